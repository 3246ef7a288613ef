"""Initial values of the flat parameters, one flat parameter at a time: from the model itself,
streamed from a Hugging Face safetensors checkpoint (``load_from=``), or from the model's own
initialiser (``init="model"``), so a model built on the meta device is never materialised whole.

[Note: streamed initial values]
The engine asks :meth:`InitialValues.flat_values` for each flat parameter as it builds it
(construction order), with the element range ``[lo, hi)`` of the flat layout it needs: this
rank's shard where parameters are sharded (stage 3 with more than one rank, or shards off the
device), the whole flat parameter where every rank keeps it (stages 1-2). The answer is one
fp32 buffer of ``padded_numel`` elements, zero outside the range, so host memory holds one flat
parameter's values at a time. A checkpoint is read with ``os.pread`` at the byte offsets its
safetensors headers give: a rank reads only the bytes of its range. Everything that can be
checked before reading (files, header bounds, names, shapes) is checked when
:func:`initial_values` runs, before the engine allocates anything.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

log = logging.getLogger("offload_zero")

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool,
           "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16}
INIT_CHOICES = (None, "model")


def pread(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` (a writable byte buffer) from ``offset`` of file descriptor ``fd``: every
    checkpoint read goes through here. Raises ValueError on a short read (a file truncated
    after its header was checked)."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise ValueError(f"short read: {done} of {len(buf)} bytes at offset {offset}")
        done += got


class TensorInfo:
    """Where one stored tensor's bytes are: ``path``, ``dtype``, ``shape``, ``start`` (absolute
    byte offset of its first element in the file)."""

    __slots__ = ("path", "dtype", "shape", "start")

    def __init__(self, path: str, dtype: torch.dtype, shape: Tuple[int, ...], start: int):
        self.path, self.dtype, self.shape, self.start = path, dtype, shape, start

    @property
    def numel(self) -> int:
        """Elements of the stored tensor (the product of its shape)."""
        return math.prod(self.shape)


class SafetensorsFolder:
    """The tensors of a Hugging Face checkpoint folder: ``model.safetensors``, or the shards
    ``model.safetensors.index.json`` lists. Only headers are read here.

    Raises:
        ValueError: no weights file; a shard the index names is missing; a header that is not
            safetensors, a dtype not in ``_DTYPES``, or data offsets past the file's end (a
            truncated file), naming the file and the tensor.
    """

    def __init__(self, folder):
        self.folder = os.fspath(folder)
        index = os.path.join(self.folder, INDEX_NAME)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
            files: Dict[str, List[str]] = {}
            for key, name in weight_map.items():
                files.setdefault(name, []).append(key)
        elif os.path.isfile(os.path.join(self.folder, SINGLE_NAME)):
            files = {SINGLE_NAME: []}
        else:
            raise ValueError(f"load_from {self.folder!r}: neither {SINGLE_NAME} nor {INDEX_NAME} "
                             "there (a Hugging Face safetensors checkpoint folder is needed)")
        self.tensors: Dict[str, TensorInfo] = {}
        for name, keys in files.items():
            path = os.path.join(self.folder, name)
            if not os.path.isfile(path):
                raise ValueError(f"load_from: shard file {path!r} is missing (the index maps "
                                 f"{sorted(keys)[:3]} to it)")
            self.tensors.update(_read_header(path))
            missing = sorted(set(keys) - set(self.tensors))
            if missing:
                raise ValueError(f"load_from: {path!r} lacks {missing[:5]}, which "
                                 f"{INDEX_NAME} maps to it")
        self._fds: Dict[str, int] = {}

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of stored tensor ``key`` flattened (row-major), in its stored
        dtype, shape (hi - lo,): one :func:`pread` of exactly those bytes."""
        info = self.tensors[key]
        size = torch.empty(0, dtype=info.dtype).element_size()
        fd = self._fds.get(info.path)
        if fd is None:
            fd = self._fds[info.path] = os.open(info.path, os.O_RDONLY)
        out = torch.empty(hi - lo, dtype=info.dtype)
        if out.numel():
            try:
                pread(fd, memoryview(out.view(torch.uint8).numpy()), info.start + lo * size)
            except (OSError, ValueError) as exc:
                raise ValueError(f"load_from: reading {key!r} from {info.path!r}: {exc}") from exc
        return out

    def close(self) -> None:
        """Close the open files; idempotent."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _read_header(path: str) -> Dict[str, TensorInfo]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"load_from: {path!r} is not a safetensors file (or is truncated: "
                             f"{size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"load_from: {path!r} has a corrupt safetensors header: {exc}")
    out = {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(spec.get("dtype"))
        if dtype is None:
            raise ValueError(f"load_from: {path!r} stores {key!r} as {spec.get('dtype')!r}, "
                             f"not one of {sorted(_DTYPES)}")
        a, b = spec["data_offsets"]
        shape = tuple(spec["shape"])
        if 8 + n + b > size or b - a != math.prod(shape) * torch.empty(0, dtype=dtype).element_size():
            raise ValueError(f"load_from: {path!r} is truncated or corrupt: tensor {key!r} "
                             f"needs bytes up to {8 + n + b}, the file has {size}")
        out[key] = TensorInfo(path, dtype, shape, 8 + n + a)
    return out


# -- names ------------------------------------------------------------------------------------

def _renamer(model: nn.Module, wanted: set, keys=()) -> Callable[[str], str]:
    """``f(checkpoint key) -> model name``: the model's own renames (transformers 5's
    conversion mapping: pure renamings) and its ``base_model_prefix`` added or stripped, as
    ``from_pretrained`` does. ``wanted``: the model's names; ``keys``: the checkpoint's. A
    checkpoint whose every key is already a model name (up to the prefix: the model's own
    layout, as ``engine.save_pretrained`` writes it) needs no conversion. Raises
    NotImplementedError for another checkpoint of a model whose mapping merges or splits
    tensors (a ``WeightConverter``: the experts of transformers' MoE models)."""
    renamings, prefix = [], getattr(model, "base_model_prefix", None) or None
    lookup = dict.fromkeys(wanted, True)

    def own(key: str) -> bool:
        return (key in lookup or (prefix is not None and (
            f"{prefix}.{key}" in lookup
            or (key.startswith(prefix + ".") and key[len(prefix) + 1:] in lookup))))

    as_is = bool(keys) and all(own(k) for k in keys)
    if hasattr(model, "config") and hasattr(model, "_init_weights") and not as_is:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming, rename_source_key
        except ImportError:  # another transformers: no renames beyond the prefix
            rename_source_key = None
        else:
            transforms = get_model_conversion_mapping(model)
            converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
            if converters:
                raise NotImplementedError(
                    f"load_from: {type(model).__name__}'s checkpoint conversion merges or splits "
                    f"tensors ({converters[:2]}), which loading tensor by tensor cannot do: "
                    "give a folder in the model's own layout (engine.save_pretrained writes "
                    "one, as does from_pretrained(...).state_dict() saved with safetensors), or "
                    "build the model with from_pretrained and wrap it without load_from")
            renamings = transforms

    def rename(key: str) -> str:
        if renamings and rename_source_key is not None:
            key = rename_source_key(key, renamings, [])[0]
        if key in lookup or prefix is None:
            return key
        if key.startswith(prefix + ".") and key[len(prefix) + 1:] in lookup:
            return key[len(prefix) + 1:]
        return f"{prefix}.{key}" if f"{prefix}.{key}" in lookup else key

    return rename


def _persistent_buffers(model: nn.Module) -> Dict[str, Tuple[nn.Module, str]]:
    out = {}
    for mod_name, mod in model.named_modules():
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{attr}" if mod_name else attr] = (mod, attr)
    return out


def _param_names(model: nn.Module) -> Dict[int, List[str]]:
    names: Dict[int, List[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{mod_name}.{attr}" if mod_name else attr)
    return names


# -- initial values ---------------------------------------------------------------------------

class InitialValues:
    """Where each parameter's initial values come from (see [Note: streamed initial values]).

    Attributes:
        missing_keys, unexpected_keys: as ``torch.nn.Module.load_state_dict`` reports them
            (parameter and persistent-buffer names; checkpoint keys), empty when strict.
    """

    def __init__(self, model: nn.Module, checkpoint: Optional[SafetensorsFolder],
                 key_of: Dict[int, str], initialiser: Optional["ModelInit"]):
        self.model, self.checkpoint, self.key_of = model, checkpoint, key_of
        self.initialiser = initialiser
        self.missing_keys: List[str] = []
        self.unexpected_keys: List[str] = []

    def flat_values(self, entries, members, padded_numel: int, lo: int, hi: int
                    ) -> List[torch.Tensor]:
        """Values for one flat parameter: ``entries`` (its :class:`ParamEntry` list, offsets
        assigned), ``members`` (its ``(param, refs)`` pairs, same order), the range
        ``[lo, hi)`` of its flat layout wanted. Returns one fp32 tensor per entry, of the
        entry's shape: views of one zeroed buffer of ``padded_numel`` elements in which only
        ``[lo, hi)`` is filled. Raises ValueError naming the file and key on a failed read."""
        flat = torch.zeros(padded_numel, dtype=torch.float32)
        for e, (p, _) in zip(entries, members):
            a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
            key = self.key_of.get(id(p))
            if key is None and self.initialiser is not None:
                # (every rank initialises every parameter: the random stream stays the same)
                value = self.initialiser.value(p).reshape(-1)
                if a < b:
                    flat[a:b].copy_(value[a - e.offset:b - e.offset])
            elif a >= b:
                continue
            elif key is not None:
                flat[a:b].copy_(self.checkpoint.read(key, a - e.offset, b - e.offset))
            else:  # a real parameter the checkpoint lacks (strict=False): its own values
                flat[a:b].copy_(p.detach().reshape(-1)[a - e.offset:b - e.offset])
        return [flat[e.offset:e.offset + e.numel].view(e.shape) for e in entries]

    def close(self) -> None:
        """Close the checkpoint's files; idempotent."""
        if self.checkpoint is not None:
            self.checkpoint.close()


def initial_values(model: nn.Module, load_from=None, init: Optional[str] = None,
                   strict: bool = True) -> Optional[InitialValues]:
    """Check the sources of ``model``'s initial values and fill its buffers; returns None when
    the engine should take the parameters as they are (no ``load_from``, no ``init``, nothing
    on the meta device), else an :class:`InitialValues`.

    ``load_from``: a Hugging Face checkpoint folder (``model.safetensors``, or shards with
    ``model.safetensors.index.json``; any stored float dtype, read as fp32). Persistent buffers
    are read from it now. ``init="model"``: parameters the checkpoint does not give (all of them
    without one) come from the model's own initialiser (see :class:`ModelInit`). Buffers still
    on the meta device that nothing fills are recomputed by their module's initialiser
    (transformers' ``_init_weights``, which recomputes rotary ``inv_freq``; else
    ``reset_parameters``).

    Raises:
        ValueError: a bad ``init``; meta parameters with neither source (naming the first);
            a meta buffer nothing fills; a checkpoint error (see :class:`SafetensorsFolder`);
            with ``strict``, missing or unexpected keys (named, with the folder); always, a
            shape mismatch (name, both shapes, file) and missing meta parameters.
    """
    if init not in INIT_CHOICES:
        raise ValueError(f"init={init!r}: valid values are {list(INIT_CHOICES)}")
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if load_from is None and init is None:
        if meta:
            raise ValueError(f"parameter {meta[0]!r} is on the meta device (and {len(meta) - 1} "
                             "more): give load_from=<checkpoint folder> or init='model'")
        _fill_meta_buffers(model, set())
        return None
    if meta and hasattr(model, "tie_weights"):
        model.tie_weights()  # (accelerate's init_empty_weights unties them)
    names = _param_names(model)
    params = {id(p): p for p in model.parameters()}
    key_of: Dict[int, str] = {}
    checkpoint, filled = None, set()
    if load_from is not None:
        checkpoint = SafetensorsFolder(load_from)
        try:
            key_of, filled, unexpected, missing = _match(model, checkpoint, names, params)
        except BaseException:
            checkpoint.close()
            raise
    else:
        unexpected, missing = [], []
    source = InitialValues(model, checkpoint, key_of,
                           ModelInit(model) if init is not None else None)
    source.unexpected_keys, source.missing_keys = unexpected, missing
    try:
        where = f" in {checkpoint.folder!r}" if checkpoint is not None else ""
        lost = [names[k][0] for k, p in params.items() if k not in key_of and p.is_meta]
        if strict and (missing or unexpected):
            files = [f"{k} ({os.path.basename(checkpoint.tensors[k].path)})"
                     for k in unexpected[:8]]
            anyway = ("strict=False loads anyway" if not lost or init is not None else
                      "strict=False with init='model' loads anyway, the missing ones from the "
                      "model's initialiser: they are on the meta device")
            raise ValueError(f"load_from{where}: missing keys {missing[:8]}, unexpected keys "
                             f"{unexpected[:8]} (in {files}) ({anyway})")
        if lost and init is None:
            raise ValueError(f"parameters {lost[:5]} are on the meta device and missing"
                             f"{where}: nothing to build them from (give init='model')")
        if missing or unexpected:
            log.warning("load_from%s: missing keys %s, unexpected keys %s", where, missing,
                        unexpected)
        _fill_meta_buffers(model, filled)
    except BaseException:
        source.close()
        raise
    return source


def _match(model, checkpoint: SafetensorsFolder, names, params):
    """Checkpoint keys matched to parameters and persistent buffers (shapes checked; the
    buffers copied in now). Returns ``(key_of, buffers filled, unexpected, missing)``."""
    buffers = _persistent_buffers(model)
    by_name = {n: k for k, ns in names.items() for n in ns}
    rename = _renamer(model, set(by_name) | set(buffers), list(checkpoint.tensors))
    key_of, filled, unexpected = {}, set(), []
    for key, info in checkpoint.tensors.items():
        name = rename(key)
        if name in by_name:
            shape = tuple(params[by_name[name]].shape)
        elif name in buffers:
            mod, attr = buffers[name]
            shape = tuple(mod._buffers[attr].shape)
        else:
            unexpected.append(key)
            continue
        if shape != info.shape:
            raise ValueError(f"load_from: {key!r} in {info.path!r} has shape "
                             f"{list(info.shape)}, the model's {name!r} {list(shape)}")
        if name in by_name:
            key_of.setdefault(by_name[name], key)  # a tied parameter: any of its names
        else:
            mod, attr = buffers[name]
            value = checkpoint.read(key, 0, info.numel).view(info.shape)
            old = mod._buffers[attr]
            mod._buffers[attr] = value.to(old.dtype, copy=True)
            filled.add(name)
    missing = [names[k][0] for k in params if k not in key_of]
    missing += [n for n in buffers if n not in filled]
    return key_of, filled, unexpected, missing


def _fill_meta_buffers(model: nn.Module, filled: set) -> None:
    """Recompute every buffer still on the meta device with its module's initialiser: each is
    made a NaN-filled CPU tensor, then transformers' ``_init_weights`` (or the module's
    ``reset_parameters``) runs on its module; a buffer left with NaNs (nothing computed it)
    raises ValueError naming it."""
    todo = [(n, m) for n, m in model.named_modules()
            if any(b is not None and b.is_meta for b in m._buffers.values())]
    if not todo:
        return
    init_fn = getattr(model, "_init_weights", None)
    bad = []
    for mod_name, mod in todo:
        if any(p.is_meta for p in mod._parameters.values() if p is not None):
            bad += [f"{mod_name}.{a}" for a, b in mod._buffers.items() if b is not None and b.is_meta]
            continue
        metas = [a for a, b in mod._buffers.items() if b is not None and b.is_meta]
        for a in metas:
            b = mod._buffers[a]
            mod._buffers[a] = torch.full(b.shape, float("nan"), dtype=b.dtype) \
                if b.is_floating_point() else torch.empty(b.shape, dtype=b.dtype)
        with torch.no_grad():
            if init_fn is not None:
                init_fn(mod)
            elif hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
        bad += [f"{mod_name}.{a}" for a in metas
                if not mod._buffers[a].is_floating_point() or mod._buffers[a].isnan().any()]
    if bad:
        raise ValueError(f"buffers {bad[:5]} are on the meta device and neither a checkpoint nor "
                         "their module's initialiser fills them; build the model under "
                         "accelerate's init_empty_weights() (which keeps buffers real)")


class ModelInit:
    """The model's own initialiser, one module at a time: transformers' ``_init_weights``
    (the innermost pretrained model's) or else ``reset_parameters()``, on CPU copies of the
    module's own parameters, modules in the order transformers' ``initialize_weights`` visits
    them (children first). Values of parameters the engine has not yet asked for wait in host
    memory (a tied parameter is initialised once, at its first module)."""

    def __init__(self, model: nn.Module):
        self.model = model
        owned = {}
        self._order: List[Tuple[nn.Module, List[Tuple[str, nn.Parameter]], Callable]] = []
        self._walk(model, getattr(model, "_init_weights", None), owned)
        self._steps = iter(self._order)
        self._done: Dict[int, torch.Tensor] = {}

    def _walk(self, mod: nn.Module, init_fn, owned) -> None:
        own_fn = getattr(mod, "_init_weights", None)
        init_fn = own_fn if own_fn is not None and hasattr(mod, "config") else init_fn
        for child in mod.children():
            self._walk(child, init_fn, owned)
        direct = [(a, p) for a, p in mod._parameters.items() if p is not None]
        self._order.append((mod, direct, init_fn))

    def value(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s initial values (fp32 CPU, ``p``'s shape), running modules' initialisers in
        order until ``p`` has them; handed out once."""
        while id(p) not in self._done:
            try:
                mod, direct, init_fn = next(self._steps)
            except StopIteration:
                raise ValueError(f"init='model': no module initialises a parameter of shape "
                                 f"{list(p.shape)}") from None
            self._run(mod, direct, init_fn)
        return self._done.pop(id(p))

    def _run(self, mod: nn.Module, direct, init_fn) -> None:
        saved = dict(mod._parameters)
        real = {}
        for attr, p in direct:
            t = self._done.get(id(p))
            if t is None:
                t = torch.empty(p.shape, dtype=torch.float32)
                if not callable(init_fn) and not hasattr(mod, "reset_parameters"):
                    raise ValueError(f"init='model': {type(mod).__name__} has no "
                                     "reset_parameters() and the model no _init_weights")
            real[attr] = nn.Parameter(t, requires_grad=p.requires_grad)
        try:
            mod._parameters.update(real)
            with torch.no_grad():
                if init_fn is not None:
                    _hf_guard(init_fn, mod)
                elif direct and hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()
        finally:
            mod._parameters.clear()
            mod._parameters.update(saved)
        for attr, p in direct:
            self._done[id(p)] = real[attr].data


def _hf_guard(init_fn, mod) -> None:
    """``init_fn(mod)`` inside transformers' guard of torch's init functions, as
    ``initialize_weights`` runs it (where this transformers has one)."""
    try:
        from transformers import initialization
        guard = initialization.guard_torch_init_functions
    except (ImportError, AttributeError):
        init_fn(mod)
        return
    with guard():
        init_fn(mod)
