"""``--save DIR``: a Hugging Face folder (``model.safetensors``, ``config.json``,
``generation_config.json``, the tokenizer) that ``--model DIR`` and ``from_pretrained`` load."""
from __future__ import annotations

import argparse
import logging
import os
import re
from collections import defaultdict
from typing import Any, Dict, List, Tuple

import torch

from offload_zero import data as data_lib

log = logging.getLogger("offload_zero.train")

# The file --save writes the weights to: the name transformers' from_pretrained looks for first.
WEIGHTS_NAME = "model.safetensors"


def check_save_dir(folder: str) -> None:
    """Check that ``--save`` ``folder`` is, or can be made, a writable folder; creates nothing.

    Raises ``ValueError`` naming the path if ``folder`` exists and is not a folder, if it is a
    folder we cannot write to, if ``folder/model.safetensors`` is a folder, or, when it does not
    exist, if its nearest existing ancestor is not a writable folder.
    """
    flag = f"--save {folder!r}"
    if os.path.exists(folder):
        if not os.path.isdir(folder):
            raise ValueError(f"{flag} exists and is not a folder")
        from offload_zero.config import require_writable
        require_writable(folder, flag, "give another --save")
        if os.path.isdir(os.path.join(folder, WEIGHTS_NAME)):
            raise ValueError(f"{flag}: {os.path.join(folder, WEIGHTS_NAME)!r} is a folder")
        return
    from offload_zero.checkpoint import check_creatable
    check_creatable(os.path.dirname(os.path.abspath(folder)), flag)


def tied_weight_patterns(model: torch.nn.Module) -> List[str]:
    """The names a Hugging Face model declares as tied copies (``_tied_weights_keys`` of every
    submodule, prefixed with its path; a dict's keys in transformers 5, a list before), as the
    regular expressions transformers matches them with. Empty for a model without any."""
    patterns: List[str] = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        for key in (tied.keys() if isinstance(tied, dict) else tied):
            patterns.append(f"{prefix}.{key}" if prefix else key)
    return patterns


def unshare_tensors(state_dict: Dict[str, torch.Tensor], tied_patterns: List[str] = ()
                    ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Make ``state_dict`` storable by safetensors, which refuses tensors sharing storage.

    Names that hold the very same tensor (tied weights) keep one entry: the names matching
    ``tied_patterns`` (see :func:`tied_weight_patterns`) are dropped, as transformers'
    ``save_pretrained`` does, and ``from_pretrained`` ties them again on load; extra names the
    model does not declare get a copy, as do tensors that overlap without being the same view.
    Returns ``(new dict, dropped names)``; ``state_dict`` itself is not changed.
    """
    out = dict(state_dict)
    dropped: List[str] = []
    by_storage: Dict[int, List[str]] = defaultdict(list)
    for name, tensor in state_dict.items():
        if tensor.numel():
            by_storage[tensor.untyped_storage().data_ptr()].append(name)
    for names in by_storage.values():
        if len(names) < 2:
            continue
        first = state_dict[names[0]]
        same_view = all(state_dict[n].data_ptr() == first.data_ptr()
                        and state_dict[n].shape == first.shape
                        and state_dict[n].stride() == first.stride() for n in names)
        declared = {n for n in names if same_view
                    and any(re.search(p, n) for p in tied_patterns)}
        keep = next((n for n in names if n not in declared), names[0])
        for name in names:
            if name == keep:
                continue
            if name in declared:
                del out[name]
                dropped.append(name)
            else:
                out[name] = state_dict[name].clone()
    return out, dropped


def save_hf_folder(folder: str, state_dict: Dict[str, torch.Tensor], *, config: Any = None,
                    tokenizer: Any = None, tied_patterns: List[str] = (),
                    generation_config: Any = None) -> Dict[str, Any]:
    """Write a loadable checkpoint folder: ``folder/model.safetensors`` holding ``state_dict``
    (tied duplicates dropped by :func:`unshare_tensors`), plus ``config.save_pretrained(folder)``,
    ``generation_config.save_pretrained(folder)`` (``generation_config.json``: the eos/pad ids
    and other settings ``generate()`` uses) and ``tokenizer.save_pretrained(folder)`` for those
    given that have the method.

    ``folder`` is created if missing. The configs and tokenizer are written first and the
    weights last, to a temporary file in ``folder`` that is flushed to disk and then renamed
    over ``model.safetensors``: a failed or interrupted save leaves any earlier
    ``model.safetensors`` as it was and never a half-written one. A generation config that
    transformers refuses to save (its ``validate`` raises ``ValueError``) is left out with a
    warning rather than losing the weights. Returns a JSON-ready dict ``{"dir", "weights",
    "weights_bytes", "tensors", "dropped_tied", "files"}``. Raises ``ValueError`` (naming the
    path) if ``state_dict`` is empty or anything cannot be written.
    """
    from safetensors.torch import save_file

    if not state_dict:
        raise ValueError(f"--save {folder!r}: no weights to write (an empty state dict)")
    tensors, dropped = unshare_tensors(state_dict, tied_patterns)
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    weights = os.path.join(folder, WEIGHTS_NAME)
    temp = os.path.join(folder, f".{WEIGHTS_NAME}.{os.getpid()}.tmp")
    files: List[str] = []
    try:
        os.makedirs(folder, exist_ok=True)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(folder)
            files.append("config.json")
        if generation_config is not None and hasattr(generation_config, "save_pretrained"):
            files.extend(save_generation_config(folder, generation_config))
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            written = tokenizer.save_pretrained(folder)
            files.extend(sorted(os.path.basename(str(f)) for f in written or ()))
        try:
            save_file(tensors, temp, metadata={"format": "pt"})
            umask = os.umask(0)  # safetensors makes its files 0600; give the usual mode
            os.umask(umask)
            os.chmod(temp, 0o666 & ~umask)
            with open(temp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(temp, weights)
        finally:
            if os.path.exists(temp):
                os.remove(temp)
    except OSError as exc:
        raise ValueError(f"--save {folder!r}: cannot write the model's weights folder: "
                         f"{exc}") from exc
    files.append(WEIGHTS_NAME)
    return {"dir": folder, "weights": weights, "weights_bytes": os.path.getsize(weights),
            "tensors": len(tensors), "dropped_tied": dropped, "files": files}


def save_generation_config(folder: str, generation_config: Any) -> List[str]:
    """``generation_config.save_pretrained(folder)``; returns the file name written, or none
    (with a warning) if transformers refuses the config. ``OSError`` propagates."""
    try:
        generation_config.save_pretrained(folder)
    except ValueError as exc:
        log.warning("--save %s: generation_config.json left out (generate() falls back to "
                    "config.json's token ids): %s", folder, " ".join(str(exc).split()))
        return []
    return ["generation_config.json"]


def _tokenizer_to_save(args: argparse.Namespace, tokenizer) -> Any:
    """The Hugging Face tokenizer to write with ``--save``, or ``None`` (the byte tokenizer
    has no files: ``--model`` falls back to it for a folder without tokenizer files).

    Loaded again from ``--model``: the one in use has a training-only ``model_max_length``."""
    if not isinstance(tokenizer, data_lib.HFTokenizer):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(args.model))


def export(engine, args: argparse.Namespace, tokenizer) -> Dict[str, Any]:
    """``--save``: ``engine.save_pretrained(args.save)`` in fp32 (as trained), with the
    tokenizer; returns its summary dict. Collective. Raises ``ValueError`` naming the folder if
    it cannot be written."""
    try:
        return engine.save_pretrained(args.save, dtype=torch.float32,
                                      tokenizer=(_tokenizer_to_save(args, tokenizer)
                                                 if engine.rank == 0 else None))
    except OSError as exc:
        raise ValueError(f"--save {str(args.save)!r}: cannot write the model's weights "
                         f"folder: {exc}") from exc
