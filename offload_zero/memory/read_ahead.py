"""The NVMe store's whole-state read-ahead ring: a flat parameter's whole optimizer state
(master | exp_avg | exp_avg_sq) read into one fixed host buffer while other units compute,
so that its update (in backward, or in the next forward) finds it in memory; and its
write-back, started at once or deferred until the last pending update so the disk serves
the reads first. The buffers belong to a :class:`offload_zero.memory.pool.HostBufferPool`
(``optimizer_prefetch``) that the engine sizes: two, three when gathers also take the
parameters from the reads or with updates in the next forward.

:class:`ReadAheadRing` is a part of :class:`offload_zero.memory.state_stores.NVMeStore`: it
uses the store's ``_numel``, ``_io``, ``in_host``, ``_host``, ``io_stages``, ``wait_writes``
and ``_writes_done``. Each flat parameter's I/O stage (read ahead, in its update, writing,
write-back deferred), with its buffer and handles, is recorded by the store's
:class:`offload_zero.update.state.IOStages` ([Note: update states]); the ring holds the bytes.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from offload_zero.update.state import StateIO


class ReadAheadRing:
    """Whole-state reads ahead and write-backs through a ring of host buffers (see the
    module docstring): a state read ahead is ``StateIO.READ_AHEAD`` (its buffer and read
    handles), a whole write-back ``WRITING`` (its buffer and write handles) or
    ``WRITE_DEFERRED`` (its buffer), in the store's ``io_stages``."""

    def _init_read_ahead(self) -> None:
        self._ahead_cap = 0  # elements of a state each read-ahead buffer holds
        self._ahead = None                            # a HostBufferPool, or None

    def enable_prefetch(self, pool, numel: Optional[int] = None) -> None:
        """Read whole states ahead into ``pool``, a
        :class:`offload_zero.memory.pool.HostBufferPool` of fp32 buffers that each hold the
        state of a shard of up to ``numel`` elements (master | exp_avg | exp_avg_sq: at least
        ``fmt.buffer_numel(numel)`` elements; default: ``pool.numel // 3``, fp32 moments),
        owned and closed by the caller. Two buffers suffice for updates in backward: unit k's state is
        read while unit k+1's is written; a third lets unit k-1's state be read while unit k
        runs (its parameters are then gathered from it, see :meth:`master_view`), or, for
        updates applied in the next forward, a block's read start before the write-back of
        the block two before it has ended. Raises ValueError if the buffers are too small."""
        numel = pool.numel // 3 if numel is None else numel
        if self.fmt.buffer_numel(numel) > pool.numel:
            raise ValueError(f"read-ahead buffers of {pool.numel} fp32 elements cannot hold a "
                             f"state of {numel} elements ({self.fmt.buffer_numel(numel)} needed)")
        self._ahead, self._ahead_cap = pool, numel

    def fits_ahead(self, numel: int) -> bool:
        """Whether a state of ``numel`` elements fits a read-ahead buffer (False without)."""
        return self._ahead is not None and numel <= self._ahead_cap

    def _whole_views(self, buf: torch.Tensor, n: int, padded: bool = False):
        return self.fmt.views(buf, self._ahead_cap, n, padded)

    def _start_whole_write(self, fp, buf: torch.Tensor) -> list:
        n = self._numel[fp]
        return self._io(fp, 0, n, 0, write=True, views=self._whole_views(buf, n, padded=True))

    def whole_writes(self) -> list:
        """The flat parameters whose whole write-back holds a read-ahead buffer (``WRITING``
        from its buffer, or ``WRITE_DEFERRED``), oldest first."""
        io = self.io_stages
        return [fp for fp in io.in_stage(StateIO.WRITING, StateIO.WRITE_DEFERRED)
                if io.buffer(fp) is not None]

    def _retire_whole_write(self, fp) -> None:
        """Wait for ``fp``'s whole write-back (started first if deferred) and return its
        buffer to the ring: ``fp`` is ``AT_REST`` again."""
        io = self.io_stages
        buf = io.buffer(fp)
        try:
            if io.stage(fp) is StateIO.WRITE_DEFERRED:
                io.move(fp, StateIO.WRITING, handles=self._start_whole_write(fp, buf),
                        keep_place=True)
            for h in io.handles(fp):
                h.wait()
        finally:
            io.move(fp, StateIO.AT_REST)
            self._ahead.release(buf)

    def _finished_write(self, newest_first: bool):
        """The oldest (or newest) flat parameter whose whole write-back started and is done,
        or None."""
        io = self.io_stages
        writes = self.whole_writes()
        for fp in reversed(writes) if newest_first else writes:
            if io.stage(fp) is StateIO.WRITING and all(h.done() for h in io.handles(fp)):
                return fp
        return None

    def start_deferred_writes(self) -> None:
        """Start every whole write-back deferred by :meth:`iter_states`'s
        ``defer_write_back`` (``WRITE_DEFERRED`` to ``WRITING``, each keeping its place among
        the write-backs); their buffers return to the read-ahead ring as they finish (see
        :meth:`prefetch`)."""
        io = self.io_stages
        for fp in io.in_stage(StateIO.WRITE_DEFERRED):
            io.move(fp, StateIO.WRITING, handles=self._start_whole_write(fp, io.buffer(fp)),
                    keep_place=True)

    @property
    def deferred_writes(self) -> int:
        """How many whole write-backs are deferred (each holding a read-ahead buffer)."""
        return self.io_stages.count(StateIO.WRITE_DEFERRED)

    def prefetch(self, fp, wait: bool = True, newest_first: bool = False) -> bool:
        """Start reading ``fp``'s whole state (master, moments) into a read-ahead buffer
        (``AT_REST`` to ``READ_AHEAD``); the
        next :meth:`iter_states` that reaches ``fp`` yields it from there. When every buffer is
        taken, the oldest write-back is retired to free one (with ``wait=False`` the oldest
        that has finished, if one has: no wait for the disk; the newest with
        ``newest_first``, for a read started in backward: the newest write-back is then of
        the block backward gathered first, the others may still serve gathers, see
        :meth:`master_view`). A write of ``fp``'s own state still in flight or deferred is
        waited for first (``wait=False``: the read is not started unless it has finished), so
        the read sees it. Returns True if the read was started; False (and does nothing) without
        read-ahead buffers, for a state larger than they are, when it is already being read
        ahead, while an :meth:`iter_states` has handed out part or all of it and not yet
        queued its write-back (``IN_UPDATE``: a read now would be stale), or when no buffer is
        free."""
        pool = self._ahead
        if (pool is None or self.io_stages.stage(fp) in (StateIO.READ_AHEAD, StateIO.IN_UPDATE)
                or self.in_host(fp) or not self.fits_ahead(self._numel.get(fp, 0))):
            return False
        if not wait and not self._writes_done(fp):
            return False
        self.wait_writes(fp)
        if pool.in_use == pool.count and self.whole_writes():
            oldest = self.whole_writes()[0] if wait else self._finished_write(newest_first)
            if oldest is not None:
                self._retire_whole_write(oldest)
        if pool.in_use == pool.count:
            return False
        buf = pool.acquire()
        n = self._numel[fp]
        handles = self._io(fp, 0, n, 0, write=False, views=self._whole_views(buf, n, padded=True))
        self.io_stages.move(fp, StateIO.READ_AHEAD, buffer=buf, handles=handles)
        return True

    def prefetched(self, fp) -> bool:
        """Whether ``fp``'s whole state is being read ahead, or was read and awaits its
        update (``READ_AHEAD``, see :meth:`prefetch`), or is kept in host memory: whether its
        update can take it whole, without streaming it in chunks."""
        return self.io_stages.stage(fp) is StateIO.READ_AHEAD or self.in_host(fp)

    def _holds_whole_write(self, fp) -> bool:
        """Whether ``fp``'s whole write-back (started or deferred) holds a read-ahead buffer."""
        return (self.io_stages.stage(fp) in (StateIO.WRITING, StateIO.WRITE_DEFERRED)
                and self.io_stages.buffer(fp) is not None)

    def holds_master(self, fp) -> bool:
        """Whether :meth:`master_view` has ``fp``'s master in host memory: being read ahead,
        read and awaiting its update, updated and its write-back not yet retired (its
        buffer holds what is on its way to the file), or kept in host memory."""
        return self.prefetched(fp) or self._holds_whole_write(fp)

    def master_view(self, fp) -> Optional[torch.Tensor]:
        """``fp``'s master weights (the master's dtype), shape (shard_numel,), a view of its
        read-ahead buffer (waiting for that part of the read only) or of the buffer of its
        whole write-back not yet retired (the current values: a later read or update of
        ``fp`` retires it first), or None when neither holds it (see :meth:`holds_master`).
        The view is valid until the store's next call (copy it out). Raises SwapIOError if
        the read failed (file and offset named)."""
        if self.in_host(fp):
            return self._host.master_view(fp)
        n = self._numel.get(fp, 0)
        io = self.io_stages
        if io.stage(fp) is StateIO.READ_AHEAD:
            io.handles(fp)[0].wait()
            return self._whole_views(io.buffer(fp), n)[0]
        if self._holds_whole_write(fp):
            return self._whole_views(io.buffer(fp), n)[0]
        return None

    def release_prefetched(self) -> None:
        """Finish and forget read-ahead that no update used (a unit without a gradient):
        ``READ_AHEAD`` back to ``AT_REST``."""
        io = self.io_stages
        for fp in io.in_stage(StateIO.READ_AHEAD):
            buf, handles = io.buffer(fp), io.handles(fp)
            io.move(fp, StateIO.AT_REST)
            try:
                for h in handles:
                    h.wait()
            finally:
                self._ahead.release(buf)
