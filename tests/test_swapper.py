"""Swapper: async O_DIRECT swap of aligned host tensors, both backends.

Fault injection without touching internals:
- threads backend: patch ``os.pwritev`` / ``os.preadv`` (looked up at call time).
- libaio backend: shrink the swap file under the swapper (``os.truncate``) so a read runs past
  EOF (short read), or ``dup2`` a read-only descriptor of the same file over the swapper's
  descriptor (found through /proc/self/fd) so the kernel rejects writes with EBADF.
Read-only folders: the tests run as root, for whom chmod 0500 does not stop writes, so a
"parent that is not a writable directory" is made by using a regular file as the parent.
"""
import errno
import gc
import os
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from offload_zero.memory import ALIGNMENT, SwapIOError, Swapper, aligned_empty
from offload_zero.memory import swapper as swapper_mod

BACKENDS = ["libaio", "threads"]
PAGE = ALIGNMENT


def random_bytes(nbytes, seed=0):
    """Aligned uint8 tensor of nbytes random bytes."""
    gen = torch.Generator().manual_seed(seed)
    t = aligned_empty(nbytes, torch.uint8)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    return t


def fd_of(path):
    """The descriptor this process holds on ``path`` (via /proc, no swapper internals)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == path:
                return int(name)
        except OSError:
            continue
    raise AssertionError(f"no open descriptor on {path}")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def make_swapper(tmp_path):
    made = []

    def make(**kwargs):
        kwargs.setdefault("block_size", 4 * PAGE)
        kwargs.setdefault("queue_depth", 4)
        sw = Swapper(str(tmp_path / f"swap{len(made)}"), **kwargs)
        made.append(sw)
        return sw

    yield make
    for sw in made:
        sw.close()


# ---- round trips ----------------------------------------------------------------------------

@pytest.mark.parametrize("block_pages,queue_depth,num_pages", [
    (4, 4, 13),     # size not a multiple of block_size
    (1, 32, 257),   # many small requests, deep queue
    (8, 1, 3),      # one request smaller than a block
    (256, 8, 300),  # 1 MiB blocks
])
def test_round_trip_bit_exact(make_swapper, backend, block_pages, queue_depth, num_pages):
    sw = make_swapper(backend=backend, block_size=block_pages * PAGE, queue_depth=queue_depth)
    assert sw.backend == backend
    nbytes = num_pages * PAGE
    src = random_bytes(nbytes, seed=num_pages)
    sw.allocate("k", nbytes)
    handle = sw.swap_out("k", src)
    handle.wait()
    assert handle.done()
    dst = aligned_empty(nbytes, torch.uint8).zero_()
    sw.swap_in("k", dst).wait()
    assert torch.equal(src, dst)
    assert sw.bytes_written == nbytes and sw.bytes_read == nbytes
    assert sw.file_bytes == nbytes


def test_dtypes_and_offsets(make_swapper, backend):
    sw = make_swapper(backend=backend)
    sw.allocate("w", 16 * PAGE)
    a = aligned_empty(PAGE // 2 * 3, torch.bfloat16).copy_(torch.randn(PAGE // 2 * 3))
    b = aligned_empty(PAGE // 4 * 5, torch.float32).copy_(torch.randn(PAGE // 4 * 5))
    ha = sw.swap_out("w", a, offset_bytes=2 * PAGE)   # pages 2..4
    hb = sw.swap_out("w", b, offset_bytes=11 * PAGE)  # pages 11..15, up to the end
    ha.wait()
    hb.wait()
    a2 = aligned_empty(a.numel(), torch.bfloat16)
    b2 = aligned_empty(b.numel(), torch.float32)
    sw.swap_in("w", b2, offset_bytes=11 * PAGE).wait()
    sw.swap_in("w", a2, offset_bytes=2 * PAGE).wait()
    assert torch.equal(a, a2) and torch.equal(b, b2)


def test_interleaved_keys_in_flight(make_swapper, backend):
    sw = make_swapper(backend=backend, block_size=PAGE, queue_depth=8)
    keys = [f"unit{i}.exp_avg" for i in range(4)]
    chunk = 5 * PAGE
    data = {k: [random_bytes(chunk, seed=10 * i + j) for j in range(3)]
            for i, k in enumerate(keys)}
    for k in keys:
        sw.allocate(k, 3 * chunk)
    handles = [sw.swap_out(k, data[k][j], offset_bytes=j * chunk) for j in range(3) for k in keys]
    sw.wait_all()
    assert all(h.done() for h in handles)
    back = {k: aligned_empty(3 * chunk, torch.uint8) for k in keys}
    for k in reversed(keys):
        sw.swap_in(k, back[k])
    sw.wait_all()
    for k in keys:
        assert torch.equal(back[k], torch.cat(data[k]))
    assert sw.bytes_written == sw.bytes_read == 4 * 3 * chunk
    assert sw.file_bytes == 4 * 3 * chunk


def test_swap_out_returns_before_transfer_completes(make_swapper):
    # One request in flight, 64 of them to do: the caller only pays for the first submission.
    sw = make_swapper(backend="libaio", block_size=1 << 20, queue_depth=1)
    nbytes = 64 << 20
    src = aligned_empty(nbytes, torch.uint8).fill_(3)
    sw.allocate("big", nbytes)
    handle = sw.swap_out("big", src)
    assert not handle.done()
    handle.wait()
    assert sw.bytes_written == nbytes


def test_zero_byte_transfer_is_done_at_once(make_swapper, backend):
    sw = make_swapper(backend=backend)
    sw.allocate("k", PAGE)
    handle = sw.swap_out("k", aligned_empty(0, torch.float32))
    assert handle.done()
    handle.wait()
    assert sw.bytes_written == 0


def test_wait_s_counts_the_time_callers_block_on_unfinished_transfers(make_swapper,
                                                                     monkeypatch):
    """wait() and wait_all() on a transfer still running add the time they block; a wait on a
    finished one, or a poll, adds nothing."""
    import threading
    import time
    sw = make_swapper(backend="threads", block_size=PAGE, queue_depth=1)
    sw.allocate("k", PAGE)
    buf = aligned_empty(PAGE, torch.uint8).fill_(1)
    sw.swap_out("k", buf).wait()
    gate = threading.Event()
    real = os.preadv

    def slow(fd, buffers, offset, *args):
        gate.wait()
        time.sleep(0.2)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", slow)
    before = sw.wait_s
    handle = sw.swap_in("k", buf)
    assert not handle.done() and sw.wait_s == before  # (polling is not waiting)
    gate.set()
    handle.wait()
    blocked = sw.wait_s - before
    assert 0.15 <= blocked < 5.0
    handle.wait()  # done already: adds nothing
    sw.wait_all()
    assert sw.wait_s - before == blocked
    sw.swap_in("k", buf)
    sw.wait_all()
    assert sw.wait_s - before >= blocked + 0.15


# ---- files and folder -----------------------------------------------------------------------

def test_files_mode_size_and_cleanup(tmp_path, backend):
    folder = tmp_path / "swapdir"
    sw = Swapper(str(folder), backend=backend)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    sw.allocate("a", 3 * PAGE)
    sw.allocate("b", 5 * PAGE)
    assert sorted(sw.files) == [str(folder / "a.swp"), str(folder / "b.swp")]
    for path, size in zip(sorted(sw.files), (3 * PAGE, 5 * PAGE)):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == size
    assert sw.file_bytes == 8 * PAGE
    sw.close()
    assert not folder.exists()
    assert sw.files == [] and sw.file_bytes == 0
    sw.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        sw.allocate("c", PAGE)


def test_existing_folder_is_kept(tmp_path, backend):
    (tmp_path / "keep.txt").write_text("not ours")
    sw = Swapper(str(tmp_path), backend=backend)
    sw.allocate("x", PAGE)
    sw.close()
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


def test_files_removed_on_garbage_collection(tmp_path, backend):
    folder = tmp_path / "gc"
    sw = Swapper(str(folder), backend=backend)
    sw.allocate("x", PAGE)
    del sw
    gc.collect()
    assert not folder.exists()


def test_files_removed_at_interpreter_exit(tmp_path):
    folder = tmp_path / "atexit"
    script = textwrap.dedent(f"""
        import torch
        from offload_zero.memory.swapper import Swapper
        from offload_zero.memory.aligned import aligned_empty
        sw = Swapper({str(folder)!r}, backend="libaio")
        sw.allocate("x", 1 << 20)
        h = sw.swap_out("x", aligned_empty(1 << 18, torch.float32))  # left in flight
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert not folder.exists()


def test_close_with_io_in_flight(make_swapper, backend):
    sw = make_swapper(backend=backend, block_size=PAGE, queue_depth=2)
    nbytes = 256 * PAGE
    sw.allocate("k", nbytes)
    handle = sw.swap_out("k", aligned_empty(nbytes, torch.uint8).fill_(1))
    folder = sw.folder
    sw.close()
    assert handle.done()  # either completed or cancelled, never left hanging
    err = handle.error()
    assert err is None or err.errno == errno.ECANCELED
    assert not os.path.exists(folder)


def test_close_from_the_completion_thread_with_io_in_flight(make_swapper, backend, monkeypatch):
    """A swapper can be closed on the thread that completes its requests: the garbage collector
    runs its finalizer wherever the last reference goes, and a completion can drop it. That
    close must not pull the I/O context from under the thread (an error traceback in the
    libaio reaper after Ctrl-C); every request still completes or is cancelled."""
    import threading
    sw = make_swapper(backend=backend, block_size=PAGE, queue_depth=2)
    nbytes = 64 * PAGE
    sw.allocate("k", nbytes)
    crashed, closed_on, closed = [], [], threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    original = swapper_mod._Request.finish

    def finish(self, res):
        original(self, res)
        if not closed_on:
            closed_on.append(threading.current_thread().name)
            sw.close()  # on the completion thread, with requests still queued and in flight
            closed.set()

    monkeypatch.setattr(swapper_mod._Request, "finish", finish)
    handle = sw.swap_out("k", aligned_empty(nbytes, torch.uint8).fill_(1))
    handle._done.wait(30)
    assert closed.wait(30)
    assert handle.done() and closed_on and closed_on[0] != threading.main_thread().name
    err = handle.error()
    assert err is None or err.errno == errno.ECANCELED
    assert not crashed, crashed
    assert not os.path.exists(sw.folder)


def test_ctrl_c_right_after_a_submission_leaves_it_whole(make_swapper, backend, monkeypatch):
    """Ctrl-C raises KeyboardInterrupt in the main thread at any bytecode; a backend's submit
    queues all of its requests in one step, so an interrupt right after it leaves a transfer
    that still completes, and the swapper goes on working. (Simulated: the
    KeyboardInterrupt is raised after part of the requests were queued by hand.)"""
    sw = make_swapper(backend=backend, block_size=PAGE, queue_depth=2)
    nbytes = 16 * PAGE
    sw.allocate("k", nbytes)
    backend_obj = sw._state.backend
    real_submit = backend_obj.submit

    def submit(requests):
        real_submit(requests)  # all of them, or (interrupted before) none
        raise KeyboardInterrupt

    monkeypatch.setattr(backend_obj, "submit", submit)
    data = random_bytes(nbytes, seed=3)
    with pytest.raises(KeyboardInterrupt):
        sw.swap_out("k", data)
    monkeypatch.setattr(backend_obj, "submit", real_submit)
    (handle,) = list(sw._outstanding)
    handle.wait(timeout_s=30)
    back = aligned_empty(nbytes, torch.uint8)
    sw.swap_in("k", back).wait()
    assert torch.equal(back, data)


# ---- bad input ------------------------------------------------------------------------------

def test_missing_parent(tmp_path):
    path = tmp_path / "nope" / "swap"
    with pytest.raises(ValueError, match=str(tmp_path / "nope")):
        Swapper(str(path))


def test_parent_not_writable_directory(tmp_path):
    # Root ignores chmod 0500, so make the parent a regular file instead.
    parent = tmp_path / "afile"
    parent.write_text("x")
    with pytest.raises(ValueError, match=str(parent)):
        Swapper(str(parent / "swap"))


def test_folder_is_a_file(tmp_path):
    target = tmp_path / "f"
    target.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Swapper(str(target))


def test_bad_backend(tmp_path):
    with pytest.raises(ValueError, match="'io_uring'.*auto.*libaio.*threads"):
        Swapper(str(tmp_path / "s"), backend="io_uring")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("block_size", [0, -PAGE, 1000, PAGE + 512, 1.0 * PAGE, True])
def test_bad_block_size(tmp_path, block_size):
    with pytest.raises(ValueError, match=f"block_size.*{block_size!r}"):
        Swapper(str(tmp_path / "s"), block_size=block_size)


@pytest.mark.parametrize("queue_depth", [0, -1, 2.0])
def test_bad_queue_depth(tmp_path, queue_depth):
    with pytest.raises(ValueError, match=f"queue_depth.*{queue_depth!r}"):
        Swapper(str(tmp_path / "s"), queue_depth=queue_depth)


@pytest.mark.parametrize("nbytes", [0, 100, PAGE + 1, -PAGE])
def test_bad_allocation_size(make_swapper, nbytes):
    sw = make_swapper(backend="threads")
    with pytest.raises(ValueError, match=f"nbytes.*{nbytes}"):
        sw.allocate("k", nbytes)
    assert sw.files == []


@pytest.mark.parametrize("key", ["", "../escape", "a/b", ".hidden", "-x", 3])
def test_bad_key(make_swapper, key):
    sw = make_swapper(backend="threads")
    with pytest.raises(ValueError, match="swap key"):
        sw.allocate(key, PAGE)


def test_duplicate_key_and_unknown_key(make_swapper):
    sw = make_swapper(backend="threads")
    sw.allocate("k", PAGE)
    with pytest.raises(ValueError, match="already allocated"):
        sw.allocate("k", PAGE)
    with pytest.raises(ValueError, match="'other' is not allocated"):
        sw.swap_in("other", aligned_empty(1024, torch.float32))


def test_bad_tensors(make_swapper, backend):
    sw = make_swapper(backend=backend)
    sw.allocate("k", 4 * PAGE)
    base = aligned_empty(3 * PAGE, torch.uint8)
    misaligned = base[512: 512 + PAGE]
    with pytest.raises(ValueError, match=f"'k'.*data_ptr {misaligned.data_ptr():#x}"):
        sw.swap_out("k", misaligned)
    with pytest.raises(ValueError, match="'k'.*nbytes 1000"):
        sw.swap_out("k", base[:1000])
    with pytest.raises(ValueError, match="contiguous"):
        sw.swap_in("k", base[: 2 * PAGE].view(2, PAGE).t())
    with pytest.raises(ValueError, match="torch.Tensor"):
        sw.swap_out("k", bytearray(PAGE))


def test_transfer_beyond_file(make_swapper, backend):
    sw = make_swapper(backend=backend)
    sw.allocate("k", 4 * PAGE)
    buf = aligned_empty(2 * PAGE, torch.uint8)
    with pytest.raises(ValueError, match=f"offset_bytes {3 * PAGE} \\+ nbytes {2 * PAGE}.*"
                                         f"file size {4 * PAGE}"):
        sw.swap_out("k", buf, offset_bytes=3 * PAGE)
    with pytest.raises(ValueError, match="offset_bytes must be.*100"):
        sw.swap_in("k", buf, offset_bytes=100)
    with pytest.raises(ValueError, match="offset_bytes must be.*-4096"):
        sw.swap_in("k", buf, offset_bytes=-PAGE)
    assert sw.bytes_read == sw.bytes_written == 0


# ---- faults ---------------------------------------------------------------------------------

def _assert_names_file_and_offset(exc_info, path, offset):
    message = str(exc_info.value)
    assert path in message and f"offset {offset} " in message, message
    assert exc_info.value.path == path and exc_info.value.offset == offset


def test_threads_injected_eio(make_swapper, monkeypatch):
    sw = make_swapper(backend="threads", block_size=PAGE, queue_depth=4)
    sw.allocate("k", 8 * PAGE)
    path = sw.files[0]
    real_pwritev = os.pwritev

    def flaky_pwritev(fd, buffers, offset, *args):
        if offset == 5 * PAGE:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pwritev(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", flaky_pwritev)
    handle = sw.swap_out("k", random_bytes(8 * PAGE))
    with pytest.raises(SwapIOError, match="Errno 5") as exc_info:
        handle.wait()
    assert exc_info.value.errno == errno.EIO
    _assert_names_file_and_offset(exc_info, path, 5 * PAGE)
    assert sw.bytes_written == 7 * PAGE
    sw.wait_all()  # the failure was already reported by wait()
    sw.close()
    assert not os.path.exists(path)


def test_threads_injected_short_write(make_swapper, monkeypatch):
    sw = make_swapper(backend="threads", block_size=2 * PAGE, queue_depth=2)
    sw.allocate("k", 4 * PAGE)
    path = sw.files[0]
    monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset, *a: 512)
    sw.swap_out("k", random_bytes(4 * PAGE))
    with pytest.raises(SwapIOError, match="short swap write") as exc_info:
        sw.wait_all()  # unobserved failures surface here
    assert "512 of 8192 bytes" in str(exc_info.value)
    assert exc_info.value.offset in (0, 2 * PAGE)
    _assert_names_file_and_offset(exc_info, path, exc_info.value.offset)
    sw.close()
    assert not os.path.exists(path)


def test_libaio_short_read_past_eof(make_swapper):
    sw = make_swapper(backend="libaio", block_size=2 * PAGE, queue_depth=4)
    sw.allocate("k", 8 * PAGE)
    path = sw.files[0]
    sw.swap_out("k", random_bytes(8 * PAGE)).wait()
    os.truncate(path, 5 * PAGE)  # the file shrinks under the swapper
    handle = sw.swap_in("k", aligned_empty(8 * PAGE, torch.uint8))
    with pytest.raises(SwapIOError, match="short swap read") as exc_info:
        handle.wait()
    # Requests at 0 and 2 pages are whole, the one at 4 pages gets 1 of 2 pages, 6 gets 0.
    assert exc_info.value.offset in (4 * PAGE, 6 * PAGE)
    _assert_names_file_and_offset(exc_info, path, exc_info.value.offset)
    assert sw.bytes_read == 4 * PAGE
    sw.close()
    assert not os.path.exists(path)


def test_libaio_rejected_write_ebadf(make_swapper):
    sw = make_swapper(backend="libaio", block_size=PAGE, queue_depth=4)
    sw.allocate("k", 4 * PAGE)
    path = sw.files[0]
    read_only = os.open(path, os.O_RDONLY | os.O_DIRECT)
    os.dup2(read_only, fd_of(path))  # the swapper's descriptor now refuses writes
    os.close(read_only)
    with pytest.raises(SwapIOError) as exc_info:
        sw.swap_out("k", random_bytes(4 * PAGE)).wait()
    assert exc_info.value.errno == errno.EBADF
    assert "Errno 9" in str(exc_info.value)
    _assert_names_file_and_offset(exc_info, path, exc_info.value.offset)
    sw.close()
    assert not os.path.exists(path)


# ---- backend choice -------------------------------------------------------------------------

def _shm_refuses_o_direct():
    if not os.path.isdir("/dev/shm"):
        return False
    return swapper_mod.probe_o_direct("/dev/shm") is not None


@pytest.mark.skipif(not _shm_refuses_o_direct(),
                    reason="/dev/shm missing or accepts O_DIRECT (tmpfs does since Linux 6.6)")
def test_tmpfs_auto_falls_back_to_threads(tmp_path):
    folder = f"/dev/shm/oz-test-{os.getpid()}"
    with pytest.warns(RuntimeWarning, match="O_DIRECT.*libaio"):
        sw = Swapper(folder, backend="auto")
    assert sw.backend == "threads" and not sw.direct
    sw.allocate("k", PAGE)
    src = random_bytes(PAGE)
    sw.swap_out("k", src).wait()
    dst = aligned_empty(PAGE, torch.uint8)
    sw.swap_in("k", dst).wait()
    assert torch.equal(src, dst)
    sw.close()
    assert not os.path.exists(folder)
    with pytest.raises(ValueError, match="libaio.*unusable.*O_DIRECT"):
        Swapper(folder, backend="libaio")


def test_auto_without_o_direct_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(swapper_mod, "probe_o_direct", lambda folder: "no O_DIRECT here (test)")
    with pytest.warns(RuntimeWarning, match="no O_DIRECT here.*pip install libaio"):
        sw = Swapper(str(tmp_path / "a"), backend="auto")
    assert sw.backend == "threads" and not sw.direct
    sw.close()
    with pytest.raises(ValueError, match="'libaio' is unusable.*no O_DIRECT here"):
        Swapper(str(tmp_path / "b"), backend="libaio")
    assert not (tmp_path / "b").exists()


def test_auto_without_libaio_bindings_warns(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "offload_zero.memory.aio_libaio", None)  # import fails
    with pytest.warns(RuntimeWarning, match="libaio bindings do not import"):
        sw = Swapper(str(tmp_path / "a"), backend="auto")
    assert sw.backend == "threads" and sw.direct  # still O_DIRECT through the thread pool
    sw.close()
    with pytest.raises(ValueError, match="libaio bindings do not import"):
        Swapper(str(tmp_path / "b"), backend="libaio")


def test_auto_picks_libaio_silently(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw = Swapper(str(tmp_path / "a"))
    assert sw.backend == "libaio" and sw.direct
    sw.close()


# ---- measurement ----------------------------------------------------------------------------

@pytest.mark.parametrize("ring", [False, True])
def test_measure_bandwidth_small(tmp_path, backend, ring):
    calls = []

    def peer(path, op):
        assert os.path.getsize(path) == 1 << 20
        calls.append(op)
        return 1.0

    result = swapper_mod.measure_bandwidth(str(tmp_path), 1 << 20, block_size=64 << 10,
                                           queue_depth=4, backend=backend, repeats=2,
                                           peer=peer, ring=ring)
    assert calls == ["write", "write", "read", "read"]
    assert result["peer_read_gbps"] == result["peer_write_gbps"] == 1.0
    assert result["backend"] == backend and result["ring"] == ring
    assert result["read_gbps"] > 0 and result["write_gbps"] > 0
    assert len(result["read_s"]) == len(result["write_s"]) == 2
    assert os.listdir(tmp_path) == []


# ---- tuned block size and queue depth ---------------------------------------------------------

@pytest.fixture
def fake_tuning(tmp_path, monkeypatch):
    """Cache in tmp_path; the probe answers (256 KiB, 4) without I/O and records its calls."""
    from offload_zero.memory import tuning

    monkeypatch.setenv("OFFLOAD_ZERO_CACHE", str(tmp_path / "aio_tuning.json"))
    calls = []

    def probe(folder, backend="auto", budget_s=2.0):
        calls.append(backend)
        trial = dict(block_size=64 * PAGE, queue_depth=4, write_gbps=1.0, read_gbps=1.0, gbps=1.0)
        return dict(block_size=64 * PAGE, queue_depth=4, backend=backend,
                    measured=dict(trials=[trial], direct=True, trial_bytes=1 << 20))

    monkeypatch.setattr(tuning, "probe", probe)
    return calls


def test_tuned_swapper_round_trip(tmp_path, backend, fake_tuning):
    with Swapper(str(tmp_path / "s"), backend=backend, block_size=None, queue_depth=None) as sw:
        assert (sw.block_size, sw.queue_depth) == (64 * PAGE, 4)
        assert sw.tuning["source"] == "probe" and sw.backend == backend
        sw.allocate("k", 300 * PAGE)
        src = random_bytes(300 * PAGE)
        sw.swap_out("k", src).wait()
        dst = aligned_empty(300 * PAGE, torch.uint8)
        sw.swap_in("k", dst).wait()
        assert torch.equal(src, dst)
    with Swapper(str(tmp_path / "t"), backend=backend, block_size=None, queue_depth=None) as sw:
        assert sw.tuning["source"] == "cache"
    assert fake_tuning == [backend]  # probed once for this device and backend


def test_explicit_values_override_tuning(tmp_path, fake_tuning):
    with Swapper(str(tmp_path / "a"), block_size=None, queue_depth=16) as sw:
        assert (sw.block_size, sw.queue_depth) == (64 * PAGE, 16)
    with Swapper(str(tmp_path / "b"), block_size=2 * PAGE, queue_depth=None) as sw:
        assert (sw.block_size, sw.queue_depth) == (2 * PAGE, 4)
    fake_tuning.clear()
    with Swapper(str(tmp_path / "c"), block_size=2 * PAGE, queue_depth=3) as sw:
        assert (sw.block_size, sw.queue_depth) == (2 * PAGE, 3) and sw.tuning is None
    with Swapper(str(tmp_path / "d")) as sw:  # the defaults stay explicit: no probe
        assert (sw.block_size, sw.queue_depth) == (1 << 20, 8) and sw.tuning is None
    assert fake_tuning == []


def test_tuned_swapper_real_probe(tmp_path, monkeypatch):
    from offload_zero.memory import tuning

    monkeypatch.setenv("OFFLOAD_ZERO_CACHE", str(tmp_path / "aio_tuning.json"))
    monkeypatch.setattr(tuning, "MAX_TRIAL_BYTES", 8 << 20)  # keep it short on a shared machine
    folder = tmp_path / "s"
    with Swapper(str(folder), block_size=None, queue_depth=None) as sw:
        assert sw.block_size in tuning.BLOCK_SIZES and sw.queue_depth in tuning.QUEUE_DEPTHS
        assert sw.tuning["source"] == "probe" and sw.files == []
        assert os.listdir(folder) == []  # nothing of the probe left in the swap folder
    assert not folder.exists()


def test_aio_context_released_once_even_if_interrupted():
    """Ctrl-C right after the kernel context is released must not make the library release it
    again when the object is collected (that printed an ignored EINVAL traceback at exit)."""
    import gc
    libaio = pytest.importorskip("libaio")
    from offload_zero.memory.aio_libaio import _release_context
    try:
        ctx = libaio.AIOContext(4)
    except OSError as exc:
        pytest.skip(f"no AIO context here: {exc}")
    calls = []
    real = ctx._io_queue_release

    def release_then_interrupt(raw):
        calls.append(raw)
        real(raw)
        raise KeyboardInterrupt  # lands just after the release

    ctx._io_queue_release = release_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        _release_context(ctx)
    ctx.close()  # what the library's __del__ does at exit: must find nothing to release
    del ctx
    gc.collect()
    assert len(calls) == 1
