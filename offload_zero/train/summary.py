"""The run's summary: losses, peak bytes per tier, NVMe traffic, time and throughput, merged
over ranks; printed at the end, written by ``--json``, and drawn by ``--memory-plot``."""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from offload_zero.tables import TIERS
from offload_zero.train.hf_folder import WEIGHTS_NAME


def mean_of(values: List[float]) -> float:
    """The arithmetic mean of ``values`` (a non-empty list)."""
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
    ``engine.memory_report()``; peak bytes per tier, NVMe read/written bytes and the seconds
    training waited for them (``nvme_wait_s``: the I/O not hidden behind compute; all three
    counted from the engine's start-up) are taken from it: what the engine holds by its own
    accounting, not the process's RSS (``extra``'s ``peak_rss_bytes``, from
    :func:`peak_rss_bytes`). ``wall_s`` is the training loop's wall time in seconds and
    ``tokens`` the number of tokens it consumed on all ranks. ``extra`` entries are copied in
    first.
    """
    k = max(1, min(5, len(losses) // 3))
    nvme = report.get("nvme", {})
    summary = dict(extra)
    summary.update(
        first_loss=mean_of(losses[:k]),
        last_loss=mean_of(losses[-k:]),
        loss_window_steps=k,
        losses=losses,
        peak_bytes={tier: _peak(report, tier) for tier in TIERS},
        nvme_read_bytes=int(nvme.get("read_bytes", 0)),
        nvme_written_bytes=int(nvme.get("written_bytes", 0)),
        nvme_wait_s=float(nvme.get("wait_s", 0.0)),
        wall_s=wall_s,
        tokens=tokens,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        memory_report=report,
    )
    return summary


def fmt_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ... up to TiB (powers of 1024)."""
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
        + (f", update timing {s['update_timing']}" if s.get("update_timing", "step") != "step"
           else "")
        + (f", {s['grad_accum']} micro-batches a step" if s.get("grad_accum", 1) > 1 else "")
        + (f", {s['moment_dtype']} moments" if s.get("moment_dtype", "fp32") != "fp32" else "")
        + (f", {s['master_dtype']} master weights" if s.get("master_dtype", "fp32") != "fp32"
           else "")
        + (f", host cache {fmt_bytes(s['host_cache_bytes'])}" if s.get("host_cache_bytes")
           else ""),
    ] + ([f"  deepspeed    {s['deepspeed']}"] if s.get("deepspeed") else [])
      + ([f"  placement    {s['placement']}"] if s.get("placement") else []) + [
        f"  loss         first {s['first_loss']:.4f} -> last {s['last_loss']:.4f} "
        f"(mean of {k} step(s) each)" + _skipped_note(s),
        f"  peak memory  engine-held (accounting): device {fmt_bytes(peak['device'])} | "
        f"host {fmt_bytes(peak['host'])} | nvme {fmt_bytes(peak['nvme'])}",
    ] + ([f"  peak memory  process peak RSS {fmt_bytes(s['peak_rss_bytes'])} (the OS's count: "
          "torch, the model, activations and all)"] if s.get("peak_rss_bytes") else []) + [
        f"  nvme i/o     read {fmt_bytes(s['nvme_read_bytes'])} | "
        f"written {fmt_bytes(s['nvme_written_bytes'])}"
        + (f" | training waited {s['nvme_wait_s']:.1f} s on it (not hidden by compute)"
           if s.get("nvme_read_bytes") or s.get("nvme_written_bytes") else ""),
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
    return [f"  saved        {saved['weights']} ({fmt_bytes(saved['weights_bytes'])}, "
            f"{saved['tensors']} tensors){extra}"]


def _matplotlib():
    """matplotlib, imported with the Agg backend (files only); ValueError if it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--memory-plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    return matplotlib


def check_plot_file(path: str) -> None:
    """Check, before the run, that :func:`plot_memory` can draw to ``path``: matplotlib is
    installed and writes the format its suffix names (no suffix: PNG), as ``savefig`` reads
    it. Raises ValueError naming ``--memory-plot``, the suffix and the formats it writes."""
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase
    suffix = os.path.splitext(path)[1][1:]
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix.lower() not in formats:
        raise ValueError(f"--memory-plot {path!r}: matplotlib cannot draw to a {suffix!r} file; "
                         f"give a name ending in .png (or one of "
                         f"{', '.join('.' + f for f in sorted(formats))})")


def plot_memory(trace: List[Dict[str, int]], path: str, title: str = "") -> None:
    """Draw bytes per tier over the steps (solid: held after the step; dashed: peak so far) to
    a PNG at ``path`` with matplotlib. ``trace``: one dict per step as :func:`_train_loop` fills.
    Raises ValueError if matplotlib is missing or ``path`` cannot be written."""
    _matplotlib()
    import matplotlib.pyplot as plt
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


def reduce_across_ranks(losses: List[float], report: Dict[str, Any], peak_rss: int
                         ) -> Tuple[List[float], Dict[str, Any], int]:
    """Make the summary global: mean loss per step over ranks, max peak bytes per tier and
    max peak RSS (bytes), summed NVMe traffic, the longest NVMe wait (seconds). Needs the
    engine's process group (call before ``engine.close()``)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return losses, report, peak_rss
    loss_sum = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_sum)
    tiers = TIERS
    peaks = torch.tensor([report.get(t, {}).get("peak_bytes", 0) for t in tiers] + [peak_rss],
                         dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    nvme = report.get("nvme", {})
    traffic = torch.tensor([nvme.get("read_bytes", 0), nvme.get("written_bytes", 0)],
                           dtype=torch.int64)
    dist.all_reduce(traffic)
    merged = {t: dict(report.get(t, {}), peak_bytes=int(v)) for t, v in zip(tiers, peaks[:3])}
    waited = torch.tensor([float(nvme.get("wait_s", 0.0))], dtype=torch.float64)
    dist.all_reduce(waited, op=dist.ReduceOp.MAX)
    merged["nvme"].update(read_bytes=int(traffic[0]), written_bytes=int(traffic[1]),
                          wait_s=float(waited[0]))
    merged["rank0"] = report
    world_size = dist.get_world_size()
    return (loss_sum / world_size).tolist(), merged, int(peaks[3])
