"""``offload="auto"``: measure what the machine has and pick the placement that fits and, when
the workload is known, runs the fastest step.

Candidates, cheapest first (each moves more state off the device, at more cost per step):

1. nothing offloaded;
2. optimizer state (fp32 master weights, moments) and gradient shards to host RAM;
3. + parameter shards to host RAM (stage 3);
4. optimizer state to NVMe, parameter shards in host RAM (stage 3);
5. optimizer state and parameter shards to NVMe (stage 3).

The bytes of each come from :func:`offload_zero.estimator.placement_bytes`: the sum of the
engine's own memory plan for that placement (:func:`offload_zero.plan.memory_plan`). Budgets: free device memory
(``torch.cuda.mem_get_info``; on a CPU-only machine the device is host RAM), available host RAM
(``psutil.virtual_memory().available``) and free disk at ``path`` (``shutil.disk_usage``), each
with 10% headroom for activations and the allocator; ``max_device_bytes`` / ``max_host_bytes``
replace the measured figures exactly. Nothing is allocated before the choice is made.

With a workload (:class:`offload_zero.step_time.Workload`: the engine's ``workload``, the
micro-batch per rank and the sequence length) each candidate's device tier also holds one
micro-batch's activations, counted as ``offload-zero estimate`` counts them
(:func:`offload_zero.activations.activation_bytes`, for a model whose ``config`` is a
Llama-style decoder's; on a CPU-only machine in the one RAM), and every candidate that fits
gets an estimated step time (:mod:`offload_zero.step_time`, [Note: step-time model]): compute
from a matmul timed on the device, NVMe bytes per step from the plan, disk rates from the aio
tuning probe for ``path``. The fastest wins; equal times go to the cheaper candidate. Without a
workload the compute is unknown: the first candidate that fits wins, with the largest host
cache its budget allows (``host_cache_bytes="auto"``), and the reason says so; so it is when
the disk's rates are unknown (a filesystem without O_DIRECT) and an NVMe candidate would have
to be timed.

``moment_dtype="auto"``: each candidate is tried with fp32, bf16 and int8 moments (the last two
only with the state off an accelerator); fp32 (exact) is kept unless a smaller format's best
step is faster than fp32's best by more than :data:`MOMENT_TOLERANCE` of the compute estimate,
bf16 likewise before int8; without a workload, fp32 unless only a smaller format fits. An
explicit ``moment_dtype`` is never changed.

At world size > 1 (``comm`` given) the ranks take the smallest of each measured figure
(budgets, FLOP/s, disk rates), so every rank makes the same choice.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from offload_zero.step_time import DiskRates, StepTime, Workload
from offload_zero.tables import TIERS

log = logging.getLogger("offload_zero")

CANDIDATES: Tuple[Tuple[str, str], ...] = (
    ("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme"))
HEADROOM = 0.9
MOMENT_FORMATS = ("fp32", "bf16", "int8")
"""The formats ``moment_dtype="auto"`` tries, most exact first."""
MOMENT_TOLERANCE = 0.05
"""``moment_dtype="auto"`` keeps the more exact format while its best step is at most this
fraction of the compute estimate slower than the fastest."""


@dataclasses.dataclass(frozen=True)
class PlacementChoice:
    """The placement ``offload="auto"`` picked and the numbers behind it (bytes per rank).

    Fields: offload_optimizer, offload_param ("none"/"cpu"/"nvme"); need: {tier: bytes} of the
    chosen placement, activations included; budgets: {tier: bytes} it had to fit in; tried:
    one line per candidate (its bytes, fits or short, and with a workload its estimated
    seconds a step); update_timing: the engine's ``update_timing`` the bytes were counted
    with (never ``"auto"``); host_cache_bytes: the engine's ``host_cache_bytes`` (as given, or
    what ``"auto"`` chose); moment_dtype: the moments' format (never ``"auto"``); reason: one
    line saying why (the estimate, the compute and disk rates used, or why it picked by fit);
    step: the chosen placement's :class:`offload_zero.step_time.StepTime`, or None when not
    timed; activation_bytes: the activations counted (bytes, 0 without a workload).
    """

    offload_optimizer: str
    offload_param: str
    need: dict
    budgets: dict
    tried: Tuple[str, ...]
    update_timing: str = "step"
    host_cache_bytes: int = 0
    moment_dtype: str = "fp32"
    reason: str = ""
    step: Optional[StepTime] = None
    activation_bytes: int = 0


@dataclasses.dataclass
class _Option:
    """One candidate as tried: tiers, update timing, moments, label; then what it needs."""

    opt: str
    param: str
    timing: str
    moments: str
    label: str
    skipped: str = ""
    need: Optional[dict] = None
    short: Optional[dict] = None
    cache: int = 0
    plan: object = None
    time: Optional[StepTime] = None

    def line(self) -> str:
        """Its line in ``PlacementChoice.tried``."""
        if self.skipped:
            return f"{self.label}: skipped, {self.skipped}"
        fit = (" -> fits" if not self.short else " -> short of " + ", ".join(
            f"{t} by {_fmt(b)}" for t, b in self.short.items()))
        timed = f"; {self.time.text()}" if self.time is not None else ""
        return (f"{self.label}: needs " + ", ".join(f"{t} {_fmt(self.need[t])}" for t in self.need)
                + fit + timed)


def measure_budgets(device: torch.device, path: Optional[str], max_device_bytes: Optional[int],
                    max_host_bytes: Optional[int]) -> dict:
    """``{"device", "host", "nvme", "shared"}`` bytes available; ``shared`` is True when device
    and host are one RAM (CPU-only machine, no ``max_device_bytes`` to set them apart), so
    their sum must fit the host budget (``max_host_bytes`` when given: on a CPU-only machine it
    bounds the device tier's bytes too, which are host memory)."""
    import psutil
    avail = psutil.virtual_memory().available
    shared = device.type == "cpu" and max_device_bytes is None
    if max_device_bytes is not None:
        dev = max_device_bytes
    elif device.type == "cuda":
        dev = int(HEADROOM * torch.cuda.mem_get_info(device)[0])
    else:
        dev = int(HEADROOM * avail)
    host = max_host_bytes if max_host_bytes is not None else int(HEADROOM * avail)
    disk = 0
    if path is not None and os.path.isdir(path):
        disk = int(HEADROOM * shutil.disk_usage(path).free)
    return {"device": dev, "host": host, "nvme": disk, "shared": shared}


def choose_placement(model: nn.Module, stage: int, world_size: int, dtype: torch.dtype,
                     prefetch: int, unit_classes, device: torch.device, path: Optional[str],
                     max_device_bytes: Optional[int] = None,
                     max_host_bytes: Optional[int] = None,
                     update_timing: str = "auto",
                     tail_state_in_host: Optional[bool] = None,
                     leaf_modules=(), host_cache_bytes=0,
                     moment_dtype: str = "fp32", workload: Optional[Workload] = None,
                     aio_backend: str = "auto", comm=None, disk: Optional[DiskRates] = None,
                     flops: Optional[float] = None,
                     optimizer_prefetch: Optional[int] = None,
                     master_dtype: str = "fp32") -> PlacementChoice:
    """Pick among :data:`CANDIDATES` by fit and, with ``workload``, by estimated step time (see
    the module docstring; ``update_timing`` ``"backward"`` or ``"next_forward"``: count their
    NVMe read-ahead buffers too). ``update_timing="auto"`` (the engine's default) tries each
    candidate as the engine would run it (see :func:`offload_zero.update.rules.default_timing`),
    then, where that chose ``"next_forward"``, the same candidates with the plain step, whose
    host memory is smaller (without a workload only when nothing fitted); the choice says which
    (``PlacementChoice.update_timing``). ``host_cache_bytes``: the engine's option (bytes of
    NVMe-placed optimizer state kept in host memory; see [Note: host cache] in
    :mod:`offload_zero.memory.host_cache`), counted in the candidates with the state on NVMe;
    ``"auto"``: a candidate with the state on NVMe that fits gets half the host memory left
    beside it as its cache (the other half is a margin). ``moment_dtype``: ``"fp32"``,
    ``"bf16"``, ``"int8"`` (12, 8 or 6.03 bytes of state per parameter; the last two only with
    the state off an accelerator) or ``"auto"`` (the module docstring). ``workload``: the
    micro-batch, or None. ``aio_backend``: the backend the disk is probed with. ``comm``: the
    engine's :class:`offload_zero.comm.Comm` (ranks agree on the measured figures), or None.
    ``disk`` (:class:`offload_zero.step_time.DiskRates`) and ``flops`` (FLOP/s > 0) replace
    the measured rates (tests, or a machine known in advance). ``optimizer_prefetch``: the
    engine's option, counted in the candidates that have the read-ahead ring.
    ``master_dtype``: the engine's option (``"bf16"``: 2 bytes of state per parameter less,
    only with the state off an accelerator), never changed.

    Raises:
        ValueError: nothing fits; the message names, for the placement that needs the least
            device memory, each tier that is short and by how many bytes. Raised before the
            engine allocates anything.
    """
    from offload_zero.estimator import model_layout
    budgets = _agreed(comm, measure_budgets(device, path, max_device_bytes, max_host_bytes))
    search = _Search(model, stage, world_size, dtype, prefetch, unit_classes, device, path,
                     update_timing, tail_state_in_host, host_cache_bytes, moment_dtype, workload,
                     aio_backend, comm, disk, flops, budgets,
                     model_layout(model, unit_classes, leaf_modules), max_host_bytes,
                     optimizer_prefetch, master_dtype)
    choice = search.run()
    log.info("offload='auto' chose offload_optimizer=%r offload_param=%r update_timing=%r "
             "moment_dtype=%r: %s; budgets %s; %s", choice.offload_optimizer,
             choice.offload_param, choice.update_timing, choice.moment_dtype, choice.reason,
             {t: _fmt(b) for t, b in budgets.items() if t != "shared"}, "; ".join(choice.tried))
    return choice


@dataclasses.dataclass
class _Search:
    """One ``choose_placement`` call: its arguments, the budgets, the model's layout."""

    model: nn.Module
    stage: int
    world_size: int
    dtype: torch.dtype
    prefetch: int
    unit_classes: tuple
    device: torch.device
    path: Optional[str]
    update_timing: str
    tail_state_in_host: Optional[bool]
    host_cache_bytes: object
    moment_dtype: str
    workload: Optional[Workload]
    aio_backend: str
    comm: object
    disk: Optional[DiskRates]
    flops: Optional[float]
    budgets: dict
    layout: list
    max_host_bytes: Optional[int] = None  # (the engine's option: chunks shrink to fit it)
    optimizer_prefetch: Optional[int] = None  # (the engine's option: read-ahead depth)
    master_dtype: str = "fp32"  # (the engine's option)

    def _ring_for(self, timing: str) -> Optional[int]:
        """The ``optimizer_prefetch`` a candidate with ``timing`` is counted with (the plain
        step has no read-ahead ring)."""
        return None if timing == "step" else self.optimizer_prefetch

    def run(self) -> PlacementChoice:
        """Try the options, pick one (raises ValueError when none fits)."""
        self.activations, self.notes = _activations(self.model, self.workload, self.dtype,
                                                    self.device.type != "cpu")
        options = self.options()
        if self.workload is None:
            for o in options:
                if not o.skipped:
                    self.evaluate(o)
                    if not o.short:
                        return self.chosen(o, options, "the first placement that fits, cheapest "
                                           "first (step time not estimated: no workload)")
            return self.refuse(options)
        for o in options:
            if not o.skipped:
                self.evaluate(o)
        fitting = [o for o in options if not o.skipped and not o.short]
        if not fitting:
            return self.refuse(options)
        return self.by_time(options, fitting)

    def options(self) -> List[_Option]:
        """Every option in the order tried: formats (most exact first) x candidates (cheapest
        first) x timings (the plain step's second tries last); skipped ones say why."""
        from offload_zero.update import rules
        base = [(opt, param, rules.resolve(self.update_timing, self.stage, opt))
                for opt, param in CANDIDATES]
        if self.update_timing == rules.AUTO:  # then the plain step where the default was next_forward
            base += [(opt, param, rules.STEP) for opt, param, timing in list(base)
                     if timing == rules.NEXT_FORWARD]
        formats = MOMENT_FORMATS if self.moment_dtype == "auto" else (self.moment_dtype,)
        out = []
        for fmt in formats:
            for opt, param, timing in base:
                if param != "none" and self.stage != 3:
                    continue
                sif = timing == rules.NEXT_FORWARD
                twin = (opt, param, rules.NEXT_FORWARD) in base and not sif  # (plain step's 2nd try)
                label = f"{opt}+{param}" + (" next_forward" if sif else " plain step" if twin
                                            else "")
                label += f" {fmt} moments" if len(formats) > 1 else ""
                skip = self._skip(opt, param, fmt, twin, len(formats) > 1)
                if skip is None:
                    out.append(_Option(opt, param, timing, fmt, label))
                elif skip:
                    out.append(_Option(opt, param, timing, fmt, f"{opt}+{param}", skipped=skip))
        return out

    def _skip(self, opt: str, param: str, fmt: str, twin: bool, auto: bool) -> Optional[str]:
        """Why an option cannot run (``""``: it cannot, silently), or None when it can."""
        if opt == "none" and fmt != "fp32" and self.device.type != "cpu":
            # (bf16 and int8 moments need the host kernel: see EngineConfig's moment_dtype)
            return "" if auto else (f"moment_dtype={fmt!r} needs the optimizer state off the "
                                    "accelerator")
        if opt == "none" and self.master_dtype != "fp32" and self.device.type != "cpu":
            said = twin or (auto and fmt != MOMENT_FORMATS[0])  # (said once per candidate)
            return "" if said else (f"master_dtype={self.master_dtype!r} needs the optimizer "
                                    "state off the accelerator")
        if "nvme" in (opt, param) and self.path is None:
            said = twin or (auto and fmt != MOMENT_FORMATS[0])  # (said once per candidate)
            return "" if said else "needs path= for NVMe files"
        return None

    def evaluate(self, o: _Option) -> None:
        """Fill ``o``'s need (activations included), shortfall, host cache and plan."""
        from offload_zero.estimator import placement_bytes
        from offload_zero.fit import placement_need, shortfall

        def need_with(cache: int):
            p = placement_bytes(self.model, self.stage, o.opt, o.param, self.world_size,
                                self.dtype, self.prefetch, self.unit_classes,
                                self.device.type != "cpu", layout=self.layout,
                                update_timing=o.timing, tail_state_in_host=self.tail_state_in_host,
                                host_cache_bytes=cache, moment_dtype=o.moments,
                                max_host_bytes=self.max_host_bytes,
                                optimizer_prefetch=self._ring_for(o.timing),
                                master_dtype=self.master_dtype)
            need = placement_need(p, self.activations["device"], per_node=False)
            need["host"] += self.activations["host"]
            return p, need

        cache = 0 if self.host_cache_bytes == "auto" else self.host_cache_bytes
        p, need = need_with(cache)
        short = shortfall(need, self.budgets)
        if self.host_cache_bytes == "auto" and o.opt == "nvme" and not short:
            cache = _auto_host_cache(need, self.budgets)
            while cache and shortfall(need_with(cache)[1], self.budgets):
                cache //= 2  # (a cache costs at most its bytes: this only guards the rule)
            p, need = need_with(cache)
            o.label += f" host cache {_fmt(cache)}"
        o.need, o.short, o.plan = need, short, p.plan
        o.cache = cache if o.opt == "nvme" else 0

    def by_time(self, options: List[_Option], fitting: List[_Option]) -> PlacementChoice:
        """The fastest of ``fitting`` by [Note: step-time model] (the first when the disk's
        rates are needed and unknown)."""
        from offload_zero.step_time import compute_estimate, measured_flops, nvme_traffic, step_time
        flops = self.flops or _agreed(comm=self.comm, values={
            "flops": measured_flops(self.device, self.dtype)})["flops"]
        compute = compute_estimate(self.layout, self.workload, flops)
        moving = [o for o in fitting if nvme_traffic(o.plan).total_bytes]
        disk, why = None, ""
        if moving and fitting[0] is moving[0]:  # (else the first that fits moves no byte and
            disk, why = self.disk_rates()        # nothing is faster: the disk is not probed)
        for o in fitting:
            if disk is not None or all(o is not m for m in moving):
                o.time = step_time(o.plan, compute, disk)
        if moving and disk is None and not why:
            return self.chosen(fitting[0], options, f"the fastest: it moves no NVMe byte, "
                               f"{fitting[0].time.text()} ({compute.text()})")
        measured = compute.text() + (f", {disk.text()}" if disk is not None else "")
        if why:
            return self.chosen(fitting[0], options, f"the first placement that fits, cheapest "
                               f"first (step time not estimated: {why}; {measured})")
        best = _fastest(fitting, compute.seconds)
        tolerance = (f"; {best.moments} moments, the most exact format within "
                     f"{MOMENT_TOLERANCE:.0%} of the compute of the fastest"
                     if self.moment_dtype == "auto" else "")
        return self.chosen(best, options, f"the fastest of {len(fitting)} that fit, "
                           f"{best.time.text()}{tolerance} ({measured})")

    def disk_rates(self) -> Tuple[Optional[DiskRates], str]:
        """The disk's rates: as given, else probed under ``path`` (ranks agreeing)."""
        from offload_zero.step_time import disk_rates
        if self.disk is not None:
            return self.disk, ""
        if self.path is None or not os.path.isdir(self.path):
            return None, f"path={self.path!r} is not a folder to probe"
        rates, why = disk_rates(self.path, self.aio_backend)
        agreed = _agreed(self.comm, {"read": rates.read_bytes_per_s if rates else 0.0,
                                     "write": rates.write_bytes_per_s if rates else 0.0})
        if not (agreed["read"] > 0 and agreed["write"] > 0):
            return None, why or "disk rates unknown on another rank"
        return DiskRates(agreed["read"], agreed["write"], rates.source), ""

    def chosen(self, o: _Option, options: List[_Option], why: str) -> PlacementChoice:
        """The :class:`PlacementChoice` of ``o``."""
        reason = f"{o.label}: {why}" + "".join(f"; {n}" for n in self.notes)
        return PlacementChoice(o.opt, o.param, o.need, self.budgets,
                               tuple(x.line() for x in options if x.skipped or x.need),
                               update_timing=o.timing, host_cache_bytes=o.cache,
                               moment_dtype=o.moments, reason=reason, step=o.time,
                               activation_bytes=sum(self.activations.values()))

    def refuse(self, options: List[_Option]):
        """Raise the ValueError of nothing fitting (see :func:`choose_placement`)."""
        detail = "; ".join(o.line() for o in options if o.skipped or o.need)
        tried = [o for o in options if o.need]
        if not tried:
            raise ValueError(f"offload='auto' found no placement to try at stage={self.stage}: "
                             f"{detail}")
        last = tried[-1]
        raise ValueError(
            f"offload='auto': the model does not fit even with everything offloaded "
            f"(offload_optimizer={last.opt!r}, offload_param={last.param!r}): short of "
            + ", ".join(f"{t} by {_fmt(b)}" for t, b in last.short.items())
            + f". Budgets: " + ", ".join(f"{t} {_fmt(b)}" for t, b in self.budgets.items()
                                         if t != "shared")
            + f". Tried: {detail}. " + self._disk_advice())

    def _disk_advice(self) -> str:
        """What to do, ending the refusal: an unwritable ``path`` named first (it leaves no
        NVMe budget, which is not a small disk)."""
        from offload_zero.config import write_error
        error = None if self.path is None or not os.path.isdir(self.path) else \
            write_error(self.path)
        if error is not None:
            return (f"path={self.path!r} cannot be written (creating a file there: {error}), "
                    "so nothing could go to NVMe: give a writable path=, use more ranks, or a "
                    "smaller model.")
        return "Use more ranks, a larger disk at path=, or a smaller model."


def _fastest(fitting: List[_Option], compute_s: float) -> _Option:
    """The option to run: the most exact moment format whose best step is within
    :data:`MOMENT_TOLERANCE` of the compute of the fastest, then its fastest option, equal
    times going to the one tried first (the cheaper)."""
    best = min(o.time.step_s for o in fitting)
    for fmt in MOMENT_FORMATS:
        mine = [o for o in fitting if o.moments == fmt]
        if mine and min(o.time.step_s for o in mine) <= best + MOMENT_TOLERANCE * compute_s:
            break
    quickest = min(o.time.step_s for o in mine)
    return next(o for o in mine if o.time.step_s <= quickest * (1 + 1e-9))


def _activations(model: nn.Module, workload: Optional[Workload], dtype: torch.dtype,
                 accelerator: bool) -> Tuple[dict, List[str]]:
    """``({"device": bytes, "host": bytes}, notes)``: one micro-batch's activations by [Note:
    activation arithmetic] (the checkpointed block inputs in host memory with
    ``offload_activations`` on an accelerator), none without a workload or a Llama-style
    ``model.config`` (a note says which)."""
    none = {"device": 0, "host": 0}
    if workload is None:
        return none, []
    from offload_zero.activations import DecoderShape, activation_bytes
    config = getattr(model, "config", None)
    try:
        if config is None:
            raise NotImplementedError(f"{type(model).__name__} has no config to read the "
                                      "decoder's sizes from")
        shape = DecoderShape.from_config(config)
    except NotImplementedError as exc:
        return none, [f"activations not counted: {exc}"]
    acts = activation_bytes(shape, workload.batch_size, workload.seq_len, dtype,
                            workload.activation_checkpointing)
    host = (acts.blocks - acts.per_layer if workload.activation_checkpointing
            and workload.offload_activations and accelerator else 0)
    where = ", the checkpointed inputs in host memory" if host else ""
    return ({"device": acts.total - host, "host": host},
            [f"activations {_fmt(acts.total)} a micro-batch counted{where}"])


def _agreed(comm, values: dict) -> dict:
    """``values`` (numbers, or bools) as every rank may use them: the smallest of each number
    over the ranks of ``comm`` (all the same where every rank measured the same); unchanged
    without ``comm`` or at world size 1."""
    if comm is None or comm.world_size == 1:
        return values
    ranks = comm.all_gather_object(values, "offload='auto' measurements")
    return {k: v if isinstance(v, bool) else min(r[k] for r in ranks) for k, v in values.items()}


def _auto_host_cache(need: dict, budgets: dict) -> int:
    """``host_cache_bytes="auto"``: half the host memory the budgets leave beside ``need``
    (the placement without a cache), the other half kept as a margin for what the estimate
    does not count (activations, the allocator, other processes). Bytes, >= 0."""
    used = need["host"] + (need["device"] if budgets["shared"] else 0)
    return max(0, budgets["host"] - used) // 2


def _fmt(nbytes: int) -> str:
    if nbytes < 2**20:
        return f"{nbytes} B"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"
