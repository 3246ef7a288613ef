"""DeepSpeed JSON configs as :class:`OffloadEngine` settings: :func:`from_deepspeed_config`.

:data:`KEYS` is the one table of every DeepSpeed key this module knows, each with what becomes
of it: ``mapped`` to an engine setting (the keyword named), ``auto`` (a tuning knob the engine
decides itself: accepted, and listed once in one log line), or ``refused`` (a DeepSpeed feature
the engine does not have: NotImplementedError, unless the value is one of the few that mean
"off"). The parser, docs/deepspeed.md and the tests all read it. A key in no row is a
ValueError naming its path and where it belongs (a key or section placed in another section:
``zero_optimization.aio``), else the nearest valid key.

``"auto"`` (the Hugging Face convention) is resolved from the keyword arguments given beside
the config (``lr=``, ``dtype=``, ``train_micro_batch_size_per_gpu=``, ...), else, for
``scheduler.params.warmup_min_lr``, by 0 as transformers resolves it (:data:`AUTO_CONSTANTS`);
an ``"auto"`` that nothing resolves is a ValueError naming the key. A keyword that
contradicts a value the config gives is a ValueError too (one source of truth per setting).

The three DeepSpeed schedules are ``torch.optim.lr_scheduler.LambdaLR`` objects on
``engine.optimizer`` (:class:`WarmupSchedule`), stepped by the engine after each update it makes
(not after a skipped fp16 step, nor between accumulated micro-batches), as DeepSpeed steps its
own. With ``t`` the number of updates so far and ``W = max(2, warmup_num_steps)``:

- warmup fraction ``g(t)`` for ``t < W``: ``log(t + 1) / log(W)`` (``warmup_type`` log) or
  ``t / W`` (linear); 1 after.
- WarmupLR: ``lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g(t)``.
- WarmupDecayLR: the same during warmup, then ``(warmup_max_lr - warmup_min_lr) * max(0, (T -
  t) / max(1, T - W))`` above ``warmup_min_lr`` (``T = total_num_steps``).
- WarmupCosineLR: ``lr = base_lr * r(t)``, ``r = warmup_min_ratio + (1 - warmup_min_ratio) *
  g(t)`` during warmup, then ``max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * (t -
  W + 1) / (T - W))) / 2)``.

For WarmupLR and WarmupDecayLR the engine's ``lr`` is ``warmup_max_lr`` (DeepSpeed's schedule
replaces the optimizer's; its default is the optimizer's ``lr``), and each group's rate is its
own ``lr`` times ``lr(t) / warmup_max_lr``.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from offload_zero.tables import OFFLOADS

log = logging.getLogger("offload_zero")

MAPPED, AUTO, REFUSED = "mapped", "auto", "refused"
OFF = ("off",)  # a refused section accepted while its "enabled" is false


class Key(NamedTuple):
    """One row of :data:`KEYS`."""

    how: str
    """``mapped``, ``auto`` or ``refused``."""
    note: str
    """mapped: the engine keyword (or the name an override uses); auto: why it needs nothing;
    refused: what to use instead."""
    accepts: tuple = ()
    """refused only: the values accepted anyway (DeepSpeed's "off"), or :data:`OFF`."""


def _auto(note: str = "the engine sizes and schedules this itself") -> Key:
    return Key(AUTO, note)


_ZO = "zero_optimization."
_OO, _OP = _ZO + "offload_optimizer.", _ZO + "offload_param."
_TUNED = "the engine sizes its buffers, buckets and prefetch itself (DESIGN.md)"
_PINNED = "host buffers are pinned whenever an accelerator is present"
_SCHED = "scheduler.params."

KEYS: Dict[str, Key] = {
    _ZO + "stage": Key(MAPPED, "stage"),
    _OO + "device": Key(MAPPED, "offload_optimizer"),
    _OO + "nvme_path": Key(MAPPED, "path"),
    _OO + "pin_memory": _auto(_PINNED),
    _OO + "buffer_count": _auto(_TUNED),
    _OO + "pipeline_read": _auto("NVMe reads are pipelined with the update (update_timing next_forward)"),
    _OO + "pipeline_write": _auto("NVMe writes are pipelined with the update"),
    _OO + "fast_init": _auto(),
    _OO + "ratio": Key(REFUSED, "partial optimizer offload: use offload_optimizer='cpu' or "
                       "'nvme' for all of it", (1, 1.0)),
    _OP + "device": Key(MAPPED, "offload_param"),
    _OP + "nvme_path": Key(MAPPED, "path"),
    _OP + "pin_memory": _auto(_PINNED),
    _OP + "buffer_count": _auto(_TUNED),
    _OP + "buffer_size": _auto(_TUNED),
    _OP + "max_in_cpu": _auto(_TUNED),
    **{_ZO + k: _auto(_TUNED) for k in (
        "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "reduce_scatter",
        "allgather_partitions", "allgather_bucket_size", "sub_group_size",
        "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_param_persistence_threshold", "round_robin_gradients",
        "stage3_module_granularity_threshold", "memory_efficient_linear")},
    _ZO + "stage3_gather_16bit_weights_on_model_save": _auto(
        "engine.full_state_dict() gathers the weights when asked"),
    **{_ZO + k: _auto("engine.full_state_dict() gathers the weights when asked") for k in (
        "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")},
    _ZO + "ignore_unused_parameters": _auto("unused parameters get zero gradients (README)"),
    _ZO + "load_from_fp32_weights": _auto("checkpoints hold the fp32 masters"),
    _ZO + "elastic_checkpoint": _auto("checkpoints load at any world size"),
    _ZO + "zero_quantized_weights": Key(REFUSED, "ZeRO++ quantization is not implemented",
                                        (False,)),
    _ZO + "zero_quantized_gradients": Key(REFUSED, "ZeRO++ quantization is not implemented",
                                          (False,)),
    _ZO + "zero_hpz_partition_size": Key(REFUSED, "ZeRO++ hierarchical partitions are not "
                                         "implemented", (1,)),
    _ZO + "mics_shard_size": Key(REFUSED, "MiCS sharding is not implemented", (-1,)),
    _ZO + "cpu_offload": Key(REFUSED, "the old spelling: use offload_optimizer.device 'cpu'",
                             (False,)),
    "gradient_clipping": Key(MAPPED, "max_grad_norm"),
    "gradient_accumulation_steps": Key(MAPPED, "gradient_accumulation_steps"),
    "train_micro_batch_size_per_gpu": Key(MAPPED, "train_micro_batch_size_per_gpu"),
    "train_batch_size": Key(MAPPED, "train_batch_size"),
    "bf16.enabled": Key(MAPPED, "dtype"),
    "bf16.immediate_grad_update": _auto("gradients are reduced into their shards at once"),
    "bf16.bf16_master_weights_and_grads": Key(MAPPED, "master_dtype"),
    "bf16.bf16_optimizer_states": Key(MAPPED, "moment_dtype"),
    "fp16.enabled": Key(MAPPED, "dtype"),
    "fp16.loss_scale": Key(MAPPED, "loss_scale"),
    "fp16.initial_scale_power": Key(MAPPED, "initial_loss_scale"),
    "fp16.loss_scale_window": Key(MAPPED, "loss_scale_window"),
    "fp16.min_loss_scale": Key(MAPPED, "min_loss_scale"),
    "fp16.hysteresis": Key(REFUSED, "the engine halves the scale at the first overflow "
                           "(hysteresis 1; DeepSpeed's default 2 is accepted)", (1, 2)),
    "fp16.consecutive_hysteresis": Key(REFUSED, "no hysteresis to renew", (False,)),
    "fp16.auto_cast": Key(REFUSED, "inputs are cast to the compute dtype; no autocast",
                          (False,)),
    "fp16.fp16_master_weights_and_grads": Key(REFUSED, "master weights are always fp32",
                                              (False,)),
    "amp": Key(REFUSED, "use dtype=torch.float16 (dynamic loss scale) or bfloat16", OFF),
    "optimizer.type": Key(MAPPED, "adamw"),
    "optimizer.params.lr": Key(MAPPED, "lr"),
    "optimizer.params.betas": Key(MAPPED, "betas"),
    "optimizer.params.eps": Key(MAPPED, "eps"),
    "optimizer.params.weight_decay": Key(MAPPED, "weight_decay"),
    "optimizer.params.adam_w_mode": Key(MAPPED, "adamw"),
    "optimizer.params.torch_adam": _auto("the engine runs its own Adam (C++ on the host)"),
    "optimizer.params.amsgrad": Key(REFUSED, "AMSGrad is not implemented", (False,)),
    "optimizer.params.bias_correction": Key(REFUSED, "Adam always corrects its bias", (True,)),
    "scheduler.type": Key(MAPPED, "lr_scheduler"),
    _SCHED + "warmup_min_lr": Key(MAPPED, "warmup_min_lr"),
    _SCHED + "warmup_max_lr": Key(MAPPED, "warmup_max_lr"),
    _SCHED + "warmup_num_steps": Key(MAPPED, "warmup_num_steps"),
    _SCHED + "warmup_type": Key(MAPPED, "warmup_type"),
    _SCHED + "total_num_steps": Key(MAPPED, "total_num_steps"),
    _SCHED + "warmup_min_ratio": Key(MAPPED, "warmup_min_ratio"),
    _SCHED + "cos_min_ratio": Key(MAPPED, "cos_min_ratio"),
    _SCHED + "last_batch_iteration": Key(REFUSED, "resume a schedule with "
                                         "engine.lr_scheduler.load_state_dict()", (-1,)),
    "aio.block_size": Key(MAPPED, "aio_block_size"),
    "aio.queue_depth": Key(MAPPED, "aio_queue_depth"),
    **{"aio." + k: _auto("the NVMe I/O backend picks its threads and submission itself")
       for k in ("thread_count", "single_submit", "overlap_events", "intra_op_parallelism",
                 "use_gds")},
    **{k: _auto("logging and checks this engine does not need") for k in (
        "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer")},
    "bfloat16": Key(REFUSED, "the old name of the bf16 section: write bf16", OFF),
    **{k: Key(REFUSED, "DeepSpeed's own training features are not part of this engine", OFF)
       for k in ("elasticity", "autotuning", "compression_training")},
    "dataloader_drop_last": _auto("the engine builds no data loader: yours decides"),
    "checkpoint.tag_validation": _auto("every tensor's CRC-32 is checked on load"),
    "checkpoint.use_node_local_storage": _auto("each rank writes its own file"),
    "checkpoint.load_universal": Key(REFUSED, "checkpoints load at any world size as they are; "
                                     "DeepSpeed's universal checkpoints are not read", (False,)),
    "prescale_gradients": Key(REFUSED, "gradients are averaged after the reduction", (False,)),
    "gradient_predivide_factor": Key(REFUSED, "gradients are averaged after the reduction",
                                     (1, 1.0)),
    "communication_data_type": Key(REFUSED, "collectives run in the compute dtype", (None,)),
    "sparse_gradients": Key(REFUSED, "sparse gradients are not implemented", (False,)),
    "activation_checkpointing": Key(REFUSED, "use activation_checkpointing=True (a "
                                    "keyword of the engine)", ({},)),
    **{k: Key(REFUSED, "monitoring is not built in: log engine.memory_report() yourself", OFF)
       for k in ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
                 "comms_logger")},
}

# optimizer.type (lower case) -> whether it is AdamW before adam_w_mode is read
_OPTIMIZERS = {"adam": None, "adamw": True}
# scheduler.type -> its parameters (DeepSpeed's names) and their defaults
_SCHEDULES: Dict[str, Dict[str, Any]] = {
    "WarmupLR": dict(warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                     warmup_type="log"),
    "WarmupDecayLR": dict(warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                          warmup_type="log", total_num_steps=None),
    "WarmupCosineLR": dict(warmup_min_ratio=0.0, cos_min_ratio=0.0001, warmup_num_steps=1000,
                           warmup_type="log", total_num_steps=None),
}
# override keywords that are DeepSpeed's names, not the engine's
DS_ONLY = ("train_micro_batch_size_per_gpu", "train_batch_size", "warmup_min_lr",
           "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
           "warmup_min_ratio", "cos_min_ratio")

# "auto" values that no setting of the run fills: the constant transformers' DeepSpeed
# integration puts there (HfTrainerDeepSpeedConfig: fill_only("scheduler.params.warmup_min_lr",
# 0), "not a trainer arg"); a keyword or flag of that name resolves it first
AUTO_CONSTANTS = {_SCHED + "warmup_min_lr": 0.0}


def sections() -> set:
    """Every path that holds further keys (``zero_optimization``, ``optimizer.params``, ...)."""
    return {path.rsplit(".", i)[0] for path in KEYS for i in range(1, path.count(".") + 1)}


def keys_by_kind(how: str) -> List[str]:
    """The paths of :data:`KEYS` whose row is ``how`` (mapped, auto or refused), in order."""
    return [path for path, key in KEYS.items() if key.how == how]


def markdown_table() -> str:
    """:data:`KEYS` as a Markdown table (docs/deepspeed.md holds it; a test compares)."""
    rows = ["| DeepSpeed key | here | engine setting, or why |", "|---|---|---|"]
    what = {MAPPED: "mapped", AUTO: "handled automatically", REFUSED: "refused"}
    for path, key in KEYS.items():
        note = f"`{key.note}`" if key.how == MAPPED else key.note
        if key.how == REFUSED and key.accepts:
            ok = "enabled: false" if key.accepts == OFF else ", ".join(
                json.dumps(v) for v in key.accepts)
            note += f" (accepted: {ok})"
        rows.append(f"| `{path}` | {what[key.how]} | {note} |")
    return "\n".join(rows)


class WarmupSchedule:
    """One of DeepSpeed's schedules as the factor a ``LambdaLR`` multiplies each group's base
    ``lr`` by after ``t`` updates (see the module's docstring for the formulas).

    ``kind``: WarmupLR, WarmupDecayLR or WarmupCosineLR; ``params``: its parameters, complete
    (defaults filled, ``warmup_max_lr`` resolved: the rate the factor of the first two is
    relative to). A plain object, so the scheduler's ``state_dict()`` holds it as numbers.
    """

    def __init__(self, kind: str, params: Dict[str, Any]):
        self.kind = kind
        self.params = dict(params)
        self.warmup_steps = max(2, int(params["warmup_num_steps"]))

    def warmup_fraction(self, t: int) -> float:
        """``g(t)``: from 0 to 1 over the warmup, log or linear; 1 after it."""
        w = self.warmup_steps
        if t >= w:
            return 1.0
        if self.params["warmup_type"] == "log":
            return math.log(t + 1) / math.log(w)
        return t / w

    def lr_at(self, t: int, base_lr: float) -> float:
        """The learning rate after ``t`` updates of a group whose base rate is ``base_lr``."""
        p, w = self.params, self.warmup_steps
        if self.kind == "WarmupCosineLR":
            if t < w:
                ratio = p["warmup_min_ratio"] + (1 - p["warmup_min_ratio"]) * self.warmup_fraction(t)
            else:
                progress = (t - w + 1) / (p["total_num_steps"] - w)
                cos = (1 + math.cos(math.pi * progress)) / 2
                ratio = max(0.0, p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * cos)
            return base_lr * ratio
        low, high = p["warmup_min_lr"], p["warmup_max_lr"]
        gamma = self.warmup_fraction(t)
        if self.kind == "WarmupDecayLR" and t >= w:
            total = p["total_num_steps"]
            gamma = max(0.0, (total - t) / max(1.0, total - w))
        return (low + (high - low) * gamma) * base_lr / high

    def __call__(self, t: int) -> float:
        """The factor after ``t`` updates (LambdaLR's ``lr_lambda``)."""
        return self.lr_at(t, 1.0)

    def describe(self) -> str:
        """``WarmupDecayLR(warmup_min_lr=0, ...)``."""
        return f"{self.kind}(" + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in self.params.items()) + ")"


@dataclasses.dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config asks of the engine (:func:`parse_deepspeed_config`).

    Fields:
        engine_kwargs: keywords for :class:`OffloadEngine` (overrides included).
        train_micro_batch_size_per_gpu, train_batch_size: the batch sizes, consistent with
            ``gradient_accumulation_steps`` and ``world_size``; None where the config gives
            neither (nor an override).
        gradient_accumulation_steps: micro-batches per update.
        world_size: the data-parallel world size the batch sizes were checked against.
        schedule: the :class:`WarmupSchedule`, or None without a ``scheduler`` section.
        automatic: the paths of the keys the engine handles itself, as given.
    """

    engine_kwargs: Dict[str, Any]
    train_micro_batch_size_per_gpu: Optional[int]
    train_batch_size: Optional[int]
    gradient_accumulation_steps: int
    world_size: int
    schedule: Optional[WarmupSchedule]
    automatic: Tuple[str, ...]

    def build(self, model: torch.nn.Module, **extra):
        """The :class:`OffloadEngine` for ``model`` (``extra``: further engine keywords), with
        ``lr_scheduler``, ``train_micro_batch_size_per_gpu`` and ``train_batch_size`` set. A
        missing ``nvme_path`` folder is made first (with its parents), as DeepSpeed makes it."""
        from offload_zero.engine import OffloadEngine

        kw = {**self.engine_kwargs, **extra}
        path = kw.get("path")
        if path is not None and not os.path.lexists(path):
            # (as DeepSpeed: a missing nvme_path is made, not refused; left in place after)
            os.makedirs(path, exist_ok=True)
            log.info("DeepSpeed config: made the swap folder nvme_path=%r", path)
        engine = OffloadEngine(model, **kw)
        if self.schedule is not None:
            engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer,
                                                                    self.schedule)
        engine.train_micro_batch_size_per_gpu = self.train_micro_batch_size_per_gpu
        engine.train_batch_size = self.train_batch_size
        engine.deepspeed_settings = self
        return engine

    def describe(self) -> str:
        """One line of the mapped settings (the CLI's run summary prints it)."""
        kw = self.engine_kwargs
        parts = [f"stage {kw.get('stage', 3)}",
                 f"optimizer state {kw.get('offload_optimizer', kw.get('offload', 'none'))}",
                 f"parameters {kw.get('offload_param', 'none')}"]
        if "dtype" in kw:
            parts.append(str(kw["dtype"]).replace("torch.", ""))
        opt = "AdamW" if kw.get("adamw", True) else "Adam"
        hyper = [f"{k} {kw[k]:g}" for k in ("lr", "eps", "weight_decay") if k in kw]
        if "betas" in kw:
            hyper.insert(1, f"betas ({kw['betas'][0]:g}, {kw['betas'][1]:g})")
        parts.append(opt + (" " + " ".join(hyper) if hyper else ""))
        if kw.get("max_grad_norm") is not None:
            parts.append(f"clip {kw['max_grad_norm']:g}")
        parts.append(self.schedule.describe() if self.schedule is not None else "constant lr")
        if self.train_micro_batch_size_per_gpu is not None:
            parts.append(f"batch {self.train_micro_batch_size_per_gpu} x "
                         f"{self.gradient_accumulation_steps} accum x {self.world_size} "
                         f"rank(s) = {self.train_batch_size}")
        return ", ".join(parts)


def load_config(config) -> dict:
    """``config`` as a dict: a dict as it is, or a path (str or os.PathLike) to a JSON file.
    Raises ValueError for a missing file, bad JSON or a JSON value that is not an object."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"config must be a dict or a path to a DeepSpeed JSON file, got "
                         f"{type(config).__name__}")
    try:
        with open(config) as f:
            loaded = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read DeepSpeed config {os.fspath(config)!r}: "
                         f"{exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"DeepSpeed config {os.fspath(config)!r} is not valid JSON: "
                         f"{exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"DeepSpeed config {os.fspath(config)!r} must hold a JSON object")
    return loaded


def flatten(config: dict) -> Dict[str, Any]:
    """``{path: value}`` of every key of ``config`` that :data:`KEYS` knows. Raises
    ValueError for an unknown key (naming its path and where it belongs, see
    :func:`_unknown`) or a section that is not an object, NotImplementedError for a refused
    key's value."""
    known_sections = sections()
    leaves: Dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for name, value in node.items():
            path = prefix + str(name)
            if path in KEYS:
                _check_refused(path, value)
                leaves[path] = value
            elif path in known_sections:
                if not isinstance(value, dict):
                    raise ValueError(f"DeepSpeed config key {path!r} must be an object, got "
                                     f"{value!r}")
                walk(value, path + ".")
            else:
                raise ValueError(_unknown(path, prefix))

    walk(config, "")
    return leaves


def _unknown(path: str, prefix: str) -> str:
    """The message for the unknown key ``path`` (found under ``prefix``): where its name is a
    key or section elsewhere (misplaced: ``zero_optimization.aio``), where it belongs;
    otherwise (a misspelling) the nearest valid key beside it."""
    name = path[len(prefix):]
    known = sections() | set(KEYS)
    where = f" under {prefix[:-1]!r}" if prefix else " at the top level of the config"
    msg = f"unknown DeepSpeed config key {path!r}: {name!r} is not a key{where}"
    elsewhere = sorted(p for p in known if p.rsplit(".", 1)[-1] == name)
    if elsewhere:
        places = " or ".join("at the top level of the config" if "." not in p
                             else f"under {p.rsplit('.', 1)[0]!r} (as {p!r})" for p in elsewhere)
        return f"{msg}; {name} belongs {places}: move it there"
    siblings = sorted({p[len(prefix):].split(".")[0] for p in known if p.startswith(prefix)})
    nearest = difflib.get_close_matches(name, siblings, n=1, cutoff=0.0)
    return f"{msg}; nearest valid key: {prefix + nearest[0]!r}" if nearest else msg


def _check_refused(path: str, value) -> None:
    key = KEYS[path]
    if key.how != REFUSED:
        return
    if key.accepts == OFF:
        if isinstance(value, dict) and not value.get("enabled", False):
            return
    elif any(value == ok and isinstance(value, bool) == isinstance(ok, bool)
             for ok in key.accepts):
        return
    raise NotImplementedError(f"DeepSpeed config key {path!r}={value!r} is not supported: "
                              f"{key.note}")


def _world_size(overrides: dict) -> int:
    group = overrides.get("process_group")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(group)
    return int(os.environ.get("WORLD_SIZE", "1"))


class _Resolver:
    """Looks up a mapped key's value: the config's, checked against an override of the same
    setting, or for ``"auto"`` the override's (then a fallback's)."""

    def __init__(self, leaves: dict, overrides: dict, fallbacks: dict):
        self.leaves, self.overrides, self.fallbacks = leaves, overrides, fallbacks

    def given(self, path: str) -> bool:
        return path in self.leaves

    def get(self, path: str, convert=lambda v: v, names: Tuple[str, ...] = (), default=None,
            derivable: bool = False):
        """The engine-side value for ``path`` (``convert`` turns the config's value into it),
        or ``default`` when neither the config nor an override gives one."""
        names = names or (KEYS[path].note,)
        override = next((self.overrides[n] for n in names if n in self.overrides), _MISSING)
        if path not in self.leaves or (self.leaves[path] == "auto" and derivable
                                       and override is _MISSING):
            if override is not _MISSING:
                return override
            return default
        raw = self.leaves[path]
        if raw == "auto":
            if override is not _MISSING:
                return override
            fallback = next((self.fallbacks[n] for n in names if n in self.fallbacks), _MISSING)
            if fallback is not _MISSING:
                return fallback
            if path in AUTO_CONSTANTS:
                return AUTO_CONSTANTS[path]
            raise ValueError(f"DeepSpeed config key {path!r} is \"auto\" and nothing resolves "
                             f"it: pass {names[0]}=... beside the config")
        try:
            value = convert(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"DeepSpeed config key {path!r}={raw!r} is not valid: "
                             f"{exc}") from None
        if override is not _MISSING and not _same(override, value):
            raise ValueError(f"{names[0]}={override!r} conflicts with the DeepSpeed config's "
                             f"{path}={raw!r} (= {value!r} here); give one of them")
        return value


_MISSING = object()


def _same(a, b) -> bool:
    """Whether an override and a config value agree (a list and a tuple of equal items do)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    return a == b


def parse_deepspeed_config(config, overrides: Optional[dict] = None,
                           fallbacks: Optional[dict] = None,
                           world_size: Optional[int] = None) -> DeepSpeedSettings:
    """Map a DeepSpeed config (a dict, or a path to its JSON file) to engine settings.

    ``overrides``: engine keywords and the DeepSpeed names in :data:`DS_ONLY`; each resolves
    an ``"auto"`` and must agree with a value the config gives (ValueError otherwise); the
    engine keywords the config does not set pass through. ``fallbacks``: values that resolve an
    ``"auto"`` only (the CLI's defaults). ``world_size``: default the process group's, else
    ``$WORLD_SIZE``, else 1. Logs the keys handled automatically in one line.

    Raises ValueError (an unknown key, a bad value, an unresolved ``"auto"``, an override
    in conflict, batch sizes that disagree) or NotImplementedError (a refused key, an
    optimizer or scheduler type other than Adam/AdamW and the three warmup schedules).
    """
    cfg = load_config(config)
    overrides, fallbacks = dict(overrides or {}), dict(fallbacks or {})
    leaves = flatten(cfg)
    res = _Resolver(leaves, overrides, fallbacks)
    kw = {k: v for k, v in overrides.items() if k not in DS_ONLY}
    kw.update(_zero_kwargs(res))
    kw.update(_precision_kwargs(res))
    kw.update(_optimizer_kwargs(res, leaves))
    for path in ("gradient_clipping", "aio.block_size", "aio.queue_depth"):
        value = res.get(path)
        if value is not None:
            kw[KEYS[path].note] = value
    if kw.get("max_grad_norm") == 0:  # DeepSpeed's "no clipping"
        kw["max_grad_norm"] = None
    ws = world_size if world_size is not None else _world_size(overrides)
    micro, total, accum = _batch_sizes(res, ws)
    kw["gradient_accumulation_steps"] = accum
    schedule = _schedule(res, leaves, kw)
    if schedule is not None and schedule.kind != "WarmupCosineLR":
        kw["lr"] = schedule.params["warmup_max_lr"]
    automatic = tuple(p for p in leaves if KEYS[p].how == AUTO)
    if automatic:
        log.info("DeepSpeed config: handled automatically by offload-zero (accepted, not "
                 "needed): %s", ", ".join(automatic))
    return DeepSpeedSettings(kw, micro, total, accum, ws, schedule, automatic)


def from_deepspeed_config(model: torch.nn.Module, config, **overrides):
    """An :class:`OffloadEngine` for ``model`` configured by a DeepSpeed config (a dict, or
    a path to its JSON file); ``overrides`` are engine keywords (``lr=``, ``dtype=``,
    ``param_groups=``, ``path=``, ...) and DeepSpeed's names (``train_micro_batch_size_per_gpu``,
    ``total_num_steps``, ...): they resolve ``"auto"`` values and must agree with the values the
    config gives. See :func:`parse_deepspeed_config` for the errors.

    The engine gets three attributes: ``lr_scheduler`` (the config's schedule as a
    ``LambdaLR`` on ``engine.optimizer``, stepped by the engine after each update; None without
    a ``scheduler``), ``train_micro_batch_size_per_gpu`` and ``train_batch_size`` (ints, or None
    where the config gives no batch size): feed the loop micro-batches of that size, and call
    ``engine.backward`` and ``engine.step`` on each, as with DeepSpeed.
    """
    return parse_deepspeed_config(config, overrides).build(model)


def _zero_kwargs(res: _Resolver) -> dict:
    kw = {}
    stage = res.get(_ZO + "stage")
    if stage is not None:
        if stage == 0:
            raise NotImplementedError("zero_optimization.stage 0 (plain data parallelism) is "
                                      "not supported; use stage 1, 2 or 3")
        kw["stage"] = stage
    for section, name in ((_OO, "offload_optimizer"), (_OP, "offload_param")):
        device = res.get(section + "device")
        if device is not None:
            if device not in OFFLOADS:
                raise ValueError(f"{section}device={device!r} is not valid; choose 'none', "
                                 "'cpu' or 'nvme'")
            kw[name] = device
    paths = {p: res.leaves[p] for p in (_OO + "nvme_path", _OP + "nvme_path")
             if p in res.leaves and res.leaves[p] != "auto"}
    if len(set(paths.values())) > 1:
        raise ValueError("zero_optimization.offload_optimizer.nvme_path and offload_param."
                         f"nvme_path must agree (this engine has one swap folder): got "
                         f"{list(paths.values())}")
    if "nvme" in (kw.get("offload_optimizer"), kw.get("offload_param")):
        for path in (_OO + "nvme_path", _OP + "nvme_path"):
            folder = res.get(path)
            if folder is not None:
                kw["path"] = folder
    return kw


def _precision_kwargs(res: _Resolver) -> dict:
    want = {"bf16.enabled": torch.bfloat16, "fp16.enabled": torch.float16}
    on = []
    for path, dtype in want.items():
        if not res.given(path):
            continue
        if res.leaves[path] == "auto":
            dtype_now = res.get(path, names=("dtype",))
            if dtype_now == dtype:
                on.append(dtype)
            continue
        enabled = res.leaves[path]
        if not isinstance(enabled, bool):
            raise ValueError(f"DeepSpeed config key {path!r}={enabled!r} must be true, false "
                             "or \"auto\"")
        if enabled:
            on.append(dtype)
    if len(on) == 2:
        raise ValueError("bf16.enabled and fp16.enabled are both true; enable one")
    dtype = on[0] if on else res.overrides.get("dtype")
    kw = {} if dtype is None else {"dtype": dtype}
    if on and "dtype" in res.overrides and res.overrides["dtype"] != on[0]:
        raise ValueError(f"dtype={res.overrides['dtype']} conflicts with the DeepSpeed config, "
                         f"which enables {on[0]}; give one of them")
    # bf16 master weights and gradient shards; bf16 moments (DeepSpeed's low-precision options)
    # (only where the config gives the key: an engine keyword alone passes through as it is)
    path = "bf16.bf16_master_weights_and_grads"
    if res.given(path):
        kw["master_dtype"] = res.get(path, _bf16_or_fp32)
        if res.leaves[path] is True:  # its gradient shards too (checked against grad_dtype=)
            kw["grad_dtype"] = res.get(path, lambda v: torch.bfloat16, names=("grad_dtype",))
    moments = res.get("bf16.bf16_optimizer_states", _bf16_or_fp32)
    if moments is not None:
        kw["moment_dtype"] = moments
    if dtype == torch.float16:
        scale = res.get("fp16.loss_scale", lambda v: "dynamic" if v == 0 else float(v))
        if scale is not None:
            kw["loss_scale"] = scale
        if scale in (None, "dynamic"):
            for path, convert in (("fp16.initial_scale_power", lambda p: 2.0 ** p),
                                  ("fp16.loss_scale_window", int),
                                  ("fp16.min_loss_scale", float)):
                value = res.get(path, convert)
                if value is not None:
                    kw[KEYS[path].note] = value
    return kw


def _bf16_or_fp32(value) -> str:
    """A DeepSpeed bf16 option's true/false as the engine's ``"bf16"``/``"fp32"`` (ValueError
    for anything else)."""
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return "bf16" if value else "fp32"


def _optimizer_kwargs(res: _Resolver, leaves: dict) -> dict:
    kw = {}
    given = [p for p in leaves if p.startswith("optimizer.")]
    if given and "optimizer.type" not in leaves:
        raise ValueError(f"{given} given without optimizer.type (Adam or AdamW)")
    if "optimizer.type" in leaves:
        kind = leaves["optimizer.type"]
        if not isinstance(kind, str) or kind.lower() not in _OPTIMIZERS:
            raise NotImplementedError(f"DeepSpeed optimizer type {kind!r} is not supported: "
                                      "this engine runs Adam and AdamW (type 'Adam' or 'AdamW')")
        adamw = _OPTIMIZERS[kind.lower()] or leaves.get("optimizer.params.adam_w_mode", True)
        if adamw == "auto":
            adamw = res.get("optimizer.params.adam_w_mode")
        if "adamw" in res.overrides and res.overrides["adamw"] != adamw:
            raise ValueError(f"adamw={res.overrides['adamw']!r} conflicts with the DeepSpeed "
                             f"config's optimizer (type {kind!r}); give one of them")
        kw["adamw"] = bool(adamw)
    for name in ("lr", "betas", "eps", "weight_decay"):
        value = res.get("optimizer.params." + name, tuple if name == "betas" else float)
        if value is not None:
            kw[name] = value
    return kw


def _batch_sizes(res: _Resolver, world_size: int) -> Tuple[Optional[int], Optional[int], int]:
    """``(micro, total, accumulation)`` by DeepSpeed's rule: ``train_batch_size ==
    train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``; any two
    give the third. ValueError naming the three numbers (and the world size) when they
    disagree or do not divide."""
    names = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps")
    micro, total, accum = (res.get(name, derivable=True) for name in names)
    for name, value in zip(names, (micro, total, accum)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    fallback = {n: res.fallbacks.get(n) if res.leaves.get(n) == "auto" else None for n in names}
    if accum is None and total is not None and micro is not None:
        accum = max(1, total // (micro * world_size))
    accum = accum if accum is not None else fallback[names[2]]
    if micro is None and total is not None:
        micro = max(1, total // ((accum or 1) * world_size))
    micro = micro if micro is not None else fallback[names[0]]
    if accum is None and res.leaves.get(names[2]) != "auto":
        accum = 1
    if total is None and micro is not None and accum is not None:
        total = micro * accum * world_size
    for name, value in ((names[2], accum), (names[0], micro), (names[1], total)):
        if value is None and res.leaves.get(name) == "auto":
            raise ValueError(f"DeepSpeed config key {name!r} is \"auto\" and nothing resolves "
                             f"it: pass {name}=... beside the config (or two of the three "
                             "batch settings)")
    if total is not None and total != micro * accum * world_size:
        raise ValueError(f"train_batch_size={total} must equal train_micro_batch_size_per_gpu="
                         f"{micro} x gradient_accumulation_steps={accum} x world size "
                         f"{world_size} = {micro * accum * world_size}")
    return micro, total, accum


def _schedule(res: _Resolver, leaves: dict, kw: dict) -> Optional[WarmupSchedule]:
    params = {p.split(".")[-1]: p for p in leaves if p.startswith(_SCHED)}
    if "scheduler.type" not in leaves:
        if params:
            raise ValueError(f"scheduler.params {sorted(params)} given without scheduler.type")
        return None
    kind = leaves["scheduler.type"]
    if kind not in _SCHEDULES:
        raise NotImplementedError(f"DeepSpeed scheduler type {kind!r} is not supported; use "
                                  f"one of {sorted(_SCHEDULES)}, or any torch scheduler on "
                                  "engine.optimizer")
    defaults = _SCHEDULES[kind]
    stray = sorted(set(params) - set(defaults) - {"last_batch_iteration"})
    if stray:
        raise ValueError(f"scheduler.params {stray} are not parameters of {kind} (it takes "
                         f"{sorted(defaults)})")
    values = {}
    for name, default in defaults.items():
        names = (name, "lr") if name == "warmup_max_lr" else (name,)
        values[name] = res.get(_SCHED + name, names=names, default=default)
    if "warmup_max_lr" in values and values["warmup_max_lr"] is None:
        values["warmup_max_lr"] = kw.get("lr", 1e-3)  # DeepSpeed's: the optimizer's lr
    _check_schedule(kind, values)
    return WarmupSchedule(kind, values)


def _check_schedule(kind: str, values: dict) -> None:
    from offload_zero.config import check_int, check_number

    if values["warmup_type"] not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type={values['warmup_type']!r} is not "
                         "valid; choose 'log' or 'linear'")
    values["warmup_num_steps"] = check_int("scheduler.params.warmup_num_steps",
                                           values["warmup_num_steps"], 0)
    if "total_num_steps" in values:
        if values["total_num_steps"] is None:
            raise ValueError(f"{kind} needs scheduler.params.total_num_steps (the number of "
                             "updates the schedule spans)")
        values["total_num_steps"] = check_int("scheduler.params.total_num_steps",
                                              values["total_num_steps"], 1)
    for name in ("warmup_min_lr", "warmup_min_ratio", "cos_min_ratio"):
        if name in values:
            values[name] = check_number(f"scheduler.params.{name}", values[name], 0.0)
    if "warmup_max_lr" in values:
        values["warmup_max_lr"] = check_number("scheduler.params.warmup_max_lr",
                                               values["warmup_max_lr"], 0.0,
                                               low_inclusive=False)
    if kind == "WarmupCosineLR" and values["total_num_steps"] <= max(2, values["warmup_num_steps"]):
        raise ValueError(f"WarmupCosineLR needs total_num_steps > warmup_num_steps; got "
                         f"{values['total_num_steps']} and {values['warmup_num_steps']}")
