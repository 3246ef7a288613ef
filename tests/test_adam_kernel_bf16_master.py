"""bf16 master weights in the C++ Adam/AdamW kernel (``adam_step_`` with a bfloat16 ``param``):
each weight widened to fp32, updated by the fp32 maths and stored with stochastic rounding
under a key of its own ([Note: bf16 master weights] in csrc/adam_scalar.h), per ISA: against
the reference of test_adam_kernel.py bit for bit, unbiased, independent of the moments' bits,
the same across pieces, threads and instruction sets; overflow and ``out``."""
import math

import pytest
import torch

from offload_zero.optim import adam_step_
from test_adam_kernel import (_assert_close_to, _assert_within_one_bf16_ulp,
                              _bf16_reference_step, _bits_equal, _grads, _sr_bits, _to_bf16_sr)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _assert_bits_equal(ours: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not _bits_equal(ours, want):
        i = int((ours.view(torch.int16 if ours.element_size() == 2 else torch.int32)
                 != want.view(torch.int16 if want.element_size() == 2 else torch.int32))
                .nonzero()[0])
        raise AssertionError(f"{what}: bits differ, first at {i}: ours={ours[i].item()!r} "
                             f"want={want[i].item()!r}")


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1_000_003])
@pytest.mark.parametrize("offset", [0, 2 ** 32 - 128])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bf16_master_element_by_element(isa, n, offset, state_dtype):
    """bf16 weights, sizes around the vector widths and a large prime, elements counted from
    ``sr_offset`` (one crossing 2**32 inside the buffer): each step equals the fp32-weight
    kernel's step from the widened weights rounded by the reference's stochastic rounding
    under the weights' own key, bit for bit (the moments equal that run's, the fp32 out the
    stored weight), and agrees with torch's fp32 ops plus that rounding (one bf16 step off
    where torch's op differs by an ulp)."""
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.1, adamw=True, bias_correction=True)
    step_kw = dict(lr=kw["lr"], betas=kw["betas"], eps=kw["eps"], weight_decay=kw["wd"],
                   sr_seed=99, sr_offset=offset)
    param = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    m, v = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
    out = torch.empty(n)
    for step, grad in enumerate(_grads(n, 3, seed=4), start=1):
        what = f"{isa} n={n} step={step}"
        p_ref = param.clone()
        m_ref, v_ref = _bf16_reference_step(p_ref, grad, m, v, seed=99, step=step,
                                            offset=offset, **kw)
        p32, m32, v32 = param.float(), m.clone(), v.clone()
        assert not adam_step_(p32, grad, m32, v32, step=step, **step_kw)
        assert not adam_step_(param, grad, m, v, step=step, out=out, **step_kw)
        rounded = _to_bf16_sr(p32, _sr_bits(99, step, n, offset, weights=True) & 0xFFFF)
        _assert_bits_equal(param, rounded, f"{what} param vs fp32 kernel + rounding")
        _assert_bits_equal(m, m32, f"{what} exp_avg vs fp32 weights")
        _assert_bits_equal(v, v32, f"{what} exp_avg_sq vs fp32 weights")
        _assert_bits_equal(out, param.float(), f"{what} out")
        _assert_within_one_bf16_ulp(param, p_ref, f"{what} param vs torch")
        if state_dtype == torch.bfloat16:
            _assert_within_one_bf16_ulp(m, m_ref, f"{what} exp_avg vs torch")
            _assert_within_one_bf16_ulp(v, v_ref, f"{what} exp_avg_sq vs torch")
        else:
            _assert_close_to(m, m_ref, f"{what} exp_avg vs torch", moment=True)
            _assert_close_to(v, v_ref, f"{what} exp_avg_sq vs torch", moment=True)


@pytest.mark.parametrize("n", [17, 100_003])
@pytest.mark.parametrize("adamw,weight_decay,bias_correction",
                         [(True, 0.1, True), (False, 0.1, False)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bf16_master_matches_torch_reference(isa, n, adamw, weight_decay, bias_correction,
                                             state_dtype):
    """20 steps of Adam (L2, the weight in the gradient) and AdamW, each from the kernel's own
    state: torch in fp32 on the widened weights plus the same stochastic rounding."""
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    param = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    m, v = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
    for step, grad in enumerate(_grads(n, 20, seed=6), start=1):
        p_ref = param.clone()
        m_ref, v_ref = _bf16_reference_step(p_ref, grad, m, v, seed=5, step=step,
                                            wd=weight_decay, adamw=adamw,
                                            bias_correction=bias_correction, **kw)
        assert not adam_step_(param, grad, m, v, step=step, weight_decay=weight_decay,
                              adamw=adamw, bias_correction=bias_correction, sr_seed=5, **kw)
        _assert_within_one_bf16_ulp(param, p_ref, f"{isa} n={n} step={step} param")
        if state_dtype == torch.bfloat16:
            _assert_within_one_bf16_ulp(m, m_ref, f"{isa} n={n} step={step} exp_avg")
        else:
            _assert_close_to(m, m_ref, f"{isa} n={n} step={step} exp_avg", moment=True)


def _half_ulp_case(n: int):
    """bf16 weights 1.0, fp32 gradient -(1 + 2**-8), betas (0, 0), eps 0, lr 2**-8, no bias
    correction: the new exp_avg is the gradient and the new weight 1 + 2**-8, both exactly
    half-way between two bf16 values, so each rounds up (away from zero) iff bit 15 of its 16
    random bits is set: a fair coin per element."""
    param = torch.ones(n, dtype=torch.bfloat16)
    grad = torch.full((n,), -(1.0 + 2 ** -8))
    kw = dict(step=1, lr=2 ** -8, betas=(0.0, 0.0), eps=0.0, bias_correction=False)
    return param, grad, kw


def test_bf16_master_bits_independent_of_the_moments(isa):
    """With bf16 moments, the weight and exp_avg of an element, both half-way between two bf16
    values, round up together only about half the time (with the moments' bits they would
    always agree), and the weight's direction matches neither half of the moments' random
    word; another sr_seed, also with fp32 moments, rounds other weights."""
    n = 100_000
    param, grad, kw = _half_ulp_case(n)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    assert not adam_step_(param, grad, m, v, sr_seed=8, **kw)
    up_p = param.view(torch.int16) == 0x3F81                     # 1 + 2**-7, else 1.0
    up_m = m.view(torch.int16) == (0xBF81 - 0x10000)             # -(1 + 2**-7), else -1.0
    assert bool((up_p | (param.view(torch.int16) == 0x3F80)).all())
    assert bool((up_m | (m.view(torch.int16) == 0xBF80 - 0x10000)).all())
    r = _sr_bits(8, 1, n)
    assert torch.equal(up_p, (_sr_bits(8, 1, n, weights=True) & 0x8000) != 0)
    assert torch.equal(up_m, (r & 0x8000) != 0)
    # (sd of each fraction: 0.5 / sqrt(n) = 0.0016; the bound is 12 of them.)
    for what, agree in (("exp_avg", up_p == up_m), ("v's bits", up_p == ((r & 0x80000000) != 0))):
        assert abs(float(agree.float().mean()) - 0.5) < 0.02, (what, float(agree.float().mean()))
    assert abs(float(up_p.float().mean()) - 0.5) < 0.02
    seeds = []
    for seed in (8, 9):
        p, _, _ = _half_ulp_case(n)
        assert not adam_step_(p, grad, torch.zeros(n), torch.zeros(n), sr_seed=seed, **kw)
        seeds.append(p)
    assert _bits_equal(seeds[0], param)  # (fp32 or bf16 moments: the same weight bits)
    differ = float((seeds[0].view(torch.int16) != seeds[1].view(torch.int16)).float().mean())
    assert 0.45 < differ < 0.55, differ


def test_bf16_master_is_unbiased():
    """One step moving a weight of 1.0 by ~1e-3, an eighth of a bf16 ulp (round to nearest
    would never move it): over 64 seeds x 4096 weights the bf16 weights' mean is the fp32
    weights' mean within 5 standard deviations of the rounding (~0.5% of the step)."""
    n, seeds = 4096, 64
    gen = torch.Generator().manual_seed(3)
    grad = -(torch.rand(n, generator=gen) + 0.1)
    kw = dict(step=1, lr=1e-3)
    p32 = torch.ones(n)
    adam_step_(p32, grad, torch.zeros(n), torch.zeros(n), **kw)
    assert torch.equal(p32.to(torch.bfloat16), torch.ones(n, dtype=torch.bfloat16))
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(seeds):
        p = torch.ones(n, dtype=torch.bfloat16)
        adam_step_(p, grad, torch.zeros(n), torch.zeros(n), sr_seed=seed, **kw)
        total += p.double()
    ulp = 2.0 ** -7
    q = (p32.double() - 1.0) / ulp                        # P(one ulp up) per weight
    sd = ulp * float((seeds * q * (1 - q)).sum().sqrt()) / (n * seeds)  # of the mean
    step_mean = float(p32.double().mean()) - 1.0
    bias = float(total.mean()) / seeds - float(p32.double().mean())
    assert 0.9e-3 < step_mean < 1.1e-3, step_mean
    assert abs(bias) < 5 * sd, (bias, sd, step_mean)


@pytest.mark.parametrize("n", [4096, 100_003])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bf16_master_in_pieces_equal_one_call(isa, n, state_dtype):
    """Elements [lo, hi) updated by a call of their own with ``sr_offset=lo`` get the weights,
    moments and out one call on the whole buffer gives them."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen).to(torch.bfloat16)
    g = torch.randn(n, generator=gen)
    whole = [p.clone(), torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype),
             torch.empty(n, dtype=torch.float16)]
    parts = [t.clone() for t in whole]
    cuts = [0, 64, 1024, 3072, n]
    for step in (1, 2):
        adam_step_(*whole[:1], g, *whole[1:3], step=step, lr=1e-2, sr_seed=3, out=whole[3])
        for lo, hi in zip(cuts, cuts[1:]):
            adam_step_(parts[0][lo:hi], g[lo:hi], parts[1][lo:hi], parts[2][lo:hi], step=step,
                       lr=1e-2, sr_seed=3, sr_offset=lo, out=parts[3][lo:hi])
    assert all(_bits_equal(a, b) for a, b in zip(whole, parts))
    assert _bits_equal(whole[3], whole[0].to(torch.float16))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bf16_master_thread_counts_give_identical_bits(isa, state_dtype):
    n = 1_000_003
    results = []
    for threads in (1, 2, 5):
        gen = torch.Generator().manual_seed(0)
        p, g = torch.randn(n, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen)
        m, v = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
        out = torch.empty(n)
        for step in (1, 2):
            adam_step_(p, g, m, v, step=step, lr=1e-2, out=out, sr_seed=4, num_threads=threads)
        results.append((p, m, v, out))
    for other in results[1:]:
        assert all(_bits_equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("n", [1, 17, 1023, 300_007])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bf16_master_out_holds_the_stored_weight(isa, n, out_dtype):
    """out of bf16 weights: a bf16 out their bits, fp32 their exact values, fp16 those
    rounded to nearest even (param.to(out.dtype) each time; 300_007 also takes the
    streaming stores)."""
    param = (torch.randn(n) * 100).to(torch.bfloat16)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    out = torch.empty(n, dtype=out_dtype)
    for step, grad in enumerate(_grads(n, 3, seed=11), start=1):
        adam_step_(param, grad, m, v, step=step, lr=1e-1, out=out, sr_seed=2)
        assert _bits_equal(out, param.to(out_dtype)), f"{isa} {out_dtype} step {step}"


@pytest.mark.parametrize("n", [17, 200_003])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_overflow_leaves_bf16_master_unchanged(isa, n, bad, state_dtype):
    param = torch.randn(n).to(torch.bfloat16)
    m, v = torch.randn(n).to(state_dtype), torch.rand(n).to(state_dtype)
    out = torch.full((n,), 7.0)
    before = [t.clone() for t in (param, m, v, out)]
    for where in (0, n - 1):
        grad = torch.randn(n)
        grad[where] = bad
        assert adam_step_(param, grad, m, v, step=3, lr=1e-2, weight_decay=0.1, out=out,
                          sr_seed=1) is True
        assert all(_bits_equal(a, b) for a, b in zip((param, m, v, out), before))
    grad[n - 1] = bad
    with pytest.raises(RuntimeError, match="check_overflow=False met an inf/nan"):
        adam_step_(param, grad, m, v, step=3, lr=1e-2, check_overflow=False)


def test_bf16_master_trains_like_fp32_master():
    """Fine-tuning a least-squares problem from near its solution with lr=1e-3 over 200
    steps: bf16 weights with stochastic rounding (and bf16 moments) end close to fp32 weights;
    rounded to nearest instead (emulated: the fp32 step from the widened weights, then
    .to(bfloat16)), every weight above 0.5 in size (half a bf16 ulp >= 1.95e-3 there) never
    moves and the loss stalls."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=gen)
    w_true = torch.randn(64, 16, generator=gen)
    y = x @ w_true
    w0 = w_true + 0.05 * torch.randn(64, 16, generator=gen)
    losses = {}
    for kind in ("fp32", "bf16 stochastic", "bf16 nearest"):
        w = w0.clone() if kind == "fp32" else w0.to(torch.bfloat16)
        state_dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        m, v = torch.zeros(w.shape, dtype=state_dtype), torch.zeros(w.shape, dtype=state_dtype)
        for step in range(1, 201):
            grad = 2.0 / len(x) * x.t() @ (x @ w.float() - y)
            if kind == "bf16 nearest":
                w32 = w.float()
                adam_step_(w32, grad, m, v, step=step, lr=1e-3, sr_seed=1, num_threads=1)
                w = w32.to(torch.bfloat16)
            else:
                adam_step_(w, grad, m, v, step=step, lr=1e-3, sr_seed=1, num_threads=1)
        losses[kind] = float(((x @ w.float() - y) ** 2).mean())
    start = float(((x @ w0 - y) ** 2).mean())
    assert losses["fp32"] < 0.01 * start, losses
    assert losses["bf16 stochastic"] < 0.02 * start, (start, losses)
    assert losses["bf16 stochastic"] < 4 * losses["fp32"] + 0.005 * start, (start, losses)
    assert losses["bf16 nearest"] > 0.3 * start, (start, losses)


