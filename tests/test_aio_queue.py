"""The swap backends' queue: reads go before queued writes, except behind writes to their own
file (offload_zero/memory/aio_queue.py), in the queue alone and through a real Swapper."""
import pytest
import torch

from offload_zero.memory import ALIGNMENT, Swapper, aligned_empty
from offload_zero.memory import swapper as swapper_mod
from offload_zero.memory.aio_queue import ReadsFirst


class _Req:
    def __init__(self, name, fd, is_write, urgent=False):
        self.name, self.fd, self.is_write, self.urgent = name, fd, is_write, urgent

    def __repr__(self):
        return self.name


def _names(reqs):
    return [r.name for r in reqs]


def test_reads_go_before_queued_writes_of_other_files():
    q = ReadsFirst()
    q.extend([_Req("w1", 1, True), _Req("w2", 1, True), _Req("r3", 3, False),
              _Req("w3", 2, True), _Req("r4", 4, False)])
    assert len(q) == 5 and q
    assert _names(q.take(3)) == ["r3", "r4", "w1"]
    assert _names(q.take(10)) == ["w2", "w3"]
    assert not q and len(q) == 0 and q.take(1) == []


def test_a_read_stays_behind_queued_writes_of_its_own_file():
    q = ReadsFirst()
    q.extend([_Req("w1a", 1, True), _Req("w1b", 1, True), _Req("r1", 1, False),
              _Req("r2", 2, False)])
    assert _names(q.take(1)) == ["r2"]
    assert _names(q.take(4)) == ["w1a", "w1b", "r1"]
    # once the file's writes have left the queue, its reads go first again
    q.extend([_Req("w5", 5, True), _Req("r1b", 1, False)])
    assert _names(q.take(2)) == ["r1b", "w5"]


def test_urgent_reads_go_before_other_reads_but_not_before_their_files_writes():
    q = ReadsFirst()
    q.extend([_Req("w1", 1, True), _Req("r2", 2, False), _Req("u3", 3, False, urgent=True),
              _Req("u1", 1, False, urgent=True), _Req("u4", 4, False, urgent=True)])
    assert _names(q.take(3)) == ["u3", "u4", "r2"]
    assert _names(q.take(3)) == ["w1", "u1"]
    q.extend([_Req("r5", 5, False), _Req("u6", 6, False, urgent=True)])
    taken = q.take(2)
    q.put_back(taken)
    assert _names(q.take(2)) == ["u6", "r5"]


def test_put_back_restores_the_order_and_items_empties():
    q = ReadsFirst()
    reqs = [_Req("w1", 1, True), _Req("r1", 1, False), _Req("r2", 2, False), _Req("w2", 2, True)]
    q.extend(reqs)
    taken = q.take(3)
    assert _names(taken) == ["r2", "w1", "r1"]
    q.put_back(taken[1:])  # the kernel took only the first
    assert _names(q.take(10)) == ["w1", "r1", "w2"]
    q.extend(reqs)
    assert sorted(_names(q.items())) == sorted(_names(reqs)) and not q
    q.extend([_Req("r1", 1, False)])
    assert _names(q.take(1)) == ["r1"]  # (items() forgot the queued writes of file 1)


@pytest.mark.parametrize("backend", ["libaio", "threads"])
def test_a_read_overtakes_a_long_write_back_and_sees_its_own_files_writes(backend, tmp_path,
                                                                           monkeypatch):
    """One request in flight at a time: a read of another file queued behind 64 writes finishes
    before most of them; a read of the file being written returns the written bytes."""
    done = []
    finish = swapper_mod._Request.finish

    def logged(request, res):
        key = request.path.rsplit("/", 1)[-1][:-len(".swp")]
        done.append(("write" if request.is_write else "read", key))
        return finish(request, res)

    monkeypatch.setattr(swapper_mod._Request, "finish", logged)
    block = 16 * ALIGNMENT
    with Swapper(str(tmp_path / "s"), backend=backend, block_size=block, queue_depth=1) as sw:
        if sw.backend != backend:
            pytest.skip(f"the {backend} backend is not available here")
        sw.allocate("a", 64 * block)
        sw.allocate("b", block)
        big = aligned_empty(64 * block, torch.uint8)
        big.copy_(torch.arange(big.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
        sw.swap_out("b", big[:block]).wait()
        writes = sw.swap_out("a", big)
        back_b = aligned_empty(block, torch.uint8)
        sw.swap_in("b", back_b).wait()
        back_a = aligned_empty(64 * block, torch.uint8)
        sw.swap_in("a", back_a).wait()  # (queued behind a's writes)
        writes.wait()
    order = done[1:]  # (after b's first write)
    assert order.index(("read", "b")) < 32, order
    assert torch.equal(back_a, big) and torch.equal(back_b, big[:block])
