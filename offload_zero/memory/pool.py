"""A fixed pool of equal-size aligned host buffers, sized once at start-up.

Buffers that move shards between tiers (NVMe reads of parameter shards, write-back of updated
shards) come from here: no allocation per step, so host memory stays flat however many steps
run, and the pool's own counters say how many buffers are in flight.
"""
from __future__ import annotations

from typing import List

import torch

from offload_zero.config import Tier
from offload_zero.memory.accounting import StateKind, TierAccountant


class HostBufferPool:
    """``count`` buffers of ``numel`` elements of ``dtype``, 4096-byte aligned.

    Args:
        name: label for messages and reports.
        count: number of buffers (>= 1).
        numel: elements per buffer (the largest shard it must hold).
        dtype: element type.
        host_alloc: ``f(numel, dtype) -> Tensor`` (aligned, pinned when CUDA is present).
        accountant: the pool's whole capacity is recorded once as host ``BUFFERS``.

    Raises:
        RuntimeError: :meth:`acquire` on an empty pool (a broken invariant: the pool is sized
            for the most buffers the schedule can hold at once).
    """

    def __init__(self, name: str, count: int, numel: int, dtype: torch.dtype, host_alloc,
                 accountant: TierAccountant):
        self.name, self.numel, self.dtype = name, numel, dtype
        self._free: List[torch.Tensor] = [host_alloc(numel, dtype) for _ in range(count)]
        self.count = count
        self.buffer_bytes = numel * torch.empty(0, dtype=dtype).element_size()
        self.capacity_bytes = count * self.buffer_bytes
        self._acct = accountant
        accountant.add(Tier.HOST, StateKind.BUFFERS, self.capacity_bytes)
        self.peak_in_use = 0
        self._closed = False

    @property
    def in_use(self) -> int:
        """Buffers handed out and not yet released."""
        return self.count - len(self._free)

    def acquire(self) -> torch.Tensor:
        """Take a buffer, shape (numel,), contents undefined."""
        if not self._free:
            raise RuntimeError(f"host buffer pool {self.name!r} is empty ({self.count} buffers of "
                               f"{self.buffer_bytes} bytes all in flight)")
        buf = self._free.pop()
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer back."""
        self._free.append(buf)

    def report(self) -> dict:
        """``{"buffers", "buffer_bytes", "capacity_bytes", "in_use", "peak_in_use"}``."""
        return {"buffers": self.count, "buffer_bytes": self.buffer_bytes,
                "capacity_bytes": self.capacity_bytes, "in_use": self.in_use,
                "peak_in_use": self.peak_in_use}

    def close(self) -> None:
        """Drop the buffers; idempotent."""
        if not self._closed:
            self._closed = True
            self._acct.sub(Tier.HOST, StateKind.BUFFERS, self.capacity_bytes)
            self._free = []
