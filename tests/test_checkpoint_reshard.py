"""Checkpoints across layouts: two ranks resume exactly; a checkpoint of N ranks loads on M
(resharded), at another stage, and into an engine that groups the parameters into flat
parameters otherwise; every saved file is checked."""
import errno
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn as nn

from checkpoint_helpers import (BF16, F32, _differences, _engine, _full_state, _model,
                                _same_full_state, _snapshot, _train)
from dist_harness import run_ranks
from models import TinyLM, batches, flat_param_of, lm_loss
from offload_zero import OffloadEngine
from offload_zero import checkpoint as ckpt
from offload_zero.memory.tiers import NVMeStore

pytestmark = pytest.mark.usefixtures("torch_single_thread")


DIST_CASES = [(1, "cpu", F32), (2, "none", F32), (3, "nvme", F32), (3, "cpu", BF16)]


def _two_rank_job(rank, world_size, root):
    """Per case: exact resume on both ranks; then a save that fails on rank 1 only."""
    NVMeStore.CHUNK_NUMEL = 1024
    data = batches(5, seed=1, batch=2 * world_size)
    out = {}
    for stage, offload, dtype in DIST_CASES:
        folder = os.path.join(root, f"ckpt-{stage}-{offload}-{dtype}".replace("torch.", ""))
        kw = dict(stage=stage, dtype=dtype, lr=1e-2, weight_decay=0.1)
        with tempfile.TemporaryDirectory() as swap, \
                _engine(_model(0), offload, os.path.join(swap, "a"), **kw) as a:
            _train(a, data[:3], rank)
            a.save_checkpoint(folder)
            at_save = _snapshot(a)
            _train(a, data[3:], rank)
            at_end = _snapshot(a)
        with tempfile.TemporaryDirectory() as swap, \
                _engine(_model(1), offload, os.path.join(swap, "b"), **kw) as b:
            b.load_checkpoint(folder)
            after_load = _differences(_snapshot(b), at_save)
            _train(b, data[3:], rank)
            out[(stage, offload, str(dtype))] = (after_load, _differences(_snapshot(b), at_end))
            if rank == 0:  # (tensors do not travel back through the harness's queue)
                torch.save(at_end["weights"], folder + ".weights-at-end.pt")

    folder = os.path.join(root, "ckpt-failing")
    with OffloadEngine(_model(0), offload="cpu", stage=3) as a:
        _train(a, data[:1], rank)
        a.save_checkpoint(folder)
        first = _snapshot(a)
        _train(a, data[1:2], rank)
        if rank == 1:
            def failing(fp):
                raise OSError(errno.ENOSPC, "No space left on device")
            a.store.read_all = failing
        try:
            a.save_checkpoint(folder)
            error = None
        except (OSError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        if rank == 1:
            del a.store.read_all
        leftovers = sorted(os.listdir(root))
        a.load_checkpoint(folder)
        out["failing"] = (error, leftovers, _differences(_snapshot(a), first))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("two_ranks"))
    return root, run_ranks(_two_rank_job, 2, root)


@pytest.mark.parametrize("case", DIST_CASES,
                         ids=lambda c: f"stage{c[0]}-{c[1]}-{str(c[2]).replace('torch.', '')}")
def test_two_ranks_resume_exactly(two_ranks, case):
    root, results = two_ranks
    stage, offload, dtype = case
    folder = os.path.join(root, f"ckpt-{stage}-{offload}-{dtype}".replace("torch.", ""))
    assert sorted(os.listdir(folder)) == ["checkpoint.json", "rank00000.safetensors",
                                          "rank00001.safetensors"]
    for rank_result in results:
        after_load, after_training = rank_result[(stage, offload, str(dtype))]
        assert after_load == [] and after_training == []


def test_two_ranks_failed_save_raises_everywhere_and_keeps_the_checkpoint(two_ranks):
    root, results = two_ranks
    errors = [r["failing"][0] for r in results]
    assert errors[1].startswith("OSError") and "No space left" in errors[1]
    assert errors[0].startswith("RuntimeError") and "failed on rank(s) [1]" in errors[0]
    for _, leftovers, differences in (r["failing"] for r in results):
        assert not any(name.startswith(".") for name in leftovers)
        assert differences == []  # the folder still held the first checkpoint


@pytest.mark.parametrize("stage", [1, 2])
def test_a_stage_3_checkpoint_loads_at_another_stage(stage, tmp_path):
    """The stage does not change how a flat parameter is sharded: a stage-3 checkpoint loads at
    stages 1 and 2 with every weight and state element the same."""
    with OffloadEngine(_model(0), offload="cpu", stage=3) as a:
        _train(a, batches(2))
        a.save_checkpoint(tmp_path / "s3")
        want = _snapshot(a)
    with OffloadEngine(_model(1), offload="cpu", stage=stage) as b:
        b.load_checkpoint(tmp_path / "s3")
        assert _differences(_snapshot(b), want) == []


def _save_on_four(rank, world_size, folder):
    torch.manual_seed(0)
    with OffloadEngine(TinyLM(n_blocks=1), offload="cpu", stage=3) as eng:
        x, y = batches(1, batch=8)[0]
        eng.backward(lm_loss(eng(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
        eng.step()
        eng.save_checkpoint(folder)


def _load_and_report(rank, world_size, folder):
    with OffloadEngine(TinyLM(n_blocks=1), offload="cpu", stage=3) as eng:
        try:
            eng.load_checkpoint(folder)
        except ValueError as exc:
            return str(exc)
    return "loaded"


def test_every_saved_file_is_checked_when_resharding(tmp_path):
    """Saved on 4 ranks, the last one holding only padding: loaded on fewer ranks, no rank
    reads that file, yet one checks it, so a checkpoint without it, or with it damaged, is
    refused, and every rank's error names the file."""
    folder = str(tmp_path / "ck")
    run_ranks(_save_on_four, 4, folder)
    assert ckpt.read_metadata(folder)["flat_params"][0]["shard_numel"] * 3 >= 1885
    damaged = str(tmp_path / "damaged")
    shutil.copytree(folder, damaged)
    path = os.path.join(damaged, "rank00003.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 1
    open(path, "wb").write(bytes(data))
    os.remove(os.path.join(folder, "rank00003.safetensors"))
    assert _load_and_report(0, 1, folder) == f"checkpoint file {folder + '/rank00003.safetensors'!r} is missing"
    for message in run_ranks(_load_and_report, 2, damaged):
        assert "rank00003.safetensors" in message and "is corrupt" in message


@pytest.mark.parametrize("case", DIST_CASES,
                         ids=lambda c: f"stage{c[0]}-{c[1]}-{str(c[2]).replace('torch.', '')}")
def test_a_two_rank_checkpoint_loads_on_one_rank_resharded(two_ranks, case, tmp_path):
    """Saved on 2 ranks, loaded on 1: the state is the same elements bit for bit (saved again
    on 1 rank, shards joined), and training on from it on the whole batch gives the weights
    the 2-rank run reached on the two halves (the same mean gradient, summed in another
    order)."""
    root, results = two_ranks
    stage, offload, dtype = case
    name = f"ckpt-{stage}-{offload}-{dtype}".replace("torch.", "")
    folder = os.path.join(root, name)
    kw = dict(stage=stage, dtype=dtype, lr=1e-2, weight_decay=0.1)
    with _engine(_model(1), offload, tmp_path / "swap", **kw) as b:
        b.load_checkpoint(folder)
        b.save_checkpoint(tmp_path / "one")
        assert _same_full_state(_full_state(tmp_path / "one"), _full_state(folder)) == []
        _train(b, batches(5, seed=1, batch=4)[3:])
        got = b.full_state_dict()
    want = torch.load(folder + ".weights-at-end.pt")
    tol = 1e-5 if dtype == F32 else 2e-2
    assert max((got[k].float() - want[k].float()).abs().max().item() for k in want) <= tol


def _reshard_job(rank, world_size, src, dst):
    """Load ``src`` (saved on another world size) at stage 2, save it to ``dst``, train on."""
    with OffloadEngine(_model(1), offload="cpu", stage=2, lr=1e-2, weight_decay=0.1) as eng:
        eng.load_checkpoint(src)
        eng.save_checkpoint(dst)
        losses = []
        for x, y in batches(2, seed=2, batch=2 * world_size):
            loss = lm_loss(eng(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
        return losses


def test_a_one_rank_checkpoint_loads_on_three_ranks_and_back(tmp_path):
    """Saved on 1 rank (stage 3, state on NVMe), loaded on 3 ranks at stage 2 (shards that
    split the saved one at other boundaries, a last rank with padding only) and saved there,
    then loaded on 1 rank again: every saved element is the same bit for bit each time."""
    # (the plain step: its root is one flat parameter, as on the other ranks' stage 2)
    with _engine(_model(0), "nvme", tmp_path / "swap", stage=3, lr=1e-2, weight_decay=0.1,
                 update_timing="step") as a:
        _train(a, batches(3))
        a.save_checkpoint(tmp_path / "one")
    losses = run_ranks(_reshard_job, 3, str(tmp_path / "one"), str(tmp_path / "three"))
    meta = ckpt.read_metadata(tmp_path / "three")
    assert meta["world_size"] == 3 and meta["stage"] == 2
    assert _same_full_state(_full_state(tmp_path / "three"), _full_state(tmp_path / "one")) == []
    assert all(len(r) == 2 and all(torch.isfinite(torch.tensor(r))) for r in losses)
    with OffloadEngine(_model(2), offload="cpu", stage=3) as c:
        c.load_checkpoint(tmp_path / "three")
        c.save_checkpoint(tmp_path / "back")
    assert _same_full_state(_full_state(tmp_path / "back"), _full_state(tmp_path / "one")) == []


PLAIN = {"update_timing": "step"}


LINEARS = {"unit_classes": (nn.Linear,)}  # each Linear a unit, the LayerNorms in the root


ROOT_ONLY = {"unit_classes": (nn.GRU,)}   # no unit found: one root flat parameter


REGROUPINGS = [(PLAIN, dict(PLAIN, **LINEARS)),
               ({"update_timing": "next_forward"}, dict(PLAIN, **ROOT_ONLY)),
               ({"update_timing": "backward"}, dict(PLAIN, **LINEARS)),
               (dict(PLAIN, **ROOT_ONLY), {"update_timing": "backward", "offload": "cpu"})]


@pytest.mark.parametrize("save_kw,load_kw", REGROUPINGS,
                         ids=["plain-to-linears", "sif-to-root-only", "sib-to-linears",
                              "root-only-to-sib-cpu"])
def test_a_checkpoint_loads_into_an_engine_that_groups_the_root_otherwise(save_kw, load_kw,
                                                                          tmp_path):
    """Engines with other units (``unit_classes``) group the parameters into other flat
    parameters. A checkpoint of one grouping loads into the other parameter by parameter: the weights are
    the saved ones, and one more step on both engines gives the same weights bit for bit (the
    moments and step counts came along)."""
    data = batches(3, seed=5)
    a_kw = dict({"offload": "nvme", "path": str(tmp_path / "a")}, **save_kw)
    b_kw = dict({"offload": "nvme", "path": str(tmp_path / "b")}, **load_kw)
    for kw in (a_kw, b_kw):
        if kw["offload"] == "nvme":
            os.makedirs(kw["path"])
        else:
            kw.pop("path")
    with OffloadEngine(_model(0), stage=3, lr=1e-2, **a_kw) as a, \
            OffloadEngine(_model(1), stage=3, lr=1e-2, **b_kw) as b:
        assert [fp.name for fp in a.flat_params] != [fp.name for fp in b.flat_params]
        _train(a, data[:2])
        a.save_checkpoint(tmp_path / "ckpt")
        b.load_checkpoint(tmp_path / "ckpt")
        wa, wb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        _train(a, data[2:])
        _train(b, data[2:])
        wa, wb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_parameters_whose_step_counts_differ_cannot_share_a_flat_parameter(tmp_path):
    """With update_timing="backward" an overflow skips only the flat parameters that hold it, so the
    LM head's and the embeddings' step counts may differ; an engine that puts them in one flat
    parameter (no units: the root holds every parameter) cannot take both: the load is refused
    by name, and the engine is as it was."""
    with OffloadEngine(_model(0), stage=3, offload="cpu", update_timing="backward") as a:
        _train(a, batches(2))
        head = flat_param_of(a, "head.weight")
        a.step_counts[head] -= 1  # as if its update had been skipped once
        a.save_checkpoint(tmp_path / "ckpt")
    with OffloadEngine(_model(1), stage=3, offload="cpu", **ROOT_ONLY) as b:
        before = _snapshot(b)
        with pytest.raises(ValueError, match=r"one flat parameter \('root\.trainable'\) have "
                                             r"different Adam step counts in the checkpoint "
                                             r"\(emb\.weight: 2 steps; blocks\.0\.ln\.weight, .*"
                                             r"; head\.weight: 1 steps; the saving engine"):
            b.load_checkpoint(tmp_path / "ckpt")
        assert _differences(_snapshot(b), before) == []


def test_a_tied_parameter_is_found_by_any_of_its_names(tmp_path):
    """A tied weight is one parameter known by several names, listed in module order: a model
    that registers its modules in another order names it otherwise first. The load finds it
    by any of its names, and the weights are the saved ones."""
    a_model = _model(0)
    a_model.head.weight = a_model.emb.weight
    b_model = _model(1)
    b_model.head.weight = b_model.emb.weight
    b_model._modules = {"head": b_model._modules.pop("head"), **b_model._modules}
    with OffloadEngine(a_model, stage=3, offload="cpu") as a, \
            OffloadEngine(b_model, stage=3, offload="cpu") as b:
        names = lambda eng: [e.names for fp in eng.flat_params for e in fp.entries  # noqa: E731
                             if "emb.weight" in e.names][0]
        assert names(a) == ["emb.weight", "head.weight"]
        assert names(b) == ["head.weight", "emb.weight"]
        _train(a, batches(2))
        a.save_checkpoint(tmp_path / "ckpt")
        b.load_checkpoint(tmp_path / "ckpt")
        wa, wb = a.full_state_dict(), b.full_state_dict()
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
