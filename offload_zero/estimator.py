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
files too. At stages 0 and 1 the full gradient (KΨ) stays on the device until the
step whatever the offload. With fp32 compute the master weights are the parameter shard itself
when both sit on the device (no offload, or ``"cpu"`` when the CPU itself is the device) or
both in NVMe files (``"nvme"`` at stage 3: the parameter shard is read from the master's
bytes), so they cost 0 bytes beyond the parameters.
With ``step_in_backward`` or ``step_in_forward`` and ``"nvme"``, the flat parameter updated
last in backward and needed first by the next forward (the root's part used before the blocks:
input embeddings) may keep its master weights and moments in host memory (``tail_state_in_host``; by default when its shard is at most a quarter of all
trainable shards): 12 bytes per element there, its fp32 parameter shard then being that
host master (0 on NVMe), and 8 when its master is the CPU device's shard itself. With
``host_cache_bytes`` (any mode) more flat parameters keep their state there by the same
arithmetic, chosen by :func:`offload_zero.memory.host_cache.plan_host_cache`.
With ``moment_dtype="bf16"`` the moments take 2 bytes each per element instead of 4 (8Ψ/N
of optimizer state instead of 12Ψ/N; in NVMe files each moment of a shard is padded to 4096
bytes, see [Note: state layout] in :mod:`offload_zero.memory.state_format`), and every buffer
that holds states (pipeline, read-ahead) is sized in that format.
Frozen parameters (``requires_grad=False``) cost only their compute-dtype copy.

[Note: engine extras]
Besides model states this engine holds, at the peak of a step:
- stage 3: the gather pool (device buffers, fixed at start-up): ``prefetch + 1`` slots (at most
  one per block: ``prefetch`` counts at most the other blocks, here and below) the size
  of the largest block unit (its flat parameters' ``padded_numel * K`` bytes) plus one slot the
  size of the root unit; with parameters on NVMe the units ahead are read into host buffers
  instead, so one block slot plus the root's; with one rank and the shards on the device
  nothing is gathered (the shard is the whole parameter);
- stages 2 and 3: one unit's full gradient in flight before it is reduce-scattered (the largest
  trainable flat parameter, ``padded_numel * K`` bytes, device gradients; on a CPU device a
  device buffer kept from step to step, the size of the largest flat parameter of several
  parameters or with padding, beside which the largest of one parameter without padding is a
  device gradient while it is reduced (its gradient is taken as autograd made it), except where
  one rank's fp32 host shards adopt the gradients);
- (stage 1 needs no gradient buffer beyond the full gradients: without offload it reduces in
  place and the shard is a window of the full gradient);
- ``"nvme"``: three pipeline host buffer sets of ``3 * min(largest shard_numel, chunk) * 4``
  bytes each (read k+1 | update k | write k-1; chunks of ``NVMeStore.CHUNK_NUMEL`` elements); at stage 3 also the pool of parameter-shard buffers,
  ``2 * (prefetch + 2) + 2`` buffers of ``largest shard_numel * K`` bytes (reads ahead of use and
  the step's write-back ring; no ring at fp32 with the optimizer state on NVMe too, where the
  shard is the master and the update writes it once), and for an outsized root unit buffers of
  its size: one per root flat parameter larger than a block's shard when all the root's
  parameters are trainable (each keeps its updated shard for the next forward), else one (the
  root's small flat parameters, such as the final norm's part of its split, go
  through the block-sized buffers);
- with ``step_in_backward`` and ``"nvme"``: two read-ahead buffers of the largest trainable block
  shard's whole state, ``2 * 12 * shard_numel`` bytes (three when fp32 parameter shards on NVMe
  are gathered from them); the outsized root's buffers then hold one shard fewer when its tail
  state is in host memory (see above);
- with ``step_in_forward`` and ``"nvme"`` (stage 3): three read-ahead buffers of the largest
  trainable block shard's whole state, ``3 * 12 * shard_numel`` bytes;
- with an accelerator and any offload: one host staging buffer of ``largest shard_numel * K``;
- with N > 1: one reduce-scatter scratch shard on the device, ``largest shard_numel * K``.
Activations, the allocator's fragmentation and the framework's own workspace are not counted.

[Note: padding]
Each flat parameter (one per unit and ``requires_grad`` value) is padded so that its shard,
``shard_numel``, is a multiple of ``4096 / K`` elements: 4096-byte aligned for O_DIRECT. When a
model is given, the estimate uses the engine's exact layout, so its bytes equal
``OffloadEngine.memory_report()``. When only a parameter count is given there is no layout:
model states are the paper's unpadded arithmetic, exactly (each kind's bytes rounded to the
nearest byte when Ψ/N is not whole), and the engine extras use an assumed layout (see
:func:`assumed_layout`).

Units everywhere: bytes; "GB" in printed tables is 1e9 bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
import os
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from offload_zero.config import check_int, check_switch, default_step_in_forward
from offload_zero.memory.state_format import StateFormat, moment_dtype_of

STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "cpu", "nvme")
TIERS = ("device", "host", "nvme")
KINDS = ("parameters", "gradients", "master_weights", "moments", "buffers")
ALIGN_BYTES = 4096
_DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Assumed shape of a model known only by its parameter count (see assumed_layout).
_ASPECT = 128          # hidden size per layer (GPT-3 175B: 12288 / 96)
_ASSUMED_VOCAB = 32000  # Llama vocabulary

Number = Union[int, Fraction]
_FP32_STATE = StateFormat()  # fp32 master weights and moments


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
class Placement:
    """Bytes per rank for one (stage, offload), split into model states and engine extras.

    Fields:
        stage, offload: the choice estimated.
        model_states: ``{tier: {kind: bytes}}`` per rank — parameters, gradients, master
            weights, moments (see [Note: model-state arithmetic]).
        extras: ``{tier: {kind: bytes}}`` per rank — this engine's buffers at the step's peak
            (see [Note: engine extras]).
        gpus_per_node: ranks per node, to turn per-rank host and NVMe bytes into per-node bytes.
        engine_supported: False for stage 0 (plain data parallelism; a reference row only).
        step_in_forward: whether the row counts the engine's ``step_in_forward`` (the
            embeddings' state in host memory when small, its read-ahead buffers).
    """

    stage: int
    offload: str
    model_states: Dict[str, Dict[str, int]]
    extras: Dict[str, Dict[str, int]]
    gpus_per_node: int
    engine_supported: bool
    step_in_forward: bool = False

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
                "step_in_forward": self.step_in_forward,
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
def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    if dtype in _SHORT:
        return dtype
    raise ValueError(f"dtype={dtype!r} is not valid; choose one of float32, bfloat16, float16 "
                     f"(or {sorted(_DTYPE_NAMES)})")


def _param_count(value) -> int:
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
    specs = [FlatSpec(sum(p.numel() for p, _ in members), -1 if i == len(block_mods) else i,
                      trainable, len(members) == 1) for i, trainable, members in planned]
    if not specs:
        raise ValueError(f"model {type(model).__name__} has no parameters")
    return specs


MAX_PARAMS = 10 ** 15  # a parameter count the estimate takes (16 PB of training state)
MAX_UNITS = 100_000    # blocks an assumed layout may have (one row of work each)


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
    layers = max(1, round((num_params / (12 * _ASPECT ** 2)) ** (1 / 3)))
    if root_numel is None:
        root_numel = min(2 * _ASSUMED_VOCAB * _ASPECT * layers, num_params // 2)
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


def _preset_or_checkpoint(name: str) -> Tuple[nn.Module, str]:
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
def _shard_numel(numel: int, world_size: int, itemsize: int, padded: bool) -> Number:
    """Elements per rank of one flat parameter: padded to the engine's 4096-byte alignment
    (as :class:`offload_zero.partition.flat_param.FlatParam`), or the exact fraction numel / N."""
    if not padded:
        return Fraction(numel, world_size)
    align = ALIGN_BYTES // itemsize
    return max(1, math.ceil(numel / (world_size * align))) * align


def _zeros() -> Dict[str, Dict[str, Number]]:
    return {t: {k: 0 for k in KINDS} for t in TIERS}


_TIER_OF = {"none": "device", "cpu": "host", "nvme": "nvme"}


def default_offload_param(offload: str, stage: int) -> str:
    """Where ``offload=`` alone puts parameter shards: NVMe for ``"nvme"`` at stage 3, else the
    device (as :class:`offload_zero.config.EngineConfig`)."""
    return "nvme" if (offload == "nvme" and stage == 3) else "none"


def _cached_in_host(layout, stage, offload, n, k, padded, step_in_backward, setting,
                    step_in_forward=False, host_cache_bytes=0, offload_param=None,
                    accelerator=True, fmt=_FP32_STATE):
    """Indices in ``layout`` of the flat parameters whose optimizer state the engine keeps in
    host memory: the one ``tail_state_in_host`` keeps (see
    :func:`offload_zero.partition.units.host_tail_index`) and those ``host_cache_bytes`` takes
    (see [Note: host cache] in :mod:`offload_zero.memory.host_cache`); empty unless the
    state is on NVMe."""
    if offload != "nvme":
        return frozenset()
    from offload_zero.memory.host_cache import plan_host_cache
    from offload_zero.partition.units import host_tail_index
    flat = [(None if spec.unit == -1 else spec.unit, spec.trainable,
             _shard_numel(spec.numel, n, k, padded)) for spec in layout]
    tail = None
    if (step_in_backward and stage >= 2) or (step_in_forward and stage == 3):
        tail = host_tail_index([(b is None, t, sh) for b, t, sh in flat], setting)
    if offload_param is None:
        offload_param = default_offload_param(offload, stage)
    param_tier = _TIER_OF[offload_param] if stage == 3 else "device"
    aliased = k == 4 and param_tier == "device" and not accelerator
    per_element = fmt.bytes_per_element - (4 if aliased else 0)
    return frozenset(plan_host_cache(flat, host_cache_bytes, per_element, tail=tail,
                                     blocks_reversed=step_in_backward))


def _state_bytes(fmt: StateFormat, numel, padded: bool, moments_only: bool = False):
    """Bytes of a state of ``numel`` elements in format ``fmt`` (master and moments, or the
    moments alone): the padded layout of [Note: state layout], or the plain arithmetic
    (``bytes_per_element``) for an unpadded estimate."""
    if padded:
        return fmt.moment_bytes(numel) if moments_only else fmt.nbytes(numel)
    return (fmt.bytes_per_element - (4 if moments_only else 0)) * numel


def _model_states(layout, stage, offload, n, k, padded, offload_param=None,
                  accelerator=True, cached=frozenset(),
                  fmt=_FP32_STATE) -> Dict[str, Dict[str, Number]]:
    """Per-rank model-state bytes by tier and kind; see [Note: model-state arithmetic].
    ``cached``: indices of the flat parameters whose state is kept in host memory (see
    :func:`_cached_in_host`)."""
    out = _zeros()
    dev = out["device"]
    opt_tier = _TIER_OF[offload]
    if offload_param is None:
        offload_param = default_offload_param(offload, stage)
    param_tier = _TIER_OF[offload_param] if stage == 3 else "device"
    for i, spec in enumerate(layout):
        shard = _shard_numel(spec.numel, n, k, padded)
        full = shard * n
        if i in cached:
            # its state in host memory: an fp32 shard that lived in the master's NVMe bytes
            # is that host master now; on a CPU device the master is the shard itself
            on_nvme = param_tier == "nvme" and k == 4
            out[param_tier]["parameters"] += 0 if on_nvme else k * (full if stage < 3 else shard)
            if stage < 2:
                dev["gradients"] += k * full     # full gradients held until the step
            out["host"]["gradients"] += 4 * shard
            aliased = k == 4 and param_tier == "device" and not accelerator
            out["host"]["master_weights"] += 0 if aliased else 4 * shard
            out["host"]["moments"] += 2 * fmt.moment_itemsize * shard
            continue
        out[param_tier]["parameters"] += k * (full if stage < 3 else shard)
        if not spec.trainable:
            continue
        opt = full if stage == 0 else shard  # optimizer state is partitioned from stage 1
        if stage < 2:
            dev["gradients"] += k * full     # full gradients held until the step
        if offload != "none":
            out["host"]["gradients"] += 4 * opt   # fp32 reduced gradient shards
        elif stage >= 2:
            dev["gradients"] += k * shard
        # fp32 master is the parameter shard itself: on the device, or the same NVMe bytes
        aliased = k == 4 and (offload == "none" or (offload == "nvme" and param_tier == "nvme")
                              or (offload == "cpu" and param_tier == "device" and not accelerator))
        out[opt_tier]["master_weights"] += 0 if aliased else 4 * opt
        # (in NVMe files with the padding of [Note: state layout])
        out[opt_tier]["moments"] += (_state_bytes(fmt, opt, padded, moments_only=True)
                                     if opt_tier == "nvme" else 2 * fmt.moment_itemsize * opt)
    return out


def _grad_as_is(spec: FlatSpec, shard, n: int, padded: bool) -> bool:
    """Whether the flat parameter ``spec`` (``shard`` elements per rank of ``n``) takes
    autograd's gradient as it is: one parameter and no padding (unpadded arithmetic assumes
    none), as :attr:`offload_zero.partition.flat_param.FlatParam.grad_as_is`."""
    return spec.single and (not padded or shard * n == spec.numel)


def _shards_adopt_grads(stage, offload, n, k, accelerator) -> bool:
    """Whether the host gradient shards are the full gradients' own memory: one rank on a CPU
    device at stage 2 or 3, with offload and fp32 gradients (``GradientShards``' adoption; see
    [Note: reused gradient memory] in offload_zero/partition/grads.py)."""
    return stage >= 2 and n == 1 and offload != "none" and k == 4 and not accelerator


def _extras(layout, stage, offload, n, k, padded, prefetch, accelerator, offload_param=None,
            step_in_backward=False, cached=frozenset(), step_in_forward=False,
            fmt=_FP32_STATE):
    """Per-rank bytes of this engine's buffers at the step's peak; see [Note: engine extras].
    ``cached``: as for :func:`_model_states`."""
    out = _zeros()
    if offload_param is None:
        offload_param = default_offload_param(offload, stage)
    if stage == 0:
        return out
    # units in flight ahead of the running one: prefetch, at most the other blocks
    ahead = max(0, min(prefetch, len({spec.unit for spec in layout if spec.unit != -1}) - 1))
    full = {}     # unit -> gathered bytes
    shards = []   # trainable shard_numel
    grad_full = []  # (bytes, taken as autograd made it) per trainable flat parameter
    all_shards, units_of = [], []
    for spec in layout:
        shard = _shard_numel(spec.numel, n, k, padded)
        all_shards.append(shard)
        units_of.append(spec.unit)
        full[spec.unit] = full.get(spec.unit, 0) + k * shard * n
        if spec.trainable:
            shards.append(shard)
            grad_full.append((k * shard * n, _grad_as_is(spec, shard, n, padded)))
    if stage == 3 and not (n == 1 and offload_param == "none"):
        # (one rank with its shards on the device keeps them as the parameters: nothing gathered)
        # the gather pool: slots of the largest block, and one of the root's size
        largest = max((b for u, b in full.items() if u != -1), default=0)
        # NVMe-resident shards are read ahead, not gathered ahead: one block on the device
        gathered = 1 if offload_param == "nvme" else ahead + 1
        out["device"]["buffers"] += gathered * largest + full.get(-1, 0)
    if stage >= 2 and grad_full:
        # on a CPU device the gradient in flight is one buffer kept from step to step, beside
        # which a gradient taken as autograd made it (one parameter, no padding) is briefly a
        # device gradient while it is reduced, unless one rank's fp32 host shards adopt the
        # gradients themselves (see [Note: reused gradient memory] in
        # offload_zero/partition/grads.py)
        adopted = _shards_adopt_grads(stage, offload, n, k, accelerator)
        if accelerator or adopted:
            out["device"]["gradients"] += max(b for b, _ in grad_full)
        else:
            out["device"]["buffers"] += max((b for b, as_is in grad_full if not as_is), default=0)
            out["device"]["gradients"] += max((b for b, as_is in grad_full if as_is), default=0)
    if n > 1 and shards:  # the reduce-scatter scratch shard, sized at start-up
        out["device"]["buffers"] += max(shards) * k
    biggest = max(shards, default=0)
    if offload == "nvme":
        # (a state kept in host memory never streams through the pipeline)
        streamed = [_shard_numel(spec.numel, n, k, padded) for i, spec in enumerate(layout)
                    if spec.trainable and i not in cached]
        # with nothing to stream the engine sizes its buffers for 1024 elements
        from offload_zero.memory.tiers import NVMeStore
        out["host"]["buffers"] += 3 * _state_bytes(
            fmt, min(max(streamed, default=1024), NVMeStore.CHUNK_NUMEL), padded)
    if stage == 3 and offload_param == "nvme" and all_shards:
        block_shard = max([sh for sh, u in zip(all_shards, units_of) if u != -1], default=0)
        root_shard = max([sh for sh, u in zip(all_shards, units_of) if u == -1], default=0)
        # an fp32 shard on NVMe beside its optimizer state is its master: no write-back ring
        ring = 0 if (k == 4 and offload == "nvme") else 2
        out["host"]["buffers"] += (2 * (ahead + 2) + ring) * max(block_shard, 1) * k
        if root_shard > block_shard:
            # one buffer per outsized root flat parameter when all are trainable (each keeps
            # its updated shard for the next forward), else one; the root's small ones go
            # through the block-sized buffers above
            root = [i for i, u in enumerate(units_of) if u == -1]
            outsized = [i for i in root if all_shards[i] > block_shard]
            if all(layout[i].trainable for i in root):
                # a state kept in host memory is, in fp32, its own shard: no buffer
                count = len([i for i in outsized if not (ring == 0 and i in cached)])
            else:
                count = 1
            out["host"]["buffers"] += count * root_shard * k
    if offload == "nvme" and ((step_in_backward and stage >= 2) or (step_in_forward and stage == 3)):
        # read-ahead buffers of a block's whole state (master + moments, fp32): two, three
        # when fp32 parameter shards on NVMe are gathered from them in backward, and with
        # step_in_forward
        # (a state kept in host memory is not read ahead)
        trainable_blocks = [sh for i, (sh, u, spec) in enumerate(zip(all_shards, units_of, layout))
                            if u != -1 and spec.trainable and i not in cached]
        count = 3 if (step_in_forward or (step_in_backward and stage == 3
                                          and offload_param == "nvme" and k == 4)) else 2
        out["host"]["buffers"] += count * _state_bytes(fmt, max(trainable_blocks, default=0),
                                                       padded)
    if offload != "none" and offload_param == "none" and accelerator and shards:
        out["host"]["buffers"] += biggest * k
    return out


def _to_bytes(d: Dict[str, Dict[str, Number]]) -> Dict[str, Dict[str, int]]:
    return {t: {k: int(round(v)) for k, v in kinds.items()} for t, kinds in d.items()}


# -- public entry point --------------------------------------------------------------------------
def estimate_memory(model_or_num_params, world_size: int = 1, gpus_per_node: int = 1,
                    stage: int = 3, offload: str = "none", dtype=torch.bfloat16,
                    prefetch: int = 1, unit_classes: Sequence[type] = (),
                    largest_unit_numel: Optional[int] = None, root_numel: Optional[int] = None,
                    accelerator: bool = True,
                    step_in_forward: Optional[bool] = None,
                    host_cache_bytes: int = 0, moment_dtype="fp32") -> MemoryEstimate:
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
        accelerator: whether the device is an accelerator (False: the CPU-only engine, which
            needs no host staging buffer).
        step_in_forward: the engine's option of that name for the stage-3 rows; None (its
            default) counts it where the engine turns it on, the optimizer state on NVMe (see
            :func:`offload_zero.config.default_step_in_forward`): the embeddings' state in
            host memory when small, three read-ahead buffers. For a parameter count the root's
            split by gradient order (every mode) assumes its two embeddings of equal size (a
            final norm is too small to count).
        host_cache_bytes: bytes of optimizer state kept in host memory instead of NVMe in the
            ``"nvme"`` rows, an int >= 0 (the engine's option; see [Note: host cache] in
            :mod:`offload_zero.memory.host_cache`). Default 0.
        moment_dtype: ``"fp32"`` (default) or ``"bf16"``: Adam's moments, 8 or 4 bytes per
            element of the state (the engine's option; see [Note: state layout] in
            :mod:`offload_zero.memory.state_format`).

    Returns:
        :class:`MemoryEstimate` with the selected placement and the 12-row table (bytes).

    Raises:
        ValueError: a bad stage, offload, world size, dtype, parameter count, folder or preset,
            or step_in_forward (not a bool or None; True below stage 3), naming the value.
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
    dt = _resolve_dtype(dtype)
    itemsize = torch.empty(0, dtype=dt).element_size()
    step_in_forward = check_switch("step_in_forward", step_in_forward, "the engine's default")
    host_cache_bytes = check_int("host_cache_bytes", host_cache_bytes, 0)
    fmt = StateFormat(moment_dtype_of(moment_dtype))
    if step_in_forward and stage != 3:
        raise ValueError(f"step_in_forward=True needs stage 3 (as the engine's); got "
                         f"stage={stage}")
    layout, padded, source = _layout_of(model_or_num_params, unit_classes, largest_unit_numel,
                                        root_numel)
    rows = []
    for s in STAGES:
        for o in OFFLOADS:
            sif = s == 3 and (default_step_in_forward(s, o, False) if step_in_forward is None
                              else step_in_forward)
            cached = _cached_in_host(layout, s, o, world_size, itemsize, padded, False, None,
                                     sif, host_cache_bytes, accelerator=accelerator, fmt=fmt)
            states = _model_states(layout, s, o, world_size, itemsize, padded,
                                   accelerator=accelerator, cached=cached, fmt=fmt)
            extras = _extras(layout, s, o, world_size, itemsize, padded, prefetch, accelerator,
                             cached=cached, step_in_forward=sif, fmt=fmt)
            rows.append(Placement(s, o, _to_bytes(states), _to_bytes(extras), gpus_per_node,
                                  engine_supported=s > 0, step_in_forward=sif))
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


def placement_bytes(model: nn.Module, stage: int, offload_optimizer: str, offload_param: str,
                    world_size: int = 1, dtype=torch.bfloat16, prefetch: int = 1,
                    unit_classes: Sequence[type] = (), accelerator: bool = True,
                    layout=None, step_in_backward: bool = False,
                    tail_state_in_host: Optional[bool] = None,
                    step_in_forward: Optional[bool] = None,
                    host_cache_bytes: int = 0, moment_dtype="fp32") -> "Placement":
    """Bytes per rank for one placement with the optimizer and parameter tiers set apart.

    ``offload_optimizer`` / ``offload_param``: "none", "cpu" or "nvme" (parameters off the
    device only at stage 3). ``layout``: a precomputed :func:`model_layout` (saves a walk of
    the model). ``step_in_backward``, ``tail_state_in_host``, ``step_in_forward``: the engine's
    options of those names (its NVMe read-ahead buffers; the state it keeps in host memory;
    ``step_in_forward=None``: the engine's default for this placement, see
    :func:`offload_zero.config.default_step_in_forward`); ``host_cache_bytes``: bytes of
    optimizer state the engine keeps in host memory instead of NVMe (see [Note: host cache] in
    :mod:`offload_zero.memory.host_cache`); ``moment_dtype``: ``"fp32"`` or ``"bf16"``, the
    engine's option. Returns a :class:`Placement` whose
    ``offload`` reads ``"<optimizer>+<param>"``. Used by ``offload="auto"``
    (:mod:`offload_zero.placement`).
    """
    if step_in_forward is None:
        step_in_forward = default_step_in_forward(stage, offload_optimizer, step_in_backward)
    dt = _resolve_dtype(dtype)
    k = torch.empty(0, dtype=dt).element_size()
    if layout is None:
        layout = model_layout(model, unit_classes)
    fmt = StateFormat(moment_dtype_of(moment_dtype))
    cached = _cached_in_host(layout, stage, offload_optimizer, world_size, k, True,
                             step_in_backward, tail_state_in_host, step_in_forward,
                             host_cache_bytes, offload_param, accelerator, fmt=fmt)
    states = _model_states(layout, stage, offload_optimizer, world_size, k, True, offload_param,
                           accelerator=accelerator, cached=cached, fmt=fmt)
    if step_in_backward and _shards_adopt_grads(stage, offload_optimizer, world_size, k,
                                                accelerator):
        # one rank on a CPU device: the host shards are the gradients' own memory, each used up
        # by its update in backward and reused by the next gradient of its size (see [Note:
        # reused gradient memory] in offload_zero/partition/grads.py): one of each size class,
        # and one gradient taken as autograd made it (one parameter, no padding: no buffer is
        # kept for those, and each is used up before the next)
        from offload_zero.partition.grads import size_classes
        sizes = [(_shard_numel(spec.numel, 1, k, True), spec) for spec in layout
                 if spec.trainable]
        borrowed = [n for n, spec in sizes if not _grad_as_is(spec, n, 1, True)]
        taken = [n for n, spec in sizes if _grad_as_is(spec, n, 1, True)]
        states["host"]["gradients"] = 4 * (sum(set(size_classes(borrowed).values()))
                                           + max(taken, default=0))
    extras = _extras(layout, stage, offload_optimizer, world_size, k, True, prefetch, accelerator,
                     offload_param, step_in_backward=step_in_backward, cached=cached,
                     step_in_forward=step_in_forward, fmt=fmt)
    return Placement(stage, f"{offload_optimizer}+{offload_param}", _to_bytes(states),
                     _to_bytes(extras), 1, engine_supported=stage > 0,
                     step_in_forward=step_in_forward)


def _layout_of(obj, unit_classes, largest_unit_numel, root_numel):
    """``(layout, padded, source)`` for any accepted model input: the layout has the root's
    trainable parameters split by gradient order as the engine splits them (for a parameter
    count: two equal halves, the embeddings and the LM head)."""
    if isinstance(obj, (str, os.PathLike)):
        obj, source = _preset_or_checkpoint(os.fspath(obj))
    else:
        source = None
    if isinstance(obj, nn.Module):
        if largest_unit_numel is not None or root_numel is not None:
            raise ValueError("largest_unit_numel/root_numel are only for a parameter count; "
                             "with a model they come from its units")
        return model_layout(obj, unit_classes), True, source or f"model {type(obj).__name__}"
    num = _param_count(obj)
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
    parser.add_argument("--step-in-forward", action=argparse.BooleanOptionalAction, default=None,
                        help="count the engine's step_in_forward in the stage-3 rows (default: "
                             "as the engine, on with the optimizer state on NVMe)")
    parser.add_argument("--moment-dtype", default="fp32", choices=("fp32", "bf16"),
                        help="Adam's moments: fp32 (default, 12 bytes of optimizer state per "
                             "parameter) or bf16 (8)")
    parser.add_argument("--host-cache-bytes", type=int, default=0, metavar="B",
                        help="bytes of the NVMe rows' optimizer state kept in host memory "
                             "(the engine's host_cache_bytes; default 0)")
    parser.add_argument("--cpu-device", action="store_true",
                        help="the CPU plays the device (no accelerator): device and host are one "
                             "memory, so an fp32 master offloaded to the host is the shard itself "
                             "and no staging buffer is needed (default: an accelerator)")


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
                          step_in_forward=args.step_in_forward,
                          host_cache_bytes=args.host_cache_bytes, moment_dtype=args.moment_dtype)
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
              "states: parameters, gradients, fp32 master weights and Adam moments per device",
              "        (ZeRO, Rajbhandari et al., 2019); host/node and NVMe/node: all of a "
              "node's ranks",
              "extra:  this engine's gather pool (stage 3), gradient in flight (stages 2-3) and buffers",
              "stage 0 is plain data parallelism, shown for reference; the engine runs 1-3"]
    sif = [f"{p.stage} {p.offload}" for p in est.table if p.step_in_forward]
    if sif:
        nvme = any(p.step_in_forward and p.offload == "nvme" for p in est.table)
        lines.append(f"with step_in_forward ({', '.join(sif)}): updates applied in the next "
                     "forward" + ("; with NVMe the embeddings' optimizer state in host memory "
                                  "when small and three read-ahead buffers of a block's state"
                                  if nvme else ""))
    if not est.padded:
        lines.append(f"layout assumed from the parameter count: largest unit "
                     f"{est.largest_unit_numel:,}, root {est.root_numel:,} elements")
    return "\n".join(lines)
