"""Loss scaling for float16 training: the scaler's schedule, the engine against a plain torch
reference that does the same thing by hand (fp16 copy for forward/backward, fp32 master
weights updated by torch.optim.AdamW on unscaled gradients, whole step skipped on inf/nan),
and bad settings."""
import copy

import pytest
import torch

from models import BackwardFault, TinyLM, batches, lm_loss
from offload_zero import OffloadEngine
from offload_zero.optim import CPUAdam
from offload_zero.optim.loss_scale import LossScaler

LR, WD = 1e-2, 0.1


def _scaled_loss(model, x, y, loss_mult, fault=None):
    logits = model(x)
    if fault is not None:
        logits = BackwardFault.apply(logits, fault)
    return lm_loss(logits, y) * loss_mult


def _reference(model, data, init_scale, window, loss_mult, faults=(), opt_cls=None):
    """fp16 forward/backward on a copy, scaled loss, fp32 masters stepped by torch AdamW (or
    ``opt_cls``) on the gradients divided by the scale; a step with any inf/nan gradient is
    skipped and halves the scale, ``window`` good steps in a row double it. Returns (masters
    by name, scales seen)."""
    half = copy.deepcopy(model).half()
    names = [n for n, _ in model.named_parameters()]
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    opt = (opt_cls(masters.values(), lr=LR, weight_decay=WD) if opt_cls else
           torch.optim.AdamW(masters.values(), lr=LR, weight_decay=WD, foreach=False))
    scale, good, scales = init_scale, 0, []
    for i, (x, y) in enumerate(data):
        scales.append(scale)
        half.zero_grad(set_to_none=True)
        loss = _scaled_loss(half, x, y, loss_mult, "nan" if i in faults else None)
        (loss.float() * scale).backward()
        grads = {n: p.grad.float() * (1.0 / scale) for n, p in half.named_parameters()}
        if not all(torch.isfinite(g).all() for g in grads.values()):
            scale, good = max(1.0, scale / 2), 0
            continue
        for n in names:
            masters[n].grad = grads[n]
        opt.step()
        with torch.no_grad():
            for n, p in half.named_parameters():
                p.copy_(masters[n].half())
        good += 1
        if good == window:
            scale, good = scale * 2, 0
    return {n: t.detach() for n, t in masters.items()}, scales


def _train(model, data, loss_mult, faults=(), **kw):
    eng = OffloadEngine(model, lr=LR, weight_decay=WD, dtype=torch.float16, **kw)
    scales = []
    for i, (x, y) in enumerate(data):
        scales.append(eng.loss_scaler.scale)
        eng.backward(_scaled_loss(eng, x, y, loss_mult, "nan" if i in faults else None))
        eng.step()
    return eng, scales


@pytest.mark.parametrize("offload,stage", [("none", 3), ("cpu", 1), ("cpu", 2), ("cpu", 3),
                                           ("nvme", 3)])
def test_dynamic_loss_scale_matches_the_hand_made_reference(offload, stage, tmp_path):
    """From a scale so high that fp16 gradients overflow, the scale halves step by step (each
    such step skipped whole), then trains and doubles after ``loss_scale_window`` good steps; an
    injected nan skips one more step. The scale's path equals the reference's, and so do the
    weights: bit for bit when the reference steps with the engine's own Adam kernel (CPUAdam),
    to 1e-5 with torch's AdamW (its float rounding, carried through the fp16 copies)."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=3)
    data = batches(12)
    want, want_scales = _reference(model, data, 2.0 ** 20, 3, 1.0, faults=(8,))
    same, _ = _reference(model, data, 2.0 ** 20, 3, 1.0, faults=(8,), opt_cls=CPUAdam)
    eng, scales = _train(model, data, 1.0, faults=(8,), offload=offload, stage=stage,
                         path=str(tmp_path) if offload == "nvme" else None,
                         initial_loss_scale=2.0 ** 20, loss_scale_window=3)
    with eng:
        got = eng.full_state_dict()
        assert scales == want_scales
        assert scales[0] > scales[-1] >= 1 and max(scales[1:]) > min(scales)  # went down, then up
        skipped = sum(1 for a, b in zip(want_scales, want_scales[1:]) if b < a)
        assert eng.skipped_steps == eng.loss_scaler.overflows == skipped >= 2
        assert all(torch.equal(got[n], w) for n, w in same.items())
        assert max((got[n] - w).abs().max().item() for n, w in want.items()) <= 1e-5


def test_an_overflowing_step_changes_nothing(tmp_path):
    """A step whose gradients overflow leaves every weight and moment as it was: the whole step
    is skipped, also the flat parameters whose gradients are finite (the LM head and the block
    after the nan), and the scale halves."""
    torch.manual_seed(1)
    model = TinyLM(n_blocks=3)
    bad = {"on": False}
    model.blocks[1].register_forward_hook(
        lambda mod, args, out: BackwardFault.apply(out, "nan" if bad["on"] else None))
    (x, y), = batches(1)
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), dtype=torch.float16, lr=LR,
                       initial_loss_scale=2.0 ** 10) as eng:
        eng.backward(_scaled_loss(eng, x, y, 1.0))
        eng.step()
        assert eng.skipped_steps == 0
        weights = eng.full_state_dict()  # (applies the updates step() left for the forward)
        before = {fp.name: eng.store.read_all(fp) for fp in eng.trainable}
        bad["on"] = True  # nan in the gradients of blocks 0-1 and the embeddings only
        eng.backward(_scaled_loss(eng, x, y, 1.0))
        eng.step()
        assert eng.skipped_steps == 1 and eng.loss_scaler.scale == 2.0 ** 9
        after = eng.full_state_dict()
        assert all(torch.equal(weights[n], after[n]) for n in weights)
        for fp in eng.trainable:
            assert all(torch.equal(a, b) for a, b in zip(before[fp.name], eng.store.read_all(fp)))


def test_scaling_keeps_gradients_that_fp16_flushes_to_zero(tmp_path):
    """A loss so small that its fp16 gradients underflow: without a scale (loss_scale=1) nothing
    learns (AdamW without decay leaves every weight as it was); with the dynamic scale the
    weights move, and match the reference."""
    torch.manual_seed(2)
    model = TinyLM(n_blocks=2)
    data = batches(3)
    tiny = 2.0 ** -30
    global WD
    wd, WD = WD, 0.0
    try:
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        eng, _ = _train(copy.deepcopy(model), data, tiny, offload="cpu", loss_scale=1.0)
        with eng:
            flat = eng.full_state_dict()
            assert all(torch.equal(flat[n], init[n]) for n in init)
        want, _ = _reference(model, data, 2.0 ** 16, 2000, tiny)
        eng, _ = _train(model, data, tiny, offload="cpu")
        with eng:
            got = eng.full_state_dict()
            moved = sum(int((got[n] != init[n]).sum()) for n in init)
            assert moved > 0.9 * sum(t.numel() for t in init.values())
            assert max((got[n] - w).abs().max().item() for n, w in want.items()) <= 1e-6
    finally:
        WD = wd


def test_update_in_backward_skips_only_what_overflowed_and_halves_the_scale(tmp_path):
    """With update_timing="backward" the flat parameters updated before the nan reached backward keep
    their update (blocks, LM head); the one holding the nan (the embeddings, last in backward)
    is skipped, and the scale halves."""
    torch.manual_seed(3)
    model = TinyLM(n_blocks=3)
    model.emb.register_forward_hook(lambda mod, args, out: BackwardFault.apply(out, "nan"))
    (x, y), = batches(1)
    with OffloadEngine(model, offload="cpu", dtype=torch.float16, lr=LR, update_timing="backward",
                       initial_loss_scale=2.0 ** 8) as eng:
        before = eng.full_state_dict()
        eng.backward(_scaled_loss(eng, x, y, 1.0))
        eng.step()
        after = eng.full_state_dict()
        assert eng.skipped_steps == 1 and eng.loss_scaler.scale == 2.0 ** 7
        assert torch.equal(before["emb.weight"], after["emb.weight"])
        for name in ("head.weight", "blocks.0.up.weight", "blocks.2.down.bias"):
            assert not torch.equal(before[name], after[name]), name


def test_loss_scale_defaults_by_dtype():
    """fp16 scales dynamically by default; fp32 and bf16 do not scale unless asked."""
    def scaler(**kw):
        with OffloadEngine(TinyLM(n_blocks=1), offload="cpu", **kw) as eng:
            return eng.loss_scaler
    assert scaler(dtype=torch.float16).dynamic and scaler(dtype=torch.float16).scale == 2.0 ** 16
    assert scaler() is None and scaler(dtype=torch.bfloat16) is None
    static = scaler(loss_scale=128.0)
    assert not static.dynamic and static.scale == 128.0


@pytest.mark.parametrize("kw,match", [
    ({"loss_scale": "auto"}, r"loss_scale='auto' is not valid; use 'dynamic'"),
    ({"loss_scale": -1.0}, r"loss_scale=-1.0 is not valid"),
    ({"loss_scale": float("inf")}, r"loss_scale=inf is not valid"),
    ({"dtype": torch.float16, "loss_scale_window": 0}, r"loss_scale_window=0 is not valid"),
    ({"dtype": torch.float16, "initial_loss_scale": 0.0}, r"initial_loss_scale=0.0 is not valid"),
    ({"dtype": torch.float16, "min_loss_scale": 8.0, "initial_loss_scale": 4.0},
     r"initial_loss_scale=4.0 must lie in \[min_loss_scale=8.0"),
])
def test_bad_loss_scale_settings_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(n_blocks=1), **kw)


def test_scaler_schedule_and_state_round_trip():
    """Halves on overflow down to min_scale, doubles after growth_interval good steps up to
    max_scale; an overflow restarts the count; state_dict restores all of it."""
    s = LossScaler(8.0, growth_interval=2, min_scale=2.0, max_scale=32.0)
    path = []
    for overflow in [True, True, True, False, False, False, True, False, False, False, False,
                     False, False]:
        s.update(overflow)
        path.append(s.scale)
    assert path == [4, 2, 2, 2, 4, 4, 2, 2, 4, 4, 8, 8, 16]
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 16.0, "good_steps": 0, "overflows": 4,
                                                "dynamic": True}
    static = LossScaler(64.0, dynamic=False)
    for overflow in (True, False, False):
        static.update(overflow)
    assert static.scale == 64.0 and static.overflows == 1
    good = {"scale": 4.0, "good_steps": 1, "overflows": 0}
    for bad, match in [({"scale": float("nan")}, r"scale=nan; it must be a finite number in"),
                       ({"scale": 0.5}, r"scale=0.5; it must be a finite number in \[min_scale=1"),
                       ({"scale": 2.0 ** 30}, r"max_scale=1.67772e\+07"),
                       ({"good_steps": -1}, r"good_steps=-1; it must be an int >= 0"),
                       ({"overflows": 1.5}, r"overflows=1.5; it must be an int >= 0"),
                       ({"dynamic": False}, r"state is of a static loss scale but this scaler "
                                            r"is dynamic")]:
        with pytest.raises(ValueError, match=match):
            t.load_state_dict({**good, **bad})
        assert t.state_dict()["scale"] == 16.0  # unchanged
    static.load_state_dict({"scale": 8.0, "good_steps": 0, "overflows": 2, "dynamic": False})
    assert static.scale == 64.0 and static.overflows == 2  # a static scale is a setting
    with pytest.raises(ValueError, match=r"lacks \['overflows'\]"):
        t.load_state_dict({"scale": 1.0, "good_steps": 0})


@pytest.mark.parametrize("kw,match", [
    ({"dtype": torch.bfloat16, "initial_loss_scale": 1024.0, "loss_scale_window": 5},
     r"initial_loss_scale=1024.0, loss_scale_window=5 not used: loss scaling is off"),
    ({"dtype": torch.float16, "loss_scale": 128.0, "min_loss_scale": 4.0},
     r"min_loss_scale=4.0 not used: the loss scale is static \(loss_scale=128.0\)"),
])
def test_loss_scale_knobs_without_a_dynamic_scale_warn(kw, match):
    with pytest.warns(UserWarning, match=match):
        OffloadEngine(TinyLM(n_blocks=1), **kw).close()


def test_overflow_at_the_minimum_scale_warns(caplog):
    """Halving cannot go on below min_scale: an overflow there says that scaling cannot help."""
    s = LossScaler(4.0, min_scale=2.0)
    with caplog.at_level("WARNING", logger="offload_zero"):
        s.update(True)
        assert s.scale == 2.0 and not caplog.records
        s.update(True)
    assert s.scale == 2.0 and "loss scale at its minimum 2" in caplog.records[0].getMessage()
