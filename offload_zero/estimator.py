"""Memory per rank, per node and on NVMe for a model, world size, ZeRO stage and offload choice.

[Note: model-state arithmetic]
Mixed-precision Adam keeps, for Ψ trainable parameters and a compute dtype of K bytes per
element (K = 2 for bf16/fp16, the paper's case): KΨ parameters, KΨ gradients and 12Ψ of fp32
optimizer state (4Ψ master weights, 4Ψ first moment, 4Ψ second moment). ZeRO-DP (Rajbhandari
et al., 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 5)
partitions it over the N data-parallel ranks. Bytes per rank, K = 2:

    stage 0 (plain DP)  16Ψ
    stage 1 (P_os)      4Ψ + 12Ψ/N
    stage 2 (P_os+g)    2Ψ + 14Ψ/N
    stage 3 (P_os+g+p)  16Ψ/N

Offload moves the partitioned state off the device: ``"cpu"`` puts the fp32 master weights and
moments (12Ψ/N) and the reduced gradient shards (fp32: 4Ψ/N) in host memory (ZeRO-Offload);
``"nvme"`` puts master weights and moments in NVMe files and keeps the gradient shards in host
memory (ZeRO-Infinity); at stage 3 it puts the compute-dtype parameter shards (KΨ/N) in NVMe
files too. With ``moment_dtype="bf16"`` the moments take 2 bytes each per element instead of
4. Frozen parameters (``requires_grad=False``) cost only their compute-dtype copy.

Every byte the engine holds beyond that arithmetic (its padding, the state it keeps in host
memory, the fp32 cases where one tensor serves twice, and its fixed pools of buffers) is the
engine's own memory plan, :func:`offload_zero.plan.memory_plan`: this module builds the
layout and sums the plan, so a model's estimate equals ``OffloadEngine.memory_report()``.

[Note: padding]
Each flat parameter (one per unit and ``requires_grad`` value) is padded so that its shard is
4096-byte aligned for O_DIRECT. When a model is given, the estimate uses the engine's exact
layout. When only a parameter count is given there is no layout: model states are the paper's
unpadded arithmetic, exactly (each kind's bytes rounded to the nearest byte when Ψ/N is not
whole), and the plan runs on an assumed layout (see :func:`assumed_layout`).

Units everywhere: bytes; "GB" in printed tables is 1e9 bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from offload_zero.config import check_int
from offload_zero.memory.pool import storage_rebinding_supported
from offload_zero.memory.state_format import StateFormat, master_dtype_of, moment_dtype_of
from offload_zero.host_budget import fit_host_budget
from offload_zero.plan import KINDS, FlatSpec, MemoryPlan, PlanSettings, layout_of, memory_plan
from offload_zero.plan import shard_numel as _shard_numel  # noqa: F401 (the name callers import)
from offload_zero.tables import (DTYPE_LONG_NAMES, DTYPES, OFFLOADS, SHORT_NAME as _SHORT,
                                 TIERS, default_offload_param)

__all__ = ["estimate_memory", "placement_bytes", "model_layout", "assumed_layout", "FlatSpec",
           "Placement", "MemoryEstimate", "default_offload_param", "format_table", "STAGES",
           "OFFLOADS", "TIERS", "KINDS", "resolve_dtype", "param_count", "preset_or_checkpoint",
           "ASSUMED_ASPECT", "ASSUMED_VOCAB"]

STAGES = (0, 1, 2, 3)
_DTYPE_NAMES = {**DTYPES, **DTYPE_LONG_NAMES}
# Assumed shape of a model known only by its parameter count (see assumed_layout).
ASSUMED_ASPECT = 128
"""Hidden size per layer of a model known only by its parameter count (GPT-3 175B: 12288 /
96); see :func:`assumed_layout`."""
ASSUMED_VOCAB = 32000
"""Vocabulary of such a model (Llama's)."""

MAX_PARAMS = 10 ** 15  # a parameter count the estimate takes (16 PB of training state)
MAX_UNITS = 100_000    # blocks an assumed layout may have (one row of work each)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Bytes per rank for one (stage, offload), split into model states and engine extras.

    Fields:
        stage, offload: the choice estimated.
        model_states: ``{tier: {kind: bytes}}`` per rank — parameters, gradients, master
            weights, moments (see [Note: model-state arithmetic]).
        extras: ``{tier: {kind: bytes}}`` per rank — this engine's buffers at the step's peak
            (see [Note: pools] and [Note: bytes in flight] in :mod:`offload_zero.plan`).
        gpus_per_node: ranks per node, to turn per-rank host and NVMe bytes into per-node bytes.
        engine_supported: False for stage 0 (plain data parallelism; a reference row only),
            and for the optimizer state on an accelerator with bf16 masters or low-precision
            moments (the engine raises NotImplementedError there: their update needs the host
            kernel).
        update_timing: the engine's ``update_timing`` the row counts.
        plan: the :class:`offload_zero.plan.MemoryPlan` the bytes are summed from.
    """

    stage: int
    offload: str
    model_states: Dict[str, Dict[str, int]]
    extras: Dict[str, Dict[str, int]]
    gpus_per_node: int
    engine_supported: bool
    update_timing: str = "step"
    plan: Optional[MemoryPlan] = dataclasses.field(default=None, compare=False, repr=False)

    def tier_bytes(self, tier: str, model_states: bool = True, extras: bool = True) -> int:
        """Bytes per rank on ``tier`` ("device", "host", "nvme"): model states and/or extras."""
        total = sum(self.model_states[tier].values()) if model_states else 0
        return total + (sum(self.extras[tier].values()) if extras else 0)

    def by_kind(self, tier: str) -> Dict[str, int]:
        """Model states plus extras per kind on ``tier``, per rank: what the engine's
        ``memory_report()[tier]["by_kind"][kind]["peak_bytes"]`` reports at world size 1."""
        return {k: self.model_states[tier][k] + self.extras[tier][k] for k in KINDS}

    @property
    def model_state_bytes_per_device(self) -> int:
        """Model-state bytes on each device (the paper's figure when the layout is unpadded)."""
        return self.tier_bytes("device", extras=False)

    @property
    def device_bytes(self) -> int:
        """Bytes on each device: model states plus engine extras."""
        return self.tier_bytes("device")

    @property
    def host_bytes_per_rank(self) -> int:
        """Host bytes one rank holds (model states plus buffers)."""
        return self.tier_bytes("host")

    @property
    def host_bytes(self) -> int:
        """Host bytes per node: ``gpus_per_node`` ranks' worth."""
        return self.gpus_per_node * self.host_bytes_per_rank

    @property
    def nvme_bytes_per_rank(self) -> int:
        """NVMe file bytes one rank holds."""
        return self.tier_bytes("nvme")

    @property
    def nvme_bytes(self) -> int:
        """NVMe bytes per node: ``gpus_per_node`` ranks' worth."""
        return self.gpus_per_node * self.nvme_bytes_per_rank

    def to_dict(self) -> dict:
        """JSON-ready summary; every value in bytes."""
        return {"stage": self.stage, "offload": self.offload,
                "engine_supported": self.engine_supported,
                "update_timing": self.update_timing,
                "model_state_bytes_per_device": self.model_state_bytes_per_device,
                "extra_bytes_per_device": self.tier_bytes("device", model_states=False),
                "device_bytes": self.device_bytes,
                "host_bytes_per_rank": self.host_bytes_per_rank, "host_bytes": self.host_bytes,
                "nvme_bytes_per_rank": self.nvme_bytes_per_rank, "nvme_bytes": self.nvme_bytes,
                "model_states": self.model_states, "extras": self.extras}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The result of :func:`estimate_memory`.

    Fields:
        num_params: distinct parameters (tied ones once), trainable and frozen.
        trainable_params: the trainable ones (Ψ of the paper).
        world_size, gpus_per_node, nodes: N = gpus_per_node * nodes ranks.
        dtype: compute dtype name ("bf16", "fp16", "fp32"); itemsize: its bytes per element (K).
        prefetch: units gathered ahead at stage 3.
        padded: True when the engine's layout (and its 4096-byte padding) is used.
        largest_unit_numel, root_numel: elements of the largest block unit and the root unit.
        source: what was estimated, in words.
        selected: the :class:`Placement` for the requested stage and offload.
        table: a :class:`Placement` for every stage 0-3 x offload none/cpu/nvme, in that order.

    The selected placement's attributes read through: ``est.device_bytes`` is
    ``est.selected.device_bytes`` (likewise ``model_states``, ``extras``, ``host_bytes``, ...).
    """

    num_params: int
    trainable_params: int
    world_size: int
    gpus_per_node: int
    nodes: int
    dtype: str
    itemsize: int
    prefetch: int
    padded: bool
    largest_unit_numel: int
    root_numel: int
    source: str
    selected: Placement
    table: Tuple[Placement, ...]

    def __getattr__(self, name):
        # selected.device_bytes etc. read as estimate.device_bytes
        if name.startswith("__") or name in ("selected",):
            raise AttributeError(name)
        return getattr(self.selected, name)

    def placement(self, stage: int, offload: str) -> Placement:
        """The table's :class:`Placement` for ``stage`` and ``offload``."""
        for p in self.table:
            if p.stage == stage and p.offload == offload:
                return p
        raise ValueError(f"no row for stage={stage!r}, offload={offload!r}; "
                         f"stages {STAGES}, offloads {OFFLOADS}")

    def to_dict(self) -> dict:
        """JSON-ready dict: the inputs, the selected placement and the whole table (bytes)."""
        head = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("selected", "table")}
        return {**head, "units": "bytes", "selected": self.selected.to_dict(),
                "table": [p.to_dict() for p in self.table]}


# -- inputs ------------------------------------------------------------------------------------
def resolve_dtype(dtype) -> torch.dtype:
    """``dtype`` as a torch dtype: float32, bfloat16 or float16, given as the dtype or a name
    (``"bf16"``, ``"bfloat16"``, ``"fp32"``, ...). Raises ValueError naming the bad value and
    the valid names."""
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    if dtype in _SHORT:
        return dtype
    raise ValueError(f"dtype={dtype!r} is not valid; choose one of float32, bfloat16, float16 "
                     f"(or {sorted(_DTYPE_NAMES)})")


def param_count(value) -> int:
    """``value`` as a parameter count: a whole number in [1, :data:`MAX_PARAMS`] (an int, or a
    float such as ``7e9``). Raises ValueError naming the bad value (a bool, a non-number, nan,
    a fraction, zero or less, or too many)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"model={value!r} is not a module, a parameter count, a checkpoint "
                         f"folder or a preset name")
    if not math.isfinite(value) or value <= 0 or value != int(value):
        raise ValueError(f"number of parameters {value!r} is not valid; it must be a whole "
                         f"number > 0")
    if value > MAX_PARAMS:
        raise ValueError(f"number of parameters {value!r} is not valid; it must be at most "
                         f"{MAX_PARAMS:.0e} (a layout of that many would take this estimate "
                         "longer than any training run)")
    return int(value)


def model_layout(model: nn.Module, unit_classes: Sequence[type] = (),
                 leaf_modules: Sequence[object] = ()) -> List[FlatSpec]:
    """The engine's flat parameters of ``model``: one :class:`FlatSpec` per unit and
    ``requires_grad`` value, units found as :class:`offload_zero.OffloadEngine` finds them
    (the root's trainable parameters split by gradient order, as the engine splits them; see
    :func:`offload_zero.partition.units.split_by_gradient_order`).

    A parameter shared by several modules (tied embeddings) is counted once. Works on models on
    the ``meta`` device (nothing is allocated). Units: elements.
    """
    from offload_zero.partition.units import plan_flat_params
    block_mods, planned, _ = plan_flat_params(model, tuple(unit_classes), tuple(leaf_modules))
    try:
        return list(layout_of([(-1 if i == len(block_mods) else i, trainable, members)
                               for i, trainable, members in planned]))
    except ValueError:
        raise ValueError(f"model {type(model).__name__} has no parameters") from None


def assumed_layout(num_params: int, largest_unit_numel: Optional[int] = None,
                   root_numel: Optional[int] = None) -> List[FlatSpec]:
    """A layout for a model known only by its trainable parameter count Ψ (elements).

    Assumption (a GPT/Llama-like decoder): L layers of width h = 128 L (GPT-3's aspect ratio),
    each block holding 12 h² parameters, so L = round((Ψ / 196608)^(1/3)) (at least 1); the
    root unit holds untied input and output embeddings of a 32000-token vocabulary, 2 * 32000 * h,
    at most Ψ / 2. Blocks share the rest equally. For Ψ = 7.5e9: L = 34, h = 4352, root 0.279e9,
    blocks 0.212e9 each. ``largest_unit_numel`` / ``root_numel`` override the assumption (the block
    count then follows from the remainder). The layout sums to Ψ exactly. Raises ValueError
    for a ``root_numel`` above Ψ, or a ``largest_unit_numel`` that cuts the rest into more
    than ``MAX_UNITS`` blocks.
    """
    layers = max(1, round((num_params / (12 * ASSUMED_ASPECT ** 2)) ** (1 / 3)))
    if root_numel is None:
        root_numel = min(2 * ASSUMED_VOCAB * ASSUMED_ASPECT * layers, num_params // 2)
    if root_numel > num_params:
        raise ValueError(f"root_numel={root_numel} exceeds the number of parameters {num_params}")
    rest = num_params - root_numel
    if largest_unit_numel is not None:
        layers = max(1, math.ceil(rest / largest_unit_numel)) if rest else 0
        if layers > MAX_UNITS:
            raise ValueError(f"largest_unit_numel={largest_unit_numel} cuts {rest} parameters "
                             f"into {layers} blocks; at most {MAX_UNITS} are estimated: give a "
                             "larger unit")
    elif rest == 0:
        layers = 0
    specs = []
    if largest_unit_numel is not None:  # blocks of the given size, the last one may be short
        specs = [FlatSpec(min(largest_unit_numel, rest - i * largest_unit_numel), i, True)
                 for i in range(layers)]
    elif layers:
        block, extra = divmod(rest, layers)
        specs = [FlatSpec(block + (1 if i < extra else 0), i, True) for i in range(layers)]
    if root_numel:
        specs.append(FlatSpec(root_numel, -1, True))
    return specs


def preset_or_checkpoint(name: str) -> Tuple[nn.Module, str]:
    """Build the model named by a preset of :mod:`offload_zero.train` or a Hugging Face
    checkpoint folder on the ``meta`` device (no memory allocated, no weights read)."""
    import transformers  # deferred: importing transformers takes seconds
    from offload_zero import train
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(f"model={name!r} is a folder without config.json; it is not a "
                             f"Hugging Face checkpoint")
        config = transformers.AutoConfig.from_pretrained(name)
        with torch.device("meta"):
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:
                model = transformers.AutoModel.from_config(config)
        return model, f"checkpoint {name}"
    if name in train.PRESETS:
        size = train.PRESETS[name]
        vocab = train.data_lib.ByteTokenizer().vocab_size
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=size.hidden_size, num_hidden_layers=size.layers,
            num_attention_heads=size.heads, num_key_value_heads=size.heads,
            intermediate_size=size.intermediate_size)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        return model, f"preset {name} ({size.describe()})"
    raise ValueError(f"model={name!r} is neither a checkpoint folder (with config.json) nor a "
                     f"preset; presets: {sorted(train.PRESETS)}")


# -- arithmetic ----------------------------------------------------------------------------------
def _plan(layout, stage, offload_optimizer, offload_param, world_size, dtype, prefetch,
          accelerator, padded, **timing_and_cache) -> MemoryPlan:
    """The engine's :func:`offload_zero.plan.memory_plan` for one row (``offload_param=None``:
    :func:`offload_zero.tables.default_offload_param`)."""
    if offload_param is None:
        offload_param = default_offload_param(offload_optimizer, stage)
    return memory_plan(layout, PlanSettings(
        stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param,
        world_size=world_size, dtype=dtype, prefetch=prefetch, accelerator=accelerator,
        padded=padded, rebinding=storage_rebinding_supported(), **timing_and_cache))


def _placement(plan: MemoryPlan, offload: str, gpus_per_node: int) -> "Placement":
    """A plan's bytes as a table row."""
    s = plan.settings
    host_kernel_only = (s.master_dtype != torch.float32 or s.moment_dtype != torch.float32)
    supported = s.stage > 0 and not (host_kernel_only and s.accelerator
                                     and s.optimizer_tier == "device")
    return Placement(s.stage, offload, plan.states(), plan.extras(), gpus_per_node,
                     engine_supported=supported, update_timing=s.update_timing, plan=plan)


# -- public entry point --------------------------------------------------------------------------
def estimate_memory(model_or_num_params, world_size: int = 1, gpus_per_node: int = 1,
                    stage: int = 3, offload: str = "none", dtype=torch.bfloat16,
                    prefetch: int = 1, unit_classes: Sequence[type] = (),
                    largest_unit_numel: Optional[int] = None, root_numel: Optional[int] = None,
                    accelerator: bool = True,
                    update_timing: str = "auto",
                    host_cache_bytes: int = 0, moment_dtype="fp32",
                    master_dtype="fp32") -> MemoryEstimate:
    """Estimate training memory in bytes per device, per node (host) and on NVMe.

    Accounting from Rajbhandari et al., 2019 (ZeRO), sec. 5: KΨ parameters + KΨ gradients +
    12Ψ fp32 optimizer state (K = compute dtype itemsize, 2 for bf16), per rank at N ranks:
    stage 0: 16Ψ; 1: 4Ψ + 12Ψ/N; 2: 2Ψ + 14Ψ/N; 3: 16Ψ/N (K = 2); offload moves the fp32
    state (and the fp32 gradient shards, 4Ψ/N) to host or NVMe; see the module notes for the
    exact rules, the engine's extra buffers and padding. Ψ = 7.5e9 on 64 ranks gives the
    paper's 120, 31.4, 16.6 and 1.9 GB of model states per device at stages 0-3.

    Args:
        model_or_num_params: an ``nn.Module`` (distinct parameters counted, tied ones once;
            units found as the engine finds them), a parameter count (``7.5e9``), a Hugging Face
            checkpoint folder (its config.json; the model is built on the ``meta`` device) or a
            preset name of :mod:`offload_zero.train`.
        world_size: N, data-parallel ranks, >= 1. gpus_per_node: ranks per node (divides N).
        stage: ZeRO stage 0-3 for :attr:`MemoryEstimate.selected` (0 = plain data parallelism,
            a reference the engine does not run). offload: "none", "cpu" or "nvme".
        dtype: compute dtype (torch dtype or "bf16"/"fp16"/"fp32").
        prefetch: units gathered ahead at stage 3, >= 0 (the engine's default is 1).
        unit_classes: module classes that make units (as ``OffloadEngine(unit_classes=...)``).
        largest_unit_numel, root_numel: elements of the largest block and of the root unit,
            only for a parameter count (default: :func:`assumed_layout`).
        accelerator: whether the device is an accelerator (False: the CPU-only engine, whose
            device and host are one memory).
        update_timing: the engine's option of that name for the stage-3 rows
            (:mod:`offload_zero.update.rules`): ``"next_forward"`` counts it and its buffers
            (see :mod:`offload_zero.plan`), ``"step"`` none, ``"auto"`` (its default) where the
            engine chooses it, the optimizer state on NVMe; ``"backward"`` is counted by
            :func:`placement_bytes` (ValueError here). For a parameter count the root's
            split by gradient order (every mode) assumes its two embeddings of equal size (a
            final norm is too small to count).
        host_cache_bytes: bytes of optimizer state kept in host memory instead of NVMe in the
            ``"nvme"`` rows, an int >= 0 (the engine's option; see [Note: host cache] in
            :mod:`offload_zero.memory.host_cache`). Default 0.
        moment_dtype: ``"fp32"`` (default), ``"bf16"`` or ``"int8"``: Adam's moments, 8, 4 or
            2.03 bytes per element of the state (the engine's option; see [Note: state layout]
            in :mod:`offload_zero.memory.state_format`).
        master_dtype: ``"fp32"`` (default) or ``"bf16"`` (with ``dtype`` bf16 only): the
            master weights, 4 or 2 bytes per element (the engine's option; a bf16 master is
            the bf16 parameter shard itself wherever both share a tier or file; the engine
            keeps it off an accelerator: read the cpu and nvme rows).

    Returns:
        :class:`MemoryEstimate` with the selected placement and the 12-row table (bytes).

    Raises:
        ValueError: a bad stage, offload, world size, dtype, parameter count, folder or preset,
            or update_timing (not a timing; ``"next_forward"`` below stage 3; ``"backward"``),
            a bad ``moment_dtype`` or ``master_dtype`` (``"bf16"`` with another dtype), naming
            the value.
    """
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not valid; choose one of {STAGES}")
    stage = int(stage)  # (numpy's ints too)
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is not valid; choose one of {OFFLOADS}")
    world_size = check_int("world_size", world_size, 1)
    gpus_per_node = check_int("gpus_per_node", gpus_per_node, 1)
    prefetch = check_int("prefetch", prefetch, 0)
    if world_size % gpus_per_node:
        raise ValueError(f"world_size={world_size} is not a multiple of "
                         f"gpus_per_node={gpus_per_node}")
    dt = resolve_dtype(dtype)
    itemsize = torch.empty(0, dtype=dt).element_size()
    from offload_zero.update import rules
    rules.check_name(update_timing)
    if update_timing == rules.BACKWARD:
        raise ValueError("update_timing='backward' is not counted in the table; choose one of "
                         "('step', 'next_forward', 'auto'), or count it for one placement with "
                         "placement_bytes(update_timing='backward')")
    host_cache_bytes = check_int("host_cache_bytes", host_cache_bytes, 0)
    fmt = StateFormat(moment_dtype_of(moment_dtype), _master_dtype(master_dtype, dt))
    if update_timing == rules.NEXT_FORWARD and stage != 3:
        raise ValueError(f"update_timing='next_forward' needs stage 3 (as the engine's); got "
                         f"stage={stage}")
    layout, padded, source = _layout_of(model_or_num_params, unit_classes, largest_unit_numel,
                                        root_numel)
    rows = []
    for s in STAGES:
        for o in OFFLOADS:
            sif = s == 3 and rules.resolve(update_timing, s, o) == rules.NEXT_FORWARD
            plan = _plan(layout, s, o, None, world_size, dt, prefetch, accelerator, padded,
                         update_timing=rules.NEXT_FORWARD if sif else rules.STEP, host_cache_bytes=host_cache_bytes,
                         moment_dtype=fmt.moment_dtype, master_dtype=fmt.master_dtype)
            rows.append(_placement(plan, o, gpus_per_node))
    selected = next(p for p in rows if p.stage == stage and p.offload == offload)
    units = {}
    for spec in layout:
        units[spec.unit] = units.get(spec.unit, 0) + spec.numel
    return MemoryEstimate(
        num_params=sum(sp.numel for sp in layout),
        trainable_params=sum(sp.numel for sp in layout if sp.trainable),
        world_size=world_size, gpus_per_node=gpus_per_node, nodes=world_size // gpus_per_node,
        dtype=_SHORT[dt], itemsize=itemsize, prefetch=prefetch, padded=padded,
        largest_unit_numel=max((v for u, v in units.items() if u != -1), default=0),
        root_numel=units.get(-1, 0), source=source, selected=selected, table=tuple(rows))


def _master_dtype(master_dtype, dtype: torch.dtype) -> torch.dtype:
    """``master_dtype`` as a torch dtype, checked against the compute ``dtype`` as the engine
    checks it (ValueError naming both: a bf16 master needs a bf16 model)."""
    master = master_dtype_of(master_dtype)
    if master == torch.bfloat16 and dtype != torch.bfloat16:
        raise ValueError(f"master_dtype={master_dtype!r} needs dtype bf16 (the master is the "
                         f"bf16 parameter shard itself); got dtype={_SHORT[dtype]}: give "
                         "dtype bf16, or master_dtype 'fp32'")
    return master


def placement_bytes(model: nn.Module, stage: int, offload_optimizer: str, offload_param: str,
                    world_size: int = 1, dtype=torch.bfloat16, prefetch: int = 1,
                    unit_classes: Sequence[type] = (), accelerator: bool = True,
                    layout=None, update_timing: str = "auto",
                    tail_state_in_host: Optional[bool] = None,
                    host_cache_bytes: int = 0, moment_dtype="fp32",
                    max_host_bytes: Optional[int] = None,
                    optimizer_prefetch: Optional[int] = None,
                    master_dtype="fp32") -> "Placement":
    """Bytes per rank for one placement with the optimizer and parameter tiers set apart.

    ``offload_optimizer`` / ``offload_param``: "none", "cpu" or "nvme" (parameters off the
    device only at stage 3). ``layout``: a precomputed :func:`model_layout` (saves a walk of
    the model). ``update_timing``, ``tail_state_in_host``: the engine's
    options of those names (``update_timing="auto"``: the engine's default for this placement,
    see :func:`offload_zero.update.rules.default_timing`); ``host_cache_bytes``: bytes of
    optimizer state the engine keeps in host memory instead of NVMe (see [Note: host cache] in
    :mod:`offload_zero.memory.host_cache`); ``moment_dtype``: ``"fp32"``, ``"bf16"`` or
    ``"int8"``, the engine's option; ``max_host_bytes``: the engine's option (bytes), whose
    budget streams the optimizer state in smaller chunks as the engine's build does
    (:func:`offload_zero.host_budget.fit_host_budget`; a plan that cannot fit is counted as it is,
    over the budget); ``optimizer_prefetch``: the engine's option (whole-state read-ahead
    buffers; None: the least the timing needs); ``master_dtype``: ``"fp32"`` or ``"bf16"``, the
    engine's option (ValueError for bf16 with another dtype). Returns a :class:`Placement` whose
    ``offload`` reads ``"<optimizer>+<param>"``. Used by ``offload="auto"``
    (:mod:`offload_zero.placement`).
    """
    from offload_zero.update import rules
    update_timing = rules.resolve(update_timing, stage, offload_optimizer)
    if layout is None:
        layout = model_layout(model, unit_classes)
    dtype = resolve_dtype(dtype)
    plan = _plan(layout, stage, offload_optimizer, offload_param, world_size,
                 dtype, prefetch, accelerator, True,
                 update_timing=update_timing, tail_state_in_host=tail_state_in_host,
                 host_cache_bytes=host_cache_bytes, moment_dtype=moment_dtype_of(moment_dtype),
                 master_dtype=_master_dtype(master_dtype, dtype),
                 max_host_bytes=max_host_bytes, optimizer_prefetch=optimizer_prefetch)
    if max_host_bytes is not None:
        try:
            plan = fit_host_budget(plan.layout, plan.settings)
        except ValueError:
            pass  # (over the budget whatever the chunks: the caller sees it short)
    return _placement(plan, f"{offload_optimizer}+{offload_param}", 1)


def _layout_of(obj, unit_classes, largest_unit_numel, root_numel):
    """``(layout, padded, source)`` for any accepted model input: the layout has the root's
    trainable parameters split by gradient order as the engine splits them (for a parameter
    count: two equal halves, the embeddings and the LM head)."""
    if isinstance(obj, (str, os.PathLike)):
        obj, source = preset_or_checkpoint(os.fspath(obj))
    else:
        source = None
    if isinstance(obj, nn.Module):
        if largest_unit_numel is not None or root_numel is not None:
            raise ValueError("largest_unit_numel/root_numel are only for a parameter count; "
                             "with a model they come from its units")
        return model_layout(obj, unit_classes), True, source or f"model {type(obj).__name__}"
    num = param_count(obj)
    if largest_unit_numel is not None:
        largest_unit_numel = check_int("largest_unit_numel", largest_unit_numel, 1)
    if root_numel is not None:
        root_numel = check_int("root_numel", root_numel, 0)
    layout = assumed_layout(num, largest_unit_numel, root_numel)
    split = [half for spec in layout
             for half in ([spec] if spec.unit != -1 or spec.numel < 2 else
                          [FlatSpec(spec.numel - spec.numel // 2, -1, True, True),
                           FlatSpec(spec.numel // 2, -1, True, True)])]
    return split, False, "parameter count"


# -- command line: offload-zero estimate -----------------------------------------------------
DESCRIPTION = """\
Estimate training memory for a model: bytes per device, host memory per node and NVMe per node
for ZeRO stages 0-3 x offload none/cpu/nvme (stage 0 is plain data parallelism, for reference).
Model states follow Rajbhandari et al., 2019 (ZeRO): 2 bytes of parameters + 2 of gradients +
12 of fp32 optimizer state per parameter (bf16/fp16), partitioned over N = gpus x nodes ranks.
The engine's extra buffers (the gather pool at stage 3, a gradient in flight, NVMe pipeline
buffers) are shown apart. Activations are not counted in the table (the verdict
below counts them). GB = 1e9 bytes.

examples:
  offload-zero estimate --params 7.5e9 --gpus 8 --nodes 8  # the paper's example: 120/31.4/16.6/1.9
  offload-zero estimate --model base --stage 3 --offload cpu
  offload-zero estimate --model ./my-checkpoint --gpus 8 --nodes 4 --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``offload-zero estimate``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, metavar="N",
                      help="number of parameters, e.g. 7.5e9 (model states are then the "
                           "paper's unpadded arithmetic)")
    what.add_argument("--model", metavar="DIR|PRESET",
                      help="a Hugging Face checkpoint folder (config.json is read; no weights) "
                           "or a preset of 'offload-zero train'")
    parser.add_argument("--gpus", type=int, default=1, metavar="N",
                        help="ranks (GPUs) per node (default 1)")
    parser.add_argument("--nodes", type=int, default=1, metavar="M", help="nodes (default 1)")
    parser.add_argument("--stage", type=int, default=3, choices=STAGES,
                        help="stage to highlight and report in --json 'selected' (default 3)")
    parser.add_argument("--offload", default="none", choices=OFFLOADS,
                        help="offload to highlight (default none)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                        help="compute dtype of parameters and gradients (default bf16)")
    parser.add_argument("--prefetch", type=int, default=1, metavar="K",
                        help="units gathered ahead at stage 3 (default 1, the engine's)")
    parser.add_argument("--unit", default="GB", choices=tuple(_UNITS),
                        help="unit of the table, one decimal (default GB = 1e9 bytes)")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    parser.add_argument("--update-timing", default="auto", choices=("step", "next_forward", "auto"),
                        help="count the engine's update timing in the stage-3 rows (default: "
                             "auto, as the engine: next_forward with the optimizer state on NVMe)")
    parser.add_argument("--moment-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                        help="Adam's moments: fp32 (default, 12 bytes of optimizer state per "
                             "parameter), bf16 (8) or int8 (6.03: blockwise 8-bit, the absmax "
                             "in host memory; the engine keeps it off a GPU: read the cpu and "
                             "nvme rows)")
    parser.add_argument("--master-dtype", default="fp32", choices=("fp32", "bf16"),
                        help="master weights: fp32 (default) or bf16 (with --dtype bf16: 2 "
                             "bytes of state per parameter less; the engine keeps it off a "
                             "GPU: read the cpu and nvme rows)")
    parser.add_argument("--host-cache-bytes", type=int, default=0, metavar="B",
                        help="bytes of the NVMe rows' optimizer state kept in host memory "
                             "(the engine's host_cache_bytes; default 0)")
    parser.add_argument("--cpu-device", action="store_true",
                        help="the CPU plays the device (no accelerator): device and host are one "
                             "memory (default: an accelerator)")


def run(args: argparse.Namespace) -> MemoryEstimate:
    """Run ``offload-zero estimate``: print the table (or JSON) and return the estimate."""
    est = estimate_from_args(args)
    print(json.dumps(est.to_dict(), indent=2) if args.json else format_table(est, args.unit))
    return est


def estimate_from_args(args: argparse.Namespace) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of the flags of :func:`add_arguments` (nothing printed)."""
    for name in ("gpus", "nodes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)} is not valid; it must be >= 1")
    est = estimate_memory(args.params if args.params is not None else args.model,
                          world_size=args.gpus * args.nodes, gpus_per_node=args.gpus,
                          stage=args.stage, offload=args.offload, dtype=args.dtype,
                          prefetch=args.prefetch, accelerator=not args.cpu_device,
                          update_timing=args.update_timing,
                          host_cache_bytes=args.host_cache_bytes, moment_dtype=args.moment_dtype,
                          master_dtype=args.master_dtype)
    return est


_UNITS = {"GB": 1e9, "MB": 1e6, "GiB": 2.0 ** 30, "MiB": 2.0 ** 20}
_UNIT_TEXT = {"GB": "1e9", "MB": "1e6", "GiB": "2^30", "MiB": "2^20"}


def format_table(est: MemoryEstimate, unit: str = "GB") -> str:
    """The estimate as a table for a person: one row per stage x offload, in ``unit`` ("GB" =
    1e9 bytes, "MB", "GiB", "MiB") with one decimal; columns model states per device, engine
    extras per device, their total, host memory per node and NVMe per node. The selected row is
    marked with ``*``. Raises ValueError for an unknown unit."""
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r} is not valid; choose one of {tuple(_UNITS)}")

    def _gb(nbytes: int) -> str:
        return f"{nbytes / _UNITS[unit]:.1f}"

    lines = [
        f"{est.source}: {est.num_params:,} parameters ({est.trainable_params:,} trainable), "
        f"{est.dtype}",
        f"{est.world_size} rank(s) = {est.nodes} node(s) x {est.gpus_per_node} GPU(s); "
        f"prefetch {est.prefetch}; {unit} = {_UNIT_TEXT[unit]} bytes; activations not counted",
        "",
        f"  {'stage':<6}{'offload':<8}{'states/dev':>11}{'extra/dev':>11}{'total/dev':>11}"
        f"{'host/node':>11}{'NVMe/node':>11}",
    ]
    for p in est.table:
        mark = "*" if p is est.selected else " "
        extra = p.tier_bytes("device", model_states=False)
        lines.append(f"{mark} {p.stage:<6}{p.offload:<8}{_gb(p.model_state_bytes_per_device):>11}"
                     f"{_gb(extra):>11}{_gb(p.device_bytes):>11}{_gb(p.host_bytes):>11}"
                     f"{_gb(p.nvme_bytes):>11}")
    lines += ["",
              f"states: parameters, gradients, {_SHORT[est.selected.plan.settings.master_dtype]}"
              " master weights and Adam moments per device",
              "        (ZeRO, Rajbhandari et al., 2019); host/node and NVMe/node: all of a "
              "node's ranks",
              "extra:  this engine's gather pool (stage 3), gradient in flight (stages 2-3) and buffers",
              "stage 0 is plain data parallelism, shown for reference; the engine runs 1-3"]
    if any(p.stage > 0 and not p.engine_supported for p in est.table):
        lines.append("the none rows, for reference: bf16 masters and bf16 or int8 moments need "
                     "the optimizer state off the accelerator (cpu or nvme)")
    sif = [f"{p.stage} {p.offload}" for p in est.table if p.update_timing == "next_forward"]
    if sif:
        nvme = any(p.update_timing == "next_forward" and p.offload == "nvme" for p in est.table)
        lines.append(f"with update_timing next_forward ({', '.join(sif)}): updates applied in "
                     "the next "
                     "forward" + ("; with NVMe the embeddings' optimizer state in host memory "
                                  "when small and read-ahead buffers of a block's state"
                                  if nvme else ""))
    if not est.padded:
        lines.append(f"layout assumed from the parameter count: largest unit "
                     f"{est.largest_unit_numel:,}, root {est.root_numel:,} elements")
    return "\n".join(lines)
