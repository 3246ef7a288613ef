"""CPUAdam (the C++ kernel as a torch.optim.Optimizer) against torch.optim.AdamW / Adam."""
import copy
import math

import pytest
import torch

from offload_zero.optim import CPUAdam

SIZES = [1, 7, 15, 16, 17, 1023, 1_000_003]



pytestmark = pytest.mark.usefixtures("torch_single_thread")

def _params(seed=0, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(n,) if n % 2 else (n // 1, 1) for n in sizes]  # mix 1-D and 2-D
    return [torch.randn(*s, generator=gen) for s in shapes]


def _set_grads(params, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * (10.0 ** ((step % 4) - 2))


def _assert_close(ours, ref, what, moment=False):
    tol = 1e-6 * ref.abs().clamp(min=1.0)
    if moment and ref.numel():  # see tests/test_adam_kernel.py::_assert_close_to
        tol = tol + 1e-7 * ref.abs().max()
    bad = ~((ours - ref).abs() <= tol)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max diff " \
                          f"{(ours - ref).abs().max().item()}"


def _pair(adamw, **kw):
    ours_p = [p.requires_grad_(True) for p in _params()]
    ref_p = [p.detach().clone().requires_grad_(True) for p in ours_p]
    ours = CPUAdam(ours_p, adamw_mode=adamw, **kw)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = cls(ref_p, foreach=False, **kw)
    return ours_p, ours, ref_p, ref


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_over_100_steps(adamw, weight_decay):
    ours_p, ours, ref_p, ref = _pair(adamw, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                     weight_decay=weight_decay)
    for step in range(1, 101):
        _set_grads(ours_p, step)
        for a, b in zip(ours_p, ref_p):
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    for i, (a, b) in enumerate(zip(ours_p, ref_p)):
        _assert_close(a.detach(), b.detach(), f"param {i} (numel {a.numel()})")
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_close(ours.state[a][key], ref.state[b][key], f"{key} {i}", moment=True)
        assert float(ours.state[a]["step"]) == float(ref.state[b]["step"]) == 100.0


def test_bias_correction_off_matches_formula():
    n = 1023
    p = torch.randn(n, requires_grad=True)
    ref = p.detach().clone()
    m, v = torch.zeros(n), torch.zeros(n)
    opt = CPUAdam([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01,
                  bias_correction=False)
    for step in range(1, 21):
        _set_grads([p], step)
        g = p.grad.clone()
        opt.step()
        ref.mul_(1 - 1e-2 * 0.01)
        m.lerp_(g, 1 - 0.9)
        v.mul_(0.99).addcmul_(g, g, value=1 - 0.99)
        ref.addcdiv_(m, v.sqrt().add_(1e-6), value=-1e-2)
    _assert_close(p.detach(), ref, "bias_correction=False")


def test_params_without_grad_are_skipped():
    a, b = torch.randn(10, requires_grad=True), torch.randn(10, requires_grad=True)
    b0 = b.detach().clone()
    opt = CPUAdam([a, b], lr=1e-1)
    a.grad = torch.ones(10)
    opt.step()
    assert torch.equal(b.detach(), b0) and b not in opt.state
    assert not torch.equal(a.detach(), b0)


def test_param_groups_use_their_own_hyperparameters():
    p1, p2 = torch.randn(33, requires_grad=True), torch.randn(33, requires_grad=True)
    r1, r2 = (p.detach().clone().requires_grad_(True) for p in (p1, p2))
    ours = CPUAdam([{"params": [p1]}, {"params": [p2], "lr": 1e-1, "weight_decay": 0.2}], lr=1e-3)
    ref = torch.optim.AdamW([{"params": [r1]}, {"params": [r2], "lr": 1e-1, "weight_decay": 0.2}],
                            lr=1e-3, weight_decay=0.0, foreach=False)
    for step in range(1, 6):
        _set_grads([p1, p2], step)
        r1.grad, r2.grad = p1.grad.clone(), p2.grad.clone()
        ours.step()
        ref.step()
    _assert_close(p1.detach(), r1.detach(), "group 0")
    _assert_close(p2.detach(), r2.detach(), "group 1")


def test_state_dict_round_trip_and_torch_compatibility():
    def make():
        torch.manual_seed(0)
        return [torch.randn(17, requires_grad=True), torch.randn(4, 5, requires_grad=True)]

    params = make()
    opt = CPUAdam(params, lr=1e-2, weight_decay=0.1)
    for step in range(1, 6):
        _set_grads(params, step)
        opt.step()
    # Deep copies, as after torch.save/torch.load: a live state_dict shares its tensors.
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    clone_p = [p.detach().clone().requires_grad_(True) for p in params]
    clone = CPUAdam(clone_p, lr=0.5)  # lr comes back from the state dict
    clone.load_state_dict(copy.deepcopy(sd))
    assert clone.param_groups[0]["lr"] == 1e-2
    torch_p = [p.detach().clone().requires_grad_(True) for p in params]
    torch_opt = torch.optim.AdamW(torch_p, lr=1e-2, weight_decay=0.1, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    for step in range(6, 11):
        _set_grads(params, step)
        for group in (clone_p, torch_p):
            for a, b in zip(group, params):
                a.grad = b.grad.clone()
        opt.step()
        clone.step()
        torch_opt.step()
    for a, b, c in zip(params, clone_p, torch_p):
        assert torch.equal(a.detach(), b.detach())  # bit for bit after the round trip
        _assert_close(a.detach(), c.detach(), "continued in torch.optim.AdamW")

    # And a torch AdamW state dict loads into CPUAdam.
    back = CPUAdam([p.detach().clone().requires_grad_(True) for p in params])
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert float(back.state[back.param_groups[0]["params"][0]]["step"]) == 10.0


def test_lr_scheduler_drives_lr():
    p = torch.randn(100, requires_grad=True)
    r = p.detach().clone().requires_grad_(True)
    ours = CPUAdam([p], lr=1e-1)
    ref = torch.optim.AdamW([r], lr=1e-1, weight_decay=0.0, foreach=False)
    s1 = torch.optim.lr_scheduler.LambdaLR(ours, lambda e: 0.5 ** e)
    s2 = torch.optim.lr_scheduler.LambdaLR(ref, lambda e: 0.5 ** e)
    for step in range(1, 8):
        _set_grads([p], step)
        r.grad = p.grad.clone()
        ours.step()
        ref.step()
        s1.step()
        s2.step()
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-1 * 0.5 ** step
    _assert_close(p.detach(), r.detach(), "with LambdaLR")


def test_closure_and_overflow_flag():
    p = torch.randn(10, requires_grad=True)
    opt = CPUAdam([p], lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and not opt.last_step_overflow
    before = p.detach().clone()
    p.grad = torch.full((10,), math.inf)
    opt.step()
    assert opt.last_step_overflow and torch.equal(p.detach(), before)
    assert float(opt.state[p]["step"]) == 1.0  # not advanced by the skipped step


@pytest.mark.parametrize("make,match", [
    (lambda: torch.zeros(4, dtype=torch.float64), "float32"),
    (lambda: torch.zeros(4, 4).t(), "contiguous"),
    (lambda: torch.zeros(4, device="meta"), "CPU"),
])
def test_bad_params_raise(make, match):
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*" + match):
        CPUAdam([torch.zeros(3), make()])


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "lr=-1.0"),
    (dict(betas=(0.9, 1.0)), "index 1: 1.0"),
    (dict(eps=-1.0), "eps=-1.0"),
    (dict(weight_decay=-0.5), "-0.5"),
])
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPUAdam([torch.zeros(3)], **kwargs)


def test_bf16_state_dtype_keeps_bf16_moments_near_fp32_ones():
    fp32_p = [p.requires_grad_(True) for p in _params(sizes=[17, 1023])]
    bf16_p = [p.detach().clone().requires_grad_(True) for p in fp32_p]
    fp32 = CPUAdam(fp32_p, lr=1e-2, weight_decay=0.1)
    bf16 = CPUAdam(bf16_p, lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16)
    for step in range(1, 11):
        _set_grads(fp32_p, step)
        for a, b in zip(bf16_p, fp32_p):
            a.grad = b.grad.clone()
        fp32.step()
        bf16.step()
    for a, b in zip(bf16_p, fp32_p):
        for key in ("exp_avg", "exp_avg_sq"):
            ours, ref = bf16.state[a][key], fp32.state[b][key]
            assert ours.dtype == torch.bfloat16 and ours.shape == a.shape
            # Ten stochastic roundings, each under one bf16 ulp (2**-8 relative); m also has
            # elements near zero after cancellation, so an absolute term at the tensor's scale.
            tol = 2 ** -5 * ref.abs() + 2 ** -8 * ref.abs().max()
            assert ((ours.float() - ref).abs() <= tol).all(), key
        assert torch.allclose(a.detach(), b.detach(), rtol=0, atol=1e-3)
    # A state dict round trip (torch casts moments to the parameter's fp32 on load) comes back
    # to bf16 on the next step without changing a bit of the moments.
    sd = copy.deepcopy(bf16.state_dict())
    again = CPUAdam([p.detach().clone().requires_grad_(True) for p in bf16_p])
    again.load_state_dict(sd)
    assert again.param_groups[0]["state_dtype"] == torch.bfloat16
    for p in again.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    again.step()
    m0 = again.state[again.param_groups[0]["params"][0]]["exp_avg"]
    assert m0.dtype == torch.bfloat16


def test_bad_state_dtype_raises():
    with pytest.raises(ValueError, match="state_dtype=torch.float16"):
        CPUAdam([torch.zeros(3)], state_dtype=torch.float16)


def test_check_overflow_off_matches_and_raises_on_nonfinite():
    import pytest
    import torch
    from offload_zero.optim import CPUAdam
    torch.manual_seed(0)
    a = torch.randn(1000)
    b = a.clone()
    pa, pb = torch.nn.Parameter(a), torch.nn.Parameter(b)
    oa, ob = CPUAdam([pa], lr=1e-2), CPUAdam([pb], lr=1e-2, check_overflow=False)
    for _ in range(5):
        g = torch.randn(1000)
        pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(pa.data, pb.data)
    pb.grad = torch.full((1000,), float("inf"))
    with pytest.raises(RuntimeError):
        ob.step()


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_bf16_params_match_the_kernel_and_round_trip_their_state(state_dtype):
    """bf16 parameters in two groups: every step is adam_step_ on the parameter (its position
    over the groups as sr_seed, the moments in state_dtype), bit for bit, and stays near
    torch.optim.AdamW on fp32 copies; a state dict loads back with the moments' own dtype and
    bits (torch alone would round fp32 moments and 8-bit scales to the parameters' bf16) and
    the two optimizers continue bit for bit."""
    from offload_zero.optim import adam_step_
    from offload_zero.optim.int8_moments import blocks
    sizes = ([17, 1023], [300])
    params = [[p.to(torch.bfloat16).requires_grad_(True) for p in _params(i, s)]
              for i, s in enumerate(sizes)]
    hyper = ({"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0})
    opt = CPUAdam([{"params": ps, **h} for ps, h in zip(params, hyper)],
                  state_dtype=state_dtype)
    flat = [p for ps in params for p in ps]
    group_of = [h for ps, h in zip(params, hyper) for _ in ps]
    ref = [[p.detach().clone().view(-1), torch.zeros(p.numel(), dtype=state_dtype),
            torch.zeros(p.numel(), dtype=state_dtype)] for p in flat]
    scales = [[torch.zeros(blocks(p.numel())) for _ in range(2)] for p in flat]
    fp32 = [p.detach().float().requires_grad_(True) for p in flat]
    torch_opt = torch.optim.AdamW([{"params": [q], **h} for q, h in zip(fp32, group_of)],
                                  foreach=False)
    def set_bf16_grads(step):
        gen = torch.Generator().manual_seed(step)
        for p in flat:
            p.grad = (torch.randn(p.shape, generator=gen) * 10.0 ** (step % 4 - 2)).bfloat16()

    for step in range(1, 11):
        set_bf16_grads(step)
        for q, p in zip(fp32, flat):
            q.grad = p.grad.float()
        opt.step()
        torch_opt.step()
        for seed, (p, (w, m, v), h, s) in enumerate(zip(flat, ref, group_of, scales), start=1):
            q8 = dict(exp_avg_absmax=s[0], exp_avg_sq_absmax=s[1]) \
                if state_dtype == torch.uint8 else {}
            adam_step_(w, p.grad.view(-1), m, v, step=step, sr_seed=seed, **h, **q8)
    for p, (w, m, v), q in zip(flat, ref, fp32):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach().view(-1).view(torch.int16), w.view(torch.int16))
        assert torch.equal(opt.state[p]["exp_avg"].view(-1), m)
        # Ten stochastic roundings, each off by under a bf16 ulp (2**-8 to 2**-7 relative):
        # a random walk of ~sqrt(10) / 2 ulps.
        err = float((p.detach().float() - q.detach()).abs().mean())
        assert err < 2 ** -6 * float(q.detach().abs().mean())
    sd = copy.deepcopy(opt.state_dict())
    again_params = [[p.detach().clone().requires_grad_(True) for p in ps] for ps in params]
    again = CPUAdam([{"params": ps} for ps in again_params])
    again.load_state_dict(copy.deepcopy(sd))
    again_flat = [p for ps in again_params for p in ps]
    for p, a in zip(flat, again_flat):
        for key, value in opt.state[p].items():
            assert again.state[a][key].dtype == value.dtype, key
            assert torch.equal(again.state[a][key], value), key
    set_bf16_grads(11)
    for a, p in zip(again_flat, flat):
        a.grad = p.grad.clone()
    opt.step()
    again.step()
    for p, a in zip(flat, again_flat):
        assert torch.equal(p.detach().view(torch.int16), a.detach().view(torch.int16))
