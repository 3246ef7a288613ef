"""Checkpoint folders: a failed save keeps the previous checkpoint, a folder of other files is
never replaced, saves and loads of one folder by two jobs wait for each other, a rank that
cannot use the folder stops every rank, and a symbolic link's target is what is replaced."""
import errno
import os

import pytest

from checkpoint_helpers import _assert_identical, _differences, _model, _snapshot, _train
from dist_harness import run_ranks
from models import batches, lm_loss
from offload_zero import OffloadEngine
from offload_zero.checkpoint import folder as ckpt_folder
from offload_zero.checkpoint import save as ckpt_save

pytestmark = pytest.mark.usefixtures("torch_single_thread")


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
            module, name = {"metadata": (ckpt_save, "write_text"),
                            "exchange": (ckpt_folder, "_exchange")}[fail_at]
            monkeypatch.setattr(module, name, failing)
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
    monkeypatch.setattr(ckpt_folder, "_exchange", lambda a, b: False)
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
