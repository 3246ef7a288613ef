"""The NVMe tier: asynchronous O_DIRECT swapping of aligned host buffers to files.

Glossary: a *key* names one swap file ``<folder>/<key>.swp``; ``swap_out`` writes a host tensor's
bytes into it, ``swap_in`` reads them back. A transfer is cut into *requests* of at most
``block_size`` bytes; a *handle* completes when all of its requests have. A *backend* moves the
requests (``libaio``: kernel AIO, see [Note: libaio backend flow] in ``aio_libaio.py``;
``threads``: a thread pool doing ``preadv``/``pwritev``).

O_DIRECT rules, enforced at the boundary: the tensor's address, its size in bytes and the file
offset are all multiples of ``ALIGNMENT`` (4096 bytes). Use ``aligned_empty`` for buffers.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import signal
import statistics
import threading
import time
import uuid
import warnings
import weakref
from typing import Optional

import torch

from offload_zero.memory.aligned import ALIGNMENT, aligned_empty
from offload_zero.memory.aio_threads import ThreadsBackend
from offload_zero.memory.owner import claim_folder, release_folder
from offload_zero.tables import AIO_BACKENDS

__all__ = ["Swapper", "SwapHandle", "SwapIOError", "measure_bandwidth", "BACKENDS"]

BACKENDS = AIO_BACKENDS
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_FAST_PATH_HINT = (
    "for the fast path install the libaio bindings (`pip install libaio`, which needs the system "
    "library, e.g. `apt-get install libaio1`) and put the swap folder on a local filesystem "
    "that supports O_DIRECT (ext4 or xfs on the NVMe drive)"
)


class SwapIOError(OSError):
    """A swap transfer failed: an errno from the kernel, or a short read/write.

    Attributes: ``errno``, ``strerror`` (the full message), ``path`` (the swap file),
    ``offset`` (bytes into the file where the failed request started), ``nbytes`` (its length).
    """

    def __init__(self, err: int, message: str, path: str = "", offset: int = -1, nbytes: int = 0):
        super().__init__(err, message)
        self.path = path
        self.offset = offset
        self.nbytes = nbytes

    def __str__(self) -> str:
        return self.strerror


class SwapHandle:
    """Completion handle of one ``swap_in`` / ``swap_out``. Keeps the tensor alive until done.

    ``done()`` polls; ``wait()`` blocks and raises ``SwapIOError`` if any request failed. The
    seconds a ``wait()`` blocks on an unfinished transfer are added to ``counters`` (the
    swapper's :attr:`Swapper.wait_s`), when given.
    """

    def __init__(self, key: str, op: str, tensor: Optional[torch.Tensor], num_requests: int,
                 on_error=None, counters: Optional["_Counters"] = None) -> None:
        self.key = key
        self._counters = counters
        self.op = op
        self._tensor = tensor  # the buffer travels with its completion handle
        self._remaining = num_requests
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._errors: list = []
        self._on_error = on_error
        self.observed = False
        if num_requests == 0:
            self._finish_handle()

    def _request_done(self, error: Optional[SwapIOError]) -> None:
        with self._lock:
            if error is not None:
                self._errors.append(error)
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish_handle()

    def _finish_handle(self) -> None:
        self._tensor = None
        if self._errors and self._on_error is not None:
            self._on_error(self)
        self._done.set()

    def done(self) -> bool:
        """True once every request of this transfer has completed (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Block until the transfer completed.

        Args:
            timeout_s: seconds; None waits forever.
        Raises:
            SwapIOError: a request failed (the first failure, by completion order; its message
                names the file, the offset and the errno or the short count).
            TimeoutError: ``timeout_s`` elapsed first.
        """
        if not _timed_wait(self._done, timeout_s, self._counters):
            raise TimeoutError(f"swap {self.op} of key {self.key!r} not done after {timeout_s} s")
        self.observed = True
        if self._errors:
            first = self._errors[0]
            if len(self._errors) > 1:
                first.strerror += f" (and {len(self._errors) - 1} more failed requests)"
                self._errors = self._errors[:1]
            raise first

    def error(self) -> Optional[SwapIOError]:
        """The first failure of a completed transfer, or None."""
        return self._errors[0] if self._done.is_set() and self._errors else None


class _Request:
    """One contiguous O_DIRECT transfer: ``nbytes`` at file ``offset`` <-> memory at ``addr``."""

    __slots__ = ("handle", "path", "fd", "offset", "addr", "nbytes", "is_write", "counters",
                 "urgent")

    def __init__(self, handle, path, fd, offset, addr, nbytes, is_write, counters,
                 urgent=False):
        self.handle, self.path, self.fd, self.offset = handle, path, fd, offset
        self.addr, self.nbytes, self.is_write, self.counters = addr, nbytes, is_write, counters
        self.urgent = urgent  # (a read a computation will soon wait for: queued first)

    def buffer(self):
        """A writable ctypes view of the request's memory (no copy)."""
        return (ctypes.c_char * self.nbytes).from_address(self.addr)

    def finish(self, res: int) -> None:
        """Called once by the backend: ``res`` = bytes transferred, or ``-errno``."""
        op = "write" if self.is_write else "read"
        error = None
        if res < 0:
            err = -res
            error = SwapIOError(
                err, f"swap {op} of {self.nbytes} bytes at offset {self.offset} of {self.path} "
                f"failed: [Errno {err}] {os.strerror(err)}", self.path, self.offset, self.nbytes)
        elif res != self.nbytes:
            error = SwapIOError(
                errno.EIO, f"short swap {op} at offset {self.offset} of {self.path}: "
                f"{res} of {self.nbytes} bytes transferred", self.path, self.offset, self.nbytes)
        else:
            self.counters.add(self.is_write, res)
        self.handle._request_done(error)


def _timed_wait(done: threading.Event, timeout_s: Optional[float],
                counters: Optional["_Counters"]) -> bool:
    """``done.wait(timeout_s)``, adding the seconds it blocked to ``counters.wait_s`` (nothing
    when ``done`` is already set). Returns whether ``done`` is set."""
    if done.is_set():
        return True
    start = time.perf_counter()
    try:
        return done.wait(timeout_s)
    finally:
        if counters is not None:
            counters.add_wait(time.perf_counter() - start)


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.wait_s = 0.0

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds

    def add(self, is_write: bool, nbytes: int) -> None:
        with self._lock:
            if is_write:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes


class _SwapFile:
    __slots__ = ("path", "fd", "nbytes")

    def __init__(self, path: str, fd: int, nbytes: int) -> None:
        self.path, self.fd, self.nbytes = path, fd, nbytes


class _SwapperState:
    """Everything ``close`` needs, held apart from ``Swapper`` so a finalizer can own it."""

    def __init__(self, folder: str, created_folder: bool) -> None:
        self.folder = folder
        self.created_folder = created_folder
        self.files: dict = {}
        self.backend = None
        self.owner_file: Optional[str] = None  # written by claim_folder, removed at close
        self.closed = False
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        with _signals_deferred():  # a second Ctrl-C must not leave the files behind
            self._close()

    def _close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        for swap_file in self.files.values():
            try:
                os.close(swap_file.fd)
            except OSError:
                pass
            try:
                os.unlink(swap_file.path)
            except FileNotFoundError:
                pass
        self.files.clear()
        release_folder(self.owner_file)
        if self.created_folder:
            try:
                os.rmdir(self.folder)
            except OSError:
                pass  # someone else put files there; leave them alone


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT and SIGTERM back for the block, then deliver the first that came to the
    handler that was in place (a KeyboardInterrupt, the CLI's or the engine's SIGTERM exit).

    Closing a swapper waits for the transfers in flight, then closes and deletes its files: a
    second Ctrl-C landing there (users press it twice) cut that short and left the files,
    which the next run refuses to overwrite. Only in the main thread, where Python runs signal
    handlers (elsewhere the block runs as it is). The block waits for the disk: a disk that
    never answers then needs SIGKILL (its files stay, as after any SIGKILL)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not None:  # (None: set outside Python; left alone)
                previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    except (ValueError, OSError):  # (no signals here: an embedded interpreter, say)
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


# ---- folder and backend probing -----------------------------------------------------------------

def _prepare_folder(folder: str) -> tuple:
    """Returns (absolute folder, created_by_us). Raises ValueError naming the bad path."""
    folder = os.path.abspath(os.fspath(folder))
    if os.path.isdir(folder):
        from offload_zero.config import require_writable
        require_writable(folder, f"swap folder {folder!r}", "give another path")
        return folder, False
    if os.path.lexists(folder):
        raise ValueError(f"swap folder {folder!r} exists and is not a directory")
    parent = os.path.dirname(folder)
    if not os.path.isdir(parent):
        raise ValueError(
            f"parent {parent!r} of swap folder {folder!r} is missing or not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"parent {parent!r} of swap folder {folder!r} is not writable")
    try:
        os.mkdir(folder, 0o700)
    except OSError as exc:
        raise ValueError(f"cannot create swap folder {folder!r}: {exc.strerror}") from exc
    os.chmod(folder, 0o700)
    return folder, True


def probe_o_direct(folder: str) -> Optional[str]:
    """Check that the filesystem under ``folder`` takes aligned O_DIRECT writes.

    Opens a temporary file in ``folder`` with O_DIRECT, writes one aligned 4096-byte page and
    removes it. Returns None when that works, else a short reason (str).
    """
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = os.path.join(folder, f".oz-odirect-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return f"the filesystem under {folder!r} refuses O_DIRECT ({exc.strerror})"
    try:
        page = mmap.mmap(-1, ALIGNMENT)  # page-aligned anonymous memory
        try:
            written = os.pwrite(fd, page, 0)
        finally:
            page.close()
        if written != ALIGNMENT:
            return f"O_DIRECT write probe in {folder!r} wrote {written} of {ALIGNMENT} bytes"
    except OSError as exc:
        return f"O_DIRECT write probe in {folder!r} failed ({exc.strerror})"
    finally:
        os.close(fd)
        os.unlink(path)
    return None


def _make_libaio_backend(queue_depth: int):
    """Returns (backend or None, reason it is unusable or None)."""
    try:
        from offload_zero.memory.aio_libaio import LibaioBackend
    except ImportError as exc:
        return None, f"the libaio bindings do not import ({exc})"
    try:
        return LibaioBackend(queue_depth), None
    except OSError as exc:
        return None, f"the kernel refused an AIO context (io_setup: {exc})"


def _check_positive_int(name: str, value, multiple_of: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % multiple_of:
        rule = f"a positive multiple of {multiple_of}" if multiple_of > 1 else "an int >= 1"
        raise ValueError(f"{name} must be {rule}, got {value!r}")


# ---- the swapper --------------------------------------------------------------------------------

class Swapper:
    """Asynchronous O_DIRECT swap of aligned host tensors to files in one folder.

    Args:
        folder: directory for the swap files. Used as is when it exists; otherwise created with
            mode 0700 (its parent must exist) and removed again by ``close``.
        backend: "auto" (libaio when the bindings import and the filesystem takes O_DIRECT,
            else "threads" with a warning saying why), "libaio" (error if unusable) or "threads".
        block_size: bytes per request, a positive multiple of 4096 (default 1 MiB), or None:
            tuned for the folder's device (``tuning.tuned_settings``: a probe of at most ~2 s
            the first time a device is seen, then a cached choice; see
            [Note: aio self-tuning] in ``tuning.py``).
        queue_depth: most requests in flight at once for this swapper (>= 1, default 8), or
            None: tuned likewise. An explicit value of one overrides the tuned one, and
            ``tuning`` holds what the probe or the cache said (None when both are explicit).
        claim: record this process as the folder's owner (``<folder>/.owner``, removed by
            ``close``) and take over a folder whose recorded owner is gone, removing its swap
            files with a warning (see ``offload_zero.memory.owner``). Default False.

    Raises:
        ValueError: the folder's parent is missing/not a directory/not writable, the folder is
            a file, ``claim`` and its recorded owner still runs, the backend name is unknown, "libaio" was forced but cannot work (the
            message says why), or block_size/queue_depth are invalid.

    Files are removed by ``close()``, which also runs when the swapper is garbage collected
    and at interpreter exit.
    """

    def __init__(self, folder: str, backend: str = "auto", block_size: Optional[int] = 1 << 20,
                 queue_depth: Optional[int] = 8, claim: bool = False) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown swap backend {backend!r}; choose one of {BACKENDS}")
        if block_size is not None:
            _check_positive_int("block_size", block_size, ALIGNMENT)
        if queue_depth is not None:
            _check_positive_int("queue_depth", queue_depth)
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.tuning: Optional[dict] = None
        folder, created = _prepare_folder(folder)
        self._state = _SwapperState(folder, created)
        self._finalizer = weakref.finalize(self, _SwapperState.close, self._state)
        try:
            if claim:
                self._state.owner_file = claim_folder(folder, created)
            if block_size is None or queue_depth is None:
                self._apply_tuning(backend)
            self._state.backend, self._direct = self._pick_backend(backend)
        except BaseException:
            self.close()
            raise
        self._counters = _Counters()
        self._handles_lock = threading.Lock()
        self._outstanding: "weakref.WeakSet[SwapHandle]" = weakref.WeakSet()
        self._unobserved_failures: list = []

    def _apply_tuning(self, backend: str) -> None:
        """Fill in whichever of block_size / queue_depth is None from the device's tuning."""
        from offload_zero.memory.tuning import tuned_settings

        self.tuning = tuned_settings(self._state.folder, backend=backend)
        if self.block_size is None:
            self.block_size = self.tuning["block_size"]
        if self.queue_depth is None:
            self.queue_depth = self.tuning["queue_depth"]

    def _pick_backend(self, requested: str) -> tuple:
        """Returns (backend object, whether files are opened with O_DIRECT)."""
        folder = self._state.folder
        direct_problem = probe_o_direct(folder)
        if requested == "threads":
            return ThreadsBackend(self.queue_depth), direct_problem is None
        problem = direct_problem
        if problem is None:
            backend, problem = _make_libaio_backend(self.queue_depth)
            if backend is not None:
                return backend, True
        if requested == "libaio":
            raise ValueError(f"swap backend 'libaio' is unusable for {folder!r}: {problem}")
        warnings.warn(
            f"offload_zero swapper: using the slower 'threads' backend for {folder!r} because "
            f"{problem}; {_FAST_PATH_HINT}", RuntimeWarning, stacklevel=3)
        return ThreadsBackend(self.queue_depth), direct_problem is None

    # ---- properties --------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """"libaio" or "threads"."""
        return self._state.backend.name

    @property
    def direct(self) -> bool:
        """Whether swap files are opened with O_DIRECT (bypassing the page cache)."""
        return self._direct

    @property
    def folder(self) -> str:
        """Absolute path of the swap folder."""
        return self._state.folder

    @property
    def bytes_read(self) -> int:
        """Bytes successfully read by ``swap_in`` since construction (cumulative)."""
        return self._counters.bytes_read

    @property
    def bytes_written(self) -> int:
        """Bytes successfully written by ``swap_out`` since construction (cumulative)."""
        return self._counters.bytes_written

    @property
    def wait_s(self) -> float:
        """Seconds callers have spent blocked in ``SwapHandle.wait()`` and ``wait_all()`` on
        transfers not yet done, since construction (cumulative; a wait on a finished transfer
        adds nothing). For the engine, whose training thread is the only one that waits, this
        is the NVMe I/O that did not hide behind compute."""
        return self._counters.wait_s

    @property
    def file_bytes(self) -> int:
        """Bytes currently allocated on disk by this swapper (sum of allocated file sizes)."""
        return sum(f.nbytes for f in self._state.files.values())

    @property
    def files(self) -> list:
        """Paths of the swap files currently owned by this swapper."""
        return [f.path for f in self._state.files.values()]

    @property
    def closed(self) -> bool:
        """True after ``close()``."""
        return self._state.closed

    # ---- files -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state.closed:
            raise ValueError(f"swapper for {self._state.folder!r} is closed")

    def allocate(self, key: str, nbytes: int) -> None:
        """Create ``<folder>/<key>.swp`` (mode 0600) of ``nbytes`` bytes, preallocated on disk.

        Args:
            key: letters, digits, '_', '.', '-' (not starting with '.' or '-'), <= 200 chars.
            nbytes: file size in bytes, a positive multiple of 4096.
        Raises:
            ValueError: bad key, key already allocated, a file of that name already exists,
                bad nbytes, or the swapper is closed.
            SwapIOError: the filesystem could not reserve the space (e.g. ENOSPC).
        """
        self._check_open()
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise ValueError(f"swap key must match {_KEY_RE.pattern}, got {key!r}")
        if key in self._state.files:
            raise ValueError(f"swap key {key!r} is already allocated in {self._state.folder!r}")
        _check_positive_int(f"nbytes for swap key {key!r}", nbytes, ALIGNMENT)
        path = os.path.join(self._state.folder, key + ".swp")
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC
        if self._direct:
            flags |= os.O_DIRECT
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError as exc:
            raise ValueError(
                f"swap file {path!r} already exists; not overwriting it. Another engine is using "
                f"this folder, or an earlier run was killed before it could clean up: delete "
                f"{os.path.dirname(path)!r} if no run is using it, or choose another path") from exc
        try:
            os.fchmod(fd, 0o600)
            _reserve(fd, path, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self._state.files[key] = _SwapFile(path, fd, nbytes)

    # ---- transfers ---------------------------------------------------------------------------

    def swap_out(self, key: str, tensor: torch.Tensor, offset_bytes: int = 0) -> SwapHandle:
        """Start writing ``tensor``'s bytes to the file of ``key`` at ``offset_bytes``.

        Args:
            key: an allocated key.
            tensor: contiguous CPU tensor, any dtype, ``data_ptr() % 4096 == 0`` and size in
                bytes a multiple of 4096. Do not modify it until the handle is done.
            offset_bytes: byte offset into the file, a multiple of 4096.
        Returns:
            A ``SwapHandle``; the write proceeds in the background.
        Raises:
            ValueError: unknown key, misaligned/non-contiguous/non-CPU tensor, bad offset, or
                ``offset_bytes + nbytes`` beyond the allocated file size (values in the message).
        """
        return self._start(key, tensor, offset_bytes, is_write=True)

    def swap_in(self, key: str, tensor: torch.Tensor, offset_bytes: int = 0,
                urgent: bool = False) -> SwapHandle:
        """Start reading ``tensor.nbytes`` bytes at ``offset_bytes`` of ``key``'s file into
        ``tensor``. Same arguments, rules and errors as ``swap_out``; do not read the tensor
        until the handle is done. Queued reads go before queued writes (but those of their own
        file); ``urgent`` ones before the other reads (see
        :mod:`offload_zero.memory.aio_queue`)."""
        return self._start(key, tensor, offset_bytes, is_write=False, urgent=urgent)

    def _start(self, key, tensor, offset_bytes, is_write, urgent=False) -> SwapHandle:
        self._check_open()
        swap_file = self._state.files.get(key)
        if swap_file is None:
            raise ValueError(f"swap key {key!r} is not allocated in {self._state.folder!r}")
        nbytes = _check_tensor(key, tensor)
        if (isinstance(offset_bytes, bool) or not isinstance(offset_bytes, int)
                or offset_bytes < 0 or offset_bytes % ALIGNMENT):
            raise ValueError(f"swap key {key!r}: offset_bytes must be a multiple of "
                             f"{ALIGNMENT} >= 0, got {offset_bytes!r}")
        if offset_bytes + nbytes > swap_file.nbytes:
            raise ValueError(
                f"swap key {key!r}: offset_bytes {offset_bytes} + nbytes {nbytes} = "
                f"{offset_bytes + nbytes} exceeds the file size {swap_file.nbytes} of "
                f"{swap_file.path!r}")
        num_requests = -(-nbytes // self.block_size)
        handle = SwapHandle(key, "out" if is_write else "in", tensor, num_requests,
                            on_error=self._note_failure, counters=self._counters)
        base = tensor.data_ptr()
        requests = [
            _Request(handle, swap_file.path, swap_file.fd, offset_bytes + start, base + start,
                     min(self.block_size, nbytes - start), is_write, self._counters, urgent)
            for start in range(0, nbytes, self.block_size)
        ]
        if requests:
            with self._handles_lock:
                self._outstanding.add(handle)
            self._state.backend.submit(requests)
        return handle

    def _note_failure(self, handle: SwapHandle) -> None:
        with self._handles_lock:
            self._unobserved_failures.append(handle)

    def wait_all(self) -> None:
        """Block until every transfer started so far has completed.

        Raises:
            SwapIOError: the first failure among transfers whose handle was never ``wait()``-ed
                (each failure is reported once, by ``wait()`` or by ``wait_all()``).
        """
        with self._handles_lock:
            outstanding = list(self._outstanding)
        for handle in outstanding:
            _timed_wait(handle._done, None, self._counters)
        with self._handles_lock:
            failed = [h for h in self._unobserved_failures if not h.observed]
            self._unobserved_failures.clear()
        if failed:
            failed[0].wait()  # raises its SwapIOError

    def close(self) -> None:
        """Finish or cancel in-flight I/O (cancelled transfers fail with ECANCELED), close the
        file descriptors, delete every file this swapper created and the folder if it created
        it. Idempotent; never raises for I/O failures."""
        self._finalizer()

    def __enter__(self) -> "Swapper":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._state.closed else f"{len(self._state.files)} files"
        return f"Swapper({self._state.folder!r}, backend={self.backend!r}, {state})"


def _check_tensor(key: str, tensor) -> int:
    """Validate a transfer buffer; returns its size in bytes."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"swap key {key!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"swap key {key!r}: tensor must be a contiguous CPU tensor, got "
                         f"device={tensor.device}, contiguous={tensor.is_contiguous()}")
    if nbytes and (tensor.data_ptr() % ALIGNMENT or nbytes % ALIGNMENT):
        raise ValueError(
            f"swap key {key!r}: tensor data_ptr {tensor.data_ptr():#x} and nbytes {nbytes} must "
            f"both be multiples of {ALIGNMENT} (allocate it with aligned_empty)")
    return nbytes


def _reserve(fd: int, path: str, nbytes: int) -> None:
    """Give the file its size, reserving the blocks when the filesystem can (fallocate)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise SwapIOError(exc.errno, f"cannot reserve {nbytes} bytes for {path}: "
                              f"[Errno {exc.errno}] {exc.strerror}", path, 0, nbytes) from exc
    try:
        os.ftruncate(fd, nbytes)
    except OSError as exc:
        raise SwapIOError(exc.errno, f"cannot size {path} to {nbytes} bytes: "
                          f"[Errno {exc.errno}] {exc.strerror}", path, 0, nbytes) from exc


# ---- measurement --------------------------------------------------------------------------------

def measure_bandwidth(path: str, size_bytes: int, block_size: int = 1 << 20, queue_depth: int = 8,
                      backend: str = "auto", repeats: int = 3, peer=None,
                      ring: bool = False) -> dict:
    """Measure the swapper's sequential write and read bandwidth on one file.

    Writes ``size_bytes`` from an aligned host buffer into one swap file in a fresh
    sub-folder of ``path``, ``repeats`` times, then reads it back ``repeats`` times, and checks
    the bytes read equal the bytes written. With O_DIRECT the page cache is not involved.

    Args:
        path: an existing directory on the filesystem to measure.
        size_bytes: file size in bytes, a positive multiple of 4096.
        block_size: bytes per request (multiple of 4096). queue_depth: requests in flight.
        backend: as for ``Swapper``. repeats: timed passes per direction (>= 1).
        peer: optional ``peer(file_path, op) -> GB/s`` (op "write" or "read") run on the same
            swap file, alternating with our passes (before each of our writes, so the data
            we verify is ours; after each of our reads). Used to put fio beside us.
        ring: False moves the whole file through one ``size_bytes`` buffer (how the engine
            swaps shards). True cycles ``queue_depth`` buffers of ``block_size`` bytes, one
            transfer per block, the memory footprint fio uses; data is not verified then.
    Returns:
        dict with ``read_gbps`` / ``write_gbps`` (best pass, GB/s = 1e9 bytes/s),
        ``read_gbps_median`` / ``write_gbps_median``, ``read_s`` / ``write_s`` (seconds per
        pass), with ``peer``: ``peer_read_gbps`` / ``peer_write_gbps`` (best of its passes) and
        ``peer_read_gbps_all`` / ``peer_write_gbps_all``; ``backend``, ``direct``, ``size_bytes``, ``block_size``, ``queue_depth``.
    Raises:
        ValueError: bad arguments (see ``Swapper``). SwapIOError: an I/O failure.
        RuntimeError: the data read back differs from what was written.
    """
    _check_positive_int("size_bytes", size_bytes, ALIGNMENT)
    _check_positive_int("repeats", repeats)
    folder = os.path.join(os.path.abspath(path), f"oz-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    _check_positive_int("block_size", block_size, ALIGNMENT)
    _check_positive_int("queue_depth", queue_depth)
    buffer = aligned_empty(queue_depth * block_size if ring else size_bytes, torch.uint8)
    _fill_random(buffer)  # incompressible, in case the storage below compresses or dedups
    write_s, read_s, peer_write, peer_read = [], [], [], []
    with Swapper(folder, backend=backend, block_size=block_size, queue_depth=queue_depth) as sw:
        sw.allocate("bench", size_bytes)
        file_path = sw.files[0]
        for _ in range(repeats):
            if peer is not None:
                peer_write.append(peer(file_path, "write"))
            start = time.perf_counter()
            _transfer(sw, buffer, size_bytes, ring, is_write=True)
            write_s.append(time.perf_counter() - start)
        buffer.zero_()
        for _ in range(repeats):
            start = time.perf_counter()
            _transfer(sw, buffer, size_bytes, ring, is_write=False)
            read_s.append(time.perf_counter() - start)
            if peer is not None:
                peer_read.append(peer(file_path, "read"))
        result = dict(backend=sw.backend, direct=sw.direct)
    if not ring and not _fill_random(buffer, check=True):
        raise RuntimeError(f"measure_bandwidth: data read back from {folder!r} differs")

    def gbps(seconds: float) -> float:
        return size_bytes / seconds / 1e9

    result.update(
        write_gbps=gbps(min(write_s)), read_gbps=gbps(min(read_s)),
        write_gbps_median=statistics.median(gbps(x) for x in write_s),
        read_gbps_median=statistics.median(gbps(x) for x in read_s),
        write_s=write_s, read_s=read_s, size_bytes=size_bytes, block_size=block_size,
        queue_depth=queue_depth, ring=ring)
    if peer is not None:
        result.update(peer_write_gbps=max(peer_write), peer_read_gbps=max(peer_read),
                      peer_write_gbps_all=peer_write, peer_read_gbps_all=peer_read)
    return result


def _transfer(sw: Swapper, buffer: torch.Tensor, size_bytes: int, ring: bool,
              is_write: bool) -> None:
    """One timed pass of ``measure_bandwidth`` over the key "bench"."""
    start_io = sw.swap_out if is_write else sw.swap_in
    if not ring:
        start_io("bench", buffer).wait()
        return
    block, slots = sw.block_size, [None] * sw.queue_depth
    for index, offset in enumerate(range(0, size_bytes, block)):
        slot = index % len(slots)
        if slots[slot] is not None:
            slots[slot].wait()
        length = min(block, size_bytes - offset)
        slots[slot] = start_io("bench", buffer[slot * block: slot * block + length], offset)
    for handle in slots:
        if handle is not None:
            handle.wait()


def _fill_random(buffer: torch.Tensor, check: bool = False, chunk_bytes: int = 64 << 20) -> bool:
    """Fill a uint8 buffer (size a multiple of 8) with seeded random bytes, 64 MiB at a time;
    with ``check``, compare instead. Returns True when filled or when the bytes match."""
    words = buffer.view(torch.int64)
    chunk_words = chunk_bytes // 8
    generator = torch.Generator()
    for index, start in enumerate(range(0, words.numel(), chunk_words)):
        generator.manual_seed(index)
        part = words[start: start + chunk_words]
        expected = torch.randint(-(1 << 62), 1 << 62, part.shape, dtype=torch.int64,
                                 generator=generator)
        if not check:
            part.copy_(expected)
        elif not torch.equal(part, expected):
            return False
    return True
