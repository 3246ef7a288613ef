"""Fast swap backend: Linux native AIO (io_submit / io_getevents) through the ``libaio`` bindings.

[Note: libaio backend flow]
``submit`` appends requests to a pending queue (reads first: :class:`ReadsFirst`) under one lock and wakes the *reaper*, a daemon
thread that hands as many as fit (``queue_depth - in_flight``) to the kernel with a single
``io_submit`` and blocks in ``io_getevents`` (ctypes releases the GIL there, so the caller
keeps computing); it finishes each completed request and refills the kernel queue from the
pending queue. The caller never waits for a transfer, and never calls ``io_submit`` itself:
a Ctrl-C in the main thread cannot land between a submission and its bookkeeping.

Every result is checked: ``io_submit`` raising for a block (e.g. EBADF, EINVAL) finishes that
request with ``-errno``; a completion with a negative ``res`` is ``-errno``; a ``res`` other than
the requested length is a short transfer, judged by ``request.finish``.

The reaper alone destroys the AIO context, as it ends: ``close()`` may run on the reaper's own
thread (the garbage collector runs a swapper's finalizer wherever its last reference goes, and
finishing a request can drop it), where it cannot wait for the reaper to finish.
"""
from __future__ import annotations

import errno
import threading

import libaio

from offload_zero.memory.aio_queue import ReadsFirst

__all__ = ["LibaioBackend"]

_REAP_TIMEOUT_S = 0.5  # wake up now and then even if the kernel is slow, to notice shutdown


def _signed(res: int) -> int:
    """io_event.res is an unsigned long in the C struct; errors are -errno in two's complement."""
    return res - (1 << 64) if res >= (1 << 63) else res


class LibaioBackend:
    """Keeps up to ``queue_depth`` requests in flight in one kernel AIO context.

    Args:
        queue_depth: the most requests handed to the kernel at once (>= 1).

    Raises:
        OSError: the kernel refused to create the AIO context (io_setup), e.g. because
            ``/proc/sys/fs/aio-max-nr`` is exhausted or a sandbox forbids the syscall.
    """

    name = "libaio"

    def __init__(self, queue_depth: int) -> None:
        self._queue_depth = queue_depth
        self._ctx = libaio.AIOContext(queue_depth)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._pending = ReadsFirst()
        self._in_flight = 0
        self._blocks: set = set()  # AIOBlocks handed to the kernel and not yet reaped
        self._closing = False
        self._reaper = threading.Thread(target=self._reap_loop, name="oz-aio-reaper", daemon=True)
        self._reaper.start()

    # ---- submission -------------------------------------------------------------------------

    def submit(self, requests) -> None:
        """Queue ``requests`` for the reaper, which hands them to the kernel; returns at once.

        The caller's thread never calls ``io_submit``: a Ctrl-C (KeyboardInterrupt, raised in
        the main thread at any bytecode) landing between ``io_submit`` and the bookkeeping left
        requests in the kernel that the reaper did not know, and waits that never ended. Here
        the queue takes all of ``requests`` in one step or none."""
        with self._lock:
            if self._closing:
                cancelled = list(requests)
            else:
                cancelled = []
                self._work.notify()  # (before the queue grows: an interrupt between the two
                self._pending.extend(requests)  # leaves nothing half done)
        for request in cancelled:
            request.finish(-errno.ECANCELED)

    def _pump_locked(self) -> list:
        """Move pending requests into the kernel while there is room. Returns [(request, -errno)]
        for requests the kernel rejected at submission; the caller finishes them (lock released)."""
        failed = []
        while self._pending and self._in_flight < self._queue_depth:
            count = min(self._queue_depth - self._in_flight, len(self._pending))
            batch = self._pending.take(count)
            blocks = [self._make_block(r) for r in batch]
            try:
                submitted = self._ctx.submit(blocks)
            except OSError as exc:
                if exc.errno == errno.EAGAIN and self._in_flight > 0:
                    # Kernel queue momentarily full: retry after the next completion.
                    self._pending.put_back(batch)
                    break
                # io_submit fails as a whole only when its first block is bad.
                failed.append((batch[0], -(exc.errno or errno.EIO)))
                self._pending.put_back(batch[1:])
                continue
            self._in_flight += submitted
            self._blocks.update(blocks[:submitted])
            if submitted < len(batch):  # kernel took a prefix; the rest waits for a completion
                self._pending.put_back(batch[submitted:])
                break
        return failed

    @staticmethod
    def _make_block(request) -> "libaio.AIOBlock":
        mode = libaio.AIOBLOCK_MODE_WRITE if request.is_write else libaio.AIOBLOCK_MODE_READ
        block = libaio.AIOBlock(mode, request.fd, [request.buffer()], request.offset)
        block.oz_request = request  # the buffer travels with its completion
        return block

    # ---- completion -------------------------------------------------------------------------

    def _reap_loop(self) -> None:
        try:
            self._reap_until_closed()
        except BaseException:  # noqa: BLE001 - never leave a waiter hanging
            with self._lock:
                self._closing = True
                orphans = [b.oz_request for b in self._blocks] + self._pending.items()
                self._blocks.clear()
                self._in_flight = 0
                self._work.notify_all()
            for request in orphans:
                request.finish(-errno.EIO)
            raise
        finally:
            # the reaper alone destroys the context, once nothing of it is in flight: close()
            # may run on this very thread (a finalizer run by a completion) and cannot wait
            _release_context(self._ctx)

    def _reap_until_closed(self) -> None:
        while True:
            with self._lock:
                failed = [] if self._closing else self._pump_locked()
                while self._in_flight == 0 and not failed:
                    if self._closing:
                        return
                    self._work.wait()
                    failed = [] if self._closing else self._pump_locked()
            for request, res in failed:
                request.finish(res)
            if self._in_flight == 0:
                continue
            try:
                events = self._ctx.getEvents(min_nr=1, nr=self._queue_depth, timeout=_REAP_TIMEOUT_S)
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not events:
                continue
            with self._lock:
                self._in_flight -= len(events)
                self._blocks.difference_update(block for block, _, _ in events)
                failed = [] if self._closing else self._pump_locked()
                self._work.notify_all()
            for block, res, _res2 in events:
                block.oz_request.finish(_signed(res))
            for request, res in failed:
                request.finish(res)

    # ---- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel requests not yet handed to the kernel (they finish with ECANCELED), wait for
        the in-flight ones to complete, stop the reaper and destroy the AIO context. On the
        reaper's own thread it returns at once: the reaper finishes the in-flight requests and
        destroys the context as it ends."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            cancelled = self._pending.items()
            self._work.notify_all()
        for request in cancelled:
            request.finish(-errno.ECANCELED)
        if threading.current_thread() is not self._reaper:
            self._reaper.join()  # it releases the context as it ends


def _release_context(ctx) -> None:
    """Destroy ``ctx`` (a ``libaio.AIOContext``) exactly once.

    The library's own ``close()`` releases the kernel context and only then forgets it; a
    Ctrl-C landing between the two made its ``__del__`` release it again at exit (EINVAL,
    printed as an ignored exception). Here the handle is taken from the object first, so its
    ``close()``/``__del__`` find nothing to release, whatever interrupts us.
    """
    raw = ctx.__dict__.pop("_ctx", None) if "_ctx" in getattr(ctx, "__dict__", {}) else None
    release = getattr(ctx, "_io_queue_release", None)
    if raw is None or release is None:
        if raw is not None:
            ctx._ctx = raw
        ctx.close()
        return
    release(raw)
