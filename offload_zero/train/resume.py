"""``--checkpoint`` and ``--resume``: the run state saved beside the engine's training state,
and the checks that a resumed run continues the saved one (its data order, layout, schedule
and corpus)."""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
from typing import Any, Dict, Optional, Sequence

log = logging.getLogger("offload_zero.train")


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


def run_identity(args: argparse.Namespace) -> Dict[str, Any]:
    """What a resumed run must share with the saved one for its batches to continue where the
    saved run stopped (the data order depends on all of them)."""
    return {"seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "grad_accum": args.grad_accum}


def read_resume_state(args: argparse.Namespace) -> Dict[str, Any]:
    """The run state that ``--checkpoint`` saved in ``--resume DIR``'s ``checkpoint.json``
    (its ``client_state``): ``step``, ``steps``, ``lr``, ``warmup``, ``seed``, ``batch_size``,
    ``seq_len``, ``grad_accum`` (absent before that flag), ``stage``, ``dtype``,
    ``update_timing`` (``step_in_backward`` before that flag) and ``data`` (a fingerprint of the
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


def check_resume_world_size(folder: str, world_size: int) -> None:
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
    ``--seed``, ``--batch-size``, ``--seq-len``, ``--grad-accum`` (its data order), ``--stage``,
    ``--dtype``, ``--master-dtype`` or ``--moment-dtype`` (its numbers) differ from this one's, or if it already did ``--steps`` steps or more. Another ``--steps``,
    ``--lr`` or ``--warmup`` is allowed (to train longer, say); with ``warn`` a warning says that
    the learning-rate schedule changes. So is another ``--update-timing``: the same
    numbers either way, and the checkpoint loads into either layout (see
    :func:`offload_zero.checkpoint.load_checkpoint`)."""
    saved = read_resume_state(args) if saved is None else saved
    mine = {**run_identity(args), "stage": args.stage, "dtype": args.dtype,
            "master_dtype": args.master_dtype, "moment_dtype": args.moment_dtype}
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
