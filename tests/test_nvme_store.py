"""The NVMe optimizer store on a real swapper: streamed updates leave their last writes in
flight, reads wait for the same bytes still being written, no state is read ahead while a
stream has part of it updated, and whole write-backs are deferred until asked or needed."""
import os

import torch

from offload_zero.memory import Swapper, aligned_empty
from offload_zero.update.state import StateIO


class _Flat:
    """What the NVMe store needs of a flat parameter: a name (its file's)."""

    def __init__(self, name):
        self.name = name


def _store_with_ring(sw, buffers: int, numel: int = 2048):
    """An NVMeStore on ``sw`` streaming chunks of 1024 elements, with a read-ahead ring of
    ``buffers`` whole states of up to ``numel`` elements: ``(store, ring)``."""
    from offload_zero.memory.accounting import TierAccountant
    from offload_zero.memory.pool import HostBufferPool
    from offload_zero.memory.tiers import NVMeStore
    acct = TierAccountant()
    alloc = lambda n, dt: aligned_empty(n, dt)  # noqa: E731
    store = NVMeStore(sw, acct, alloc, numel, chunk_numel=1024)
    ring = HostBufferPool("ring", buffers, 3 * numel, torch.float32, alloc, acct)
    store.enable_prefetch(ring)
    return store, ring


def test_nvme_store_streamed_update_leaves_its_last_writes_in_flight(tmp_path):
    """A state streamed chunk by chunk (NVMeStore.iter_states) returns with its last chunks'
    write-backs still in flight (nothing waits for them inside backward); a read of the file
    after wait_writes, a later stream reusing the buffer sets, and read_all all see the
    updated bytes."""
    from offload_zero.memory.accounting import TierAccountant
    from offload_zero.memory.tiers import NVMeStore

    acct = TierAccountant()
    with Swapper(str(tmp_path / "swap"), backend="threads") as sw:
        store = NVMeStore(sw, acct, lambda n, dt: aligned_empty(n, dt), 5120, chunk_numel=1024)
        a, b = _Flat("a"), _Flat("b")
        store.add(a, torch.arange(5120, dtype=torch.float32))
        store.add(b, torch.zeros(3072))
        for fp, lo, hi, master, m, v in store.iter_states([a]):
            master.add_(1.0)
            m.fill_(2.0)
        assert any(w is not None for w in store._pending_write)  # not drained
        assert store.io_stages.stage(a) is StateIO.WRITING  # (its chunks' writes)
        store.wait_writes(a)
        assert all(w is None or w[0] is not a for w in store._pending_write)
        assert store.io_stages.stage(a) is StateIO.AT_REST
        raw = aligned_empty(5120, torch.float32)
        sw.swap_in("a", raw, offset_bytes=0).wait()  # the master region, as a reader
        assert torch.equal(raw, torch.arange(5120, dtype=torch.float32) + 1)
        for fp, lo, hi, master, m, v in store.iter_states([a, b]):  # reuses the buffer sets
            master.add_(1.0)
        master, m, v = store.read_all(a)
        assert torch.equal(master, torch.arange(5120, dtype=torch.float32) + 2)
        assert torch.equal(m, torch.full((5120,), 2.0)) and not v.any()
        assert torch.equal(store.read_all(b)[0], torch.ones(3072))
        store.close()


def test_nvme_store_stream_reads_wait_for_the_same_bytes_still_being_written(tmp_path,
                                                                           monkeypatch):
    """Streaming a state again while the last writes of its previous stream are still in
    flight (nothing drained between), with its chunks in other buffer sets than before: each
    chunk read waits for the write of the same bytes, made slow here, so every stream sees the
    previous one's values."""
    import time
    from offload_zero.memory import aio_threads
    from offload_zero.memory.accounting import TierAccountant
    from offload_zero.memory.tiers import NVMeStore
    run = aio_threads.ThreadsBackend._run

    def slow(request):
        if request.is_write and os.path.basename(request.path) == "a.swp":
            time.sleep(0.1)
        run(request)

    a, b = _Flat("a"), _Flat("b")
    with Swapper(str(tmp_path / "swap"), backend="threads") as sw:
        store = NVMeStore(sw, TierAccountant(), lambda n, dt: aligned_empty(n, dt), 2048,
                          chunk_numel=1024)
        store.add(a, torch.zeros(2048))
        store.add(b, torch.zeros(1024))
        monkeypatch.setattr(aio_threads.ThreadsBackend, "_run", staticmethod(slow))
        # [b, a] puts a's two chunks in buffer sets 1 and 2; [a] then reads them into 0 and 1
        for step, fps in enumerate(([b, a], [a], [b, a], [a]), start=1):
            for fp, lo, hi, master, m, v in store.iter_states(fps):
                if fp is a:
                    assert torch.equal(master, torch.full((hi - lo,), float(step - 1)))
                    master.add_(1.0)
                else:
                    master.sub_(1.0)
        assert torch.equal(store.read_all(a)[0], torch.full((2048,), 4.0))
        assert torch.equal(store.read_all(b)[0], torch.full((1024,), -2.0))
        store.close()


def test_nvme_store_reads_no_state_ahead_while_a_stream_has_part_of_it_updated(tmp_path):
    """A whole-state read-ahead of a flat parameter whose update is suspended (an update
    streaming while other units compute) would read bytes updated but not yet written: it is
    refused until the update has queued its write-back, whether the update streams in chunks
    or takes the state whole from an earlier read-ahead, and the next update sees every new
    value. In chunks, it stays refused after the stream's first chunk writes were waited for
    (four chunks through three buffer sets): the state is in its update until the last."""
    a = _Flat("a")
    with Swapper(str(tmp_path / "swap"), backend="threads") as sw:
        store, ring = _store_with_ring(sw, 2, numel=4096)
        store.add(a, torch.zeros(4096))
        for fp, lo, hi, master, m, v in store.iter_states([a]):  # chunks updated, not written
            master.add_(1.0)
            assert not store.prefetch(a, wait=False) and not store.prefetch(a)
            assert not store.prefetched(a) and store.io_stages.stage(a) is StateIO.IN_UPDATE
        assert store.prefetch(a)                     # waits for the stream's writes
        whole = store.iter_states([a])
        fp, lo, hi, master, m, v = next(whole)
        assert (lo, hi) == (0, 4096) and store.io_stages.stage(a) is StateIO.IN_UPDATE
        assert torch.equal(master, torch.ones(4096))
        master.add_(1.0)
        assert not store.prefetch(a, wait=False) and not store.prefetch(a)
        assert list(whole) == []                     # its write-back is queued
        assert store.prefetch(a)
        for fp, lo, hi, master, m, v in store.iter_states([a]):
            assert torch.equal(master, torch.full((4096,), 2.0))
        store.close()
        ring.close()


def test_nvme_store_defers_a_whole_write_back_until_asked_or_needed(tmp_path):
    """``iter_states(defer_write_back=True)``: the write-back of a state updated from its
    read-ahead buffer is
    not started (no bytes written) until ``start_deferred_writes``, or until something needs
    the buffer or the bytes: a read of that state waits for the write first, ``drain`` and
    ``read_all`` start and finish it. Meanwhile the buffer serves the new master
    (``master_view``), and a read-ahead that must not wait takes no buffer a deferred write
    holds."""
    a, b = _Flat("a"), _Flat("b")
    with Swapper(str(tmp_path / "swap"), backend="threads") as sw:
        store, ring = _store_with_ring(sw, 1)
        store.add(a, torch.zeros(2048))
        store.add(b, torch.zeros(2048))

        def update(fp, value):
            assert store.prefetch(fp)
            for _, lo, hi, master, m, v in store.iter_states([fp], defer_write_back=True):
                assert (lo, hi) == (0, 2048)
                master.fill_(value)
                m.fill_(value + 1)

        written = sw.bytes_written
        update(a, 5.0)
        assert sw.bytes_written == written and store.deferred_writes == 1
        assert store.io_stages.stage(a) is StateIO.WRITE_DEFERRED
        assert store.holds_master(a) and torch.equal(store.master_view(a), torch.full((2048,), 5.0))
        assert not store.prefetch(b, wait=False)   # the only buffer is held by a's write
        store.start_deferred_writes()
        assert store.deferred_writes == 0 and store.io_stages.stage(a) is StateIO.WRITING
        assert store.prefetch(b)                  # retires a's write: its buffer is b's now
        assert store.io_stages.report() == {"b": "read_ahead"}
        assert sw.bytes_written == written + 3 * 2048 * 4
        assert not store.holds_master(a)
        store.release_prefetched()
        update(a, 7.0)
        assert store.prefetch(a)                  # a read of a's state: its write lands first
        for _, lo, hi, master, m, v in store.iter_states([a]):
            assert torch.equal(master, torch.full((2048,), 7.0))
            assert torch.equal(m, torch.full((2048,), 8.0))
        update(b, 9.0)
        master, m, v = store.read_all(b)          # drains: the deferred write first
        assert torch.equal(master, torch.full((2048,), 9.0)) and torch.equal(v, torch.zeros(2048))
        assert store.deferred_writes == 0
        store.close()
        ring.close()
