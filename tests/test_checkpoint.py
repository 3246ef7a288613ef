"""Training checkpoints: an exact resume on every tier and stage, on one and two ranks; a failed
save keeps the previous checkpoint; a damaged or mismatched checkpoint is refused by name and
leaves the engine as it was."""
import errno
import json
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks
from models import Block, TinyLM, batches, flat_param_of, lm_loss
from offload_zero import OffloadEngine
from offload_zero import checkpoint as ckpt
from offload_zero.memory.tiers import NVMeStore

F32, BF16 = torch.float32, torch.bfloat16
pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _model(seed, n_blocks=3):
    """TinyLM with a frozen tensor beside trainable ones (block 1's LayerNorm weight), its
    values drawn from ``seed`` so that two seeds differ everywhere, frozen values included."""
    torch.manual_seed(seed)
    model = TinyLM(n_blocks=n_blocks)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.blocks[1].ln.weight.requires_grad_(False)
    return model


def _engine(model, offload, swap_dir, **kw):
    path = None
    if offload == "nvme":
        os.makedirs(swap_dir, exist_ok=True)
        path = str(swap_dir)
    return OffloadEngine(model, offload=offload, path=path, **kw)


def _train(eng, data, rank=None, per_rank=2):
    for x, y in data:
        if rank is not None:
            lo, hi = rank * per_rank, (rank + 1) * per_rank
            x, y = x[lo:hi], y[lo:hi]
        eng.backward(lm_loss(eng(x), y))
        eng.step()


def _snapshot(eng):
    """Everything a resume must restore: the exported weights, every flat parameter's shard,
    master weights, moments and step count, lr and skipped_steps."""
    state = {}
    for fp in eng.flat_params:
        shard = fp.home.read(fp) if fp.home is not None else fp.sharded.detach().cpu().clone()
        state[f"{fp.name}/param"] = shard
        if fp.requires_grad:
            for key, t in zip(("master", "exp_avg", "exp_avg_sq"), eng.store.read_all(fp)):
                state[f"{fp.name}/{key}"] = t
            state[f"{fp.name}/step"] = eng._step_count[fp]
    return {"weights": eng.full_state_dict(), "state": state, "lr": eng.lr,
            "skipped_steps": eng.skipped_steps}


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _differences(got, want):
    """Names of the entries that are not identical bit for bit (empty when all are)."""
    bad = [k for k in ("lr", "skipped_steps") if got[k] != want[k]]
    for part in ("weights", "state"):
        g, w = got[part], want[part]
        if g.keys() != w.keys():
            bad.append(f"{part} keys")
            continue
        for k in w:
            if isinstance(w[k], torch.Tensor):
                same = (g[k].dtype == w[k].dtype and g[k].shape == w[k].shape
                        and torch.equal(_bits(g[k]), _bits(w[k])))
            else:
                same = g[k] == w[k]
            if not same:
                bad.append(f"{part}[{k}]")
    return bad


def _assert_identical(got, want):
    assert not _differences(got, want)


# -- exact resume on one rank ---------------------------------------------------------------------

RESUME_CASES = (
    [(o, s, F32, {}) for o in ("none", "cpu", "nvme") for s in (1, 2, 3)]
    + [("cpu", 3, F32, {"offload_param": "cpu"}),  # parameter shards in host memory
       ("cpu", 3, BF16, {"offload_param": "cpu"}),
       ("nvme", 3, BF16, {}),
       ("nvme", 3, F32, {"update_timing": "backward"}),
       # the embeddings' state in host memory (the default with update_timing="backward" here) or not
       ("nvme", 3, F32, {"update_timing": "backward", "tail_state_in_host": False}),
       ("nvme", 2, BF16, {"update_timing": "backward", "tail_state_in_host": True})])


@pytest.mark.parametrize("offload,stage,dtype,extra", RESUME_CASES,
                         ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, dict)
                         else "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_resume_is_exact(offload, stage, dtype, extra, tmp_path, monkeypatch):
    """Train A 3 steps, save, 2 more; B (another init, another lr) loads and trains the same 2
    steps: weights, shards, masters, moments, step counts and lr equal A's bit for bit, right
    after the load and at the end."""
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)  # NVMe state streams in several chunks
    data = batches(5)
    kw = dict(stage=stage, dtype=dtype, lr=1e-2, weight_decay=0.1, **extra)
    folder = tmp_path / "ckpt"
    with _engine(_model(0), offload, tmp_path / "swap_a", **kw) as a:
        _train(a, data[:3])
        a.set_lr(5e-3)  # B is built with lr=1e-2: the load must restore this one
        a.save_checkpoint(folder)
        at_save = _snapshot(a)
        _train(a, data[3:])
        at_end = _snapshot(a)
    assert sorted(os.listdir(folder)) == ["checkpoint.json", "rank00000.safetensors"]
    with _engine(_model(1), offload, tmp_path / "swap_b", **kw) as b:
        assert _differences(_snapshot(b), at_save)  # a different start: the load must change it
        b.load_checkpoint(folder)
        _assert_identical(_snapshot(b), at_save)
        _train(b, data[3:])
        _assert_identical(_snapshot(b), at_end)


def test_resume_on_another_tier(tmp_path):
    """Saved from NVMe, loaded into host memory: the tiers may differ, the numbers do not."""
    data = batches(4)
    kw = dict(stage=3, dtype=BF16, lr=1e-2)
    with _engine(_model(0), "nvme", tmp_path / "swap", **kw) as a:
        _train(a, data[:2])
        a.save_checkpoint(tmp_path / "ckpt")
        _train(a, data[2:])
        expected = _snapshot(a)["weights"]
    with _engine(_model(1), "cpu", None, offload_param="cpu", **kw) as b:
        b.load_checkpoint(tmp_path / "ckpt")
        _train(b, data[2:])
        got = b.full_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_resume_with_the_tail_state_moved_between_host_and_nvme(tmp_path):
    """The embeddings' state saved from host memory (tail_state_in_host) loads into an engine
    that keeps it on NVMe, and back: the same weights as the uninterrupted run."""
    data = batches(4)
    kw = dict(stage=3, dtype=F32, lr=1e-2, weight_decay=0.1, update_timing="backward")
    for saved, loaded in ((True, False), (False, True)):
        run = tmp_path / f"run-{saved}"
        with _engine(_model(0), "nvme", run / "swap_a", tail_state_in_host=saved, **kw) as a:
            assert a.store.in_host(a.root.flat_params[-1]) is saved
            _train(a, data[:2])
            a.save_checkpoint(run / "ckpt")
            _train(a, data[2:])
            expected = _snapshot(a)
        with _engine(_model(1), "nvme", run / "swap_b", tail_state_in_host=loaded, **kw) as b:
            b.load_checkpoint(run / "ckpt")
            _train(b, data[2:])
            _assert_identical(_snapshot(b), expected)


def test_fp16_loss_scale_and_counters_are_restored(tmp_path):
    """fp16 with a dynamic loss scale that overflowed (skipped steps) and grew back: B resumes
    with A's scale, its count of good steps and skipped_steps, and the next steps match A's
    bit for bit, scale included. A checkpoint without a scaler does not load into an engine
    with one."""
    data = batches(7)
    kw = dict(dtype=torch.float16, lr=1e-2, initial_loss_scale=2.0 ** 20, loss_scale_window=2)
    with OffloadEngine(_model(0), offload="cpu", **kw) as a:
        _train(a, data[:5])
        assert a.skipped_steps >= 1
        a.save_checkpoint(tmp_path / "ckpt")
        at_save = (_snapshot(a), a.loss_scaler.state_dict())
        _train(a, data[5:])
        at_end = (_snapshot(a), a.loss_scaler.state_dict())
    meta = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    assert meta["loss_scaler"] == at_save[1]
    with OffloadEngine(_model(1), offload="cpu", **{**kw, "initial_loss_scale": 2.0 ** 16}) as b:
        b.load_checkpoint(tmp_path / "ckpt")
        _assert_identical(_snapshot(b), at_save[0])
        assert b.loss_scaler.state_dict() == at_save[1]
        _train(b, data[5:])
        _assert_identical(_snapshot(b), at_end[0])
        assert b.loss_scaler.state_dict() == at_end[1]
    with OffloadEngine(_model(0), offload="cpu") as c:
        c.save_checkpoint(tmp_path / "plain")
    with OffloadEngine(_model(1), offload="cpu", loss_scale=128.0) as d:
        with pytest.raises(ValueError, match="loss_scaler is 'absent' in the checkpoint but "
                                             "'present' in this engine"):
            d.load_checkpoint(tmp_path / "plain")


# -- atomic save ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fail_at", ["read_all", "metadata", "exchange"])
def test_failed_save_keeps_the_previous_checkpoint(fail_at, tmp_path, monkeypatch):
    """A save that fails half-way through this rank's file (the disk is full), while writing
    the metadata, or while swapping the folders leaves the first checkpoint loadable, and no
    temporary folder behind."""
    data = batches(3)
    folder = tmp_path / "ckpt"
    with OffloadEngine(_model(0), offload="cpu", stage=3) as a:
        _train(a, data[:1])
        a.save_checkpoint(folder)
        first = _snapshot(a)
        _train(a, data[1:])
        if fail_at == "read_all":
            read_all, calls = a.store.read_all, []

            def failing(fp):
                calls.append(fp)
                if len(calls) > 2:  # two flat parameters are in the file already
                    raise OSError(errno.ENOSPC, "No space left on device")
                return read_all(fp)
            monkeypatch.setattr(a.store, "read_all", failing)
        else:
            def failing(*args):
                raise OSError(errno.EIO, "Input/output error")
            monkeypatch.setattr(ckpt, {"metadata": "_write_text", "exchange": "_exchange"}[fail_at],
                                failing)
        with pytest.raises(OSError):
            a.save_checkpoint(folder)
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .ckpt.saving left
        monkeypatch.undo()
        latest = _snapshot(a)
    with OffloadEngine(_model(1), offload="cpu", stage=3) as b:
        b.load_checkpoint(folder)
        _assert_identical(_snapshot(b), first)
        assert _differences(first, latest)  # the failed save would have changed the folder


def test_save_replaces_a_checkpoint_without_rename_exchange(tmp_path, monkeypatch):
    """Where folders cannot be exchanged atomically, two renames replace the checkpoint."""
    monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)
    with OffloadEngine(_model(0), offload="cpu") as a:
        a.save_checkpoint(tmp_path / "ckpt")
        _train(a, batches(1))
        a.save_checkpoint(tmp_path / "ckpt")
        expected = _snapshot(a)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    with OffloadEngine(_model(1), offload="cpu") as b:
        b.load_checkpoint(tmp_path / "ckpt")
        _assert_identical(_snapshot(b), expected)


def test_save_never_replaces_a_folder_of_other_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    with OffloadEngine(_model(0), offload="cpu") as a:
        with pytest.raises(ValueError, match="is not an offload-zero checkpoint.*notes.txt"):
            a.save_checkpoint(tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["notes.txt"]


# -- damaged and mismatched checkpoints -----------------------------------------------------------

def _damage(folder, how):
    rank_file = folder / "rank00000.safetensors"
    if how == "missing rank file":
        rank_file.unlink()
    elif how == "truncated":
        os.truncate(rank_file, rank_file.stat().st_size - 100)
    elif how == "flipped byte":  # in the data, far from the header
        raw = bytearray(rank_file.read_bytes())
        raw[-5000] ^= 0x10
        rank_file.write_bytes(bytes(raw))
    elif how == "missing metadata":
        (folder / "checkpoint.json").unlink()


@pytest.mark.parametrize("how,names", [("missing rank file", "rank00000.safetensors"),
                                       ("truncated", "rank00000.safetensors"),
                                       ("flipped byte", "rank00000.safetensors.*is corrupt"),
                                       ("missing metadata", "checkpoint.json")])
def test_damaged_checkpoint_is_refused_and_changes_nothing(how, names, tmp_path):
    with OffloadEngine(_model(0), offload="cpu", stage=2) as a:
        _train(a, batches(1))
        a.save_checkpoint(tmp_path / "ckpt")
    _damage(tmp_path / "ckpt", how)
    with OffloadEngine(_model(1), offload="cpu", stage=2) as b:
        before = _snapshot(b)
        with pytest.raises(ValueError, match=names):
            b.load_checkpoint(tmp_path / "ckpt")
        _assert_identical(_snapshot(b), before)


class _TwoShapes(nn.Module):
    """A bias-free Linear whose weight is (rows, cols): (6, 4) and (4, 6) have the same numel."""

    def __init__(self, rows, cols):
        super().__init__()
        self.lin = nn.Linear(cols, rows, bias=False)


def _wider_block_model():
    model = _model(0)
    model.blocks[0] = Block(hidden=41)
    return model


MISMATCHES = [
    ("depth", lambda: (_model(0, n_blocks=4), {}),
     r"parameter 'blocks\.3\.ln\.weight' of this engine is not in the checkpoint"),
    ("width", lambda: (_wider_block_model(), {}),
     r"parameter 'blocks\.0\.up\.weight' shape is \[37, 24\] in the checkpoint but \[41, 24\]"),
]


@pytest.mark.parametrize("what,make,message", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatched_engine_is_refused_by_field(what, make, message, tmp_path):
    with OffloadEngine(_model(0), offload="cpu", stage=3) as a:
        _train(a, batches(1))
        a.save_checkpoint(tmp_path / "ckpt")
    model, kw = make()
    with OffloadEngine(model, offload="cpu", **{"stage": 3, **kw}) as b:
        with pytest.raises(ValueError, match=message):
            b.load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("offload,extra", [("cpu", {"offload_param": "cpu"}), ("nvme", {})],
                         ids=["cpu", "nvme"])
def test_a_checkpoint_loads_into_another_compute_dtype(offload, extra, tmp_path):
    """The master weights are fp32 in every compute dtype: a bf16 run's checkpoint loads into
    an fp32 engine (the weights, masters, moments and step counts bit for bit), whose own fp32
    checkpoint loads back into a bf16 engine with the bf16 parameter shards derived from the
    masters: that engine then equals the bf16 run that went on uninterrupted, bit for bit."""
    data = batches(5)
    kw = dict(stage=3, lr=1e-2, weight_decay=0.1, **extra)
    with _engine(_model(0), offload, tmp_path / "swap_a", dtype=BF16, **kw) as a:
        _train(a, data[:3])
        a.save_checkpoint(tmp_path / "bf16")
        at_save = _snapshot(a)
        _train(a, data[3:])
        at_end = _snapshot(a)
    with _engine(_model(1), offload, tmp_path / "swap_f", dtype=F32, **kw) as f:
        f.load_checkpoint(tmp_path / "bf16")
        assert not _same_full_state(f.full_state_dict(), at_save["weights"])
        f.save_checkpoint(tmp_path / "fp32")
    saved_bf16, saved_fp32 = _full_state(tmp_path / "bf16"), _full_state(tmp_path / "fp32")
    state = [k for k in saved_bf16 if not k.endswith("/param")]  # (fp32 holds no trainable param)
    assert state and not _same_full_state({k: saved_fp32[k] for k in state},
                                          {k: saved_bf16[k] for k in state})
    with _engine(_model(2), offload, tmp_path / "swap_b", dtype=BF16, **kw) as b:
        b.load_checkpoint(tmp_path / "fp32")
        _assert_identical(_snapshot(b), at_save)
        _train(b, data[3:])
        _assert_identical(_snapshot(b), at_end)


def test_a_loss_scaler_on_one_side_only_is_not_restored_across_dtypes(tmp_path, caplog):
    """fp32 into fp16 and back: the masters load, the loss scale is not restored (a warning);
    at the same dtype a scaler on one side only is still refused (the other tests)."""
    with OffloadEngine(_model(0), offload="cpu", stage=3) as a:
        _train(a, batches(1))
        a.save_checkpoint(tmp_path / "fp32")
        want = _snapshot(a)["state"]["unit0.trainable/master"]
    with OffloadEngine(_model(1), offload="cpu", stage=3, dtype=torch.float16) as b:
        with caplog.at_level("WARNING", logger="offload_zero"):
            b.load_checkpoint(tmp_path / "fp32")
        assert "the loss scale is not restored" in caplog.text
        assert torch.equal(_snapshot(b)["state"]["unit0.trainable/master"], want)
        assert b.loss_scaler.scale == 2.0 ** 16
        b.save_checkpoint(tmp_path / "fp16")
    with OffloadEngine(_model(2), offload="cpu", stage=3) as c:
        c.load_checkpoint(tmp_path / "fp16")
        assert torch.equal(_snapshot(c)["state"]["unit0.trainable/master"], want)


def test_same_numel_other_shape_is_refused(tmp_path):
    with OffloadEngine(_TwoShapes(6, 4), offload="cpu") as a:
        a.save_checkpoint(tmp_path / "ckpt")
    with OffloadEngine(_TwoShapes(4, 6), offload="cpu") as b:
        with pytest.raises(ValueError, match=r"parameter 'lin\.weight' shape is \[6, 4\] in the "
                                             r"checkpoint but \[4, 6\]"):
            b.load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("timing", ["auto", "backward"])
def test_save_or_load_between_backward_and_step_raises(timing, tmp_path):
    with OffloadEngine(_model(0), offload="cpu", stage=3, update_timing=timing) as a:
        (x, y), = batches(1)
        a.save_checkpoint(tmp_path / "ckpt")
        a.backward(lm_loss(a(x), y))
        for method in (a.save_checkpoint, a.load_checkpoint):
            with pytest.raises(RuntimeError, match=r"call step\(\) \(or zero_grad\(\)"):
                method(tmp_path / "ckpt")
        a.step()
        a.save_checkpoint(tmp_path / "ckpt")  # fine once the step is done
        a.load_checkpoint(tmp_path / "ckpt")


# -- two ranks ------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("field,value,message", [
    ("flat_params", ["x"], r"flat_params must be a list of objects"),
    ("client_state", [1], r"client_state must be an object \(or null\), got \[1\]"),
    ("save_id", None, r"belongs to another save than its checkpoint.json"),
    ("world_size", 0, r"world_size is 0; a checkpoint's is a positive integer"),
    ("world_size", "2", r"world_size is '2'; a checkpoint's is a positive integer"),
    ("shard_numel", 4, r"shard_numel is 4: 2 shards of it cannot hold its 1885 elements"),
    ("dtype", "int8", r"dtype is 'int8'; a checkpoint's is one of \['bfloat16', 'float16', "
                      r"'float32'\]"),
])
def test_impossible_or_edited_metadata_is_refused(field, value, message, tmp_path):
    with OffloadEngine(_model(0), offload="cpu", stage=3) as a:
        _train(a, batches(1))
        a.save_checkpoint(tmp_path / "ckpt")
        path = tmp_path / "ckpt" / "checkpoint.json"
        meta = json.loads(path.read_text())
        if field == "save_id":
            del meta["save_id"]  # the rank file's own is then checked against none
        elif field != "shard_numel":
            meta[field] = value
        else:
            meta["world_size"], meta["flat_params"][0]["shard_numel"] = 2, value
        path.write_text(json.dumps(meta))
        before = _snapshot(a)
        with pytest.raises(ValueError, match=message):
            a.load_checkpoint(tmp_path / "ckpt")
        assert _differences(_snapshot(a), before) == []


class _WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.bn(self.lin(x))


def test_model_buffers_are_saved_and_restored(tmp_path, monkeypatch, caplog):
    """BatchNorm's running statistics and batch counter come back as saved (non-persistent
    buffers are not saved, as in state_dict); a checkpoint written without buffers loads with
    a warning that names them."""
    torch.manual_seed(0)
    with OffloadEngine(_WithBatchNorm(), offload="cpu") as a:
        for _ in range(3):
            a.backward(a(torch.randn(16, 8)).pow(2).mean())
            a.step()
        a.save_checkpoint(tmp_path / "ckpt")
        want = a.full_state_dict()
        with monkeypatch.context() as m:  # as a writer that saved no buffers would
            m.setattr(ckpt, "_persistent_buffers", lambda module: [])
            a.save_checkpoint(tmp_path / "old")
        meta = json.loads((tmp_path / "old" / "checkpoint.json").read_text())
        del meta["buffers"]
        (tmp_path / "old" / "checkpoint.json").write_text(json.dumps(meta))
    assert ckpt.read_metadata(tmp_path / "ckpt")["buffers"] == [
        "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    with OffloadEngine(_WithBatchNorm(), offload="cpu") as b:
        b.load_checkpoint(tmp_path / "ckpt")
        got = b.full_state_dict()
        assert int(got["bn.num_batches_tracked"]) == 3
        assert all(torch.equal(got[k], want[k]) for k in want)
        with caplog.at_level("WARNING", logger="offload_zero"):
            b.load_checkpoint(tmp_path / "old")
    assert "saved without the model's buffers" in caplog.text and "bn.running_mean" in caplog.text


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


def _full_state(folder):
    """Every saved tensor of the checkpoint in ``folder`` with its rank shards joined and cut to
    the flat parameter's ``numel`` (the padding dropped), and each step count, by name: what a
    checkpoint means, whatever the world size that wrote it."""
    from safetensors.torch import load_file
    meta = ckpt.read_metadata(folder)
    files = [load_file(os.path.join(folder, ckpt.rank_file_name(r)))
             for r in range(meta["world_size"])]
    full = {}
    for f in meta["flat_params"]:
        for name in files[0]:
            if name.startswith(f["name"] + "/"):
                if name.endswith("/step"):
                    assert all(torch.equal(t[name], files[0][name]) for t in files)
                    full[name] = files[0][name]
                else:
                    full[name] = torch.cat([t[name] for t in files])[:f["numel"]]
    return full


def _same_full_state(a, b):
    """Names whose tensors differ between two :func:`_full_state` results (bit for bit)."""
    assert a.keys() == b.keys()
    return [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])))]


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


@pytest.mark.parametrize("what", ["save", "load"])
def test_a_save_or_load_waits_for_another_jobs_save_of_the_folder(what, tmp_path):
    """While another process holds the checkpoint folder's lock (as its save does), a save
    or load here waits for it instead of writing into the same temporary folder or reading a
    folder being swapped; once released it completes."""
    import fcntl
    import threading
    import time
    with OffloadEngine(_model(0), offload="cpu") as eng:
        _train(eng, batches(1))
        eng.save_checkpoint(tmp_path / "ckpt")
        before = _snapshot(eng)
        _train(eng, batches(1, seed=5))
        fd = os.open(str(tmp_path), os.O_RDONLY)  # another open file description: another job
        fcntl.flock(fd, fcntl.LOCK_EX)
        method = eng.save_checkpoint if what == "save" else eng.load_checkpoint
        done = []
        worker = threading.Thread(target=lambda: done.append(method(tmp_path / "ckpt")))
        worker.start()
        time.sleep(0.5)
        assert not done and worker.is_alive()
        assert not os.path.exists(tmp_path / ".ckpt.saving")
        os.close(fd)
        worker.join(30)
        assert done
        if what == "load":
            assert _differences(_snapshot(eng), before) == []
        else:
            assert _differences(_snapshot(eng), before) != []
            with OffloadEngine(_model(1), offload="cpu") as other:
                other.load_checkpoint(tmp_path / "ckpt")
                assert _differences(_snapshot(other), _snapshot(eng)) == []


def _one_rank_sees_another_folder(rank, world_size, root):
    """Rank 1 is given a folder the others do not see (as on a node without the shared file
    system): its save finds a folder of other files there, its load no checkpoint."""
    out = {}
    with OffloadEngine(_model(0), offload="cpu", stage=3, timeout_s=60) as eng:
        _train(eng, batches(1, batch=4), rank)
        eng.save_checkpoint(os.path.join(root, "ckpt"))  # seen by both
        for what in ("save", "load"):
            folder = os.path.join(root, "ckpt" if rank == 0 else f"elsewhere-{what}")
            try:
                (eng.save_checkpoint if what == "save" else eng.load_checkpoint)(folder)
                out[what] = "ok"
            except (ValueError, RuntimeError) as exc:
                out[what] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_rank_that_cannot_use_the_folder_stops_every_rank(tmp_path):
    """A check that fails on one rank only (the folder it sees holds other files; it sees no
    checkpoint) raises on every rank, naming that rank's error, instead of leaving the others
    waiting in a collective."""
    os.makedirs(tmp_path / "elsewhere-save")
    (tmp_path / "elsewhere-save" / "notes.txt").write_text("keep")
    results = run_ranks(_one_rank_sees_another_folder, 2, str(tmp_path), timeout_s=90)
    assert "is not an offload-zero checkpoint" in results[1]["save"]
    assert results[0]["save"].startswith("ValueError") and "failed on rank(s) [1]" in results[0]["save"]
    assert "is not an offload-zero checkpoint" in results[0]["save"]
    assert "does not exist" in results[1]["load"]
    assert "failed on rank(s) [1]" in results[0]["load"] and "does not exist" in results[0]["load"]
    assert (tmp_path / "elsewhere-save" / "notes.txt").read_text() == "keep"


def test_client_state_travels_with_the_checkpoint(tmp_path):
    """The caller's own dict (a step counter, a data position) is saved in checkpoint.json and
    returned by load_checkpoint; a checkpoint saved without one returns {}; a value JSON cannot
    hold is refused before anything is written."""
    state = {"step": 3, "data": {"epoch": 0, "files": ["a.txt"]}, "note": "warmup"}
    with OffloadEngine(_model(0), offload="cpu") as a:
        _train(a, batches(1))
        a.save_checkpoint(tmp_path / "ckpt", client_state=state)
        a.save_checkpoint(tmp_path / "plain")
        with pytest.raises(ValueError, match="client_state must hold only numbers"):
            a.save_checkpoint(tmp_path / "bad", client_state={"t": torch.zeros(1)})
        with pytest.raises(ValueError, match="client_state must be a dict"):
            a.save_checkpoint(tmp_path / "bad", client_state=[1, 2])
    assert not (tmp_path / "bad").exists()
    with OffloadEngine(_model(1), offload="cpu") as b:
        assert b.load_checkpoint(tmp_path / "ckpt") == state
        assert b.load_checkpoint(tmp_path / "plain") == {}


def test_a_bad_loss_scaler_state_is_refused_before_anything_changes(tmp_path):
    """checkpoint.json's scaler state is checked with the rest, before the load changes
    anything: a scale of 0 (or of another kind of scaler) leaves weights, lr and counters as
    they were."""
    kw = dict(dtype=torch.float16, lr=1e-2)
    with OffloadEngine(_model(0), offload="cpu", **kw) as a:
        _train(a, batches(2))
        a.save_checkpoint(tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    for bad, match in [({"scale": 0.0}, "loss_scaler: loss scaler state has scale=0.0"),
                       ({"good_steps": -3}, "good_steps=-3"),
                       ({"dynamic": False}, "state is of a static loss scale")]:
        meta_path.write_text(json.dumps({**meta, "loss_scaler": {**meta["loss_scaler"], **bad}}))
        with OffloadEngine(_model(1), offload="cpu", **{**kw, "lr": 0.5}) as b:
            before = _snapshot(b)
            with pytest.raises(ValueError, match=match):
                b.load_checkpoint(tmp_path / "ckpt")
            _assert_identical(_snapshot(b), before)
            assert b.lr == 0.5 and b.loss_scaler.scale == 2.0 ** 16


def test_save_through_a_symlink_replaces_its_target(tmp_path):
    """``latest -> step1``: saving to ``latest`` replaces ``step1`` and keeps the link, and
    later saves through it keep working."""
    target = tmp_path / "step1"
    link = tmp_path / "latest"
    with OffloadEngine(_model(0), offload="cpu", lr=1e-2) as a:
        _train(a, batches(1))
        a.save_checkpoint(target)
        link.symlink_to(target)
        for _ in range(2):
            _train(a, batches(1))
            a.save_checkpoint(link)
        want = _snapshot(a)
    assert link.is_symlink() and os.path.realpath(link) == str(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1"]
    with OffloadEngine(_model(1), offload="cpu") as b:
        b.load_checkpoint(link)
        _assert_identical(_snapshot(b), want)


def test_loading_a_file_says_it_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with OffloadEngine(_model(0), offload="cpu") as eng:
        with pytest.raises(ValueError, match=r"'.*/f' is not a folder \(a checkpoint is a folder"):
            eng.load_checkpoint(tmp_path / "f")


def test_files_of_two_saves_are_not_loaded_together(tmp_path):
    """checkpoint.json of one save beside the rank file of another (copied by hand) is refused:
    both carry the save's id."""
    with OffloadEngine(_model(0), offload="cpu", lr=1e-2) as a:
        _train(a, batches(1))
        a.save_checkpoint(tmp_path / "one")
        _train(a, batches(1))
        a.save_checkpoint(tmp_path / "two")
    ids = {json.loads((tmp_path / n / "checkpoint.json").read_text())["save_id"] for n in ("one", "two")}
    assert len(ids) == 2 and all(len(i) == 16 for i in ids)
    shutil.copy(tmp_path / "two" / "rank00000.safetensors", tmp_path / "one")
    with OffloadEngine(_model(1), offload="cpu") as b:
        before = _snapshot(b)
        with pytest.raises(ValueError, match=r"rank00000.safetensors' belongs to another save"):
            b.load_checkpoint(tmp_path / "one")
        _assert_identical(_snapshot(b), before)
        b.load_checkpoint(tmp_path / "two")


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
        a._step_count[head] -= 1  # as if its update had been skipped once
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
