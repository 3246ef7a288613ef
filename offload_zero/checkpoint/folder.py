"""A checkpoint's folder on disk: its name and temporary siblings, the lock against other
jobs, the checks that a folder may be replaced or created, durable writes and the swap.

[Note: atomic save]
A save never changes ``folder`` until the new checkpoint is complete. Every rank writes (and
fsyncs) its file into the sibling folder ``.<folder name>.saving``; all ranks agree that every
write succeeded; rank 0 then writes ``checkpoint.json`` into it and swaps it with ``folder``
(one atomic exchange of the two names where Linux's ``renameat2(RENAME_EXCHANGE)`` is
supported, else ``folder`` -> ``.<folder name>.replaced`` and the new folder -> ``folder``), and
removes the previous checkpoint; the ranks agree once more before returning. Rank 0 holds an
exclusive ``flock`` on the folder's parent meanwhile, and each loading rank a shared one while
it reads: a second job saving to the same folder waits instead of writing into the same
temporary folder, and a load waits for a save to end (see :func:`folder_lock`). If any rank fails,
every rank raises, the temporary folder is removed and ``folder`` is as it was. A process
killed mid-save leaves ``.<folder name>.saving`` behind; the next save removes it.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil

from offload_zero.checkpoint.layout import META_NAME, RANK_FILE_RE, paths

log = logging.getLogger("offload_zero")


def check_destination(folder) -> None:
    """Check, writing nothing, that :func:`~offload_zero.checkpoint.save.save_checkpoint`
    could save into ``folder``: it is absent, empty or a checkpoint folder, and its parent
    exists (or can be created) and is writable. Raises ValueError naming the path otherwise."""
    final = paths(folder)[0]
    check_replaceable(final)
    check_creatable(os.path.dirname(final), f"checkpoint folder {final!r}")


def check_creatable(path, what: str) -> None:
    """Check, leaving nothing behind, that the folder ``path`` exists or ``os.makedirs`` could
    make it: its nearest existing ancestor is a folder this process can create a file in
    (:func:`offload_zero.config.write_error`). Raises ValueError ``"<what> cannot be created:
    <ancestor> is not a folder"`` (or ``"... not writable (...)"``, with the OS error)."""
    ancestor = os.path.abspath(os.fspath(path))
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{what} cannot be created: {ancestor!r} is not a folder")
    from offload_zero.config import require_writable
    require_writable(ancestor, f"{what} cannot be created: {ancestor!r}",
                     "give a folder this process can write to")


@contextlib.contextmanager
def folder_lock(final: str, exclusive: bool, take: bool):
    """Hold an advisory lock (``flock``) on the folder that holds checkpoint ``final`` while
    the body runs: exclusive for a save (taken by rank 0, which creates, swaps and removes
    folders there), shared for a load (every rank, while it reads). Another process's save
    next to it waits for the lock instead of mixing its files into the same temporary
    folder; a load waits for a save to finish instead of reading a folder being swapped. The
    lock goes with the process: a killed job leaves none behind. Nothing is taken where
    ``take`` is False, or where the file system has no such locks (a message says so); the
    parent folder missing is left to the save or load to report."""
    import fcntl
    fd = None
    if take:
        try:
            fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
        except OSError:
            fd = None
    try:
        if fd is not None:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            try:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                except BlockingIOError:
                    log.info("%s: another process is saving or loading a checkpoint in %s; "
                             "waiting for it", final, os.path.dirname(final))
                    fcntl.flock(fd, mode)
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                log.info("%s: this file system has no flock (%s): checkpoints are not locked "
                         "against other jobs", final, exc.strerror)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # (releases the lock)


def check_replaceable(final: str) -> None:
    """Raise ValueError unless ``final`` is absent, an empty folder, or a checkpoint folder
    holding only checkpoint files (a save replaces it as a whole)."""
    if not os.path.lexists(final):
        return
    if not os.path.isdir(final):
        raise ValueError(f"checkpoint folder {final!r} exists and is not a folder")
    entries = os.listdir(final)
    others = sorted(e for e in entries if e != META_NAME and not RANK_FILE_RE.fullmatch(e))
    if entries and (others or META_NAME not in entries):
        raise ValueError(f"{final!r} exists and is not an offload-zero checkpoint (it holds "
                         f"{(others or sorted(entries))[:5]}); a save replaces the whole folder, "
                         "so choose a new or empty one")


def fresh_folder(path: str) -> None:
    """Make ``path`` an empty new folder, first removing what a killed save left there.
    Raises OSError if it cannot be made."""
    if os.path.lexists(path):  # left by a save that was killed: never a complete checkpoint
        shutil.rmtree(path)
    os.makedirs(path)


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to the new file ``path`` and fsync it. Raises FileExistsError if
    ``path`` exists, OSError if the write fails."""
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_folder(path: str) -> None:
    """Make the folder's entries (created, renamed files) durable; a no-op where folders cannot
    be fsynced."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def swap_in(tmp: str, final: str, replaced: str) -> None:
    """Put the complete folder ``tmp`` at ``final`` and remove what was there."""
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint now
    else:
        if os.path.lexists(replaced):
            shutil.rmtree(replaced)
        os.rename(final, replaced)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(replaced, final)
            raise
        shutil.rmtree(replaced, ignore_errors=True)
    fsync_folder(parent)
    for leftover in (tmp, replaced):
        if os.path.lexists(leftover):
            log.warning("could not remove %s (the previous checkpoint); the new one is in %s",
                        leftover, final)


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the C library or the file system does not support it; raises OSError
    (errno, path) if the call itself fails."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}", a)
