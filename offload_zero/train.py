"""``offload-zero train``: train or fine-tune a causal LM with :class:`OffloadEngine`.

The model is either a Llama-style causal LM built from ``transformers.LlamaConfig`` (size from
a named preset, optionally overridden per field) with the byte tokenizer of
:mod:`offload_zero.data`, or a local Hugging Face checkpoint (``--model DIR``) with its own
tokenizer. Text comes from ``--data`` files/directories, or by default from the Python standard
library's sources. The run ends with a summary (losses, peak bytes per tier, NVMe traffic,
time, throughput) printed to stdout and optionally written as JSON. ``--save DIR`` keeps the
trained weights as ``DIR/model.safetensors`` (with the Hugging Face config, generation config
and tokenizer), a folder that ``--model DIR`` and
``transformers.AutoModelForCausalLM.from_pretrained`` load.

:func:`add_arguments` fills the ``train`` sub-parser; :func:`run` executes a parsed namespace
and returns the summary. Bad user input raises ``ValueError`` (the CLI turns it into a
one-line message and exit status 2).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from offload_zero import data as data_lib
from offload_zero.memory.owner import pid_alive as _pid_alive
from offload_zero.tables import DTYPES

log = logging.getLogger("offload_zero.train")

# File names whose presence in a checkpoint folder means it ships a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "spiece.model", "vocab.txt")
_DTYPES = DTYPES
# The file --save writes the weights to: the name transformers' from_pretrained looks for first.
WEIGHTS_NAME = "model.safetensors"


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
DEFAULTS = dict(offload="cpu", stage=3, steps=50, seq_len=128, batch_size=8, lr=2e-3,
                weight_decay=0.0, seed=0, dtype="fp32", log_every=10)
DESCRIPTION = f"""\
Train a Llama-style causal LM from scratch (default: preset {DEFAULT_PRESET!r}, byte-level
tokenizer) or fine-tune a local Hugging Face checkpoint (--model DIR), with ZeRO stage 1/2/3
and parameters/optimizer state offloaded to host memory or NVMe files.

Text comes from --data files or directories, or by default from the Python standard library's
*.py sources (read lazily, only as much as the run needs). Each step feeds --batch-size windows
of --seq-len tokens per rank; under torchrun every rank gets a disjoint share of the windows.

Shows a progress bar (loss, tokens/s) and ends with a summary on stdout: first and last loss,
peak bytes per tier (device, host, nvme; the engine's own accounting) beside the process's
peak RSS, NVMe bytes read and written, wall time and tokens/s.
--json FILE writes the same summary as JSON. --save DIR writes the trained weights to
DIR/model.safetensors, with the model's config.json, its generation_config.json (eos/pad ids
and other generate() settings) and its tokenizer (if it has a Hugging Face one): a folder that
--model DIR fine-tunes further and transformers' from_pretrained loads.

Defaults: preset {DEFAULT_PRESET!r} (~3M parameters), {DEFAULTS['steps']} steps of {DEFAULTS['batch_size']} x {DEFAULTS['seq_len']} tokens, --offload {DEFAULTS['offload']},
--stage {DEFAULTS['stage']}, fp32: about a minute on two CPU cores.
"""


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``train`` flag (with its default shown in ``--help``) to ``parser``."""
    d = DEFAULTS
    model = parser.add_argument_group("model (a preset built from scratch, or --model DIR)")
    presets = "; ".join(f"{k}: {v.describe()}" for k, v in PRESETS.items())
    model.add_argument("--preset", choices=list(PRESETS), default=None,
                       help=f"model size preset (default: {DEFAULT_PRESET}). {presets}")
    for flag, field in (("--hidden-size", "hidden_size"), ("--layers", "layers"),
                        ("--heads", "heads"), ("--intermediate-size", "intermediate_size")):
        model.add_argument(flag, type=_positive_int, default=None, metavar="N",
                           help=f"override the preset's {field.replace('_', ' ')}")
    model.add_argument("--model", metavar="DIR", default=None,
                       help="fine-tune a local Hugging Face causal-LM checkpoint instead "
                            "(uses its tokenizer; the byte tokenizer if it has none)")

    data = parser.add_argument_group("data")
    data.add_argument("--data", nargs="+", metavar="PATH", default=None,
                      help="text files or directories (walked for text files); default: the "
                           "Python standard library's *.py sources, read lazily")
    data.add_argument("--seq-len", type=_positive_int, default=d["seq_len"], metavar="T",
                      help="tokens per sequence (default: %(default)s)")
    data.add_argument("--batch-size", type=_positive_int, default=d["batch_size"], metavar="B",
                      help="sequences per step on each rank (default: %(default)s)")
    data.add_argument("--seed", type=int, default=d["seed"],
                      help="seeds model init and data order (default: %(default)s)")

    engine = parser.add_argument_group("engine")
    engine.add_argument("--offload", choices=["none", "cpu", "nvme", "auto"], default=d["offload"],
                        help="where optimizer state and parameter shards live "
                             "(default: %(default)s)")
    engine.add_argument("--path", metavar="DIR", default=None,
                        help="NVMe swap folder for --offload nvme (default: a fresh temporary "
                             "folder under the system temp dir, removed at exit)")
    engine.add_argument("--stage", type=int, choices=[1, 2, 3], default=d["stage"],
                        help="ZeRO stage (default: %(default)s)")
    engine.add_argument("--dtype", choices=sorted(_DTYPES), default=d["dtype"],
                        help="compute dtype; master weights stay fp32; fp16 scales the loss "
                             "dynamically (default: %(default)s)")

    optim = parser.add_argument_group("optimization")
    optim.add_argument("--steps", type=_positive_int, default=d["steps"],
                       help="optimizer steps (default: %(default)s)")
    optim.add_argument("--lr", type=_positive_float, default=d["lr"],
                       help="peak learning rate of AdamW (default: %(default)s)")
    optim.add_argument("--warmup", type=_nonnegative_int, default=None, metavar="STEPS",
                       help="linear warmup steps before cosine decay to lr/10, 0 to --steps "
                            "(default: steps/10, at most 100)")
    optim.add_argument("--grad-accum", type=_positive_int, default=1, metavar="N",
                       help="micro-batches per optimizer step (gradient accumulation, as "
                            "DeepSpeed's: backward and step on each, the update on every N-th); "
                            "--steps, --warmup and the progress count optimizer steps, each of "
                            "N x --batch-size sequences per rank; needs --no-step-in-backward "
                            "(the default then) (default: %(default)s)")
    optim.add_argument("--weight-decay", type=float, default=d["weight_decay"], metavar="WD",
                       help="AdamW weight decay (default: %(default)s)")

    out = parser.add_argument_group("output")
    out.add_argument("--log-every", type=_nonnegative_int, default=d["log_every"], metavar="N",
                     help="log a line every N steps, 0 for never (default: %(default)s)")
    out.add_argument("--json", metavar="FILE", default=None,
                     help="also write the summary as JSON to FILE")
    out.add_argument("--save", metavar="DIR", default=None,
                     help=f"after training, write the full weights to DIR/{WEIGHTS_NAME} with "
                          "config.json, generation_config.json and the tokenizer (a folder "
                          "--model DIR and "
                          "transformers' from_pretrained load); DIR is created if missing")
    out.add_argument("--checkpoint", metavar="DIR", default=None,
                     help="save the training state (weights, optimizer state, step) to DIR at "
                          "the end, and every --checkpoint-every steps; --resume DIR continues "
                          "from it. A DIR that holds a checkpoint is only replaced by the run "
                          "that resumes it")
    out.add_argument("--checkpoint-every", type=_nonnegative_int, default=0, metavar="N",
                     help="with --checkpoint: also save every N steps (default: only at the end)")
    out.add_argument("--resume", metavar="DIR", default=None,
                     help="continue the run saved by --checkpoint DIR: same model, --data, "
                          "--seed, --batch-size, --seq-len, --stage, --dtype and world size (and "
                          "its --[no-]step-in-backward unless given); it trains from the saved "
                          "step up to --steps, on the batches it had not seen")
    out.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    out.add_argument("--memory-plot", metavar="FILE.png", default=None,
                     help="draw bytes per tier (device, host, NVMe) over the steps to this PNG")
    engine.add_argument("--deepspeed", metavar="DS.json", default=None,
                        help="take stage, offload, dtype, optimizer, clipping, schedule, batch "
                             "size and accumulation from a DeepSpeed config (see "
                             "docs/deepspeed.md); a flag given as well must agree with it, and "
                             "fills its \"auto\" values")
    engine.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each layer's forward in backward (less activation memory)")
    engine.add_argument("--step-in-backward", action=argparse.BooleanOptionalAction, default=None,
                        help="update each unit as soon as its gradient is final in backward, "
                             "hiding NVMe optimizer I/O behind backward (this loop runs one "
                             "backward per step and does not clip; default: on at stages 2-3, "
                             "off with --dtype fp16, whose overflowed steps are then skipped "
                             "whole, and with --step-in-forward)")
    engine.add_argument("--step-in-forward", action=argparse.BooleanOptionalAction, default=None,
                        help="apply each unit's update just before its next gather, hiding the "
                             "NVMe optimizer I/O behind the next forward (same numbers as the "
                             "plain step; stage 3; default: on with --offload nvme at stage 3 "
                             "when --step-in-backward is off, as with --dtype fp16)")


def _step_in_backward(args) -> bool:
    """``--step-in-backward``: on by default at stages 2-3 except with ``--dtype fp16`` (an
    overflow there would skip only the units whose gradients overflowed, not the whole step),
    ``--step-in-forward`` or ``--grad-accum`` above 1 (it updates in each backward);
    asked for at stage 1 or with ``--grad-accum`` above 1 is an error (gradients are reduced
    only in step() there, or must accumulate)."""
    if args.step_in_backward and args.stage < 2:
        raise ValueError(f"--step-in-backward needs --stage 2 or 3, got --stage {args.stage}")
    accum = getattr(args, "grad_accum", 1)
    if args.step_in_backward and accum > 1:
        raise ValueError(f"--step-in-backward updates in each backward, so it cannot "
                         f"accumulate --grad-accum {accum} micro-batches; give "
                         "--no-step-in-backward (or --grad-accum 1)")
    if args.step_in_backward is None:  # (an explicit --step-in-forward turns it off)
        return (args.stage >= 2 and args.dtype != "fp16" and not args.step_in_forward
                and accum == 1 and not getattr(args, "ds_kwargs", {}).get("max_grad_norm"))
    return args.step_in_backward


def _step_in_forward(args, step_in_backward: bool) -> Optional[bool]:
    """``--step-in-forward``: None by default, the engine's choice
    (:func:`offload_zero.config.default_step_in_forward`: on with the optimizer state on NVMe
    at stage 3 when the step does not run in backward, i.e. fp16 or ``--no-step-in-backward``;
    with ``--offload auto`` once the engine has placed the state); asked for with
    ``--step-in-backward`` or below stage 3 it is an error."""
    if args.step_in_forward and args.stage != 3:
        raise ValueError(f"--step-in-forward needs --stage 3, got --stage {args.stage}")
    if args.step_in_forward and step_in_backward:
        raise ValueError("--step-in-forward and --step-in-backward exclude each other (give "
                         "--no-step-in-backward with --step-in-forward)")
    return args.step_in_forward


def lr_at(step: int, steps: int, peak_lr: float, warmup: int) -> float:
    """Learning rate for 0-based ``step``: linear warmup, then cosine decay to ``peak_lr/10``."""
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = 0.1 * peak_lr
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


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


def _tokenizer_name(tokenizer) -> str:
    if isinstance(tokenizer, data_lib.HFTokenizer):
        return type(tokenizer.tokenizer).__name__
    return "byte" if tokenizer.eos_id is not None else "byte (no specials)"


def _mean(values: List[float]) -> float:
    return sum(values) / len(values)


def _peak(report: Dict[str, Any], tier: str) -> int:
    return int(report.get(tier, {}).get("peak_bytes", 0))


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes, as the OS counts it (``getrusage``'s
    ``ru_maxrss``: KiB on Linux): everything the process touched, torch and the
    activations included, unlike the engine's accounting of its own buffers. 0 where
    ``resource`` is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # macOS: bytes


def summarize(losses: List[float], report: Dict[str, Any], *, wall_s: float, tokens: int,
              extra: Dict[str, Any]) -> Dict[str, Any]:
    """Build the run summary (a JSON-ready dict).

    ``losses`` are per-step training losses (nats/token); ``first_loss``/``last_loss`` average
    the first/last ``max(1, min(5, steps // 3))`` of them. ``report`` is
    ``engine.memory_report()``; peak bytes per tier and NVMe read/written bytes are taken from
    it: what the engine holds by its own accounting, not the process's RSS (``extra``'s
    ``peak_rss_bytes``, from :func:`peak_rss_bytes`). ``wall_s`` is the training loop's wall
    time in seconds and ``tokens`` the number of tokens it consumed on all ranks. ``extra``
    entries are copied in first.
    """
    k = max(1, min(5, len(losses) // 3))
    nvme = report.get("nvme", {})
    summary = dict(extra)
    summary.update(
        first_loss=_mean(losses[:k]),
        last_loss=_mean(losses[-k:]),
        loss_window_steps=k,
        losses=losses,
        peak_bytes={tier: _peak(report, tier) for tier in ("device", "host", "nvme")},
        nvme_read_bytes=int(nvme.get("read_bytes", 0)),
        nvme_written_bytes=int(nvme.get("written_bytes", 0)),
        wall_s=wall_s,
        tokens=tokens,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        memory_report=report,
    )
    return summary


def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_summary(s: Dict[str, Any]) -> str:
    """Render a :func:`summarize` dict as the human-readable block printed at the end."""
    peak = s["peak_bytes"]
    k = s["loss_window_steps"]
    return "\n".join([
        "offload-zero train: summary",
        f"  model        {s['model']}, {s['params'] / 1e6:.2f}M params, tokenizer {s['tokenizer']}",
        f"  engine       offload {s['offload']}, stage {s['stage']}, dtype {s['dtype']}, "
        f"world size {s['world_size']}"
        + (", step in backward" if s.get("step_in_backward") else "")
        + (", step in forward" if s.get("step_in_forward") else "")
        + (f", {s['grad_accum']} micro-batches a step" if s.get("grad_accum", 1) > 1 else ""),
    ] + ([f"  deepspeed    {s['deepspeed']}"] if s.get("deepspeed") else []) + [
        f"  loss         first {s['first_loss']:.4f} -> last {s['last_loss']:.4f} "
        f"(mean of {k} step(s) each)" + _skipped_note(s),
        f"  peak memory  engine-held (accounting): device {_fmt_bytes(peak['device'])} | "
        f"host {_fmt_bytes(peak['host'])} | nvme {_fmt_bytes(peak['nvme'])}",
    ] + ([f"  peak memory  process peak RSS {_fmt_bytes(s['peak_rss_bytes'])} (the OS's count: "
          "torch, the model, activations and all)"] if s.get("peak_rss_bytes") else []) + [
        f"  nvme i/o     read {_fmt_bytes(s['nvme_read_bytes'])} | "
        f"written {_fmt_bytes(s['nvme_written_bytes'])}",
        f"  time         {s['wall_s']:.1f} s for {s['steps']} steps "
        + (f"after step {s['resumed_from']} (resumed) " if s.get("resumed_from") is not None else "")
        + f"(+{s['setup_s']:.1f} s setup), {s['tokens_per_s']:,.0f} tokens/s",
    ] + ([f"  checkpoint   {s['checkpoint']} (training state; --resume continues it)"]
         if s.get("checkpoint") else []) + _saved_lines(s.get("saved")))


def _skipped_note(s: Dict[str, Any]) -> str:
    """``; N step(s) skipped (inf/nan gradients)`` and the final loss scale, when there are."""
    note = ""
    if s.get("skipped_steps"):
        note += f"; {s['skipped_steps']} step(s) skipped (inf/nan gradients)"
    if s.get("loss_scale") is not None:
        note += f"; loss scale {s['loss_scale']:g}"
    return note


def _saved_lines(saved: Optional[Dict[str, Any]]) -> List[str]:
    """The summary's ``saved`` line (where ``--save`` put the weights), or none."""
    if not saved:
        return []
    others = [f for f in saved["files"] if f != WEIGHTS_NAME]
    extra = f"; with {', '.join(others)}" if others else ""
    return [f"  saved        {saved['weights']} ({_fmt_bytes(saved['weights_bytes'])}, "
            f"{saved['tensors']} tensors){extra}"]


def _train_loop(engine, batches, args, warmup: int, tokens_per_step: int,
                is_rank0: bool, memory_trace: Optional[List[Dict[str, int]]] = None,
                start_step: int = 0, run_state: Optional[Dict[str, Any]] = None
                ) -> Tuple[List[float], float]:
    """Run optimizer steps ``start_step`` .. ``args.steps - 1`` (``batches`` already past the
    first ``start_step * args.grad_accum`` batches), each of ``--grad-accum`` micro-batches
    (forward, backward and step on each: the engine updates on the last); return ``(per-step
    losses, wall seconds)``, a step's loss the mean of its micro-batches'. With
    ``--checkpoint`` the training state is saved with ``run_state`` every
    ``--checkpoint-every`` steps and after the last one (see :func:`save_training_state`).

    With ``memory_trace`` a list, appends after each step ``{tier: current_bytes,
    tier + "_peak": peak_bytes so far}`` for tiers device, host, nvme.

    On rank 0 shows the progress bar (unless ``--no-progress``) and writes a log line to
    stderr every ``--log-every`` steps, with rank 0's own loss (marked ``(rank 0)`` when there
    are several ranks: the summary gives the mean over ranks).
    """
    from tqdm import tqdm

    device = getattr(engine, "device", None)
    losses: List[float] = []
    bar = tqdm(total=args.steps, initial=start_step, unit="step",
               disable=not is_rank0 or args.no_progress, dynamic_ncols=True)
    # several ranks: the progress shows rank 0's own loss (the summary, the mean over ranks)
    whose = " (rank 0)" if getattr(engine, "world_size", 1) > 1 else ""
    start = time.perf_counter()
    try:
        for step in range(start_step, args.steps):
            if getattr(engine, "lr_scheduler", None) is None:
                engine.set_lr(lr_at(step, args.steps, args.lr, warmup))
            lr = engine.lr  # (a DeepSpeed schedule steps itself after each update)
            micro = []
            for _ in range(args.grad_accum):
                input_ids, labels = next(batches)  # (B, T) int64 each
                if device is not None:
                    input_ids, labels = input_ids.to(device), labels.to(device)
                out = engine(input_ids=input_ids, labels=labels, use_cache=False)
                engine.backward(out.loss)
                engine.step()  # (an update on the last micro-batch of the step)
                micro.append(float(out.loss.detach().float().item()))
            loss = _mean(micro)
            if not math.isfinite(loss):
                raise ValueError(f"loss became {loss} at step {step + 1}; try a lower --lr")
            losses.append(loss)
            if memory_trace is not None:
                rep = engine.memory_report()
                sample = {}
                for tier in ("device", "host", "nvme"):
                    sample[tier] = rep[tier]["current_bytes"]
                    sample[tier + "_peak"] = rep[tier]["peak_bytes"]
                memory_trace.append(sample)
            every = args.checkpoint_every
            if args.checkpoint and (step + 1 == args.steps or (every and (step + 1) % every == 0)):
                save_training_state(engine, args, step + 1, run_state)
            elapsed = time.perf_counter() - start
            tok_s = tokens_per_step * (step + 1 - start_step) / elapsed
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            bar.update(1)
            if is_rank0 and args.log_every and ((step + 1) % args.log_every == 0
                                                or step + 1 == args.steps):
                tqdm.write(f"step {step + 1}/{args.steps}  loss {loss:.4f}{whose}  lr {lr:.2e}  "
                           f"{tok_s:,.0f} tokens/s", file=sys.stderr)
    finally:
        bar.close()
    return losses, time.perf_counter() - start


def save_training_state(engine, args: argparse.Namespace, step: int, run_state: Dict[str, Any]
                        ) -> None:
    """``engine.save_checkpoint(--checkpoint)`` with the run's ``step`` and ``run_state`` (what
    :func:`resumed_step` checks: the data order, the layout, the schedule, the corpus), for
    ``--resume``. Collective. Atomic: a failed save leaves the previous one, and raises
    ``ValueError`` naming ``--checkpoint`` and the cause (e.g. no space left on the device)."""
    state = {"step": step, **run_state}
    if getattr(engine, "lr_scheduler", None) is not None:  # (--deepspeed's schedule)
        state["lr_scheduler"] = engine.lr_scheduler.state_dict()
    try:
        engine.save_checkpoint(args.checkpoint, client_state=state)
    except OSError as exc:
        raise ValueError(f"--checkpoint {args.checkpoint!r} cannot be written at step {step}: "
                         f"{exc}; the checkpoint saved before (if any) is kept") from None


def plot_memory(trace: List[Dict[str, int]], path: str, title: str = "") -> None:
    """Draw bytes per tier over the steps (solid: held after the step; dashed: peak so far) to
    a PNG at ``path`` with matplotlib. ``trace``: one dict per step as :func:`_train_loop` fills.
    Raises ValueError if matplotlib is missing or ``path`` cannot be written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--memory-plot needs matplotlib: pip install matplotlib") from None
    steps = list(range(1, len(trace) + 1))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for tier, color in (("device", "tab:red"), ("host", "tab:blue"), ("nvme", "tab:green")):
        ax.plot(steps, [s[tier] / 2**20 for s in trace], color=color, label=f"{tier} (held)")
        ax.plot(steps, [s[tier + "_peak"] / 2**20 for s in trace], color=color, ls="--",
                label=f"{tier} (peak)")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_title(title or "memory per tier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ValueError(f"--memory-plot {path!r} cannot be written: {exc}") from None
    finally:
        plt.close(fig)


def _reduce_across_ranks(losses: List[float], report: Dict[str, Any], peak_rss: int
                         ) -> Tuple[List[float], Dict[str, Any], int]:
    """Make the summary global: mean loss per step over ranks, max peak bytes per tier and
    max peak RSS (bytes), summed NVMe traffic. Needs the engine's process group (call before
    ``engine.close()``)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return losses, report, peak_rss
    loss_sum = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_sum)
    tiers = ("device", "host", "nvme")
    peaks = torch.tensor([report.get(t, {}).get("peak_bytes", 0) for t in tiers] + [peak_rss],
                         dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    nvme = report.get("nvme", {})
    traffic = torch.tensor([nvme.get("read_bytes", 0), nvme.get("written_bytes", 0)],
                           dtype=torch.int64)
    dist.all_reduce(traffic)
    merged = {t: dict(report.get(t, {}), peak_bytes=int(v)) for t, v in zip(tiers, peaks[:3])}
    merged["nvme"].update(read_bytes=int(traffic[0]), written_bytes=int(traffic[1]))
    merged["rank0"] = report
    world_size = dist.get_world_size()
    return (loss_sum / world_size).tolist(), merged, int(peaks[3])


def nvme_bytes_needed(args: argparse.Namespace, model: torch.nn.Module, step_in_backward: bool,
                      step_in_forward: Optional[bool]) -> int:
    """Bytes the swap files of ``--offload nvme`` take on ``--path``'s file system: one rank's
    (:func:`offload_zero.estimator.placement_bytes` on the engine's layout, at the world size
    of ``WORLD_SIZE``) times the ranks of this node (``LOCAL_WORLD_SIZE``), which share it."""
    from offload_zero.estimator import placement_bytes
    from offload_zero.tables import default_offload_param
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    placement = placement_bytes(model, args.stage, "nvme",
                                default_offload_param("nvme", args.stage), world_size,
                                _DTYPES[args.dtype], accelerator=torch.cuda.is_available(),
                                step_in_backward=step_in_backward,
                                step_in_forward=step_in_forward)
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
    needs = f"the run needs {_fmt_bytes(need)} of swap files there, " if need is not None else ""
    return (f"{needs}{_fmt_bytes(free)} free: train a smaller model, use --offload auto (it "
            "keeps on disk only what does not fit in memory), or give another --path on a "
            "larger disk")


def check_disk_space(path: Optional[str], need: int) -> None:
    """Raise ValueError (one line: the bytes needed, the bytes free, what to do) if ``need``
    bytes of swap files do not fit in the free space of ``path``'s file system (``None``: the
    system temp dir, where the run's temporary swap folder goes). Creates nothing."""
    if need > shutil.disk_usage(_disk_folder(path)).free:
        where = path if path is not None else tempfile.gettempdir()
        raise ValueError(f"--offload nvme: not enough space on the file system of {where!r}: "
                         f"{_disk_advice(path, need)}")


@contextlib.contextmanager
def _disk_full_as_value_error(path: Optional[str], need: Optional[int]) -> Iterator[None]:
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
def _swap_folder(offload: str, path: Optional[str]) -> Iterator[Optional[str]]:
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
                    len(stale), _fmt_bytes(sum(n for _, n in stale)),
                    " ".join(f for f, _ in stale))


def check_args(args: argparse.Namespace) -> None:
    """Check the flags that can be checked before anything is built, so a bad one fails in a
    second instead of after the whole run. Writes nothing.

    Raises ``ValueError`` (naming the flag and its value) if ``--warmup`` is more than
    ``--steps``; ``--path`` is given without ``--offload nvme``/``auto``, is not a folder or has
    no parent folder; the folder of ``--json`` / ``--memory-plot`` is missing or not
    writable; ``--save`` is not a folder or cannot be created (see :func:`check_save_dir`);
    or a ``--checkpoint`` / ``--resume`` flag is bad (see :func:`check_checkpoint_args`).
    """
    if args.warmup is not None and args.warmup > args.steps:
        raise ValueError(f"--warmup {args.warmup} is more than --steps {args.steps}; "
                         f"give --warmup between 0 and {args.steps}")
    if args.path is not None and args.offload not in ("nvme", "auto"):
        raise ValueError(f"--path is only used with --offload nvme or auto (got --offload {args.offload})")
    if args.path is not None:
        parent = os.path.dirname(os.path.abspath(args.path))
        if os.path.exists(args.path) and not os.path.isdir(args.path):
            raise ValueError(f"--path {args.path!r} is not a folder")
        if not os.path.isdir(parent):
            raise ValueError(f"--path {args.path!r}: its parent folder {parent!r} does not exist")
    for flag, out in (("--json", args.json), ("--memory-plot", args.memory_plot)):
        if out is not None:
            folder = os.path.dirname(os.path.abspath(out))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise ValueError(f"{flag} {out!r}: folder {folder!r} does not exist or is not writable")
    if args.save is not None:
        check_save_dir(args.save)
    check_checkpoint_args(args)


# train flag (its dest) -> the engine keyword or DeepSpeed name it sets (see --deepspeed)
_DS_FLAGS = {"stage": "stage", "lr": "lr", "weight_decay": "weight_decay",
             "grad_accum": "gradient_accumulation_steps",
             "batch_size": "train_micro_batch_size_per_gpu", "dtype": "dtype",
             "steps": "total_num_steps", "warmup": "warmup_num_steps", "path": "path"}


def explicit_flags(args: argparse.Namespace) -> set:
    """The dests of the flags given on the command line: ``args.explicit_flags`` (set by
    :func:`offload_zero.cli.main`), else those whose value differs from the default."""
    given = getattr(args, "explicit_flags", None)
    if given is not None:
        return set(given)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    return {k for k, v in vars(args).items() if k in defaults and defaults[k] != v}


def apply_deepspeed_config(args: argparse.Namespace):
    """``--deepspeed FILE``: map the config (:func:`offload_zero.deepspeed_config.
    parse_deepspeed_config`) onto ``args`` (stage, offload, path, dtype, lr, weight decay,
    accumulation, batch size) and ``args.ds_kwargs`` (the engine keywords no flag has). Flags
    given explicitly must agree with the config (ValueError naming both otherwise); every
    flag's value, given or default, resolves the config's ``"auto"``. Returns the
    :class:`~offload_zero.deepspeed_config.DeepSpeedSettings`."""
    from offload_zero.deepspeed_config import parse_deepspeed_config

    explicit = explicit_flags(args)
    values = {name: getattr(args, dest) for dest, name in _DS_FLAGS.items()}
    values["dtype"] = _DTYPES[args.dtype]
    values["warmup_num_steps"] = (args.warmup if args.warmup is not None
                                  else min(100, args.steps // 10))
    # (what this CLI trains with when no flag sets them: the engine's defaults, no clipping)
    values.update(betas=(0.9, 0.999), eps=1e-8, adamw=True, max_grad_norm=None,
                  warmup_min_lr=0.0)
    # (--steps is the run's length, total_num_steps the schedule's: it fills "auto" only)
    overrides = {name: values[name] for dest, name in _DS_FLAGS.items()
                 if dest in explicit and dest != "steps" and values[name] is not None}
    if "offload" in explicit:
        if args.offload == "auto":
            raise ValueError("--offload auto cannot be combined with --deepspeed: the config "
                             "places the state (zero_optimization.offload_*)")
        overrides["offload_optimizer"] = args.offload
        if args.offload == "nvme" and args.stage == 3:
            overrides["offload_param"] = "nvme"
    try:
        settings = parse_deepspeed_config(args.deepspeed, overrides, fallbacks=values)
    except ValueError as exc:  # name the flags, not the keywords
        msg = str(exc)
        for dest, name in _DS_FLAGS.items():
            flag = "--" + dest.replace("_", "-")
            if msg.startswith(f"{name}="):
                msg = f"{flag} " + msg[len(name) + 1:]
            msg = msg.replace(f"pass {name}=... beside the config", f"give {flag}")
        raise ValueError(f"--deepspeed {args.deepspeed}: {msg}") from None
    kw = dict(settings.engine_kwargs)
    args.stage = kw.pop("stage", args.stage)
    args.lr = kw.pop("lr", args.lr)
    args.weight_decay = kw.pop("weight_decay", args.weight_decay)
    args.grad_accum = kw.pop("gradient_accumulation_steps")
    args.batch_size = settings.train_micro_batch_size_per_gpu or args.batch_size
    dtype = kw.pop("dtype", _DTYPES[args.dtype])
    args.dtype = next(k for k, v in _DTYPES.items() if v == dtype)
    devices = (kw.setdefault("offload_optimizer", "none"), kw.setdefault("offload_param", "none"))
    args.offload = "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"
    args.path = kw.pop("path", args.path)
    kw.pop("offload", None)
    if settings.schedule is not None:
        args.warmup = min(settings.schedule.params["warmup_num_steps"], args.steps)
    args.ds_kwargs = kw
    return settings


def _run_identity(args: argparse.Namespace) -> Dict[str, Any]:
    """What a resumed run must share with the saved one for its batches to continue where the
    saved run stopped (the data order depends on all of them)."""
    return {"seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "grad_accum": args.grad_accum}


def read_resume_state(args: argparse.Namespace) -> Dict[str, Any]:
    """The run state that ``--checkpoint`` saved in ``--resume DIR``'s ``checkpoint.json``
    (its ``client_state``): ``step``, ``steps``, ``lr``, ``warmup``, ``seed``, ``batch_size``,
    ``seq_len``, ``grad_accum`` (absent before that flag), ``stage``, ``dtype``,
    ``step_in_backward`` and ``data`` (a fingerprint of the
    corpus). Reads no tensor. Raises ``ValueError`` naming the folder if it holds no complete
    checkpoint, or one that ``offload-zero train --checkpoint`` did not write."""
    from offload_zero.checkpoint import read_metadata
    if not args.resume:
        raise ValueError("--resume needs a checkpoint folder, got an empty name")
    try:
        saved = read_metadata(args.resume).get("client_state")
    except ValueError as exc:
        raise ValueError(f"--resume {args.resume!r}: {exc}") from None
    keys = ("step", "steps", "seed", "batch_size", "seq_len")
    if (not isinstance(saved, dict) or any(k not in saved for k in keys)
            or any(isinstance(saved[k], bool) or not isinstance(saved[k], int) for k in keys)
            or not 0 < saved["step"] <= saved["steps"]):
        raise ValueError(f"--resume {args.resume!r}: its checkpoint was not written by "
                         f"offload-zero train --checkpoint (no valid run state: {saved!r}); "
                         "load it with OffloadEngine.load_checkpoint instead")
    return saved


def _check_resume_world_size(folder: str, world_size: int) -> None:
    """Raise ValueError naming both world sizes if the checkpoint in ``folder`` was saved by
    another number of ranks: each rank's batches depend on it, so the run could not continue
    on the batches it had not seen. (The state itself loads on any world size through
    :meth:`OffloadEngine.load_checkpoint`, which reshards it.)"""
    from offload_zero.checkpoint import read_metadata
    saved = read_metadata(folder).get("world_size")
    if saved != world_size:
        raise ValueError(f"--resume {folder!r}: the saved run had world size {saved}, this one "
                         f"{world_size}; the batches each rank sees depend on it, so resume on "
                         f"{saved} rank(s) (OffloadEngine.load_checkpoint reshards the state "
                         "itself onto any world size)")


def resumed_step(args: argparse.Namespace, saved: Optional[Dict[str, Any]] = None,
                 warn: bool = True) -> int:
    """The step ``--resume DIR`` continues from: the steps the saved run had done.

    ``saved``: :func:`read_resume_state`'s dict (read here if None). Raises ``ValueError`` (see
    :func:`read_resume_state`), or naming the flag and both values if the saved run's
    ``--seed``, ``--batch-size``, ``--seq-len``, ``--grad-accum`` (its data order), ``--stage``
    or ``--dtype``
    differ from this one's, or if it already did ``--steps`` steps or more. Another ``--steps``,
    ``--lr`` or ``--warmup`` is allowed (to train longer, say); with ``warn`` a warning says that
    the learning-rate schedule changes. So is another ``--[no-]step-in-backward``: the same
    numbers either way, and the checkpoint loads into either layout (see
    :func:`offload_zero.checkpoint.load_checkpoint`)."""
    saved = read_resume_state(args) if saved is None else saved
    mine = {**_run_identity(args), "stage": args.stage, "dtype": args.dtype}
    for key, value in mine.items():
        if key == "grad_accum" and saved.get(key, 1) != value:  # (1 before the flag existed)
            raise ValueError(f"--resume {args.resume!r}: the saved run used --grad-accum "
                             f"{saved.get(key, 1)!r}, this one {value!r}; give --grad-accum "
                             f"{saved.get(key, 1)!r} to continue it")
        if key in saved and saved[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"--resume {args.resume!r}: the saved run used {flag} "
                             f"{saved[key]!r}, this one {value!r}; give {flag} "
                             f"{saved[key]!r} to continue it")
    if saved["step"] >= args.steps:
        raise ValueError(f"--resume {args.resume!r}: the saved run already did {saved['step']} "
                         f"steps; give --steps more than {saved['step']} to train further")
    changed = [f"--{k} {saved[k]} -> {v}" for k, v in (("steps", args.steps), ("lr", args.lr),
                                                        ("warmup", args.warmup))
               if saved.get(k) is not None and v is not None and saved[k] != v]
    if warn and changed:
        log.warning("--resume %s: %s: the learning rate follows the new schedule from step %s on",
                    args.resume, ", ".join(changed), saved["step"] + 1)
    return saved["step"]


def data_fingerprint(files: Sequence[os.PathLike]) -> str:
    """A short hash (16 hex digits) of the corpus's files (absolute path and size in bytes of
    each, in order): a resumed run must see the same text to continue where the saved one
    stopped. Raises OSError if a file vanished since it was listed."""
    h = hashlib.sha1()
    for f in files:
        h.update(f"{os.path.abspath(f)}\0{os.path.getsize(f)}\n".encode())
    return h.hexdigest()[:16]


def check_checkpoint_args(args: argparse.Namespace) -> None:
    """The ``--checkpoint`` / ``--resume`` checks of :func:`check_args`; writes nothing.

    Raises ``ValueError`` naming the flag if ``--checkpoint-every`` comes without
    ``--checkpoint``; a folder name is empty; ``--checkpoint`` could not be saved into (a
    file, a folder of other files, an unwritable parent), is the ``--save`` or ``--path``
    folder, or already holds a checkpoint that this run does not ``--resume`` (it would be
    overwritten); or ``--resume`` cannot be continued (see :func:`resumed_step`)."""
    from offload_zero.checkpoint import META_NAME, check_destination
    if args.checkpoint_every and args.checkpoint is None:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint DIR")
    if args.checkpoint is not None:
        if not args.checkpoint:
            raise ValueError("--checkpoint needs a folder, got an empty name")
        try:
            check_destination(args.checkpoint)
        except ValueError as exc:
            raise ValueError(f"--checkpoint {args.checkpoint!r}: {exc}") from None
        real = os.path.realpath(args.checkpoint)
        for flag, other in (("--save", args.save), ("--path", args.path)):
            if other and (real == os.path.realpath(other)
                          or real.startswith(os.path.realpath(other) + os.sep)):
                raise ValueError(f"--checkpoint {args.checkpoint!r} is inside the {flag} folder "
                                 f"{other!r}; give the training state a folder of its own")
        resuming_it = args.resume and os.path.realpath(args.resume) == real
        if os.path.isfile(os.path.join(real, META_NAME)) and not resuming_it:
            raise ValueError(f"--checkpoint {args.checkpoint!r} already holds a checkpoint, which "
                             f"this run would overwrite: continue it with --resume "
                             f"{args.checkpoint}, or give another (or an empty) folder")
    if args.resume is not None:
        resumed_step(args, warn=False)  # the folder holds a checkpoint of this run, before --steps


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
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} is a folder this process cannot write to")
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


def save_checkpoint(folder: str, state_dict: Dict[str, torch.Tensor], *, config: Any = None,
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
            files.extend(_save_generation_config(folder, generation_config))
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
        raise ValueError(f"--save {folder!r}: cannot write the checkpoint: {exc}") from exc
    files.append(WEIGHTS_NAME)
    return {"dir": folder, "weights": weights, "weights_bytes": os.path.getsize(weights),
            "tensors": len(tensors), "dropped_tied": dropped, "files": files}


def _save_generation_config(folder: str, generation_config: Any) -> List[str]:
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
        raise ValueError(f"--save {str(args.save)!r}: cannot write the checkpoint: {exc}") from exc


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Run ``offload-zero train`` for parsed ``args``; return the summary dict.

    Flags are checked by :func:`check_args` before anything is built. Only rank 0 shows
    progress (its own loss), prints the summary and writes ``--json`` and ``--save`` (every
    rank takes part in gathering the weights; see :func:`save_checkpoint`); with several ranks
    the summary's losses are means over ranks, peak bytes and peak RSS the largest rank's and
    NVMe traffic the sum over ranks. Raises ``ValueError`` on bad input (from this module, the data pipeline
    or the engine) and when ``--save`` cannot be written.
    """
    from offload_zero import OffloadEngine

    setup_start = time.perf_counter()
    settings = apply_deepspeed_config(args) if getattr(args, "deepspeed", None) else None
    check_args(args)  # fail now, not after the whole run
    saved = read_resume_state(args) if args.resume else None
    if (saved is not None and args.step_in_backward is None and not args.step_in_forward
            and "step_in_backward" in saved):
        args.step_in_backward = saved["step_in_backward"]  # (as the saved run: fp16's default)
    step_in_backward = _step_in_backward(args)
    step_in_forward = _step_in_forward(args, step_in_backward)
    start_step = resumed_step(args, saved) if saved is not None else 0
    files = data_lib.find_text_files(args.data) if args.data else data_lib.stdlib_files()
    data_id = data_fingerprint(files)
    if saved is not None and saved.get("data") not in (None, data_id):
        raise ValueError(f"--resume {args.resume!r}: the saved run trained on other text (its "
                         "--data files, or their sizes, differ); give the same --data to "
                         "continue it")
    run_state = {**_run_identity(args), "steps": args.steps, "lr": args.lr, "warmup": args.warmup,
                 "stage": args.stage, "dtype": args.dtype, "step_in_backward": step_in_backward,
                 "data": data_id}
    model, tokenizer, description = build_model(args, empty=True)
    params = sum(p.numel() for p in model.parameters())
    warmup = args.warmup if args.warmup is not None else min(100, args.steps // 10)
    nvme_need = None
    if args.offload == "nvme":
        nvme_need = nvme_bytes_needed(args, model, step_in_backward, step_in_forward)
        check_disk_space(args.path, nvme_need)

    with _disk_full_as_value_error(args.path, nvme_need), \
            _swap_folder(args.offload, args.path) as path, (settings.build if settings else OffloadEngine)(
            model, offload=args.offload, path=path, stage=args.stage, lr=args.lr,
            weight_decay=args.weight_decay, dtype=_DTYPES[args.dtype],
            activation_checkpointing=args.activation_checkpointing,
            step_in_backward=step_in_backward, step_in_forward=step_in_forward,
            gradient_accumulation_steps=args.grad_accum,
            **getattr(args, "ds_kwargs", {}), **model_source(args)) as engine:
        rank, world_size = engine.rank, engine.world_size
        offload_shown = args.offload
        if args.offload == "auto":  # say what was chosen
            offload_shown = (f"auto (optimizer {engine.config.offload_optimizer}, "
                             f"parameters {engine.config.offload_param})")
        batches = data_lib.TokenWindows(files, tokenizer, args.seq_len, seed=args.seed,
                                        world_size=world_size, rank=rank
                                        ).batches(args.batch_size)
        if args.resume:
            _check_resume_world_size(args.resume, world_size)
            engine.load_checkpoint(args.resume)
        skipped_before = engine.skipped_steps  # a resumed run reports its own steps only
        if args.resume:
            for _ in range(start_step * args.grad_accum):  # the batches the saved run trained on
                next(batches)
            if engine.lr_scheduler is not None and "lr_scheduler" in saved:
                engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        engine.train()
        tokens_per_step = args.batch_size * args.seq_len * world_size * args.grad_accum
        setup_s = time.perf_counter() - setup_start
        trace: Optional[List[Dict[str, int]]] = [] if args.memory_plot else None
        losses, wall_s = _train_loop(engine, batches, args, warmup, tokens_per_step,
                                     is_rank0=rank == 0, memory_trace=trace,
                                     start_step=start_step, run_state=run_state)
        report = engine.memory_report()
        skipped = engine.skipped_steps - skipped_before
        loss_scale = engine.loss_scaler.scale if engine.loss_scaler is not None else None
        peak_rss = peak_rss_bytes()
        if world_size > 1:
            losses, report, peak_rss = _reduce_across_ranks(losses, report, peak_rss)
        # every rank takes part in the gathers; rank 0 writes, one unit at a time
        saved = export(engine, args, tokenizer) if args.save else None
        if rank != 0:
            saved = None
    summary = summarize(losses, report, wall_s=wall_s, tokens=tokens_per_step * (args.steps - start_step),
                        extra=dict(
                            model=description, params=params,
                            tokenizer=_tokenizer_name(tokenizer),
                            corpus="data" if args.data else "stdlib",
                            files=len(files), offload=offload_shown, stage=args.stage,
                            dtype=args.dtype, steps=args.steps - start_step,
                            resumed_from=start_step if args.resume else None,
                            checkpoint=args.checkpoint, seq_len=args.seq_len,
                            batch_size=args.batch_size, grad_accum=args.grad_accum,
                            world_size=world_size, rank=rank,
                            lr=args.lr, warmup=warmup, seed=args.seed, setup_s=setup_s,
                            step_in_backward=step_in_backward,
                            step_in_forward=engine.config.step_in_forward, skipped_steps=skipped,
                            loss_scale=loss_scale, peak_rss_bytes=peak_rss, saved=saved,
                            deepspeed=(f"{args.deepspeed}: {settings.describe()}"
                                       if settings else None)))
    if rank == 0:
        print(format_summary(summary), flush=True)
        if args.memory_plot:
            plot_memory(trace, args.memory_plot, title=f"{description}, offload {args.offload}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
                f.write("\n")
    return summary
