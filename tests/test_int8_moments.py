"""Blockwise 8-bit moments (offload_zero.optim.int8_moments, csrc/adam_q8.h): the map, the
round-trip error against the bound the format documents, decoding then encoding as the
identity, unbiased stochastic rounding, the fused kernel of every instruction set against the
scalar reference element by element, the fused pass against decode + fp32 step + encode, and
runs of several parameter groups."""
import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from offload_zero.optim import adam_step_, available_isas
from offload_zero.optim.int8_moments import (BLOCK_NUMEL, adam_step_runs_, blocks, dequantize,
                                             quantize_, values)

ISAS = available_isas()
SIZES = [0, 1, 255, 256, 257, 1_000_003]
TOL = 2.0 ** -21  # the format's float slack ([Note: int8 moments])

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _map_spec(signed: bool) -> np.ndarray:
    """The documented map, in double: value(c) = 10^-(N-1-k) (0.1 + 0.9 (f + 1) / 2^k)."""
    bits = 7 if signed else 8
    mag = np.zeros(1 << bits)
    for c in range(1, 1 << bits):
        k = c.bit_length() - 1
        mag[c] = 10.0 ** -(bits - 1 - k) * (0.1 + 0.9 * (c - (1 << k) + 1) / (1 << k))
    return np.concatenate([mag, -mag]) if signed else mag


@pytest.mark.parametrize("signed", [True, False])
def test_map_is_the_documented_dynamic_tree(signed):
    got = values(signed).double().numpy()
    want = _map_spec(signed)
    assert np.allclose(got, want, rtol=2 ** -23, atol=0)
    mags = got[:128] if signed else got
    assert (np.diff(mags) > 0).all() and mags[-1] == 1.0
    assert mags[1] == pytest.approx(1e-6 if signed else 1e-7, rel=1e-6)
    if signed:
        assert got[0x80] == 0 and (got[129:] == -got[1:128]).all()


def _spread(n, seed, signed=True):
    """Values over ten orders of magnitude, exact zeros included, in blocks of varied absmax."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.empty(n).uniform_(-23, 0, generator=gen))
    x[torch.rand(n, generator=gen) < 0.02] = 0.0
    x *= 10.0 ** torch.randint(-6, 3, (blocks(n),), generator=gen).repeat_interleave(
        BLOCK_NUMEL)[:n].float()
    if signed:
        x *= torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    return x


def _step_of(r, signed):
    """The code spacing s at r = |x| / absmax (see the format's error bound)."""
    bits = 7 if signed else 8
    r = np.asarray(r, dtype=np.float64)
    z = np.clip(np.floor(-np.log10(np.maximum(r, 1e-30))), 0, bits - 1).astype(int)
    z = np.where(r >= 1.0, 0, z)
    k = bits - 1 - z
    s = 0.9 * 10.0 ** -z / 2.0 ** k
    return np.where(z == bits - 1, 10.0 ** -(bits - 1), s)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 100_003])
def test_round_trip_error_within_the_documented_bound(signed, stochastic, n):
    x = _spread(n, n, signed) if signed else _spread(n, n, signed).abs()
    codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(blocks(n))
    quantize_(x, codes, absmax, signed=signed, stochastic=stochastic, sr_seed=3, step=5)
    blockmax = torch.stack([c.abs().max() for c in x.split(BLOCK_NUMEL)])
    assert torch.equal(absmax, blockmax)
    back = dequantize(codes, absmax, signed=signed).double().numpy()
    a = absmax.double().numpy().repeat(BLOCK_NUMEL)[:n]
    xd = x.double().numpy()
    r = np.abs(xd) / np.where(a > 0, a, 1)
    s = _step_of(r, signed)
    bound = a * ((s if stochastic else s / 2) + TOL)
    if not signed:  # a positive exp_avg_sq never encodes to 0
        bound = np.where((xd > 0) & (r < 1e-7), a * (1e-7 + TOL), bound)
    err = np.abs(back - xd)
    assert (err <= bound).all(), f"worst {np.max(err / np.maximum(bound, 1e-45))}x the bound"
    assert ((back == 0) == (xd == 0)).all() if not signed else ((xd == 0) <= (back == 0)).all()
    assert (np.sign(back) * np.sign(xd) >= 0).all()


@pytest.mark.parametrize("signed", [True, False])
def test_decoding_then_encoding_gives_the_same_codes_and_absmax(signed):
    """Every code in blocks of varied absmax (each holding the top code, as every encoded
    block does): decode, encode to nearest, the same bytes back."""
    gen = torch.Generator().manual_seed(0)
    n = 256 * 40
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if signed:
        codes[codes == 0x80] = 0
    codes[::BLOCK_NUMEL] = 127 if signed else 255
    codes[:BLOCK_NUMEL] = torch.arange(256, dtype=torch.uint8) if not signed else \
        torch.cat([torch.arange(128), torch.arange(129, 256), torch.tensor([0])]).to(torch.uint8)
    codes[0] = 127 if signed else 255
    absmax = torch.exp(torch.empty(blocks(n)).uniform_(-30, 30, generator=gen))
    absmax[3] = 0.0
    codes[3 * BLOCK_NUMEL:4 * BLOCK_NUMEL] = 0
    x = dequantize(codes, absmax, signed=signed)
    again, again_max = torch.empty_like(codes), torch.empty_like(absmax)
    quantize_(x, again, again_max, signed=signed)
    assert torch.equal(again, codes) and torch.equal(again_max, absmax)


def test_stochastic_rounding_is_unbiased():
    """A value between two codes lands on one of them, with the mean at the value."""
    n = 256 * 400
    x = torch.full((n,), 0.5003)
    x[::BLOCK_NUMEL] = 1.0  # absmax 1
    codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(blocks(n))
    for signed in (True, False):
        quantize_(x, codes, absmax, signed=signed, stochastic=True, sr_seed=9, step=2)
        back = dequantize(codes, absmax, signed=signed)
        rest = back[x != 1.0]
        assert len(set(rest.tolist())) == 2
        lo, hi = min(rest.tolist()), max(rest.tolist())
        assert lo < 0.5003 < hi
        sd = (hi - lo) / 2 / math.sqrt(rest.numel())
        assert abs(float(rest.double().mean()) - 0.5003) < 5 * sd


def _q8_state(n, seed):
    """fp32 param, and int8 moments encoded from plausible fp32 moments."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m32 = torch.randn(n, generator=gen) * 1e-2
    v32 = torch.rand(n, generator=gen) * 1e-4
    state = [p]
    for x, signed in ((m32, True), (v32, False)):
        c, a = torch.empty(n, dtype=torch.uint8), torch.empty(blocks(n))
        quantize_(x, c, a, signed=signed)
        state += [c, a]
    return state  # p, m codes, m absmax, v codes, v absmax


def _run_q8(isa, monkeypatch, state, grads, out_dtype=None, **kw):
    monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", isa)
    p, mc, ma, vc, va = (t.clone() for t in state)
    n = p.numel()
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    for step, g in enumerate(grads, start=1):
        assert adam_step_(p, g, mc, vc, step=step, lr=1e-2, weight_decay=0.1, out=out,
                          sr_seed=11, exp_avg_absmax=ma, exp_avg_sq_absmax=va, **kw) is False
    return [p, mc, ma, vc, va] + ([] if out is None else [out])


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype,out_dtype,adamw",
                         [(torch.float32, None, True), (torch.bfloat16, torch.bfloat16, True),
                          (torch.float16, torch.float32, False)])
def test_every_isa_equals_the_scalar_reference(isa, n, grad_dtype, out_dtype, adamw,
                                               monkeypatch):
    """Three steps: param, codes, absmax and out of the SIMD kernel equal the scalar
    kernel's bit for bit."""
    if isa not in ISAS:
        pytest.skip(f"this CPU/OS lacks {isa} (available: {ISAS}): its kernel cannot run here")
    if n == 1_000_003 and grad_dtype != torch.float32:
        pytest.skip("the large size once per instruction set, with fp32 gradients")
    gen = torch.Generator().manual_seed(n + 1)
    grads = [(torch.randn(n, generator=gen) * 10.0 ** (s - 2)).to(grad_dtype) for s in range(3)]
    state = _q8_state(n, n)
    ref = _run_q8("scalar", monkeypatch, state, grads, out_dtype, adamw=adamw)
    if n:
        assert not torch.equal(ref[1], state[1])  # (the moments did move)
    got = _run_q8(isa, monkeypatch, state, grads, out_dtype, adamw=adamw)
    for name, a, b in zip(("param", "m", "m_absmax", "v", "v_absmax", "out"), got, ref):
        assert torch.equal(a, b), f"{isa} n={n}: {name} differs at {int((a != b).nonzero()[0])}"


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_every_isa_decodes_every_code_as_the_scalar_reference(isa, monkeypatch):
    """Codes the encoder never writes (exp_avg's 0x80, a negative zero's place) and every
    other, in blocks of varied absmax: one step of the SIMD kernel equals the scalar one."""
    if isa not in ISAS:
        pytest.skip(f"this CPU/OS lacks {isa} (available: {ISAS}): its kernel cannot run here")
    gen = torch.Generator().manual_seed(5)
    n = BLOCK_NUMEL * 16
    p = torch.randn(n, generator=gen)
    state = [p]
    for _ in range(2):
        codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        codes[:BLOCK_NUMEL] = torch.arange(256, dtype=torch.uint8)
        state += [codes, torch.exp(torch.empty(blocks(n)).uniform_(-20, 0, generator=gen))]
    grads = [torch.randn(n, generator=gen) * 1e-3]
    ref = _run_q8("scalar", monkeypatch, state, grads)
    got = _run_q8(isa, monkeypatch, state, grads)
    for name, a, b in zip(("param", "m", "m_absmax", "v", "v_absmax"), got, ref):
        assert torch.equal(a, b), f"{isa}: {name} differs at {int((a != b).nonzero()[0])}"


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_every_isa_encodes_values_at_each_decade_and_octave_edge_as_the_reference(isa,
                                                                                monkeypatch):
    """beta1 = 0 and zero moments make the new exp_avg the gradient itself: values one ulp
    around each decade threshold 10^-k and each power of two 2^-i (i = 0..40), 16 per decade
    down to 1e-9, zeros and subnormals, beside a block absmax of 1, encode to the scalar
    kernel's codes."""
    if isa not in ISAS:
        pytest.skip(f"this CPU/OS lacks {isa} (available: {ISAS}): its kernel cannot run here")
    edges = [float(np.float32(10.0 ** -k)) for k in range(1, 9)] + [2.0 ** -i for i in range(41)]
    g = []
    for x in edges:
        g += [np.nextafter(np.float32(x), np.float32(0)), np.float32(x),
              np.nextafter(np.float32(x), np.float32(1))]
    g += [10.0 ** (-k / 16) for k in range(150)]  # (and between them)
    g = torch.tensor(g + [0.0, 1e-40, 3e-39], dtype=torch.float32)
    g = torch.cat([g, -g])
    n = BLOCK_NUMEL * -(-g.numel() // BLOCK_NUMEL)
    grad = torch.zeros(n)
    grad[:g.numel()] = g
    grad[::BLOCK_NUMEL] = 1.0  # (each block's absmax)
    zeros = [torch.zeros(n, dtype=torch.uint8), torch.ones(blocks(n))]
    state = [torch.zeros(n)] + zeros + [t.clone() for t in zeros]
    kw = dict(betas=(0.0, 0.0))
    ref = _run_q8("scalar", monkeypatch, state, [grad], **kw)
    got = _run_q8(isa, monkeypatch, state, [grad], **kw)
    for name, a, b in zip(("param", "m", "m_absmax", "v", "v_absmax"), got, ref):
        assert torch.equal(a, b), f"{isa}: {name} differs at {int((a != b).nonzero()[0])}"


@pytest.mark.parametrize("isa", ISAS)
def test_fused_pass_equals_decode_fp32_step_encode(isa, monkeypatch):
    """The fused kernel is the format's decode, the fp32 kernel and a stochastic encode keyed
    by the same (seed, step, offset), composed: bit for bit."""
    monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", isa)
    n = 5000
    p, mc, ma, vc, va = _q8_state(n, 1)
    g = torch.randn(n, generator=torch.Generator().manual_seed(2))
    m32, v32 = dequantize(mc, ma, signed=True), dequantize(vc, va, signed=False)
    p32 = p.clone()
    kw = dict(step=7, lr=3e-3, weight_decay=0.05)
    adam_step_(p32, g, m32, v32, **kw)
    ref_m, ref_ma = torch.empty_like(mc), torch.empty_like(ma)
    ref_v, ref_va = torch.empty_like(vc), torch.empty_like(va)
    quantize_(m32, ref_m, ref_ma, signed=True, stochastic=True, sr_seed=4, step=7, sr_offset=512)
    quantize_(v32, ref_v, ref_va, signed=False, stochastic=True, sr_seed=4, step=7, sr_offset=512)
    adam_step_(p, g, mc, vc, sr_seed=4, sr_offset=512, exp_avg_absmax=ma, exp_avg_sq_absmax=va,
               **kw)
    assert torch.equal(p, p32)
    for got, want in ((mc, ref_m), (ma, ref_ma), (vc, ref_v), (va, ref_va)):
        assert torch.equal(got, want)


def _hp(lr, wd):
    return SimpleNamespace(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)


@pytest.mark.parametrize("cuts", [[], [100], [256, 300], [10, 20, 700], [511, 1024, 1030]])
def test_runs_with_one_setting_equal_one_fused_call(cuts):
    """Cutting the buffers into runs (even inside a block) with the same hyperparameters
    changes no bit: a block shared by runs is updated as the fused pass would."""
    n = 1500
    state = _q8_state(n, 5)
    g = torch.randn(n, generator=torch.Generator().manual_seed(6))
    whole = [t.clone() for t in state]
    p, mc, ma, vc, va = whole
    adam_step_(p, g, mc, vc, step=3, lr=1e-2, weight_decay=0.1, sr_seed=2, sr_offset=1024,
               exp_avg_absmax=ma, exp_avg_sq_absmax=va)
    edges = [0] + cuts + [n]
    runs = [(a, b, _hp(1e-2, 0.1)) for a, b in zip(edges, edges[1:])]
    p, mc, ma, vc, va = cut = [t.clone() for t in state]
    assert adam_step_runs_(p, g, mc, vc, ma, va, runs, step=3, sr_seed=2, sr_offset=1024) is False
    assert all(torch.equal(a, b) for a, b in zip(cut, whole))


def test_runs_with_their_own_settings_follow_the_per_element_reference():
    """Two groups cut inside a block: each element is updated with its own group's settings
    and every block encoded once, as decode -> fp32 step per run -> encode gives."""
    n = 1000
    state = _q8_state(n, 7)
    g = torch.randn(n, generator=torch.Generator().manual_seed(8))
    runs = [(0, 300, _hp(1e-2, 0.1)), (300, 650, _hp(1e-3, 0.0)), (650, n, _hp(1e-2, 0.1))]
    p, mc, ma, vc, va = (t.clone() for t in state)
    m32, v32 = dequantize(mc, ma, signed=True), dequantize(vc, va, signed=False)
    for a, b, hp in runs:
        adam_step_(p[a:b], g[a:b], m32[a:b], v32[a:b], step=2, lr=hp.lr,
                   weight_decay=hp.weight_decay)
    quantize_(m32, mc, ma, signed=True, stochastic=True, sr_seed=1, step=2)
    quantize_(v32, vc, va, signed=False, stochastic=True, sr_seed=1, step=2)
    got = [t.clone() for t in state]
    assert adam_step_runs_(*got[:1], g, got[1], got[3], got[2], got[4], runs, step=2,
                           sr_seed=1) is False
    for a, b in zip(got, (p, mc, ma, vc, va)):
        assert torch.equal(a, b)
    bad = g.clone()
    bad[900] = float("nan")
    before = [t.clone() for t in state]
    assert adam_step_runs_(before[0], bad, before[1], before[3], before[2], before[4], runs,
                           step=2) is True
    assert all(torch.equal(a, b) for a, b in zip(before, state))


def test_int8_adam_stays_close_to_fp32_adam():
    """200 steps of AdamW on noisy gradients of a quadratic: the int8-moment weights stay
    within 2% (of the weights' spread) of the fp32-moment ones, and both converge."""
    n = 4096
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(n, generator=gen)
    p32, p8 = torch.zeros(n), torch.zeros(n)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    mc, vc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ma, va = torch.zeros(blocks(n)), torch.zeros(blocks(n))
    for step in range(1, 201):
        noise = torch.randn(n, generator=gen) * 0.1
        adam_step_(p32, p32 - target + noise, m32, v32, step=step, lr=2e-2)
        adam_step_(p8, p8 - target + noise, mc, vc, step=step, lr=2e-2, sr_seed=1,
                   exp_avg_absmax=ma, exp_avg_sq_absmax=va)
    assert float((p32 - target).abs().mean()) < 0.1
    assert float((p8 - p32).abs().max()) < 0.02 * float(target.std()) * 10
    assert float((p8 - p32).abs().mean()) < 0.02 * float(target.std())


# ---------------------------------------------------------------------------- bf16 master weights


def _with_bf16_master(state):
    return [state[0].to(torch.bfloat16)] + state[1:]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", SIZES)
def test_bf16_master_with_int8_moments(isa, n, monkeypatch):
    """bf16 weights with 8-bit moments, three steps: each step is the fp32-weight kernel's
    step from the widened weights (codes and absmax bit for bit) with the weight rounded by
    the reference's stochastic rounding under the weights' key ([Note: bf16 master weights]),
    a bf16 out holding the weights' bits; and every instruction set gives the scalar kernel's
    bits."""
    from test_adam_kernel import _sr_bits, _to_bf16_sr
    gen = torch.Generator().manual_seed(n + 1)
    grads = [torch.randn(n, generator=gen) * 10.0 ** (s - 2) for s in range(3)]
    state = _with_bf16_master(_q8_state(n, n))
    kw = dict(lr=1e-2, weight_decay=0.1, sr_seed=11, sr_offset=512)
    monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", isa)
    p, mc, ma, vc, va = (t.clone() for t in state)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, start=1):
        p32 = p.float()
        moments32 = [t.clone() for t in (mc, ma, vc, va)]  # (beside fp32 weights)
        assert adam_step_(p32, g, moments32[0], moments32[2], step=step,
                          exp_avg_absmax=moments32[1], exp_avg_sq_absmax=moments32[3],
                          **kw) is False
        assert adam_step_(p, g, mc, vc, step=step, out=out, exp_avg_absmax=ma,
                          exp_avg_sq_absmax=va, **kw) is False
        rounded = _to_bf16_sr(p32, _sr_bits(11, step, n, 512, weights=True) & 0xFFFF)
        assert torch.equal(p.view(torch.int16), rounded.view(torch.int16)), f"{isa} step {step}"
        assert torch.equal(out.view(torch.int16), p.view(torch.int16))
        for name, a, b in zip(("m", "m_absmax", "v", "v_absmax"), (mc, ma, vc, va), moments32):
            assert torch.equal(a, b), f"{isa} n={n} step={step}: {name}"
    ref = _run_q8("scalar", monkeypatch, state, grads, torch.bfloat16)
    got = _run_q8(isa, monkeypatch, state, grads, torch.bfloat16)
    for name, a, b in zip(("param", "m", "m_absmax", "v", "v_absmax", "out"), got, ref):
        assert torch.equal(a, b), f"{isa} n={n}: {name} differs at {int((a != b).nonzero()[0])}"


@pytest.mark.parametrize("isa", ISAS)
def test_overflow_leaves_bf16_master_and_int8_moments_unchanged(isa, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", isa)
    n = 100_003
    p, mc, ma, vc, va = state = _with_bf16_master(_q8_state(n, 3))
    out = torch.full((n,), 7.0)
    before = [t.clone() for t in state + [out]]
    for where in (0, 70_000, n - 1):
        g = torch.randn(n)
        g[where] = float("inf")
        assert adam_step_(p, g, mc, vc, step=2, lr=1e-2, out=out, sr_seed=1,
                          exp_avg_absmax=ma, exp_avg_sq_absmax=va) is True
        assert all(torch.equal(a, b) for a, b in zip(state + [out], before)), where


def test_runs_of_bf16_master_at_block_edges_equal_one_fused_call():
    """bf16 weights: runs cut at block edges are the fused call's bits; cut inside a block
    (at 300, in block 1), the shared block's weights are rounded keyed by their place too:
    codes and absmax are the fused call's bits, the weights outside block 1 too, those inside
    it a bf16 neighbour of the fused call's (the same value before rounding, other random
    bits), and the same on every run of it."""
    n = 1500
    state = _with_bf16_master(_q8_state(n, 5))
    g = torch.randn(n, generator=torch.Generator().manual_seed(6))
    p, mc, ma, vc, va = whole = [t.clone() for t in state]
    adam_step_(p, g, mc, vc, step=3, lr=1e-2, weight_decay=0.1, sr_seed=2, sr_offset=1024,
               exp_avg_absmax=ma, exp_avg_sq_absmax=va)
    runs = [(0, 256, _hp(1e-2, 0.1)), (256, 1024, _hp(1e-2, 0.1)), (1024, n, _hp(1e-2, 0.1))]
    p, mc, ma, vc, va = cut = [t.clone() for t in state]
    assert adam_step_runs_(p, g, mc, vc, ma, va, runs, step=3, sr_seed=2, sr_offset=1024) is False
    assert all(torch.equal(a, b) for a, b in zip(cut, whole))
    runs = [(0, 300, _hp(1e-2, 0.1)), (300, n, _hp(1e-2, 0.1))]
    results = []
    for _ in range(2):
        p, mc, ma, vc, va = mixed = [t.clone() for t in state]
        assert adam_step_runs_(p, g, mc, vc, ma, va, runs, step=3, sr_seed=2,
                               sr_offset=1024) is False
        results.append(mixed)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert all(torch.equal(a, b) for a, b in zip(mixed[1:], whole[1:]))
    outside = torch.ones(n, dtype=torch.bool)
    outside[256:512] = False
    assert torch.equal(mixed[0][outside], whole[0][outside])
    inside = (mixed[0][256:512].float() - whole[0][256:512].float()).abs()
    ulp = whole[0][256:512].float().abs() * 2.0 ** -7
    assert bool((inside <= ulp).all()) and bool((inside > 0).any())


def test_bad_absmax_raises_value_error():
    n = 300
    p, g = torch.zeros(n), torch.zeros(n)
    mc, vc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"exp_avg_absmax is required with uint8"):
        adam_step_(p, g, mc, vc, step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"exp_avg_sq_absmax has numel=3, expected 2"):
        adam_step_(p, g, mc, vc, step=1, lr=1e-3, exp_avg_absmax=torch.zeros(2),
                   exp_avg_sq_absmax=torch.zeros(3))
    with pytest.raises(ValueError, match=r"only uint8 moments have them"):
        adam_step_(p, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-3,
                   exp_avg_absmax=torch.zeros(2), exp_avg_sq_absmax=torch.zeros(2))
    with pytest.raises(ValueError, match=r"sr_offset=100 must be a multiple of 256"):
        adam_step_runs_(p, g, mc, vc, torch.zeros(2), torch.zeros(2), [(0, n, _hp(1, 0))],
                        step=1, sr_offset=100)
    with pytest.raises(ValueError, match=r"codes dtype torch.float32 is not one of torch.uint8"):
        quantize_(p, torch.zeros(n), torch.zeros(2), signed=True)


def test_cpu_adam_with_int8_moments_matches_the_kernel_and_round_trips_its_state():
    """CPUAdam(state_dtype=torch.uint8): the kernel's codes and scales step by step; its
    state_dict loads back bit for bit (torch casts the codes to fp32 on the way: exact), into
    an fp32 CPUAdam decoded, and an fp32 state into an 8-bit one encoded to nearest."""
    from offload_zero.optim import CPUAdam
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(33, 17))
    opt = CPUAdam([w], lr=1e-2, state_dtype=torch.uint8)
    p, mc, vc = w.detach().clone().view(-1), torch.zeros(561, dtype=torch.uint8), \
        torch.zeros(561, dtype=torch.uint8)
    ma, va = torch.zeros(3), torch.zeros(3)
    grads = [torch.randn(33, 17) for _ in range(3)]
    for step, g in enumerate(grads, start=1):
        w.grad = g
        opt.step()
        adam_step_(p, g.view(-1), mc, vc, step=step, lr=1e-2, sr_seed=1, exp_avg_absmax=ma,
                   exp_avg_sq_absmax=va)
    st = opt.state[w]
    assert torch.equal(w.detach().view(-1), p) and torch.equal(st["exp_avg"].view(-1), mc)
    assert torch.equal(st["exp_avg_sq_absmax"], va)
    w2 = torch.nn.Parameter(w.detach().clone())
    again = CPUAdam([w2], lr=1e-2, state_dtype=torch.uint8)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # (torch would alias the absmax)
    w.grad = w2.grad = grads[0]
    opt.step()
    again.step()
    assert torch.equal(w, w2)
    assert torch.equal(again.state[w2]["exp_avg"], opt.state[w]["exp_avg"])
    exact = CPUAdam([torch.nn.Parameter(w.detach().clone())], lr=1e-2)
    exact.load_state_dict(copy.deepcopy(opt.state_dict()))
    exact.param_groups[0]["state_dtype"] = torch.float32  # (loading took the saved group's)
    (q,) = exact.param_groups[0]["params"]
    q.grad = torch.zeros_like(q)
    exact.step()
    m_dec = dequantize(opt.state[w]["exp_avg"].view(-1), opt.state[w]["exp_avg_absmax"],
                       signed=True)
    assert torch.allclose(exact.state[q]["exp_avg"].view(-1), 0.9 * m_dec, rtol=1e-6, atol=0)
    ref = torch.nn.Parameter(w.detach().clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-2)
    ref.grad = grads[1]
    torch_opt.step()
    coded = CPUAdam([torch.nn.Parameter(ref.detach().clone())], lr=1e-2,
                    state_dtype=torch.uint8)
    sd = copy.deepcopy(torch_opt.state_dict())
    sd["param_groups"][0]["state_dtype"] = torch.uint8
    coded.load_state_dict(sd)
    (c,) = coded.param_groups[0]["params"]
    c.grad = torch.zeros_like(c)
    coded.step()
    codes, absmax = torch.empty(561, dtype=torch.uint8), torch.empty(3)
    fp32_m = torch_opt.state[ref]["exp_avg"].reshape(-1).contiguous()
    quantize_(fp32_m, codes, absmax, signed=True)
    decoded = dequantize(codes, absmax, signed=True)
    got = dequantize(coded.state[c]["exp_avg"].view(-1), coded.state[c]["exp_avg_absmax"],
                     signed=True)
    assert torch.allclose(got, 0.9 * decoded, rtol=0.02, atol=1e-6 * float(absmax.max()))
