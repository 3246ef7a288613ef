"""Blockwise 8-bit Adam moments (``moment_dtype="int8"``): the format's Python face.

Each moment is one uint8 code per element plus one fp32 absmax per block of
:data:`BLOCK_NUMEL` = 256 elements; an element's value is ``absmax * value[code]`` with
``value`` a dynamic map in the manner of 8-bit Adam (Dettmers, Lewis, Shleifer & Zettlemoyer
2021, "8-bit Optimizers via Block-wise Quantization": dynamic tree quantisation), signed for
exp_avg, unsigned for exp_avg_sq. The exact variant, in short (csrc/adam_q8.h,
[Note: int8 moments], has it in full): a magnitude code c >= 1 of N bits (N = 7 plus a sign
bit for exp_avg, N = 8 for exp_avg_sq) with k = floor(log2 c) and f = c - 2^k stands for

    value(c) = 10^-(N-1-k) * (0.1 + 0.9 * (f + 1) / 2^k),        value(0) = 0,

so the codes increase with their value, the top code is exactly 1, and the smallest non-zero
value is 1e-6 (exp_avg) or 1e-7 (exp_avg_sq). The update (:func:`offload_zero.optim.adam_step_`
with uint8 moments) decodes, updates in fp32 and encodes again in one pass, rounding
stochastically (unbiased; a bf16-like stall otherwise: ``v * beta2`` moves v by less than half
a code step); :func:`quantize_` rounds to nearest, so decoding and encoding again gives the
same codes and absmax.

Round-trip error of :func:`quantize_` to nearest, per element x of a block of absmax A and
r = |x| / A in decade z = N-1-k (10^-(z+1) <= r <= 10^-z): ``|x - decoded| <= A * (s / 2 +
2^-21)`` with s = 0.9 * 10^-z / 2^k the spacing of the codes there (1.4% of A in the top
decade); below the smallest value s is that value, and a positive exp_avg_sq never encodes
to 0 (error then <= A * 1e-7). Stochastic rounding: ``< A * (s + 2^-21)``.

Bytes: 1 per element per moment and 4 per block per moment: 2 + 8/256 = 2.03125 bytes per
element for both (8 with fp32 moments, 4 with bf16); with the fp32 master 6.03125 (see
:class:`offload_zero.memory.state_format.StateFormat`).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from offload_zero import _C
from offload_zero.optim.kernel import Q8_BLOCK_NUMEL, _check_tensor, adam_step_

__all__ = ["BLOCK_NUMEL", "values", "blocks", "quantize_", "dequantize", "adam_step_runs_"]

BLOCK_NUMEL = Q8_BLOCK_NUMEL


def blocks(numel: int) -> int:
    """Absmax blocks of a moment of ``numel`` elements: ceil(numel / 256)."""
    return -(-int(numel) // BLOCK_NUMEL)


def values(signed: bool) -> torch.Tensor:
    """The 256 decoded values of a map, fp32 shape (256,), indexed by code: exp_avg's signed map
    (``signed=True``: code = sign << 7 | magnitude) or exp_avg_sq's unsigned one."""
    return torch.tensor(_C.q8_values(bool(signed)), dtype=torch.float32)


def _check_codes(codes: torch.Tensor, absmax: torch.Tensor, numel: int) -> None:
    _check_tensor("codes", codes, numel, (torch.uint8,))
    _check_tensor("absmax", absmax, blocks(numel), (torch.float32,))


def quantize_(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool,
              stochastic: bool = False, sr_seed: int = 0, step: int = 1,
              sr_offset: int = 0) -> None:
    """Encode fp32 ``x`` (contiguous CPU, N elements) into ``codes`` (uint8, N) and ``absmax``
    (fp32, ceil(N / 256)), in place: each block's absmax is its largest |x|, each code the
    nearest (``stochastic=False``) or a stochastically rounded one, keyed exactly as the update
    keys it (``sr_seed``, ``step``, element index counted from ``sr_offset``, a multiple of 64).

    Raises:
        ValueError: a tensor has the wrong dtype, device, layout or numel, or ``sr_seed``,
            ``step`` or ``sr_offset`` is out of range (the message names the value).
    """
    _check_tensor("x", x, x.numel(), (torch.float32,))
    _check_codes(codes, absmax, x.numel())
    _C.q8_quantize(x.data_ptr(), x.numel(), codes.data_ptr(), absmax.data_ptr(), bool(signed),
                   bool(stochastic), int(sr_seed), int(step), int(sr_offset))


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode: ``absmax[i // 256] * values(signed)[codes[i]]`` as fp32 of shape (N,) (into
    ``out``, contiguous fp32 CPU of N elements, when given). Raises ValueError for a wrong
    dtype, device, layout or numel."""
    n = codes.numel()
    _check_codes(codes, absmax, n)
    out = torch.empty(n, dtype=torch.float32) if out is None else out
    _check_tensor("out", out, n, (torch.float32,))
    _C.q8_dequantize(codes.data_ptr(), absmax.data_ptr(), n, out.data_ptr(), bool(signed))
    return out


def _all_finite(grad: torch.Tensor, grad_scale: float) -> bool:
    return bool(torch.isfinite(grad.float() * grad_scale).all())


def adam_step_runs_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, exp_avg_absmax: torch.Tensor,
                    exp_avg_sq_absmax: torch.Tensor, runs: Sequence[Tuple[int, int, object]],
                    *, step: int, adamw: bool = True, grad_scale: float = 1.0,
                    out: Optional[torch.Tensor] = None, check_overflow: bool = True,
                    sr_seed: int = 0, sr_offset: int = 0) -> bool:
    """One Adam/AdamW step over buffers of N elements with int8 moments whose runs
    ``[(lo, hi, hp)]`` (covering [0, N) in order) each have their own hyperparameters ``hp``
    (``.lr``, ``.betas``, ``.eps``, ``.weight_decay``: a parameter group's); returns True on
    overflow (nothing written).

    The blocks of 256 elements inside one run go through the fused kernel; a block that two or
    more runs share is decoded, updated run by run by the fp32 kernel and encoded again with
    the same stochastic rounding: the codes are those one fused pass with per-element
    hyperparameters would give, wherever the runs are cut. ``sr_offset``: the place of element
    0 in the whole flat parameter (a multiple of 256, so the blocks are the same however a
    state is chunked). ``master`` may be bfloat16 ([Note: bf16 master weights] in
    csrc/adam_scalar.h): in a block shared by runs its rounding is keyed as the chunked update
    keys a run's pieces (see :func:`_mixed_block`). Other arguments and errors as
    :func:`offload_zero.optim.adam_step_`.
    """
    n = master.numel()
    if sr_offset % BLOCK_NUMEL:
        raise ValueError(f"sr_offset={sr_offset} must be a multiple of {BLOCK_NUMEL} (a block)")
    inside = {edge for a, b, _ in runs for edge in (a, b) if 0 < edge < n and edge % BLOCK_NUMEL}
    if len(runs) > 1 and check_overflow:
        if not _all_finite(grad, grad_scale):
            return True
        check_overflow = False
    common = dict(step=step, adamw=adamw, grad_scale=grad_scale, check_overflow=check_overflow)
    mixed = {edge // BLOCK_NUMEL for edge in inside}
    overflow = False
    for a, b, hp in runs:
        lo = -(-a // BLOCK_NUMEL) * BLOCK_NUMEL
        hi = b if b == n else b // BLOCK_NUMEL * BLOCK_NUMEL
        if lo >= hi:
            continue
        k0, k1 = lo // BLOCK_NUMEL, blocks(hi)
        overflow |= adam_step_(
            master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], lr=hp.lr,
            betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
            out=None if out is None else out[lo:hi], sr_seed=sr_seed, sr_offset=sr_offset + lo,
            exp_avg_absmax=exp_avg_absmax[k0:k1], exp_avg_sq_absmax=exp_avg_sq_absmax[k0:k1],
            **common)
    for k in sorted(mixed):
        _mixed_block(k, master, grad, (exp_avg, exp_avg_sq), (exp_avg_absmax, exp_avg_sq_absmax),
                     runs, out, sr_seed, sr_offset, common)
    return overflow


def _mixed_block(k, master, grad, codes, absmax, runs, out, sr_seed, sr_offset, common) -> None:
    """Block ``k``, shared by several runs: decode, the fp32 kernel per run, encode. A bf16
    master's rounding is keyed by the place in the flat parameter of each run's pieces
    (:func:`offload_zero.update.adam.sr_pieces`), so it too is the same however a state is
    chunked."""
    from offload_zero.update.adam import sr_pieces
    s, e = k * BLOCK_NUMEL, min(master.numel(), (k + 1) * BLOCK_NUMEL)
    moments = [dequantize(c[s:e], a[k:k + 1], signed=signed)
               for c, a, signed in zip(codes, absmax, (True, False))]
    for a, b, hp in runs:
        lo, hi = max(a, s), min(b, e)
        for p0, p1, key in (sr_pieces(lo, hi, sr_offset) if lo < hi else ()):
            adam_step_(master[p0:p1], grad[p0:p1], moments[0][p0 - s:p1 - s],
                       moments[1][p0 - s:p1 - s], lr=hp.lr, betas=hp.betas, eps=hp.eps,
                       weight_decay=hp.weight_decay, out=None if out is None else out[p0:p1],
                       sr_seed=sr_seed, sr_offset=key, **{**common, "check_overflow": False})
    for x, c, a, signed in zip(moments, codes, absmax, (True, False)):
        quantize_(x, c[s:e], a[k:k + 1], signed=signed, stochastic=True, sr_seed=sr_seed,
                  step=common["step"], sr_offset=sr_offset + s)
