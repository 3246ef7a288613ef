"""Where fp32 master weights and Adam moments live, and how the step walks them.

Three stores share one interface. ``iter_states(flat_params)`` yields, for each flat parameter
in turn, ``(fp, master, exp_avg, exp_avg_sq)`` as fp32 tensors of shape (shard_numel,) that
the caller updates in place; whatever the caller wrote is persisted by the store.

- :class:`DeviceStore` (``offload="none"``): tensors on the accelerator.
- :class:`HostStore` (``offload="cpu"``): 4096-aligned (pinned when CUDA is present) host tensors.
- :class:`NVMeStore` (``offload="nvme"``): one file per flat parameter holding
  ``[master | exp_avg | exp_avg_sq]`` (3 * shard_numel fp32, 4096-aligned), and a pipeline of
  three host buffer sets: while the caller updates flat parameter k, the read of k+1 is in
  flight and the write of k-1 drains (ZeRO-Infinity's overlap of NVMe I/O with the update).
"""
from __future__ import annotations

import os
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from offload_zero.config import Tier
from offload_zero.memory.accounting import StateKind, TierAccountant

StateTuple = Tuple[object, torch.Tensor, torch.Tensor, torch.Tensor]


class _TensorStore:
    """Shared code of the stores that keep the three tensors resident (device or host)."""

    tier: Tier

    def __init__(self, accountant: TierAccountant, alloc):
        self._acct, self._alloc = accountant, alloc
        self._state: Dict[object, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._held: Dict[object, Tuple[int, int]] = {}

    def add(self, fp, master_shard: torch.Tensor, alias: Optional[torch.Tensor] = None) -> None:
        """Register ``fp`` with initial fp32 master values ``master_shard`` (shard_numel,).

        ``alias``: an existing fp32 tensor to use as the master (fp32 compute on the same tier).
        """
        n = master_shard.numel()
        master = alias if alias is not None else self._alloc(n, torch.float32)
        if alias is None:
            master.copy_(master_shard)
        m, v = self._alloc(n, torch.float32), self._alloc(n, torch.float32)
        m.zero_()
        v.zero_()
        self._state[fp] = (master, m, v)
        master_bytes = 0 if alias is not None else 4 * n
        self._held[fp] = (master_bytes, 8 * n)
        self._acct.add(self.tier, StateKind.MASTER, master_bytes)
        self._acct.add(self.tier, StateKind.MOMENTS, 8 * n)

    def iter_states(self, flat_params: List[object]) -> Iterator[StateTuple]:
        """Yield ``(fp, master, exp_avg, exp_avg_sq)`` for each flat parameter, in order."""
        for fp in flat_params:
            yield (fp, *self._state[fp])

    def read_master(self, fp) -> torch.Tensor:
        """This rank's fp32 master shard of ``fp`` (a copy on the CPU), shape (shard_numel,)."""
        return self._state[fp][0].detach().to("cpu", copy=True)

    def read_all(self, fp) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU copies of (master, exp_avg, exp_avg_sq) for ``fp``."""
        return tuple(t.detach().to("cpu", copy=True) for t in self._state[fp])

    def close(self) -> None:
        """Release every tensor; idempotent."""
        for fp, (mb, sb) in self._held.items():
            self._acct.sub(self.tier, StateKind.MASTER, mb)
            self._acct.sub(self.tier, StateKind.MOMENTS, sb)
        self._held.clear()
        self._state.clear()


class DeviceStore(_TensorStore):
    """Master weights and moments on the accelerator (``offload="none"``)."""

    tier = Tier.DEVICE

    def __init__(self, accountant: TierAccountant, device: torch.device):
        super().__init__(accountant, lambda n, dt: torch.empty(n, dtype=dt, device=device))


class HostStore(_TensorStore):
    """Master weights and moments in aligned host memory (``offload="cpu"``)."""

    tier = Tier.HOST

    def __init__(self, accountant: TierAccountant, host_alloc):
        super().__init__(accountant, host_alloc)


class NVMeStore:
    """Master weights and moments in O_DIRECT files, streamed through three host buffer sets.

    Args:
        folder: this rank's swap folder (created by the swapper; removed on close).
        accountant: byte accounting (NVMe: file bytes; host: pipeline buffers).
        host_alloc: ``f(numel, dtype)`` returning 4096-aligned host tensors.
        max_shard_numel: the largest shard_numel of any flat parameter (sizes the buffers).
        backend, block_size, queue_depth: swapper settings (see ``Swapper``).

    Raises:
        ValueError: the folder cannot be used (from ``Swapper``).
        offload_zero.memory.swapper.SwapIOError: an I/O failed; it names file and offset.
    """

    tier = Tier.NVME
    _DEPTH = 3  # buffer sets: read k+1 | update k | write k-1

    def __init__(self, folder: str, accountant: TierAccountant, host_alloc, max_shard_numel: int,
                 backend: str = "auto", block_size: int = 1 << 20, queue_depth: int = 8):
        from offload_zero.memory.swapper import Swapper
        self._acct = accountant
        self.swapper = Swapper(folder, backend=backend, block_size=block_size, queue_depth=queue_depth)
        self._max = max_shard_numel
        self._bufs = [host_alloc(3 * max_shard_numel, torch.float32) for _ in range(self._DEPTH)]
        self._buf_bytes = sum(b.numel() * 4 for b in self._bufs)
        self._acct.add(Tier.HOST, StateKind.BUFFERS, self._buf_bytes)
        self._pending_write = [None] * self._DEPTH
        self._numel: Dict[object, int] = {}
        self._keys: Dict[object, str] = {}
        self._closed = False

    def add(self, fp, master_shard: torch.Tensor, alias: Optional[torch.Tensor] = None) -> None:
        """Create ``fp``'s file and write the initial master (and zero moments) to it."""
        n = master_shard.numel()
        key = fp.name
        self.swapper.allocate(key, 3 * n * 4)
        self._numel[fp], self._keys[fp] = n, key
        self._acct.add(Tier.NVME, StateKind.MASTER, 4 * n)
        self._acct.add(Tier.NVME, StateKind.MOMENTS, 8 * n)
        buf = self._bufs[0][:3 * n]
        buf[:n].copy_(master_shard)
        buf[n:].zero_()
        self.swapper.swap_out(key, buf).wait()

    def _views(self, slot: int, n: int):
        b = self._bufs[slot]
        return b[:n], b[n:2 * n], b[2 * n:3 * n]

    def _start_read(self, slot: int, fp):
        w = self._pending_write[slot]
        if w is not None:
            w.wait()
            self._pending_write[slot] = None
        n = self._numel[fp]
        return self.swapper.swap_in(self._keys[fp], self._bufs[slot][:3 * n])

    def iter_states(self, flat_params: List[object]) -> Iterator[StateTuple]:
        """Yield each flat parameter's state from a host buffer; write it back after the caller
        is done with it, with the next read and the previous write in flight meanwhile."""
        fps = list(flat_params)
        if not fps:
            return
        reads = {0: self._start_read(0, fps[0])}
        try:
            for i, fp in enumerate(fps):
                slot = i % self._DEPTH
                if i + 1 < len(fps):
                    reads[i + 1] = self._start_read((i + 1) % self._DEPTH, fps[i + 1])
                reads.pop(i).wait()
                yield (fp, *self._views(slot, self._numel[fp]))
                n = self._numel[fp]
                self._pending_write[slot] = self.swapper.swap_out(self._keys[fp], self._bufs[slot][:3 * n])
        finally:
            for h in reads.values():
                h.wait()
            self.drain()

    def drain(self) -> None:
        """Wait for every write in flight; raises SwapIOError if one failed."""
        for slot, w in enumerate(self._pending_write):
            if w is not None:
                self._pending_write[slot] = None
                w.wait()

    def read_all(self, fp) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU copies of (master, exp_avg, exp_avg_sq) for ``fp``, read from its file."""
        self.drain()
        n = self._numel[fp]
        self.swapper.swap_in(self._keys[fp], self._bufs[0][:3 * n]).wait()
        return tuple(t.clone() for t in self._views(0, n))

    def read_master(self, fp) -> torch.Tensor:
        """This rank's fp32 master shard of ``fp``, read from its file (a CPU copy)."""
        return self.read_all(fp)[0]

    @property
    def read_bytes(self) -> int:
        """Bytes read from NVMe since construction."""
        return self.swapper.bytes_read

    @property
    def written_bytes(self) -> int:
        """Bytes written to NVMe since construction."""
        return self.swapper.bytes_written

    def close(self) -> None:
        """Wait for I/O, remove the files and the folder, release buffers; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            self.swapper.close()
            for fp, n in self._numel.items():
                self._acct.sub(Tier.NVME, StateKind.MASTER, 4 * n)
                self._acct.sub(Tier.NVME, StateKind.MOMENTS, 8 * n)
            self._numel.clear()
            self._acct.sub(Tier.HOST, StateKind.BUFFERS, self._buf_bytes)
            self._bufs = []
