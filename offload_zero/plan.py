"""The memory plan: every byte the engine holds, from the model's layout and the settings.

One function, :func:`memory_plan`, says for a layout (the flat parameters as the engine cuts
them: sizes, units, trainable or frozen, tied parameters once) and resolved settings (stage,
tiers, dtype, world size, prefetch, update timing, host cache) what the engine will hold:

- model states per tier and kind (parameters, gradients, master weights, moments);
- every fixed pool of buffers, as ``(name, tier, count, bytes each)`` (see [Note: pools]);
- the bytes in flight that are no pool (a unit's full gradient before it is reduced);
- the decisions behind them: whether the master is the parameter shard itself (master
  aliasing), which flat parameter's state stays in host memory (the tail and the host cache).

The engine builds exactly these pools (and checks it); :func:`offload_zero.estimate_memory` and
``offload="auto"`` sum the same plan, so the estimate is the engine's bytes by construction.

[Note: pools]
Pools are sized at start-up and never grow (``K``: the compute dtype's bytes per element;
``shard``: a flat parameter's elements per rank, padded to 4096 bytes; ``ahead``: units in
flight ahead of the running one, ``prefetch`` capped at the other blocks):

- ``gather`` (device): stage 3 unless one rank keeps its shards on the device (its shard is
  the whole parameter: nothing gathered); ``ahead + 1`` slots of the largest block's gathered
  bytes, one when the shards live on NVMe (the units ahead are read into host buffers instead);
  ``gather_root`` (device): one slot of the root unit's gathered bytes.
- ``param_shards`` (host): trainable parameter shards on NVMe; ``f * (ahead + 2) + ring``
  buffers of the largest such shard read from a file through it (reads ahead of use for the
  ``f`` such flat parameters of a block, usually 1; and 2 more for new shards' write-backs in
  flight, a write being waited for only when every buffer is in use; none when shards of the
  master's dtype (fp32, or bf16 with a bf16 master) and their optimizer state are both on
  NVMe: the shard is the master's bytes and the update writes it once).
  ``param_shards_frozen`` (host): the same for frozen shards (``f * (ahead + 2)``, no ring:
  never written), so that small trainable shards (LoRA's adapters) do not take buffers the
  size of the frozen base weights. Shards kept in host memory (a state kept there and its
  shard, a frozen shard the host cache keeps) and the outsized root parts take neither: no
  such pool when nothing else is on NVMe. ``param_shards_root``
  (host): where a root flat parameter is larger than a block shard, buffers of the largest
  such part on NVMe, one per such outsized flat parameter when all the root is trainable
  (each keeps its updated shard for the next forward; none for a state kept in host memory
  that is its own shard), else one.
- ``optimizer_pipeline`` (host): the optimizer state on NVMe; three buffer sets (read k+1 |
  update k | write k-1), each one whole state of ``min(largest streamed shard, chunk)``
  elements (1024 when nothing streams: every state is in host memory).
- ``optimizer_prefetch`` (host): the state on NVMe with updates in backward or in the next
  forward; two buffers of the largest streamed block shard's whole state, three with the next
  forward or when backward gathers parameter shards from them (the master's bytes), or
  ``optimizer_prefetch`` (at least that many); never more than the block flat parameters
  whose state streams (the rest kept in host memory).
- ``staging`` (host): an accelerator, the optimizer state off it and the parameter shards on
  it: one buffer of the largest trainable shard (the update's copy back to the device).
- ``reduce_scratch`` (device): N > 1: one shard of the largest trainable shard, that every
  reduce-scatter writes into.

[Note: bytes in flight]
Besides the pools, at the step's peak:

- stages 2 and 3: one unit's full gradient before its reduce-scatter, the largest trainable
  flat parameter's padded bytes (device gradients). On a CPU device that memory is a buffer
  kept from step to step (kind "buffers"), the size of the largest flat parameter of several
  parameters or with padding; a flat parameter of one unpadded parameter takes its gradient
  as autograd made it, a device gradient beside that buffer while it is reduced. One rank's
  fp32 host shards adopt the gradients themselves instead (see [Note: reused gradient memory]
  in offload_zero/partition/grads.py).
- stage 3 without storage rebinding (an old torch): the gather pool's bytes, allocated per
  gather instead.

[Note: model states in the engine]
The paper's arithmetic (see [Note: model-state arithmetic] in :mod:`offload_zero.estimator`),
with the engine's layout and these decisions:

- master aliasing: with a master of the compute dtype (fp32 in an fp32 model, bf16 with
  ``master_dtype="bf16"``) the master weights are the parameter shard itself when both sit on
  the device (no offload, or ``"cpu"`` where the CPU itself is the device) or both in NVMe files
  (the shard is read from the master's bytes): 0 bytes beyond the parameters.
- states kept in host memory (``in_host``): with updates in backward or in the next forward and
  the state on NVMe, the root's last trainable flat parameter (the embeddings: updated last in
  backward, needed first in forward; see :func:`offload_zero.partition.units.host_tail_index`)
  when its shard is at most a quarter of all trainable shards (``tail_state_in_host=None``),
  and those ``host_cache_bytes`` takes (see [Note: host cache] in
  :mod:`offload_zero.memory.host_cache`): 12 bytes per element there (8 with bf16 moments),
  2 less with a bf16 master, the master's bytes less when it is the CPU device's shard; a
  parameter shard on NVMe that is its master's bytes is then that host master (0 on NVMe).
- NVMe moments are padded to 4096 bytes each (see [Note: state layout] in
  :mod:`offload_zero.memory.state_format`).
- ``update_timing="backward"`` on one CPU rank whose fp32 host shards adopt the gradients: each
  gradient is used up by its update in backward and its memory serves the next of its size
  class, so the host gradients are one of each size class plus the largest taken as autograd
  made it.

Units: bytes everywhere; element counts are named ``_numel``.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Dict, FrozenSet, Optional, Sequence, Tuple, Union

import torch

from offload_zero.memory.state_format import StateFormat
from offload_zero.tables import TIER_OF_OFFLOAD, TIERS

KINDS = ("parameters", "gradients", "master_weights", "moments", "buffers")
ALIGN_BYTES = 4096
Number = Union[int, Fraction]
_WRITE_RING = 2       # parameter-shard buffers for write-backs in flight (NVMeParamHome)
_PIPELINE_DEPTH = 3   # optimizer pipeline buffer sets
_IDLE_PIPELINE_NUMEL = 1024  # the pipeline's chunk when nothing streams


@dataclasses.dataclass(frozen=True)
class FlatSpec:
    """One flat parameter of the layout: ``numel`` real elements of one unit.

    ``unit``: the unit's index (the root unit is ``-1``); ``trainable``: its ``requires_grad``;
    ``single``: it holds one parameter (unpadded, its gradient is taken as autograd made it; see
    [Note: reused gradient memory] in offload_zero/partition/grads.py).
    """

    numel: int
    unit: int
    trainable: bool
    single: bool = False


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """The resolved settings a plan depends on.

    Fields: ``stage`` 1-3 (0: plain data parallelism, model states only);
    ``offload_optimizer`` / ``offload_param`` ("none", "cpu", "nvme"; parameters leave the
    device only at stage 3); ``world_size`` N >= 1; ``dtype`` the compute dtype; ``prefetch``
    units gathered ahead (>= 0); ``accelerator`` (False: the CPU plays the device);
    ``update_timing`` (resolved: ``"step"``, ``"backward"`` or ``"next_forward"``; see
    :mod:`offload_zero.update.rules`);
    ``tail_state_in_host`` (None, True, False) and ``host_cache_bytes`` (bytes >= 0) which
    states stay in host memory; ``optimizer_prefetch`` (None: the least the update timing
    needs, else that many whole-state read-ahead buffers); ``moment_dtype`` (float32,
    bfloat16 or uint8: int8 codes); ``master_dtype`` (float32, or bfloat16: [Note: bf16
    master weights] in :mod:`offload_zero.memory.state_format`); ``padded`` (False: the
    paper's unpadded arithmetic, shards of exactly numel / N elements, for a layout assumed from
    a parameter count); ``rebinding`` (whether this torch can bind gathered units to pool
    slots; without it they are allocated per gather, bytes counted in flight);
    ``pipeline_chunk_numel``: the most elements of a state the optimizer pipeline streams at
    once (None: ``NVMeStore.CHUNK_NUMEL``, read when the plan is made; smaller where a host
    budget asks, see :func:`offload_zero.host_budget.fit_host_budget`); ``max_host_bytes``:
    that budget (bytes on the host tier), or None; ``left_to_engine``: the settings the user
    left to the engine, which that budget may lower (``"update_timing"`` left at ``"auto"``,
    ``"prefetch"`` left at its default; see ``EngineConfig.left_to_engine``).
    """

    stage: int
    offload_optimizer: str
    offload_param: str
    world_size: int = 1
    dtype: torch.dtype = torch.bfloat16
    prefetch: int = 1
    accelerator: bool = True
    update_timing: str = "step"
    tail_state_in_host: Optional[bool] = None
    host_cache_bytes: int = 0
    optimizer_prefetch: Optional[int] = None
    moment_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    padded: bool = True
    rebinding: bool = True
    pipeline_chunk_numel: Optional[int] = None
    max_host_bytes: Optional[int] = None
    left_to_engine: FrozenSet[str] = frozenset()

    @property
    def in_backward(self) -> bool:
        """Whether updates run in backward (``update_timing="backward"``)."""
        return self.update_timing == "backward"

    @property
    def in_forward(self) -> bool:
        """Whether updates run in the next forward (``update_timing="next_forward"``)."""
        return self.update_timing == "next_forward"

    @property
    def master_is_compute(self) -> bool:
        """Whether the master weights have the compute dtype (fp32 ones of an fp32 model, bf16
        ones of a bf16 model): a parameter shard can then be its master's memory or bytes."""
        return self.master_dtype == self.dtype

    @property
    def itemsize(self) -> int:
        """K: bytes per element of the compute dtype."""
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def param_tier(self) -> str:
        """Tier of the parameter shards: "device" below stage 3."""
        return TIER_OF_OFFLOAD[self.offload_param] if self.stage == 3 else "device"

    @property
    def optimizer_tier(self) -> str:
        """Tier of the master weights and moments."""
        return TIER_OF_OFFLOAD[self.offload_optimizer]


def settings_of(cfg, world_size: int, device: torch.device, rebinding: bool) -> PlanSettings:
    """The :class:`PlanSettings` of an engine's resolved ``EngineConfig`` (``offload`` not
    "auto"), its world size, device and whether torch can rebind storages
    (:func:`offload_zero.memory.pool.storage_rebinding_supported`). The one place the update
    timing is read from the config."""
    return PlanSettings(
        stage=cfg.stage, offload_optimizer=cfg.offload_optimizer, offload_param=cfg.offload_param,
        world_size=world_size, dtype=cfg.dtype, prefetch=cfg.prefetch,
        accelerator=device.type != "cpu", update_timing=cfg.update_timing,
        tail_state_in_host=cfg.tail_state_in_host,
        host_cache_bytes=cfg.host_cache_bytes, optimizer_prefetch=cfg.optimizer_prefetch,
        moment_dtype=cfg.moment_torch_dtype, master_dtype=cfg.master_torch_dtype,
        rebinding=rebinding, max_host_bytes=cfg.max_host_bytes,
        left_to_engine=frozenset(cfg.left_to_engine))


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One fixed pool: ``count`` buffers of ``buffer_numel`` elements of ``itemsize`` bytes on
    ``tier`` ("device" or "host"); ``buffer_bytes`` = ``buffer_numel * itemsize``."""

    name: str
    tier: str
    count: int
    buffer_numel: Number
    itemsize: int

    @property
    def buffer_bytes(self) -> Number:
        """Bytes of one buffer."""
        return self.buffer_numel * self.itemsize

    @property
    def capacity_bytes(self) -> Number:
        """Bytes of the whole pool: ``count * buffer_bytes``."""
        return self.count * self.buffer_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What :func:`memory_plan` returns: the engine's bytes for one layout and settings.

    Fields:
        settings, layout: the inputs.
        shard_numel: elements per rank of each flat parameter of ``layout`` (padded, or the
            exact fraction numel / N unpadded).
        model_states: ``{tier: {kind: bytes}}``, kinds of :data:`KINDS` ("buffers" 0).
        pools: every fixed pool (see [Note: pools]).
        in_flight: ``{tier: {kind: bytes}}`` held at the step's peak beside the pools (a unit's
            full gradient before its reduction; gathered units without storage rebinding).
        master_aliased: the trainable shards are their own master weights (no copy; the master
            has the compute dtype: :attr:`PlanSettings.master_is_compute`).
        host_master_aliased: a state kept in host memory has the parameter shard as its
            master (a master of the compute dtype on a CPU device, shards on the device).
        master_is_param_on_nvme: parameter shards on NVMe are read from their master's
            bytes in the optimizer's files (no files of their own, no write-back ring): a
            master of the compute dtype.
        keeps_full_params: gathered parameters stay allocated (stages 1-2; stage 3 with one rank
            and its shards on the device).
        tail: index in ``layout`` of the state ``tail_state_in_host`` keeps, or None.
        in_host: indices whose optimizer state stays in host memory (the tail and the host
            cache's choice); empty unless the state is on NVMe.
        outsized_root: indices of the root's flat parameters larger than a block shard whose
            parameter shards on NVMe go through ``param_shards_root``.
        keep_root: the root's updated shards stay in their buffers for the next forward.
        host_cache: where the optimizer state and the parameter shards are kept, host memory
            or NVMe: counts of flat parameters and bytes, the same keys in every configuration
            (:data:`offload_zero.memory.host_cache.REPORT_KEYS`, zeros where nothing applies;
            see [Note: host cache report] in :mod:`offload_zero.memory.host_cache`): what
            ``memory_report()["host_cache"]`` reports.
        params_in_host: indices of frozen flat parameters whose shard (on NVMe otherwise)
            stays in host memory with what ``host_cache_bytes`` leaves after the states (rule
            3 of [Note: host cache]).
        shrunk: what :func:`offload_zero.host_budget.fit_host_budget` lowered to fit
            ``max_host_bytes``, in the order it did, each ``"<setting> <given>-><in force>"``
            (empty: nothing).
    """

    settings: PlanSettings
    layout: Tuple[FlatSpec, ...]
    shard_numel: Tuple[Number, ...]
    model_states: Dict[str, Dict[str, Number]]
    pools: Tuple[PoolSpec, ...]
    in_flight: Dict[str, Dict[str, Number]]
    master_aliased: bool
    host_master_aliased: bool
    master_is_param_on_nvme: bool
    keeps_full_params: bool
    tail: Optional[int]
    in_host: FrozenSet[int]
    outsized_root: FrozenSet[int]
    keep_root: bool
    host_cache: Dict[str, int]
    shrunk: Tuple[str, ...] = ()
    params_in_host: FrozenSet[int] = frozenset()

    def pool(self, name: str) -> Optional[PoolSpec]:
        """The pool called ``name``, or None when the plan has none of that name."""
        return next((p for p in self.pools if p.name == name), None)

    def pools_report(self) -> Dict[str, Dict[str, int]]:
        """``{name: {"tier", "buffers", "buffer_bytes", "capacity_bytes"}}``: the keys of
        ``memory_report()["pools"]``."""
        return {p.name: {"tier": p.tier, "buffers": p.count, "buffer_bytes": p.buffer_bytes,
                         "capacity_bytes": p.capacity_bytes} for p in self.pools}

    def extras(self) -> Dict[str, Dict[str, int]]:
        """``{tier: {kind: bytes}}`` beside the model states: the pools (kind "buffers") plus
        the bytes in flight, rounded to whole bytes."""
        out = {t: dict(kinds) for t, kinds in self.in_flight.items()}
        for p in self.pools:
            out[p.tier]["buffers"] += p.capacity_bytes
        return _to_bytes(out)

    def states(self) -> Dict[str, Dict[str, int]]:
        """:attr:`model_states` rounded to whole bytes."""
        return _to_bytes(self.model_states)

    def by_kind(self, tier: str) -> Dict[str, int]:
        """Model states plus extras per kind on ``tier``: what the engine's
        ``memory_report()[tier]["by_kind"][kind]["peak_bytes"]`` reports."""
        states, extras = self.states(), self.extras()
        return {k: states[tier][k] + extras[tier][k] for k in KINDS}

    def tier_bytes(self, tier: str) -> int:
        """All bytes on ``tier`` ("device", "host", "nvme")."""
        return sum(self.by_kind(tier).values())


def shard_numel(numel: int, world_size: int, itemsize: int, padded: bool = True) -> Number:
    """Elements per rank of a flat parameter of ``numel`` elements: ``ceil(numel / N)`` rounded
    up to a multiple of ``4096 / itemsize`` (at least one such block), as
    :func:`offload_zero.partition.flat_param.shard_numel_for`; unpadded, the fraction numel / N."""
    if not padded:
        return Fraction(numel, world_size)
    align = ALIGN_BYTES // itemsize
    return max(1, math.ceil(numel / (world_size * align))) * align


def layout_of(planned) -> Tuple[FlatSpec, ...]:
    """The layout of ``planned``: ``(unit index or -1 for the root, trainable, members)`` per
    flat parameter in construction order, ``members`` a list of ``(parameter, references)``
    (as :func:`offload_zero.partition.units.plan_flat_params` gives them). Tied parameters
    are members once. Raises ValueError when there is no parameter at all."""
    specs = tuple(FlatSpec(sum(p.numel() for p, _ in members), unit, trainable,
                           len(members) == 1) for unit, trainable, members in planned)
    if not specs:
        raise ValueError("the model has no parameters")
    return specs


def memory_plan(layout: Sequence[FlatSpec], settings: PlanSettings) -> MemoryPlan:
    """The engine's bytes for ``layout`` (its flat parameters in construction order, as
    :func:`offload_zero.estimator.model_layout` gives them) under ``settings``.

    Model states follow Rajbhandari et al., 2019 (ZeRO), sec. 5, as [Note: model states in the
    engine] says; pools follow [Note: pools], the rest [Note: bytes in flight]. Raises
    ValueError for an empty layout or settings out of range (naming the value)."""
    s = settings
    if not layout:
        raise ValueError("layout is empty: a plan needs at least one flat parameter")
    if s.stage not in (0, 1, 2, 3) or s.world_size < 1 or s.prefetch < 0:
        raise ValueError(f"stage={s.stage!r}, world_size={s.world_size!r}, prefetch="
                         f"{s.prefetch!r}: need stage 0-3, world_size >= 1, prefetch >= 0")
    layout = tuple(layout)
    k = s.itemsize
    shards = tuple(shard_numel(f.numel, s.world_size, k, s.padded) for f in layout)
    fmt = StateFormat(s.moment_dtype, s.master_dtype)
    share = (s.param_tier == "nvme" and s.optimizer_tier == "nvme" and s.master_is_compute)
    tail, in_host = _in_host(layout, shards, s, fmt)
    frozen = _frozen_in_host(layout, shards, s, fmt, in_host)
    states = _model_states(layout, shards, s, fmt, in_host, frozen)
    outsized, keep_root = _outsized_root(layout, shards)
    pools = _pools(layout, shards, s, fmt, in_host | frozen, share, outsized, keep_root)
    host_cache = _host_cache(layout, shards, s, fmt, in_host, frozen)
    return MemoryPlan(
        settings=s, layout=layout, shard_numel=shards, model_states=states, pools=pools,
        in_flight=_in_flight(layout, shards, s), master_aliased=_aliased(s),
        host_master_aliased=_host_alias(s),
        master_is_param_on_nvme=share, keeps_full_params=_keeps_full(s), tail=tail,
        in_host=in_host, outsized_root=outsized, keep_root=keep_root, host_cache=host_cache,
        params_in_host=frozen)


# -- decisions -----------------------------------------------------------------------------------
def _aliased(s: PlanSettings) -> bool:
    """Master weights in the same memory as the parameter shard of their dtype, the shard being
    the master: optimizer state on the device (or host "offload" where the CPU is the
    device)."""
    same_memory = s.optimizer_tier == "device" or (s.optimizer_tier == "host"
                                                   and not s.accelerator)
    return same_memory and s.param_tier == "device" and s.master_is_compute


def _host_alias(s: PlanSettings) -> bool:
    """A state kept in host memory whose master is the parameter shard (a CPU device, a
    master of the compute dtype)."""
    return not s.accelerator and s.param_tier == "device" and s.master_is_compute


def _keeps_full(s: PlanSettings) -> bool:
    return s.stage < 3 or (s.world_size == 1 and s.param_tier == "device")


def _host_state_bytes_per_element(s: PlanSettings, fmt: StateFormat) -> float:
    """Host bytes per element of a state kept in host memory (int8 moments' scales
    included: :attr:`StateFormat.resident_bytes_per_element`), less the master's bytes when it
    is the parameter shard itself."""
    return fmt.resident_bytes_per_element - (fmt.master_itemsize if _host_alias(s) else 0)


def _in_host(layout, shards, s: PlanSettings, fmt: StateFormat):
    """``(tail, in_host)``: see :class:`MemoryPlan`."""
    if s.optimizer_tier != "nvme":
        return None, frozenset()
    from offload_zero.memory.host_cache import plan_host_cache
    from offload_zero.partition.units import host_tail_index
    flat = _flat_info(layout, shards)
    tail = None
    if s.in_backward or s.in_forward:
        tail = host_tail_index([(b is None, t, sh) for b, t, sh in flat], s.tail_state_in_host)
    chosen = plan_host_cache(flat, s.host_cache_bytes, _host_state_bytes_per_element(s, fmt),
                             tail=tail, blocks_reversed=s.in_backward)
    return tail, frozenset(chosen)


def _flat_info(layout, shards):
    """``(block, trainable, shard_numel)`` per flat parameter, as
    :mod:`offload_zero.memory.host_cache` takes them (block None: the root)."""
    return [(None if f.unit == -1 else f.unit, f.trainable, sh) for f, sh in zip(layout, shards)]


def _frozen_in_host(layout, shards, s: PlanSettings, fmt: StateFormat, in_host):
    """:attr:`MemoryPlan.params_in_host`."""
    if s.optimizer_tier != "nvme" or s.param_tier != "nvme" or not s.host_cache_bytes:
        return frozenset()
    from offload_zero.memory.host_cache import plan_frozen_cache
    per = _host_state_bytes_per_element(s, fmt)
    left = s.host_cache_bytes - sum(per * shards[i] for i in in_host)
    flat = _flat_info(layout, shards)
    return frozenset(plan_frozen_cache(flat, left, s.itemsize))


def _host_cache(layout, shards, s: PlanSettings, fmt: StateFormat, in_host, frozen):
    """:attr:`MemoryPlan.host_cache`: [Note: host cache report] in
    :mod:`offload_zero.memory.host_cache`, from the same decisions as :func:`_model_states`
    (``in_host``: states kept in host memory; ``frozen``: frozen shards kept there). Bytes."""
    trainable = [i for i, f in enumerate(layout) if f.trainable]
    opt = {i: shards[i] * (s.world_size if s.stage == 0 else 1) for i in trainable}
    if s.optimizer_tier == "nvme":
        held, alias = [i for i in trainable if i in in_host], _host_alias(s)
        on_nvme = [i for i in trainable if i not in in_host]
    else:
        held, alias = (trainable if s.optimizer_tier == "host" else []), _aliased(s)
        on_nvme = []
    everything = range(len(layout))
    if s.param_tier == "host":
        host_params, read = list(everything), []
    elif s.param_tier == "nvme":
        # a kept state's shard of the master's dtype is that host master: in neither
        host_params = [i for i in everything if i in frozen
                       or (i in in_host and not s.master_is_compute)]
        read = [i for i in everything if i not in frozen and i not in in_host]
    else:
        host_params, read = [], []
    host_frozen = [i for i in host_params if not layout[i].trainable]
    k = s.itemsize
    return {"host_flat_params": len(held), "nvme_flat_params": len(on_nvme),
            "host_state_bytes": int(sum(_host_state_bytes(fmt, opt[i], alias, s.padded)
                                        for i in held)),
            "nvme_state_bytes": int(sum(_state_bytes(fmt, opt[i], s.padded) for i in on_nvme)),
            "host_param_flat_params": len(host_params),
            "nvme_param_flat_params": len(read),
            "host_param_bytes": int(sum(k * shards[i] for i in host_params)),
            "nvme_param_bytes": int(sum(k * shards[i] for i in read)),
            "host_frozen_flat_params": len(host_frozen),
            "host_frozen_bytes": int(sum(k * shards[i] for i in host_frozen))}


def _host_state_bytes(fmt: StateFormat, numel, alias: bool, padded: bool):
    """Host bytes of one state of ``numel`` elements kept in host memory, as the store
    allocates it: master (none when ``alias``: the parameter shard is the master) and moments
    with int8 moments' scales; unpadded, the per-element arithmetic."""
    if not padded:
        return (fmt.resident_bytes_per_element - (fmt.master_itemsize if alias else 0)) * numel
    return (0 if alias else fmt.master_itemsize * numel) + fmt.resident_moment_bytes(numel)


def _outsized_root(layout, shards):
    """``(outsized, keep_root)``: the root's flat parameters larger than the largest block
    shard, and whether all the root is trainable (its updated shards then stay in their
    buffers, one buffer each)."""
    block = max((sh for f, sh in zip(layout, shards) if f.unit != -1), default=0)
    root = [i for i, f in enumerate(layout) if f.unit == -1]
    outsized = frozenset(i for i in root if shards[i] > block)
    return outsized, all(layout[i].trainable for i in root)


def _ahead(layout, prefetch: int) -> int:
    """Units really in flight ahead of the running one: ``prefetch``, at most the other
    blocks (so a huge ``prefetch`` costs nothing)."""
    return max(0, min(prefetch, len({f.unit for f in layout if f.unit != -1}) - 1))


def _flats_per_block(layout) -> int:
    """The most flat parameters one block unit has (1, or 2 where a block holds trainable and
    frozen parameters): the parameter-shard read-ahead holds that many shards per unit."""
    per_unit: Dict[int, int] = {}
    for f in layout:
        if f.unit != -1:
            per_unit[f.unit] = per_unit.get(f.unit, 0) + 1
    return max(per_unit.values(), default=1)


def _grad_as_is(spec: FlatSpec, shard, n: int, padded: bool) -> bool:
    """One parameter and no padding: its gradient is taken as autograd made it (see
    :attr:`offload_zero.partition.flat_param.FlatParam.grad_as_is`)."""
    return spec.single and (not padded or shard * n == spec.numel)


def _shards_adopt_grads(s: PlanSettings) -> bool:
    """The host gradient shards are the full gradients' own memory: one rank on a CPU device
    at stage 2 or 3 with offload and fp32 (see [Note: reused gradient memory])."""
    return (s.stage >= 2 and s.world_size == 1 and s.offload_optimizer != "none"
            and s.itemsize == 4 and not s.accelerator)


def _state_bytes(fmt: StateFormat, numel, padded: bool, moments_only: bool = False):
    """Bytes of a state of ``numel`` elements (master and moments, or the moments alone): with
    the padding of [Note: state layout], or the unpadded ``bytes_per_element`` arithmetic."""
    if padded:
        return fmt.moment_bytes(numel) if moments_only else fmt.nbytes(numel)
    return (fmt.bytes_per_element - (fmt.master_itemsize if moments_only else 0)) * numel


def _state_buffer_numel(fmt: StateFormat, numel, padded: bool) -> Number:
    """fp32 elements of a buffer that holds a whole state of ``numel`` elements."""
    return fmt.buffer_numel(numel) if padded else Fraction(_state_bytes(fmt, numel, False), 4)


def _zeros() -> Dict[str, Dict[str, Number]]:
    return {t: {k: 0 for k in KINDS} for t in TIERS}


def _to_bytes(d) -> Dict[str, Dict[str, int]]:
    return {t: {k: int(round(v)) for k, v in kinds.items()} for t, kinds in d.items()}


# -- model states --------------------------------------------------------------------------------
def _model_states(layout, shards, s: PlanSettings, fmt: StateFormat, in_host,
                  frozen=frozenset()):
    """Per-rank model-state bytes by tier and kind (see [Note: model states in the engine])."""
    out = _zeros()
    dev, n, k = out["device"], s.world_size, s.itemsize
    opt_tier, param_tier = s.optimizer_tier, s.param_tier
    aliased = _aliased(s) or (s.master_is_compute and s.offload_optimizer == "nvme"
                              and param_tier == "nvme")
    w = fmt.master_itemsize
    for i, (spec, shard) in enumerate(zip(layout, shards)):
        full = shard * n
        if s.stage < 2 and spec.trainable:
            dev["gradients"] += k * full     # full gradients held until the step
        if i in in_host:
            # its state in host memory: a shard that lived in the master's NVMe bytes is that
            # host master now, a shard of another dtype than the master's stays in host
            # memory beside it; on a CPU device the master is the shard itself
            on_nvme = param_tier == "nvme" and s.master_is_compute
            tier = "host" if param_tier == "nvme" else param_tier
            out[tier]["parameters"] += 0 if on_nvme else k * (full if s.stage < 3 else shard)
            out["host"]["gradients"] += 4 * shard
            out["host"]["master_weights"] += 0 if _host_alias(s) else w * shard
            out["host"]["moments"] += fmt.resident_moment_bytes(shard)
            continue
        # (a frozen shard the host cache keeps: in host memory instead of its file)
        out["host" if i in frozen else param_tier]["parameters"] += k * (
            full if s.stage < 3 else shard)
        if not spec.trainable:
            continue
        opt = full if s.stage == 0 else shard  # optimizer state is partitioned from stage 1
        if s.offload_optimizer != "none":
            out["host"]["gradients"] += 4 * opt   # fp32 reduced gradient shards
        elif s.stage >= 2:
            dev["gradients"] += k * shard
        out[opt_tier]["master_weights"] += 0 if aliased else w * opt
        if opt_tier == "nvme":  # (the codes in the file; int8 moments' scales in host memory)
            out["nvme"]["moments"] += _state_bytes(fmt, opt, s.padded, moments_only=True)
            out["host"]["moments"] += fmt.scale_bytes(opt)
        else:
            out[opt_tier]["moments"] += fmt.resident_moment_bytes(opt)
    if s.in_backward and _shards_adopt_grads(s):
        # one rank on a CPU device: the host shards are the gradients' own memory, each used up
        # by its update in backward and reused by the next gradient of its size class; a
        # gradient taken as autograd made it keeps no buffer, each used up before the next
        from offload_zero.partition.grads import size_classes
        trainable = [(sh, f) for f, sh in zip(layout, shards) if f.trainable]
        borrowed = [sh for sh, f in trainable if not _grad_as_is(f, sh, 1, s.padded)]
        taken = [sh for sh, f in trainable if _grad_as_is(f, sh, 1, s.padded)]
        out["host"]["gradients"] = 4 * (sum(set(size_classes(borrowed).values()))
                                        + max(taken, default=0))
    return out


# -- bytes in flight and pools -------------------------------------------------------------------
def _unit_bytes(layout, shards, k: int, n: int) -> Dict[int, Number]:
    full: Dict[int, Number] = {}
    for f, sh in zip(layout, shards):
        full[f.unit] = full.get(f.unit, 0) + k * sh * n
    return full


def _in_flight(layout, shards, s: PlanSettings):
    """Bytes at the step's peak that are no pool (see [Note: bytes in flight])."""
    out = _zeros()
    n, k = s.world_size, s.itemsize
    grad_full = [(k * sh * n, _grad_as_is(f, sh, n, s.padded))
                 for f, sh in zip(layout, shards) if f.trainable]
    if s.stage >= 2 and grad_full:
        # on a CPU device the gradient in flight is one buffer kept from step to step, beside
        # which a gradient taken as autograd made it is briefly a device gradient while it is
        # reduced, unless one rank's fp32 host shards adopt the gradients themselves
        if s.accelerator or _shards_adopt_grads(s):
            out["device"]["gradients"] += max(b for b, _ in grad_full)
        else:
            out["device"]["buffers"] += max((b for b, as_is in grad_full if not as_is), default=0)
            out["device"]["gradients"] += max((b for b, as_is in grad_full if as_is), default=0)
    if s.stage == 3 and not _keeps_full(s) and not s.rebinding:
        full = _unit_bytes(layout, shards, k, n)
        out["device"]["buffers"] += max((b for u, b in full.items() if u != -1), default=0) \
            * _gather_count(layout, s) + full.get(-1, 0)
    return out


def _gather_count(layout, s: PlanSettings) -> int:
    return 1 if s.param_tier == "nvme" else _ahead(layout, s.prefetch) + 1


def _pools(layout, shards, s: PlanSettings, fmt: StateFormat, in_host, share, outsized,
           keep_root) -> Tuple[PoolSpec, ...]:
    """Every fixed pool, in the order the engine builds them (see [Note: pools])."""
    if s.stage == 0:
        return ()
    n, k = s.world_size, s.itemsize
    pools = []
    if s.param_tier == "nvme":
        # only shards read from and written to their files take buffers: a shard whose state
        # is kept in host memory is that master or stays in host memory beside it, and so
        # does a frozen shard the host cache keeps; the outsized root parts have their own
        main = [i for i, f in enumerate(layout) if i not in in_host and i not in outsized]
        # trainable and frozen shards apart: LoRA's adapters need not take buffers the size
        # of the frozen base weights (write-backs: trainable shards not their master's bytes)
        for name, trainable in (("param_shards", True), ("param_shards_frozen", False)):
            mine = [i for i in main if layout[i].trainable == trainable]
            if mine:
                ring = _WRITE_RING if trainable and not share else 0
                pools.append(PoolSpec(name, "host",
                                      _flats_per_block([layout[i] for i in mine])
                                      * (_ahead(layout, s.prefetch) + 2) + ring,
                                      max(max(shards[i] for i in mine), 1), k))
        on_disk = outsized - in_host
        root_count = len(on_disk) if keep_root else int(bool(on_disk))
        if root_count:
            pools.append(PoolSpec("param_shards_root", "host", root_count,
                                  max(shards[i] for i in on_disk), k))
    trainable = [sh for f, sh in zip(layout, shards) if f.trainable]
    if s.accelerator and s.optimizer_tier != "device" and s.param_tier == "device" and trainable:
        pools.append(PoolSpec("staging", "host", 1, max(trainable), k))
    if s.stage == 3 and not _keeps_full(s) and s.rebinding:
        full = _unit_bytes(layout, shards, k, n)
        block_bytes = max((b for u, b in full.items() if u != -1), default=0)
        if block_bytes:
            pools.append(PoolSpec("gather", "device", _gather_count(layout, s), block_bytes, 1))
        if full.get(-1, 0):
            pools.append(PoolSpec("gather_root", "device", 1, full[-1], 1))
    if s.optimizer_tier == "nvme":
        streamed = [sh for i, (f, sh) in enumerate(zip(layout, shards))
                    if f.trainable and i not in in_host]
        numel = [sh for i, (f, sh) in enumerate(zip(layout, shards))
                 if f.unit != -1 and f.trainable and i not in in_host]
        if (s.in_backward or s.in_forward) and numel:
            count = min(_ring_count(s, share), len(numel))
            pools.append(PoolSpec("optimizer_prefetch", "host", count,
                                  _state_buffer_numel(fmt, max(numel), s.padded), 4))
        chunk = min(max(streamed, default=_IDLE_PIPELINE_NUMEL), chunk_numel_of(s))
        pools.append(PoolSpec("optimizer_pipeline", "host", _PIPELINE_DEPTH,
                              _state_buffer_numel(fmt, chunk, s.padded), 4))
    if n > 1 and trainable:
        pools.append(PoolSpec("reduce_scratch", "device", 1, max(trainable), k))
    return tuple(pools)


def _ring_count(s: PlanSettings, share: bool) -> int:
    """Buffers of the ``optimizer_prefetch`` pool: ``s.optimizer_prefetch``, else the least the
    timing needs (3 with the next forward or when backward gathers shards from the
    reads, else 2). Raises ValueError for fewer than that least."""
    least = 3 if s.in_forward or (share and s.in_backward) else 2
    if s.optimizer_prefetch is None:
        return least
    if s.optimizer_prefetch < least:
        raise ValueError(f"optimizer_prefetch={s.optimizer_prefetch} is too few for "
                         f"update_timing={s.update_timing!r} here: it needs at least {least} "
                         "whole-state buffers (or leave it None)")
    return s.optimizer_prefetch


def pipeline_chunk_numel(plan: MemoryPlan) -> int:
    """Elements per chunk of the optimizer pipeline (the ``chunk_numel`` an
    :class:`offload_zero.memory.state_stores.NVMeStore` is built with)."""
    return chunk_numel_of(plan.settings)


def chunk_numel_of(s: PlanSettings) -> int:
    """Elements per chunk of the optimizer pipeline under settings ``s``: its
    ``pipeline_chunk_numel``, else :attr:`NVMeStore.CHUNK_NUMEL` (the default)."""
    from offload_zero.memory.state_stores import NVMeStore
    return s.pipeline_chunk_numel or NVMeStore.CHUNK_NUMEL


def pipeline_shard_numel(plan: MemoryPlan) -> int:
    """The largest shard the optimizer pipeline streams (1024 when none streams): the
    ``max_shard_numel`` an :class:`offload_zero.memory.tiers.NVMeStore` is built with."""
    streamed = [sh for i, (f, sh) in enumerate(zip(plan.layout, plan.shard_numel))
                if f.trainable and i not in plan.in_host]
    return max(streamed, default=_IDLE_PIPELINE_NUMEL)
