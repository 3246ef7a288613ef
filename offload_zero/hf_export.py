"""Streamed export of a wrapped model to Hugging Face's safetensors layout, one flat parameter
at a time: ``engine.iter_full_parameters()`` and ``engine.save_pretrained()``.

[Note: streamed export]
The shards are planned before anything is gathered, from the flat parameters' entries (names,
shapes) and the persistent buffers: tensors in iteration order, a new shard file whenever the
next tensor would take the current one past ``max_shard_size`` (a tensor larger than that gets
a file of its own), as ``transformers`` cuts them. Each file's header is then known up front,
so rank 0 writes it, then each tensor's bytes as the gather of its flat parameter yields it:
host memory holds one gathered flat parameter (fp32), one tensor in the export dtype and the
file's write buffer. Every rank takes part in every gather. The folder is written as the
sibling ``.<name>.saving`` and swapped in whole (see [Note: atomic save] in
:mod:`offload_zero.checkpoint`): a failed export leaves an earlier folder as it was.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import struct
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from offload_zero.stream_load import INDEX_NAME, SINGLE_NAME
from offload_zero.tables import parse_bytes

log = logging.getLogger("offload_zero")

_ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL",
             torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16"}
# files an export folder may hold: replacing a folder of anything else is refused
_EXPORT_FILE_RE = re.compile(r"(model(-\d{5}-of-\d{5})?\.safetensors|.*\.json|.*\.txt|"
                             r"tokenizer\.model|.*\.jinja|merges\.txt|vocab\..*)")


def parse_size(size) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10**9) or ``"500MiB"`` (2**20),
    as transformers reads ``max_shard_size``. Raises ValueError for anything else or <= 0."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        try:
            n = parse_bytes(size)
        except ValueError as exc:
            raise ValueError(f"max_shard_size={exc}") from None
    else:
        raise ValueError(f"max_shard_size={size!r}: give bytes (int) or e.g. '5GB', '500MiB'")
    if n <= 0:
        raise ValueError(f"max_shard_size={size!r} must be > 0 bytes")
    return n


def _persistent_buffers(module):
    from offload_zero.checkpoint.layout import persistent_buffers as buffers
    return buffers(module)


def iter_full_parameters(engine, dtype: Optional[torch.dtype] = None, buffers: bool = True
                         ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every parameter name, then (``buffers``) every persistent
    buffer, one flat parameter gathered at a time (see
    :meth:`OffloadEngine.iter_full_parameters`). Collective."""
    engine._finish_updates()
    for fp in engine.flat_params:
        if fp.requires_grad:
            shard = engine.store.read_master(fp).to(engine.device)
        elif fp.home is not None:
            shard = fp.home.read(fp).float().to(engine.device)
        else:
            shard = fp.sharded.float()
        full = torch.empty(fp.padded_numel, dtype=torch.float32, device=engine.device)
        engine.comm.all_gather_into(full, shard, what=fp.name)
        del shard
        full = full.cpu()
        for e in fp.entries:
            value = full[e.offset:e.offset + e.numel].view(e.shape)
            value = value.to(dtype, copy=True) if dtype is not None else value.clone()
            for name in e.names:
                yield name, value
            del value
        del full
    if not buffers:
        return
    for name, mod, attr in _persistent_buffers(engine.module):
        buf = mod._buffers[attr].detach().to("cpu", copy=True)
        yield name, buf.to(dtype) if dtype is not None and buf.is_floating_point() else buf


def full_state_dict(engine, exposure, rank0_only: bool) -> Dict[str, torch.Tensor]:
    """``engine.full_state_dict(rank0_only)`` (see :meth:`OffloadEngine.full_state_dict`):
    every parameter name's full fp32 CPU tensor (:func:`iter_full_parameters`), then what else
    the model's own ``state_dict()`` holds (persistent buffers, extra state), read through
    ``exposure`` (the engine's :class:`offload_zero.exposure.ModelExposure`); ``{}`` on ranks
    other than 0 with ``rank0_only``. Collective."""
    exposure.take_outside_writes()
    out: Dict[str, torch.Tensor] = dict(iter_full_parameters(engine, buffers=False))
    with exposure.exporting():
        own = engine.module.state_dict()
    for name, buf in own.items():
        if name not in out:
            out[name] = buf.detach().cpu().clone() if isinstance(buf, torch.Tensor) else buf
    if rank0_only and engine.rank != 0:
        return {}
    return out


def _tied_patterns(model) -> List[str]:
    from offload_zero.train.hf_folder import tied_weight_patterns
    return tied_weight_patterns(model)


def plan_tensors(engine, dtype: torch.dtype) -> Tuple[List[Tuple[str, torch.dtype, tuple]],
                                                      Dict[str, List[str]]]:
    """What :func:`save_pretrained` writes, in iteration order: ``[(name, dtype, shape)]``
    with one name per tied parameter (the one the model does not declare as a tied copy, as
    ``save_pretrained`` keeps it), and ``{kept name: dropped names}``."""
    patterns = _tied_patterns(engine.module)
    specs, dropped = [], {}
    for fp in engine.flat_params:
        for e in fp.entries:
            declared = [n for n in e.names if any(re.search(p, n) for p in patterns)]
            keep = next((n for n in e.names if n not in declared), e.names[0])
            specs.append((keep, dtype, tuple(e.shape)))
            others = [n for n in e.names if n != keep]
            if others:
                dropped[keep] = others
    for name, mod, attr in _persistent_buffers(engine.module):
        buf = mod._buffers[attr]
        specs.append((name, dtype if buf.is_floating_point() else buf.dtype, tuple(buf.shape)))
    return specs, dropped


def _nbytes(spec) -> int:
    _, dtype, shape = spec
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


def shard_plan(specs, max_shard_bytes: int) -> List[List[tuple]]:
    """``specs`` cut into consecutive shards of at most ``max_shard_bytes`` each (a tensor
    larger than that alone in its own)."""
    shards: List[List[tuple]] = [[]]
    size = 0
    for spec in specs:
        n = _nbytes(spec)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def _header(specs) -> bytes:
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        n = _nbytes((name, dtype, shape))
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_tensor(f, tensor: torch.Tensor) -> None:
    """Append ``tensor``'s bytes (contiguous CPU) to the open file ``f``."""
    if tensor.numel():  # (the tensor's own memory, no copy)
        f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _check_replaceable(final: str) -> None:
    if not os.path.lexists(final):
        return
    if not os.path.isdir(final):
        raise ValueError(f"save_pretrained: {final!r} exists and is not a folder")
    others = sorted(e for e in os.listdir(final) if not _EXPORT_FILE_RE.fullmatch(e))
    if others:
        raise ValueError(f"save_pretrained: {final!r} holds {others[:5]}, which an export does "
                         "not write; the export replaces the whole folder, so choose a new one")


def _write_weights(engine, tmp: str, shards, dtype) -> Tuple[Dict[str, str], Optional[Exception]]:
    """Stream the tensors into the shard files in ``tmp`` (rank 0; the others only gather).
    Returns ``(weight map, the write error or None)``: after a failed write rank 0 still takes
    part in the remaining gathers, so every rank reaches the agreement after them."""
    names = ([SINGLE_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    order = [(i, spec) for i, shard in enumerate(shards) for spec in shard]
    weight_map = {spec[0]: names[i] for i, spec in order}
    writing = engine.rank == 0
    f, current, pos, error = None, -1, 0, None
    for name, tensor in engine.iter_full_parameters(dtype):
        if pos >= len(order) or order[pos][1][0] != name:
            continue  # a tied copy's second name
        i, (_, want_dtype, shape) = order[pos]
        pos += 1
        if not writing:
            continue
        try:
            if tensor.dtype != want_dtype or tuple(tensor.shape) != shape:
                raise RuntimeError(f"internal error: export tensor {name!r} is "
                                   f"{tensor.dtype} {list(tensor.shape)}, planned "
                                   f"{want_dtype} {list(shape)}")
            if i != current:
                if f is not None:
                    _close_synced(f)
                    f = None
                f = open(os.path.join(tmp, names[i]), "xb")
                f.write(_header(shards[i]))
                current = i
            write_tensor(f, tensor)
        except Exception as exc:
            error, writing = exc, False
            if f is not None:
                f.close()
                f = None
    if f is not None:
        try:
            _close_synced(f)
        except Exception as exc:
            error = error or exc
    if pos != len(order) and error is None:
        error = RuntimeError(f"internal error: export wrote {pos} of {len(order)} tensors")
    return weight_map, error


def _close_synced(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def _write_side_files(engine, tmp: str, dtype, tokenizer) -> List[str]:
    files = []
    config = getattr(engine.module, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        if hasattr(config, "dtype"):
            config.dtype = dtype
        config.save_pretrained(tmp)
        files.append("config.json")
    generation = getattr(engine.module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        from offload_zero.train.hf_folder import save_generation_config as _save_generation_config
        files.extend(_save_generation_config(tmp, generation))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        written = tokenizer.save_pretrained(tmp)
        files.extend(sorted(os.path.basename(str(p)) for p in written or ()))
    return files


def _write_index(tmp: str, specs, weight_map: Dict[str, str]) -> None:
    index = {"metadata": {"total_size": sum(_nbytes(s) for s in specs),
                          "total_parameters": sum(torch.Size(s[2]).numel() for s in specs)},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(tmp, INDEX_NAME), "x", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_pretrained(engine, folder, dtype: Optional[torch.dtype] = None,
                    max_shard_size="5GB", tokenizer=None) -> dict:
    """See :meth:`OffloadEngine.save_pretrained`; [Note: streamed export]. ``dtype`` None: the
    engine's compute dtype."""
    if dtype is None:
        dtype = engine.config.dtype
    from offload_zero.checkpoint.agree import agree as _agree
    from offload_zero.checkpoint.folder import fsync_folder as _fsync_folder, swap_in as _swap_in

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"save_pretrained: dtype={dtype} (float32, bfloat16 or float16)")
    max_bytes = parse_size(max_shard_size)
    final = os.path.realpath(os.fspath(folder))
    parent, base = os.path.split(final)
    tmp, old = os.path.join(parent, f".{base}.saving"), os.path.join(parent, f".{base}.replaced")
    specs, dropped = plan_tensors(engine, dtype)
    shards = shard_plan(specs, max_bytes)
    is_root = engine.rank == 0
    error, files = None, []
    if is_root:
        try:
            _check_replaceable(final)
            os.makedirs(parent, exist_ok=True)
            if os.path.lexists(tmp):  # left by a killed export: never complete
                shutil.rmtree(tmp)
            os.makedirs(tmp)
            files = _write_side_files(engine, tmp, dtype, tokenizer)
        except Exception as exc:
            error = exc
    _agree(engine, error, f"save_pretrained({final!r})", exc_type=ValueError,
           on_failure=(lambda: shutil.rmtree(tmp, ignore_errors=True)) if is_root else None)
    weight_map, error = _write_weights(engine, tmp, shards, dtype)
    if is_root and error is None:
        try:
            if len(shards) > 1:
                _write_index(tmp, specs, weight_map)
            _fsync_folder(tmp)
            _swap_in(tmp, final, old)
        except Exception as exc:
            error = exc
    if is_root and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _agree(engine, error, f"save_pretrained({final!r})")
    weight_files = sorted(set(weight_map.values()))
    if len(shards) > 1:
        weight_files.append(INDEX_NAME)
    main = os.path.join(final, INDEX_NAME if len(shards) > 1 else SINGLE_NAME)
    return {"dir": final, "weights": main,
            "weights_bytes": sum(_nbytes(s) for s in specs), "tensors": len(specs),
            "shards": len(shards),
            "dropped_tied": sorted(n for names in dropped.values() for n in names),
            "files": sorted(files) + weight_files}
