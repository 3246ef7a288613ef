"""Who owns a swap folder: an owner file that lets a run take over the folder of a killed one.

A run killed with SIGKILL cannot remove its swap files, and the next run with the same folder
refused to overwrite them until the user deleted the folder by hand. :func:`claim_folder`
records the owner in ``<folder>/.owner`` (JSON: ``pid``, ``start`` (the process's start time
in clock ticks after boot, from ``/proc/<pid>/stat``, or null), ``boot_id``
(``/proc/sys/kernel/random/boot_id``), ``host`` and ``created_folder`` (whether the run made
the folder, so that whoever ends up owning it removes it when done)). A later claim of the folder then

- takes it over, with a warning, when the owner is gone: same host, and another boot id, or
  no process of that pid (or one started at another time: the pid was reused); the owner's
  ``*.swp`` files are removed, and a folder the gone owner had made is removed when the new
  owner releases it (as the gone owner would have);
- refuses it (``ValueError``) while the owner runs;
- leaves it as it is when the owner is this process (another swapper of it), when the owner
  file is of another host (a shared file system: its processes cannot be seen from here), and
  when there is no owner file (a folder of an older run, or the user's own): a stale swap file
  there is then refused when allocated, as before.
"""
from __future__ import annotations

import glob
import json
import os
import socket
import warnings
from typing import Optional

OWNER_NAME = ".owner"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> Optional[int]:
    """Start time of process ``pid`` in clock ticks after boot, or None if unknown (no /proc,
    no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # (the command name, field 2, is in parentheses and may hold spaces)
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process of id ``pid`` runs on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def owner_record(pid: Optional[int] = None, created_folder: bool = False) -> dict:
    """The owner file's contents for process ``pid`` (default: this one); ``created_folder``:
    whether the folder is the owner's to remove when it is done."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start": _start_ticks(pid), "boot_id": _boot_id(),
            "host": socket.gethostname(), "created_folder": bool(created_folder)}


def _read_owner(path: str) -> Optional[dict]:
    """The owner file at ``path``, or None if there is none or it is unreadable."""
    try:
        with open(path) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return None
    return owner


def _is_gone(owner: dict) -> bool:
    """Whether the process ``owner`` names (same host) no longer runs."""
    if owner.get("boot_id") != _boot_id():
        return True
    if not pid_alive(owner["pid"]):
        return True
    start = owner.get("start")
    now = _start_ticks(owner["pid"])
    return start is not None and now is not None and start != now


def claim_folder(folder: str, created_folder: bool = False) -> Optional[str]:
    """Record this process as the owner of the swap folder ``folder`` (an existing folder),
    taking it over from an owner that is gone (its ``*.swp`` files removed, with a
    ``RuntimeWarning``). Returns the owner file's path when this call wrote it (remove it with
    :func:`release_folder` when done), None when the folder is left as it is (see the module
    docstring; also when the owner file cannot be written, a full disk say: the folder is then
    used as one without it). Raises ValueError naming the folder and the pid while the owner
    runs. ``created_folder``: this process made ``folder`` (it inherits that from a gone owner
    that had made it); :func:`release_folder` then removes the folder if it is empty."""
    path = os.path.join(folder, OWNER_NAME)
    owner, me = _read_owner(path), owner_record(created_folder=created_folder)
    if owner is not None:
        if owner.get("host") != me["host"]:
            return None
        if owner["pid"] == me["pid"] and owner.get("boot_id") == me["boot_id"]:
            return None
        if not _is_gone(owner):
            raise ValueError(f"swap folder {folder!r} is in use by process {owner['pid']} "
                             f"(per {path}), which is still running: give this run another "
                             "path, or end that one first")
        stale = sorted(glob.glob(os.path.join(glob.escape(folder), "*.swp")))
        stale_bytes = sum(os.path.getsize(f) for f in stale)
        warnings.warn(f"swap folder {folder!r} was left by process {owner['pid']}, which is "
                      f"gone (killed, or the machine rebooted): removing {len(stale)} swap "
                      f"file(s) of it ({stale_bytes} bytes) and reusing the folder",
                      RuntimeWarning, stacklevel=3)
        for f in stale:
            os.unlink(f)
        me["created_folder"] = bool(created_folder or owner.get("created_folder"))
    elif os.path.lexists(path):
        return None  # unreadable: not ours to replace
    try:
        with open(path, "w") as f:
            json.dump(me, f)
    except OSError:
        release_folder(path)
        return None
    return path


def release_folder(path: Optional[str]) -> None:
    """Remove the owner file :func:`claim_folder` wrote at ``path`` (None: nothing to do), and
    its folder when the record says the owner made it and nothing else is left in it."""
    if path is not None:
        owner = _read_owner(path) or {}
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if owner.get("created_folder"):
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass  # someone else's files are there: leave them
