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
from concurrent.futures import ThreadPoolExecutor

__all__ = ["ThreadsBackend"]


class ThreadsBackend:
    """Runs each request as one blocking ``preadv``/``pwritev`` on a pool of worker threads.

    Args:
        queue_depth: number of worker threads, hence the most requests in flight at once (>= 1).
    """

    name = "threads"

    def __init__(self, queue_depth: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="oz-swap-io")
        self._closing = threading.Event()

    def submit(self, requests) -> None:
        """Queue ``requests``; returns at once. Each request later gets ``finish(res)``."""
        for request in requests:
            if self._closing.is_set():
                request.finish(-errno.ECANCELED)
                continue
            self._pool.submit(self._run, request)

    def _run(self, request) -> None:
        if self._closing.is_set():
            request.finish(-errno.ECANCELED)
            return
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
        """Cancel requests not yet started (they finish with ECANCELED), wait for running ones."""
        self._closing.set()
        self._pool.shutdown(wait=True)
