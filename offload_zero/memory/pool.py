"""Fixed pools sized once at start-up: aligned host buffers, and device slots for gathered units.

Buffers that move shards between tiers (NVMe reads of parameter shards, write-back of updated
shards) come from here: no allocation per step, so host memory stays flat however many steps
run, and the pool's own counters say how many buffers are in flight.
"""
from __future__ import annotations

import logging
from typing import List, Tuple

import torch

from offload_zero.config import Tier
from offload_zero.memory.accounting import StateKind, TierAccountant

log = logging.getLogger(__name__)


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


# -- gather buffers ------------------------------------------------------------------------------
def storage_rebinding_supported() -> bool:
    """Whether this torch can point an existing storage at other memory (see :class:`GatherPool`)."""
    return (hasattr(torch.UntypedStorage, "_swap_data_ptr_")
            and hasattr(torch._C, "_construct_storage_from_data_pointer"))


def bind_storage(storage: torch.UntypedStorage, memory: torch.Tensor) -> None:
    """Make ``storage`` (0 bytes) hold exactly ``memory``'s bytes, without copying or allocating.

    The storage object keeps its identity, so every tensor and autograd-saved view already
    built on it sees the new memory. ``memory`` must outlive the binding (see
    :func:`unbind_storage`); it stays owned by its own tensor.

    Args:
        storage: the storage to bind (0 bytes). memory: any contiguous tensor on the same
            device; the storage then holds ``memory.numel() * memory.element_size()`` bytes.

    Raises:
        RuntimeError: ``storage`` already holds bytes (unbind it first).
    """
    if storage.nbytes() != 0:
        raise RuntimeError(f"bind_storage: the storage already holds {storage.nbytes()} bytes")
    nbytes = memory.numel() * memory.element_size()
    borrowed = torch._C._construct_storage_from_data_pointer(memory.data_ptr(), memory.device, nbytes)
    storage._swap_data_ptr_(borrowed)


def unbind_storage(storage: torch.UntypedStorage, keep_values: bool = False) -> None:
    """Detach ``storage`` from borrowed memory: afterwards it holds 0 bytes, or with
    ``keep_values`` a private copy of the bytes it held (so views that outlive the pool stay
    readable; that copy allocates ``storage.nbytes()`` bytes on its device)."""
    nbytes = storage.nbytes()
    if keep_values:
        own = torch.empty(nbytes, dtype=torch.uint8, device=storage.device).untyped_storage()
        own.copy_(storage)
    else:
        own = torch.empty(0, dtype=torch.uint8, device=storage.device).untyped_storage()
    storage._swap_data_ptr_(own)


class GatherPool:
    """Fixed device memory for unsharded units (stage 3): ``count`` slots of ``slot_bytes`` each.

    [Note: gather pool]
    A unit is gathered into a free slot and its flat parameters' storages are pointed at the
    slot (:func:`bind_storage`); resharding points them back at 0 bytes and frees the slot. The
    storage objects never change, so the views autograd saved in forward see the values gathered
    again for backward, whichever slot that is. No allocation happens per gather, so device
    memory for parameters is constant from start-up: ``count * slot_bytes`` (ZeRO-R's constant
    buffers, Rajbhandari et al. 2019, section 6.3). ``count`` is what the schedule keeps in
    flight (``prefetch + 1`` units, one with NVMe-resident shards); if a model's schedule holds
    more at once (units that share weights across blocks, frozen weights kept to the end of
    backward), the pool adds one slot with a warning naming how many it now has: a one-time
    cost, after which memory is flat again.

    Args:
        name: label for messages and reports.
        count: slots sized at start-up (>= 1); slot_bytes: bytes per slot (a multiple of 4096).
        device: where the slots live (the accelerator, or the CPU playing it).
        accountant: the capacity is recorded as device ``BUFFERS``.

    Raises:
        ValueError: ``count`` or ``slot_bytes`` below 1.
        RuntimeError: :meth:`acquire` after :meth:`close`; :meth:`release` of a slot not in use.
    """

    def __init__(self, name: str, count: int, slot_bytes: int, device: torch.device,
                 accountant: TierAccountant):
        if count < 1 or slot_bytes < 1:
            raise ValueError(f"gather pool {name!r}: count={count} and slot_bytes={slot_bytes} "
                             "must be >= 1")
        self.name, self.slot_bytes, self.device = name, slot_bytes, device
        self._acct = accountant
        self._slots: List[torch.Tensor] = []
        self._free: List[int] = []
        self.grown = 0
        self.peak_in_use = 0
        self._closed = False
        self._add_slots(count)

    def _add_slots(self, n: int) -> None:
        block = torch.empty(n * self.slot_bytes, dtype=torch.uint8, device=self.device)
        first = len(self._slots)
        self._slots += list(block.split(self.slot_bytes))
        self._free += range(first + n - 1, first - 1, -1)
        self._acct.add(Tier.DEVICE, StateKind.BUFFERS, n * self.slot_bytes)

    @property
    def count(self) -> int:
        """Slots in the pool now."""
        return len(self._slots)

    @property
    def in_use(self) -> int:
        """Slots holding a unit now."""
        return self.count - len(self._free)

    def acquire(self) -> Tuple[int, torch.Tensor]:
        """Take a free slot: ``(slot id, uint8 tensor of slot_bytes)``, contents undefined."""
        if self._closed:
            raise RuntimeError(f"gather pool {self.name!r} is closed")
        if not self._free:
            self.grown += 1
            log.warning("gather pool %r: the schedule holds more units at once than the %d slots "
                        "sized at start-up; adding one slot of %d bytes (now %d)", self.name,
                        self.count, self.slot_bytes, self.count + 1)
            self._add_slots(1)
        slot = self._free.pop()
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return slot, self._slots[slot]

    def release(self, slot: int) -> None:
        """Give slot ``slot`` back."""
        if slot in self._free or not 0 <= slot < self.count:
            raise RuntimeError(f"gather pool {self.name!r}: slot {slot} is not in use")
        self._free.append(slot)

    def report(self) -> dict:
        """``{"buffers", "buffer_bytes", "capacity_bytes", "in_use", "peak_in_use", "grown"}``."""
        return {"buffers": self.count, "buffer_bytes": self.slot_bytes,
                "capacity_bytes": self.count * self.slot_bytes, "in_use": self.in_use,
                "peak_in_use": self.peak_in_use, "grown": self.grown}

    def close(self) -> None:
        """Drop the slots; idempotent. Bound storages must have been unbound first."""
        if not self._closed:
            self._closed = True
            self._acct.sub(Tier.DEVICE, StateKind.BUFFERS, self.count * self.slot_bytes)
            self._slots, self._free = [], []
