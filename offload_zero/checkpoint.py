"""Resumable training checkpoints: every rank saves and loads its own shard of the training state.

:func:`save_checkpoint` and :func:`load_checkpoint` are the engine's
:meth:`~offload_zero.engine.OffloadEngine.save_checkpoint` and
:meth:`~offload_zero.engine.OffloadEngine.load_checkpoint`. Both are collective (every rank of
the data-parallel group calls them with the same folder) and run between steps.

[Note: checkpoint layout]
A checkpoint is a folder::

    folder/
      checkpoint.json          metadata, written last: its presence marks a complete checkpoint
      rank00000.safetensors    rank 0's shards
      rank00001.safetensors    rank 1's shards, ... (one file per rank)

``checkpoint.json`` holds ``format``, ``format_version``, ``world_size``, ``stage``, ``dtype``
(the compute dtype, e.g. ``"bfloat16"``), ``flat_params`` (per flat parameter, in the engine's
order: ``name``, ``requires_grad``, ``numel``, ``shard_numel`` and ``parameters``, the
``[names, shape]`` of each model parameter inside it, and for a trainable one ``groups``, the
parameter group of each), ``lr`` (the first group's), ``param_groups`` (each group of
``engine.optimizer`` without its ``params``: ``lr``, ``betas``, ``eps``, ``weight_decay`` and
what a scheduler added, such as ``initial_lr``), ``skipped_steps``,
``loss_scaler`` (the scaler's ``state_dict()``, or null), ``optimizer`` (betas, eps,
weight_decay, adamw: for reading only; the loading engine keeps its own), ``files``,
``client_state`` (the caller's own JSON-ready dict, e.g. its step counter and data position)
and ``save_id`` (16 hex digits, random per save; every rank file's metadata holds the same, so
files of two saves are never loaded together).

A rank file is a plain safetensors file (any safetensors reader opens it). For each flat
parameter ``<fp>`` (its name, e.g. ``unit3.trainable``) it holds this rank's shard:

- ``<fp>/master``, ``<fp>/exp_avg``, ``<fp>/exp_avg_sq``: shape (shard_numel,), for a
  trainable flat parameter: the fp32 master weights and Adam's two moments (float32, or
  bfloat16 with ``moment_dtype="bf16"``: ``checkpoint.json``'s ``moment_dtype``, float32 when
  absent; loading into an engine with the other moment dtype converts them, bf16 -> fp32
  exactly, fp32 -> bf16 rounding to nearest even; int8 moments are saved decoded, as float32,
  and encode back to the same codes and scales on loading);
- ``<fp>/step``: int64, shape (), its Adam step count (trainable only);
- ``<fp>/param``: the compute dtype, shape (shard_numel,): the parameter shard, for a frozen flat
  parameter and for every flat parameter when the compute dtype is not float32 (an fp32
  trainable shard is its master weights, bit for bit, and is restored from them).
- ``buffers/<name>``: each persistent buffer of the model (BatchNorm's running statistics,
  say), whole, in its own dtype and shape; the same in every rank's file. ``checkpoint.json``'s
  ``buffers`` lists their names.

Rank r of N holds elements ``[r * shard_numel, (r + 1) * shard_numel)`` of each flat parameter
(the last shard padded with zeros), so the files of N ranks also make up the state for any other
world size: loading on M ranks reads, for each rank, the slices of the saved shards that overlap
its own (resharding; see :func:`_load_shards`). Each parameter's place in its flat parameter is
in ``parameters``, so an engine that groups the parameters into flat parameters otherwise (one
built with other ``unit_classes``, say) loads them too, parameter by parameter.

Its safetensors metadata (strings) names the ``rank`` and ``world_size`` it was written by and
the ``save_id``, and gives a CRC-32 of each tensor's bytes (``crc32/<tensor name>``, 8 hex digits), checked on load.
The file is written as a stream, one flat parameter at a time, so saving never holds more than
one flat parameter's state in host memory (12 bytes per element of its shard, plus the shard):
the state of an NVMe-offloaded model need not fit in RAM.

[Note: atomic save]
A save never changes ``folder`` until the new checkpoint is complete. Every rank writes (and
fsyncs) its file into the sibling folder ``.<folder name>.saving``; all ranks agree that every
write succeeded; rank 0 then writes ``checkpoint.json`` into it and swaps it with ``folder``
(one atomic exchange of the two names where Linux's ``renameat2(RENAME_EXCHANGE)`` is
supported, else ``folder`` -> ``.<folder name>.replaced`` and the new folder -> ``folder``), and
removes the previous checkpoint; the ranks agree once more before returning. Rank 0 holds an
exclusive ``flock`` on the folder's parent meanwhile, and each loading rank a shared one while
it reads: a second job saving to the same folder waits instead of writing into the same
temporary folder, and a load waits for a save to end (see :func:`_folder_lock`). If any rank fails,
every rank raises, the temporary folder is removed and ``folder`` is as it was. A process
killed mid-save leaves ``.<folder name>.saving`` behind; the next save removes it.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import itertools
import json
import logging
import math
import os
import re
import secrets
import shutil
import struct
import zlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from offload_zero.lockstep import mark_agreed
from offload_zero.optim.facade import json_group

log = logging.getLogger("offload_zero")

FORMAT_NAME = "offload-zero-checkpoint"
FORMAT_VERSION = 1
META_NAME = "checkpoint.json"
_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
_RANK_FILE_RE = re.compile(r"rank\d{5,}\.safetensors")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64"}
_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}  # checkpoint.json's "dtype" -> torch dtype

TensorSpec = Tuple[str, torch.dtype, Tuple[int, ...]]


def rank_file_name(rank: int) -> str:
    """File name of ``rank``'s shard in a checkpoint folder: ``rank00000.safetensors``."""
    return f"rank{rank:05d}.safetensors"


# -- public entry points --------------------------------------------------------------------------

def save_checkpoint(engine, folder, client_state: Optional[dict] = None) -> None:
    """Save ``engine``'s training state into ``folder``, atomically (see [Note: atomic save]).

    Collective: every rank calls it with the same ``folder``, on a file system all ranks see.
    Layout: [Note: checkpoint layout]. ``folder`` is created if missing; a previous checkpoint
    there is replaced only once the new one is complete. ``client_state``: a dict of the
    caller's own (JSON-serialisable: numbers, strings, lists, dicts), kept in
    ``checkpoint.json`` and returned by :func:`load_checkpoint` on every rank. It is saved
    from rank 0 only: the other ranks' ``client_state`` is ignored, so a per-rank value (each
    rank's data position, say) must reach rank 0 first (e.g. ``all_gather_object``).

    Raises:
        RuntimeError: gradients of a ``backward()`` are waiting for ``step()``, or the engine
            is closed; on every rank, if another rank failed to write its file.
        ValueError: ``folder`` exists and is not a checkpoint folder (a file, or a folder
            holding other files: it is never replaced); the loss scaler's state or
            ``client_state`` is not JSON-serialisable (or ``client_state`` not a dict).
        OSError: this rank could not write (e.g. ENOSPC); ``folder`` is unchanged.
    """
    _prepare(engine, "save_checkpoint")
    final = _paths(folder)[0]
    # rank 0 writes the folder: another job's save or load of a checkpoint beside it waits
    with _folder_lock(final, exclusive=True, take=engine.rank == 0):
        _save(engine, folder, client_state)


def _save(engine, folder, client_state: Optional[dict]) -> None:
    """:func:`save_checkpoint` once the folder is locked."""
    final, tmp, old = _paths(folder)
    error, meta = None, None
    try:  # (a rank that sees another folder there must not leave the others waiting)
        _check_replaceable(final)
        meta = _metadata(engine, client_state)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"save_checkpoint({final!r})", exc_type=ValueError)
    is_root = engine.rank == 0
    if is_root:
        try:
            _fresh_folder(tmp)
        except Exception as exc:  # every rank must hear of it: they wait for this one
            error = exc
    _agree(engine, error, f"save_checkpoint({final!r}): creating {tmp!r}")
    # one id for this save, in checkpoint.json and every rank file: files of two saves never mix
    meta["save_id"] = save_id = _shared_save_id(engine)
    meta_text = json.dumps(meta, indent=1)
    try:
        _write_rank_file(engine, os.path.join(tmp, rank_file_name(engine.rank)), save_id)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"save_checkpoint({final!r})",
           on_failure=(lambda: shutil.rmtree(tmp, ignore_errors=True)) if is_root else None)
    if is_root:
        try:
            _write_text(os.path.join(tmp, META_NAME), meta_text)
            _fsync_folder(tmp)
            _swap_in(tmp, final, old)
        except Exception as exc:
            error = exc
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(engine, error, f"save_checkpoint({final!r})")


def load_checkpoint(engine, folder) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into ``engine``; returns the
    ``client_state`` saved with it (``{}`` if none).

    Collective. Restores every flat parameter's fp32 master weights, Adam moments and step
    count, the compute-dtype parameter shards (the saved ones, bit for bit, or derived from the
    fp32 master weights when the saving engine's compute dtype was another; at stages 1 and 2
    all-gathered into the full parameters), the values of ``engine.optimizer``'s parameter
    groups (every key but ``params``; a checkpoint without groups: ``engine.lr``),
    ``engine.skipped_steps`` and the loss scaler's state. The parameter groups must be the
    saving engine's: as many, each parameter in the same one (ValueError naming the first
    parameter that differs). The tiers may differ from the saving engine's (saved with
    ``offload="nvme"``, loaded with ``offload="cpu"``, say), and so may the world size and the
    ZeRO stage: a checkpoint of N ranks loads on M ranks, each rank reading the slices of the
    saved shards that make up its own (see :func:`_load_shards`). So may the grouping of the
    parameters into flat parameters (``unit_classes`` cuts units otherwise, say), as long as
    the parameters of one flat parameter here share one Adam step count there. So may the
    compute dtype (the master weights are fp32 in every one; a frozen parameter's shard is
    the saved one cast; a loss scaler on one side only is not restored, with a warning); the
    model's parameters (names, shapes, ``requires_grad``) may not change.

    Every rank first checks its whole file (structure, dtypes, shapes, CRC-32 of every tensor;
    when resharding, every saved file it reads from) and the ranks agree before anything in the engine changes, so a bad checkpoint leaves the
    engine as it was; each file is therefore read twice. An I/O error after that point (a
    failing NVMe write) leaves the engine partly loaded.

    Raises:
        ValueError: the metadata does not match this engine (a parameter missing
            on either side or with another shape or ``requires_grad``, a flat parameter's
            ``shard_numel`` too small for its ``numel``, ``loss_scaler`` present in one only
            at the same compute dtype, an unknown ``dtype``,
            parameters of one flat parameter here with different step counts there): the
            message names the field, the saved value and this engine's; ``folder`` or
            ``checkpoint.json`` missing or unreadable; a rank file missing, truncated,
            corrupt (checksum) or written by another rank (the message names the file; on
            every rank).
        RuntimeError: gradients of a ``backward()`` are waiting for ``step()``, or the engine
            is closed.
    """
    _prepare(engine, "load_checkpoint")
    final = _paths(folder)[0]
    with _folder_lock(final, exclusive=False, take=True):
        return _load(engine, final)


def _load(engine, final: str) -> dict:
    """:func:`load_checkpoint` once the folder is locked (shared)."""
    error = None
    try:  # every rank checks, then all agree: one that cannot read the folder stops them all
        meta = _read_metadata(final)
        _check_matches(meta, engine, os.path.join(final, META_NAME))
        saved_world = meta["world_size"]
        segments = _segments(meta, engine)
        sources = _source_ranks(segments, engine)
        specs = _saved_specs(meta, engine)
        # every saved file is checked by some rank, also one this rank does not read (a rank
        # whose shards are padding only): a checkpoint with a file missing or damaged is refused
        mine = sorted(set(sources) | set(range(engine.rank, saved_world, engine.world_size)))
        for rank in mine:
            _verify_rank_file(os.path.join(final, rank_file_name(rank)), specs, rank,
                              saved_world, meta.get("save_id"))
        from safetensors import safe_open
        with safe_open(os.path.join(final, rank_file_name(sources[0])), framework="pt") as f:
            steps = _saved_steps(f, segments, os.path.join(final, META_NAME))
    except Exception as exc:
        error = exc
    _agree(engine, error, f"load_checkpoint({final!r})", exc_type=ValueError)
    try:
        with torch.no_grad():
            _load_shards(final, engine, segments, sources, steps,
                         _COMPUTE_DTYPES[meta["dtype"]])
        _restore_groups(engine, meta)
        engine.skipped_steps = meta["skipped_steps"]
        if meta["loss_scaler"] is not None and _scaler(engine) is not None:
            engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    except Exception as exc:
        error = exc
    _agree(engine, error, f"load_checkpoint({final!r})")
    with torch.no_grad():
        for fp in engine.flat_params:
            if fp.keep_unsharded:  # stages 1 and 2: every rank's new shard into the full values
                engine.comm.all_gather_into(fp.full_values(), fp.sharded, what=fp.name)
    return meta.get("client_state") or {}


def read_metadata(folder) -> dict:
    """The ``checkpoint.json`` of the checkpoint in ``folder`` (a symbolic link stands for its
    target), as a dict (see [Note: checkpoint layout]); reads no rank file. Raises ValueError
    naming the path if ``folder`` is missing or not a folder (with a hint when a save was
    interrupted between its renames), or holds no complete checkpoint metadata."""
    return _read_metadata(_paths(folder)[0])


def check_destination(folder) -> None:
    """Check, writing nothing, that :func:`save_checkpoint` could save into ``folder``: it is
    absent, empty or a checkpoint folder, and its parent exists (or can be created) and is
    writable. Raises ValueError naming the path otherwise."""
    final = _paths(folder)[0]
    _check_replaceable(final)
    check_creatable(os.path.dirname(final), f"checkpoint folder {final!r}")


def check_creatable(path, what: str) -> None:
    """Check, creating nothing, that the folder ``path`` exists or ``os.makedirs`` could make
    it: its nearest existing ancestor is a folder this process can write to. Raises ValueError
    ``"<what> cannot be created: <ancestor> is not a folder"`` (or ``"... not writable"``)."""
    ancestor = os.path.abspath(os.fspath(path))
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{what} cannot be created: {ancestor!r} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{what} cannot be created: {ancestor!r} is not writable")


# -- preconditions and agreement between ranks ----------------------------------------------------

@contextlib.contextmanager
def _folder_lock(final: str, exclusive: bool, take: bool):
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


def _prepare(engine, what: str) -> None:
    """Check that ``engine`` is open and between steps; finish updates still streaming and free
    gathered units, so the shards hold the state of a completed step."""
    engine._check_open()
    if engine._backward_pending:
        raise RuntimeError(
            f"[rank {engine.rank}] {what} must run between steps, but gradients of a backward() "
            "are waiting for step(): call step() (or zero_grad() to drop them) first")
    engine._finish_updates()
    engine.scheduler.reshard_all()


def _agree(engine, error: Optional[BaseException], what: str, exc_type=RuntimeError,
           on_failure=None) -> None:
    """Collective: wait for every rank (a barrier) and raise on every rank if any failed.

    A rank that failed raises its own ``error``; the others raise ``exc_type`` naming the
    failed ranks. ``on_failure`` (cleanup) runs first wherever it is given, and every rank
    waits for it before raising."""
    failed = _failed_ranks(engine, error is not None)
    if not failed:
        return
    if on_failure is not None:
        on_failure()
    first = _first_error(engine, failed, error)  # (a barrier too: the cleanup is done)
    if error is None:
        error = exc_type(f"[rank {engine.rank}] {what} failed on rank(s) {failed}: "
                         f"rank {failed[0]}: {first}")
    raise mark_agreed(error)  # (every rank raises it: no failure record, see [Note: lockstep])


def _first_error(engine, failed: List[int], error: Optional[BaseException]) -> str:
    """Collective: the message of the lowest failed rank's error, on every rank."""
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    if engine.comm.world_size == 1:
        return text
    return engine.comm.all_gather_object(text, what="checkpoint errors")[failed[0]]


def _shared_save_id(engine) -> str:
    """Collective: rank 0's random 62-bit id for this save, as 16 hex digits, on every rank."""
    value = secrets.randbits(62) if engine.rank == 0 else 0
    if engine.comm.world_size > 1:
        t = torch.tensor([value], dtype=torch.int64, device=engine.device)
        engine.comm.all_reduce_sum(t, what="checkpoint id", count=False)  # only rank 0 adds
        value = int(t.item())
    return f"{value:016x}"


def _failed_ranks(engine, failed: bool) -> List[int]:
    """Collective: the ranks that report ``failed`` (a barrier too; one int32 per rank)."""
    comm = engine.comm
    if comm.world_size == 1:
        return [0] if failed else []
    flags = torch.zeros(comm.world_size, dtype=torch.int32, device=engine.device)
    flags[comm.rank] = int(failed)
    comm.all_reduce_sum(flags, what="checkpoint flags", count=False)  # not training traffic
    return [r for r, f in enumerate(flags.tolist()) if f]


# -- metadata -------------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _layout(engine) -> dict:
    """What a checkpoint must share with the engine that loads it (JSON-ready)."""
    return {
        "world_size": engine.world_size,
        "stage": engine.config.stage,
        "dtype": _dtype_name(engine.config.dtype),
        "moment_dtype": _dtype_name(engine.store.fmt.exchange_dtype),  # (int8: fp32 values)
        "flat_params": [{"name": fp.name, "requires_grad": fp.requires_grad, "numel": fp.numel,
                         "shard_numel": fp.shard_numel,
                         "parameters": [[e.names, list(e.shape)] for e in fp.entries],
                         **({"groups": engine._entry_groups[fp]} if fp.requires_grad else {})}
                        for fp in engine.flat_params],
        "buffers": [name for name, _, _ in _persistent_buffers(engine.module)],
    }


def _persistent_buffers(module) -> List[Tuple[str, object, str]]:
    """``(name, owning module, attribute)`` of every persistent buffer of ``module`` (what its
    ``state_dict`` holds: BatchNorm's running statistics, say), each once, in
    ``named_modules`` order. They are not sharded: every rank holds the same."""
    out, seen = [], set()
    for prefix, mod in module.named_modules():
        for attr, buf in mod._buffers.items():
            if buf is None or attr in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{prefix}.{attr}" if prefix else attr, mod, attr))
    return out


def _scaler(engine):
    return getattr(engine, "loss_scaler", None)


def _metadata(engine, client_state: Optional[dict] = None) -> dict:
    cfg = engine.config
    if client_state is not None and not isinstance(client_state, dict):
        raise ValueError(f"client_state must be a dict (or None), got {type(client_state).__name__}")
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"client_state must hold only numbers, strings, lists and dicts to "
                         f"be saved: {exc}") from None
    scaler = _scaler(engine)
    scaler_state = None if scaler is None else dict(scaler.state_dict())
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **_layout(engine),
            "lr": engine.lr, "param_groups": [json_group(g) for g in engine.optimizer.param_groups],
            "skipped_steps": engine.skipped_steps, "loss_scaler": scaler_state,
            "optimizer": {"betas": list(cfg.betas), "eps": cfg.eps,
                          "weight_decay": cfg.weight_decay, "adamw": cfg.adamw},
            "files": [rank_file_name(r) for r in range(engine.world_size)],
            "client_state": client_state or {}}
    try:
        json.dumps(scaler_state)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"loss_scaler.state_dict() must hold only numbers, strings, lists and "
                         f"dicts to be saved, got {scaler_state!r}: {exc}") from None
    return meta


def _read_metadata(folder: str) -> dict:
    """``folder``'s ``checkpoint.json``; ValueError if the folder or file is missing or bad."""
    path = os.path.join(folder, META_NAME)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"checkpoint folder {folder!r} is not a folder (a checkpoint is a "
                         f"folder holding {META_NAME} and one file per rank)")
    if not os.path.isdir(folder):
        replaced = _paths(folder)[2]
        hint = (f"; a save was interrupted between its two renames: the previous checkpoint is "
                f"{replaced!r}" if os.path.isdir(replaced) else "")
        raise ValueError(f"checkpoint folder {folder!r} does not exist{hint}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path!r} is missing: {folder!r} is not a complete offload-zero "
                         "checkpoint") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path!r} cannot be read: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{path!r} is not offload-zero checkpoint metadata")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path!r}: format_version is {meta.get('format_version')!r} in the "
                         f"checkpoint but this offload-zero reads version {FORMAT_VERSION}")
    lr, skipped = meta.get("lr"), meta.get("skipped_steps")
    if (not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr >= 0
            or not isinstance(skipped, int) or skipped < 0
            or not isinstance(meta.get("loss_scaler"), (dict, type(None)))):
        raise ValueError(f"{path!r}: lr={lr!r}, skipped_steps={skipped!r} or loss_scaler="
                         f"{meta.get('loss_scaler')!r} is not valid")
    fps = meta.get("flat_params")
    if not isinstance(fps, list) or not all(isinstance(f, dict) for f in fps):
        raise ValueError(f"{path!r}: flat_params must be a list of objects (one per flat "
                         f"parameter), got {str(fps)[:80]}")
    if not isinstance(meta.get("client_state"), (dict, type(None))):
        raise ValueError(f"{path!r}: client_state must be an object (or null), got "
                         f"{str(meta.get('client_state'))[:80]}")
    if not isinstance(meta.get("buffers", []), list):
        raise ValueError(f"{path!r}: buffers must be a list of names, got {meta['buffers']!r}")
    return meta


def _mismatch(path: str, field: str, saved, mine) -> ValueError:
    return ValueError(f"{path!r}: {field} is {saved!r} in the checkpoint but {mine!r} in this "
                      "engine")


def _check_matches(meta: dict, engine, path: str) -> None:
    """Raise ValueError naming the first field of ``meta`` that does not fit ``engine``."""
    mine = _layout(engine)
    if meta.get("dtype") not in _COMPUTE_DTYPES:
        raise ValueError(f"{path!r}: dtype is {meta.get('dtype')!r}; a checkpoint's is one of "
                         f"{sorted(_COMPUTE_DTYPES)}")
    world = meta.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"{path!r}: world_size is {world!r}; a checkpoint's is a positive "
                         "integer")
    same_world = world == mine["world_size"]
    saved_fps = meta.get("flat_params")
    if not isinstance(saved_fps, list) or not saved_fps:
        raise ValueError(f"{path!r}: flat_params is {saved_fps!r}; a checkpoint lists its flat "
                         "parameters")
    for saved in saved_fps:
        shard, numel = saved.get("shard_numel"), saved.get("numel")
        if not (isinstance(shard, int) and isinstance(numel, int) and shard * world >= numel >= 0):
            raise ValueError(f"{path!r}: flat parameter {saved.get('name')!r} shard_numel is "
                             f"{shard!r}: {world} shards of it cannot hold its {numel!r} "
                             "elements")
    where = _saved_parameters(meta, path)
    count = len({saved[5] for saved in where.values()})
    params = [(e.names, list(e.shape), fp.requires_grad) for fp in engine.flat_params
            for e in fp.entries]
    found = set()
    for names, shape, trainable in params:
        saved = _match(where, names)
        if saved is None:
            raise ValueError(f"{path!r}: parameter {names[0]!r} of this engine is not in the "
                             f"checkpoint (it holds {count} parameters, this engine "
                             f"{len(params)})")
        found.add(saved[5])
        if saved[4] != shape:
            raise _mismatch(path, f"parameter {names[0]!r} shape", saved[4], shape)
        if saved_fps[saved[0]].get("requires_grad") != trainable:
            raise _mismatch(path, f"parameter {names[0]!r} requires_grad",
                            saved_fps[saved[0]].get("requires_grad"), trainable)
    _check_groups(meta, engine, path)
    extra = [saved[5] for saved in where.values() if saved[5] not in found]
    if extra:
        raise ValueError(f"{path!r}: parameter {extra[0]!r} of the checkpoint is not in this "
                         f"engine (it holds {count} parameters, this engine {len(params)})")
    if "buffers" in meta and meta["buffers"] != mine["buffers"]:
        raise _mismatch(path, "buffers (names)", meta["buffers"], mine["buffers"])
    if "buffers" not in meta and mine["buffers"]:
        log.warning("%s: saved without the model's buffers (an older checkpoint): %s keep their "
                    "current values", path, ", ".join(mine["buffers"][:5]))
    has_saved, has_mine = meta.get("loss_scaler") is not None, _scaler(engine) is not None
    if has_saved != has_mine and meta["dtype"] == mine["dtype"]:
        state = {True: "present", False: "absent"}
        raise _mismatch(path, "loss_scaler", state[has_saved], state[has_mine])
    if has_saved != has_mine:
        log.warning("%s: saved in %s with%s a loss scaler, loaded in %s with%s one: the loss "
                    "scale is not restored", path, meta["dtype"], "" if has_saved else "out",
                    mine["dtype"], "" if has_mine else "out")
    elif has_saved:  # a bad scaler state must fail here, before the engine changes
        try:
            copy.deepcopy(_scaler(engine)).load_state_dict(meta["loss_scaler"])
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path!r}: loss_scaler: {exc}") from None
    saved_opt = meta.get("optimizer") or {}
    cfg = engine.config
    if "param_groups" in meta:  # the groups' values are restored: only adamw stays this engine's
        mine_opt = {"adamw": cfg.adamw}
    else:
        mine_opt = {"betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
                    "adamw": cfg.adamw}
    changed = [f"{k} {saved_opt[k]!r} -> {v!r}" for k, v in mine_opt.items()
               if k in saved_opt and saved_opt[k] != v]
    if changed:
        log.warning("%s: the optimizer settings differ from the saved run's (%s); this engine's "
                    "are used", path, ", ".join(changed))


def _check_groups(meta: dict, engine, path: str) -> None:
    """Raise ValueError unless ``meta`` (a checkpoint's metadata) puts every trainable
    parameter in the parameter group ``engine`` puts it in (naming the first that differs) and
    holds valid values for as many groups. A checkpoint saved before parameter groups (no
    ``param_groups``) fits an engine of one group."""
    from offload_zero.optim.facade import check_group
    groups = meta.get("param_groups")
    mine = len(engine.optimizer.param_groups)
    if groups is None:
        if mine != 1:
            raise _mismatch(path, "the number of param_groups", 1, mine)
        return
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{path!r}: param_groups must be a list of objects, got {groups!r:.80}")
    if len(groups) != mine:
        raise _mismatch(path, "the number of param_groups", len(groups), mine)
    for i, group in enumerate(groups):
        try:
            check_group(i, group)
        except ValueError as exc:
            raise ValueError(f"{path!r}: {exc}") from None
    saved_group = {}
    for saved in meta["flat_params"]:
        for entry, group in zip(saved.get("parameters") or [], saved.get("groups") or []):
            for name in entry[0]:
                saved_group[name] = group
    for fp in engine.trainable:
        for e, group in zip(fp.entries, engine._entry_groups[fp]):
            theirs = next((saved_group[n] for n in e.names if n in saved_group), 0)
            if theirs != group:
                raise ValueError(f"{path!r}: parameter {e.names[0]!r} is in param_groups"
                                 f"[{theirs!r}] in the checkpoint but in param_groups[{group}] "
                                 "in this engine; load it into an engine with the same groups")


def _restore_groups(engine, meta: dict) -> None:
    """Set ``engine.optimizer``'s groups to the values ``meta`` saved (checked by
    :func:`_check_groups`; every key but ``params``), or, for a checkpoint without
    ``param_groups``, the saved ``lr``."""
    groups = meta.get("param_groups")
    if groups is None:
        engine.set_lr(meta["lr"])
        return
    for group, saved in zip(engine.optimizer.param_groups, groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if key == "betas" else value


def _saved_parameters(meta: dict, path: str = META_NAME) -> Dict[str, tuple]:
    """``{name: (saved flat parameter index, its name, its shard_numel, offset in it, shape,
    first name)}`` for every model parameter in ``meta``'s flat parameters, under each of its
    names (a tied parameter has several), offsets in elements, in layout order as
    :func:`offload_zero.partition.flat_param.build_entries` assigns them. Raises ValueError
    naming a malformed ``parameters`` entry."""
    out = {}
    for j, saved in enumerate(meta["flat_params"]):
        offset = 0
        for entry in saved.get("parameters") or []:
            ok = (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                  and entry[0] and all(isinstance(n, str) for n in entry[0])
                  and isinstance(entry[1], list)
                  and all(isinstance(d, int) and d >= 0 for d in entry[1]))
            if not ok:
                raise ValueError(f"{path!r}: flat parameter {saved.get('name')!r} has a "
                                 f"parameters entry {entry!r}; each is [[names], [shape]]")
            for name in entry[0]:
                out[name] = (j, saved["name"], saved["shard_numel"], offset, entry[1],
                             entry[0][0])
            offset += math.prod(entry[1])
        if offset > saved["numel"]:
            raise ValueError(f"{path!r}: flat parameter {saved.get('name')!r} lists parameters "
                             f"of {offset} elements in all, more than its numel "
                             f"{saved['numel']}")
    return out


def _match(where: Dict[str, tuple], names: List[str]) -> Optional[tuple]:
    """The saved parameter (from :func:`_saved_parameters`) known by any of ``names`` (one
    parameter's names here: a tied one may list them in another order), or None."""
    return next((where[name] for name in names if name in where), None)


def _segments(meta: dict, engine) -> Dict[object, List[tuple]]:
    """Where each of ``engine``'s flat parameters lies in the saved ones, parameter by
    parameter: ``{fp: [(offset in fp, numel, saved flat parameter name, its shard_numel,
    offset in it)]}`` (elements). The checkpoint may group the parameters differently (other
    ``unit_classes`` on one side, say); checked by
    :func:`_check_matches`."""
    where = _saved_parameters(meta)
    out = {}
    for fp in engine.flat_params:
        segs = []
        for e in fp.entries:
            _, name, shard, offset, _, _ = _match(where, e.names)
            segs.append((e.offset, e.numel, name, shard, offset))
        out[fp] = segs
    return out


def _pieces(segs: List[tuple], lo: int, hi: int) -> Iterator[tuple]:
    """The saved slices that make up elements ``[lo, hi)`` of a flat parameter whose
    ``segs`` are from :func:`_segments`: ``(saved rank, saved flat parameter name, [a, b) in
    that rank's shard, [c, d) in the range)``. Elements no parameter holds (padding) are in no
    piece."""
    for offset, n, name, shard, saved_offset in segs:
        a, b = max(lo, offset), min(hi, offset + n)
        if a >= b:
            continue
        sa, sb = saved_offset + a - offset, saved_offset + b - offset
        for r in range(sa // shard, (sb - 1) // shard + 1):
            x, y = max(sa, r * shard), min(sb, (r + 1) * shard)
            yield r, name, (x - r * shard, y - r * shard), (x - sa + a - lo, y - sa + a - lo)


def _saved_steps(f, segs: Dict[object, List[tuple]], path: str) -> Dict[object, int]:
    """Each trainable flat parameter's Adam step count, from the saved flat parameters its
    parameters come from (``segs``: :func:`_segments`), in the open rank file ``f`` (every
    file holds them all). Raises ValueError if they differ: one flat parameter has one step
    count."""
    steps = {}
    for fp, parts in segs.items():
        if not fp.requires_grad:
            continue
        found = {name: int(f.get_tensor(f"{name}/step")) for _, _, name, _, _ in parts}
        if len(set(found.values())) > 1:
            names = {}
            for e, (_, _, name, _, _) in zip(fp.entries, parts):
                names.setdefault(name, []).append(e.names[0])
            told = "; ".join(f"{', '.join(ps[:3])}{', ...' if len(ps) > 3 else ''}: "
                             f"{found[name]} steps" for name, ps in names.items())
            raise ValueError(f"{path!r}: parameters that this engine keeps in one flat "
                             f"parameter ({fp.name!r}) have different Adam step counts in the "
                             f"checkpoint ({told}; the saving engine skipped a step "
                             "for some only, as it does for a flat parameter without a "
                             "gradient, or step_in_backward for one with an overflow); load it "
                             "into an engine that groups them as the saving one did (the same "
                             "unit_classes)")
        steps[fp] = next(iter(found.values()), 0)
    return steps


# -- rank files -----------------------------------------------------------------------------------

def _saves_param(fp) -> bool:
    """Whether a rank file holds ``<fp>/param`` (see [Note: checkpoint layout])."""
    return _holds_param(fp.requires_grad, fp.dtype)


def _holds_param(requires_grad: bool, dtype: torch.dtype) -> bool:
    """Whether a flat parameter's entry in a rank file has a ``param`` tensor: frozen ones, and
    any whose compute dtype is not fp32 (an fp32 trainable shard is its master weights)."""
    return not requires_grad or dtype != torch.float32


def _flat_specs(flat: List[Tuple[str, bool, int]], dtype: torch.dtype,
                moment_dtype: torch.dtype = torch.float32) -> List[TensorSpec]:
    """``(name, dtype, shape)`` of the rank-file tensors of flat parameters ``flat`` (``(name,
    requires_grad, shard_numel)`` each, in file order) in compute dtype ``dtype``, the moments
    in ``moment_dtype``."""
    specs: List[TensorSpec] = []
    for name, requires_grad, n in flat:
        if requires_grad:
            specs += [(f"{name}/{key}", dt, (n,)) for key, dt in
                      zip(_STATE_KEYS, (torch.float32, moment_dtype, moment_dtype))]
            specs.append((f"{name}/step", torch.int64, ()))
        if _holds_param(requires_grad, dtype):
            specs.append((f"{name}/param", dtype, (n,)))
    return specs


def _buffer_specs(engine) -> List[TensorSpec]:
    """``(name, dtype, shape)`` of the persistent buffers in a rank file of ``engine``."""
    return [(f"buffers/{name}", mod._buffers[attr].dtype, tuple(mod._buffers[attr].shape))
            for name, mod, attr in _persistent_buffers(engine.module)]


def _tensor_specs(engine) -> List[TensorSpec]:
    """(name, dtype, shape) of every tensor in a rank file of ``engine``, in file order."""
    flat = [(fp.name, fp.requires_grad, fp.shard_numel) for fp in engine.flat_params]
    return _flat_specs(flat, engine.config.dtype, engine.store.fmt.exchange_dtype) + \
        _buffer_specs(engine)


_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _saved_moment_dtype(meta: dict) -> torch.dtype:
    """The moments' dtype of the checkpoint ``meta`` describes (float32 for one saved before
    ``moment_dtype`` existed). Raises ValueError for another value."""
    name = meta.get("moment_dtype", "float32")
    if name not in _MOMENT_DTYPES:
        raise ValueError(f"checkpoint moment_dtype {name!r} is not valid; one of "
                         f"{tuple(_MOMENT_DTYPES)} expected")
    return _MOMENT_DTYPES[name]


def _saved_specs(meta: dict, engine) -> List[TensorSpec]:
    """``(name, dtype, shape)`` of every tensor in a rank file of the engine that wrote
    ``meta``, in file order: its flat parameters and compute dtype from the metadata, the
    buffers as ``engine``'s (checked equal by :func:`_check_matches`)."""
    flat = [(f["name"], bool(f.get("requires_grad")), f["shard_numel"])
            for f in meta["flat_params"]]
    return _flat_specs(flat, _COMPUTE_DTYPES[meta["dtype"]], _saved_moment_dtype(meta)) + (
        _buffer_specs(engine) if "buffers" in meta else [])


def _rank_tensors(engine) -> Iterator[Tuple[str, torch.Tensor]]:
    """This rank's tensors as CPU copies in :func:`_tensor_specs` order, one flat parameter at a
    time (NVMe state is read from its files)."""
    for fp in engine.flat_params:
        if fp.requires_grad:
            for key, t in zip(_STATE_KEYS, engine.store.read_all(fp)):
                yield f"{fp.name}/{key}", t
            yield f"{fp.name}/step", torch.tensor(engine._step_count[fp], dtype=torch.int64)
        if _saves_param(fp):
            if fp.home is not None:
                shard = fp.home.read(fp)
            else:
                shard = fp.sharded.detach().to("cpu", copy=True)
            yield f"{fp.name}/param", shard
    for name, mod, attr in _persistent_buffers(engine.module):
        yield f"buffers/{name}", mod._buffers[attr].detach().to("cpu", copy=True)


def _raw_bytes(t: torch.Tensor):
    """``t``'s bytes as a numpy uint8 array (no copy for a contiguous CPU tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _header(specs: List[TensorSpec], metadata: Dict[str, str], crcs: Dict[str, int]) -> bytes:
    """A safetensors header: 8-byte little-endian length, then JSON padded to 8 bytes."""
    meta = dict(metadata)
    meta.update({f"crc32/{name}": f"{crcs[name]:08x}" for name, _, _ in specs})
    header: Dict[str, object] = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_rank_file(engine, path: str, save_id: str = "") -> None:
    """Stream this rank's tensors into a new safetensors file at ``path`` and fsync it; its
    metadata records ``save_id`` (the id checkpoint.json also holds).

    The header goes first with placeholder checksums of the same width; once every tensor is
    written and its CRC-32 known, the header is written again in place."""
    specs = _tensor_specs(engine)
    metadata = {"format": "pt", "offload_zero": f"{FORMAT_NAME} v{FORMAT_VERSION}",
                "rank": str(engine.rank), "world_size": str(engine.world_size),
                "save_id": save_id}
    crcs = {name: 0 for name, _, _ in specs}
    header = _header(specs, metadata, crcs)
    with open(path, "xb") as f:
        f.write(header)
        for spec, item in itertools.zip_longest(specs, _rank_tensors(engine)):
            name, dtype, shape = spec if spec is not None else (None, None, None)
            if item is None or item[0] != name or item[1].dtype != dtype \
                    or tuple(item[1].shape) != tuple(shape):
                raise RuntimeError(f"[rank {engine.rank}] internal error: rank file tensor "
                                   f"{spec} does not match {item and (item[0], item[1].dtype)}")
            data = _raw_bytes(item[1])
            crcs[name] = zlib.crc32(data)
            f.write(data)
        final_header = _header(specs, metadata, crcs)
        if len(final_header) != len(header):
            raise RuntimeError(f"[rank {engine.rank}] internal error: {path} header changed size")
        f.seek(0)
        f.write(final_header)
        f.flush()
        os.fsync(f.fileno())


def _verify_rank_file(path: str, specs: List[TensorSpec], rank: int, world_size: int,
                      save_id: Optional[str] = None) -> None:
    """Check that ``path`` is rank ``rank``'s complete, intact file of a save at
    ``world_size`` ranks: readable, written by that rank in the save ``save_id``
    (checkpoint.json's; a file must have the same, or none when it has none), exactly the tensors of ``specs`` with their
    dtypes and shapes, every CRC-32 right. Raises ValueError naming the file."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {path!r} is missing")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("rank"), meta.get("world_size")) != (str(rank), str(world_size)):
                raise ValueError(f"checkpoint file {path!r} was written by rank "
                                 f"{meta.get('rank')} of {meta.get('world_size')}, not rank "
                                 f"{rank} of {world_size}")
            if meta.get("save_id") != save_id:
                raise ValueError(f"checkpoint file {path!r} belongs to another save than its "
                                 f"{META_NAME} (save_id {meta.get('save_id')!r} there, "
                                 f"{save_id!r} in {META_NAME}): files of two checkpoints were "
                                 "mixed")
            expected = {name for name, _, _ in specs}
            keys = set(f.keys())
            if keys != expected:
                raise ValueError(f"checkpoint file {path!r}: tensors missing "
                                 f"{sorted(expected - keys)[:5]}, unexpected "
                                 f"{sorted(keys - expected)[:5]}")
            for name, dtype, shape in specs:
                t = f.get_tensor(name)
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"checkpoint file {path!r}: {name} is {t.dtype} of shape "
                                     f"{tuple(t.shape)}, expected {dtype} of shape {shape}")
                crc = f"{zlib.crc32(_raw_bytes(t)):08x}"
                if meta.get(f"crc32/{name}") != crc:
                    raise ValueError(f"checkpoint file {path!r} is corrupt: {name} has CRC-32 "
                                     f"{crc}, the file records {meta.get(f'crc32/{name}')}")
    except ValueError:
        raise
    except Exception as exc:  # safetensors' own errors: truncated, bad header
        raise ValueError(f"checkpoint file {path!r} cannot be read (truncated or corrupt): "
                         f"{exc}") from None


def _load_buffers(f, engine) -> None:
    """Copy the persistent buffers saved in the open rank file ``f`` (if it has them: files
    written before buffers were saved do not) into the engine's module."""
    names = set(f.keys())
    for name, mod, attr in _persistent_buffers(engine.module):
        if f"buffers/{name}" in names:
            mod._buffers[attr].copy_(f.get_tensor(f"buffers/{name}"))


def _source_ranks(segments: Dict[object, List[tuple]], engine) -> List[int]:
    """The saving ranks whose files hold some element of this rank's shards (``segments``:
    :func:`_segments`): this rank alone at the same world size and grouping; else those whose
    shards overlap this rank's ranges (see :func:`_load_shards`); rank 0 alone if none does
    (the step counts and buffers are in every file)."""
    ranks = set()
    for fp, segs in segments.items():
        lo = engine.rank * fp.shard_numel
        ranks.update(r for r, _, _, _ in _pieces(segs, lo, lo + fp.shard_numel))
    return sorted(ranks) or [0]


def _load_shards(final: str, engine, segments: Dict[object, List[tuple]], sources: List[int],
                 steps: Dict[object, int], saved_dtype: torch.dtype) -> None:
    """Write this rank's shards of the checkpoint in ``final`` (verified) into the engine's
    store and parameter shards, at the saving world size or another (resharding), with the
    parameters grouped into flat parameters as the saving engine did or otherwise.

    Every flat parameter is a flat vector of ``numel`` elements cut into equal shards of
    ``shard_numel`` (the last padded with zeros): rank r of N holds elements
    ``[r * s, (r + 1) * s)``. Each parameter lies at an offset of one saved flat vector and
    one of this engine's (:func:`_segments`); this rank's shard is assembled from the slices of
    the saved shards that hold its range's parameters (``sources``' files; safetensors reads
    only those bytes): at the same world size and grouping that is its own file, whole. One
    flat parameter at a time (12 bytes per element of its shard in host memory, 8 with bf16
    moments, plus the shard); the padding is zeros, as in a fresh engine's (a zero weight with zero gradient and
    moments stays zero under Adam/AdamW). Buffers are the same in every file; ``steps`` are
    the step counts :func:`_saved_steps` read (and checked) before anything changed.
    ``saved_dtype`` is the saving engine's compute dtype: where it is not this engine's, a
    trainable parameter shard is its master weights cast to this engine's dtype (rounded to
    nearest, as an update writes it) and a frozen one the saved shard cast."""
    from contextlib import ExitStack
    from safetensors import safe_open
    saved_moments = _saved_moment_dtype(_read_metadata(final))
    moments = engine.store.fmt.exchange_dtype
    with ExitStack() as stack:
        files = {r: stack.enter_context(safe_open(os.path.join(final, rank_file_name(r)),
                                                  framework="pt")) for r in sources}
        first = files[sources[0]]
        for fp in engine.flat_params:
            lo = engine.rank * fp.shard_numel
            pieces = list(_pieces(segments[fp], lo, lo + fp.shard_numel))

            def gather(key, dtype):
                out = torch.zeros(fp.shard_numel, dtype=dtype)
                for r, name, (a, b), (c, d) in pieces:
                    out[c:d] = files[r].get_slice(f"{name}/{key}")[a:b]
                return out

            master = None
            if fp.requires_grad:
                master = gather("master", torch.float32)
                # (moments saved in another dtype are converted: bf16 -> fp32 exactly)
                m, v = (gather(key, saved_moments).to(moments) for key in _STATE_KEYS[1:])
                engine.store.write_all(fp, master, m, v)
                engine._step_count[fp] = steps[fp]
            if fp.requires_grad and (saved_dtype != fp.dtype or not _saves_param(fp)):
                values = master.to(fp.dtype)  # as an update writes it (fp32: the masters)
            else:
                values = gather("param", saved_dtype).to(fp.dtype)
            _write_param_shard(fp, values)
        _load_buffers(first, engine)
    if engine.param_home is not None:
        engine.param_home.drain()


def _write_param_shard(fp, values: torch.Tensor) -> None:
    """Make ``values`` (shape (shard_numel,), compute dtype) ``fp``'s parameter shard, the way
    an update writes it: into the shard itself, or through its home (host memory, or a pool
    buffer written back to its NVMe file; nothing when the shard is its master's bytes, which
    the store just wrote)."""
    if fp.home is None:
        fp.sharded.copy_(values)
        return
    fp.home.done_with(fp)  # a read of the old shard (kept or read ahead) is stale now
    target = fp.home.update_target(fp)
    if target is not None:
        target.copy_(values)
    fp.home.commit(fp, target)


# -- files and folders ----------------------------------------------------------------------------

def _paths(folder) -> Tuple[str, str, str]:
    """(checkpoint folder, its temporary sibling, the name a replaced one moves to). A symbolic
    link (``latest -> step1000``) stands for its target: that folder is replaced, the link
    stays."""
    final = os.path.realpath(os.fspath(folder))
    parent, base = os.path.split(final)
    if not base or not os.fspath(folder):
        raise ValueError(f"checkpoint folder {folder!r} has no name")
    return final, os.path.join(parent, f".{base}.saving"), os.path.join(parent, f".{base}.replaced")


def _check_replaceable(final: str) -> None:
    """Raise ValueError unless ``final`` is absent, an empty folder, or a checkpoint folder
    holding only checkpoint files (a save replaces it as a whole)."""
    if not os.path.lexists(final):
        return
    if not os.path.isdir(final):
        raise ValueError(f"checkpoint folder {final!r} exists and is not a folder")
    entries = os.listdir(final)
    others = sorted(e for e in entries if e != META_NAME and not _RANK_FILE_RE.fullmatch(e))
    if entries and (others or META_NAME not in entries):
        raise ValueError(f"{final!r} exists and is not an offload-zero checkpoint (it holds "
                         f"{(others or sorted(entries))[:5]}); a save replaces the whole folder, "
                         "so choose a new or empty one")


def _fresh_folder(path: str) -> None:
    if os.path.lexists(path):  # left by a save that was killed: never a complete checkpoint
        shutil.rmtree(path)
    os.makedirs(path)


def _write_text(path: str, text: str) -> None:
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_folder(path: str) -> None:
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


def _swap_in(tmp: str, final: str, replaced: str) -> None:
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
    _fsync_folder(parent)
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
