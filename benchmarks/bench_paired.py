"""Training-step overhead of offload-zero (and DeepSpeed) over plain torch, measured in pairs.

``bench_step.py`` runs each configuration in a process of its own, one after the other, and
compares medians. On a shared virtual machine the speed of the whole machine drifts by tens of
percent over minutes (plain torch's 58M-parameter bf16 step measured 0.73 s and 1.24 s in two
rounds a few minutes apart), which swamps a 5-15% difference. Here each configuration runs in a
fresh process beside a plain torch twin of the same model, in rounds: ``--block`` steps of one
side, then as many of the other, the side that goes first swapped every round, so a drift slows
both halves of a round alike. The figure is the median over rounds of ``t_config / t_torch``
(each the mean step of its block; with the quartiles), beside each side's median step.

An ``ours-*`` block ends only when the engine's NVMe transfers are all done
(``engine.swapper.wait_all()``, timed with the block): the reads ahead and write-backs it
leaves in flight would otherwise run during the torch block, slowing it and hiding their own
cost. In a run of the engine alone they overlap its next step, so the figure is an upper bound
of the engine's overhead (by at most one step's leftover I/O per block).

Model, batch and rows are ``bench_step.py``'s (same flags; ``--configs`` takes its ``ours-*``
and ``ds-*`` rows): a ``transformers.LlamaForCausalLM`` with random weights, one fixed batch of
random token ids, AdamW lr 1e-4 wd 0.01 on both sides, stage 3; the torch twin trains in the
compute dtype with ``torch.optim.AdamW(fused=True)`` (at bf16 purely in bf16: a floor, not the
same arithmetic). Each side first runs ``--warmup`` steps; then ``--rounds`` rounds are timed
(wall seconds of forward + backward + step, each side's ``--grad-accum`` micro-batches).
NVMe bytes per step (the engine's swapper counters, mean over the timed steps) are printed
for ``ours-*`` rows, and the seconds per step the training thread stood waiting for NVMe
transfers (``memory_report()["nvme"]["wait_s"]``, the block's final drain included): the
I/O that did not hide behind compute. Peak memory is ``bench_step.py``'s to measure (two
models share this process).

Usage: PYTHONPATH=. python benchmarks/bench_paired.py --dtype bf16
       --configs ours-nvme,ours-nvme+cache,ours-nvme+cache+bf16m [--rounds 8] [--block 3]
       [--warmup 3]
       [--layers 8 --hidden 1024 --intermediate 2048 --heads 16 --vocab 32000 --seq 256
        --batch 4] [--host-cache-frac 0.5] [--path DIR] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_step  # noqa: E402  (the model, the rows and their engines)


def _quartiles(xs: List[float]):
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def worker(args) -> None:
    """One row beside its torch twin, in this process; prints one ``RESULT`` JSON line."""
    import torch
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device("cpu")
    config = args.worker
    x = torch.randint(0, args.vocab, (args.batch, args.seq),
                      generator=torch.Generator().manual_seed(1))
    twin = bench_step._build_model(args, dtype)  # (built first: DeepSpeed's Init patches)
    opt = torch.optim.AdamW(twin.parameters(), lr=bench_step.LR, betas=bench_step.BETAS,
                            eps=bench_step.EPS, weight_decay=bench_step.WD, fused=True)

    def torch_step():
        for _ in range(args.grad_accum):
            (twin(input_ids=x, labels=x).loss / args.grad_accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    moved = drain = None
    if config.startswith("ours-"):
        engine = bench_step.ours_engine(args, config, bench_step._build_model(args, dtype),
                                        dtype, dev)
        closer = engine.close

        def row_step():
            for _ in range(args.grad_accum):
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()

        def moved():
            nvme = engine.memory_report()["nvme"]
            return nvme["read_bytes"], nvme["written_bytes"], nvme["wait_s"]

        drain = engine.swapper.wait_all if engine.swapper is not None else None
    else:
        _, ds_step = bench_step._ds_init(args, dtype, config, args.path)
        closer = None

        def row_step():
            ds_step(x)
    for _ in range(args.warmup):
        torch_step()
        row_step()
    if drain is not None:
        drain()
    times: Dict[str, List[float]] = {"torch": [], "row": []}
    io0 = moved() if moved else None
    for i in range(args.rounds):
        order = (("torch", torch_step), ("row", row_step))
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            for _ in range(args.block):
                fn()
            if name == "row" and drain is not None:
                drain()  # (its leftover I/O is its own: see the module docstring)
            times[name].append((time.perf_counter() - t0) / args.block)
    steps = args.rounds * args.block
    io = [(b - a) / steps for a, b in zip(io0, moved())] if moved else None
    if closer is not None:
        closer()
    print("RESULT " + json.dumps({"config": config, "torch": times["torch"],
                                  "row": times["row"], "io": io}), flush=True)


def _run_one(args, config: str) -> Dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", config] + args.passthrough
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if config.startswith("ds-"):
        env.setdefault("DS_ACCELERATOR", "cpu")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
    return {"config": config, "error": f"exit {r.returncode}: " + " | ".join(tail)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("layers", 8), ("hidden", 1024), ("intermediate", 2048),
                          ("heads", 16), ("vocab", 32000), ("seq", 256), ("batch", 4)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (>= 2)")
    p.add_argument("--block", type=int, default=3, help="steps of each side per round (>= 1)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--path", default=None, help="folder for NVMe files (default: temp under /tmp)")
    p.add_argument("--configs", default="ours-nvme,ours-nvme+cache",
                   help="comma-separated ours-* / ds-* rows of bench_step.py")
    p.add_argument("--host-cache-frac", type=float, default=0.5)
    p.add_argument("--moment-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.device = "cpu"
    if args.rounds < 2 or args.block < 1 or args.warmup < 0 or args.grad_accum < 1:
        p.error(f"--rounds must be >= 2, --block >= 1, --warmup >= 0, --grad-accum >= 1; got "
                f"{args.rounds}, {args.block}, {args.warmup}, {args.grad_accum}")
    if args.worker:
        return worker(args)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if not bench_step.known_config(c) or c.startswith("torch")]
    if bad:
        p.error(f"unknown configs {bad}; choose the ours-*/ds-* rows of bench_step.py "
                f"({bench_step.CONFIGS}, suffixes {bench_step.SUFFIXES})")
    tmp = None
    if args.path is None:
        tmp = args.path = tempfile.mkdtemp(prefix="bench_paired_", dir="/tmp")
    args.passthrough = []
    for k in ("layers", "hidden", "intermediate", "heads", "vocab", "seq", "batch", "dtype",
              "rounds", "block", "warmup", "threads", "path", "host_cache_frac", "moment_dtype",
              "grad_accum"):
        args.passthrough += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    import torch
    ds = bench_step._deepspeed_status() if any(c.startswith("ds-") for c in configs) else ""
    results = []
    load0 = os.getloadavg()
    try:
        for c in configs:
            if c.startswith("ds-") and not ds:
                results.append({"config": c, "error": "skipped: deepspeed not importable"})
                continue
            res = _run_one(args, c)
            results.append(res)
            print(f"# {c}: {res.get('error') or 'done'}", file=sys.stderr, flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    ds_text = ds or ("not importable" if any(c.startswith("ds-") for c in configs)
                           else "no row")
    print(f"# bench_paired: {platform.node()} cpus={len(os.sched_getaffinity(0))} "
          f"threads={args.threads} torch={torch.__version__} deepspeed={ds_text} "
          f"date={time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# model: Llama layers={args.layers} hidden={args.hidden} "
          f"intermediate={args.intermediate} heads={args.heads} vocab={args.vocab} "
          f"dtype={args.dtype} batch={args.batch} seq={args.seq} grad_accum={args.grad_accum}; "
          f"{args.rounds} rounds of {args.block} steps a side after {args.warmup} warm-up "
          f"steps each; load average "
          f"{load0[0]:.2f} -> {load1[0]:.2f}")
    hdr = (f"{'config':<30}{'torch s':>9}{'config s':>10}{'median ratio':>14}"
           f"{'quartiles':>18}{'R/W MB per step':>18}{'waited s/step':>15}")
    print(hdr)
    print("-" * len(hdr))
    for res in results:
        if "error" in res:
            print(f"{res['config']:<30} {res['error'][:300]}")
            continue
        ratios = [r / t for r, t in zip(res["row"], res["torch"])]
        q1, med, q3 = _quartiles(ratios)
        io = (f"{res['io'][0] / 1e6:9.0f}/{res['io'][1] / 1e6:<8.0f}" if res.get("io")
              else "")
        waited = f"{res['io'][2]:.3f}" if res.get("io") else ""
        print(f"{res['config']:<30}{statistics.median(res['torch']):9.2f}"
              f"{statistics.median(res['row']):10.2f}{(med - 1) * 100:+13.1f}%"
              f"{(q1 - 1) * 100:+8.1f}%..{(q3 - 1) * 100:+.1f}%{io:>18}{waited:>15}")


if __name__ == "__main__":
    main()
