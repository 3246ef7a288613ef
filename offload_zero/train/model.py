"""The model ``offload-zero train`` trains: a Llama-style preset built from scratch with the
byte tokenizer, or a local Hugging Face checkpoint (``--model DIR``) with its own tokenizer;
built on the meta device and streamed into the engine."""
from __future__ import annotations

import argparse
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from offload_zero import data as data_lib

log = logging.getLogger("offload_zero.train")


# File names whose presence in a checkpoint folder means it ships a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "spiece.model", "vocab.txt")


@dataclass(frozen=True)
class ModelSize:
    """Shape of a Llama-style model built from scratch.

    Fields: ``hidden_size`` (model width), ``layers`` (decoder blocks), ``heads`` (attention
    heads, which must divide ``hidden_size``; key/value heads are the same number) and
    ``intermediate_size`` (MLP width).
    """

    hidden_size: int
    layers: int
    heads: int
    intermediate_size: int

    def describe(self) -> str:
        """One-line human description, e.g. ``hidden 256, 4 layers, 4 heads, mlp 688``."""
        return (f"hidden {self.hidden_size}, {self.layers} layers, {self.heads} heads, "
                f"mlp {self.intermediate_size}")


# Parameter counts are with the byte tokenizer's 259-token vocabulary and untied embeddings.
PRESETS: Dict[str, ModelSize] = {
    "tiny": ModelSize(96, 2, 4, 256),        # ~0.27M params: tests
    "mini": ModelSize(256, 4, 4, 688),       # ~3.3M params: the default, ~1 min on 2 CPU cores
    "small": ModelSize(512, 6, 8, 1376),     # ~19M params
    "base": ModelSize(768, 12, 12, 3072),    # ~113M params
}
DEFAULT_PRESET = "mini"


def resolve_size(args: argparse.Namespace) -> ModelSize:
    """The preset named by ``args.preset`` (or the default) with per-field flag overrides.

    Raises ``ValueError`` if ``heads`` does not divide ``hidden_size`` or the head size is odd
    (rotary embeddings need an even head size).
    """
    base = PRESETS[args.preset or DEFAULT_PRESET]
    size = ModelSize(
        hidden_size=args.hidden_size or base.hidden_size,
        layers=args.layers or base.layers,
        heads=args.heads or base.heads,
        intermediate_size=args.intermediate_size or base.intermediate_size,
    )
    if size.hidden_size % size.heads or (size.hidden_size // size.heads) % 2:
        raise ValueError(f"--heads {size.heads} must divide --hidden-size {size.hidden_size} "
                         f"into an even head size")
    return size


def model_source(args: argparse.Namespace) -> Dict[str, Any]:
    """The engine's keyword arguments that give an empty model (``build_model(args,
    empty=True)``) its values: ``{"load_from": DIR}`` for ``--model DIR`` (streamed from its
    safetensors), ``{"init": "model"}`` for a preset (the model's own initialiser, one unit at
    a time, after ``torch.manual_seed(--seed)``)."""
    return {"load_from": str(args.model)} if args.model is not None else {"init": "model"}


def build_model(args: argparse.Namespace, empty: bool = False
                ) -> Tuple[torch.nn.Module, Any, str]:
    """Build or load the model and its tokenizer.

    Returns ``(model, tokenizer, description)``: an fp32 causal LM in train mode, a tokenizer
    with ``encode``/``eos_id``/``vocab_size`` (see :mod:`offload_zero.data`), and a one-line
    description. With ``empty`` the model's parameters are on the meta device (built under
    accelerate's ``init_empty_weights()`` from the preset or ``config.json``, nothing read
    or allocated): give the engine :func:`model_source`'s arguments. Raises ``ValueError`` on
    conflicting flags, a missing checkpoint, a tokenizer that does not fit the model's
    vocabulary, or a sequence length beyond the model's.
    """
    import transformers  # deferred: importing transformers takes seconds

    torch.manual_seed(args.seed)
    if empty:
        from accelerate import init_empty_weights
    else:
        init_empty_weights = contextlib.nullcontext
    if args.model is None:
        size = resolve_size(args)
        tokenizer = data_lib.ByteTokenizer()
        config = transformers.LlamaConfig(
            vocab_size=tokenizer.vocab_size, hidden_size=size.hidden_size,
            num_hidden_layers=size.layers, num_attention_heads=size.heads,
            num_key_value_heads=size.heads, intermediate_size=size.intermediate_size,
            max_position_embeddings=max(args.seq_len, 512),
            bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id)
        with init_empty_weights():
            model = transformers.LlamaForCausalLM(config)
        return model.train(), tokenizer, f"preset {args.preset or DEFAULT_PRESET} ({size.describe()})"

    size_flags = [f for f in ("preset", "hidden_size", "layers", "heads", "intermediate_size")
                  if getattr(args, f) is not None]
    if size_flags:
        names = ", ".join("--" + f.replace("_", "-") for f in size_flags)
        raise ValueError(f"{names} cannot be combined with --model (the checkpoint fixes the size)")
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {str(folder)!r} is not a Hugging Face checkpoint folder "
                         f"(no config.json)")
    if getattr(args, "no_progress", False):
        transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar too
    if empty:
        config = transformers.AutoConfig.from_pretrained(str(folder))
        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.tie_weights()  # (init_empty_weights unties them)
        if (folder / "generation_config.json").is_file():  # as from_pretrained takes it
            model.generation_config = transformers.GenerationConfig.from_pretrained(str(folder))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                                  dtype=torch.float32)
    vocab_rows = model.get_input_embeddings().num_embeddings
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = data_lib.HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(folder)))
        if tokenizer.vocab_size > vocab_rows:
            raise ValueError(f"the tokenizer in {str(folder)!r} has {tokenizer.vocab_size} tokens "
                             f"but the model's embedding has only {vocab_rows} rows")
    elif vocab_rows >= data_lib.ByteTokenizer.NUM_BYTES:
        log.warning("no tokenizer files in %s; using the byte tokenizer (model vocabulary: %d)",
                    folder, vocab_rows)
        tokenizer = data_lib.ByteTokenizer(with_specials=vocab_rows >= 259)
    else:
        raise ValueError(f"{str(folder)!r} has no tokenizer files and its vocabulary "
                         f"({vocab_rows} tokens) is too small for the byte tokenizer (256)")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and args.seq_len > max_pos:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's "
                         f"max_position_embeddings {max_pos}")
    return model.train(), tokenizer, f"checkpoint {folder}"


def tokenizer_name(tokenizer) -> str:
    """The tokenizer's name for the summary: its Hugging Face class, or ``byte`` (``byte (no
    specials)`` without the bos/eos/pad tokens)."""
    if isinstance(tokenizer, data_lib.HFTokenizer):
        return type(tokenizer.tokenizer).__name__
    return "byte" if tokenizer.eos_id is not None else "byte (no specials)"
