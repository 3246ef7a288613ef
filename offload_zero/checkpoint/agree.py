"""Agreement between ranks during a save or load: every rank learns whether any rank failed,
and raises if one did, so that no rank waits for another that gave up (see [Note: atomic
save] in :mod:`offload_zero.checkpoint.folder`)."""
from __future__ import annotations

import secrets
from typing import List, Optional

import torch

from offload_zero.lockstep import mark_agreed


def agree(engine, error: Optional[BaseException], what: str, exc_type=RuntimeError,
           on_failure=None) -> None:
    """Collective: wait for every rank (a barrier) and raise on every rank if any failed.

    A rank that failed raises its own ``error``; the others raise ``exc_type`` naming the
    failed ranks. ``on_failure`` (cleanup) runs first wherever it is given, and every rank
    waits for it before raising."""
    failed = _failed_ranks(engine, error is not None)
    if not failed:
        return
    if on_failure is not None:
        on_failure()
    first = _first_error(engine, failed, error)  # (a barrier too: the cleanup is done)
    if error is None:
        error = exc_type(f"[rank {engine.rank}] {what} failed on rank(s) {failed}: "
                         f"rank {failed[0]}: {first}")
    raise mark_agreed(error)  # (every rank raises it: no failure record, see [Note: lockstep])


def _first_error(engine, failed: List[int], error: Optional[BaseException]) -> str:
    """Collective: the message of the lowest failed rank's error, on every rank."""
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    if engine.comm.world_size == 1:
        return text
    return engine.comm.all_gather_object(text, what="checkpoint errors")[failed[0]]


def shared_save_id(engine) -> str:
    """Collective: rank 0's random 62-bit id for this save, as 16 hex digits, on every rank."""
    value = secrets.randbits(62) if engine.rank == 0 else 0
    if engine.comm.world_size > 1:
        t = torch.tensor([value], dtype=torch.int64, device=engine.device)
        engine.comm.all_reduce_sum(t, what="checkpoint id", count=False)  # only rank 0 adds
        value = int(t.item())
    return f"{value:016x}"


def _failed_ranks(engine, failed: bool) -> List[int]:
    """Collective: the ranks that report ``failed`` (a barrier too; one int32 per rank)."""
    comm = engine.comm
    if comm.world_size == 1:
        return [0] if failed else []
    flags = torch.zeros(comm.world_size, dtype=torch.int32, device=engine.device)
    flags[comm.rank] = int(failed)
    comm.all_reduce_sum(flags, what="checkpoint flags", count=False)  # not training traffic
    return [r for r, f in enumerate(flags.tolist()) if f]
