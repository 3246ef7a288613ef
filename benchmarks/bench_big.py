"""Train a Llama-style model whose training state is far larger than this machine's RAM.

ZeRO-Infinity's claim, on one machine: with parameters and optimizer state on NVMe, model size
is bounded by disk, not memory. This script builds a Llama-style model whose 16Ψ bytes of
mixed-precision training state (Rajbhandari et al., 2019: 2Ψ bf16 weights + 2Ψ gradients +
12Ψ fp32 master weights and moments) is at least 1.5x the machine's RAM (default Ψ ≈ 2.5B:
40 GB on a 24 GiB machine), trains it with ``offload="nvme"`` for a few steps on real text
(the Python standard library's sources, byte tokens), and prints per step: time (s), loss,
and peak RSS (bytes, sampled every 0.1 s and from ``getrusage``), beside 16Ψ and RAM.
Target: peak RSS below 60% of RAM, finite loss.

It checks free disk at ``--path`` first and says how many bytes it needs (12Ψ of optimizer
state + 2Ψ of parameter shards, padded, plus 5%).

Usage: python benchmarks/bench_big.py --path /scratch [--layers 32 --hidden 2560
       --intermediate 6912] [--steps 3] [--seq-len 64] [--batch-size 1] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import threading
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload_zero import OffloadEngine  # noqa: E402
from offload_zero import data as data_lib  # noqa: E402
from offload_zero.estimator import placement_bytes  # noqa: E402


class RssSampler(threading.Thread):
    """Samples this process's RSS (bytes) every ``interval_s`` seconds; ``peak`` is the max."""

    def __init__(self, interval_s: float = 0.1):
        super().__init__(daemon=True)
        self.interval_s, self.peak, self._halt = interval_s, 0, threading.Event()
        self._proc = psutil.Process()

    def run(self):
        while not self._halt.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._halt.wait(self.interval_s)

    def stop(self):
        self._halt.set()
        self.join()


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default=None, help="folder for swap files (default: a temp dir in /tmp)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--intermediate", type=int, default=6912)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)

    from transformers import LlamaConfig, LlamaForCausalLM
    tok = data_lib.ByteTokenizer()
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=max(128, args.seq_len), use_cache=False)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    psi = sum(p.numel() for p in meta.parameters())
    ram = psutil.virtual_memory().total
    need = placement_bytes(meta, 3, "nvme", "nvme", dtype=torch.bfloat16,
                           accelerator=False).tier_bytes("nvme")
    del meta
    own_tmp = args.path is None
    path = args.path or tempfile.mkdtemp(prefix="oz-big-", dir="/tmp")
    free = shutil.disk_usage(path).free
    lines = [f"# bench_big: {psi / 1e9:.2f}B parameters ({args.layers} layers, hidden {args.hidden}, "
             f"mlp {args.intermediate}, vocab {cfg.vocab_size}), bf16 compute, offload='nvme', stage 3",
             f"# 16Ψ = {gib(16 * psi)} of training state; RAM {gib(ram)} ({16 * psi / ram:.2f}x RAM); "
             f"cpus {os.cpu_count()}; torch {torch.__version__}; swap files at {path}",
             f"# NVMe needed {gib(need)} (+5%), free {gib(free)}"]
    print("\n".join(lines), flush=True)
    if free < need * 1.05:
        msg = (f"not enough free disk at {path}: this run needs {gib(need * 1.05)} for swap files "
               f"(12Ψ optimizer state + 2Ψ parameter shards, padded, +5%), {gib(free)} is free")
        print(msg, file=sys.stderr)
        return 2

    sampler = RssSampler()
    sampler.start()
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)  # (the same weights, and so the same losses, in every run)
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    build_s = time.perf_counter() - t0
    rss_model = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    rows = []
    try:
        with OffloadEngine(model, offload="nvme", path=path, dtype=torch.bfloat16,
                           grad_dtype=torch.bfloat16, lr=1e-4) as eng:
            del model
            init_s = time.perf_counter() - t0
            rss_after_init = psutil.Process().memory_info().rss
            lines.append(f"# model built in {build_s:.0f} s (RSS {gib(rss_model)}); engine init "
                         f"{init_s:.0f} s (RSS after {gib(rss_after_init)})")
            print(lines[-1], flush=True)
            windows = data_lib.TokenWindows(data_lib.stdlib_files(), tok, args.seq_len, seed=0)
            batches = windows.batches(args.batch_size)
            for step in range(1, args.steps + 1):
                x, y = next(batches)
                t = time.perf_counter()
                out = eng(input_ids=x, labels=y, use_cache=False)
                loss = out.loss.float().item()
                eng.backward(out.loss)
                eng.step()
                dt = time.perf_counter() - t
                rep = eng.memory_report()
                rows.append((step, dt, loss, sampler.peak))
                line = (f"step {step}: {dt:6.1f} s  loss {loss:.4f}  peak RSS {gib(sampler.peak)} "
                        f"({sampler.peak / ram:.0%} of RAM)  nvme read {gib(rep['nvme']['read_bytes'])} "
                        f"written {gib(rep['nvme']['written_bytes'])}")
                lines.append(line)
                print(line, flush=True)
    finally:
        sampler.stop()
        if own_tmp:
            shutil.rmtree(path, ignore_errors=True)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = max(sampler.peak, maxrss)
    ok = peak < 0.6 * ram and all(r[2] == r[2] and abs(r[2]) != float("inf") for r in rows)
    lines.append(f"# peak RSS {gib(peak)} = {peak / ram:.0%} of RAM (target < 60%) for "
                 f"{gib(16 * psi)} of training state (16Ψ = {16 * psi / ram:.2f}x RAM); "
                 f"median step {sorted(r[1] for r in rows)[len(rows) // 2]:.1f} s; "
                 f"{'target met' if ok else 'TARGET MISSED'}")
    print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
