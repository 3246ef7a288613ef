"""The checkpoint's format: the names of its folder and files, what ``checkpoint.json`` and
each rank file hold, the tensors' names, dtypes and shapes in file order, the safetensors
header, and the metadata read back.

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
  trainable flat parameter: the master weights (float32; bf16 masters as their exact fp32
  values, loaded into either master dtype: fp32 -> bf16 rounding to nearest even) and Adam's
  two moments (float32, or
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
its own (resharding; see :func:`offload_zero.checkpoint.load._load_shards`). Each parameter's place in its flat parameter is
in ``parameters``, so an engine that groups the parameters into flat parameters otherwise (one
built with other ``unit_classes``, say) loads them too, parameter by parameter.

Its safetensors metadata (strings) names the ``rank`` and ``world_size`` it was written by and
the ``save_id``, and gives a CRC-32 of each tensor's bytes (``crc32/<tensor name>``, 8 hex digits), checked on load.
The file is written as a stream, one flat parameter at a time, so saving never holds more than
one flat parameter's state in host memory (12 bytes per element of its shard, plus the shard):
the state of an NVMe-offloaded model need not fit in RAM.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from offload_zero.optim.facade import json_group
from offload_zero.tables import DTYPE_LONG_NAMES

FORMAT_NAME = "offload-zero-checkpoint"
FORMAT_VERSION = 1
META_NAME = "checkpoint.json"
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
RANK_FILE_RE = re.compile(r"rank\d{5,}\.safetensors")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64"}
COMPUTE_DTYPES = DTYPE_LONG_NAMES  # checkpoint.json's "dtype" -> torch dtype

TensorSpec = Tuple[str, torch.dtype, Tuple[int, ...]]


def rank_file_name(rank: int) -> str:
    """File name of ``rank``'s shard in a checkpoint folder: ``rank00000.safetensors``."""
    return f"rank{rank:05d}.safetensors"


def paths(folder) -> Tuple[str, str, str]:
    """(checkpoint folder, its temporary sibling, the name a replaced one moves to). A symbolic
    link (``latest -> step1000``) stands for its target: that folder is replaced, the link
    stays."""
    final = os.path.realpath(os.fspath(folder))
    parent, base = os.path.split(final)
    if not base or not os.fspath(folder):
        raise ValueError(f"checkpoint folder {folder!r} has no name")
    return final, os.path.join(parent, f".{base}.saving"), os.path.join(parent, f".{base}.replaced")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def engine_layout(engine) -> dict:
    """What a checkpoint must share with the engine that loads it (JSON-ready)."""
    return {
        "world_size": engine.world_size,
        "stage": engine.config.stage,
        "dtype": _dtype_name(engine.config.dtype),
        "moment_dtype": _dtype_name(engine.store.fmt.exchange_dtype),  # (int8: fp32 values)
        "flat_params": [{"name": fp.name, "requires_grad": fp.requires_grad, "numel": fp.numel,
                         "shard_numel": fp.shard_numel,
                         "parameters": [[e.names, list(e.shape)] for e in fp.entries],
                         **({"groups": engine.entry_groups[fp]} if fp.requires_grad else {})}
                        for fp in engine.flat_params],
        "buffers": [name for name, _, _ in persistent_buffers(engine.module)],
    }


def persistent_buffers(module) -> List[Tuple[str, object, str]]:
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


def build_metadata(engine, client_state: Optional[dict] = None) -> dict:
    """``checkpoint.json``'s contents for ``engine``: format and version, the layout
    (:func:`engine_layout`), lr, parameter groups, skipped steps, loss-scaler state, Adam's
    settings and ``client_state``. Raises ValueError if ``client_state`` is not a dict of
    JSON-ready values (naming what is wrong)."""
    cfg = engine.config
    if client_state is not None and not isinstance(client_state, dict):
        raise ValueError(f"client_state must be a dict (or None), got {type(client_state).__name__}")
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"client_state must hold only numbers, strings, lists and dicts to "
                         f"be saved: {exc}") from None
    scaler = engine.loss_scaler
    scaler_state = None if scaler is None else dict(scaler.state_dict())
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **engine_layout(engine),
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


def read_metadata(folder) -> dict:
    """The ``checkpoint.json`` of the checkpoint in ``folder`` (a symbolic link stands for its
    target), as a dict (see [Note: checkpoint layout]); reads no rank file. Raises ValueError
    naming the path if ``folder`` is missing or not a folder (with a hint when a save was
    interrupted between its renames), or holds no complete checkpoint metadata."""
    return read_metadata_file(paths(folder)[0])


def read_metadata_file(folder: str) -> dict:
    """``folder``'s ``checkpoint.json``; ValueError if the folder or file is missing or bad."""
    path = os.path.join(folder, META_NAME)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"checkpoint folder {folder!r} is not a folder (a checkpoint is a "
                         f"folder holding {META_NAME} and one file per rank)")
    if not os.path.isdir(folder):
        replaced = paths(folder)[2]
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


def saves_param(fp) -> bool:
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
                      zip(STATE_KEYS, (torch.float32, moment_dtype, moment_dtype))]
            specs.append((f"{name}/step", torch.int64, ()))
        if _holds_param(requires_grad, dtype):
            specs.append((f"{name}/param", dtype, (n,)))
    return specs


def _buffer_specs(engine) -> List[TensorSpec]:
    """``(name, dtype, shape)`` of the persistent buffers in a rank file of ``engine``."""
    return [(f"buffers/{name}", mod._buffers[attr].dtype, tuple(mod._buffers[attr].shape))
            for name, mod, attr in persistent_buffers(engine.module)]


def tensor_specs(engine) -> List[TensorSpec]:
    """(name, dtype, shape) of every tensor in a rank file of ``engine``, in file order."""
    flat = [(fp.name, fp.requires_grad, fp.shard_numel) for fp in engine.flat_params]
    return _flat_specs(flat, engine.config.dtype, engine.store.fmt.exchange_dtype) + \
        _buffer_specs(engine)


_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def saved_moment_dtype(meta: dict) -> torch.dtype:
    """The moments' dtype of the checkpoint ``meta`` describes (float32 for one saved before
    ``moment_dtype`` existed). Raises ValueError for another value."""
    name = meta.get("moment_dtype", "float32")
    if name not in _MOMENT_DTYPES:
        raise ValueError(f"checkpoint moment_dtype {name!r} is not valid; one of "
                         f"{tuple(_MOMENT_DTYPES)} expected")
    return _MOMENT_DTYPES[name]


def saved_specs(meta: dict, engine) -> List[TensorSpec]:
    """``(name, dtype, shape)`` of every tensor in a rank file of the engine that wrote
    ``meta``, in file order: its flat parameters and compute dtype from the metadata, the
    buffers as ``engine``'s (checked equal by :func:`check_matches`)."""
    flat = [(f["name"], bool(f.get("requires_grad")), f["shard_numel"])
            for f in meta["flat_params"]]
    return _flat_specs(flat, COMPUTE_DTYPES[meta["dtype"]], saved_moment_dtype(meta)) + (
        _buffer_specs(engine) if "buffers" in meta else [])


def rank_tensors(engine) -> Iterator[Tuple[str, torch.Tensor]]:
    """This rank's tensors as CPU copies in :func:`tensor_specs` order, one flat parameter at a
    time (NVMe state is read from its files)."""
    for fp in engine.flat_params:
        if fp.requires_grad:
            for key, t in zip(STATE_KEYS, engine.store.read_all(fp)):
                yield f"{fp.name}/{key}", t
            yield f"{fp.name}/step", torch.tensor(engine.step_counts[fp], dtype=torch.int64)
        if saves_param(fp):
            if fp.home is not None:
                shard = fp.home.read(fp)
            else:
                shard = fp.sharded.detach().to("cpu", copy=True)
            yield f"{fp.name}/param", shard
    for name, mod, attr in persistent_buffers(engine.module):
        yield f"buffers/{name}", mod._buffers[attr].detach().to("cpu", copy=True)


def raw_bytes(t: torch.Tensor):
    """``t``'s bytes as a numpy uint8 array (no copy for a contiguous CPU tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def safetensors_header(specs: List[TensorSpec], metadata: Dict[str, str], crcs: Dict[str, int]) -> bytes:
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
