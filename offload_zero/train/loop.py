"""``offload-zero train``'s run: the engine built from the flags, a resumed run's state
loaded, the optimizer steps (progress bar, log lines, periodic checkpoints), the export and
the summary."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from offload_zero import data as data_lib
from offload_zero.tables import TIERS
from offload_zero.train.arguments import (DTYPES, apply_deepspeed_config, auto_workload,
                                          check_args, update_timing as cli_update_timing)
from offload_zero.train.disk import (check_disk_space, disk_full_as_value_error,
                                     nvme_bytes_needed, swap_folder)
from offload_zero.train.hf_folder import export
from offload_zero.train.model import build_model, model_source, tokenizer_name
from offload_zero.train.resume import (check_resume_world_size, data_fingerprint,
                                       read_resume_state, resumed_step, run_identity,
                                       save_training_state)
from offload_zero.train.summary import (format_summary, mean_of, peak_rss_bytes, plot_memory,
                                        reduce_across_ranks, summarize)


def lr_at(step: int, steps: int, peak_lr: float, warmup: int) -> float:
    """Learning rate for 0-based ``step``: linear warmup, then cosine decay to ``peak_lr/10``."""
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = 0.1 * peak_lr
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _train_loop(engine, batches, args, warmup: int, tokens_per_step: int,
                is_rank0: bool, memory_trace: Optional[List[Dict[str, int]]] = None,
                start_step: int = 0, run_state: Optional[Dict[str, Any]] = None,
                schedule: bool = True) -> Tuple[List[float], float]:
    """Run optimizer steps ``start_step`` .. ``args.steps - 1`` (``batches`` already past the
    first ``start_step * args.grad_accum`` batches), each of ``--grad-accum`` micro-batches
    (forward, backward and step on each: the engine updates on the last); return ``(per-step
    losses, wall seconds)``, a step's loss the mean of its micro-batches'. With
    ``--checkpoint`` the training state is saved with ``run_state`` every
    ``--checkpoint-every`` steps and after the last one (see :func:`save_training_state`).
    The learning rate follows :func:`lr_at` when ``schedule`` (the CLI's own warmup and cosine),
    else the engine's ``lr_scheduler`` where it has one, else stays at the engine's ``lr``
    (``--deepspeed`` with no ``scheduler`` section: a constant rate, as DeepSpeed).

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
            if schedule and getattr(engine, "lr_scheduler", None) is None:
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
            loss = mean_of(micro)
            if not math.isfinite(loss):
                raise ValueError(f"loss became {loss} at step {step + 1}; try a lower --lr")
            losses.append(loss)
            if memory_trace is not None:
                rep = engine.memory_report()
                sample = {}
                for tier in TIERS:
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


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Run ``offload-zero train`` for parsed ``args``; return the summary dict.

    Flags are checked by :func:`check_args` before anything is built. Only rank 0 shows
    progress (its own loss), prints the summary and writes ``--json`` and ``--save`` (every
    rank takes part in gathering the weights; see :func:`export`); with several ranks
    the summary's losses are means over ranks, peak bytes and peak RSS the largest rank's and
    NVMe traffic the sum over ranks. Raises ``ValueError`` on bad input (from this package, the
    data pipeline or the engine) and when ``--save`` cannot be written.
    """
    from offload_zero import OffloadEngine

    setup_start = time.perf_counter()
    settings = apply_deepspeed_config(args) if getattr(args, "deepspeed", None) else None
    check_args(args)  # fail now, not after the whole run
    saved = read_resume_state(args) if args.resume else None
    update_timing = cli_update_timing(args)
    if saved is not None and args.update_timing == "auto":  # as the saved run (fp16's default)
        if "update_timing" in saved:
            update_timing = saved["update_timing"]
        elif "step_in_backward" in saved:  # (a run saved before --update-timing)
            update_timing = "backward" if saved["step_in_backward"] else "auto"
        from offload_zero.update import rules
        rules.cli_timing(update_timing, args.stage, False, args.grad_accum)
    start_step = resumed_step(args, saved) if saved is not None else 0
    files = data_lib.find_text_files(args.data) if args.data else data_lib.stdlib_files()
    data_id = data_fingerprint(files)
    if saved is not None and saved.get("data") not in (None, data_id):
        raise ValueError(f"--resume {args.resume!r}: the saved run trained on other text (its "
                         "--data files, or their sizes, differ); give the same --data to "
                         "continue it")
    run_state = {**run_identity(args), "steps": args.steps, "lr": args.lr, "warmup": args.warmup,
                 "stage": args.stage, "dtype": args.dtype, "update_timing": update_timing,
                 "master_dtype": args.master_dtype, "moment_dtype": args.moment_dtype,
                 "data": data_id}
    model, tokenizer, description = build_model(args, empty=True)
    params = sum(p.numel() for p in model.parameters())
    warmup = args.warmup if args.warmup is not None else min(100, args.steps // 10)
    nvme_need = None
    if args.offload == "nvme":
        nvme_need = nvme_bytes_needed(args, model, update_timing)
        check_disk_space(args.path, nvme_need)

    with disk_full_as_value_error(args.path, nvme_need), \
            swap_folder(args.offload, args.path) as path, (settings.build if settings else OffloadEngine)(
            model, offload=args.offload, path=path, stage=args.stage, lr=args.lr,
            weight_decay=args.weight_decay, dtype=DTYPES[args.dtype],
            activation_checkpointing=args.activation_checkpointing,
            update_timing=update_timing,
            gradient_accumulation_steps=args.grad_accum, moment_dtype=args.moment_dtype,
            master_dtype=args.master_dtype,
            host_cache_bytes=args.host_cache_bytes, max_host_bytes=args.max_host_bytes,
            optimizer_prefetch=args.optimizer_prefetch, workload=auto_workload(args),
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
            check_resume_world_size(args.resume, world_size)
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
                                     start_step=start_step, run_state=run_state,
                                     schedule=settings is None)
        report = engine.memory_report()
        skipped = engine.skipped_steps - skipped_before
        loss_scale = engine.loss_scaler.scale if engine.loss_scaler is not None else None
        peak_rss = peak_rss_bytes()
        if world_size > 1:
            losses, report, peak_rss = reduce_across_ranks(losses, report, peak_rss)
        # every rank takes part in the gathers; rank 0 writes, one unit at a time
        saved = export(engine, args, tokenizer) if args.save else None
        if rank != 0:
            saved = None
    summary = summarize(losses, report, wall_s=wall_s, tokens=tokens_per_step * (args.steps - start_step),
                        extra=dict(
                            model=description, params=params,
                            tokenizer=tokenizer_name(tokenizer),
                            corpus="data" if args.data else "stdlib",
                            files=len(files), offload=offload_shown, stage=args.stage,
                            dtype=args.dtype, steps=args.steps - start_step,
                            resumed_from=start_step if args.resume else None,
                            checkpoint=args.checkpoint, seq_len=args.seq_len,
                            batch_size=args.batch_size, grad_accum=args.grad_accum,
                            world_size=world_size, rank=rank,
                            lr=args.lr, warmup=warmup, seed=args.seed, setup_s=setup_s,
                            update_timing=engine.config.update_timing, skipped_steps=skipped,
                            moment_dtype=engine.config.moment_dtype,
                            master_dtype=engine.config.master_dtype,
                            host_cache_bytes=(engine.config.host_cache_bytes
                                              if engine.config.offload_optimizer == "nvme"
                                              else 0),
                            placement=(engine.placement.reason if engine.placement else None),
                            loss_scale=loss_scale, peak_rss_bytes=peak_rss, saved=saved,
                            deepspeed=(f"{args.deepspeed}: {settings.describe()}"
                                       if settings else None)))
    if rank == 0:
        print(format_summary(summary), flush=True)
        if args.memory_plot:
            plot_memory(trace, args.memory_plot, title=f"{description}, offload {args.offload}")
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=2)
                    f.write("\n")
            except OSError as exc:  # (checked before the run; the disk can change since)
                raise ValueError(f"--json {args.json!r} cannot be written: {exc}; the summary "
                                 "is printed above") from None
    return summary
