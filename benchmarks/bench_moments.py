"""Adam's moments in fp32 (exact AdamW), bf16 and int8, with fp32 or bf16 master weights: loss
curves side by side, the final loss difference, and the optimizer-state bytes per parameter per
step.

A format is a moment dtype (``fp32``, ``bf16``, ``int8``: fp32 master weights) or a moment
dtype with ``+bf16-master`` (``master_dtype="bf16"``, with ``--dtype bf16`` only), e.g.
``bf16+bf16-master``.

Each format trains the same model from the same initial weights on the same batches of the
train CLI's default corpus (the Python standard library's sources, byte tokenizer; see
:mod:`offload_zero.data`) with the CLI's learning-rate schedule (:func:`offload_zero.train.lr_at`:
linear warm-up over min(100, steps / 10) steps, then cosine), for ``--steps`` steps on
``--offload`` (nvme by default, so the swapper counts the state bytes each step moves).

Model: ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` with random weights (seeded),
default the 149M shape of ``bench_step.py`` (hidden 1024, intermediate 2048, 8 layers, 16
heads, vocab 32000: the byte tokenizer's 259 ids are its first rows).

Prints, per format: first and last loss, the mean loss of the last 10% of the steps and its
difference from fp32's, the NVMe state bytes read + written per step over the parameter count
(the formula: 2 x 12 = 24 for fp32, 16 for bf16, 12 for int8, 4 less with a bf16 master, plus
4096-byte padding; with a bf16 master the parameter shards are the masters' bytes), and
the host bytes of state per parameter; plots the curves to ``--png``.

Usage: PYTHONPATH=. python benchmarks/bench_moments.py [--steps 300] [--hidden 1024]
    [--intermediate 2048] [--layers 8] [--heads 16] [--vocab 32000] [--seq 256] [--batch 4]
    [--offload nvme] [--dtype fp32|bf16] [--path DIR] [--formats fp32 bf16 int8 ...] [--png FILE]
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from typing import Dict, List

import torch


def _model(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False)
    return LlamaForCausalLM(config).float().train()


def _batches(args):
    """The train CLI's default corpus as (B, T) int64 (input_ids, labels) batches."""
    from offload_zero import data as data_lib
    files = data_lib.stdlib_files()
    return data_lib.TokenWindows(files, data_lib.ByteTokenizer(), args.seq,
                                 seed=args.seed).batches(args.batch)


def _run(model, fmt: str, args) -> Dict[str, object]:
    """``args.steps`` steps with format ``fmt`` (``"<moments>"`` or
    ``"<moments>+bf16-master"``): losses, bytes, seconds."""
    from offload_zero import OffloadEngine
    from offload_zero.train import lr_at
    warmup = min(100, args.steps // 10)
    losses: List[float] = []
    with tempfile.TemporaryDirectory(dir=args.path) as folder:
        kw = {"path": folder} if args.offload == "nvme" else {}
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        with OffloadEngine(model, offload=args.offload, stage=3, lr=args.lr, dtype=dtype,
                           weight_decay=args.weight_decay, moment_dtype=fmt.split("+")[0],
                           master_dtype="bf16" if fmt.endswith("+bf16-master") else "fp32",
                           **kw) as eng:
            batches = _batches(args)
            rep0 = eng.memory_report()
            start = time.perf_counter()
            for step in range(args.steps):
                eng.set_lr(lr_at(step, args.steps, args.lr, warmup))
                x, y = next(batches)
                out = eng(input_ids=x, labels=y, use_cache=False)
                eng.backward(out.loss)
                eng.step()
                losses.append(float(out.loss.detach()))
                if args.log_every and (step + 1) % args.log_every == 0:
                    print(f"  {fmt} step {step + 1}/{args.steps} loss {losses[-1]:.4f} "
                          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
            if hasattr(eng, "apply_pending_updates"):
                eng.apply_pending_updates()
            seconds = time.perf_counter() - start
            rep = eng.memory_report()
    moved = 0
    if args.offload == "nvme":
        moved = sum(rep["nvme"][k] - rep0["nvme"][k]
                    for k in ("state_read_bytes", "state_written_bytes"))
    host_state = sum(rep["host"]["by_kind"][k]["peak_bytes"] for k in ("master_weights", "moments"))
    return {"losses": losses, "moved": moved, "host_state": host_state, "seconds": seconds}


def _plot(results, args, png: str) -> None:
    """Left: the loss curves; right: each format's loss minus fp32's, step by step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.5))
    ref = results.get("fp32")
    for fmt, r in results.items():
        steps = range(1, len(r["losses"]) + 1)
        ax.plot(steps, r["losses"], label=fmt if "+" in fmt else f"moments {fmt}", lw=1)
        if ref is not None and fmt != "fp32":
            dx.plot(steps, [a - b for a, b in zip(r["losses"], ref["losses"])],
                    label=f"{fmt} - fp32", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    dx.axhline(0.0, color="grey", lw=0.5)
    dx.set_xlabel("step")
    dx.set_ylabel("loss difference from exact AdamW (fp32 moments)")
    dx.legend()
    fig.suptitle(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
                 f"{args.steps} steps, seq {args.seq} x batch {args.batch}, default corpus")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offload", choices=["cpu", "nvme"], default="nvme")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="compute dtype (the master weights are fp32 unless a format says "
                        "+bf16-master, which needs bf16)")
    p.add_argument("--path", default=None, help="folder for the NVMe state (default: tmp)")
    p.add_argument("--formats", nargs="+", default=["fp32", "bf16", "int8"],
                   choices=["fp32", "bf16", "int8", "fp32+bf16-master", "bf16+bf16-master",
                            "int8+bf16-master"])
    p.add_argument("--png", default="benchmarks/results/bench_moments.png")
    p.add_argument("--log-every", type=int, default=10, help="progress to stderr (0: none)")
    args = p.parse_args()
    if args.dtype != "bf16" and any("+bf16-master" in f for f in args.formats):
        p.error("a +bf16-master format needs --dtype bf16")
    if args.vocab < 259:
        p.error(f"--vocab {args.vocab}: the byte tokenizer needs at least 259 ids")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = _model(args)
    params = sum(t.numel() for t in base.parameters())
    print(f"# model: Llama hidden={args.hidden} intermediate={args.intermediate} "
          f"layers={args.layers} heads={args.heads} vocab={args.vocab}: {params / 1e6:.1f}M "
          f"parameters; seq {args.seq} x batch {args.batch}, {args.steps} steps, lr {args.lr}, "
          f"offload={args.offload}, stage 3, compute {args.dtype}, default corpus (stdlib, "
          f"byte tokenizer)")
    results = {fmt: _run(copy.deepcopy(base), fmt, args) for fmt in args.formats}
    tail = max(1, args.steps // 10)
    ref = results.get("fp32")
    ref_tail = sum(ref["losses"][-tail:]) / tail if ref else None
    print(f"{'format':16} {'first':>8} {'last':>8} {'tail mean':>10} {'vs fp32':>9} "
          f"{'state B/param/step':>19} {'host state B/param':>19} {'s/step':>7}")
    for fmt, r in results.items():
        mean = sum(r["losses"][-tail:]) / tail
        diff = f"{mean - ref_tail:+.4f}" if ref else "-"
        per_step = r["moved"] / params / args.steps if args.offload == "nvme" else float("nan")
        print(f"{fmt:16} {r['losses'][0]:8.4f} {r['losses'][-1]:8.4f} {mean:10.4f} {diff:>9} "
              f"{per_step:19.2f} {r['host_state'] / params:19.2f} "
              f"{r['seconds'] / args.steps:7.2f}")
    if ref:
        for fmt, r in results.items():
            if fmt != "fp32":
                print(f"final loss difference {fmt} - fp32: {r['losses'][-1] - ref['losses'][-1]:+.4f}"
                      f" (last step), {sum(r['losses'][-tail:]) / tail - ref_tail:+.4f} "
                      f"(mean of the last {tail} steps)")
    _plot(results, args, args.png)
    print(f"# plot: {args.png}")


if __name__ == "__main__":
    main()
