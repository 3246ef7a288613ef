"""Model-state memory and communication per rank across ZeRO stages and world sizes.

    PYTHONPATH=. python benchmarks/bench_scaling.py [--world-sizes 1,2,4] [--stages 1,2,3]
        [--steps 3] [--no-ddp] [--json]

For each world size N (N processes on this machine, gloo over 127.0.0.1) and each ZeRO stage,
every rank trains the same model for ``--steps`` steps with
``OffloadEngine(model, stage=s, offload="none", dtype=torch.bfloat16)`` and reports, from the
engine's own accounting:

* model-state bytes on the device, per kind (bf16 parameters, bf16 gradients, fp32 master
  weights, fp32 Adam moments): the current bytes after the last backward and before its step
  (the moment the paper's formula describes), and the sum of the per-kind peaks over the run
  (which also counts units gathered in flight at stage 3 and full unit gradients in flight
  before their reduce-scatter at stages 2-3);
* the bytes this rank moved in the last step, per collective (all-gather, reduce-scatter,
  all-reduce), counted as ring algorithms move them: (N-1)/N of the full tensor for
  all-gather and reduce-scatter, 2(N-1)/N for all-reduce.

Beside them stand the formulas of Rajbhandari et al., 2019 ("ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"), with Ψ the parameter count and K = 12 bytes of
fp32 optimizer state per parameter (master weights + two moments):

    stage 1 (P_os):      4Ψ + 12Ψ/N bytes
    stage 2 (P_os+g):    2Ψ + 14Ψ/N bytes
    stage 3 (P_os+g+p):  16Ψ/N bytes
    communication:       plain data parallelism all-reduces the bf16 gradients,
                         2(N-1)/N x 2Ψ bytes per rank per step; ZeRO stages 1-2 move the same
                         (ratio 1.0), stage 3 moves 1.5x (parameters gathered twice).

Unless ``--no-ddp`` is given, the same processes also run the peer, torch's
``DistributedDataParallel`` (fp32 weights, ``torch.optim.AdamW``, gradients as bucket views,
bf16-compressed all-reduce so its traffic is the bf16 baseline above): its model-state bytes
are the unique tensor storages of parameters, gradients and AdamW state after backward (fp32:
4Ψ + 4Ψ + 8Ψ = 16Ψ), its traffic the bucket bytes its communication hook sent, ring-counted.

Units: bytes throughout. The engine pads each flat shard to a 4096-byte boundary; the model
is sized so that padding stays under 2% of Ψ (the ratio column shows it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from models import unique_storage_bytes  # noqa: E402

KINDS = ("parameters", "gradients", "master_weights", "moments")
FORMULA = {1: lambda psi, n: 4 * psi + 12 * psi / n,
           2: lambda psi, n: 2 * psi + 14 * psi / n,
           3: lambda psi, n: 16 * psi / n,
           0: lambda psi, n: 16 * psi}          # plain DDP
FORMULA_TEXT = {1: "4Ψ+12Ψ/N", 2: "2Ψ+14Ψ/N", 3: "16Ψ/N", 0: "16Ψ"}
WIDTH, BLOCKS, BATCH = 640, 4, 4


def Net(width=WIDTH, n_blocks=BLOCKS) -> nn.Module:
    """The model of tests/test_distributed.py's memory checks (tests/models.py: WideNet)."""
    from models import WideNet
    return WideNet(width, n_blocks)



def _zero_stage(rank, world_size, stage, steps):
    from offload_zero import OffloadEngine
    torch.manual_seed(0)
    model = Net()
    psi = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    with OffloadEngine(model, stage=stage, offload="none", dtype=torch.bfloat16) as eng:
        t0 = time.perf_counter()
        for _ in range(steps):
            x = torch.randn(BATCH, WIDTH, generator=gen)
            eng.backward(eng(x).float().pow(2).mean())
            after_bwd = {k: v["current_bytes"] for k, v in
                         eng.memory_report()["device"]["by_kind"].items() if k in KINDS}
            eng.step()
        wall = time.perf_counter() - t0
        by_kind = eng.memory_report()["device"]["by_kind"]
        peak = {k: by_kind[k]["peak_bytes"] for k in KINDS}
        padded = sum(fp.padded_numel for fp in eng.flat_params)
        comm = dict(eng.comm_report()["last_step"])
    return dict(psi=psi, padded=padded, after_bwd=after_bwd, peak=peak, comm=comm,
                step_s=wall / steps)


def _ddp(rank, world_size, steps):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = Net()
    psi = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, gradient_as_bucket_view=True)
    sent = {"bytes": 0}

    def counting_bf16_hook(state, bucket):
        # the hook all-reduces the bucket cast to bf16: 2 bytes per gradient element
        sent["bytes"] += bucket.buffer().numel() * 2
        return default_hooks.bf16_compress_hook(state, bucket)

    ddp.register_comm_hook(dist.group.WORLD, counting_bf16_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    t0 = time.perf_counter()
    for i in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=gen)
        sent["bytes"] = 0
        opt.zero_grad(set_to_none=False)
        ddp(x).float().pow(2).mean().backward()
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state = [t for s in opt.state.values() for k, t in s.items()
                 if torch.is_tensor(t) and k != "step"]
        # AdamW state exists from the first step on; measure after the second backward
        after_bwd = {"parameters": unique_storage_bytes(params), "gradients": unique_storage_bytes(grads),
                     "master_weights": 0, "moments": unique_storage_bytes(state) if state else 0}
        opt.step()
    wall = time.perf_counter() - t0
    n = world_size
    ring = int(2 * (n - 1) / n * sent["bytes"])
    return dict(psi=psi, padded=psi, after_bwd=after_bwd, peak=None,
                comm={"all_gather": 0, "reduce_scatter": 0, "all_reduce": ring},
                step_s=wall / steps)


def measure_rank(rank, world_size, stages, steps, with_ddp):
    """Run on every rank: ZeRO stages, then the DDP peer; returns {stage: measurements}."""
    torch.set_num_threads(1)
    out = {s: _zero_stage(rank, world_size, s, steps) for s in stages}
    if with_ddp:
        out[0] = _ddp(rank, world_size, steps)
    return out


def rows_for(world_size, per_rank):
    """One row per stage: the max over ranks of each figure (ranks should agree)."""
    rows = []
    for stage in sorted(per_rank[0], key=lambda s: (s == 0, s)):
        rs = [r[stage] for r in per_rank]
        psi = rs[0]["psi"]
        after = max(sum(r["after_bwd"].values()) for r in rs)
        peak = None if rs[0]["peak"] is None else max(sum(r["peak"].values()) for r in rs)
        kinds_after = {k: max(r["after_bwd"][k] for r in rs) for k in KINDS}
        moved = max(sum(r["comm"].values()) for r in rs)
        comm = {k: max(r["comm"].get(k, 0) for r in rs) for k in ("all_gather", "reduce_scatter", "all_reduce")}
        formula = FORMULA[stage](psi, world_size)
        ddp_comm = 2 * (world_size - 1) / world_size * 2 * psi
        rows.append(dict(N=world_size, stage=stage, psi=psi, padded=rs[0]["padded"],
                         kinds_after_bwd=kinds_after, after_bwd=after, peak=peak,
                         formula=formula, mem_ratio=after / formula,
                         peak_ratio=None if peak is None else peak / formula,
                         comm=comm, comm_bytes=moved, ddp_comm=ddp_comm,
                         comm_ratio=moved / ddp_comm if ddp_comm else None,
                         step_s=max(r["step_s"] for r in rs)))
    return rows


def format_table(rows, header):
    cols = ("N", "stage", "params", "grads", "master", "moments", "after bwd", "formula",
            "(formula)", "ratio", "Σ peaks", "ratio", "comm/step", "DDP 2(N-1)/N·2Ψ", "ratio")
    fmt = "{:>2} {:>5} {:>10} {:>10} {:>10} {:>10} {:>11} {:>11} {:>10} {:>6} {:>11} {:>6} {:>11} {:>15} {:>6}"
    lines = [header, fmt.format(*cols), "-" * len(fmt.format(*cols))]
    last_n = None
    for r in rows:
        if last_n is not None and r["N"] != last_n:
            lines.append("")
        last_n = r["N"]
        k = r["kinds_after_bwd"]
        lines.append(fmt.format(
            r["N"], "DDP" if r["stage"] == 0 else r["stage"],
            k["parameters"], k["gradients"], k["master_weights"], k["moments"],
            r["after_bwd"], int(round(r["formula"])), FORMULA_TEXT[r["stage"]],
            f"{r['mem_ratio']:.4f}",
            "-" if r["peak"] is None else r["peak"],
            "-" if r["peak_ratio"] is None else f"{r['peak_ratio']:.3f}",
            r["comm_bytes"], int(round(r["ddp_comm"])),
            "-" if r["comm_ratio"] is None else f"{r['comm_ratio']:.4f}"))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", default="1,2,4", help="comma-separated N (processes)")
    ap.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages")
    ap.add_argument("--steps", type=int, default=3, help="training steps per configuration")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DistributedDataParallel peer")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    args = ap.parse_args(argv)
    world_sizes = [int(s) for s in args.world_sizes.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    if any(s not in (1, 2, 3) for s in stages):
        ap.error("--stages takes values from 1, 2, 3")

    from dist_harness import run_ranks
    t0 = time.perf_counter()
    rows = []
    for n in world_sizes:
        per_rank = run_ranks(measure_rank, n, stages, args.steps, not args.no_ddp, timeout_s=300)
        rows += rows_for(n, per_rank)
    wall = time.perf_counter() - t0

    if args.json:
        print(json.dumps(rows, indent=1))
        return
    psi, padded = rows[0]["psi"], max(r["padded"] for r in rows if r["stage"] != 0)
    header = (f"# bench_scaling: {platform.machine()} cpus={os.cpu_count()} torch={torch.__version__} "
              f"date={datetime.date.today().isoformat()} gloo over 127.0.0.1, "
              f"{args.steps} steps batch {BATCH}, wall {wall:.0f} s\n"
              f"# model: LayerNorm + {BLOCKS} x (Linear {WIDTH}x{WIDTH}, GELU, Linear {WIDTH}x{WIDTH}); "
              f"Ψ = {psi} parameters (padded flat shards: up to {padded} elements)\n"
              f"# bytes per rank (max over ranks). params..moments and 'after bwd': current bytes after the "
              f"last backward, before its step;\n"
              f"# 'Σ peaks': sum of the per-kind peak bytes over the run; comm/step: bytes this rank moved "
              f"in the last step (ring-counted)\n"
              f"# DDP row: torch DistributedDataParallel, fp32 weights + AdamW, bf16-compressed all-reduce; "
              f"bytes from tensor storages")
    print(format_table(rows, header))


if __name__ == "__main__":
    main()
