"""NVMe files: the swap files' bytes and modes, the aio settings, I/O faults named by file and
offset, the chunked optimizer pipeline, stale and orphaned swap folders."""
import copy
import os
import stat
import subprocess

import pytest
import torch
import torch.nn as nn

from engine_common import make_engine
from models import TinyLM, batches, big_root_lm, lm_loss
from offload_zero import OffloadEngine
from offload_zero.memory.tiers import NVMeStore


def _left_by(folder, pid, boot_id=None):
    """A rank folder as a killed run leaves it: a swap file and the owner file naming ``pid``
    (this boot's id unless ``boot_id``)."""
    import json
    import socket
    folder.mkdir()
    (folder / "unit0.trainable.swp").write_bytes(b"\0" * 4096)
    boot = boot_id or open("/proc/sys/kernel/random/boot_id").read().strip()
    (folder / ".owner").write_text(json.dumps({"pid": pid, "boot_id": boot,
                                               "host": socket.gethostname()}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvme_swap_files(dtype, tmp_path):
    model = big_root_lm(4, vocab_scale=4)  # (embeddings and LM head each larger than a block)
    eng = OffloadEngine(model, offload="nvme", path=str(tmp_path), dtype=dtype,
                        update_timing="step")  # (the plain step's I/O, counted below)
    folder = tmp_path / "rank0"
    for x, y in batches(2):
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    files = sorted(folder.glob("*.swp"))
    # per flat parameter: [master | exp_avg | exp_avg_sq] and, at stage 3, the parameter shard,
    # which in fp32 is the master's own bytes (no file of its own, never written separately)
    k = 4 if dtype == torch.float32 else 2
    assert len(files) == (1 if k == 4 else 2) * len(eng.trainable)
    for f in files:
        st = f.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size > 0 and st.st_size % 4096 == 0
    total = sum(f.stat().st_size for f in files)
    s = sum(fp.shard_numel for fp in eng.trainable)
    rep = eng.memory_report()
    assert rep["nvme"]["current_bytes"] == total == 12 * s + (0 if k == 4 else k * s)
    assert rep["nvme"]["by_kind"]["parameters"]["current_bytes"] == k * s
    assert rep["nvme"]["by_kind"]["master_weights"]["current_bytes"] == (0 if k == 4 else 4 * s)
    # two steps: optimizer state read twice and written twice, plus the initial write of the
    # master alone (the moments' bytes of a new file read as zeros, never written);
    # block shards read in forward and backward of each step; the root's in each forward (it
    # stays gathered from forward to backward), its outsized parts (embeddings, LM head) only
    # in the first (they have buffers of their own, where their updated shards stay for the
    # next forward); bf16 shards written once at start and after each step
    big = [fp for fp in eng.root.flat_params if fp.entries[0].names[0] != "norm.weight"]
    s_big = sum(fp.shard_numel for fp in big)
    s_root = sum(fp.shard_numel for fp in eng.root.flat_params)
    assert len(big) == 2 and eng.pools["param_shards_root"].numel == max(
        fp.shard_numel for fp in big) > max(fp.shard_numel for fp in eng.blocks[0].flat_params)
    assert rep["nvme"]["read_bytes"] == (2 * 12 * s + 2 * 2 * k * (s - s_root)
                                         + 2 * k * (s_root - s_big) + k * s_big)
    assert rep["nvme"]["written_bytes"] == 2 * 12 * s + 4 * s + (0 if k == 4 else 3 * k * s)
    eng.close()
    assert not folder.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("offload_optimizer", ["cpu", "nvme"])
def test_memory_report_counts_every_byte_the_swap_files_move(offload_optimizer, tmp_path,
                                                             monkeypatch):
    """read_bytes / written_bytes are the bytes that crossed the files' system calls, the
    parameter shards' included: with the optimizer state in host memory, the shards on NVMe
    (no NVMe store) still move bytes. wait_s grows when the disk is slow."""
    import time
    counted = {"read": 0, "written": 0}
    real_read, real_write = os.preadv, os.pwritev

    def reading(fd, buffers, offset, *args):
        time.sleep(0.002)
        n = real_read(fd, buffers, offset, *args)
        counted["read"] += n
        return n

    def writing(fd, buffers, offset, *args):
        n = real_write(fd, buffers, offset, *args)
        counted["written"] += n
        return n

    monkeypatch.setattr(os, "preadv", reading)
    monkeypatch.setattr(os, "pwritev", writing)
    eng = OffloadEngine(TinyLM(), stage=3, offload_optimizer=offload_optimizer,
                        offload_param="nvme", path=str(tmp_path), aio_backend="threads",
                        aio_block_size=1 << 16, aio_queue_depth=4,  # (no probe: its I/O
                        dtype=torch.bfloat16)                      # would be counted too)
    for x, y in batches(3):
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    eng.swapper.wait_all()
    rep = eng.memory_report()["nvme"]
    assert counted["read"] > 0 and counted["written"] > 0
    assert (rep["read_bytes"], rep["written_bytes"]) == (counted["read"], counted["written"])
    assert rep["wait_s"] > 0.0
    if offload_optimizer == "cpu":
        assert rep["state_read_bytes"] == rep["state_written_bytes"] == 0
    eng.close()


def test_nvme_io_settings_probed_by_default_and_overridable(tmp_path):
    with OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path)) as eng:
        assert eng.swapper.tuning["source"] in ("probe", "cache", "default")
        assert eng.swapper.block_size == eng.swapper.tuning["block_size"]
        assert eng.swapper.block_size % 4096 == 0 and eng.swapper.queue_depth >= 1
    with OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path), aio_block_size=1 << 16,
                       aio_queue_depth=3) as eng:
        assert (eng.swapper.block_size, eng.swapper.queue_depth) == (1 << 16, 3)


@pytest.mark.parametrize("next_forward", [False, True])
@pytest.mark.parametrize("fault", ["eio", "short"])
def test_nvme_write_fault_names_file_and_offset_and_close_cleans_up(fault, next_forward,
                                                                    tmp_path, monkeypatch):
    """The plain step writes the state back in step(); update_timing="next_forward" in the next forward,
    where the fault then raises."""
    import errno

    from offload_zero.memory.swapper import SwapIOError
    eng = OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path), aio_backend="threads",
                        aio_block_size=4096, aio_queue_depth=2,
                        update_timing="next_forward" if next_forward else "step")
    x, y = batches(1)[0]
    eng.backward(lm_loss(eng(x), y))
    if next_forward:
        eng.step()
    real = os.pwritev
    calls = {"n": 0}

    def faulty(fd, buffers, offset, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            if fault == "eio":
                raise OSError(errno.EIO, "Input/output error")
            return 512  # a short write
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", faulty)
    with pytest.raises(SwapIOError) as info:
        eng(x) if next_forward else eng.step()
    msg = str(info.value)
    assert str(tmp_path / "rank0") in msg and ".swp" in msg and "offset" in msg
    monkeypatch.setattr(os, "pwritev", real)
    eng.close()  # still closes cleanly and removes every file
    assert not (tmp_path / "rank0").exists()


def test_a_fault_in_a_deferred_write_back_names_its_file_and_close_cleans_up(tmp_path,
                                                                              monkeypatch):
    """update_timing="next_forward" holds the last blocks' write-backs until the forward's last update: an
    EIO in one of them raises where it is waited for (backward's read-ahead, or at the latest
    step()), naming that block's file and the offset, and close() still removes every file.
    (Every transfer is done by the time it is polled: which reads start when, and so which
    write-backs are held, is then the same in every run.)"""
    import errno

    from offload_zero.memory.swapper import SwapHandle, SwapIOError
    monkeypatch.setattr(SwapHandle, "done", lambda h: h._done.wait() or True)
    eng = OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path), aio_backend="threads",
                        update_timing="next_forward")
    x, y = batches(1)[0]
    for _ in range(2):
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    held = []
    held_by_engine = eng._updates.may_defer_write_back

    def may_defer(fp):
        if held_by_engine(fp):
            held.append(fp.name)
            return True
        return False

    monkeypatch.setattr(eng._updates, "may_defer_write_back", may_defer)
    real = os.pwritev

    def faulty(fd, buffers, offset, *args):
        if held and os.readlink(f"/proc/self/fd/{fd}").endswith(f"/{held[-1]}.swp"):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", faulty)
    with pytest.raises(SwapIOError) as info:
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    assert held  # (the fault was in a deferred write)
    msg = str(info.value)
    assert f"{held[-1]}.swp" in msg and "offset" in msg
    monkeypatch.setattr(os, "pwritev", real)
    eng.close()
    assert not (tmp_path / "rank0").exists()


def test_nvme_optimizer_pipeline_in_chunks(tmp_path, monkeypatch):
    """Flat parameters larger than a chunk stream through the pipeline in several chunks: same
    numbers as host-resident state, buffers sized by the chunk, and an overflow found before
    the first chunk is written leaves every chunk unchanged."""
    from offload_zero.memory.tiers import NVMeStore
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    results = []
    for offload in ("cpu", "nvme"):
        torch.manual_seed(13)
        with make_engine(big_root_lm(6, vocab_scale=2), offload, tmp_path, lr=1e-2,
                     update_timing="step") as eng:
            if offload == "nvme":
                assert max(fp.shard_numel for fp in eng.trainable) >= 3 * 1024
                assert eng.memory_report()["host"]["by_kind"]["buffers"]["current_bytes"] >= 9 * 1024 * 4
                assert eng.store._bufs[0].numel() == 3 * 1024
            for x, y in batches(4):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            if offload == "nvme":
                before = eng.full_state_dict()
                x, y = batches(1)[0]
                eng.backward(lm_loss(eng(x), y) * float("nan"))
                eng.step()
                assert eng.skipped_steps == 1
                after = eng.full_state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            results.append(eng.full_state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_unknown_keyword_and_stale_swap_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"OffloadEngine got unknown keyword argument\(s\) \['foo'\]"):
        OffloadEngine(TinyLM(), foo=1)
    stale = tmp_path / "rank0"
    stale.mkdir()
    (stale / "unit0.trainable.swp").write_bytes(b"")
    with pytest.raises(ValueError, match=r"earlier run was killed.*delete"):
        OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path))


def test_a_rank_folder_whose_owner_is_gone_is_reclaimed_and_a_live_ones_refused(tmp_path):
    """A run killed with SIGKILL leaves its rank folder; the owner file it holds (pid, boot id)
    lets the next run take it over, with a warning, when that process is gone (or the machine
    rebooted since), and refuse it while it runs. (Without an owner file, the older layout,
    stale swap files are refused as before: test_unknown_keyword_and_stale_swap_files_are_named.)"""
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, pid, boot in (("dead", dead.pid, None), ("rebooted", os.getpid(), "another-boot")):
        path = tmp_path / name
        path.mkdir()
        _left_by(path / "rank0", pid, boot)
        with pytest.warns(RuntimeWarning, match=rf"left by process {pid}.*gone.*removing 1 "
                                                r"swap file"):
            with OffloadEngine(TinyLM(), offload="nvme", path=str(path)) as eng:
                for x, y in batches(1):
                    eng.backward(lm_loss(eng(x), y))
                    eng.step()
        assert list((path / "rank0").iterdir()) == []  # its files and the owner file removed
    live = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / "live"
        path.mkdir()
        _left_by(path / "rank0", live.pid)
        with pytest.raises(ValueError, match=rf"is in use by process {live.pid}"):
            OffloadEngine(TinyLM(), offload="nvme", path=str(path))
        assert sorted(p.name for p in (path / "rank0").iterdir()) == [".owner",
                                                                      "unit0.trainable.swp"]
    finally:
        live.kill()
        live.wait()


class _Branches(nn.Module):
    """A model whose forward runs only the branches it is told to: ``forward(x, use)`` (a model
    with early exits, optional towers, or experts that got no tokens, on one rank)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.branches = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.out = nn.Linear(32, 8)

    def forward(self, x, use):
        h = self.inp(x)
        for i in use:
            h = h + self.branches[i](h)
        return self.out(h)


_USES = [[0, 1, 2, 3], [0], [1, 3], [], [2], [3, 2, 1, 0]]


@pytest.mark.parametrize("timing", ["step", "next_forward", "backward"])
@pytest.mark.parametrize("tiers", [{"offload": "nvme"},
                                   {"offload_optimizer": "cpu", "offload_param": "nvme"},
                                   {"offload": "nvme", "prefetch": 3}])
def test_forwards_that_skip_units_train_as_torch_does(timing, tiers, tmp_path):
    """At stage 3 with each branch a unit of its own, forwards run the units in other orders
    and skip some (the order the prefetch follows is the last forward's). The parameter reads
    started ahead for units that did not run are dropped when their buffers are needed, not
    left holding the read-ahead pool (which ran empty: 'host buffer pool ... is empty'); the
    weights equal torch AdamW's, which skips the parameters without a gradient."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = _Branches()
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    eng = OffloadEngine(model, stage=3, path=str(tmp_path), unit_classes=(nn.Linear,),
                        update_timing=timing, lr=1e-2, weight_decay=0.01, **tiers)
    for use in _USES:
        ref(x, use).square().mean().backward()
        opt.step()
        opt.zero_grad()
        eng.backward(model(x, use).square().mean())
        eng.step()
    with torch.no_grad():
        got = model(x, [0, 1, 2, 3])
    tol = 1e-6
    torch.testing.assert_close(got, ref(x, [0, 1, 2, 3]).detach(), atol=tol, rtol=tol)
    state = eng.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), atol=tol, rtol=tol)
    eng.close()
