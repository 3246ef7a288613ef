"""Adam/AdamW step throughput on the host: offload-zero's C++ kernel beside its peers.

One run prints one table. For each thread count (1 and all CPUs) every optimizer steps once in
turn (A B C ... A B C ...), so background noise spreads over all of them; each figure is the
median of ``--steps`` timed steps after ``--warmup`` untimed ones.

Rows:
- ``CPUAdam``: ``offload_zero.optim.adam_step_`` on one flat fp32 buffer: fp32 grads only; with
  the fused bf16 weight copy; with bf16 grads in and the fused bf16 copy.
- ``torch AdamW(fused=True)`` alone; then plus a separate ``copy_`` of the weights into a bf16
  tensor; then with bf16 grads converted to fp32 first (``grad.copy_(grad_bf16)``) and the copy.
- ``torch Adam(fused=True)`` (not above 100M parameters: its moments would not fit).
- ``DeepSpeedCPUAdam`` if ``deepspeed`` is importable (we never install it for this).
- ``stream a.addcmul_(b, c)``: the machine's streaming bandwidth in this process (16 B/elem).
- ``CPUAdam ..., no overflow pass`` (``check_overflow=False``): without the read-only overflow
  pass over the gradients (for a caller that already knows they are finite, as torch's fused
  AdamW assumes).
- ``CPUAdam bf16 moments``: ``exp_avg``/``exp_avg_sq`` in bf16 (stochastic rounding), with and
  without the fused copy; compared with the same torch rows (they keep fp32 moments).
- ``CPUAdam int8 moments + fused bf16 copy``: blockwise 8-bit moments (decoded, updated and
  encoded again in the one pass).
- ``CPUAdam bf16 master``: bf16 weights (stochastic rounding) with fp32 moments, then with
  bf16 moments, then with both and the fused bf16 copy (the weights' own bits).

Bytes per parameter counted as useful traffic: 28 (read param, grad, exp_avg, exp_avg_sq;
write param, exp_avg, exp_avg_sq), 30 with a bf16 weight copy, 28 for bf16 grads + bf16 copy,
20 / 22 with bf16 moments, 18 with int8 moments and the copy (one byte a moment, read and
written; the absmax per 256 not counted), 24 with bf16 weights, 16 / 18 with bf16 weights and
moments. CPUAdam also reads the gradients once more before
the update (the overflow check, csrc/dispatch.cpp) unless check_overflow=False: +4 B/param
(+2 for bf16 grads), not counted.
"GB/s" is that over the median time; "of stream" divides by the addcmul bandwidth; "vs best
peer" and "vs AdamW" are explained in ``_table``. Rows share the gradient and bf16 buffers.

Usage: python benchmarks/bench_adam.py [--numel 50e6] [--big] [--steps 9] [--warmup 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload_zero.optim import adam_step_, selected_isa  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
# Above this, no torch Adam(fused) row: its moments would be 1.6 GB more at 200M parameters.
_ADAM_ROW_MAX_NUMEL = 100_000_000


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class _Case:
    """One row: a callable doing one optimizer step, and its useful bytes per parameter."""

    def __init__(self, name: str, bytes_per_param: int, step: Callable[[int], None]):
        self.name, self.bytes_per_param, self.step = name, bytes_per_param, step
        self.times_s: Dict[int, List[float]] = {}


class _Shared:
    """Buffers every row may share, to fit 200M parameters in a small machine's memory: the
    fp32 gradient (read only; the bf16-grad torch row overwrites it with bf16-rounded values,
    which changes nothing timed), its bf16 copy and the bf16 weight-copy target."""

    def __init__(self, numel: int):
        self.grad = torch.randn(numel) * 1e-3
        self.grad_bf16 = self.grad.to(torch.bfloat16)
        self.out_bf16 = torch.empty(numel, dtype=torch.bfloat16)


def _ours(numel: int, shared: _Shared) -> List[_Case]:
    param = torch.randn(numel)
    grad, grad_bf16, out_bf16 = shared.grad, shared.grad_bf16, shared.out_bf16
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    counter = [0]

    def run(g, out, check=True):
        def step(threads: int) -> None:
            counter[0] += 1
            adam_step_(param, g, exp_avg, exp_avg_sq, step=counter[0], lr=LR, betas=BETAS,
                       eps=EPS, weight_decay=WD, adamw=True, out=out, num_threads=threads,
                       check_overflow=check)
        return step

    m_bf16 = torch.zeros(numel, dtype=torch.bfloat16)
    v_bf16 = torch.zeros(numel, dtype=torch.bfloat16)

    def run_bf16_moments(out):
        def step(threads: int) -> None:
            counter[0] += 1
            adam_step_(param, grad, m_bf16, v_bf16, step=counter[0], lr=LR, betas=BETAS,
                       eps=EPS, weight_decay=WD, adamw=True, out=out, num_threads=threads)
        return step

    m_q8 = torch.zeros(numel, dtype=torch.uint8)
    v_q8 = torch.zeros(numel, dtype=torch.uint8)
    absmax = [torch.zeros(-(-numel // 256)) for _ in range(2)]

    def run_int8_moments(out):
        def step(threads: int) -> None:
            counter[0] += 1
            adam_step_(param, grad, m_q8, v_q8, step=counter[0], lr=LR, betas=BETAS,
                       eps=EPS, weight_decay=WD, adamw=True, out=out, num_threads=threads,
                       exp_avg_absmax=absmax[0], exp_avg_sq_absmax=absmax[1])
        return step

    param_bf16 = param.to(torch.bfloat16)

    def run_bf16_master(m, v, out):
        def step(threads: int) -> None:
            counter[0] += 1
            adam_step_(param_bf16, grad, m, v, step=counter[0], lr=LR, betas=BETAS, eps=EPS,
                       weight_decay=WD, adamw=True, out=out, num_threads=threads)
        return step

    return [_Case("CPUAdam fp32", 28, run(grad, None)),
            _Case("CPUAdam + fused bf16 copy", 30, run(grad, out_bf16)),
            _Case("CPUAdam bf16 grad + fused bf16 copy", 28, run(grad_bf16, out_bf16)),
            _Case("CPUAdam fp32, no overflow pass", 28, run(grad, None, False)),
            _Case("CPUAdam + fused bf16 copy, no overflow pass", 30, run(grad, out_bf16, False)),
            _Case("CPUAdam bf16 moments", 20, run_bf16_moments(None)),
            _Case("CPUAdam bf16 moments + fused bf16 copy", 22, run_bf16_moments(out_bf16)),
            _Case("CPUAdam int8 moments + fused bf16 copy", 18, run_int8_moments(out_bf16)),
            _Case("CPUAdam bf16 master", 24, run_bf16_master(exp_avg, exp_avg_sq, None)),
            _Case("CPUAdam bf16 master + bf16 moments", 16,
                  run_bf16_master(m_bf16, v_bf16, None)),
            _Case("CPUAdam bf16 master, moments + fused copy", 18,
                  run_bf16_master(m_bf16, v_bf16, out_bf16))]


def _torch(numel: int, shared: _Shared, with_adam: bool) -> List[_Case]:
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = shared.grad
    grad_bf16, out_bf16 = shared.grad_bf16, shared.out_bf16
    adamw = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def adamw_only(threads: int) -> None:
        adamw.step()

    def adamw_copy(threads: int) -> None:
        adamw.step()
        out_bf16.copy_(param.detach())

    def adamw_bf16(threads: int) -> None:
        param.grad.copy_(grad_bf16)
        adamw.step()
        out_bf16.copy_(param.detach())

    cases = [_Case("torch AdamW(fused=True)", 28, adamw_only),
             _Case("torch AdamW(fused) + separate bf16 copy_", 30, adamw_copy),
             _Case("torch AdamW(fused) bf16 grad->fp32 + copy_", 28, adamw_bf16)]
    if with_adam:
        adam = torch.optim.Adam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                fused=True)
        cases.append(_Case("torch Adam(fused=True)", 28, lambda threads: adam.step()))
    return cases


def _deepspeed(numel: int, shared: _Shared) -> List[_Case]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: WPS433 (optional peer)
    except Exception:  # not installed, or its op fails to build: simply no row
        return []
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = shared.grad
    opt = DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           adamw_mode=True)
    return [_Case("DeepSpeedCPUAdam", 28, lambda threads: opt.step())]


def _stream(numel: int, shared: _Shared) -> _Case:
    a, b, c = torch.zeros(numel), shared.grad, torch.rand(numel)
    return _Case("stream a.addcmul_(b, c)", 16, lambda threads: a.addcmul_(b, c, value=1e-9))


def _measure(cases: List[_Case], thread_counts: List[int], warmup: int, steps: int) -> None:
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for case in cases:
            case.times_s[threads] = []
        for rep in range(warmup + steps):
            for case in cases:
                t0 = time.perf_counter()
                case.step(threads)
                elapsed = time.perf_counter() - t0
                if rep >= warmup:
                    case.times_s[threads].append(elapsed)


_ADAMW = "torch AdamW(fused=True)"
_ADAMW_COPY = "torch AdamW(fused) + separate bf16 copy_"


def _table(cases: List[_Case], stream: _Case, thread_counts: List[int], numel: int) -> str:
    """One line per row. "vs best peer": our rate over the fastest peer doing the same job
    (with or without a bf16 copy); "vs AdamW": over torch AdamW(fused), or over it plus a
    separate copy_ for our rows with a copy (the goals: >= 0.95x and >= 1.15x)."""
    lines = []
    head = f"{'optimizer':44s} {'thr':>3s} {'median ms':>10s} {'M param/s':>10s} " \
           f"{'GB/s':>7s} {'of stream':>9s} {'vs best peer':>12s} {'vs AdamW':>8s}"
    lines.append(head)
    lines.append("-" * len(head))
    for threads in thread_counts:
        stream_s = statistics.median(stream.times_s[threads])
        stream_gbs = stream.bytes_per_param * numel / stream_s / 1e9
        rate = {c.name: numel / statistics.median(c.times_s[threads]) for c in cases}
        peers_plain = [rate[c.name] for c in cases
                       if not c.name.startswith("CPUAdam") and "copy" not in c.name]
        peers_copy = [rate[c.name] for c in cases
                      if not c.name.startswith("CPUAdam") and "copy" in c.name]
        for c in cases + [stream]:
            med = statistics.median(c.times_s[threads])
            gbs = c.bytes_per_param * numel / med / 1e9
            vs = vs_adamw = ""
            if c.name.startswith("CPUAdam"):
                copy = "copy" in c.name
                best = max(peers_copy if copy else peers_plain)
                vs = f"{rate[c.name] / best:11.2f}x"
                vs_adamw = f"{rate[c.name] / rate[_ADAMW_COPY if copy else _ADAMW]:7.2f}x"
            lines.append(f"{c.name:44s} {threads:3d} {med * 1e3:10.1f} {numel / med / 1e6:10.1f} "
                         f"{gbs:7.1f} {gbs / stream_gbs:8.0%} {vs:>12s} {vs_adamw:>8s}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=50e6, help="parameters (default 50M)")
    ap.add_argument("--big", action="store_true", help="also run at 200M parameters")
    ap.add_argument("--steps", type=int, default=9, help="timed steps per row (>= 7)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per row")
    args = ap.parse_args()
    if args.steps < 7:
        raise ValueError(f"--steps={args.steps} must be >= 7")
    sizes = [int(args.numel)] + ([200_000_000] if args.big else [])
    all_cpus = _cpus()
    thread_counts = sorted({1, all_cpus})
    print(f"# bench_adam: isa={selected_isa()} cpus={all_cpus} torch={torch.__version__} "
          f"median of {args.steps} steps after {args.warmup} warm-up, alternating rows")
    for numel in sizes:
        shared = _Shared(numel)
        with_adam = numel <= _ADAM_ROW_MAX_NUMEL
        cases = _ours(numel, shared) + _torch(numel, shared, with_adam) \
            + _deepspeed(numel, shared)
        stream = _stream(numel, shared)
        _measure(cases + [stream], thread_counts, args.warmup, args.steps)
        print(f"\n## {numel / 1e6:.0f}M parameters (AdamW, lr={LR}, wd={WD})"
              + ("" if any(c.name == "DeepSpeedCPUAdam" for c in cases)
                 else "; DeepSpeedCPUAdam: not importable, no row")
              + ("" if with_adam else "; no torch Adam(fused) row (memory)"))
        print(_table(cases, stream, thread_counts, numel))
        del cases, stream, shared


if __name__ == "__main__":
    main()
