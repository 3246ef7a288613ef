"""Lockstep across ranks: each collective checked against the other ranks', and a failing
rank stops the job.

[Note: lockstep]
Collectives pair up by their order on each rank: the k-th collective of rank 0 meets the k-th of
rank 1. If the ranks disagree about what the k-th one is (one rank ran another expert's unit,
skipped a branch, or ran one no-grad forward more), collectives of equal size pair up without
complaint and every rank goes on with wrong numbers. Collectives of unequal size hang or fail.
So before each collective every rank all-gathers a fingerprint of it: ``FIELDS`` int64 values,
namely the step, the collective's index in that step, its kind, its element count and dtype,
the phase the engine is in (see :class:`Phase`), and a CRC-32 of what it moves (a flat
parameter's name). If any field differs, every rank raises :class:`CollectiveMismatch`, naming
what each rank was doing.

The fingerprint's all-gather is also where a rank waits for the others. It waits in slices of
``poll_s`` seconds. Between slices it looks in the process group's store for a failure record.
A rank whose engine call raised writes one (its rank and the exception's text) before
re-raising. When one rank fails and stays alive (a script that catches the error to write
logs, or one that hangs after it), the others raise :class:`PeerFailure` within about
``poll_s`` instead of waiting ``timeout_s``. A rank that dies closes its connections, and gloo
reports that at once; the error is raised again as :class:`PeerFailure`, naming the
collective that was being waited for. With ``check=False`` no fingerprint is exchanged: each
collective is itself waited on in slices, so a failed rank is still found.

Cost: one all-gather of ``8 * FIELDS`` bytes per rank before each collective (measured by
``benchmarks/bench_lockstep.py``). On CUDA the fingerprints travel over a gloo group of their
own when the engine uses the default group, so checking never waits on the device's stream.
"""
from __future__ import annotations

import datetime
import enum
import itertools
import logging
import time
import zlib
from typing import Dict, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

FIELDS = 8
_MAGIC = 0x0FF10AD0
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "barrier", "all_gather_object")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.uint8, torch.int8)
_TIMED_OUT = "Operation timed out"  # what gloo's Work.wait(timeout) raises when time is up
TAGS = ("inf/nan flags", "grad norm", "used flags", "checkpoint errors", "checkpoint id",
        "checkpoint flags", "barrier")
"""What the collectives that move no flat parameter carry as their ``what``."""
_engines = itertools.count()  # engines built in this process; every rank builds them in order


class Phase(enum.Enum):
    """What the engine is doing when it issues a collective (a fingerprint field)."""

    IDLE = 0
    """Between calls (construction, or a collective outside any named phase)."""
    FORWARD = 1
    """A forward with autograd recording."""
    FORWARD_NO_GRAD = 2
    """A forward under ``torch.no_grad()`` / ``inference_mode()`` (evaluation, generation)."""
    BACKWARD = 3
    """Backward: gathers for recomputation, gradient reductions, updates in backward."""
    STEP = 4
    """:meth:`OffloadEngine.step`: the gradient norm, inf/nan flags, the gather of new
    parameters at stages 1 and 2."""
    CHECKPOINT = 5
    """Saving or loading a checkpoint."""
    EXPORT = 6
    """Gathering full parameters for export (``full_state_dict``)."""


class CollectiveMismatch(RuntimeError):
    """The ranks were about to run different collectives (see [Note: lockstep]). Raised on
    every rank at once; the message names the collective each rank was at."""


class PeerFailure(RuntimeError):
    """Another rank failed (an exception in an engine call, or its process died) while this
    rank waited for it in a collective. The message names that rank and its error where it
    recorded one."""


def mark_agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised on every rank together after the ranks agreed on it (a
    checkpoint that fails to load, say): it is no failure of one rank, so no record is
    written for it, and the ranks may go on using the engine. Returns ``exc``."""
    exc._offload_zero_agreed = True
    return exc


def _code(value, table) -> int:
    return table.index(value) if value in table else len(table)


def name_hash(name: str) -> int:
    """CRC-32 of ``name`` (UTF-8): the ``what`` field of a fingerprint."""
    return zlib.crc32(name.encode())


class Lockstep:
    """Fingerprint checks and the failure side channel of one data-parallel group.

    Args:
        group: the ``torch.distributed`` group the engine's collectives use (None: default).
        rank, world_size: this rank in ``group`` and the group's size (> 1).
        device: the engine's device (fingerprints are on the CPU; on CUDA they need a gloo
            group, made here when ``group`` is the default one).
        check: exchange fingerprints before each collective (else only wait in slices).
        poll_s: seconds between looks at the store for a failure record while waiting.
        timeout_s: seconds a collective may wait in all before this rank raises
            :class:`PeerFailure` saying nobody answered.

    Raises:
        ValueError: ``poll_s`` or ``timeout_s`` not > 0.
    """

    def __init__(self, group, rank: int, world_size: int, device: torch.device,
                 check: bool = True, poll_s: float = 1.0, timeout_s: float = 300.0):
        if not poll_s > 0 or not timeout_s > 0:
            raise ValueError(f"poll_s and timeout_s must be > 0, got {poll_s}, {timeout_s}")
        self.group, self.rank, self.world_size = group, rank, world_size
        self.check, self.poll_s, self.timeout_s = check, poll_s, timeout_s
        self.phase = Phase.IDLE
        self.step = 0
        self.seq = 0
        self.names: Dict[int, str] = {name_hash(t): t for t in TAGS}
        self._store = _store_of(group, f"offload_zero/{next(_engines)}/")
        self._fingerprint_group = group
        if check and device.type == "cuda":
            if group is None:
                self._fingerprint_group = dist.new_group(backend="gloo")
            else:  # (a new group needs every rank of the world: use the engine's, on the device)
                self._fingerprint_group = None
        self._fp_device = torch.device("cpu") if self._fingerprint_group is not None else device
        if self._fingerprint_group is None:
            self._fingerprint_group = group
        self.seconds_checking = 0.0
        self.checks = 0

    def register_names(self, labels: Dict[str, str]) -> None:
        """``{name: label}``: names (of flat parameters) that fingerprints may carry, and how
        error messages show them (the modules they hold, say)."""
        for n, label in labels.items():
            self.names[name_hash(n)] = label

    def end_step(self) -> None:
        """A step ended on this rank: collective indices start again at 0."""
        self.step += 1
        self.seq = 0

    # -- before each collective ------------------------------------------------------------
    def before(self, kind: str, numel: int, dtype: torch.dtype, what: str) -> None:
        """Check, with every rank, that all are about to run the same collective; wait for the
        others (looking for failure records). Raises CollectiveMismatch or PeerFailure."""
        self.seq += 1
        if not self.check:
            return
        t0 = time.perf_counter()
        mine = torch.tensor([_MAGIC, self.step, self.seq, _code(kind, _KINDS), numel,
                             _code(dtype, _DTYPES), self.phase.value, name_hash(what)],
                            dtype=torch.int64, device=self._fp_device)
        everyone = torch.empty(self.world_size * FIELDS, dtype=torch.int64, device=self._fp_device)
        work = _all_gather_async(everyone, mine, self._fingerprint_group)
        self.wait(work, kind, what)
        rows = everyone.view(self.world_size, FIELDS).cpu()
        self.seconds_checking += time.perf_counter() - t0
        self.checks += 1
        if not bool((rows == rows[0]).all()):
            raise CollectiveMismatch(self._describe(rows, kind, what))

    def _describe(self, rows: torch.Tensor, kind: str, what: str) -> str:
        lines = [f"[rank {self.rank}] the ranks disagree about the next collective, so their "
                 "results would be wrong; each rank was at:"]
        for r, row in enumerate(rows.tolist()):
            _, step, seq, k, numel, dt, phase, h = row
            kname = _KINDS[k] if k < len(_KINDS) else "?"
            dname = str(_DTYPES[dt]).replace("torch.", "") if dt < len(_DTYPES) else "?"
            pname = Phase(phase).name.lower().replace("_", " ") if phase in {
                p.value for p in Phase} else "?"
            lines.append(f"  rank {r}: step {step}, collective {seq}: {kname} of "
                         f"{self.names.get(h, hex(h))} ({numel} x {dname}) in {pname}")
        lines.append("Every rank must run the same units in the same order, with the same "
                     "number of forward calls (under no_grad too). For mixture-of-experts "
                     "layers whose routing differs per rank, make the layer one unit "
                     "(leaf_modules=[its class or name]); for generation whose length differs "
                     "per rank, call generate(..., synced_gpus=True) on every rank.")
        return "\n".join(lines)

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, work, kind: str, what: str) -> None:
        """Wait for ``work`` (an async collective) in slices of ``poll_s``, raising
        PeerFailure when another rank recorded a failure, died, or nothing came within
        ``timeout_s``."""
        start = time.monotonic()
        while True:
            try:
                work.wait(timeout=datetime.timedelta(seconds=self.poll_s))
                return
            except RuntimeError as exc:
                if _TIMED_OUT not in str(exc):
                    raise self.peer_failure(kind, what, exc) from exc
            record = self.failure_record()
            if record is not None:
                raise PeerFailure(f"[rank {self.rank}] stopped waiting at {kind} of {what!r}: "
                                  f"{record}")
            if time.monotonic() - start > self.timeout_s:
                raise PeerFailure(f"[rank {self.rank}] no answer from the other ranks for "
                                  f"{self.timeout_s:g} s at {kind} of {what!r} (timeout_s): a "
                                  "rank is hung or stopped calling the engine")

    def peer_failure(self, kind: str, what: str, exc: BaseException) -> PeerFailure:
        """The error to raise for ``exc``, raised by a collective itself (a peer's connection
        closed, say): the failure record where one exists."""
        record = self.failure_record()
        if record is None:
            record = (f"a rank left the group ({type(exc).__name__}: {exc}); its process "
                      "probably died (killed, out of memory)")
        return PeerFailure(f"[rank {self.rank}] stopped waiting at {kind} of {what!r}: {record}")

    # -- the failure side channel ------------------------------------------------------------
    def report_failure(self, exc: BaseException) -> None:
        """Record that this rank failed with ``exc``, so ranks waiting for it stop (best effort:
        a store that cannot be reached is logged, not raised)."""
        if (self._store is None or isinstance(exc, (PeerFailure, CollectiveMismatch))
                or getattr(exc, "_offload_zero_agreed", False)):
            return
        text = f"rank {self.rank} failed with {type(exc).__name__}: {exc}"
        try:
            self._store.set("failed", text[:4000])
        except Exception as store_exc:  # noqa: BLE001 - the original error matters more
            log.warning("[rank %d] could not record the failure in the store: %s",
                        self.rank, store_exc)

    def failure_record(self) -> Optional[str]:
        """The text another rank recorded with :meth:`report_failure`, or None."""
        if self._store is None:
            return None
        try:
            if not self._store.check(["failed"]):
                return None
            return self._store.get("failed").decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store's host is gone: gloo will say so
            return None


def _all_gather_async(out: torch.Tensor, inp: torch.Tensor, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _store_of(group, prefix: str):
    """The store behind ``group`` (the rendezvous store), under ``prefix``; None if there is
    none to be had."""
    try:
        from torch.distributed import distributed_c10d as c10d
        pg = group if group is not None else c10d._get_default_group()
        store = c10d._world.pg_map[pg][1]
        return dist.PrefixStore(prefix, store)
    except Exception as exc:  # noqa: BLE001 - no side channel: failures wait for gloo/timeouts
        log.info("no store for the failure side channel (%s): a failed rank that stays alive "
                 "keeps the others waiting until timeout_s", exc)
        return None
