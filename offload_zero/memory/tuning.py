"""Self-tuning of the swapper's request size and queue depth, once per storage device.

[Note: aio self-tuning]
The best ``block_size`` (bytes per request) and ``queue_depth`` (requests in flight) depend on
the device and the filesystem: a SATA SSD saturates at a few requests of 1 MiB, an NVMe drive
often wants 4 MiB requests or a deeper queue, a network volume something else again. So the
first time a device is used, :func:`tuned_settings` runs a short *probe* under the swap folder
and remembers the choice per device id (``os.stat(folder).st_dev``) in a small JSON *cache*.

Probe, bounded by ``budget_s`` seconds of wall time in total:
1. *Calibrate*: write then read ``CALIBRATION_BYTES`` with the defaults (1 MiB, 8); this also
   resolves the backend ("auto" -> "libaio" or "threads") and tells whether O_DIRECT works.
   Without O_DIRECT the page cache would be measured, not the device, so the defaults are kept.
2. Size the *trials* so that all of them fit in ``TRIAL_SHARE`` (60%) of what is left of the
   budget at the calibrated rate: ``trial_bytes`` between ``MIN_TRIAL_BYTES`` and
   ``MAX_TRIAL_BYTES``. The calibration itself always runs (8 MiB each way).
3. Each trial (the defaults first, then the pairs of ``BLOCK_SIZES`` x ``QUEUE_DEPTHS`` that
   change one of the two, then the rest) writes then reads ``trial_bytes`` through its own
   ``Swapper``; a trial that would end past the deadline at the slowest rate seen so far is
   skipped, so the budget is overrun only by a trial slower than every one before it.
4. Score = bytes moved (both directions) / seconds. The pair with the best score wins; pairs
   within ``TIE_FRACTION`` of the best count as equal and the one with the fewest bytes in
   flight (``block_size * queue_depth``) is taken, since it pins the least memory and one
   pass per pair is noisy. No trial fitted the budget -> the defaults, not cached (a later
   call with a larger budget probes again).

Cache: ``$OFFLOAD_ZERO_CACHE`` (a file path; an existing directory gets ``aio_tuning.json``
inside it), else ``$XDG_CACHE_HOME/offload-zero/aio_tuning.json``, else
``~/.cache/offload-zero/aio_tuning.json``. Layout::

    {"version": 1, "devices": {"<st_dev>": {"<requested backend>": {"block_size": ...,
     "queue_depth": ..., "backend": ..., "measured": {...}, "path": ..., "time": ...}}}}

It is rewritten atomically (temp file in the same folder, then ``os.replace``) under an
``flock`` on ``<cache>.lock``, which also makes concurrent processes (ranks of one node) wait
for the first one's probe instead of probing all at once. A file that does not parse or has
another layout is ignored and replaced. Delete it to re-probe (e.g. after swapping a drive
that kept the same device number).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from typing import Optional

import torch

from offload_zero.memory.aligned import ALIGNMENT, aligned_empty

__all__ = ["tuned_settings", "probe", "cache_path", "measured_rates", "DEFAULT_BLOCK_SIZE",
           "DEFAULT_QUEUE_DEPTH", "BLOCK_SIZES", "QUEUE_DEPTHS"]

DEFAULT_BLOCK_SIZE = 1 << 20
"""Bytes per request when nothing better is known (the swapper's default)."""
DEFAULT_QUEUE_DEPTH = 8
"""Requests in flight when nothing better is known (the swapper's default)."""
BLOCK_SIZES = (256 << 10, 1 << 20, 4 << 20)
"""Bytes per request tried by the probe."""
QUEUE_DEPTHS = (4, 8, 32)
"""Queue depths tried by the probe."""
CALIBRATION_BYTES = 8 << 20
"""Bytes written and read once with the defaults to size the trials."""
MIN_TRIAL_BYTES = 4 << 20
"""Smallest trial file, bytes (a multiple of the largest block size)."""
MAX_TRIAL_BYTES = 128 << 20
"""Largest trial file, bytes (also the probe's host buffer)."""
TRIAL_SHARE = 0.6
"""Fraction of the budget left after calibration that the trials are sized to fill."""
TIE_FRACTION = 0.03
"""Scores within this fraction of the best are treated as equal."""
CACHE_VERSION = 1

_LOCK_SUFFIX = ".lock"


def cache_path() -> str:
    """Path of the tuning cache file (see [Note: aio self-tuning]); it may not exist yet."""
    env = os.environ.get("OFFLOAD_ZERO_CACHE")
    if env:
        env = os.path.expanduser(env)
        return os.path.join(env, "aio_tuning.json") if os.path.isdir(env) else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offload-zero", "aio_tuning.json")


def tuned_settings(path: str, backend: str = "auto", budget_s: float = 2.0) -> dict:
    """Block size and queue depth for swap files under ``path``, probed once per device.

    Args:
        path: an existing directory on the device to tune for (the swap folder). The probe
            writes at most ``MAX_TRIAL_BYTES`` (128 MiB) in a temporary sub-folder of it and
            removes it again.
        backend: "auto", "libaio" or "threads", as for ``Swapper``; cached apart.
        budget_s: most wall-clock seconds the probe may take (> 0); a cache hit costs
            only reading the cache file.
    Returns:
        dict with ``block_size`` (bytes, a multiple of 4096), ``queue_depth`` (>= 1),
        ``source`` ("probe": measured now, "cache": measured earlier for this device,
        "default": the probe could not run or the filesystem refuses O_DIRECT; then 1 MiB and
        8), ``measured`` (the probe's trials and timings, or why there are none), ``device``
        (``st_dev``), ``backend`` (the backend the probe ran, "" when it did not).
    Raises:
        ValueError: ``path`` is not an existing directory, unknown ``backend``, bad
            ``budget_s``. A failing probe does not raise: it warns and gives the defaults.
    """
    from offload_zero.memory.swapper import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"unknown swap backend {backend!r}; choose one of {BACKENDS}")
    if (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float))
            or not math.isfinite(budget_s) or budget_s <= 0):
        raise ValueError(f"budget_s must be a finite number of seconds > 0, got {budget_s!r}")
    folder = os.path.abspath(os.fspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot tune swap I/O for {folder!r}: not an existing directory")
    device = os.stat(folder).st_dev
    cache_file = cache_path()
    with _cache_lock(cache_file):
        entry = _load_cache(cache_file)["devices"].get(str(device), {}).get(backend)
        if _valid_entry(entry):
            return _result(entry, "cache", device)
        settings = _probe_or_defaults(folder, backend, budget_s)
        if settings is None:
            return _result(_default_entry("probe failed"), "default", device)
        settings.update(path=folder, time=time.time())
        if settings["measured"]["trials"] or not settings["measured"]["direct"]:
            _store_entry(cache_file, device, backend, settings)  # not a too-small budget
    source = "probe" if settings["measured"].get("trials") else "default"
    return _result(settings, source, device)


def probe(folder: str, backend: str = "auto", budget_s: float = 2.0) -> dict:
    """Measure and pick (block_size, queue_depth) under ``folder`` (no cache involved).

    See [Note: aio self-tuning]. Args as for :func:`tuned_settings`.
    Returns:
        dict with ``block_size``, ``queue_depth``, ``backend`` and ``measured``: ``trials``
        (one dict per pair run: ``block_size``, ``queue_depth``, ``write_gbps``, ``read_gbps``,
        ``gbps`` = both directions, GB/s = 1e9 bytes/s), ``trial_bytes``, ``calibration_gbps``,
        ``direct`` (O_DIRECT worked), ``probe_s`` and, when no trial ran, ``reason``.
    Raises:
        OSError (SwapIOError included), ValueError: the swapper could not run in ``folder``.
    """
    start = time.perf_counter()
    deadline = start + budget_s
    root = tempfile.mkdtemp(prefix=".oz-tune-", dir=folder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the real swapper warns itself
            calibration = _trial(root, backend, DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH,
                                 _filled_buffer(CALIBRATION_BYTES))
        backend_used = calibration.pop("backend")
        direct = calibration.pop("direct")
        measured = dict(calibration_gbps=calibration["gbps"], direct=direct, trials=[],
                        trial_bytes=0)
        if not direct:
            measured["reason"] = "the filesystem refuses O_DIRECT; the page cache is not measured"
        else:
            measured.update(_run_trials(root, backend_used, calibration["gbps"], deadline))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    measured["probe_s"] = time.perf_counter() - start
    block_size, queue_depth = _pick(measured["trials"])
    return dict(block_size=block_size, queue_depth=queue_depth, backend=backend_used,
                measured=measured)


def measured_rates(settings: dict) -> Optional[tuple]:
    """``(read, write)`` bytes per second the probe measured for the pair ``settings`` chose
    (its own ``block_size`` and ``queue_depth``: the requests the swapper will send), from a
    :func:`tuned_settings` result (fresh or cached); ``None`` when no trial of that pair ran
    (the filesystem refuses O_DIRECT, the budget was too small, the probe failed). Used by
    ``offload="auto"``'s step-time model (:mod:`offload_zero.step_time`)."""
    trials = settings.get("measured", {}).get("trials") or []
    pair = (settings.get("block_size"), settings.get("queue_depth"))
    for t in trials:
        if (t.get("block_size"), t.get("queue_depth")) == pair:
            read, write = t.get("read_gbps"), t.get("write_gbps")
            if isinstance(read, (int, float)) and isinstance(write, (int, float)) \
                    and read > 0 and write > 0:
                return read * 1e9, write * 1e9
    return None


# ---- the probe ------------------------------------------------------------------------------

def _candidates() -> list:
    """Every (block_size, queue_depth) pair: the defaults first, then the pairs that change one
    of the two, then those that change both (so a short budget still tries both axes)."""
    pairs = [(b, q) for b in BLOCK_SIZES for q in QUEUE_DEPTHS]
    pairs.append((DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH))  # in case the grid lacks it
    changed = {p: (p[0] != DEFAULT_BLOCK_SIZE) + (p[1] != DEFAULT_QUEUE_DEPTH) for p in pairs}
    return sorted(changed, key=changed.get)  # dicts keep the grid order among equals


def _run_trials(root: str, backend: str, calibration_gbps: float, deadline: float) -> dict:
    """Step 2 and 3 of [Note: aio self-tuning]. Returns ``trials``, ``trial_bytes``, maybe
    ``reason``."""
    pairs = _candidates()
    unit = max(BLOCK_SIZES)
    rate = calibration_gbps * 1e9  # bytes per second, both directions
    left_s = deadline - time.perf_counter()
    trial_bytes = int(rate * max(left_s, 0.0) * TRIAL_SHARE / (2 * len(pairs))) // unit * unit
    trial_bytes = min(max(trial_bytes, MIN_TRIAL_BYTES), MAX_TRIAL_BYTES)
    buffer = _filled_buffer(trial_bytes)
    trials = []
    for block_size, queue_depth in pairs:
        if time.perf_counter() + 2 * trial_bytes / rate > deadline:
            break
        trial = _trial(root, backend, block_size, queue_depth, buffer)
        del trial["backend"], trial["direct"]
        trials.append(trial)
        rate = min(rate, trial["gbps"] * 1e9)
    out = dict(trials=trials, trial_bytes=trial_bytes)
    if not trials:
        out["reason"] = f"no trial of {trial_bytes} bytes fits the budget"
    return out


def _trial(root: str, backend: str, block_size: int, queue_depth: int,
           buffer: torch.Tensor) -> dict:
    """Write then read ``buffer`` once through a fresh swapper; GB/s per direction and both."""
    from offload_zero.memory.swapper import Swapper

    nbytes = buffer.numel()
    folder = os.path.join(root, f"b{block_size}-q{queue_depth}")
    with Swapper(folder, backend=backend, block_size=block_size, queue_depth=queue_depth) as sw:
        sw.allocate("probe", nbytes)
        start = time.perf_counter()
        sw.swap_out("probe", buffer).wait()
        middle = time.perf_counter()
        sw.swap_in("probe", buffer).wait()
        end = time.perf_counter()
        backend_used, direct = sw.backend, sw.direct
    return dict(block_size=block_size, queue_depth=queue_depth,
                write_gbps=nbytes / (middle - start) / 1e9, read_gbps=nbytes / (end - middle) / 1e9,
                gbps=2 * nbytes / (end - start) / 1e9, backend=backend_used, direct=direct)


def _filled_buffer(nbytes: int) -> torch.Tensor:
    """An aligned uint8 buffer of ``nbytes`` (a multiple of 1 MiB): one MiB of seeded random
    bytes repeated, so storage that compresses sees incompressible data, at memcpy cost."""
    chunk = 1 << 20
    buffer = aligned_empty(nbytes, torch.uint8)
    pattern = torch.randint(0, 256, (chunk,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0))
    buffer.view(-1, chunk).copy_(pattern.expand(nbytes // chunk, chunk))
    return buffer


def _pick(trials: list) -> tuple:
    """Step 4 of [Note: aio self-tuning]: the chosen (block_size, queue_depth)."""
    if not trials:
        return DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH
    best = max(t["gbps"] for t in trials)
    tied = [t for t in trials if t["gbps"] >= best * (1 - TIE_FRACTION)]
    chosen = min(tied, key=lambda t: (t["block_size"] * t["queue_depth"], t["queue_depth"]))
    return chosen["block_size"], chosen["queue_depth"]


def _probe_or_defaults(folder: str, backend: str, budget_s: float) -> Optional[dict]:
    """``probe``, or None after a warning when the swapper cannot run there."""
    try:
        return probe(folder, backend, budget_s)
    except (OSError, ValueError) as exc:
        warnings.warn(
            f"offload_zero aio tuning: the probe under {folder!r} failed ({exc}); using "
            f"block_size={DEFAULT_BLOCK_SIZE} bytes, queue_depth={DEFAULT_QUEUE_DEPTH}",
            RuntimeWarning, stacklevel=4)
        return None


def _default_entry(reason: str) -> dict:
    return dict(block_size=DEFAULT_BLOCK_SIZE, queue_depth=DEFAULT_QUEUE_DEPTH, backend="",
                measured=dict(trials=[], direct=False, reason=reason))


def _result(entry: dict, source: str, device: int) -> dict:
    return dict(block_size=entry["block_size"], queue_depth=entry["queue_depth"], source=source,
                measured=entry["measured"], device=device, backend=entry.get("backend", ""))


# ---- the cache ------------------------------------------------------------------------------

def _valid_entry(entry) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("measured"), dict):
        return False
    block_size, queue_depth = entry.get("block_size"), entry.get("queue_depth")
    return (type(block_size) is int and block_size > 0 and block_size % ALIGNMENT == 0
            and type(queue_depth) is int and queue_depth >= 1)


def _load_cache(cache_file: str) -> dict:
    """The cache's content; an empty one when missing, unreadable or of another layout."""
    empty = dict(version=CACHE_VERSION, devices={})
    try:
        with open(cache_file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return empty
    if (not isinstance(data, dict) or data.get("version") != CACHE_VERSION
            or not isinstance(data.get("devices"), dict)
            or not all(isinstance(v, dict) for v in data["devices"].values())):
        return empty
    return data


def _store_entry(cache_file: str, device: int, backend: str, entry: dict) -> None:
    """Add ``entry`` to the cache file, atomically; warn (do not raise) when it cannot."""
    data = _load_cache(cache_file)
    data["devices"].setdefault(str(device), {})[backend] = entry
    folder = os.path.dirname(cache_file) or "."
    tmp_path = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp_path = tempfile.mkstemp(prefix=".aio_tuning-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, cache_file)
    except OSError as exc:
        if tmp_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)
        warnings.warn(f"offload_zero aio tuning: cannot write the cache {cache_file!r} "
                      f"({exc}); the next process will probe again", RuntimeWarning,
                      stacklevel=4)


@contextlib.contextmanager
def _cache_lock(cache_file: str):
    """Hold an exclusive ``flock`` on ``<cache_file>.lock`` (best effort: without one when the
    folder cannot be created or the platform has no ``fcntl``)."""
    try:
        import fcntl
        os.makedirs(os.path.dirname(cache_file) or ".", exist_ok=True)
        fd = os.open(cache_file + _LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
