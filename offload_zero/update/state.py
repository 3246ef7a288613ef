"""Each trainable flat parameter's update state, with one owner (:class:`UpdateStates`).

[Note: update states]
One flat parameter's update between two steps, in each timing (``update_timing``; see
:mod:`offload_zero.update.rules`):

```
                 step() decides (next_forward)          applied before the next gather
          +------------------------------------> PENDING ------------------------------+
          |                                         | the root's part after the blocks |
          |                                         v (LM head: streamed in forward)   |
        IDLE ----- gradient final in backward ---> STREAMING ---- last chunk --------->+
          ^        (backward; state too large           |  (backward: -> APPLIED)      |
          |         for the read-ahead ring)            |                              |
          |                                             v                              v
          |    gradient final, updated at once    APPLIED | OVERFLOWED | UNUSED      IDLE
          +---- (backward) -----------------------> (until the step ends) --- step() -+
```

- ``IDLE``: no update under way; a gradient, if any, accumulates. The plain step (``"step"``)
  updates every flat parameter from here and back to here inside :meth:`OffloadEngine.step`.
- ``PENDING`` (``"next_forward"``): ``step()`` fixed the update (gradient factor, inf/nan
  verdict, hyperparameters); it is applied just before the unit's parameters are next read.
  Pending updates keep the order the next forward needs them in (:meth:`UpdateStates.pending`).
- ``STREAMING``: the update runs chunk by chunk from the hooks that follow (its generator is
  queued in :attr:`UpdateStates.streams`, oldest first), so its NVMe reads and writes overlap
  compute: in backward, a state larger than the read-ahead ring; in the next forward, the
  root's part used after the blocks (the LM head), gathered only when its module runs. A
  stream started from ``PENDING`` is still pending until its last chunk.
- ``APPLIED`` / ``OVERFLOWED`` / ``UNUSED`` (``"backward"``): updated in this backward;
  skipped for an inf/nan gradient on some rank (the step then counts as skipped); used by no
  rank's backward (nothing to update). ``step()`` ends them all back to ``IDLE``.

A stream cut short by an error leaves its flat parameter ``OVERFLOWED`` (in backward: the
step counts as skipped, as an overflow would) or ``PENDING`` (in the next forward: its update
is applied again from its unchanged state). Below the engine the NVMe store's read-ahead
buffers (a whole state read ahead, a write-back deferred until the last pending update) and
the parameter homes' buffers hold the bytes; this module holds where each update stands, and
where each flat parameter's bytes stand between their file and an update (its I/O stages,
below), with the buffer and completion handles of each.

The I/O stages, one table per kind (:data:`STATE_IO_LEGAL`, :data:`SHARD_IO_LEGAL`), each
move checked against it: the NVMe store, its read-ahead ring and the NVMe parameter home ask
one :class:`IOStages` each (``UpdateStates.state_io``, ``.shard_io``) where a flat
parameter's bytes are, with the buffer and completion handles that hold them, instead of
keeping dicts of their own.

```
 optimizer state on NVMe (StateIO: NVMeStore, ReadAheadRing)

           prefetch (whole, into a ring buffer)          iter_states takes it whole
 AT_REST ------------------------------------> READ_AHEAD ------------------------+
  | ^ ^ ^                                          |                              v
  | | | +-- release_prefetched (no update used it) -+                         IN_UPDATE
  | | |                                                                        | | |
  +-|-|-- iter_states streams it in chunks (the pipeline's buffer sets) ------>+ | |
    | |                                                                          | |
    | +-- cut short by an error, no write of it in flight (buffer released) <----+ |
    |                                                                              |
    +-- retired <-- WRITING <-- write-back started (whole; chunks: the last one) --+
                      ^                                                            |
                      +-- start_deferred_writes, or needed -- WRITE_DEFERRED <-----+
                                                              (defer_write_back)

 parameter shard on NVMe (ShardIO: NVMeParamHome)

 AT_REST --fetch--> READING --done_with (gathered, or stale)--> AT_REST
 AT_REST --update_target--> IN_UPDATE --commit--> WRITING --retired--> AT_REST
                             | | |                   +--retired, keep_after_update---+
                             | | +--commit, its gather follows (write in flight)---+ |
                             | +--commit (its bytes are the master's), kept------+ | |
                             |                                                   v v v
                             +--discard (overflow)--> AT_REST     KEPT --done_with--> AT_REST
                                                      (its write still in flight: WRITING)
```

- ``StateIO.READ_AHEAD``: the whole state is being read into a read-ahead buffer, or was read
  and awaits its update; :meth:`NVMeStore.master_view` serves a gather from it.
- ``StateIO.IN_UPDATE``: an ``iter_states`` handed out part or all of the state and has not
  queued its write-back: the file is stale, so no read of it starts. A stream starts only
  from ``AT_REST``: the state's own earlier writes are waited for first.
- ``StateIO.WRITING``: the write-back is in flight, whole from its read-ahead buffer (which
  serves gathers until it is retired) or as the pipeline's chunk writes (the buffer sets hold
  them; ``AT_REST`` once the last is waited for); a read of the state waits for it first.
- ``StateIO.WRITE_DEFERRED``: ``"next_forward"`` holds the write-back, and its buffer, until
  the forward's last pending update, so the disk serves the reads first.
- ``ShardIO.READING`` / ``KEPT``: a pool buffer holds the shard for the next gather, read from
  the file, or kept from the update; ``IN_UPDATE``: the update writes the new shard into a
  pool buffer; ``WRITING``: that buffer's write to the file is in flight, and no gather waits
  for it (a full pool retires the oldest such write: a shard whose gather follows its update
  is ``KEPT`` from its commit, so how fast the disk writes never sends that gather to the
  file).

State kept in host memory (``keep_in_host``), the resident stores and the host parameter home
have no I/O: always at rest. After a step of ``"step"`` or ``"backward"`` every optimizer
state and shard is at rest (the step waits for every write), but for the root's shards kept
in buffers of their own for the next forward (``KEPT``). After a ``"next_forward"`` step
pending updates' states may be ``READ_AHEAD`` and write-backs ``WRITING`` (nothing waits for
them until a buffer or the bytes are needed); none is ``IN_UPDATE`` or ``WRITE_DEFERRED``
between steps. ``memory_report()["io_stages"]`` shows every flat parameter not at rest.
"""
from __future__ import annotations

import enum
from typing import Dict, Iterable, List, Optional


class UpdateState(enum.Enum):
    """Where a flat parameter's update stands (see [Note: update states])."""

    IDLE = "idle"
    """No update under way; its gradient (if any) accumulates."""
    PENDING = "pending"
    """``next_forward``: decided by ``step()``, applied before the unit's next read."""
    STREAMING = "streaming"
    """Running chunk by chunk from later hooks (queued in :attr:`UpdateStates.streams`)."""
    APPLIED = "applied"
    """``backward``: updated in this backward; the step has not ended."""
    OVERFLOWED = "overflowed"
    """``backward``: skipped in this backward (an inf/nan gradient on some rank)."""
    UNUSED = "unused"
    """``backward``: no rank's backward used it; nothing to update."""


S = UpdateState
_DONE_IN_BACKWARD = (S.APPLIED, S.OVERFLOWED, S.UNUSED)
LEGAL = {
    S.IDLE: {S.PENDING, S.STREAMING, *_DONE_IN_BACKWARD},
    S.PENDING: {S.STREAMING, S.IDLE},
    S.STREAMING: {S.APPLIED, S.OVERFLOWED, S.IDLE, S.PENDING},
    S.APPLIED: {S.IDLE},
    S.OVERFLOWED: {S.IDLE},
    S.UNUSED: {S.IDLE},
}
"""The legal transitions: ``LEGAL[a]`` holds every state ``a`` may move to."""


class UpdateStates:
    """The one owner of every trainable flat parameter's :class:`UpdateState` (see [Note:
    update states]), of the queue of streaming updates, of the compute-dtype targets updates
    write into, and of the flat parameters whose gather follows their update.

    Args:
        rank: this rank, for error messages.

    Attributes:
        streams: the streaming updates, oldest first, as ``[flat param, generator of chunks,
            f() run once it ends]``.
        grads_pending: whether a backward since the last step left gradients in the engine.
        closed: set once the engine is closed.
        state_io: the optimizer state's I/O stages (:class:`StateIO`), given to the NVMe store.
        shard_io: the parameter shards' I/O stages (:class:`ShardIO`), given to the NVMe
            parameter home.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self._state: Dict[object, UpdateState] = {}
        self._pending: Dict[object, None] = {}  # decided, not yet applied, in the order needed
        self._targets: Dict[object, object] = {}
        self._gather_follows: set = set()
        self.streams: List[list] = []
        self.grads_pending = False
        self.closed = False
        self.state_io = IOStages(rank, "optimizer state", STATE_IO_LEGAL)
        self.shard_io = IOStages(rank, "parameter shard", SHARD_IO_LEGAL)

    # -- states --------------------------------------------------------------------------
    def state(self, fp) -> UpdateState:
        """``fp``'s state (``IDLE`` if never moved)."""
        return self._state.get(fp, S.IDLE)

    def move(self, fp, to: UpdateState) -> None:
        """Move ``fp`` to ``to``; raises RuntimeError naming the rank, the flat parameter and
        both states if :data:`LEGAL` does not allow it (a broken invariant of the engine)."""
        now = self.state(fp)
        if to not in LEGAL[now]:
            raise RuntimeError(f"[rank {self.rank}] internal error: the update of "
                               f"{getattr(fp, 'name', fp)!r} cannot go from {now.name} to "
                               f"{to.name} (legal: {sorted(s.name for s in LEGAL[now])})")
        if to is S.PENDING:
            self._pending[fp] = None
        elif to is not S.STREAMING:
            self._pending.pop(fp, None)
        if to is S.IDLE:
            self._state.pop(fp, None)
        else:
            self._state[fp] = to

    def decide(self, fps: Iterable) -> None:
        """``step()`` decided the updates of ``fps`` (``next_forward``): each goes ``PENDING``,
        in the given order (the order the next forward needs them)."""
        for fp in fps:
            self.move(fp, S.PENDING)

    def pending(self) -> list:
        """The updates decided and not yet applied (``PENDING``, or ``STREAMING`` from
        there), in the order the next forward needs them."""
        return list(self._pending)

    def is_pending(self, fp) -> bool:
        """Whether ``fp``'s decided update is not applied yet (see :meth:`pending`)."""
        return fp in self._pending

    def done_in_backward(self, fp) -> bool:
        """Whether ``fp`` was handled in this backward (``APPLIED``, ``OVERFLOWED``,
        ``UNUSED``, or a stream begun there): the step does not update it again."""
        st = self.state(fp)
        return st in _DONE_IN_BACKWARD or (st is S.STREAMING and fp not in self._pending)

    def any_overflowed(self) -> bool:
        """Whether some flat parameter was skipped in this backward, or its stream has not
        ended (``OVERFLOWED``, or ``STREAMING`` not from ``PENDING``)."""
        return any(st is S.OVERFLOWED or (st is S.STREAMING and fp not in self._pending)
                   for fp, st in self._state.items())

    def end_backward_updates(self) -> None:
        """The step ended: every update made in backward goes back to ``IDLE``; a stream of
        backward cut short by an error too (its I/O was ended by then)."""
        for fp, st in list(self._state.items()):
            if st in _DONE_IN_BACKWARD:
                self.move(fp, S.IDLE)
            elif st is S.STREAMING and fp not in self._pending:
                self.move(fp, S.OVERFLOWED)
                self.move(fp, S.IDLE)

    def report(self) -> Dict[str, str]:
        """``{flat parameter name: state}`` of every flat parameter not ``IDLE``, pending
        ones first in the order they are needed."""
        out = {fp.name: self.state(fp).value for fp in self._pending}
        out.update((fp.name, st.value) for fp, st in self._state.items())
        return out

    def io_report(self) -> Dict[str, Dict[str, str]]:
        """``{flat parameter name: {"optimizer_state": StateIO value, "parameter_shard":
        ShardIO value}}`` of every flat parameter whose bytes are not at rest in one of them
        (see :class:`IOStages`); empty when nothing is read ahead, updated or written."""
        kinds = (("optimizer_state", self.state_io), ("parameter_shard", self.shard_io))
        reports = [(key, io.report(), io.at_rest.value) for key, io in kinds]
        names = dict.fromkeys(name for _, rep, _ in reports for name in rep)
        return {name: {key: rep.get(name, rest) for key, rep, rest in reports}
                for name in names}

    # -- streams -------------------------------------------------------------------------
    def stream(self, fp, gen, done) -> None:
        """Queue ``fp``'s update as a stream (``STREAMING``): ``gen`` yields after each
        chunk, ``done()`` runs once it ends."""
        self.move(fp, S.STREAMING)
        self.streams.append([fp, gen, done])

    def streaming(self, fp) -> bool:
        """Whether ``fp``'s update is queued or running as a stream and has not ended."""
        return any(entry[0] is fp for entry in self.streams)

    def stream_failed(self, fp) -> None:
        """``fp``'s stream raised: back to ``PENDING`` (``next_forward``: applied again later)
        or ``OVERFLOWED`` (``backward``: the step counts as skipped)."""
        self.move(fp, S.PENDING if fp in self._pending else S.OVERFLOWED)

    # -- the update's target and the gather that follows it ---------------------------------
    def set_target(self, fp, target) -> None:
        """Where ``fp``'s running update writes its new compute-dtype shard."""
        self._targets[fp] = target

    def target(self, fp):
        """The target :meth:`set_target` gave (None if none or the shard is the master)."""
        return self._targets.get(fp)

    def drop_target(self, fp) -> Optional[object]:
        """Forget ``fp``'s target (its update ended or failed); returns it."""
        return self._targets.pop(fp, None)

    def follow_with_gather(self, fps: Iterable) -> None:
        """``fps``' updates, about to be made (or streamed) for their unit's gather in a
        forward (``"next_forward"``), are followed by that gather: their new NVMe shards stay
        in the buffers the updates write for it (see :meth:`forget_gather_follows`)."""
        self._gather_follows.update(fps)

    def forget_gather_follows(self, fps: Optional[Iterable] = None) -> None:
        """No gather follows an update of ``fps`` (default: of any flat parameter) any more:
        their unit is gathered again with no update of theirs before it (a backward's gather:
        its shard is read from its file), or updates are made with no gather after them."""
        if fps is None:
            self._gather_follows.clear()
        else:
            self._gather_follows.difference_update(fps)

    def gather_follows(self, fp) -> bool:
        """Whether ``fp``'s next gather follows its update (see :meth:`follow_with_gather`)."""
        return fp in self._gather_follows


# -- I/O stages ------------------------------------------------------------------------------
class StateIO(enum.Enum):
    """Where a flat parameter's optimizer state on NVMe stands between its file and an update
    (see [Note: update states])."""

    AT_REST = "at_rest"
    """In its file, nothing of it in a buffer of the store (or kept in host memory)."""
    READ_AHEAD = "read_ahead"
    """Read whole into a read-ahead buffer (reads in flight or done), awaiting its update."""
    IN_UPDATE = "in_update"
    """Handed out by ``iter_states``, write-back not yet queued: its file is stale."""
    WRITING = "writing"
    """Its write-back is in flight: whole from its buffer, or the pipeline's chunk writes."""
    WRITE_DEFERRED = "write_deferred"
    """Updated from its buffer; the write-back waits for the forward's last pending update."""


class ShardIO(enum.Enum):
    """Where a flat parameter's parameter shard on NVMe stands between its file and a gather
    or an update (see [Note: update states])."""

    AT_REST = "at_rest"
    """In its file (or its master's bytes), no pool buffer holds it."""
    READING = "reading"
    """Being read (or read) into a pool buffer for its next gather."""
    KEPT = "kept"
    """Its new shard stays in the pool buffer the update wrote, as the next gather's read (the
    buffer's write to the file may still be in flight: the gather only reads it, and the
    buffer goes back to the pool once that write is done)."""
    IN_UPDATE = "in_update"
    """The update writes the new shard into a pool buffer."""
    WRITING = "writing"
    """That buffer's write to the file is in flight."""


_IO = StateIO
STATE_IO_LEGAL = {
    _IO.AT_REST: {_IO.READ_AHEAD, _IO.IN_UPDATE},
    # taken by its update; dropped unused (a unit without a gradient)
    _IO.READ_AHEAD: {_IO.IN_UPDATE, _IO.AT_REST},
    # written back (whole or chunks), deferred, or cut short (nothing written, or chunks
    # already retired)
    _IO.IN_UPDATE: {_IO.WRITING, _IO.WRITE_DEFERRED, _IO.AT_REST},
    _IO.WRITING: {_IO.AT_REST},
    # started; or its start failed (the error is raised, the buffer released)
    _IO.WRITE_DEFERRED: {_IO.WRITING, _IO.AT_REST},
}
"""The optimizer state's legal I/O moves: ``STATE_IO_LEGAL[a]`` holds every stage ``a`` may
move to (the first key is the stage at rest)."""

_SH = ShardIO
SHARD_IO_LEGAL = {
    _SH.AT_REST: {_SH.READING, _SH.IN_UPDATE},
    _SH.READING: {_SH.AT_REST},
    # gathered: its buffer back to the pool, or (its write still in flight) writing again
    _SH.KEPT: {_SH.AT_REST, _SH.WRITING},
    # written; kept (its bytes are the master's, written by the store); discarded (overflow)
    _SH.IN_UPDATE: {_SH.WRITING, _SH.KEPT, _SH.AT_REST},
    # retired: its buffer back to the pool, or kept as the next gather's read
    _SH.WRITING: {_SH.AT_REST, _SH.KEPT},
}
"""The parameter shard's legal I/O moves (the first key is the stage at rest)."""


class IORecord:
    """One flat parameter's I/O stage, with the buffer that holds its bytes (None when none of
    its own does) and the completion handles of the transfers in flight from or into it (a
    list of :class:`offload_zero.memory.swapper.SwapHandle`, or None)."""

    __slots__ = ("stage", "buffer", "handles")

    def __init__(self, stage, buffer, handles):
        self.stage, self.buffer, self.handles = stage, buffer, handles


class IOStages:
    """The one owner of one kind of I/O stage (:class:`StateIO` or :class:`ShardIO`) of every
    flat parameter, with its buffer and handles (see [Note: update states]): the NVMe store and
    the NVMe parameter home ask it where each flat parameter's bytes are.

    Args:
        rank: this rank, for error messages (None for a store built on its own).
        what: the kind, for error messages (``"optimizer state"``, ``"parameter shard"``).
        legal: the table of legal moves (:data:`STATE_IO_LEGAL`, :data:`SHARD_IO_LEGAL`);
            its first key is the stage at rest.
    """

    def __init__(self, rank: Optional[int], what: str, legal: Dict):
        self.rank, self.what, self._legal = rank, what, legal
        self.at_rest = next(iter(legal))
        # every flat parameter not at rest, in the order it entered its stage
        self._records: Dict[object, IORecord] = {}

    def stage(self, fp):
        """``fp``'s stage (at rest if never moved)."""
        rec = self._records.get(fp)
        return self.at_rest if rec is None else rec.stage

    def buffer(self, fp):
        """The buffer that holds ``fp``'s bytes in its stage (None at rest, or none of its own)."""
        rec = self._records.get(fp)
        return None if rec is None else rec.buffer

    def handles(self, fp):
        """The completion handles of ``fp``'s transfers in its stage (None if none)."""
        rec = self._records.get(fp)
        return None if rec is None else rec.handles

    def move(self, fp, to, buffer=None, handles=None, keep_place: bool = False) -> None:
        """Move ``fp`` to stage ``to`` with ``handles`` (None: none), holding ``buffer``
        (None: the buffer it holds now, if any); at rest it holds nothing. It goes last in the
        order of :meth:`in_stage` unless ``keep_place`` (a deferred write-back started keeps
        its place among the write-backs). Raises RuntimeError naming the rank, the flat
        parameter and both stages if the table of legal moves does not allow it (a broken
        invariant of the engine)."""
        now = self.stage(fp)
        if to not in self._legal[now]:
            where = "" if self.rank is None else f"[rank {self.rank}] "
            raise RuntimeError(f"{where}internal error: the {self.what} I/O of "
                               f"{getattr(fp, 'name', fp)!r} cannot go from {now.name} to "
                               f"{to.name} (legal: {sorted(s.name for s in self._legal[now])})")
        rec = self._records.pop(fp, None) if not keep_place else self._records.get(fp)
        if to is self.at_rest:
            self._records.pop(fp, None)
            return
        buffer = buffer if buffer is not None or rec is None else rec.buffer
        if keep_place and rec is not None:
            rec.stage, rec.buffer, rec.handles = to, buffer, handles
        else:
            self._records[fp] = IORecord(to, buffer, handles)

    def in_stage(self, *stages) -> list:
        """The flat parameters in any of ``stages``, in the order they entered them."""
        return [fp for fp, rec in self._records.items() if rec.stage in stages]

    def count(self, stage) -> int:
        """How many flat parameters are in ``stage`` (not at rest)."""
        return sum(1 for rec in self._records.values() if rec.stage is stage)

    def report(self) -> Dict[str, str]:
        """``{flat parameter name: stage}`` of every flat parameter not at rest, in the order
        of :meth:`in_stage`."""
        return {getattr(fp, "name", str(fp)): rec.stage.value
                for fp, rec in self._records.items()}
