"""Python face of the C++ host Adam/AdamW kernel (``offload_zero._C``).

:func:`adam_step_` is the one entry point the engine calls on every flat shard: it checks the
tensors, then hands raw pointers to the kernel, which runs with the GIL released over
``num_threads`` threads using the best instruction set this CPU supports
(:func:`selected_isa`).

Math (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization"; Loshchilov & Hutter
2019, "Decoupled Weight Decay Regularization"), per element, with t = ``step``::

    g = grad * grad_scale
    g = g + weight_decay * param            (Adam, adamw=False: L2 penalty)
    param = param * (1 - lr * weight_decay) (AdamW, adamw=True: decoupled decay)
    exp_avg    = beta1 * exp_avg + (1 - beta1) * g          (as exp_avg.lerp_(g, 1 - beta1))
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t   (both 1 when bias_correction=False)
    param = param - (lr / bc1) * exp_avg / (sqrt(exp_avg_sq) / sqrt(bc2) + eps)

The operations and their rounding follow ``torch.optim.Adam``/``AdamW`` with
``foreach=False``, except that the denominator is scaled by sqrt(bc2) to save a division
(weights within a few ulps of torch's; csrc/adam_scalar.h, [Note: Adam math]).

The moments may be kept in bfloat16 (2 B each instead of 4: 4 B per parameter less memory and
traffic). They are then computed in fp32 and stored with stochastic rounding from a
counter-based hash of (``sr_seed``, ``step``, element index), so a step is deterministic and
the same on every instruction set and thread count (csrc/adam_scalar.h,
[Note: bf16 moments]).

The master weights may be bfloat16 too (2 B each instead of 4: 4 B per parameter less memory
and traffic again), updated in fp32 and stored with stochastic rounding under random bits of
their own, independent of the moments' (csrc/adam_scalar.h, [Note: bf16 master weights]).

Threads: the per-call ``num_threads`` wins; otherwise :func:`set_num_threads`, then the
environment variable ``OFFLOAD_ZERO_ADAM_THREADS``, then every CPU this process may run on.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from offload_zero import _C

__all__ = ["adam_step_", "selected_isa", "available_isas", "set_num_threads",
           "get_num_threads", "Q8_BLOCK_NUMEL"]

_GRAD_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_OUT_DTYPES = _GRAD_DTYPES
_STATE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.uint8: "q8"}
_PARAM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
Q8_BLOCK_NUMEL = int(_C.q8_block_numel())  # elements per absmax block of int8 moments (256)


def selected_isa() -> str:
    """Instruction set :func:`adam_step_` uses now: ``"scalar"``, ``"avx2"`` or ``"avx512"``.

    The best one the CPU and OS support, unless the environment variable
    ``OFFLOAD_ZERO_ADAM_ISA`` names one (re-read on every call).

    Raises:
        ValueError: ``OFFLOAD_ZERO_ADAM_ISA`` is not one of the three names.
        RuntimeError: ``OFFLOAD_ZERO_ADAM_ISA`` names an instruction set this CPU lacks.
    """
    return _C.selected_isa()


def set_num_threads(num_threads: Optional[int]) -> None:
    """Set the threads every later :func:`adam_step_` call uses when it gets no ``num_threads``.

    Process-wide; overrides ``OFFLOAD_ZERO_ADAM_THREADS``. ``None`` clears the setting, so the
    environment variable (or else every CPU this process may run on) applies again.

    Raises:
        ValueError: ``num_threads`` is not None or an int >= 1.
    """
    if num_threads is None:
        _C.set_num_threads(0)
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads={num_threads!r} must be None or an int >= 1")
    _C.set_num_threads(num_threads)


def get_num_threads() -> int:
    """Threads an :func:`adam_step_` call without ``num_threads`` uses now.

    Raises:
        ValueError: ``OFFLOAD_ZERO_ADAM_THREADS`` is consulted and is not a positive integer.
    """
    return int(_C.get_num_threads())


def available_isas() -> list:
    """Instruction sets this CPU and OS support, ``"scalar"`` first, best last."""
    return list(_C.available_isas())


def _check_tensor(name: str, t: torch.Tensor, numel: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device={t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} dtype {t.dtype} is not one of {allowed}")
    if t.layout != torch.strided or not t.is_contiguous():
        stride = t.stride() if t.layout == torch.strided else None
        raise ValueError(f"{name} must be a contiguous dense tensor, got layout={t.layout}, "
                         f"shape={tuple(t.shape)}, stride={stride}")
    if t.numel() != numel:
        raise ValueError(f"{name} has numel={t.numel()}, expected {numel} (param's numel)")


def _check_scalars(step, lr, betas, eps, weight_decay, grad_scale, num_threads) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step={step!r} must be an int >= 1 (the count after this update)")
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr={lr!r} must be a finite float >= 0")
    if len(betas) != 2:
        raise ValueError(f"betas={betas!r} must be a pair (beta1, beta2)")
    for i, beta in enumerate(betas):
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}]={beta!r} must be in [0, 1)")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps={eps!r} must be a finite float >= 0")
    if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay) \
            or weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be a finite float >= 0")
    if not isinstance(grad_scale, (int, float)) or not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale={grad_scale!r} must be a finite float")
    if num_threads is not None and (isinstance(num_threads, bool)
                                    or not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads={num_threads!r} must be None or an int >= 1")


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, step: int, lr: float,
               betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0, adamw: bool = True, bias_correction: bool = True,
               grad_scale: float = 1.0, out: Optional[torch.Tensor] = None,
               num_threads: Optional[int] = None, state_dtype: Optional[torch.dtype] = None,
               sr_seed: int = 0, check_overflow: bool = True, sr_offset: int = 0,
               exp_avg_absmax: Optional[torch.Tensor] = None,
               exp_avg_sq_absmax: Optional[torch.Tensor] = None) -> bool:
    """One Adam/AdamW step over flat CPU buffers, in place; returns True on overflow.

    Args:
        param: master weights, contiguous, CPU, any shape with N elements, float32 or
            bfloat16. Updated in place. bfloat16 weights (2 B per weight instead of 4) are
            widened to fp32, updated by the fp32 maths above and stored with stochastic
            rounding (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision";
            Zamirai et al. 2020, "Revisiting BFloat16 Training"): round-to-nearest would drop
            every update under half a bf16 ulp of the weight (2^-9 to 2^-8 of it: with
            lr=1e-4 a weight of 0.1 would never move); stochastic rounding keeps it on
            average. The random bits are a hash of (``sr_seed``, ``step``, element index
            counted from ``sr_offset``) under a key of their own, independent of the
            moments' bits, and the same whatever the moments' dtype, thread count or
            instruction set.
        grad: gradient, contiguous CPU tensor of N elements, float32, bfloat16 or float16.
            Read only.
        exp_avg: first moment, contiguous CPU, N elements, float32, bfloat16 or uint8 (the
            codes of blockwise 8-bit moments, see ``exp_avg_absmax``). Updated in place.
        exp_avg_sq: second moment, same dtype as ``exp_avg``. Updated in place.
        step: the step count including this update (1 on the first call), int >= 1.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; decoupled (AdamW) if ``adamw`` else an L2 term added to the
            gradient (Adam).
        adamw: AdamW (True) or Adam with L2 (False).
        bias_correction: divide the moments by 1 - beta**step (True) or not.
        grad_scale: the gradient is multiplied by this first (1/loss_scale times a clip
            coefficient); finite.
        out: None, or a contiguous CPU tensor of N elements, float32, bfloat16 or float16, that
            receives the new weight as stored in ``param`` rounded to nearest even
            (bit-identical to ``param.to(out.dtype)``: for bfloat16 weights, a bfloat16 out
            holds their bits, a float32 out their exact value), written in the same pass.
        num_threads: threads to use; None means :func:`set_num_threads`'s value, else
            ``OFFLOAD_ZERO_ADAM_THREADS``, else every CPU this process may run on. Buffers
            under ~64K elements per thread use fewer threads. The GIL is released meanwhile.
        state_dtype: None (take the moments' dtype), or the dtype the moments must have:
            ``torch.float32`` or ``torch.bfloat16``. bfloat16 moments are updated in fp32 and
            stored with stochastic rounding, not round-to-nearest-even: bf16 keeps 8
            significand bits, so RNE drops any relative change under 2^-9; with beta2=0.999,
            ``v * beta2`` is such a change and v would never decay (nor absorb small
            ``(1 - beta2) * g**2``). Stochastic rounding is unbiased, so the moments follow
            the fp32 ones on average. The random bits are a hash of (``sr_seed``, ``step``,
            element index): deterministic given the step, the same for every thread count
            and instruction set.
        sr_seed: int in [0, 2**32), the stochastic-rounding seed of the moments and of
            bfloat16 weights (use a different one per tensor for independent rounding);
            ignored for float32 moments with float32 weights.
        sr_offset: the element index the random bits count element 0 of these buffers as, an
            int >= 0 and a multiple of 64 (default 0): a call on elements [lo, hi) of a larger
            buffer with ``sr_offset=lo`` (its step, seed, all else equal) rounds them exactly
            as one call on the whole buffer would, so an update streamed in chunks gives the
            same bf16 moments and weights as one made whole. Ignored for float32 moments with
            float32 weights.
        exp_avg_absmax, exp_avg_sq_absmax: with uint8 moments only (required then): the
            fp32 absmax of each block of ``Q8_BLOCK_NUMEL`` = 256 elements of ``exp_avg`` /
            ``exp_avg_sq``, counted from element 0 (contiguous CPU tensors of ceil(N / 256)
            elements), updated in place. The moments are then decoded, updated in fp32 as
            above, and encoded again in the same pass with each block's new absmax and
            stochastic rounding keyed as for bf16 (``sr_seed``, ``step``, ``sr_offset``): the
            dynamic 8-bit map of Dettmers et al. 2021 ("8-bit Optimizers via Block-wise
            Quantization"), signed for exp_avg, unsigned for exp_avg_sq; its exact definition
            and error bound are in :mod:`offload_zero.optim.int8_moments` and csrc/adam_q8.h
            ([Note: int8 moments]). A call on part of a larger buffer must start on a block
            (elements [256 k, ...), with the absmax views from block k).
        check_overflow: True (default): read every gradient before writing anything, so an
            inf/nan leaves all state unchanged (costs one more read of the gradients, 4 B per
            fp32 gradient, ~14% of the step's traffic). False: for a caller that already knows
            ``grad * grad_scale`` is finite (e.g. from the global gradient norm it computed
            for clipping); one pass only. A non-finite gradient is still noticed, but only
            after the state was written: RuntimeError then.

    Returns:
        True when any ``grad * grad_scale`` element is inf or nan; then param, exp_avg,
        exp_avg_sq and out are left unchanged (bit for bit). False after a normal update.
        (With ``check_overflow=False``: always False, or RuntimeError.)

    Raises:
        ValueError: a tensor has the wrong type, device, dtype, layout or numel, or a scalar
            is out of range (step < 1, lr < 0, a beta outside [0, 1), eps < 0, ...); the
            message names the value. Also for a bad ``OFFLOAD_ZERO_ADAM_ISA`` /
            ``OFFLOAD_ZERO_ADAM_THREADS``.
        RuntimeError: ``OFFLOAD_ZERO_ADAM_ISA`` names an instruction set this CPU lacks, or
            ``check_overflow=False`` met a non-finite gradient (the state is then invalid).
    """
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"param must be a torch.Tensor, got {type(param).__name__}")
    numel = param.numel()
    _check_tensor("param", param, numel, tuple(_PARAM_DTYPES))
    _check_tensor("grad", grad, numel, tuple(_GRAD_DTYPES))
    _check_tensor("exp_avg", exp_avg, numel, tuple(_STATE_DTYPES))
    _check_tensor("exp_avg_sq", exp_avg_sq, numel, (exp_avg.dtype,))
    if state_dtype is not None and state_dtype != exp_avg.dtype:
        raise ValueError(f"state_dtype={state_dtype} but exp_avg/exp_avg_sq are {exp_avg.dtype}")
    if isinstance(sr_seed, bool) or not isinstance(sr_seed, int) or not 0 <= sr_seed < 2**32:
        raise ValueError(f"sr_seed={sr_seed!r} must be an int in [0, 2**32)")
    if isinstance(sr_offset, bool) or not isinstance(sr_offset, int) or sr_offset < 0 \
            or sr_offset % 64:
        raise ValueError(f"sr_offset={sr_offset!r} must be an int >= 0, a multiple of 64")
    if out is not None:
        _check_tensor("out", out, numel, tuple(_OUT_DTYPES))
    _check_scalars(step, lr, betas, eps, weight_decay, grad_scale, num_threads)
    absmax = (exp_avg_absmax, exp_avg_sq_absmax)
    if exp_avg.dtype == torch.uint8:
        blocks = -(-numel // Q8_BLOCK_NUMEL)
        for name, t in zip(("exp_avg_absmax", "exp_avg_sq_absmax"), absmax):
            if t is None:
                raise ValueError(f"{name} is required with uint8 (8-bit) moments: a float32 "
                                 f"tensor of ceil({numel} / {Q8_BLOCK_NUMEL}) = {blocks} "
                                 "elements")
            _check_tensor(name, t, blocks, (torch.float32,))
    elif any(t is not None for t in absmax):
        raise ValueError(f"exp_avg_absmax/exp_avg_sq_absmax given with {exp_avg.dtype} moments "
                         "(only uint8 moments have them)")
    return _C.adam_step(
        param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), numel,
        _GRAD_DTYPES[grad.dtype],
        0 if out is None else out.data_ptr(),
        None if out is None else _OUT_DTYPES[out.dtype],
        int(step), float(lr), float(betas[0]), float(betas[1]), float(eps),
        float(weight_decay), bool(adamw), bool(bias_correction), float(grad_scale),
        0 if num_threads is None else int(num_threads), _STATE_DTYPES[exp_avg.dtype],
        int(sr_seed), bool(check_overflow), int(sr_offset),
        *(0 if t is None else t.data_ptr() for t in absmax), _PARAM_DTYPES[param.dtype])
