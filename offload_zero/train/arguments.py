"""The ``train`` command's flags: their defaults and ``--help`` text, the checks made before
anything is built, the defaults of the update-mode flags, and ``--deepspeed``'s mapping onto
the flags."""
from __future__ import annotations

import argparse
import math
import os
from typing import List, Tuple

import torch

from offload_zero.memory.state_format import MOMENT_DTYPES
from offload_zero.tables import DTYPES, parse_bytes  # (DTYPES: the --dtype names -> torch dtypes)
from offload_zero.train.hf_folder import WEIGHTS_NAME, check_save_dir
from offload_zero.train.model import DEFAULT_PRESET, PRESETS
from offload_zero.train.resume import check_checkpoint_args
from offload_zero.train.summary import check_plot_file

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


def _size(text: str) -> int:
    """argparse type of a size flag: bytes, or a number with a unit (``2GB``, ``512MiB``; see
    :func:`offload_zero.tables.parse_bytes`)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    engine.add_argument("--dtype", choices=sorted(DTYPES), default=d["dtype"],
                        help="compute dtype; master weights fp32 unless --master-dtype bf16; "
                             "fp16 scales the loss dynamically (default: %(default)s)")

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
                            "N x --batch-size sequences per rank; not with --update-timing "
                            "backward (auto avoids it) (default: %(default)s)")
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
                          "its --update-timing unless given); it trains from the saved "
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
    engine.add_argument("--moment-dtype", choices=sorted(MOMENT_DTYPES) + ["auto"],
                        default="fp32",
                        help="Adam's moments: fp32 (default: exact AdamW), bf16 (stochastic "
                             "rounding, 8 bytes of state per parameter instead of 12) or int8 "
                             "(blockwise 8-bit, 6.03; see docs/moments.md); off the device "
                             "only; auto (with --offload auto): chosen with the placement")
    engine.add_argument("--master-dtype", choices=("bf16", "fp32"), default="fp32",
                        help="master weights: fp32 (default: exact AdamW) or bf16 (with "
                             "--dtype bf16: the bf16 weights themselves, stochastic rounding, "
                             "2 bytes of state per parameter less; see docs/moments.md); off "
                             "the device only")
    engine.add_argument("--host-cache-bytes", type=_size, default=0, metavar="SIZE",
                        help="with --offload nvme, host memory for optimizer state kept in "
                             "RAM instead of its files (e.g. 2GB; default 0: no cache). Even "
                             "at 0 the input embeddings' state stays in RAM when updates run "
                             "in backward or next_forward (--update-timing auto's usual "
                             "choice at stages 2-3) unless it is over a quarter of the "
                             "model's: its I/O could hide behind no compute (DESIGN.md: "
                             "tail_state_in_host); it counts against this size. What the "
                             "states leave keeps frozen parameter shards (LoRA's base "
                             "weights) in RAM")
    engine.add_argument("--optimizer-prefetch", type=int, default=None, metavar="N",
                        help="with --offload nvme and updates in backward or next_forward, "
                             "whole optimizer states read ahead into host buffers (>= 3 with "
                             "next_forward; default: the least the timing needs). Deeper "
                             "keeps the disk reading while earlier states are written; each "
                             "buffer holds one block's state (12 bytes per parameter)")
    engine.add_argument("--max-host-bytes", type=_size, default=None, metavar="SIZE",
                        help="bound the run's host memory (model states, buffers): the NVMe "
                             "pipeline streams in smaller chunks to fit, or the run stops at "
                             "once saying what is short; with --offload auto, its budget")
    engine.add_argument("--update-timing", default="auto",
                        choices=("step", "backward", "next_forward", "auto"),
                        help="when updates run: step (all in step()), backward (each unit as "
                             "soon as its gradient is final, hiding NVMe optimizer I/O behind "
                             "backward; stages 2-3, no --grad-accum), next_forward (each unit "
                             "just before its next gather, hiding it behind the next forward; "
                             "stage 3), auto (default: backward at stages 2-3, except with "
                             "--dtype fp16, whose overflowed steps are then skipped whole, "
                             "--grad-accum above 1 or clipping; otherwise the engine's auto, "
                             "next_forward with --offload nvme at stage 3). Same numbers in all")


def update_timing(args) -> str:
    """``--update-timing``, as the engine gets it (see
    :func:`offload_zero.update.rules.cli_timing`; ValueError naming the flags)."""
    from offload_zero.update import rules
    return rules.cli_timing(args.update_timing, args.stage, args.dtype == "fp16",
                            getattr(args, "grad_accum", 1),
                            bool(getattr(args, "ds_kwargs", {}).get("max_grad_norm")))


def check_args(args: argparse.Namespace) -> None:
    """Check the flags that can be checked before anything is built, so a bad one fails in a
    second instead of after the whole run. Writes nothing but one empty test file in each
    output folder, removed at once (see :func:`_check_output_paths`).

    Raises ``ValueError`` (naming the flag and its value) if ``--warmup`` is more than
    ``--steps``; ``--moment-dtype auto`` without ``--offload auto``; ``--master-dtype bf16``
    without ``--dtype bf16``; ``--path`` is given
    without ``--offload nvme``/``auto``, is not a folder or has no parent folder; an output
    flag's folder cannot be written (see :func:`_check_output_paths`); ``--save`` is not a
    folder or cannot be created (see :func:`check_save_dir`); or a ``--checkpoint`` /
    ``--resume`` flag is bad (see :func:`check_checkpoint_args`).
    """
    if args.warmup is not None and args.warmup > args.steps:
        raise ValueError(f"--warmup {args.warmup} is more than --steps {args.steps}; "
                         f"give --warmup between 0 and {args.steps}")
    if args.moment_dtype == "auto" and args.offload != "auto":
        raise ValueError(f"--moment-dtype auto needs --offload auto (got --offload "
                         f"{args.offload}); give fp32, bf16 or int8")
    if args.master_dtype == "bf16" and args.dtype != "bf16":
        raise ValueError(f"--master-dtype bf16 needs --dtype bf16 (got --dtype {args.dtype}): "
                         "the master is the bf16 weights themselves; or --master-dtype fp32")
    if args.path is not None and args.offload not in ("nvme", "auto"):
        raise ValueError(f"--path is only used with --offload nvme or auto (got --offload "
                         f"{args.offload})")
    if args.path is not None:
        parent = os.path.dirname(os.path.abspath(args.path))
        if os.path.exists(args.path) and not os.path.isdir(args.path):
            raise ValueError(f"--path {args.path!r} is not a folder")
        if not os.path.isdir(parent):
            raise ValueError(f"--path {args.path!r}: its parent folder {parent!r} does not exist")
    _check_output_paths(args)
    if args.save is not None:
        check_save_dir(args.save)
    check_checkpoint_args(args)


def _output_folders(args: argparse.Namespace) -> List[Tuple[str, str, str, bool]]:
    """``(flag, value, folder, is_file)`` for each output flag given: the folder that the
    run creates its files in. ``--json`` and ``--memory-plot`` name a file (its folder);
    ``--save`` and ``--path`` a folder, made if missing (itself, else the nearest existing
    ancestor ``os.makedirs`` makes it in); ``--checkpoint`` a folder that a save builds as
    a sibling and swaps in (the nearest existing ancestor of its parent)."""
    def existing(folder: str) -> str:
        while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        return folder

    outputs = []
    for flag, value in (("--json", args.json), ("--memory-plot", args.memory_plot)):
        if value is not None:
            outputs.append((flag, value, os.path.dirname(os.path.abspath(value)), True))
    for flag, value in (("--save", args.save), ("--path", args.path)):
        if value:
            outputs.append((flag, value, existing(os.path.abspath(value)), False))
    if args.checkpoint:
        parent = os.path.dirname(os.path.realpath(args.checkpoint))
        outputs.append(("--checkpoint", args.checkpoint, existing(parent), False))
    return outputs


def _check_output_paths(args: argparse.Namespace) -> None:
    """Check, before anything is built, that every output flag (``--json``,
    ``--memory-plot``, ``--save``, ``--checkpoint``, ``--path``) can be written: a file is
    created in the folder it writes in (see :func:`_output_folders`) and removed at once
    (``os.access`` is not enough: it passes for root on ``/proc`` or a read-only mount).

    Raises ``ValueError`` (one line: the flag, its value, the folder, the OS error and what
    to do) if that fails; if the folder of ``--json`` / ``--memory-plot`` does not exist or
    the file named is a folder; or if ``--memory-plot`` names a format matplotlib cannot
    write (see :func:`~offload_zero.train.summary.check_plot_file`). A folder flag whose
    path is not a folder is left to its own check (:func:`check_save_dir`, ...).
    """
    from offload_zero.config import write_error
    for flag, value, folder, is_file in _output_folders(args):
        if is_file and os.path.isdir(value):
            raise ValueError(f"{flag} {value!r} is a folder; give a file name")
        if is_file and not os.path.isdir(folder):
            raise ValueError(f"{flag} {value!r}: folder {folder!r} does not exist; create it "
                             f"or give another {flag}")
        if not os.path.isdir(folder):
            continue
        error = write_error(folder)
        if error is not None:
            raise ValueError(f"{flag} {value!r} cannot be written: creating a file in "
                             f"{folder!r} failed ({error}); give another {flag}, in a folder "
                             "this process can write to")
    if args.memory_plot is not None:
        check_plot_file(args.memory_plot)


# train flag (its dest) -> the engine keyword or DeepSpeed name it sets (see --deepspeed)
_DS_FLAGS = {"stage": "stage", "lr": "lr", "weight_decay": "weight_decay",
             "grad_accum": "gradient_accumulation_steps",
             "batch_size": "train_micro_batch_size_per_gpu", "dtype": "dtype",
             "steps": "total_num_steps", "warmup": "warmup_num_steps", "path": "path",
             "master_dtype": "master_dtype", "moment_dtype": "moment_dtype"}


def auto_workload(args: argparse.Namespace):
    """The engine's ``workload`` for ``--offload auto``: ``{"batch_size": --batch-size,
    "seq_len": --seq-len}`` (the placement counts their activations and times the step); None
    with another ``--offload``."""
    if args.offload != "auto":
        return None
    return {"batch_size": args.batch_size, "seq_len": args.seq_len}


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
    parse_deepspeed_config`) onto ``args`` (stage, offload, path, dtype, master and moment
    dtypes, lr, weight decay, accumulation, batch size) and ``args.ds_kwargs`` (the engine keywords no flag has). Flags
    given explicitly must agree with the config (ValueError naming both otherwise); every
    flag's value, given or default, resolves the config's ``"auto"``. Returns the
    :class:`~offload_zero.deepspeed_config.DeepSpeedSettings`."""
    from offload_zero.deepspeed_config import parse_deepspeed_config

    explicit = explicit_flags(args)
    values = {name: getattr(args, dest) for dest, name in _DS_FLAGS.items()}
    values["dtype"] = DTYPES[args.dtype]
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
    args.master_dtype = kw.pop("master_dtype", args.master_dtype)
    args.moment_dtype = kw.pop("moment_dtype", args.moment_dtype)
    dtype = kw.pop("dtype", DTYPES[args.dtype])
    args.dtype = next(k for k, v in DTYPES.items() if v == dtype)
    devices = (kw.setdefault("offload_optimizer", "none"), kw.setdefault("offload_param", "none"))
    args.offload = "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"
    args.path = kw.pop("path", args.path)
    kw.pop("offload", None)
    if settings.schedule is not None:
        args.warmup = min(settings.schedule.params["warmup_num_steps"], args.steps)
    elif "warmup" in explicit:
        raise ValueError(f"--warmup {args.warmup}: --deepspeed {args.deepspeed} has no "
                         "scheduler section, so it trains at a constant learning rate (as "
                         "DeepSpeed does); add a scheduler (WarmupLR, WarmupDecayLR, "
                         "WarmupCosineLR) to the config, or leave out --warmup")
    args.ds_kwargs = kw
    return settings
