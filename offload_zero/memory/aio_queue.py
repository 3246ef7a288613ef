"""The swap backends' queue of requests not yet started: reads before writes.

A read is what a computation waits for (a unit's parameters, the optimizer state of the next
update); a write only holds its buffer until it is done. With one first-in-first-out queue the
reads a forward needs waited behind the write-backs of the units before it, so the disk's whole
queue stood between every unit and its compute. Here a queued read goes before the queued
writes, unless a write to the same file is still queued (it may cover the read's bytes): then
it keeps its place behind that file's writes. An urgent read (a parameter shard a gather will
wait for: ``Swapper.swap_in(..., urgent=True)``) goes before the other reads (optimizer state
read ahead for a later update). Nothing here changes what the engine waits for
before it reads bytes it has written (see [Note: update states]); a read never overtakes a
queued write to its own file.
"""
from __future__ import annotations

import collections

__all__ = ["ReadsFirst"]


class ReadsFirst:
    """The requests not yet handed to the kernel: urgent reads, then reads, then writes, each
    kind in order (a request's ``is_write``, ``fd`` and ``urgent``, if it has one).

    A read queued behind writes goes first, unless a write to the same file is still queued
    (it may cover the read's bytes): then it waits behind that file's writes, in order.
    """

    def __init__(self) -> None:
        self._urgent: collections.deque = collections.deque()
        self._reads: collections.deque = collections.deque()
        self._writes: collections.deque = collections.deque()  # (and reads held behind them)
        self._writes_of: collections.Counter = collections.Counter()  # fd -> queued writes

    def __bool__(self) -> bool:
        return bool(self._urgent or self._reads or self._writes)

    def __len__(self) -> int:
        return len(self._urgent) + len(self._reads) + len(self._writes)

    def _read_queue(self, r) -> collections.deque:
        return self._urgent if getattr(r, "urgent", False) else self._reads

    def extend(self, requests) -> None:
        """Queue ``requests`` (in order within each kind)."""
        for r in requests:
            if r.is_write:
                self._writes_of[r.fd] += 1
                self._writes.append(r)
            elif self._writes_of[r.fd]:
                self._writes.append(r)
            else:
                self._read_queue(r).append(r)

    def take(self, count: int) -> list:
        """Up to ``count`` requests to submit now: queued urgent reads first, then the other
        reads, then the rest in order."""
        out = []
        while len(out) < count and self:
            if self._urgent or self._reads:
                out.append((self._urgent or self._reads).popleft())
                continue
            r = self._writes.popleft()
            if r.is_write:
                self._writes_of[r.fd] -= 1
                if not self._writes_of[r.fd]:
                    del self._writes_of[r.fd]
            out.append(r)
        return out

    def put_back(self, requests) -> None:
        """Return requests :meth:`take` gave (in its order) but the kernel did not take, to the
        heads of the queues: a read behind a write of its own file among them stays behind it."""
        held, placed = set(), []
        for r in requests:
            if r.is_write:
                held.add(r.fd)
            placed.append((r, r.is_write or r.fd in held))
        for r, behind in reversed(placed):
            if r.is_write:
                self._writes_of[r.fd] += 1
            (self._writes if behind else self._read_queue(r)).appendleft(r)

    def items(self) -> list:
        """Every queued request; the queues are emptied."""
        out = list(self._urgent) + list(self._reads) + list(self._writes)
        self._urgent.clear()
        self._reads.clear()
        self._writes.clear()
        self._writes_of.clear()
        return out
