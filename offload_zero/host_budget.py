"""The memory plan within a host budget (``max_host_bytes``): :func:`fit_host_budget` lowers
what the engine may lower until the plan's host tier fits, or says what is short;
:func:`host_budget_report` is ``memory_report()["host_budget"]``. The plan itself, its pools
and model states: :mod:`offload_zero.plan`."""
from __future__ import annotations

import dataclasses
from typing import Dict, Sequence, Tuple

from offload_zero.memory.state_format import StateFormat
from offload_zero.plan import (FlatSpec, MemoryPlan, PlanSettings, chunk_numel_of, memory_plan,
                               pipeline_chunk_numel)


def fit_host_budget(layout: Sequence[FlatSpec], settings: PlanSettings) -> MemoryPlan:
    """:func:`memory_plan` within ``settings.max_host_bytes`` (None: no budget, the plan as it
    is). While the plan's host tier (model states, pools and bytes in flight:
    :meth:`MemoryPlan.tier_bytes`) is over the budget, in this order, each step only where it
    lowers the host tier and keeps the numbers exact:

    1. the optimizer pipeline streams the state in chunks of half as many elements (its three
       buffer sets shrink with them; the update is element-wise), down to one chunk of
       :attr:`StateFormat.chunk_multiple` elements (4096 bytes of each region);
    2. with ``update_timing`` left to the engine (``"update_timing"`` in
       ``settings.left_to_engine``) and resolved to ``"backward"`` or ``"next_forward"``, the
       plain step (``"step"``: no whole-state read-ahead ring, no embeddings' state kept in
       host memory; all timings give the same numbers); an explicit timing is never changed;
    3. with ``prefetch`` left at its default, no units read ahead (``prefetch=0``: the
       parameter-shard buffers of [Note: pools] for the running unit alone; every gather
       still finds its shard, read when the unit runs).

    After step 2 or 3 the chunk starts again from the one given, halved only as far as needed.
    ``host_cache_bytes`` is never lowered. The plan returned says what changed
    (:attr:`MemoryPlan.shrunk`, e.g. ``("pipeline_chunk_numel 4194304->16384",
    "update_timing next_forward->step")``); its settings are the ones the engine runs with.

    Raises ValueError, before anything is allocated, when even the last of these plans is over
    the budget: naming the budget, the bytes needed, what was lowered, the largest host items,
    ``update_timing="step"`` with its bytes where an explicit timing is what does not fit, an
    explicit ``host_cache_bytes``, and what to change."""
    plan = memory_plan(layout, settings)
    budget = settings.max_host_bytes
    if budget is None or plan.tier_bytes("host") <= budget:
        return plan
    for lowered, changes in _lowerings(layout, settings):
        plan = _fit_chunk(layout, lowered, budget)
        chunk = (chunk_numel_of(settings), chunk_numel_of(plan.settings))
        shrunk = ((f"pipeline_chunk_numel {chunk[0]}->{chunk[1]}",) if chunk[0] != chunk[1]
                  else ()) + changes
        if plan.tier_bytes("host") <= budget:
            return dataclasses.replace(plan, shrunk=shrunk)
    raise ValueError(_over_budget(layout, dataclasses.replace(plan, shrunk=shrunk), settings))


def _lowerings(layout, s: PlanSettings):
    """``(settings, changes)``: ``s`` as given, then with steps 2 and 3 of
    :func:`fit_host_budget` added one after the other (each only where it is left to the
    engine and lowers the host tier), ``changes`` naming them."""
    yield s, ()
    changes: Tuple[str, ...] = ()
    for name, value, applies in (("update_timing", "step", s.update_timing in _RING_TIMINGS),
                                 ("prefetch", 0, s.prefetch > 0)):
        if name not in s.left_to_engine or not applies:
            continue
        lowered = dataclasses.replace(s, **{name: value})
        if memory_plan(layout, lowered).tier_bytes("host") < memory_plan(layout, s).tier_bytes(
                "host"):
            changes += (f"{name} {getattr(s, name)}->{value}",)
            s = lowered
            yield s, changes


_RING_TIMINGS = ("backward", "next_forward")  # timings with a whole-state read-ahead ring


def _fit_chunk(layout, s: PlanSettings, budget: int) -> MemoryPlan:
    """The plan of ``s`` with the optimizer pipeline's chunk halved (from ``s``'s) until the
    host tier fits ``budget`` or the chunk is the format's smallest (step 1 of
    :func:`fit_host_budget`)."""
    plan = memory_plan(layout, s)
    smallest = StateFormat(s.moment_dtype, s.master_dtype).chunk_multiple
    chunk = chunk_numel_of(s)
    while plan.tier_bytes("host") > budget and plan.pool("optimizer_pipeline") is not None \
            and chunk > smallest:
        chunk = max(smallest, chunk // 2 // smallest * smallest)
        plan = memory_plan(layout, dataclasses.replace(s, pipeline_chunk_numel=chunk))
    return plan


def _over_budget(layout, plan: MemoryPlan, given: PlanSettings) -> str:
    """The message of :func:`fit_host_budget`'s ValueError for ``plan``, the last it tried
    (``given``: the settings it was asked for)."""
    s, budget, need = plan.settings, plan.settings.max_host_bytes, plan.tier_bytes("host")
    items = {f"{kind} (model states)": b for kind, b in plan.states()["host"].items()}
    items.update({f"{p.name} pool": int(p.capacity_bytes) for p in plan.pools
                  if p.tier == "host"})
    items.update({f"{kind} (in flight)": b for kind, b in plan.extras()["host"].items()
                  if kind != "buffers"})
    top = ", ".join(f"{name} {b}" for name, b in
                    sorted(items.items(), key=lambda kv: -kv[1])[:3] if b)
    lowered = "".join(f", {c}" for c in plan.shrunk if not c.startswith("pipeline_chunk"))
    fixes = []
    if s.update_timing in _RING_TIMINGS:  # (explicit, or the plain step saves nothing)
        step = _fit_chunk(layout, dataclasses.replace(
            s, update_timing="step", pipeline_chunk_numel=given.pipeline_chunk_numel), budget)
        if step.tier_bytes("host") <= budget:
            fixes.append(f"update_timing='step' (or 'auto') would fit: it needs "
                         f"{step.tier_bytes('host')} bytes, update_timing={s.update_timing!r} "
                         "holds whole states in a read-ahead ring")
    if s.host_cache_bytes and s.optimizer_tier == "nvme":
        fixes.append(f"lower host_cache_bytes={s.host_cache_bytes} (never lowered by the "
                     "engine)")
    return (f"max_host_bytes={budget} is short by {need - budget} bytes: this placement needs "
            f"{need} bytes of host memory even with the optimizer state streamed in chunks of "
            f"{chunk_numel_of(s)} elements{lowered} (largest: {top}); "
            + "".join(f"{fix}; " for fix in fixes)
            + "raise max_host_bytes, move state to NVMe (offload='nvme'), or use "
            "offload='auto'")


def host_budget_report(plan: MemoryPlan, peak_bytes: int) -> Dict[str, object]:
    """``memory_report()["host_budget"]`` of an engine built from ``plan`` with
    ``max_host_bytes``: ``{"max_host_bytes", "planned_bytes"`` (the plan's host tier at the
    step's peak), ``"peak_bytes"`` (``peak_bytes``: the host tier's measured peak),
    ``"pipeline_chunk_numel"`` (elements per chunk of the optimizer pipeline), ``"shrunk"``
    (list of :attr:`MemoryPlan.shrunk`: what :func:`fit_host_budget` lowered, each
    ``"<setting> <given>-><in force>"``)}``. Units: bytes."""
    return {"max_host_bytes": plan.settings.max_host_bytes,
            "planned_bytes": plan.tier_bytes("host"), "peak_bytes": peak_bytes,
            "pipeline_chunk_numel": pipeline_chunk_numel(plan), "shrunk": list(plan.shrunk)}
