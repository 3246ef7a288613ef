"""Saving: each rank streams its shard of the training state into its rank file, one flat
parameter at a time; rank 0 adds ``checkpoint.json`` and swaps the folder in (see [Note:
checkpoint layout] in :mod:`offload_zero.checkpoint.layout` and [Note: atomic save] in
:mod:`offload_zero.checkpoint.folder`)."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import zlib
from typing import Optional

from offload_zero.checkpoint.agree import agree, shared_save_id
from offload_zero.checkpoint.folder import (check_replaceable, folder_lock, fresh_folder,
                                            fsync_folder, swap_in, write_text)
from offload_zero.checkpoint.layout import (FORMAT_NAME, FORMAT_VERSION, META_NAME,
                                            build_metadata, paths, rank_file_name, rank_tensors,
                                            raw_bytes, safetensors_header, tensor_specs)


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
    engine.settle_between_steps("save_checkpoint")
    final = paths(folder)[0]
    # rank 0 writes the folder: another job's save or load of a checkpoint beside it waits
    with folder_lock(final, exclusive=True, take=engine.rank == 0):
        _save(engine, folder, client_state)


def _save(engine, folder, client_state: Optional[dict]) -> None:
    """:func:`save_checkpoint` once the folder is locked."""
    final, tmp, old = paths(folder)
    error, meta = None, None
    try:  # (a rank that sees another folder there must not leave the others waiting)
        check_replaceable(final)
        meta = build_metadata(engine, client_state)
    except Exception as exc:
        error = exc
    agree(engine, error, f"save_checkpoint({final!r})", exc_type=ValueError)
    is_root = engine.rank == 0
    if is_root:
        try:
            fresh_folder(tmp)
        except Exception as exc:  # every rank must hear of it: they wait for this one
            error = exc
    agree(engine, error, f"save_checkpoint({final!r}): creating {tmp!r}")
    # one id for this save, in checkpoint.json and every rank file: files of two saves never mix
    meta["save_id"] = save_id = shared_save_id(engine)
    meta_text = json.dumps(meta, indent=1)
    try:
        _write_rank_file(engine, os.path.join(tmp, rank_file_name(engine.rank)), save_id)
    except Exception as exc:
        error = exc
    agree(engine, error, f"save_checkpoint({final!r})",
           on_failure=(lambda: shutil.rmtree(tmp, ignore_errors=True)) if is_root else None)
    if is_root:
        try:
            write_text(os.path.join(tmp, META_NAME), meta_text)
            fsync_folder(tmp)
            swap_in(tmp, final, old)
        except Exception as exc:
            error = exc
            shutil.rmtree(tmp, ignore_errors=True)
    agree(engine, error, f"save_checkpoint({final!r})")


def _write_rank_file(engine, path: str, save_id: str = "") -> None:
    """Stream this rank's tensors into a new safetensors file at ``path`` and fsync it; its
    metadata records ``save_id`` (the id checkpoint.json also holds).

    The header goes first with placeholder checksums of the same width; once every tensor is
    written and its CRC-32 known, the header is written again in place."""
    specs = tensor_specs(engine)
    metadata = {"format": "pt", "offload_zero": f"{FORMAT_NAME} v{FORMAT_VERSION}",
                "rank": str(engine.rank), "world_size": str(engine.world_size),
                "save_id": save_id}
    crcs = {name: 0 for name, _, _ in specs}
    header = safetensors_header(specs, metadata, crcs)
    with open(path, "xb") as f:
        f.write(header)
        for spec, item in itertools.zip_longest(specs, rank_tensors(engine)):
            name, dtype, shape = spec if spec is not None else (None, None, None)
            if item is None or item[0] != name or item[1].dtype != dtype \
                    or tuple(item[1].shape) != tuple(shape):
                raise RuntimeError(f"[rank {engine.rank}] internal error: rank file tensor "
                                   f"{spec} does not match {item and (item[0], item[1].dtype)}")
            data = raw_bytes(item[1])
            crcs[name] = zlib.crc32(data)
            f.write(data)
        final_header = safetensors_header(specs, metadata, crcs)
        if len(final_header) != len(header):
            raise RuntimeError(f"[rank {engine.rank}] internal error: {path} header changed size")
        f.seek(0)
        f.write(final_header)
        f.flush()
        os.fsync(f.fileno())
