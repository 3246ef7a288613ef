"""Portable swap backend: a small thread pool running ``os.preadv`` / ``os.pwritev``.

Used when the ``libaio`` bindings are missing or the swap folder's filesystem refuses
O_DIRECT. The file descriptors it is given are O_DIRECT when the filesystem allows it, so the
page cache is bypassed either way when possible.

A backend sees only *requests* (see ``swapper._Request``): an fd, a file offset, a buffer address
and a length, all multiples of 4096 bytes. It calls ``request.finish(res)`` exactly once per
request, with ``res`` the number of bytes transferred or ``-errno``; it never raises to the
submitter for an I/O failure. ``os.pwritev`` / ``os.preadv`` are looked up on the ``os`` module
at call time, so a test may patch them to inject faults.
"""
from __future__ import annotations

import errno
import os
import threading

from offload_zero.memory.aio_queue import ReadsFirst

__all__ = ["ThreadsBackend"]


class ThreadsBackend:
    """Runs each request as one blocking ``preadv``/``pwritev`` on ``queue_depth`` worker threads
    that take requests from one queue (reads before writes: :class:`ReadsFirst`).

    ``submit`` adds all of its requests to the queue in one step (a Ctrl-C, raised in the main
    thread at any bytecode, cannot leave some of them never handed over).

    Args:
        queue_depth: number of worker threads, hence the most requests in flight at once (>= 1).
    """

    name = "threads"

    def __init__(self, queue_depth: int) -> None:
        self._work = threading.Condition(threading.Lock())
        self._queue = ReadsFirst()  # (reads before writes; see offload_zero.memory.aio_queue)
        self._closing = False
        self._workers = [threading.Thread(target=self._serve, name=f"oz-swap-io-{i}", daemon=True)
                         for i in range(queue_depth)]
        for worker in self._workers:
            worker.start()

    def submit(self, requests) -> None:
        """Queue ``requests``; returns at once. Each request later gets ``finish(res)``."""
        with self._work:
            if self._closing:
                cancelled = list(requests)
            else:
                cancelled = []
                self._work.notify_all()  # (before the queue grows: an interrupt between the
                self._queue.extend(requests)  # two leaves nothing half done)
        for request in cancelled:
            request.finish(-errno.ECANCELED)

    def _serve(self) -> None:
        while True:
            with self._work:
                while not self._queue and not self._closing:
                    self._work.wait()
                if not self._queue:
                    return  # closing, nothing left
                request = self._queue.take(1)[0]
                closing = self._closing
            if closing:
                request.finish(-errno.ECANCELED)
                continue
            self._run(request)

    @staticmethod
    def _run(request) -> None:
        try:
            buffers = [request.buffer()]
            if request.is_write:
                res = os.pwritev(request.fd, buffers, request.offset)
            else:
                res = os.preadv(request.fd, buffers, request.offset)
        except OSError as exc:
            res = -(exc.errno or errno.EIO)
        except BaseException:  # noqa: BLE001 - a request must always finish
            res = -errno.EIO
        request.finish(res)

    def close(self) -> None:
        """Cancel requests not yet started (they finish with ECANCELED), wait for running ones.
        Called on a worker thread (a finalizer run by a completion), it does not wait for that
        thread: a thread cannot join itself."""
        with self._work:
            self._closing = True
            self._work.notify_all()
        me = threading.current_thread()
        for worker in self._workers:
            if worker is not me:
                worker.join()
