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
the parameter homes' buffers hold the bytes; this module holds where each update stands.
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

    def set_gather_follows(self, fps: Iterable) -> None:
        """The flat parameters whose gather follows their update now (those of the unit about
        to be gathered): their new NVMe shards stay in their buffers for it."""
        self._gather_follows = set(fps)

    def gather_follows(self, fp) -> bool:
        """Whether ``fp``'s gather follows its update (see :meth:`set_gather_follows`)."""
        return fp in self._gather_follows
