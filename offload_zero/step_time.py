"""Seconds per optimizer step of a placement: ``offload="auto"`` compares placements by it.

[Note: step-time model]
For one rank and one optimizer step (``gradient_accumulation_steps`` micro-batches):

- compute: ``compute_s = flop / flops``, ``flop = tokens * (2 P + 2 P + 2 P_t + 2 P [ckpt])``:
  forward, backward through the activations, the trainable weights' gradients and, with
  activation checkpointing, the blocks' forward again; ``P`` all parameters, ``P_t`` the
  trainable ones (6 P when all train, the usual 6N), ``tokens = batch_size * seq_len *
  gradient_accumulation_steps`` (the workload, per rank). ``flops`` is a matmul timed on the
  device in the compute dtype (:func:`measured_flops`): a model reaches less, so
  ``compute_s`` is a lower bound and the I/O it hides is never overstated.
- NVMe bytes (:func:`nvme_traffic`): the optimizer state of the flat parameters left on NVMe
  is read once and written once a step, the plan's ``host_cache["nvme_state_bytes"]`` each way
  (what ``memory_report()["host_cache"]`` and the store's byte counters show:
  tests/test_host_cache.py, tests/test_accum_io.py). Parameter shards on NVMe are read in
  forward and again in backward (K bytes an element; with ``update_timing="next_forward"`` a
  trainable block's only in backward, the forward gathering its updated shard from the buffer
  its update wrote), the root's once (it stays gathered from forward to backward; with
  ``"next_forward"`` its trainable parts not at all, gathered from their updates' buffers
  too, but in fp32 with the state on NVMe) and, where all the root trains, its outsized parts
  not at all (their buffers keep them from step to step), none whose state is kept in host
  memory (the shard is that master in fp32, else it stays in host memory beside it) and no
  frozen one the host cache keeps; the trainable ones are written once, except in fp32 with the state on NVMe (the
  shard is the master's bytes, written with the state). Exact in bf16 in
  every timing and for the fp32 plain step (tests/test_auto_by_time.py); in fp32 with updates in
  backward or in the next forward some gathers take the shard from the state read, and the
  figure is an upper bound.
- disk seconds: bytes / the probe's read or write rate for the swapper's request size and
  queue depth (:func:`offload_zero.memory.tuning.measured_rates`); reads and writes add (one
  disk serves one stream at a time).
- overlap: parameter reads are prefetched while units compute; the state's reads and writes
  (and the shards' write-back) overlap nothing with ``update_timing="step"`` (the update runs
  between backward and the next forward), backward with ``"backward"`` (its share of the
  compute), the whole step with ``"next_forward"`` (the next forward and this backward). The
  state's overlapped seconds take their window first, the parameter reads the compute left:

      hidden = min(state_s, share * compute_s)
      exposed_s = (state_s - hidden) + max(0, param_read_s - (compute_s - hidden))
      step_s = compute_s + exposed_s

Not modelled: host-device copies, the host Adam's own time, other processes on the disk. So
every placement without NVMe bytes estimates ``compute_s`` and the cheapest of them wins.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional, Sequence, Tuple

import torch

_FLOPS: Dict[Tuple[str, torch.dtype], float] = {}  # measured_flops, per process
_TIMING_S = 0.05  # at least this long a matmul timing runs, seconds


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one rank computes per micro-batch, for ``offload="auto"``.

    Fields: batch_size (sequences per micro-batch on each rank) and seq_len (tokens per
    sequence), ints >= 1; activation_checkpointing, offload_activations,
    gradient_accumulation_steps: the engine's options of those names.
    """

    batch_size: int
    seq_len: int
    activation_checkpointing: bool = False
    offload_activations: bool = False
    gradient_accumulation_steps: int = 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens one rank computes per optimizer step."""
        return self.batch_size * self.seq_len * self.gradient_accumulation_steps


@dataclasses.dataclass(frozen=True)
class DiskRates:
    """The disk under the swap folder: read and write bytes per second (> 0), and where the
    figures came from (``"probe"``, ``"cache"``: the aio tuning probe; ``"given"``)."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    source: str = "given"

    def text(self) -> str:
        """``"disk read 2.1 GB/s, write 1.5 GB/s (probe)"``."""
        return (f"disk read {self.read_bytes_per_s / 1e9:.3g} GB/s, write "
                f"{self.write_bytes_per_s / 1e9:.3g} GB/s ({self.source})")


@dataclasses.dataclass(frozen=True)
class ComputeEstimate:
    """One optimizer step's forward and backward on one rank: ``seconds`` (> 0) at ``flops``
    FLOP/s; ``backward_share`` of it is backward (the recomputation included), in [0, 1]."""

    seconds: float
    backward_share: float
    flops: float

    def text(self) -> str:
        """``"compute 1.234 s at 12.3 TFLOP/s"``."""
        return f"compute {self.seconds:.3g} s at {self.flops / 1e12:.3g} TFLOP/s"


@dataclasses.dataclass(frozen=True)
class NVMeTraffic:
    """NVMe bytes per optimizer step on one rank (see [Note: step-time model]): ``state_bytes``
    read and as many written (optimizer state), ``param_read_bytes`` and
    ``param_written_bytes`` (parameter shards)."""

    state_bytes: int
    param_read_bytes: int
    param_written_bytes: int

    @property
    def total_bytes(self) -> int:
        """Every byte read or written."""
        return 2 * self.state_bytes + self.param_read_bytes + self.param_written_bytes


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A placement's estimated step: ``compute_s``, ``io_s`` (all its disk seconds) and
    ``exposed_s`` (the part compute does not hide), seconds; ``traffic`` its bytes."""

    compute_s: float
    io_s: float
    exposed_s: float
    traffic: NVMeTraffic

    @property
    def step_s(self) -> float:
        """compute_s + exposed_s."""
        return self.compute_s + self.exposed_s

    def text(self) -> str:
        """``"~1.23 s a step (disk 0.40 s, 0.23 s of it exposed)"``."""
        if not self.traffic.total_bytes:
            return f"~{self.step_s:.3g} s a step (no disk I/O)"
        return (f"~{self.step_s:.3g} s a step (disk {self.io_s:.3g} s, {self.exposed_s:.3g} s "
                "of it exposed)")


def nvme_traffic(plan) -> NVMeTraffic:
    """The NVMe bytes per step of ``plan`` (a :class:`offload_zero.plan.MemoryPlan`), by
    [Note: step-time model]."""
    state = plan.host_cache["nvme_state_bytes"]
    if plan.settings.param_tier != "nvme":
        return NVMeTraffic(state, 0, 0)
    k = plan.settings.itemsize
    shared = plan.master_is_param_on_nvme
    forward = plan.settings.in_forward  # (a block's updated shard stays in its read buffer)
    read = written = 0
    for i, (spec, shard) in enumerate(zip(plan.layout, plan.shard_numel)):
        if i in plan.in_host or i in plan.params_in_host:
            continue  # (its shard is the host master, or stays in host memory)
        # "next_forward": a trainable shard's gather in forward takes it from the buffer its
        # update wrote (the root's, in fp32 with the state on NVMe too, is read from the master)
        follows = forward and spec.trainable and not (shared and spec.unit == -1)
        if spec.unit == -1:  # gathered once, from forward to backward
            kept = plan.keep_root and i in plan.outsized_root  # (in its own buffer)
            read += 0 if kept or follows else k * shard
        else:
            read += (1 if follows else 2) * k * shard
        if spec.trainable and not shared:
            written += k * shard
    return NVMeTraffic(state, int(read), int(written))


def compute_estimate(layout: Sequence, workload: Workload, flops: float) -> ComputeEstimate:
    """The compute of one optimizer step for ``layout`` (flat parameters with ``numel`` and
    ``trainable``, as :func:`offload_zero.estimator.model_layout` gives them) and
    ``workload`` at ``flops`` FLOP/s (> 0), by [Note: step-time model]. Raises ValueError for
    ``flops`` <= 0."""
    if not flops > 0:
        raise ValueError(f"flops={flops!r} is not valid; it must be a number > 0 (FLOP/s)")
    total = sum(spec.numel for spec in layout)
    trainable = sum(spec.numel for spec in layout if spec.trainable)
    recompute = 2 * total if workload.activation_checkpointing else 0
    forward, backward = 2 * total, 2 * total + 2 * trainable + recompute
    per_token = max(forward + backward, 1)
    return ComputeEstimate(workload.tokens_per_step * per_token / flops, backward / per_token,
                           float(flops))


def step_time(plan, compute: ComputeEstimate, disk: Optional[DiskRates]) -> StepTime:
    """The estimated step of ``plan`` (a :class:`offload_zero.plan.MemoryPlan`) by [Note:
    step-time model]. Raises ValueError when the plan moves NVMe bytes and ``disk`` is None."""
    traffic = nvme_traffic(plan)
    if not traffic.total_bytes:
        return StepTime(compute.seconds, 0.0, 0.0, traffic)
    if disk is None:
        raise ValueError("a placement that moves NVMe bytes needs the disk's rates")
    state_s = (traffic.state_bytes / disk.read_bytes_per_s
               + (traffic.state_bytes + traffic.param_written_bytes) / disk.write_bytes_per_s)
    param_s = traffic.param_read_bytes / disk.read_bytes_per_s
    share = {"step": 0.0, "backward": compute.backward_share}.get(plan.settings.update_timing,
                                                                   1.0)
    hidden = min(state_s, share * compute.seconds)
    exposed = (state_s - hidden) + max(0.0, param_s - (compute.seconds - hidden))
    return StepTime(compute.seconds, state_s + param_s, exposed, traffic)


def measured_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in ``dtype`` on ``device`` (n = 4096 on an accelerator, 512
    on the CPU), timed for at least 50 ms after one warm-up; measured once per process and
    (device, dtype)."""
    key = (str(device), dtype)
    if key not in _FLOPS:
        n = 4096 if device.type == "cuda" else 512
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        torch.matmul(a, b)
        sync()
        runs, start = 0, time.perf_counter()
        while runs < 3 or time.perf_counter() - start < _TIMING_S:
            torch.matmul(a, b)
            runs += 1
            sync()
        _FLOPS[key] = 2 * n ** 3 * runs / (time.perf_counter() - start)
    return _FLOPS[key]


def disk_rates(path: str, backend: str = "auto") -> Tuple[Optional[DiskRates], str]:
    """The disk rates under ``path`` from the aio tuning probe (cached per device; probed now,
    within its usual budget, when absent: the swapper would run the same probe), and why there
    are none when the probe has no trial for its chosen pair (``(None, reason)``)."""
    from offload_zero.memory.tuning import measured_rates, tuned_settings
    settings = tuned_settings(path, backend=backend)
    rates = measured_rates(settings)
    if rates is None:
        why = settings.get("measured", {}).get("reason", "the probe ran no trial")
        return None, f"disk rates unknown under {path!r}: {why}"
    return DiskRates(rates[0], rates[1], settings["source"]), ""
