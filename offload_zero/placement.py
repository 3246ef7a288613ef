"""``offload="auto"``: measure what the machine has and pick the cheapest placement that fits.

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
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from offload_zero.tables import TIERS

log = logging.getLogger("offload_zero")

CANDIDATES: Tuple[Tuple[str, str], ...] = (
    ("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme"))
HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class PlacementChoice:
    """The placement ``offload="auto"`` picked and the numbers behind it (bytes per rank).

    Fields: offload_optimizer, offload_param ("none"/"cpu"/"nvme"); need: {tier: bytes} of the
    chosen placement; budgets: {tier: bytes} it had to fit in; tried: one line per candidate;
    update_timing: the engine's ``update_timing`` the bytes were counted with (never
    ``"auto"``);
    host_cache_bytes: the engine's ``host_cache_bytes`` (as given, or what ``"auto"`` chose).
    """

    offload_optimizer: str
    offload_param: str
    need: dict
    budgets: dict
    tried: Tuple[str, ...]
    update_timing: str = "step"
    host_cache_bytes: int = 0


def measure_budgets(device: torch.device, path: Optional[str], max_device_bytes: Optional[int],
                    max_host_bytes: Optional[int]) -> dict:
    """``{"device", "host", "nvme", "shared"}`` bytes available; ``shared`` is True when device
    and host are one RAM (CPU-only machine, no explicit budgets), so their sum must fit."""
    import psutil
    avail = psutil.virtual_memory().available
    shared = device.type == "cpu" and max_device_bytes is None and max_host_bytes is None
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
                     moment_dtype: str = "fp32") -> PlacementChoice:
    """Pick the first of :data:`CANDIDATES` whose bytes fit the budgets (``update_timing``
    ``"backward"`` or ``"next_forward"``: count their NVMe read-ahead buffers too).
    ``update_timing="auto"`` (the engine's default) tries each candidate as the engine would run
    it (see :func:`offload_zero.update.rules.default_timing`), then, where that chose
    ``"next_forward"`` and nothing fitted, the same candidates with the plain step, whose
    host memory is smaller; the choice says which (``PlacementChoice.update_timing``).
    ``host_cache_bytes``: the engine's option (bytes of NVMe-placed optimizer state kept in
    host memory; see [Note: host cache] in :mod:`offload_zero.memory.host_cache`), counted in
    the candidates with the state on NVMe; ``"auto"``: a candidate with the state on NVMe that
    fits gets half the host memory left beside it as its cache (the other half is a margin); ``moment_dtype``: ``"fp32"``, ``"bf16"`` or
    ``"int8"``, the moments' format (12, 8 or 6.03 bytes of state per parameter; the last two
    only with the state off an accelerator).

    Raises:
        ValueError: nothing fits; the message names, for the placement that needs the least
            device memory, each tier that is short and by how many bytes. Raised before the
            engine allocates anything.
    """
    from offload_zero.update import rules
    from offload_zero.estimator import model_layout, placement_bytes
    budgets = measure_budgets(device, path, max_device_bytes, max_host_bytes)
    layout = None  # the model's flat parameters, once counted
    accelerator = device.type != "cpu"
    tried: List[str] = []
    last = None
    options = []  # (optimizer tier, parameter tier, update timing), in the order tried
    for opt, param in CANDIDATES:
        options.append((opt, param, rules.resolve(update_timing, stage, opt)))
    if update_timing == rules.AUTO:  # then the plain step where the default was next_forward
        options += [(opt, param, rules.STEP) for opt, param, timing in list(options)
                    if timing == rules.NEXT_FORWARD]
    for opt, param, timing in options:
        sif = timing == rules.NEXT_FORWARD
        if param != "none" and stage != 3:
            continue
        if opt == "none" and moment_dtype != "fp32" and device.type != "cpu":
            # (bf16 and int8 moments need the host kernel: see EngineConfig's moment_dtype)
            tried.append(f"{opt}+{param}: skipped, moment_dtype={moment_dtype!r} needs the "
                         "optimizer state off the accelerator")
            continue
        twin = (opt, param, rules.NEXT_FORWARD) in options and not sif  # (the plain step's 2nd try)
        if "nvme" in (opt, param) and path is None:
            if not twin:
                tried.append(f"{opt}+{param}: skipped, needs path= for NVMe files")
            continue
        label = f"{opt}+{param}" + (" next_forward" if sif else " plain step" if twin else "")
        if layout is None:
            layout = model_layout(model, unit_classes, leaf_modules)
        def need_with(cache: int) -> dict:
            p = placement_bytes(model, stage, opt, param, world_size, dtype, prefetch,
                                unit_classes, accelerator, layout=layout,
                                update_timing=timing, tail_state_in_host=tail_state_in_host,
                                host_cache_bytes=cache, moment_dtype=moment_dtype)
            return {t: p.tier_bytes(t) for t in TIERS}

        cache = 0 if host_cache_bytes == "auto" else host_cache_bytes
        need = need_with(cache)
        short = _shortfall(need, budgets)
        if host_cache_bytes == "auto" and opt == "nvme" and not short:
            cache = _auto_host_cache(need, budgets)
            while cache and _shortfall(need_with(cache), budgets):
                cache //= 2  # (a cache costs at most its bytes: this only guards the rule)
            need = need_with(cache)
            label += f" host cache {_fmt(cache)}"
        tried.append(f"{label}: needs " + ", ".join(f"{t} {_fmt(need[t])}" for t in need)
                     + (" -> fits" if not short else " -> short of " + ", ".join(
                         f"{t} by {_fmt(b)}" for t, b in short.items())))
        last = (opt, param, need, short)
        if not short:
            choice = PlacementChoice(opt, param, need, budgets, tuple(tried), update_timing=timing,
                                     host_cache_bytes=cache if opt == "nvme" else 0)
            log.info("offload='auto' chose offload_optimizer=%r offload_param=%r "
                     "update_timing=%r; budgets %s; %s", opt, param, timing,
                     {t: _fmt(b) for t, b in budgets.items() if t != "shared"}, "; ".join(tried))
            return choice
    detail = "; ".join(tried)
    if last is None:
        raise ValueError(f"offload='auto' found no placement to try at stage={stage}: {detail}")
    raise ValueError(
        f"offload='auto': the model does not fit even with everything offloaded "
        f"(offload_optimizer={last[0]!r}, offload_param={last[1]!r}): short of "
        + ", ".join(f"{t} by {_fmt(b)}" for t, b in last[3].items())
        + f". Budgets: " + ", ".join(f"{t} {_fmt(b)}" for t, b in budgets.items() if t != "shared")
        + f". Tried: {detail}. Use more ranks, a larger disk at path=, or a smaller model.")


def _auto_host_cache(need: dict, budgets: dict) -> int:
    """``host_cache_bytes="auto"``: half the host memory the budgets leave beside ``need``
    (the placement without a cache), the other half kept as a margin for what the estimate
    does not count (activations, the allocator, other processes). Bytes, >= 0."""
    used = need["host"] + (need["device"] if budgets["shared"] else 0)
    return max(0, budgets["host"] - used) // 2


def _shortfall(need: dict, budgets: dict) -> dict:
    short = {}
    if budgets["shared"]:
        total = need["device"] + need["host"]
        if total > budgets["host"]:
            short["device+host"] = total - budgets["host"]
    else:
        for t in ("device", "host"):
            if need[t] > budgets[t]:
                short[t] = need[t] - budgets[t]
    if need["nvme"] > budgets["nvme"]:
        short["nvme"] = need["nvme"] - budgets["nvme"]
    return short


def _fmt(nbytes: int) -> str:
    if nbytes < 2**20:
        return f"{nbytes} B"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"
