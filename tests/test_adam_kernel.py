"""The C++ Adam/AdamW kernel (offload_zero.optim.adam_step_) against torch.optim, per ISA.

Every instruction set this CPU supports is forced in turn through OFFLOAD_ZERO_ADAM_ISA (read
on every call). Weights are compared element by element with torch.optim.Adam/AdamW
(foreach=False); torch's float sqrt here is not always correctly rounded (MKL VML) and the
kernel scales the denominator by sqrt(1 - beta2**t) to save a division, so the
comparison allows |ours - torch| <= 1e-6 * max(1, |w|) rather than equal bits. Everything that
does not go through torch's sqrt (bf16/fp16 conversions, grad dtypes, overflow, threads) is
compared bit for bit. The 100-step comparison runs every ISA side by side against one
reference run so the 1M-element case stays cheap; torch's own ops run on one thread.
"""
import math
import os
import threading
import time

import pytest
import torch

from offload_zero import _C
from offload_zero.optim import (adam_step_, available_isas, get_num_threads, selected_isa,
                                set_num_threads)

ISAS = available_isas()
SIZES = [0, 1, 7, 15, 16, 17, 31, 33, 1023, 1_000_003]  # SIMD widths 8 and 16 +- 1
BIG = 1_000_003



pytestmark = pytest.mark.usefixtures("torch_single_thread")

def _assert_close_to(ours: torch.Tensor, ref: torch.Tensor, what: str,
                     moment: bool = False) -> None:
    tol = 1e-6 * ref.abs().clamp(min=1.0)
    if moment and ref.numel():
        # A moment that cancelled down to a small value keeps the rounding error of the
        # largest gradients it averaged (ulps of ~1e2 here), not of its own magnitude.
        tol = tol + 1e-7 * ref.abs().max()
    bad = ~((ours - ref).abs() <= tol)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements off, first at {i}: "
                             f"ours={ours.flatten()[i].item()!r} ref={ref.flatten()[i].item()!r}")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.view(view), b.view(view))


def _grads(n: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # Scales spread over orders of magnitude so moments are not all alike.
    return [torch.randn(n, generator=gen) * (10.0 ** ((s % 5) - 2)) for s in range(steps)]


# (adamw, weight_decay, bias_correction). torch.optim has no bias_correction switch, so
# without it the reference is _reference_step (the same torch ops, op by op).
CONFIGS = [(True, 0.0, True), (True, 0.1, True), (False, 0.1, True),
           (True, 0.0, False), (True, 0.1, False), (False, 0.1, False)]
BIG_CONFIGS = [(True, 0.1, True), (False, 0.1, False)]
STEPS = 100
CHECK_STEPS = {1, 2, 10, 50, STEPS}


def _config_cases():
    for n in SIZES:
        for config in (BIG_CONFIGS if n == BIG else CONFIGS):
            yield pytest.param(n, *config, id=f"n{n}-{'adamw' if config[0] else 'adam'}"
                               f"-wd{config[1]}-bc{int(config[2])}")


@pytest.mark.parametrize("n,adamw,weight_decay,bias_correction", list(_config_cases()))
def test_matches_torch_over_100_steps(monkeypatch, n, adamw, weight_decay, bias_correction):
    """Every ISA side by side with one reference over 100 steps (one reference run, one
    gradient stream): |ours - torch| <= 1e-6 * max(1, |w|) element by element."""
    lr, betas, eps = 1e-2, (0.9, 0.999), 1e-8
    param = torch.randn(n, generator=torch.Generator().manual_seed(n))
    ref = param.clone().requires_grad_(True)
    if bias_correction:
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        opt = cls([ref], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    else:
        ref_m, ref_v = torch.zeros(n), torch.zeros(n)
    ours = {isa: (param.clone(), torch.zeros(n), torch.zeros(n)) for isa in ISAS}
    gen = torch.Generator().manual_seed(7)
    for step in range(1, STEPS + 1):
        grad = torch.randn(n, generator=gen) * (10.0 ** ((step % 5) - 2))
        if bias_correction:
            ref.grad = grad
            opt.step()
        else:
            _reference_step(ref.detach(), grad, ref_m, ref_v, step=step, lr=lr, betas=betas,
                            eps=eps, wd=weight_decay, adamw=adamw, bias_correction=False)
        for isa, (p, m, v) in ours.items():
            monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", isa)
            assert adam_step_(p, grad, m, v, step=step, lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay, adamw=adamw,
                              bias_correction=bias_correction) is False
            if step in CHECK_STEPS:
                _assert_close_to(p, ref.detach(), f"{isa} n={n} step={step}")
    if n:
        m_ref, v_ref = ((opt.state[ref]["exp_avg"], opt.state[ref]["exp_avg_sq"])
                        if bias_correction else (ref_m, ref_v))
        for isa, (_, m, v) in ours.items():
            _assert_close_to(m, m_ref, f"{isa} exp_avg", moment=True)
            _assert_close_to(v, v_ref, f"{isa} exp_avg_sq", moment=True)


def _reference_step(p, g, m, v, *, step, lr, betas, eps, wd, adamw, bias_correction):
    """Hand-written torch reference (the formula, op by op) for bias_correction on or off."""
    beta1, beta2 = betas
    if wd and adamw:
        p.mul_(1 - lr * wd)
    elif wd:
        g = g.add(p, alpha=wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


def test_small_beta1_uses_other_lerp_branch(isa):
    n = 1000
    param = torch.randn(n)
    ref = param.clone().requires_grad_(True)
    opt = torch.optim.Adam([ref], lr=1e-2, betas=(0.3, 0.5), foreach=False)
    m, v = torch.zeros(n), torch.zeros(n)
    for step, grad in enumerate(_grads(n, 20, seed=5), start=1):
        ref.grad = grad.clone()
        opt.step()
        adam_step_(param, grad, m, v, step=step, lr=1e-2, betas=(0.3, 0.5), adamw=False)
    _assert_close_to(param, ref.detach(), "betas=(0.3, 0.5)")


@pytest.mark.parametrize("n", [1, 17, 33, 1023, 300_007])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_copy_bits_equal_torch_conversion(isa, n, out_dtype):
    param, m, v = torch.randn(n) * 100, torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    for step, grad in enumerate(_grads(n, 3, seed=11), start=1):
        adam_step_(param, grad, m, v, step=step, lr=1e-1, out=out)
        assert _bits_equal(out, param.to(out_dtype)), f"{isa} {out_dtype} step {step}"


def _special_floats(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, 1e-45,
                             65504.0, 65519.99, 65520.0, 3.4e38, 6.0e-8, 2.98e-8, 2.9802322e-8,
                             1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11])
    x[:len(specials)] = specials
    # Exact bf16/fp16 rounding ties and their neighbours.
    ties = (torch.arange(4096, dtype=torch.int32) << 15) | 0x8000
    x[100:100 + 4096] = ties.view(torch.float32)
    x[5000:5000 + 4096] = (ties + 1).view(torch.float32)
    return x


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_conversion_of_special_values(isa, out_dtype):
    """lr=0 and zero gradients keep the weights, so out must be exactly param.to(dtype)
    for NaN payloads, infinities, denormals, overflow to inf and rounding ties."""
    n = 200_003
    param = _special_floats(n)
    m, v, grad = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    assert not adam_step_(param, grad, m, v, step=1, lr=0.0, out=out)
    ref = param.to(out_dtype)
    diff = (out.view(torch.int16) != ref.view(torch.int16)).nonzero().flatten()
    assert diff.numel() == 0, (
        f"{isa} {out_dtype}: {diff.numel()} differ, first x={param[diff[0]].item()!r} "
        f"(bits {param.view(torch.int32)[diff[0]].item() & 0xffffffff:#010x}) "
        f"ours={out.view(torch.int16)[diff[0]].item() & 0xffff:#06x} "
        f"torch={ref.view(torch.int16)[diff[0]].item() & 0xffff:#06x}")


@pytest.mark.parametrize("n", [1, 17, 1023, 100_003])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads_equal_float_grads(isa, n, grad_dtype):
    p1 = torch.randn(n)
    p2, m1, v1, m2, v2 = p1.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for step, grad in enumerate(_grads(n, 4, seed=2), start=1):
        low = grad.to(grad_dtype)
        adam_step_(p1, low, m1, v1, step=step, lr=1e-2, weight_decay=0.01, grad_scale=0.5)
        adam_step_(p2, low.float(), m2, v2, step=step, lr=1e-2, weight_decay=0.01, grad_scale=0.5)
    assert _bits_equal(p1, p2) and _bits_equal(m1, m2) and _bits_equal(v1, v2)


@pytest.mark.parametrize("n", [1, 16, 17, 1023, 200_003])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_overflow_leaves_everything_unchanged(isa, n, bad, grad_dtype):
    param, m, v = torch.randn(n), torch.rand(n), torch.rand(n)
    out = torch.full((n,), 7.0, dtype=torch.bfloat16)
    before = [t.clone() for t in (param, m, v, out)]
    for where in sorted({0, n // 2, n - 1}):
        grad = torch.randn(n).to(grad_dtype)
        grad[where] = bad
        assert adam_step_(param, grad, m, v, step=3, lr=1e-2, weight_decay=0.1, out=out) is True
        for now, then in zip((param, m, v, out), before):
            assert _bits_equal(now, then), f"changed after overflow at {where}"


def test_overflow_found_in_every_stream_of_the_check(isa):
    """The check reads 4 interleaved sub-ranges plus a tail: a lone nan at each boundary."""
    n = 4099  # 4 streams of 1024 (avx512: 64 vectors; avx2: 128), tail 4096..4098
    for where in (0, 1023, 1024, 2047, 2048, 3071, 3072, 4095, 4096, 4098):
        param, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
        p0 = param.clone()
        grad = torch.randn(n)
        grad[where] = math.nan
        assert adam_step_(param, grad, m, v, step=1, lr=1e-2, num_threads=1) is True, where
        assert _bits_equal(param, p0), where


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_without_overflow_check_same_bits(isa, state_dtype, param_dtype):
    n = 100_003
    runs = []
    for check in (True, False):
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(n, generator=gen).to(param_dtype)
        m, v = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step, grad in enumerate(_grads(n, 3, seed=8), start=1):
            assert adam_step_(p, grad, m, v, step=step, lr=1e-2, weight_decay=0.1, out=out,
                              grad_scale=0.5, check_overflow=check) is False
        runs.append((p, m, v, out))
    assert all(_bits_equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_without_overflow_check_nonfinite_raises(isa, grad_dtype):
    """The update still sees the inf/nan (in registers) and says the state is now invalid."""
    n = 200_003
    for where in (0, 100_000, n - 1):
        grad = torch.randn(n).to(grad_dtype)
        grad[where] = math.nan if where else math.inf
        with pytest.raises(RuntimeError, match="check_overflow=False met an inf/nan"):
            adam_step_(torch.randn(n), grad, torch.zeros(n), torch.zeros(n), step=1, lr=1e-2,
                       check_overflow=False)


def test_overflow_from_grad_scale(isa):
    n = 1000
    grad = torch.full((n,), 3e38)
    param, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    p0 = param.clone()
    assert adam_step_(param, grad, m, v, step=1, lr=1e-3, grad_scale=10.0) is True
    assert _bits_equal(param, p0)
    assert adam_step_(param, grad, m, v, step=1, lr=1e-3, grad_scale=0.1) is False


@pytest.mark.parametrize("n", [17, 1023, 100_003])
def test_grad_scale_equals_scaling_first(isa, n):
    scale = 1.0 / 1024 * 0.37
    p1, m1, v1 = torch.randn(n), torch.zeros(n), torch.zeros(n)
    ref = p1.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    p2, m2, v2 = p1.clone(), torch.zeros(n), torch.zeros(n)
    for step, grad in enumerate(_grads(n, 10, seed=4), start=1):
        scaled = grad * 1024
        adam_step_(p1, scaled, m1, v1, step=step, lr=1e-2, weight_decay=0.1, grad_scale=scale)
        pre = scaled * torch.tensor(scale, dtype=torch.float32)
        adam_step_(p2, pre, m2, v2, step=step, lr=1e-2, weight_decay=0.1)
        ref.grad = pre.clone()
        opt.step()
    assert _bits_equal(p1, p2) and _bits_equal(m1, m2) and _bits_equal(v1, v2)
    _assert_close_to(p1, ref.detach(), "grad_scale vs torch")


def test_thread_counts_give_identical_bits(isa):
    n = 1_000_003
    results = []
    for threads in (1, 2, 5):
        gen = torch.Generator().manual_seed(0)
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v, out = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
        adam_step_(p, g, m, v, step=1, lr=1e-2, out=out, num_threads=threads)
        results.append((p, m, v, out))
    for other in results[1:]:
        assert all(_bits_equal(a, b) for a, b in zip(results[0], other))


def test_unaligned_views(isa):
    """Buffers that start off a 64-byte boundary still update correctly (no aligned stores)."""
    n = 300_001
    base = [torch.randn(n + 3) for _ in range(2)] + [torch.zeros(n + 3) for _ in range(2)]
    p, g, m, v = (t[1:n + 1] for t in base)
    out = torch.empty(n + 5, dtype=torch.bfloat16)[3:n + 3]
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    adam_step_(p, g, m, v, step=1, lr=1e-2, out=out)
    adam_step_(p_ref, g.clone(), m_ref, v_ref, step=1, lr=1e-2)
    assert _bits_equal(p, p_ref) and _bits_equal(out, p_ref.to(torch.bfloat16))


# ---------------------------------------------------------------------------- bf16 moments

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x):
    """MurmurHash3's 32-bit finalizer on a Python int or an int64 tensor of uint32 values."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & _M32
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & _M32
        return x ^ (x >> 16)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _sr_bits(seed: int, step: int, n: int, offset: int = 0,
             weights: bool = False) -> torch.Tensor:
    """The kernel's 32 random bits per element (csrc/adam_scalar.h, [Note: bf16 moments]),
    elements counted from ``offset`` (``sr_offset``); ``weights``: those of bf16 master weights,
    under their own key ([Note: bf16 master weights])."""
    key = _fmix32((_fmix32(seed) + step) & _M32)
    if weights:
        key = _fmix32(key ^ 0x2545F491)
    i = torch.arange(n, dtype=torch.int64) + offset
    hi = key ^ _mul32(i >> 32, 0x9E3779B9)
    return _fmix32(((i & _M32) + hi) & _M32)


def _to_bf16_sr(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by stochastic rounding: the top half of bits(x) + r16; NaN -> 0xFFFF."""
    u = x.view(torch.int32).to(torch.int64) & _M32
    top = ((u + r16) >> 16) & 0xFFFF
    top = torch.where(x.isnan(), torch.full_like(top, 0xFFFF), top)
    return ((top ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)


def test_sr_reference_rounds_to_a_neighbour_and_is_unbiased():
    """The test's own reference: each value lands on one of its two bf16 neighbours, and the
    mean over many draws is the fp32 value."""
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # a quarter of a bf16 ulp above 1.0
    r = _sr_bits(3, 1, x.numel())
    y = _to_bf16_sr(x, r & 0xFFFF).float()
    assert set(y.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(y.double().mean().item() - (1.0 + 2 ** -10)) < 2e-5


def _bf16_reference_step(p, g, m_in, v_in, *, seed, step, offset=0, **kw):
    """torch ops in fp32 from the weights and moments (each fp32 or bf16), then the kernel's
    stochastic rounding of each bf16 one: p is updated in place, the new moments returned."""
    p32 = p.float()  # (p itself when fp32)
    m, v = m_in.float().clone(), v_in.float().clone()
    _reference_step(p32, g, m, v, step=step, **kw)
    if p.dtype == torch.bfloat16:
        p.copy_(_to_bf16_sr(p32, _sr_bits(seed, step, p.numel(), offset, weights=True) & 0xFFFF))
    if m_in.dtype != torch.bfloat16:
        return m, v
    r = _sr_bits(seed, step, p.numel(), offset)
    return _to_bf16_sr(m, r & 0xFFFF), _to_bf16_sr(v, r >> 16)


def _assert_within_one_bf16_ulp(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Equal, or (where torch's fp32 op differed by an ulp before rounding) one bf16 step."""
    a, b = ours.view(torch.int16).int(), ref.view(torch.int16).int()
    off = (a - b).abs()
    assert int(off.max()) <= 1 if off.numel() else True, f"{what}: off by {int(off.max())} ulps"
    assert int((off != 0).sum()) <= max(2, off.numel() // 1000), \
        f"{what}: {int((off != 0).sum())} of {off.numel()} differ"


@pytest.mark.parametrize("n", [1, 17, 1023, 100_003])
@pytest.mark.parametrize("adamw,weight_decay,bias_correction",
                         [(True, 0.1, True), (False, 0.1, False)])
def test_bf16_moments_match_torch_reference(isa, n, adamw, weight_decay, bias_correction):
    """Each step from the kernel's own state (so rounding differences cannot compound): torch
    in fp32 on the bf16 moments plus the same stochastic rounding gives the same moments, and
    the weights agree as for fp32 moments."""
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    seed = 12345
    param = torch.randn(n, generator=torch.Generator().manual_seed(n))
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    for step, grad in enumerate(_grads(n, 20, seed=6), start=1):
        p_ref = param.clone()
        m_ref, v_ref = _bf16_reference_step(p_ref, grad, m, v, seed=seed, step=step,
                                            wd=weight_decay, adamw=adamw,
                                            bias_correction=bias_correction, **kw)
        assert not adam_step_(param, grad, m, v, step=step, weight_decay=weight_decay,
                              adamw=adamw, bias_correction=bias_correction, sr_seed=seed,
                              state_dtype=torch.bfloat16, **kw)
        _assert_close_to(param, p_ref, f"{isa} n={n} step={step} param")
        _assert_within_one_bf16_ulp(m, m_ref, f"{isa} n={n} step={step} exp_avg")
        _assert_within_one_bf16_ulp(v, v_ref, f"{isa} n={n} step={step} exp_avg_sq")


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1_000_003])
@pytest.mark.parametrize("offset", [0, 2 ** 32 - 128])
def test_bf16_moments_element_by_element(isa, n, offset, torch_single_thread):
    """Sizes around the vector widths and a large prime, elements counted from ``sr_offset``
    (one that crosses 2**32 inside the buffer: the counter's upper bits): every weight agrees
    with torch's fp32 ops as for fp32 moments, every moment with the reference's stochastic
    rounding of torch's fp32 moment (or one bf16 step off where torch's op differs by an ulp)."""
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.1, adamw=True, bias_correction=True)
    param = torch.randn(n, generator=torch.Generator().manual_seed(n))
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    for step, grad in enumerate(_grads(n, 3, seed=4), start=1):
        p_ref = param.clone()
        m_ref, v_ref = _bf16_reference_step(p_ref, grad, m, v, seed=99, step=step,
                                            offset=offset, **kw)
        assert not adam_step_(param, grad, m, v, step=step, lr=kw["lr"], betas=kw["betas"],
                              eps=kw["eps"], weight_decay=kw["wd"], sr_seed=99,
                              sr_offset=offset, state_dtype=torch.bfloat16)
        _assert_close_to(param, p_ref, f"{isa} n={n} step={step} param")
        _assert_within_one_bf16_ulp(m, m_ref, f"{isa} n={n} step={step} exp_avg")
        _assert_within_one_bf16_ulp(v, v_ref, f"{isa} n={n} step={step} exp_avg_sq")


@pytest.mark.parametrize("n", [4096, 100_003])
def test_bf16_moments_in_pieces_equal_one_call(isa, n):
    """Elements [lo, hi) updated by a call of their own with ``sr_offset=lo`` get the bits one
    call on the whole buffer gives them (an update streamed in chunks equals a whole one)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    whole = [p.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    parts = [t.clone() for t in whole]
    cuts = [0, 64, 1024, 3072, n]
    for step in (1, 2):
        adam_step_(*whole[:1], g, *whole[1:], step=step, lr=1e-2, sr_seed=3)
        for lo, hi in zip(cuts, cuts[1:]):
            adam_step_(parts[0][lo:hi], g[lo:hi], parts[1][lo:hi], parts[2][lo:hi], step=step,
                       lr=1e-2, sr_seed=3, sr_offset=lo)
    assert all(_bits_equal(a, b) for a, b in zip(whole, parts))


def test_bf16_moments_deterministic_and_seeded(isa):
    n = 100_003
    runs = []
    for seed, threads in ((1, 1), (1, 3), (2, 1)):
        p, g = torch.randn(n, generator=torch.Generator().manual_seed(0)), torch.randn(n)
        m = torch.zeros(n, dtype=torch.bfloat16)
        v = torch.zeros(n, dtype=torch.bfloat16)
        g = torch.randn(n, generator=torch.Generator().manual_seed(1))
        for step in (1, 2):
            adam_step_(p, g, m, v, step=step, lr=1e-2, sr_seed=seed, num_threads=threads)
        runs.append((p, m, v))
    assert all(_bits_equal(a, b) for a, b in zip(runs[0], runs[1]))  # thread split: same bits
    assert not _bits_equal(runs[0][1], runs[2][1])                     # another seed: not


@pytest.mark.parametrize("n", [17, 200_003])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_overflow_leaves_bf16_moments_unchanged(isa, n, bad):
    param = torch.randn(n)
    m, v = torch.randn(n).to(torch.bfloat16), torch.rand(n).to(torch.bfloat16)
    out = torch.full((n,), 7.0, dtype=torch.bfloat16)
    before = [t.clone() for t in (param, m, v, out)]
    grad = torch.randn(n).to(torch.bfloat16)
    grad[n - 1] = bad
    assert adam_step_(param, grad, m, v, step=3, lr=1e-2, weight_decay=0.1, out=out) is True
    assert all(_bits_equal(a, b) for a, b in zip((param, m, v, out), before))


def test_bf16_moments_train_like_fp32_moments():
    """A small least-squares problem: bf16 moments (stochastic rounding) reach the loss fp32
    moments reach; round-to-nearest-even moments (emulated) are shown to stall v."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen)
    w_true = torch.randn(64, 16, generator=gen)
    y = x @ w_true + 0.01 * torch.randn(512, 16, generator=gen)
    w0 = torch.zeros(64, 16)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = w0.clone()
        m, v = torch.zeros(w.shape, dtype=dtype), torch.zeros(w.shape, dtype=dtype)
        for step in range(1, 401):
            grad = 2.0 / len(x) * x.t() @ (x @ w - y)
            adam_step_(w, grad, m, v, step=step, lr=2e-2, num_threads=1)
        losses[dtype] = float(((x @ w - y) ** 2).mean())
    start = float((y ** 2).mean())
    assert losses[torch.float32] < 1e-2 * start
    assert losses[torch.bfloat16] < 1e-2 * start
    assert losses[torch.bfloat16] < 3 * losses[torch.float32] + 1e-4, losses
    # Why not RNE: v * 0.999 is within half a bf16 ulp of v, so RNE never lets v decay.
    v = torch.tensor([1.0, 0.37, 123.0]).to(torch.bfloat16)
    assert torch.equal((v.float() * 0.999).to(torch.bfloat16), v)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_isas_agree_bit_for_bit(monkeypatch, state_dtype, param_dtype):
    n = 100_003
    outs = {}
    for name in ISAS:
        monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", name)
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(n, generator=gen).to(param_dtype)
        m, v = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step, grad in enumerate(_grads(n, 3, seed=9), start=1):
            adam_step_(p, grad.to(torch.float16), m, v, step=step, lr=1e-2, weight_decay=0.1,
                       adamw=False, grad_scale=0.75, sr_seed=7, out=out)
        outs[name] = (p, m, v, out)
    for name in ISAS[1:]:
        assert all(_bits_equal(a, b) for a, b in zip(outs[ISAS[0]], outs[name])), name


# ---------------------------------------------------------------------------- bad input


def _ok_args(n=8):
    return [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)]


@pytest.mark.parametrize("index,bad,match", [
    (0, torch.zeros(8, dtype=torch.float64), "param dtype torch.float64"),
    (1, torch.zeros(8, dtype=torch.int32), "grad dtype torch.int32"),
    (1, torch.zeros(9), "grad has numel=9"),
    (2, torch.zeros(4, 4)[:, :2], "exp_avg must be a contiguous"),
    (3, torch.zeros(8, device="meta"), "exp_avg_sq must be on the CPU"),
    (3, torch.zeros(8, dtype=torch.bfloat16), "exp_avg_sq dtype torch.bfloat16"),
    (0, torch.zeros(8, dtype=torch.float16),
     "param dtype torch.float16 is not one of torch.float32, torch.bfloat16"),
    (2, torch.zeros(8, dtype=torch.float16), "exp_avg dtype torch.float16"),
])
def test_bad_tensors_raise(index, bad, match):
    args = _ok_args()
    args[index] = bad
    if index == 2:
        args = [torch.zeros(8)] * 2 + [bad, torch.zeros(8)]
    with pytest.raises(ValueError, match=match):
        adam_step_(*args, step=1, lr=1e-3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(step=0), "step=0"),
    (dict(step=1.0), "step=1.0"),
    (dict(lr=-1.0), "lr=-1.0"),
    (dict(lr=math.nan), "lr=nan"),
    (dict(betas=(1.0, 0.999)), r"betas\[0\]=1.0"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\]=-0.1"),
    (dict(eps=-1e-8), "eps=-1e-08"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1"),
    (dict(grad_scale=math.inf), "grad_scale=inf"),
    (dict(num_threads=0), "num_threads=0"),
    (dict(state_dtype=torch.bfloat16), "state_dtype=torch.bfloat16 but"),
    (dict(sr_seed=-1), "sr_seed=-1"),
    (dict(sr_seed=2**32), "sr_seed=4294967296"),
    (dict(sr_offset=32), "sr_offset=32"),
    (dict(sr_offset=-64), "sr_offset=-64"),
    (dict(out=torch.zeros(8, dtype=torch.int8)), "out dtype torch.int8"),
    (dict(out=torch.zeros(7)), "out has numel=7"),
])
def test_bad_scalars_raise(kwargs, match):
    full = dict(step=1, lr=1e-3)
    full.update(kwargs)
    with pytest.raises(ValueError, match=match):
        adam_step_(*_ok_args(), **full)


def test_binding_rejects_bad_pointers_and_sizes():
    p = torch.zeros(4)
    ptr = p.data_ptr()
    base = dict(param_ptr=ptr, grad_ptr=ptr, exp_avg_ptr=ptr, exp_avg_sq_ptr=ptr, numel=4,
                grad_dtype="float32", out_ptr=0, out_dtype=None, step=1, lr=1e-3, beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, bias_correction=True,
                grad_scale=1.0, num_threads=1)
    for change, match in [(dict(param_dtype="float16"),
                           "param dtype 'float16' is not one of float32, bfloat16"),
                          (dict(param_dtype="q8"), "param dtype 'q8'"),
                          (dict(param_dtype="bfloat16", param_ptr=ptr + 1),
                           "param pointer .* not aligned to its element size 2"),
                          (dict(param_ptr=ptr + 2), "param pointer .* element size 4"),
                          (dict(grad_ptr=0), "grad pointer is null"),
                          (dict(numel=-1), "numel=-1"),
                          (dict(grad_dtype="float64"), "grad dtype 'float64'"),
                          (dict(out_dtype="int8", out_ptr=ptr), "out dtype 'int8'"),
                          (dict(out_dtype="float16"), "out pointer is null"),
                          (dict(out_ptr=ptr), "given without an out dtype"),
                          (dict(exp_avg_ptr=ptr + 1), "not aligned"),
                          (dict(beta2=1.0), "beta2=1"),
                          (dict(state_dtype="float16"), "state dtype 'float16'"),
                          (dict(sr_seed=-1), "sr_seed=-1"),
                          (dict(sr_offset=100), "sr_offset=100"),
                          (dict(step=0), "step=0")]:
        with pytest.raises(ValueError, match=match):
            _C.adam_step(**{**base, **change})
    # numel == 0 accepts null pointers and does nothing; bf16 weights need 2-byte alignment.
    assert _C.adam_step(**{**base, "numel": 0, "param_ptr": 0, "grad_ptr": 0}) is False
    assert _C.adam_step(**{**base, "param_dtype": "bfloat16", "param_ptr": ptr + 2}) is False


def test_forced_isa_errors(monkeypatch):
    monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", "sse9")
    with pytest.raises(ValueError, match="sse9"):
        selected_isa()
    with pytest.raises(ValueError, match="sse9"):
        adam_step_(*_ok_args(), step=1, lr=1e-3)
    missing = [name for name in ("avx2", "avx512") if name not in ISAS]
    for name in missing:
        monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", name)
        with pytest.raises(RuntimeError, match=f"'{name}' is not supported"):
            selected_isa()


def test_bad_thread_env(monkeypatch):
    monkeypatch.setenv("OFFLOAD_ZERO_ADAM_THREADS", "two")
    with pytest.raises(ValueError, match="OFFLOAD_ZERO_ADAM_THREADS='two'"):
        adam_step_(*_ok_args(), step=1, lr=1e-3)
    # An explicit num_threads does not consult the variable.
    assert adam_step_(*_ok_args(), step=1, lr=1e-3, num_threads=1) is False


# ---------------------------------------------------------------------------- threads, GIL


def test_set_num_threads_overrides_env_and_clears(monkeypatch):
    monkeypatch.delenv("OFFLOAD_ZERO_ADAM_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    try:
        assert get_num_threads() == cpus
        monkeypatch.setenv("OFFLOAD_ZERO_ADAM_THREADS", "3")
        assert get_num_threads() == 3
        set_num_threads(5)
        assert get_num_threads() == 5  # the setting wins over the variable
        assert adam_step_(*_ok_args(), step=1, lr=1e-3) is False
        set_num_threads(None)
        assert get_num_threads() == 3
        monkeypatch.delenv("OFFLOAD_ZERO_ADAM_THREADS")
        assert get_num_threads() == cpus
    finally:
        set_num_threads(None)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_set_num_threads_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="num_threads="):
        set_num_threads(bad)
    assert get_num_threads() >= 1


def test_thread_setting_gives_identical_bits():
    n = 300_007
    results = []
    try:
        for threads in (1, 3):
            set_num_threads(threads)
            gen = torch.Generator().manual_seed(0)
            p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
            m, v = torch.zeros(n), torch.zeros(n)
            adam_step_(p, g, m, v, step=1, lr=1e-2)
            results.append((p, m, v))
    finally:
        set_num_threads(None)
    assert all(_bits_equal(a, b) for a, b in zip(*results))


def test_concurrent_callers_share_the_pool():
    """Two Python threads stepping different buffers at once (the GIL is released, the pool
    runs one job at a time) get the bits they get one after the other."""
    n = 300_007

    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                torch.zeros(n), torch.zeros(n)]

    def steps(bufs, threads):
        for step in range(1, 6):
            adam_step_(*bufs, step=step, lr=1e-2, weight_decay=0.1, num_threads=threads)

    alone = [make(1), make(2)]
    steps(alone[0], 2)
    steps(alone[1], 3)
    together = [make(1), make(2)]
    workers = [threading.Thread(target=steps, args=(together[0], 2)),
               threading.Thread(target=steps, args=(together[1], 3))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for a, b in zip(alone, together):
        assert all(_bits_equal(x, y) for x, y in zip(a, b))


def test_pool_works_in_a_forked_child():
    """After fork() the child has no pool workers; it must get a fresh pool, not hang."""
    n = 300_007
    adam_step_(torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n), step=1, lr=1e-3,
               num_threads=2)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # child: exit status says whether two-thread steps still work
        ok = False
        try:
            p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
            for step in (1, 2):
                adam_step_(p, torch.ones(n), m, v, step=step, lr=1e-3, num_threads=2)
            ok = bool((p < 0).all())
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("adam_step_ hung in a forked child")


def test_gil_is_released_during_the_update():
    """A Python thread keeps running while another thread is inside a long adam_step_ call.
    Were the GIL held, the ticking thread would stop for a whole call; allow it pauses of up
    to 60% of the shortest call (the scheduler of a busy 2-CPU machine pauses it too)."""
    n = 12_000_000
    p, g, m, v = torch.zeros(n), torch.full((n,), 1e-3), torch.zeros(n), torch.zeros(n)
    calls = []

    def update():
        for step in (1, 2):
            t0 = time.perf_counter()
            adam_step_(p, g, m, v, step=step, lr=1e-3, num_threads=1)
            calls.append((t0, time.perf_counter()))

    ticks = []
    worker = threading.Thread(target=update)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    shortest = min(end - start for start, end in calls)
    assert shortest > 0.01, f"a call took {shortest * 1e3:.1f} ms: too short to tell"
    for start, end in calls:
        inside = [start] + [t for t in ticks if start <= t <= end] + [end]
        gap = max(b - a for a, b in zip(inside, inside[1:]))
        assert gap < 0.6 * shortest, (
            f"the Python thread paused {gap * 1e3:.1f} ms during a {(end - start) * 1e3:.1f} ms "
            "adam_step_ call: the GIL was held")
