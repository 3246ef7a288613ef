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
import contextlib
import datetime
import os
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from offload_zero.lockstep import Lockstep, Phase, PeerFailure

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
    """The data-parallel group, its byte counters and its lockstep checks.

    Every collective names what it moves (``what``: a flat parameter's name, or a tag such as
    ``"grad norm"``); at world size > 1 it first goes through :class:`offload_zero.lockstep.
    Lockstep`, which checks that every rank is at the same collective and stops waiting when
    another rank failed (see [Note: lockstep]).

    Args:
        group: a ``torch.distributed`` process group, or None for the default group (or no
            group at all when ``torch.distributed`` is not initialised: world size 1).
        device: the engine's device (where the fingerprints of the checks live on NCCL).
        check_collectives: exchange a fingerprint before each collective (world size > 1).
        timeout_s: seconds a rank waits at one collective before it raises (world size > 1).
        poll_s: seconds between looks for another rank's failure record while waiting.

    Raises:
        ValueError: ``group`` given while ``torch.distributed`` is not initialised.
    """

    def __init__(self, group=None, device: Optional[torch.device] = None,
                 check_collectives: bool = True, timeout_s: float = 300.0, poll_s: float = 1.0):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            if group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialised")
            self.world_size, self.rank = 1, 0
        self.lockstep: Optional[Lockstep] = None
        if self.world_size > 1:
            self.lockstep = Lockstep(group, self.rank, self.world_size,
                                     device or torch.device("cpu"), check=check_collectives,
                                     poll_s=poll_s, timeout_s=timeout_s)
        self._bytes: Dict[str, int] = collections.defaultdict(int)
        self._last_step: Dict[str, int] = {k: 0 for k in COLLECTIVE_KINDS}

    # -- lockstep ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Collectives issued inside carry ``phase`` in their fingerprints (the outer phase
        comes back on exit)."""
        ls = self.lockstep
        if ls is None:
            yield
            return
        outer, ls.phase = ls.phase, phase
        try:
            yield
        finally:
            ls.phase = outer

    def set_phase(self, phase: Phase) -> None:
        """Collectives from now on carry ``phase`` (for hooks that cannot wrap a block)."""
        if self.lockstep is not None:
            self.lockstep.phase = phase

    def report_failure(self, exc: BaseException) -> None:
        """This rank failed with ``exc``: let ranks waiting for it stop (world size > 1)."""
        if self.lockstep is not None:
            self.lockstep.report_failure(exc)

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """An error in the body is recorded (:meth:`report_failure`), then raised: the other
        ranks stop waiting for this one (see [Note: lockstep])."""
        try:
            yield
        except BaseException as exc:
            self.report_failure(exc)
            raise

    @contextlib.contextmanager
    def together(self, phase: Phase) -> Iterator[None]:
        """The body's collectives carry ``phase`` in their lockstep fingerprints
        (:meth:`phase`), and an error in it is recorded for the other ranks
        (:meth:`reporting`)."""
        with self.phase(phase), self.reporting():
            yield

    def _run(self, kind: str, numel: int, dtype: torch.dtype, what: str, op) -> None:
        """Run collective ``op(async_op) -> work`` after the lockstep check (world size > 1)."""
        ls = self.lockstep
        ls.before(kind, numel, dtype, what)
        try:
            if ls.check:
                op(False)  # every rank is at this collective: it completes without waiting long
            else:
                ls.wait(op(True), kind, what)
        except PeerFailure:
            raise
        except RuntimeError as exc:
            if _looks_like_lost_peer(exc):
                raise ls.peer_failure(kind, what, exc) from exc
            raise

    # -- collectives -------------------------------------------------------------------------
    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor, what: str = "") -> None:
        """Fill ``full`` (numel = N * shard.numel, same dtype/device) with every rank's shard."""
        n = self.world_size
        self._count("all_gather", full.numel() * full.element_size() * (n - 1) / n)
        if n == 1:
            full.copy_(shard)
            return
        if shard.data_ptr() == full[self.rank * shard.numel():].data_ptr():
            shard = shard.clone()  # in-place gather: not every backend accepts aliasing
        self._run("all_gather", full.numel(), full.dtype, what,
                  lambda a: _all_gather(full, shard, group=self.group, async_op=a))

    def reduce_scatter_avg(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                           scratch: Optional[torch.Tensor] = None, what: str = "") -> None:
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
        in_place = shard_out.data_ptr() == full_in[self.rank * shard_out.numel():].data_ptr()
        out = (scratch if scratch is not None else torch.empty_like(shard_out)) if in_place \
            else shard_out
        self._run("reduce_scatter", full_in.numel(), full_in.dtype, what,
                  lambda a: _reduce_scatter(out, full_in, group=self.group, async_op=a))
        if in_place:
            shard_out.copy_(out)
        shard_out.div_(n)

    def all_reduce_sum(self, t: torch.Tensor, what: str = "", count: bool = True) -> torch.Tensor:
        """Sum ``t`` in place over ranks and return it (``count=False``: not counted as
        training traffic)."""
        n = self.world_size
        if count:
            self._count("all_reduce", t.numel() * t.element_size() * 2 * (n - 1) / n)
        if n > 1:
            self._run("all_reduce", t.numel(), t.dtype, what,
                      lambda a: dist.all_reduce(t, group=self.group, async_op=a))
        return t

    def all_gather_object(self, obj, what: str = "") -> List:
        """Every rank's ``obj`` (picklable), by rank; ``[obj]`` at world size 1."""
        if self.world_size == 1:
            return [obj]
        self.lockstep.before("all_gather_object", 0, torch.uint8, what)
        out = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            if _looks_like_lost_peer(exc):
                raise self.lockstep.peer_failure("all_gather_object", what, exc) from exc
            raise
        return out

    def barrier(self, what: str = "barrier") -> None:
        """Wait for every rank (no-op at world size 1)."""
        if self.world_size > 1:
            self._run("barrier", 0, torch.uint8, what,
                      lambda a: dist.barrier(group=self.group, async_op=a))

    # -- counters ----------------------------------------------------------------------------
    def _count(self, kind: str, nbytes: float) -> None:
        self._bytes[kind] += int(round(nbytes))

    def end_step(self) -> None:
        """Close a step: what :meth:`report` returns as ``"last_step"`` is the bytes since the
        previous ``end_step``."""
        self._last_step = {k: self._bytes[k] - self._mark.get(k, 0) for k in COLLECTIVE_KINDS} \
            if hasattr(self, "_mark") else {k: self._bytes[k] for k in COLLECTIVE_KINDS}
        self._mark = {k: self._bytes[k] for k in COLLECTIVE_KINDS}
        if self.lockstep is not None:
            self.lockstep.end_step()

    def report(self) -> Dict[str, Dict[str, int]]:
        """``{"last_step": {kind: bytes}, "total": {kind: bytes}}`` for this rank."""
        return {"last_step": dict(self._last_step),
                "total": {k: self._bytes[k] for k in COLLECTIVE_KINDS}}


def _looks_like_lost_peer(exc: BaseException) -> bool:
    """Whether a collective's RuntimeError is the transport's (a closed connection, a
    timeout), not a caller's mistake such as a wrong shape."""
    text = str(exc).lower()
    return any(w in text for w in ("connection", "gloo", "nccl", "timed out", "peer", "socket"))
