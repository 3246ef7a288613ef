"""In-place writes to a wrapped model's parameters between steps reach the master weights, or
raise naming the parameter, at every stage, compute dtype, offload tier and world size."""
import copy
import os

import pytest
import torch

from offload_zero import OffloadEngine
from tests.dist_harness import run_ranks
from tests.models import TinyLM, batches, lm_loss

LR = 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WRITES = {  # name -> (write, expected value from a tensor of the old values)
    "fill": (lambda p: p.fill_(0.25), lambda old: torch.full_like(old, 0.25)),
    "copy": (lambda p: p.copy_(torch.full(p.shape, -0.5)), lambda old: torch.full_like(old, -0.5)),
    "mul": (lambda p: p.mul_(0.0), lambda old: torch.zeros_like(old)),
}
TARGET = "blocks.0.up.weight"


def _engine(model, stage, dtype, offload, tmp_path, **kw):
    path = str(tmp_path) if offload == "nvme" else None
    return OffloadEngine(model, offload=offload, path=path, stage=stage, dtype=dtype, lr=LR,
                         weight_decay=0.0, **kw)


def _train_step(eng, x, y):
    eng.backward(lm_loss(eng(x), y))
    eng.step()


def _write_case(stage, dtype, offload, tmp_path, write="fill"):
    """Train a step, write ``TARGET`` under no_grad, check full_state_dict, train a step more.
    Returns (written value, full_state_dict after the write, after the next step, and the
    values before the write)."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    (x, y), (x2, y2) = batches(2)
    with _engine(model, stage, dtype, offload, tmp_path) as eng:
        _train_step(eng, x, y)
        before = eng.full_state_dict()
        do, want = WRITES[write]
        with torch.no_grad():
            do(model.blocks[0].up.weight)
        after_write = eng.full_state_dict()
        _train_step(eng, x2, y2)
        after_step = eng.full_state_dict()
    return want(before[TARGET]), before, after_write, after_step


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_write_reaches_master(stage, dtype, offload, tmp_path):
    """The written value is the master (full_state_dict shows it exactly), the other
    parameters keep their full-precision masters, and the next step starts from it (within
    one Adam step of it), whether the parameters are kept gathered or only shards. (bf16/fp16
    writes were thrown away: the next step started from the old fp32 master; at stage 3 on
    NVMe they raised.)"""
    want, before, after_write, after_step = _write_case(stage, DTYPES[dtype], offload, tmp_path)
    assert torch.equal(after_write[TARGET], want)
    for name, value in before.items():
        if name != TARGET:
            assert torch.equal(after_write[name], value), name
    # Adam moves each weight by at most about lr per step (bias-corrected first steps)
    assert (after_step[TARGET] - want).abs().max().item() <= 3 * LR


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (2, "cpu"), (3, "cpu"), (3, "nvme")])
def test_write_then_step_matches_torch_adamw_fp32(stage, offload, write, tmp_path):
    """fp32: after the write, the next forward and step equal torch AdamW on an unwrapped
    copy given the same write."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    do, _ = WRITES[write]
    (x, y), (x2, y2) = batches(2)
    with _engine(model, stage, torch.float32, offload, tmp_path) as eng:
        _train_step(eng, x, y)
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            do(model.blocks[0].up.weight)
            do(ref.blocks[0].up.weight)
        out = eng(x2)
        ref_out = ref(x2)
        assert (out - ref_out).abs().max().item() < 1e-5
        eng.backward(lm_loss(out, y2))
        eng.step()
        lm_loss(ref_out, y2).backward()
        opt.step()
        sd = eng.full_state_dict()
    for name, p in ref.named_parameters():
        assert (sd[name] - p.detach()).abs().max().item() < 1e-5, name


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_write_between_backward_and_step(dtype, tmp_path):
    """A write after backward, before step: the step starts from the written value."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    (x, y), = batches(1)
    with _engine(model, 2, DTYPES[dtype], "cpu", tmp_path) as eng:
        eng.backward(lm_loss(eng(x), y))
        with torch.no_grad():
            model.blocks[1].down.weight.fill_(0.25)
        eng.step()
        got = eng.full_state_dict()["blocks.1.down.weight"]
    assert (got - 0.25).abs().max().item() <= 3 * LR


def test_write_to_frozen_parameter_reaches_forward_and_export(tmp_path):
    """A frozen parameter's write lands in its shard: the next forward and the export see it."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    model.blocks[0].ln.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    (x, y), = batches(1)
    with _engine(model, 1, torch.bfloat16, "none", tmp_path) as eng:
        with torch.no_grad():
            model.blocks[0].ln.weight.fill_(2.0)
            ref.blocks[0].ln.weight.fill_(2.0)
        got = eng(x).float()
        assert torch.equal(eng.full_state_dict()["blocks.0.ln.weight"], torch.full((24,), 2.0))
    assert (got - ref(x)).abs().max().item() < 0.1  # (bf16 compute)


def _world2_case(rank, world, stage, dtype, offload, path):
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    (x, y), = batches(1, seed=rank)
    eng = _engine(model, stage, dtype, offload, path)
    try:
        _train_step(eng, x, y)
        with torch.no_grad():
            model.blocks[0].up.weight.fill_(0.25)
        sd = eng.full_state_dict()
        _train_step(eng, x, y)
        stepped = eng.full_state_dict()[TARGET]
        return ("ok", bool(torch.equal(sd[TARGET], torch.full_like(sd[TARGET], 0.25))),
                (stepped - 0.25).abs().max().item())
    finally:
        eng.close()


WORLD2_CASES = [(s, d, o) for s in (1, 2, 3) for d in (torch.float32, torch.bfloat16, torch.float16)
                for o in ("none", "cpu", "nvme")]


def _world2_grid(rank, world, path):
    out = []
    for i, (stage, dtype, offload) in enumerate(WORLD2_CASES):
        case_path = os.path.join(path, f"case{i}")
        os.makedirs(case_path, exist_ok=True)
        out.append(_world2_case(rank, world, stage, dtype, offload, case_path))
    return out


@pytest.fixture(scope="module")
def world2_results(tmp_path_factory):
    """Every (stage, dtype, offload) of :data:`WORLD2_CASES` in one launch of two ranks."""
    return run_ranks(_world2_grid, 2, str(tmp_path_factory.mktemp("world2")), timeout_s=600)


@pytest.mark.parametrize("case", range(len(WORLD2_CASES)),
                         ids=[f"stage{s}-{str(d).split('.')[-1]}-{o}" for s, d, o in WORLD2_CASES])
def test_write_at_world_size_2(world2_results, case):
    """Two gloo ranks writing the same value: each rank's shard of the master takes it, the
    gathered copies (stages 1 and 2) and the shards (stage 3) alike."""
    for res in (world2_results[0][case], world2_results[1][case]):
        assert res[0] == "ok" and res[1] and res[2] <= 3 * LR, (WORLD2_CASES[case], res)


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
def test_write_through_data_is_seen_or_raises(stage, offload, tmp_path):
    """``p.data.fill_(...)`` (as weight-init code writes, with autograd on) reaches the
    master in bf16; torch's own ``.data`` would hide the write from the version counter, and
    then it was lost."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    with _engine(model, stage, torch.bfloat16, offload, tmp_path) as eng:
        model.blocks[0].up.weight.data.fill_(0.25)
        assert torch.equal(eng.full_state_dict()[TARGET], torch.full((37, 24), 0.25))


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
def test_replacing_data_raises_naming_the_parameter(stage, offload, tmp_path):
    """model.half() while wrapped would detach the parameters from the engine: it raises
    naming one; model.to(where it is) is accepted."""
    model = TinyLM(n_blocks=2)
    with _engine(model, stage, torch.float32, offload, tmp_path) as eng:
        model.to(eng.device)
        model.to(eng.device, torch.float32)
        x, y = batches(1)[0]
        _train_step(eng, x, y)
        with pytest.raises(RuntimeError, match=r"parameter '.*'.*before wrapping"):
            model.half()


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "nvme")])
def test_reference_taken_before_wrapping(stage, offload, tmp_path):
    """A parameter object taken before wrapping is the wrapped model's parameter: a write
    through it reaches the master (bf16); after close it is empty."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    w = model.blocks[0].up.weight
    with _engine(model, stage, torch.bfloat16, offload, tmp_path) as eng:
        assert model.blocks[0].up.weight is w and w.shape == (37, 24)
        with torch.no_grad():
            w.fill_(0.25)
        assert torch.equal(eng.full_state_dict()[TARGET], torch.full((37, 24), 0.25))
    assert type(w) is torch.nn.Parameter and w.numel() == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sharded_writes_elementwise_only(dtype, tmp_path):
    """Stage 3 with the parameters on NVMe: torch.nn.init's functions (those that look at the
    shape too) and element-wise in-place methods reach the master (the same values as on the
    unwrapped model from the same seed), a write under
    autograd raises as torch's does, and a write that is not element-wise raises naming the
    parameter and load_state_dict."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    ref = copy.deepcopy(model)
    with _engine(model, 3, DTYPES[dtype], "nvme", tmp_path) as eng:
        for m in (model, ref):
            torch.manual_seed(5)
            torch.nn.init.normal_(m.blocks[1].up.weight, std=0.5)
            torch.nn.init.zeros_(m.blocks[1].up.bias)
            torch.nn.init.kaiming_uniform_(m.blocks[1].down.weight)
            with torch.no_grad():
                m.blocks[0].ln.weight.uniform_(-1, 1)
        sd = eng.full_state_dict()
        for name in ("blocks.1.up.weight", "blocks.1.up.bias", "blocks.1.down.weight",
                     "blocks.0.ln.weight"):
            assert torch.equal(sd[name], dict(ref.named_parameters())[name].detach()), name
        with pytest.raises(RuntimeError, match="leaf Variable"):
            model.blocks[0].up.weight.fill_(1.0)
        with torch.no_grad(), pytest.raises(
                RuntimeError, match=r"'blocks\.0\.up\.weight'.*load_state_dict"):
            model.blocks[0].up.weight.index_fill_(0, torch.tensor([0]), 1.0)
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"'blocks\.0\.up\.weight'"):
            model.blocks[0].up.weight[0].fill_(1.0)
        with pytest.raises(RuntimeError, match=r"'blocks\.0\.down\.weight'"):
            torch.nn.init.orthogonal_(model.blocks[0].down.weight)  # (shape ops of its own)


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
def test_zero_dim_parameter(stage, offload, tmp_path):
    """A 0-d parameter is registered with its shape () and a write to it reaches the master
    (building a stage-3 placeholder for one failed)."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    model.temperature = torch.nn.Parameter(torch.tensor(1.5))
    with _engine(model, stage, torch.bfloat16, offload, tmp_path) as eng:
        assert model.temperature.shape == () and model.temperature.numel() == 1
        with torch.no_grad():
            model.temperature.fill_(2.0)
        assert eng.full_state_dict()["temperature"].item() == 2.0


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "cpu"), (3, "nvme")])
def test_write_with_update_in_backward(stage, offload, tmp_path):
    """With update_timing="backward" (the update runs inside backward) a write between steps is taken
    in as the next forward starts: the update starts from it."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    (x, y), (x2, y2) = batches(2)
    with _engine(model, stage, torch.bfloat16, offload, tmp_path, update_timing="backward") as eng:
        _train_step(eng, x, y)
        with torch.no_grad():
            model.blocks[0].up.weight.fill_(0.25)
        _train_step(eng, x2, y2)
        got = eng.full_state_dict()[TARGET]
    assert 0 < (got - 0.25).abs().max().item() <= 3 * LR


def test_sharded_write_through_data_of_data(tmp_path):
    """``p.data.data.mul_`` at stage 3 on NVMe reaches the master like ``p.mul_``."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    with _engine(model, 3, torch.float32, "nvme", tmp_path) as eng:
        before = eng.full_state_dict()[TARGET]
        model.blocks[0].up.weight.data.data.mul_(2.0)
        assert torch.equal(eng.full_state_dict()[TARGET], before * 2)
