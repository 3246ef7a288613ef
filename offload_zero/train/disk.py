"""The NVMe swap folder of ``--offload nvme``: the bytes its files need beside the free
space, a temporary folder when ``--path`` is not given, and a warning of the folders that
killed runs left."""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
from typing import Iterator, Optional

import torch

from offload_zero.memory.owner import pid_alive as _pid_alive
from offload_zero.train.arguments import DTYPES
from offload_zero.train.summary import fmt_bytes

log = logging.getLogger("offload_zero.train")


def nvme_bytes_needed(args: argparse.Namespace, model: torch.nn.Module,
                      update_timing: str) -> int:
    """Bytes the swap files of ``--offload nvme`` take on ``--path``'s file system: one rank's
    (:func:`offload_zero.estimator.placement_bytes` on the engine's layout, at the world size
    of ``WORLD_SIZE``) times the ranks of this node (``LOCAL_WORLD_SIZE``), which share it."""
    from offload_zero.estimator import placement_bytes
    from offload_zero.tables import default_offload_param
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    placement = placement_bytes(model, args.stage, "nvme",
                                default_offload_param("nvme", args.stage), world_size,
                                DTYPES[args.dtype], accelerator=torch.cuda.is_available(),
                                update_timing=update_timing)
    return placement.nvme_bytes_per_rank * local_ranks


def _disk_folder(path: Optional[str]) -> str:
    """The folder whose file system holds the swap files: ``--path`` (or its nearest existing
    ancestor, if it is still to be created), else the system temp dir."""
    folder = os.path.abspath(path) if path is not None else tempfile.gettempdir()
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def _disk_advice(path: Optional[str], need: Optional[int]) -> str:
    """The end of both no-space messages: what is free on ``path``'s file system beside what
    the run needs (bytes), and what to do."""
    free = shutil.disk_usage(_disk_folder(path)).free
    needs = f"the run needs {fmt_bytes(need)} of swap files there, " if need is not None else ""
    return (f"{needs}{fmt_bytes(free)} free: train a smaller model, use --offload auto (it "
            "keeps on disk only what does not fit in memory), or give another --path on a "
            "larger disk")


def check_disk_space(path: Optional[str], need: int) -> None:
    """Raise ValueError (one line: the bytes needed, the bytes free, what to do) if ``need``
    bytes of swap files do not fit in the free space of ``path``'s file system (``None``: the
    system temp dir, where the run's temporary swap folder goes), or (the OS error, another
    ``--path`` to give) if no file can be created in its folder (or in the nearest existing
    ancestor it is to be made in): a read-only or virtual file system reports 0 bytes free,
    which is not what is wrong. Leaves nothing behind (a test file is created and removed)."""
    from offload_zero.config import write_error
    folder = _disk_folder(path)
    where = path if path is not None else tempfile.gettempdir()
    error = write_error(folder)
    if error is not None:
        if path is not None:
            what, fix = f"the swap folder --path {path!r}", "give another --path"
        else:
            what, fix = f"the system temp dir {where!r}", "give --path"
        raise ValueError(f"--offload nvme: {what} cannot be written (creating a file in "
                         f"{folder!r}: {error}); {fix}, a folder on a file system this "
                         "process can write to")
    if need > shutil.disk_usage(folder).free:
        raise ValueError(f"--offload nvme: not enough space on the file system of {where!r}: "
                         f"{_disk_advice(path, need)}")


@contextlib.contextmanager
def disk_full_as_value_error(path: Optional[str], need: Optional[int]) -> Iterator[None]:
    """Turn a swap file's ENOSPC (the disk filled up after :func:`check_disk_space`, another
    job writing there, say) into the same one-line ValueError, instead of a SwapIOError that
    names one file's bytes."""
    from offload_zero.memory.swapper import SwapIOError
    try:
        yield
    except SwapIOError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        where = path if path is not None else tempfile.gettempdir()
        raise ValueError(f"--offload nvme: no space left on the file system of {where!r} "
                         f"(writing {exc.path}): {_disk_advice(path, need)}") from None


@contextlib.contextmanager
def swap_folder(offload: str, path: Optional[str]) -> Iterator[Optional[str]]:
    """Yield the NVMe swap folder: ``path`` (created if missing, and then removed on exit if
    left empty) or, for ``offload == "nvme"`` without one, a fresh temporary folder that is
    removed on exit (also on errors)."""
    if offload != "nvme" or path is not None:
        created = path is not None and not os.path.isdir(path)
        if path is not None:
            os.makedirs(path, exist_ok=True)
        try:
            yield path
        finally:
            if created:
                try:
                    os.rmdir(path)  # only if empty: never anything the run did not create
                except OSError:
                    pass
        return
    _warn_of_stale_swap_folders(tempfile.gettempdir())
    temp = tempfile.mkdtemp(prefix=f"{_SWAP_PREFIX}{os.getpid()}-")
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


_SWAP_PREFIX = "offload-zero-swap-"  # + the pid of the run that owns the folder


def _warn_of_stale_swap_folders(tempdir: str) -> None:
    """Log a warning naming the default swap folders under ``tempdir`` whose run is gone (a
    SIGKILL leaves its folder: nothing runs to remove it) and the bytes they hold, with the
    command that removes them. Removes nothing: a pid that looks dead here may belong to
    another PID namespace sharing this folder."""
    stale = []
    try:
        entries = os.listdir(tempdir)
    except OSError:
        return
    for name in entries:
        m = re.fullmatch(rf"{re.escape(_SWAP_PREFIX)}(\d+)-\w+", name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        folder = os.path.join(tempdir, name)
        size = sum(os.path.getsize(os.path.join(root, f))
                   for root, _, files in os.walk(folder) for f in files)
        stale.append((folder, size))
    if stale:
        log.warning("%d swap folder(s) left by killed runs hold %s; remove them with: rm -r %s",
                    len(stale), fmt_bytes(sum(n for _, n in stale)),
                    " ".join(f for f, _ in stale))
