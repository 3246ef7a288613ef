"""Collectives over ``torch.distributed`` with byte counters.

All data-parallel traffic goes through :class:`Comm`: all-gather of parameter shards,
reduce-scatter of gradients (averaged over ranks, DDP semantics) and all-reduce of scalars.
World size 1 needs no process group: the collectives degenerate into copies.

Bytes are counted as the ring algorithm moves them per rank (Rajbhandari et al., 2019, sec. 7):
``(N-1)/N * full_bytes`` for all-gather and reduce-scatter, ``2(N-1)/N * full_bytes`` for
all-reduce, where ``full_bytes`` is the size of the unsharded tensor.
"""
from __future__ import annotations

import collections
import datetime
import os
from typing import Dict, Optional

import torch
import torch.distributed as dist

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# torch renamed the tensor-in/tensor-out collectives; use the current names where they exist.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_from_env(timeout_s: float, device: torch.device) -> None:
    """Initialise the default process group from torchrun's environment if needed.

    Does nothing when a process group exists already or when ``WORLD_SIZE`` is unset or 1.
    Backend: NCCL for CUDA devices, gloo otherwise. ``timeout_s`` (seconds) bounds every
    collective, so a lost rank becomes an error on the others instead of a hang.
    """
    if dist.is_available() and dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


class Comm:
    """The data-parallel group and its byte counters.

    Args:
        group: a ``torch.distributed`` process group, or None for the default group (or no
            group at all when ``torch.distributed`` is not initialised: world size 1).
    """

    def __init__(self, group=None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            if group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialised")
            self.world_size, self.rank = 1, 0
        self._bytes: Dict[str, int] = collections.defaultdict(int)
        self._last_step: Dict[str, int] = {k: 0 for k in COLLECTIVE_KINDS}

    # -- collectives -------------------------------------------------------------------------
    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill ``full`` (numel = N * shard.numel, same dtype/device) with every rank's shard."""
        n = self.world_size
        self._count("all_gather", full.numel() * full.element_size() * (n - 1) / n)
        if n == 1:
            full.copy_(shard)
            return
        if shard.data_ptr() == full[self.rank * shard.numel():].data_ptr():
            shard = shard.clone()  # in-place gather: not every backend accepts aliasing
        _all_gather(full, shard, group=self.group)

    def reduce_scatter_avg(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                           scratch: Optional[torch.Tensor] = None) -> None:
        """Average ``full_in`` over ranks and write this rank's slice into ``shard_out``.

        ``full_in`` may be overwritten (it is scratch). Shapes: full_in (N * S,), shard_out (S,).
        When ``shard_out`` is this rank's window of ``full_in`` (in place), the result goes
        through ``scratch`` (S elements; allocated per call if None).
        """
        n = self.world_size
        self._count("reduce_scatter", full_in.numel() * full_in.element_size() * (n - 1) / n)
        if n == 1:
            shard_out.copy_(full_in)
            return
        if shard_out.data_ptr() == full_in[self.rank * shard_out.numel():].data_ptr():
            out = scratch if scratch is not None else torch.empty_like(shard_out)
            _reduce_scatter(out, full_in, group=self.group)
            shard_out.copy_(out)
        else:
            _reduce_scatter(shard_out, full_in, group=self.group)
        shard_out.div_(n)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over ranks and return it."""
        n = self.world_size
        self._count("all_reduce", t.numel() * t.element_size() * 2 * (n - 1) / n)
        if n > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def barrier(self) -> None:
        """Wait for every rank (no-op at world size 1)."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    # -- counters ----------------------------------------------------------------------------
    def _count(self, kind: str, nbytes: float) -> None:
        self._bytes[kind] += int(round(nbytes))

    def end_step(self) -> None:
        """Close a step: what :meth:`report` returns as ``"last_step"`` is the bytes since the
        previous ``end_step``."""
        self._last_step = {k: self._bytes[k] - self._mark.get(k, 0) for k in COLLECTIVE_KINDS} \
            if hasattr(self, "_mark") else {k: self._bytes[k] for k in COLLECTIVE_KINDS}
        self._mark = {k: self._bytes[k] for k in COLLECTIVE_KINDS}

    def report(self) -> Dict[str, Dict[str, int]]:
        """``{"last_step": {kind: bytes}, "total": {kind: bytes}}`` for this rank."""
        return {"last_step": dict(self._last_step),
                "total": {k: self._bytes[k] for k in COLLECTIVE_KINDS}}
