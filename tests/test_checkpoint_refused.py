"""A damaged, edited or mismatched checkpoint is refused by name (file, field, saved and this
engine's values) and leaves the engine as it was."""
import json
import os
import shutil

import pytest
import torch
import torch.nn as nn

from checkpoint_helpers import _assert_identical, _differences, _model, _snapshot, _train
from models import Block, batches
from offload_zero import OffloadEngine

pytestmark = pytest.mark.usefixtures("torch_single_thread")


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


def test_same_numel_other_shape_is_refused(tmp_path):
    with OffloadEngine(_TwoShapes(6, 4), offload="cpu") as a:
        a.save_checkpoint(tmp_path / "ckpt")
    with OffloadEngine(_TwoShapes(4, 6), offload="cpu") as b:
        with pytest.raises(ValueError, match=r"parameter 'lin\.weight' shape is \[6, 4\] in the "
                                             r"checkpoint but \[4, 6\]"):
            b.load_checkpoint(tmp_path / "ckpt")


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
