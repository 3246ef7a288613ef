"""Training checkpoints: an exact resume on every tier and stage on one rank, into another tier
or compute dtype, with the loss scale, buffers and the caller's own state restored."""
import json
import os

import pytest
import torch
import torch.nn as nn

from checkpoint_helpers import (BF16, F32, _assert_identical, _differences, _engine, _full_state,
                                _model, _same_full_state, _snapshot, _train)
from models import batches
from offload_zero import OffloadEngine
from offload_zero import checkpoint as ckpt
from offload_zero.checkpoint import layout as ckpt_layout
from offload_zero.memory.tiers import NVMeStore

pytestmark = pytest.mark.usefixtures("torch_single_thread")


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
            m.setattr(ckpt_layout, "persistent_buffers", lambda module: [])
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
