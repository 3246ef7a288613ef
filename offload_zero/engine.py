"""``OffloadEngine``: the user-facing training loop — forward, backward, step, state export,
checkpoints.

It implements ZeRO-DP (Rajbhandari et al., 2019) stages 1-3 over the data-parallel ranks, with
the partitioned fp32 optimizer state placed on the device, in host memory (ZeRO-Offload) or in
NVMe files (ZeRO-Infinity). See DESIGN.md for the memory arithmetic and
:mod:`offload_zero.partition.schedule` for when units are gathered and freed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import warnings
import weakref
import zlib
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn as nn

from offload_zero.accelerate_guard import RefusePrepare, refuse_in_accelerate
from offload_zero.comm import Comm, init_from_env
from offload_zero.lockstep import Phase
from offload_zero.config import EngineConfig, Tier, check_number
from offload_zero.memory.accounting import StateKind, TierAccountant
from offload_zero.memory.aligned import aligned_empty
from offload_zero.memory.pool import GatherPool, HostBufferPool, storage_rebinding_supported
from offload_zero.memory.tiers import (DeviceStore, HostParamHome, HostStore, NVMeParamHome,
                                       NVMeStore)
from offload_zero.partition.flat_param import FlatParam, build_entries, shard_numel_for
from offload_zero.partition.grads import GradientShards
from offload_zero.partition.reduce_order import OrderedReduction, grad_order, reduce_stage1
from offload_zero.partition.schedule import UnitScheduler, runs_itself
from offload_zero.partition.units import Unit, plan_flat_params
from offload_zero.plan import layout_of, memory_plan, pipeline_shard_numel, settings_of

log = logging.getLogger("offload_zero")


class OffloadEngine:
    """Wrap ``model`` for ZeRO training with optional CPU or NVMe offload of optimizer state.

    Args:
        model: any ``torch.nn.Module`` with its parameters on the CPU (or the device). Its
            parameters are moved into flat shards owned by the engine: afterwards the module's
            parameter attributes are views while their unit runs, and otherwise its own
            parameter objects, each of the true shape in the compute dtype (the current values
            at stages 1 and 2, placeholders at stage 3). The model's own API keeps working:
            ``parameters()``, ``state_dict()`` (the full fp32 values, collective),
            ``load_state_dict()`` (into the master weights), ``generate()``, in-place writes
            under ``torch.no_grad()`` (they reach the master weights); see
            :mod:`offload_zero.exposure`. At stage 3 under torchrun every rank must run each
            forward, ``generate()`` included (with ``synced_gpus=True`` when the ranks'
            lengths differ).
        offload: ``"none"``, ``"cpu"`` or ``"nvme"`` — where fp32 master weights and Adam
            moments live (see :class:`offload_zero.config.EngineConfig`).
        path: existing writable folder for NVMe swap files (``offload="nvme"``); files go to
            ``path/rank<r>/`` with mode 0600 and are removed by :meth:`close`; its ``.owner``
            file (pid, boot id) lets a later engine take over the folder of a process that is
            gone (with a warning), and refuse it while that process runs (ValueError).
        stage: ZeRO stage 1, 2 or 3.
        lr, betas, eps, weight_decay, adamw: the optimizer (AdamW when ``adamw`` else Adam with
            L2), with torch's exact semantics; ``lr`` and the three after it are the parameter
            groups' defaults.
        dtype: compute dtype of parameters and gradients on the device (float32, bfloat16,
            float16); master weights and moments are float32.
        device: the accelerator (default: CUDA when present, else the CPU).
        process_group: the data-parallel group (default: the world; none needed at world size 1).
        timeout_s: collective timeout in seconds when the engine initialises the process group
            (a finite number > 0; ValueError otherwise).
        param_groups: None (one group of every trainable parameter), or torch's format: a list
            of dicts, each with ``params`` (parameters of ``model``, taken before wrapping) and
            any of ``lr``, ``betas``, ``eps``, ``weight_decay``. Trainable parameters in no group
            go to a last group with the values above. See :attr:`optimizer`.
        load_from: a Hugging Face safetensors checkpoint folder whose weights (any float
            dtype) become the fp32 master weights, streamed one flat parameter at a time, each
            rank reading only its shard's bytes; works with a model built on the meta device
            (never materialised whole) or a normal one (its values are replaced). Names follow
            ``from_pretrained`` (tied weights, the model's renames, ``base_model_prefix``).
            See :func:`offload_zero.stream_load.initial_values`.
        init: ``"model"``: parameters not in ``load_from`` (all without it) come from the
            model's own initialiser (transformers' ``_init_weights``, else
            ``reset_parameters()``), one unit at a time; seed torch first for determinism.
        strict: with ``load_from``, missing or unexpected keys raise ValueError; False
            loads anyway and lists them in :attr:`load_report`.
        **kwargs: further :class:`EngineConfig` fields (prefetch, unit_classes, max_grad_norm,
            aio_backend, aio_block_size, aio_queue_depth, step_in_backward, step_in_forward,
            ...). At stage 3 with the optimizer state on NVMe, ``step_in_forward`` is on by
            default: :meth:`step` decides the update and each unit gets it just before its
            next gather. ``gradient_accumulation_steps=N``: DeepSpeed's gradient accumulation
            (see :meth:`step`).

    Raises:
        ValueError: any invalid argument, naming the value and the valid choices; a missing or
            read-only ``path``; a model without parameters, or one another engine wraps; a
            parameter in two groups or not in ``model`` (named), a bad group value; a
            parameter on the meta device without ``load_from``/``init``; a bad checkpoint
            (missing shard, truncated file, wrong shape, unexpected key: file and key named).

    Attributes:
        optimizer: the :class:`offload_zero.optim.facade.EngineOptimizer` (a
            ``torch.optim.Optimizer``) whose ``param_groups`` the updates read: give it to
            torch's or transformers' LR schedulers.
        loss_scaler: the :class:`offload_zero.optim.loss_scale.LossScaler` (``loss_scale=``;
            dynamic by default with ``dtype=torch.float16``), or None without loss scaling.
        skipped_steps: steps that updated nothing (or, with ``step_in_backward``, not every flat
            parameter) because a gradient held an inf/nan.
        lr_scheduler: None, or a torch LR scheduler on :attr:`optimizer` that :meth:`step`
            steps after each update it makes (not after a skipped one, nor between accumulated
            micro-batches), as DeepSpeed steps its configured schedule
            (:func:`offload_zero.from_deepspeed_config` sets it). Do not step it yourself too.
        memory_plan: the :class:`offload_zero.plan.MemoryPlan` the engine was built from:
            its pools (exactly those of :meth:`memory_report`) and its bytes per tier and kind.
        load_report: ``{"missing_keys": [...], "unexpected_keys": [...]}`` of ``load_from``
            (empty lists without it, and always when ``strict``).

    Memory per rank (Ψ parameters, N ranks, bf16 compute): 4Ψ + 12Ψ/N at stage 1, 2Ψ + 14Ψ/N at
    stage 2, 16Ψ/N at stage 3, split over the tiers as ``offload`` says; :meth:`memory_report`
    gives the measured bytes.
    """

    def __init__(self, model: nn.Module, offload: str = "none", path: Optional[str] = None,
                 stage: int = 3, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw: bool = True, dtype: torch.dtype = torch.float32,
                 device=None, process_group=None, timeout_s: float = 300.0,
                 param_groups=None, load_from=None, init: Optional[str] = None,
                 strict: bool = True, **kwargs):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if getattr(model, "_is_accelerate_prepared", None) is True:
            raise ValueError(f"model {type(model).__name__} was prepared by accelerate; wrap "
                             "the model itself (the engine places and shards it), and prepare "
                             "only the data loader")
        if getattr(model, _WRAPPED, False):
            raise ValueError(f"model {type(model).__name__} is already wrapped by an "
                             "OffloadEngine: its parameters live in that engine (and go with "
                             "it on close()). Build the model afresh, or load the first "
                             "engine's full_state_dict() into a new one")
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            valid = sorted(fields | {'process_group', 'timeout_s', 'param_groups'})
            raise ValueError(f"OffloadEngine got unknown keyword argument(s) {unknown}; valid "
                             f"ones: {valid}")
        self.config = EngineConfig(offload=offload, path=path, stage=stage, lr=lr, betas=betas,
                                   eps=eps, weight_decay=weight_decay, adamw=adamw, dtype=dtype,
                                   device=device, **kwargs)
        cfg = self.config
        self.device = cfg.device
        from offload_zero.optim.facade import resolve_param_groups
        defaults = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        groups, group_of = resolve_param_groups(model, param_groups, defaults)
        timeout_s = check_number("timeout_s", timeout_s, low=0.0, low_inclusive=False)
        init_from_env(timeout_s, self.device)
        self.comm = Comm(process_group, device=self.device,
                         check_collectives=cfg.check_collectives, timeout_s=timeout_s)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.placement = None
        if cfg.offload == "auto":
            from offload_zero.placement import choose_placement
            self.placement = choose_placement(
                model, cfg.stage, self.world_size, cfg.dtype, cfg.prefetch, cfg.unit_classes,
                self.device, cfg.path, cfg.max_device_bytes, cfg.max_host_bytes,
                step_in_backward=cfg.step_in_backward, tail_state_in_host=cfg.tail_state_in_host,
                step_in_forward=cfg.step_in_forward, leaf_modules=cfg.leaf_modules,
                host_cache_bytes=cfg.host_cache_bytes, moment_dtype=cfg.moment_dtype)
            self.config = cfg = dataclasses.replace(
                cfg, offload_optimizer=self.placement.offload_optimizer,
                offload_param=self.placement.offload_param,
                step_in_forward=self.placement.step_in_forward,
                host_cache_bytes=self.placement.host_cache_bytes)
        self.module = model
        self._closed = False
        self._acct = TierAccountant(self.rank)
        self._step_count: Dict[FlatParam, int] = {}
        self._targets: Dict[FlatParam, Optional[torch.Tensor]] = {}
        self._early: Dict[FlatParam, bool] = {}  # step_in_backward: updated in backward -> ok
        self._deferred: List[tuple] = []  # streaming updates: (fp, update generator, on end)
        self._pace = [0, 0]  # step_in_forward: [chunks streamed, chunks queued] (_pace_streams)
        self._lazy: Dict[FlatParam, None] = {}  # step_in_forward: updates decided, not applied,
        #                                         in the order the next forward needs them
        self._lazy_step = (1.0, ())             # (gradient factor, GroupHyper per group)
        self._keep_for_gather: set = set()      # flat params whose gather follows their update
        self._backward_pending = False
        self._micro_steps = 0           # step() calls since the engine was built
        self._micro_stepped = False     # step() ended a micro-batch, no backward since
        self.skipped_steps = 0
        self.lr_scheduler = None  # stepped after each update (see the class docstring)
        # fp16: the loss is scaled up before backward, the update scales the gradients down
        self.loss_scaler = cfg.make_loss_scaler()
        pin = self.device.type == "cuda"
        self._host_alloc = lambda n, dt: aligned_empty(n, dt, pin=pin)

        self.swapper = None
        self.param_home = None
        self.pools: Dict[str, object] = {}  # HostBufferPool | GatherPool, by name
        from offload_zero.stream_load import initial_values
        # checked (and buffers filled) before anything is allocated
        self._initial = initial_values(model, load_from, init, strict)
        self.load_report = {
            "missing_keys": list(getattr(self._initial, "missing_keys", [])),
            "unexpected_keys": list(getattr(self._initial, "unexpected_keys", []))}
        try:
            self._build(model)
            self._build_optimizer(groups, group_of, defaults)
        except BaseException as exc:
            with _not_replacing(exc, self.rank):
                _release(self._acct, getattr(self, "store", None), getattr(self, "param_home", None),
                         self.swapper, self.pools, getattr(self, "scheduler", None),
                         getattr(self, "grads", None), getattr(self, "flat_params", []))
            raise
        finally:
            if self._initial is not None:
                self._initial.close()
            self._initial = None
        # Hooks on tensors live in C++, where the cycle collector cannot see them: the finalizer
        # must not reference the engine, and it removes the hooks itself.
        self._finalizer = weakref.finalize(self, _release, self._acct, self.store,
                                           self.param_home, self.swapper, self.pools,
                                           self.scheduler, self.grads, self.flat_params)
        object.__setattr__(model, _WRAPPED, True)
        # the model's own parameters(), state_dict(), load_state_dict() and in-place writes
        from offload_zero.exposure import ModelExposure
        self._exposure = ModelExposure(self)
        # accelerator.prepare(model) raises (see [Note: accelerate's prepare])
        object.__setattr__(model, "_is_accelerate_prepared", RefusePrepare("model"))

    @property
    def __class__(self):
        """``type(self)``; but an ``isinstance`` test of the engine by accelerate (its
        ``prepare(engine)``) raises ValueError naming the pattern that works (see [Note:
        accelerate's prepare] in :mod:`offload_zero.accelerate_guard`)."""
        refuse_in_accelerate(sys._getframe(1), "engine")
        return type(self)

    # -- construction ------------------------------------------------------------------------
    def _build(self, model: nn.Module) -> None:
        cfg = self.config
        plan = self._plan = self._plan_units(model)
        if not any(members for _, _, members in plan[2]):
            raise ValueError("model has no parameters to train")
        # every byte held below, pools included, comes from this plan (see offload_zero/plan.py)
        self.memory_plan = memory_plan(
            layout_of([(-1 if u.is_root else u.index, t, m) for u, t, m in plan[2]]),
            settings_of(cfg, self.world_size, self.device, storage_rebinding_supported()))
        # names of the flat parameters whose optimizer state stays in RAM (see [Note: host cache])
        self._tail, self._in_host = self._state_in_host(plan)
        if "nvme" in (cfg.offload_optimizer, cfg.offload_param):
            from offload_zero.memory.swapper import Swapper
            _exit_on_sigterm()
            self.swapper = Swapper(os.path.join(os.fspath(cfg.path), f"rank{self.rank}"),
                                   backend=cfg.aio_backend, block_size=cfg.aio_block_size,
                                   queue_depth=cfg.aio_queue_depth, claim=True)
        mplan = self.memory_plan
        if cfg.param_tier is Tier.HOST:
            self.param_home = HostParamHome(self._acct, self._host_alloc)
        elif cfg.param_tier is Tier.NVME:
            # fp32 shards are their own master weights: read from the optimizer's files and
            # never written back separately, so no write-back ring either
            share = mplan.master_is_param_on_nvme
            # in flight at once: (prefetch + 1) units of at most 2 flat parameters, plus the
            # write-back ring of the step. An outsized root unit (embeddings) gets buffers of
            # its own, so the main pool's buffers are block-sized: one per flat parameter when
            # they are all trainable (each keeps its updated shard for the next forward), else
            # one, through which its flat parameters are read one after the other; the root's
            # small flat parameters (a final norm split off by gradient order, frozen ones) go
            # through the block-sized pool like a block's (see [Note: pools])
            main = self._host_pool(mplan.pool("param_shards"))
            pool_for = lambda fp: main  # noqa: E731
            keep = None
            # a state kept in host memory is, in fp32, the shard itself: no buffer, no file
            in_host = self._in_host if share else set()
            spec = mplan.pool("param_shards_root")
            if spec is not None:
                names = _flat_param_names(plan[2])
                outsized = {names[i] for i in mplan.outsized_root}
                root = self._host_pool(spec)
                pool_for = lambda fp: root if fp.name in outsized else main  # noqa: E731
                if mplan.keep_root:
                    # the root's buffers are idle between its update and the next forward,
                    # which gathers the root first: the updated shards stay there instead of
                    # being read back from the files
                    keep = lambda fp: fp.name in outsized and fp.name not in in_host  # noqa: E731
            if cfg.step_in_forward:
                # a block's update runs just before its gather: the new shard stays in its
                # buffer for that gather instead of being written and read back (the root's
                # only where it has a buffer per flat parameter, as above)
                keep_root, kept = keep or (lambda fp: False), self._keep_for_gather
                keep = lambda fp: (keep_root(fp) if fp.name.startswith("root.")  # noqa: E731
                                   else fp in kept and fp.name not in in_host)
            self.param_home = NVMeParamHome(self.swapper, pool_for, self._acct,
                                            master_is_param=share, keep_after_update=keep)
        self.store = self._build_store(plan)
        for name in self._in_host:
            self.store.keep_in_host(name)
        if self._tail is None and cfg.tail_state_in_host:
            warnings.warn("tail_state_in_host=True has no effect: it needs step_in_backward=True "
                          "or step_in_forward=True, "
                          f"the optimizer state on NVMe (it is on {cfg.offload_optimizer!r}) "
                          "and trainable root parameters", UserWarning, stacklevel=3)
        if isinstance(self.param_home, NVMeParamHome) and self.param_home.master_is_param:
            self.param_home.master_source = self.store
        self.blocks, self.root = self._build_units(*plan)
        self.units: List[Unit] = self.blocks + [self.root]
        self.flat_params = [fp for u in self.units for fp in u.flat_params]
        self.trainable = [fp for fp in self.flat_params if fp.requires_grad]
        # one order of the gradients' reductions on every rank (see [Note: reduction order])
        self._grad_order = grad_order(model, self.trainable)
        if self.comm.lockstep is not None:
            self.comm.lockstep.register_names({fp.name: f"{fp.name} of {u.label}"
                                               for u in self.units for fp in u.flat_params})
        # the root's trainable parameters, split by gradient order, come as [used after the
        # blocks (final norm, LM head)..., the rest (embeddings)]
        root_trainable = [fp for fp in self.root.flat_params if fp.requires_grad]
        self._after_blocks = set(root_trainable[:-1])
        # whether forward reads block parameter shards from NVMe (see _read_ahead_in_forward)
        self._forward_reads_params = any(fp.home is not None and fp.home.tier is Tier.NVME
                                         for u in self.blocks for fp in u.flat_params)
        for mod in model.modules():  # buffers are not sharded; they follow the device
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[k] = b.to(self.device)

        self.grads = GradientShards(self.trainable, cfg.grad_tier, self.comm, cfg.stage,
                                    self._acct, self._host_alloc, host_dtype=cfg.grad_dtype,
                                    share_near_sizes=cfg.step_in_backward)
        self._staging = None
        if mplan.pool("staging") is not None:
            n = mplan.pool("staging").buffer_numel
            self._staging = self._host_alloc(n, cfg.dtype)
            self._acct.add(Tier.HOST, StateKind.BUFFERS, n * self._staging.element_size())
        pool_for = self._build_gather_pools()
        staging = self.grads.scratch if self.device.type != "cpu" else None
        # (the scheduler's callbacks hold the engine weakly: the finalizer holds the scheduler)
        on_grad, on_unit_backward, on_forward = self.grads.on_full_grad, None, None
        on_unit_forward, before_gather = None, None
        if cfg.step_in_backward:
            on_grad, on_unit_backward = _weakly(self._grad_ready), _weakly(self._prefetch_state)
            # an update still streaming when backward returns ends before weights are read
            on_forward = _weakly(self._finish_updates)
        gather_late = before_late_gather = None
        if cfg.step_in_forward:
            before_gather = _weakly(self._apply_lazy_for)
            gather_late = _weakly(self._streaming)
            before_late_gather = _weakly(self._finish_streaming)
            on_unit_backward = _weakly(self._read_ahead_in_backward)
        spec = mplan.pool("optimizer_prefetch")
        if spec is not None:
            # read-ahead of a block's whole state (master | exp_avg | exp_avg_sq) while other
            # units run (see [Note: pools]; a state kept in host memory needs no read-ahead):
            # a third buffer when the next unit's parameters are gathered from it in backward
            # (see _prefetch_state), and with step_in_forward, where the next forward's compute
            # is all there is to hide the state's reads and writes behind
            numel = max(sh for i, (f, sh) in enumerate(zip(mplan.layout, mplan.shard_numel))
                        if f.unit != -1 and f.trainable and i not in mplan.in_host)
            ring = self._host_pool(spec, torch.float32)
            self.store.enable_prefetch(ring, numel)
            if cfg.step_in_backward:
                on_unit_forward = _weakly(self._read_ahead_in_forward)
        self._reduction = None
        if cfg.stage == 2 and self.world_size > 1:
            # (the engine held weakly, as for every scheduler callback)
            self._reduction = OrderedReduction(self._grad_order, on_grad, self.grads, self.comm,
                                               flags_in_update=cfg.step_in_backward)
            on_grad = self._reduction.grad_ready
        self.scheduler = UnitScheduler(self.blocks, self.root, self.comm, cfg.prefetch,
                                       reshard_after_forward=cfg.stage == 3,
                                       on_grad=on_grad, pool_for=pool_for, staging=staging,
                                       on_end_backward=(None if self._reduction is None
                                                        else self._reduction.end_backward),
                                       on_forward_error=self.comm.report_failure,
                                       on_unit_backward=on_unit_backward, on_forward=on_forward,
                                       on_unit_forward=on_unit_forward,
                                       before_gather=before_gather, gather_late=gather_late,
                                       before_late_gather=before_late_gather)
        self._check_pools()
        if cfg.activation_checkpointing:
            # a key/value cache filled in forward and again in the recomputation would make the
            # two passes differ (Hugging Face models turn it off for checkpointing the same way)
            if getattr(getattr(model, "config", None), "use_cache", False):
                model.config.use_cache = False
                log.info("activation_checkpointing: set model.config.use_cache = False")
            offload = cfg.offload_activations and self.device.type != "cpu"
            for unit in self.blocks:
                # (a container unit's children each recompute)
                for mod in ([unit.module] if runs_itself(unit.module)
                            else unit.module.children()):
                    _checkpoint_forward(mod, offload)

    def _build_optimizer(self, groups: List[dict], group_of: Dict[int, int],
                         defaults: dict) -> None:
        """``self.optimizer`` over ``groups`` (from :func:`resolve_param_groups`), and each
        trainable flat parameter's group segments (see [Note: parameter groups] in
        :mod:`offload_zero.optim.facade`): ``_entry_groups[fp]`` the group of each of its
        parameters, ``_segments[fp]`` its shard's runs ``(lo, hi, group)``."""
        from offload_zero.optim.facade import EngineOptimizer, shard_segments
        planned = self._plan[2]
        members = {name: m for (_, _, m), name in zip(planned, _flat_param_names(planned))}
        self._entry_groups: Dict[FlatParam, List[int]] = {}
        self._segments: Dict[FlatParam, List[tuple]] = {}
        for fp in self.trainable:
            self._entry_groups[fp] = [group_of[id(p)] for p, _ in members[fp.name]]
            runs = [(e.offset, e.numel, g) for e, g in zip(fp.entries, self._entry_groups[fp])]
            self._segments[fp] = shard_segments(runs, fp.rank * fp.shard_numel, fp.shard_numel)
        self.optimizer = EngineOptimizer(self, groups, defaults)

    def _hypers(self) -> tuple:
        """Every parameter group's hyperparameters now (:meth:`EngineOptimizer.hypers`):
        what an update decided now uses. Raises ValueError naming a bad value."""
        return self.optimizer.hypers()

    def _plan_units(self, model: nn.Module):
        """Units and, per unit, its trainable and frozen parameter groups (nothing built yet)."""
        cfg = self.config
        block_mods, planned, users = plan_flat_params(
            model, cfg.unit_classes, cfg.leaf_modules)
        blocks = [Unit(i, n, m, is_root=False) for i, (n, m) in enumerate(block_mods)]
        root = Unit(len(blocks), "", model, is_root=True)
        units = blocks + [root]
        planned = [(units[i], trainable, members) for i, trainable, members in planned]
        return blocks, root, planned, users

    def _build_units(self, blocks, root, planned, users):
        cfg = self.config
        units = blocks + [root]
        # fp32 master weights in the same memory as the fp32 shard: the shard is the master (the
        # device, or host "offload" where the CPU itself plays the device); the same for a
        # state kept in host memory when the CPU is the device
        alias_ok = self.memory_plan.master_aliased
        tail_alias_ok = self.memory_plan.host_master_aliased
        owner_of, originals = {}, {}
        for (unit, trainable, members), name in zip(planned, _flat_param_names(planned)):
            entries = build_entries(members)
            values = self._initial_values(entries, members)
            fp = FlatParam(name, entries, values,
                           trainable, cfg.dtype, self.device, self.rank, self.world_size,
                           keep_unsharded=self._keeps_full_params(), accountant=self._acct,
                           home=self.param_home)
            if trainable:
                # straight to its tier, unit by unit: the fp32 masters of the whole model never
                # sit in memory at once
                in_host = isinstance(self.store, NVMeStore) and self.store.in_host(fp)
                alias = fp.sharded if alias_ok or (in_host and tail_alias_ok) else None
                self.store.add(fp, _flat_shard_fp32(fp, values), alias=alias)
                self._step_count[fp] = 0
            unit.flat_params.append(fp)
            originals[fp] = [p for p, _ in members]
            del values
            for p, refs in members:
                owner_of[id(p)] = unit
                for mod, attr, _ in refs:
                    mod._parameters.pop(attr, None)
                # the engine holds the only copy now
                p.data = torch.empty(0, dtype=p.dtype, device="meta" if p.is_meta else "cpu")
        for unit_index, unit in enumerate(units):
            deps = {owner_of[k] for k, us in users.items() if unit_index in us} - {unit, root}
            unit.deps = sorted(deps, key=lambda u: u.index)
        pending = _weakly(self._grad_pending)
        for unit in units:
            for fp in unit.flat_params:
                fp.set_views() if fp.keep_unsharded else fp.set_placeholders()
                fp.expose(originals[fp])  # (see [Note: model parameters while wrapped])
                fp.grad_pending = lambda fp=fp: bool(pending(fp))
        return blocks, root

    def _grad_pending(self, fp: FlatParam) -> bool:
        """Whether a backward since the last step left a gradient of ``fp`` in the engine."""
        return fp.requires_grad and self._backward_pending and not self._closed

    def _initial_values(self, entries, members) -> List[torch.Tensor]:
        """A flat parameter's initial values, one tensor per entry: the parameters themselves,
        or (``load_from``/``init``) streamed for the elements this rank keeps (see [Note:
        streamed initial values] in :mod:`offload_zero.stream_load`)."""
        if self._initial is None:
            return [p.detach() for p, _ in members]
        numel = sum(e.numel for e in entries)
        shard = shard_numel_for(numel, self.world_size, self.config.dtype)
        lo, hi = ((0, numel) if self._keeps_full_params()
                  else (self.rank * shard, min(numel, (self.rank + 1) * shard)))
        return self._initial.flat_values(entries, members, shard * self.world_size, lo, hi)

    def _state_in_host(self, plan):
        """``(tail, names)``: the name of the flat parameter ``tail_state_in_host`` keeps (with
        step_in_backward or step_in_forward and the state on NVMe; see
        :func:`offload_zero.partition.units.host_tail_index`) or None, and the names of every
        flat parameter whose optimizer state stays in host memory: that one and those
        ``host_cache_bytes`` takes (see [Note: host cache]): the memory plan's choice, by name.
        Empty unless the state is on NVMe."""
        names = _flat_param_names(plan[2])
        tail = self.memory_plan.tail
        in_host = {names[i] for i in self.memory_plan.in_host}
        return (None if tail is None else names[tail]), in_host

    def _build_gather_pools(self):
        """Device slots for gathered units, sized now (see [Note: gather pool]); returns
        ``f(unit) -> GatherPool | None`` for the scheduler, or None when nothing is gathered.

        Blocks share the plan's ``gather`` slots, the root unit (gathered from the start of
        forward to the end of backward) has ``gather_root`` (see [Note: pools] in
        :mod:`offload_zero.plan`)."""
        if self._keeps_full_params():
            return None
        if not self.memory_plan.settings.rebinding:
            log.info("this torch cannot rebind storages: gathered units are allocated per gather")
            return None

        pools = {}
        for key, name in (("blocks", "gather"), ("root", "gather_root")):
            spec = self.memory_plan.pool(name)
            if spec is not None:
                pools[key] = self.pools[name] = GatherPool(name, spec.count, spec.buffer_bytes,
                                                           self.device, self._acct)
        return lambda unit: pools.get("root" if unit.is_root else "blocks")

    def _host_pool(self, spec, dtype=None) -> HostBufferPool:
        """The plan's host pool ``spec`` (a :class:`offload_zero.plan.PoolSpec`), built and
        registered in :attr:`pools`; buffers in ``dtype`` (default: the compute dtype)."""
        pool = HostBufferPool(spec.name, spec.count, spec.buffer_numel,
                              dtype or self.config.dtype, self._host_alloc, self._acct)
        self.pools[spec.name] = pool
        return pool

    def _keeps_full_params(self) -> bool:
        """Whether gathered parameters stay allocated: stages 1 and 2 always; stage 3 when one
        rank holds its shards on the device, since its shard already is the whole parameter
        (gathering would only copy it, and freeing the copy would save nothing)."""
        return self.memory_plan.keeps_full_params

    def _build_store(self, plan):
        tier = self.config.optimizer_tier
        moments = self.config.moment_torch_dtype
        if tier is Tier.DEVICE:
            return DeviceStore(self._acct, self.device, moments)
        if tier is Tier.HOST:
            return HostStore(self._acct, self._host_alloc, moments)
        # (a state kept in host memory never streams through the pipeline)
        return NVMeStore(self.swapper, self._acct, self._host_alloc,
                         pipeline_shard_numel(self.memory_plan),
                         master_is_param=self._master_is_param_on_nvme(), moment_dtype=moments)

    def _master_is_param_on_nvme(self) -> bool:
        """fp32 parameter shards and optimizer state both on NVMe: a trainable shard is read
        from its master's bytes (see ``NVMeParamHome(master_is_param=...)``)."""
        return self.memory_plan.master_is_param_on_nvme

    # -- training loop -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run the model's forward on ``args``/``kwargs`` and return its output unchanged.

        Tensor arguments are moved to the engine's device, and floating-point ones are cast to
        the compute dtype (as FSDP's mixed precision casts forward inputs).
        """
        self._check_open()
        args, kwargs = _to_device((args, kwargs), self.device, self.config.dtype)
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (a scalar tensor); gradients land in this rank's shards.

        Calling it several times before :meth:`step` accumulates gradients. If an error ends
        backward early, the units are freed as at its end and the error is raised; the gradients
        then hold what that backward finished: :meth:`zero_grad` drops them (to skip the batch),
        :meth:`step` applies them. With ``step_in_backward`` the updates it made stay and the
        step ends there, as :meth:`step` would end it; an interrupt (KeyboardInterrupt,
        SystemExit) starts no more I/O: :meth:`close`, or :meth:`zero_grad` to go on, ends it.
        With ``gradient_accumulation_steps=N`` the loss is divided by N first (so N
        micro-batches' gradients sum to their mean loss's). With a loss scale (fp16) the loss is
        then multiplied by ``loss_scaler.scale`` in fp32; the update divides it out.
        Raises ValueError if ``loss`` is not a scalar tensor that requires grad, or (with
        ``step_in_backward``) if a parameter group's hyperparameter is bad.
        """
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(f"backward needs a scalar loss tensor that requires grad, got {_describe(loss)}")
        if self.config.step_in_backward and self._backward_pending:
            raise RuntimeError("step_in_backward=True updates the weights during backward, so "
                               "gradients cannot accumulate over several backward calls: call "
                               "step() after each backward, or use step_in_backward=False")
        if self.config.step_in_backward:
            self._hypers()  # a bad value fails here, not inside backward's hooks
        with self._together(Phase.BACKWARD):
            self.apply_pending_updates()  # (units the last forward did not run)
            self._backward_pending = True
            self._micro_stepped = False
            n = self.config.gradient_accumulation_steps
            if n > 1:
                loss = loss / n
            if self.loss_scaler is not None:
                # in fp32: a scaled fp16 loss would overflow long before its gradients do
                loss = loss.float() * self.loss_scaler.scale
            try:
                loss.backward()
            except BaseException as exc:
                with _not_replacing(exc, self.rank, "ending the backward"):
                    self.scheduler.end_backward()  # (the end-of-backward callback did not run)
                    if (self.config.step_in_backward and isinstance(exc, Exception)
                            and not _collective_error(exc)):
                        self._step()  # (not on Ctrl-C or exit: no more I/O; zero_grad() ends it)
                raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last :meth:`step` (to skip a batch, say
        after an error in backward); the next backward starts afresh. Without a backward
        since the last step (torch's habit of ``step(); zero_grad()``) there is nothing to
        drop and nothing changes: ``step_in_forward``'s pending updates stay for the next
        forward. With ``step_in_backward`` the weights already changed in backward: this ends
        the step as :meth:`step` does. With ``gradient_accumulation_steps`` > 1 a :meth:`step`
        that only ended a micro-batch counts as a step here too (nothing is dropped until the
        next backward), so ``step(); zero_grad()`` after each micro-batch accumulates; after a
        backward it drops every micro-batch's gradient since the last update, and the next N
        :meth:`step` calls make the next update. ``set_to_none`` is accepted as torch's
        optimizers take it and changes nothing: the gradient shards are the engine's buffers,
        zeroed either way. Raises RuntimeError if the engine is closed."""
        self._check_open()
        if not self._backward_pending or self._micro_stepped:
            return
        if self.config.step_in_backward:
            self._step()
            return
        self.grads.zero()  # (pending step_in_forward updates: backward applied them)
        n = self.config.gradient_accumulation_steps
        self._micro_steps -= self._micro_steps % n  # (the accumulation window starts again)
        self._backward_pending = False

    # -- step_in_backward ----------------------------------------------------------------------
    def _params_from_state(self) -> bool:
        """Whether fp32 parameter shards on NVMe are their master's bytes: with
        step_in_backward the whole state read ahead for an update then also serves the
        unit's gather in backward (one read of the parameters less per unit and step)."""
        home = self.param_home
        return isinstance(home, NVMeParamHome) and home.master_source is not None

    def _prefetch_state(self, unit: Unit) -> None:
        """Backward reached ``unit``: start reading its optimizer state (NVMe) so the update
        that follows its gradient does not wait for the disk. When parameter shards are their
        master's bytes, the state of the unit backward reaches next is read now too: its
        gather takes the parameters from that read instead of reading them separately."""
        self._pump()
        units = [unit]
        order = self.scheduler.order
        if self._params_from_state() and order:
            i = len(order) if unit.is_root else (order.index(unit) if unit in order else 0)
            units += order[i - 1:i] if i > 0 else []
        for u in units:
            for fp in u.flat_params:
                if fp.requires_grad and fp not in self._early:
                    self.store.prefetch(fp)

    def _read_ahead_in_forward(self, unit: Optional[Unit]) -> None:
        """A training forward started (``unit`` None) or reached block ``unit``: start reading
        into the read-ahead ring the whole state of the blocks that backward updates first (the
        last ones in forward order), as many as the ring holds, so the disk does those reads
        during forward instead of backward, and backward starts with them in memory.

        Without parameter reads in forward (parameter shards in memory) they all start at the
        forward's start, latest-in-forward first. When forward reads parameter shards from NVMe,
        each starts with the lead its parameter read would have had (``prefetch`` units ahead),
        so the parameter reads forward needs first are not queued behind them; with fp32 shards
        their gather then takes the parameters from this read (see :meth:`_params_from_state`),
        one parameter read less. A read starts only when a ring buffer is free without waiting
        for the disk; one not started here is retried at the next unit, or started by
        backward (:meth:`_prefetch_state`)."""
        order = self.scheduler.order
        ring = self.pools.get("optimizer_prefetch")
        if not order or ring is None:
            return
        reads_params = self._forward_reads_params
        at = -1 if unit is None else (order.index(unit) if unit in order else None)
        if at is None:
            return
        first = len(order) - min(ring.count, len(order))
        for j in reversed(range(first, len(order))):  # backward's order
            if reads_params and j - self.config.prefetch > at:
                continue  # not yet: its parameter read would not have started yet either
            if not self._read_ahead(order[j].flat_params):
                return  # no free buffer: the rest keep backward's order, tried later

    def _read_ahead(self, fps: List[FlatParam], in_backward: bool = False) -> bool:
        """Start whole-state reads (NVMe) of the trainable flat parameters in ``fps`` not yet
        read ahead, in order, while a read-ahead buffer is free without waiting for the disk
        (``in_backward``: freed from the newest write-back done, see
        :meth:`NVMeStore.prefetch`). Returns False at the first one that could not start (the
        caller stops there)."""
        return all(self.store.prefetched(fp)
                   or self.store.prefetch(fp, wait=False, newest_first=in_backward)
                   for fp in fps if fp.requires_grad)

    def _read_ahead_in_backward(self, unit: Unit) -> None:
        """step_in_forward: backward reached ``unit``. Start reading into the read-ahead ring
        the whole state of the first blocks in forward order (as many as the ring holds), whose
        updates the next forward applies first, each when backward is ``prefetch`` units (at
        least one) from it: its parameter read for backward would start then, and the gather
        takes the parameters from this read instead when fp32 shards on NVMe are their master's
        bytes (see :meth:`_params_from_state`). The reads run while backward computes; the
        states are not written before those updates, so they stay current. A read starts only
        when a buffer is free without waiting for the disk."""
        order = self.scheduler.order
        ring = self.pools.get("optimizer_prefetch")
        if not order or ring is None:
            return
        i = len(order) if unit.is_root else (order.index(unit) if unit in order else None)
        if i is None:
            return
        for j in reversed(range(max(0, i - max(1, self.config.prefetch)), min(i, ring.count))):
            if not self._read_ahead(order[j].flat_params, in_backward=True):
                return

    def _grad_ready(self, fp: FlatParam) -> None:
        """``fp``'s gradient is accumulated: reduce it to the shard and update ``fp`` now, or
        (NVMe state too large for the read-ahead ring) chunk by chunk from the hooks that follow,
        so its reads and writes overlap the rest of backward (see :meth:`_pump`)."""
        self.grads.on_full_grad(fp)
        if fp in self._early or not self.grads.has_grad[fp]:
            return
        known_finite = False
        if self.world_size > 1:
            # the flags now, right after the reduction, in the same order on every rank: an
            # update streamed later must issue no collective of its own (its chunks advance
            # from hooks that differ per rank), and a flat parameter no rank used is not
            # updated (see [Note: reduction order])
            bad, unused = self._grad_flags([fp])
            if fp in bad or fp in unused:
                self._early[fp] = fp in unused  # (inf/nan: skipped, an overflow of the step)
                self.grads.zero(only=[fp])
                return
            known_finite = True
        if isinstance(self.store, NVMeStore) and not self.store.prefetched(fp):
            skipped: set = set()
            # (the hyperparameters in force now, whatever changes them before it ends)
            update = self._iter_updates([fp], self._unscale(), known_finite, skipped,
                                        self._hypers())

            def done(fp=fp, skipped=skipped):
                self._early[fp] = fp not in skipped
                self.grads.zero(only=[fp])  # (its gradient is used up)

            self._deferred.append((fp, update, done))
            self._early[fp] = False  # until its last chunk is updated (see _pump)
            self._pump()
            return
        self._early[fp] = fp not in self._update_states([fp], self._unscale(), known_finite,
                                                         self._hypers())
        # its gradient is used up: where one rank's shards adopt the gradients, its memory
        # serves the next one (see [Note: reused gradient memory])
        self.grads.zero(only=[fp])

    def _unscale(self) -> float:
        """The factor that undoes the loss scale in the update: 1 / S (1.0 without scaling)."""
        return 1.0 if self.loss_scaler is None else 1.0 / self.loss_scaler.scale

    def _nonfinite_on_any_rank(self, fps: List[FlatParam]) -> set:
        """The flat parameters of ``fps`` whose gradient holds an inf or nan on any rank (see
        :meth:`_grad_flags`). Collective."""
        return self._grad_flags(fps)[0]

    def _grad_flags(self, fps: List[FlatParam]):
        """``(nonfinite, unused)``: the flat parameters of ``fps`` whose gradient holds an inf
        or nan on any rank, and those no rank's backward used (their gradients are the zeros
        of [Note: reduction order]). One all-reduce of a float per flat parameter (4 bytes
        each), so that every rank skips the same ones (each rank sees only its own gradient
        shard): ``used + (N + 1) * nonfinite`` summed over the N ranks, exact in fp32 for
        any N below 4096. Collective: every rank calls it with the same ``fps`` in the same
        order."""
        if not fps:
            return set(), set()
        used = (lambda fp: True) if self._reduction is None else self._reduction.used.__contains__
        base = self.world_size + 1
        flags = torch.tensor([float(used(fp)) + (0.0 if _all_finite(self.grads.buf[fp]) else base)
                              for fp in fps], dtype=torch.float32, device=self.device)
        flags = [int(f) for f in self.comm.all_reduce_sum(flags, what="inf/nan flags").tolist()]
        return ({fp for fp, f in zip(fps, flags) if f >= base},
                {fp for fp, f in zip(fps, flags) if f % base == 0})

    def _pump(self, all_of_them: bool = False) -> None:
        """Advance the oldest streaming update (``_deferred``: ``(flat param, generator of
        :meth:`_iter_updates`, f() run once it ends)``) by one chunk, or every one to its end
        with ``all_of_them``. The updates go one after the other: they share the store's
        pipeline buffers. Each chunk's read was started one chunk earlier, so a call rarely
        waits for the disk."""
        while self._deferred:
            fp, gen, done = self._deferred[0]
            try:
                next(gen)
                self._pace[0] += 1
                if not all_of_them:
                    return
            except StopIteration:
                self._deferred.pop(0)
                done()
            except BaseException:
                self._deferred.pop(0)
                raise

    def _finish_updates(self) -> None:
        """Finish every update started in backward and still streaming (step_in_backward), and
        apply those a step left for the next forward (step_in_forward): before the step, a
        forward or a read of the weights, so none sees half of one."""
        self._pump(all_of_them=True)
        self.apply_pending_updates()

    # -- step_in_forward ----------------------------------------------------------------------
    def _apply_lazy_for(self, unit: Unit) -> None:
        """``unit``'s parameters are about to be read (gathered or prefetched): apply its
        pending updates first, then start reading ahead the state of the units that follow.
        Their new shards on NVMe stay in their buffers for that read (and only theirs: a
        shard kept for no gather would hold a buffer of the pool until its unit ran again).

        When a training forward gathers the root, the pending update of its part used after
        the blocks (the LM head; see ``_after_blocks``) is not applied but started as a stream
        (:meth:`_pump`): the blocks' gathers advance it (:meth:`_pace_streams`), so its reads
        and writes run while the blocks compute, and the root gathers that part only when its
        first module runs (:meth:`_finish_streaming`)."""
        self._keep_for_gather.clear()
        self._keep_for_gather.update(unit.flat_params)
        stream = []
        if unit.is_root and self.scheduler.training_forward:
            stream = [fp for fp in unit.flat_params
                      if fp in self._after_blocks and fp in self._lazy and not self._streaming(fp)
                      and self.scheduler.may_gather_late(fp)]
        else:
            for fp in unit.flat_params:  # gathered now, not late: its update ends first
                self._finish_streaming(fp)
            self._pace_streams(unit)
        fps = [fp for fp in unit.flat_params
               if fp in self._lazy and not self._streaming(fp) and fp not in stream]
        if fps:
            self._apply_lazy(fps)
        coef, hypers = self._lazy_step
        if stream:
            self._pace = [0, sum(self.store.chunks(fp) for fp in stream)]
        for fp in stream:  # (after the others: they may stream through the same buffers)
            def done(fp=fp):
                self._applied(fp)

            self._deferred.append((fp, self._iter_updates([fp], coef, True, set(), hypers), done))

    def _pace_streams(self, unit: Unit) -> None:
        """Block ``unit`` is about to be gathered in forward: advance the streaming updates
        (:meth:`_pump`) so that by the gather of the k-th of n blocks in forward order, k/n of
        their chunks are done. Their reads and writes then spread over the blocks' compute, the
        last chunk updated by the last block's gather, instead of taking the disk from the
        first blocks' reads and leaving it idle under the last ones. A unit outside the recorded
        order advances them by one chunk."""
        if not self._deferred:
            return
        order = self.scheduler.order
        if unit not in order:
            self._pump()
            return
        target = -(-self._pace[1] * (order.index(unit) + 1) // len(order))
        while self._deferred and self._pace[0] < target:
            self._pump()

    def _streaming(self, fp: FlatParam) -> bool:
        """Whether ``fp``'s update is streaming (see :meth:`_pump`): it has begun or is queued,
        and has not ended."""
        return any(entry[0] is fp for entry in self._deferred)

    def _finish_streaming(self, fp: FlatParam) -> None:
        """``fp`` is about to be gathered: end its streaming update (and any queued before it)."""
        while self._streaming(fp):
            self._pump()

    @torch.no_grad()
    def _apply_lazy(self, fps: List[FlatParam]) -> None:
        """Apply the pending updates of ``fps`` (see ``step_in_forward``) and zero their
        gradients; the write-backs stay in flight. The whole states of the next pending block
        updates are read ahead (as many as the read-ahead buffers hold), so their reads overlap
        the compute that runs before them."""
        coef, hypers = self._lazy_step
        if self._deferred and isinstance(self.store, NVMeStore) and not all(
                self.store.prefetched(fp) for fp in fps):
            # these stream through the pipeline buffers too: the streaming update ends first
            self._pump(all_of_them=True)
        self._read_ahead_lazy([fp for fp in self._lazy if fp not in fps])
        for fp in fps:
            # one at a time, each forgotten only once applied: an error (an I/O error, a pool
            # exhausted) leaves the updates not yet made pending, with their gradients
            for _ in self._iter_updates([fp], coef, True, set(), hypers,
                                        defer_write_back=self._may_defer_write_back(fp)):
                pass
            self._applied(fp)
        self._read_ahead_lazy(list(self._lazy))

    def _applied(self, fp: FlatParam) -> None:
        """``fp``'s pending update is made: forget it and its gradient. After the last one no
        more state is read before the next backward: the deferred write-backs start (see
        :meth:`_may_defer_write_back`)."""
        del self._lazy[fp]
        self.grads.zero(only=[fp])
        if not self._lazy and isinstance(self.store, NVMeStore):
            self.store.start_deferred_writes()

    def _may_defer_write_back(self, fp: FlatParam) -> bool:
        """Whether the write-back of ``fp``'s pending update (its state read ahead whole) can
        wait until the pending updates are all made (:meth:`_applied`; in a model with an LM
        head, until its streamed update ends as the head is gathered, so the head's compute
        hides them). The forward's disk time then goes to the reads it waits for. It can when
        the read-ahead buffers not held by such writes, this one's aside, can hold the state of
        every later pending update the ring takes, so no read ever waits on a deferred write:
        with a ring of three, the last three blocks' writes.
        Their buffers then also serve backward's gathers of those blocks
        (:meth:`NVMeStore.master_view`), one parameter read less each."""
        store, ring = self.store, self.pools.get("optimizer_prefetch")
        if not isinstance(store, NVMeStore) or ring is None or not store.prefetched(fp) \
                or store.in_host(fp):
            return False
        later = sum(1 for f in self._lazy if f is not fp and not store.in_host(f)
                    and store.fits_ahead(f.shard_numel))
        return later <= ring.count - store.deferred_writes - 1

    def _read_ahead_lazy(self, order: List[FlatParam]) -> None:
        """Start whole-state reads of the first pending updates in ``order`` while a read-ahead
        buffer is free, without waiting for the disk (NVMe state only); a state larger than
        the buffers (an outsized root's) is left to the chunked stream of its update."""
        ring = self.pools.get("optimizer_prefetch")
        if ring is None:
            return
        self._read_ahead([fp for fp in order if self.store.fits_ahead(fp.shard_numel)])

    def apply_pending_updates(self) -> None:
        """Apply every update that :meth:`step` decided and ``step_in_forward`` left for the
        units' next gathers (no-op otherwise): before anything reads the weights or the
        optimizer state as a whole (checkpoints, :meth:`full_state_dict`, the next
        :meth:`step`), and by :meth:`backward` for units the last forward did not run.
        Raises SwapIOError if an NVMe transfer fails (file and offset named), RuntimeError if
        the engine is closed."""
        self._check_open()
        self._keep_for_gather.clear()
        self._pump(all_of_them=True)  # (a streaming update: its flat parameter leaves _lazy)
        if self._lazy:
            self._apply_lazy(list(self._lazy))

    def step(self) -> None:
        """Update every trainable flat parameter with Adam/AdamW, then zero the gradients;
        with ``gradient_accumulation_steps=N``, only every N-th call does (see
        :meth:`is_gradient_accumulation_boundary`): the others return at once, keeping the
        gradients accumulated so far.

        Runs as ``engine.optimizer.step()`` (so a torch LR scheduler counts it as an optimizer
        step). The hyperparameters are each parameter group's in ``engine.optimizer`` now.
        The update runs on this rank's shard: the C++ kernel for master weights on the host
        (or NVMe, streamed through host buffers), torch ops for master weights on an accelerator.
        New compute-dtype parameters are written back to the device shards (and all-gathered
        into the full parameters at stages 1 and 2). If a gradient holds inf/nan the update is
        skipped for that flat parameter, on every rank whichever rank's shard holds it
        (``skipped_steps`` counts such steps). With a loss scale (fp16) the gradients are
        divided by it in the same pass; an inf/nan anywhere then skips the whole step and a
        dynamic scale halves (``loss_scaler``). Raises ValueError naming a group's bad value
        (a negative lr, say), before anything changes.
        """
        self._check_open()
        self.optimizer.step()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` call updates the weights: with
        ``gradient_accumulation_steps=N``, every N-th call does (always True with N=1)."""
        return (self._micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    @torch.no_grad()
    def _step(self) -> None:
        """:meth:`step`'s work (``engine.optimizer.step()`` calls it): count the micro-batch,
        and at a gradient accumulation boundary update (:meth:`_update_step`)."""
        self._check_open()
        with self._together(Phase.STEP):
            boundary = self.is_gradient_accumulation_boundary()
            if not boundary:
                self.scheduler.reshard_all()  # (as the update does: the root may be gathered)
                self._micro_steps += 1
                self._micro_stepped = True
                return
            skipped = self.skipped_steps
            self._update_step(self._hypers())
            self._micro_steps += 1
            if self.lr_scheduler is not None and self.skipped_steps == skipped:
                self.lr_scheduler.step()

    def _update_step(self, hypers: tuple) -> None:
        """Update every trainable flat parameter with the parameter groups' ``hypers``
        (:meth:`_hypers`), then zero the gradients (see :meth:`step`)."""
        cfg = self.config
        self._exposure.before_step()  # writes to the model's parameters since the forward
        self.scheduler.reshard_all()  # a training forward without backward leaves the root gathered
        if self._reduction is not None:
            self._reduction.end_backward()  # (a backward whose end-of-backward callback did not run)
        self._finish_updates()  # (step_in_forward: a step without a forward since the last)
        if cfg.stage == 1:
            reduce_stage1(self.grads, self._grad_order, self.comm)
        coef = self._unscale()  # the gradients carry the loss scale (1.0 without one)
        known_finite = False
        # (with step_in_backward most flat parameters were updated in backward already)
        with_grad = [fp for fp in self.trainable if self.grads.has_grad[fp] and fp not in self._early]
        if cfg.max_grad_norm is not None:
            sq = self.comm.all_reduce_sum(self.grads.sum_of_squares().to(self.device),
                                         what="grad norm").item()
            norm = math.sqrt(sq) * coef
            self.last_grad_norm = norm
            if not math.isfinite(norm):  # inf/nan somewhere on some rank: skip the whole step
                self._skip_step()
                return
            coef *= min(1.0, cfg.max_grad_norm / (norm + 1e-6))
            known_finite = True  # the kernel can skip its own inf/nan pass over the gradients
        elif self.loss_scaler is not None and not cfg.step_in_backward:
            # an overflow skips the whole step (not only the flat parameters that hold it), on
            # every rank; the updates then skip the kernel's own inf/nan pass
            if self._nonfinite_on_any_rank(with_grad):
                self._skip_step()
                return
            known_finite = True
        if cfg.step_in_forward:
            self._defer_step(with_grad, coef, known_finite, hypers)
            return
        try:
            skipped = self._update_states(with_grad, coef, known_finite, hypers)
        finally:
            # every write-back done before the next forward reads parameters (an fp32 shard on
            # NVMe is read from its master's bytes): updates made in backward included
            try:
                self.store.release_prefetched()
            finally:
                self.store.drain()
                if self.param_home is not None:
                    self.param_home.drain()
        overflow = bool(skipped) or not all(self._early.values())
        if overflow:
            self.skipped_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self._early.clear()
        self._backward_pending = False
        if cfg.stage < 3:
            for fp in self.trainable:
                self.comm.all_gather_into(fp.full_values(), fp.sharded, what=fp.name)
        self.grads.zero()
        self.comm.end_step()

    def _defer_step(self, with_grad: List[FlatParam], coef: float, known_finite: bool,
                    hypers: tuple) -> None:
        """End a ``step_in_forward`` step: decide now which flat parameters update (those with
        an inf/nan gradient on any rank are skipped, as in the plain step, and counted in
        ``skipped_steps``), with this gradient factor and the groups' ``hypers``; the updates
        themselves run before each unit's next gather (:meth:`_apply_lazy`)."""
        skipped = set() if known_finite else self._nonfinite_on_any_rank(with_grad)
        # in the order the next forward needs them: the root's first (gathered as forward
        # starts), then the blocks' in the recorded forward order
        units = [self.root] + (self.scheduler.order or self.blocks)
        ready = dict.fromkeys(fp for fp in with_grad if fp not in skipped)
        self._lazy = dict.fromkeys(fp for u in units for fp in u.flat_params if fp in ready)
        self._lazy.update(ready)  # (any the forward order does not hold, after it)
        self._lazy_step = (coef, hypers)
        if skipped:
            self.skipped_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(bool(skipped))
        self._backward_pending = False
        self.grads.zero(keep=self._lazy)
        self.comm.end_step()
        self._read_ahead_lazy(list(self._lazy))

    def _skip_step(self) -> None:
        """End a step that updates nothing (an inf/nan gradient on some rank): drop the
        gradients, count it in ``skipped_steps`` and halve a dynamic loss scale."""
        self.skipped_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(True)
        self.grads.zero()
        self.comm.end_step()
        self._backward_pending = False

    def _update_states(self, fps: List[FlatParam], coef: float, known_finite: bool,
                       hypers: tuple) -> set:
        """Adam/AdamW on every flat parameter in ``fps`` (their gradients final) with the
        groups' ``hypers``; returns the set skipped for inf/nan gradients. State read ahead
        (:meth:`NVMeStore.prefetch`) is written back asynchronously; the step drains it."""
        skipped: set = set()
        for _ in self._iter_updates(fps, coef, known_finite, skipped, hypers):
            pass
        return skipped

    def _iter_updates(self, fps: List[FlatParam], coef: float, known_finite: bool,
                      skipped: set, hypers: tuple, defer_write_back: bool = False
                      ) -> Iterator[None]:
        """:meth:`_update_states` as a generator that yields after each chunk, with the groups'
        ``hypers`` (a :class:`GroupHyper` per group) throughout; flat parameters skipped for
        inf/nan gradients are added to ``skipped``. With several ranks, collective (see
        :meth:`_nonfinite_on_any_rank`). ``defer_write_back``: see
        :meth:`NVMeStore.iter_states`."""
        if not known_finite and self.world_size > 1:
            # every rank skips the same flat parameters, whichever rank's shard holds the inf/nan
            bad, unused = self._grad_flags(fps)
            skipped |= bad
            fps = [fp for fp in fps if fp not in bad and fp not in unused]
            known_finite = True
        try:
            # the store yields each flat parameter's state whole, or (NVMe) in chunks
            for fp, lo, hi, master, m, v in self.store.iter_states(
                    fps, defer_write_back=defer_write_back):
                whole = lo == 0 and hi == fp.shard_numel
                if lo == 0:
                    if not (known_finite or whole) and not _all_finite(self.grads.buf[fp]):
                        skipped.add(fp)  # chunked: check before the first chunk is written
                    else:
                        if fp.home is not None:
                            # a read of the shard left unused (a backward cut short by an
                            # error) is stale once the update writes: drop it
                            fp.home.done_with(fp)
                        self._targets[fp] = self._update_target(fp)
                        # (counted once a target is found: an error there leaves the count)
                        self._step_count[fp] += 1
                if fp in skipped:
                    continue
                ok = self._update(fp, lo, hi, master, m, v, coef, hypers,
                                  check_overflow=whole and not known_finite)
                if not ok:
                    skipped.add(fp)
                if hi == fp.shard_numel:
                    self._finish_update(fp, ok)
                yield
        finally:
            for fp in fps:
                self._targets.pop(fp, None)

    def _update_target(self, fp: FlatParam) -> Optional[torch.Tensor]:
        """Where the kernel writes ``fp``'s new compute-dtype shard in the same pass as the
        update: the shard itself, a host buffer of its home, or the staging buffer; None when the
        fp32 master is the shard."""
        if fp.home is not None:
            return fp.home.update_target(fp)
        if self.store.aliases(fp):
            return None  # the master is the shard: updated in place
        if self.config.optimizer_tier is Tier.DEVICE and self.device.type != "cpu":
            return None  # torch ops on the accelerator; copied from the master afterwards
        if fp.sharded.device.type == "cpu":
            return fp.sharded
        return self._staging[:fp.shard_numel]

    def _update(self, fp: FlatParam, lo: int, hi: int, master, m, v, coef: float,
                hypers: tuple, check_overflow: bool) -> bool:
        """Adam/AdamW on elements [lo, hi) of ``fp``'s shard, each run of one parameter group
        with that group's ``hypers`` (see [Note: parameter groups] in
        :mod:`offload_zero.optim.facade`); returns False on overflow (nothing then changed)."""
        grad = self.grads.buf[fp][lo:hi]
        runs = [(max(a, lo) - lo, min(b, hi) - lo, hypers[g])
                for a, b, g in self._segments[fp] if a < hi and b > lo]
        if len(runs) > 1 and check_overflow:
            # one check before any run is written: an inf/nan in a later run changes nothing
            if not _all_finite(grad):
                self._step_count[fp] -= 1
                return False
            check_overflow = False
        if master.device.type == "cpu":
            out = self._targets[fp]
            out = None if out is None else out[lo:hi]
            # (bf16 moments: rounding keyed by the element's place in the flat parameter, the
            # same however the update is cut into chunks and at any world size)
            base = self.rank * fp.shard_numel + lo  # (the chunk's place in the flat parameter)
            if m.dtype == torch.uint8:  # int8 moments: whole 256-element blocks, one call
                overflow = self._adam_cpu_int8(fp, lo, hi, master, grad, m, v, runs, coef, out,
                                               check_overflow, base)
            else:
                overflow = any([self._adam_cpu(fp, master[a:b], grad[a:b], m[a:b], v[a:b], hp,
                                               coef, None if out is None else out[a:b],
                                               check_overflow, key)
                                for r0, r1, hp in runs for a, b, key in _sr_pieces(r0, r1, base)])
            if (not overflow and out is not None and fp.home is None
                    and out.data_ptr() != fp.sharded[lo:hi].data_ptr()):
                # staging buffer -> accelerator shard, chunk by chunk: the buffer is free again
                # before another update (interleaved with this one in backward) writes to it
                fp.sharded[lo:hi].copy_(out)
        else:
            cfg = self.config
            overflow = any([_torch_adam_(master[a:b], grad[a:b], m[a:b], v[a:b],
                                         self._step_count[fp], hp.lr, hp.betas, hp.eps,
                                         hp.weight_decay, cfg.adamw, coef) for a, b, hp in runs])
            if not overflow and master.data_ptr() != fp.sharded.data_ptr():
                fp.sharded[lo:hi].copy_(master)
        if overflow:
            self._step_count[fp] -= 1
        return not overflow

    def _adam_cpu(self, fp: FlatParam, master, grad, m, v, hp, coef: float, out,
                  check_overflow: bool, offset: int) -> bool:
        """The C++ Adam on one run of ``fp``'s shard (1-d fp32 views of equal length; bf16
        moments for ``moment_dtype="bf16"``) with the group's ``hp``; ``offset``: the run's first
        element's index in the whole flat parameter (the stochastic rounding's position key);
        returns True on overflow (see :func:`offload_zero.optim.adam_step_`)."""
        from offload_zero.optim.kernel import adam_step_
        return adam_step_(master, grad, m, v, step=self._step_count[fp], lr=hp.lr,
                          betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
                          adamw=self.config.adamw, grad_scale=coef, out=out,
                          check_overflow=check_overflow, sr_seed=_sr_seed(fp), sr_offset=offset)

    def _adam_cpu_int8(self, fp: FlatParam, lo: int, hi: int, master, grad, m, v, runs,
                       coef: float, out, check_overflow: bool, base: int) -> bool:
        """The C++ Adam on elements [lo, hi) of ``fp``'s shard with int8 moments (uint8 codes
        ``m``, ``v`` and the store's scales; ``lo`` a multiple of 256) and the runs of each
        parameter group (a block two groups share is updated as one: see
        :func:`offload_zero.optim.int8_moments.adam_step_runs_`); ``base``: element ``lo``'s
        place in the whole flat parameter. Returns True on overflow."""
        from offload_zero.optim.int8_moments import BLOCK_NUMEL, adam_step_runs_
        scales = self.store.scales(fp)[:, lo // BLOCK_NUMEL:-(-hi // BLOCK_NUMEL)]
        return adam_step_runs_(master, grad, m, v, scales[0], scales[1], runs,
                               step=self._step_count[fp], adamw=self.config.adamw,
                               grad_scale=coef, out=out, check_overflow=check_overflow,
                               sr_seed=_sr_seed(fp), sr_offset=base)

    def _finish_update(self, fp: FlatParam, ok: bool) -> None:
        """After the last chunk: write the new compute-dtype shard back to an NVMe home (an
        accelerator shard got each chunk from the staging buffer in :meth:`_update`)."""
        target = self._targets.pop(fp, None)
        if fp.home is not None:
            fp.home.commit(fp, target) if ok else fp.home.discard(fp)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group of ``engine.optimizer`` (for
        schedules; a torch LR scheduler on ``engine.optimizer`` does the same per group). It
        applies from the next update decided: the next :meth:`step`, or with
        ``step_in_backward`` the next backward (an update still streaming after a backward
        keeps that backward's rate). lr >= 0 (0 updates the moments, not the weights); raises
        ValueError naming the value otherwise (negative, nan, inf), and RuntimeError if the
        engine is closed. A numpy number or 0-d tensor is taken as a float."""
        self._check_open()
        lr = check_number("lr", lr, low=0.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group of ``engine.optimizer`` (every
        group's, unless groups or a scheduler set them apart)."""
        return self.optimizer.param_groups[0]["lr"]

    def train(self, mode: bool = True) -> "OffloadEngine":
        """Put the model in training mode (``mode=False``: evaluation)."""
        self.module.train(mode)
        return self

    def eval(self) -> "OffloadEngine":
        """Put the model in evaluation mode."""
        return self.train(False)

    # -- reports and state ---------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes held per tier, now and at peak, by state kind; and live units.

        Returns ``{"device"|"host"|"nvme": {"current_bytes", "peak_bytes", "by_kind": {...}},
        "live_units": {"current", "peak"}, "pools": {name: {"buffers", "buffer_bytes",
        "capacity_bytes", ...}}}``; ``"nvme"`` also has ``"read_bytes"`` and ``"written_bytes"``
        (cumulative bytes moved through the swapper), ``"state_read_bytes"`` and
        ``"state_written_bytes"`` (the optimizer state's part of them, counted as each transfer
        starts); with the optimizer state on NVMe,
        ``"host_cache"`` gives its split between host memory and files (see
        :meth:`offload_zero.memory.tiers.NVMeStore.cache_report`). ``"pools"``
        lists the fixed buffers sized at start-up, each with its ``"tier"`` (the device gather
        pool for unsharded units, parameter-shard read-ahead, the NVMe optimizer pipeline, the
        host staging buffer, the reduce-scatter scratch): exactly :attr:`memory_plan`'s pools
        (see :mod:`offload_zero.plan`). Units: bytes.
        """
        rep = self._acct.report()
        rep["nvme"]["read_bytes"] = getattr(self.store, "read_bytes", 0)
        rep["nvme"]["written_bytes"] = getattr(self.store, "written_bytes", 0)
        rep["nvme"]["state_read_bytes"] = getattr(self.store, "state_read_bytes", 0)
        rep["nvme"]["state_written_bytes"] = getattr(self.store, "state_written_bytes", 0)
        rep["live_units"] = {"current": self.scheduler.live_units(), "peak": self.scheduler.live_peak}
        rep["pools"] = self._pools_report()
        if isinstance(self.store, NVMeStore):
            rep["host_cache"] = self.store.cache_report()
        return rep

    def _pools_report(self) -> dict:
        """``memory_report()["pools"]``: every fixed buffer set, with its tier."""
        pools = {name: {"tier": "device" if isinstance(pool, GatherPool) else "host",
                        **pool.report()} for name, pool in self.pools.items()}
        if isinstance(self.store, NVMeStore):
            pools["optimizer_pipeline"] = {"tier": "host", **self.store.pool_report()}
        for name, tier, buf in (("staging", "host", self._staging),
                                ("reduce_scratch", "device", self.grads.scratch)):
            if buf is not None:
                nbytes = buf.numel() * buf.element_size()
                pools[name] = {"tier": tier, "buffers": 1, "buffer_bytes": nbytes,
                               "capacity_bytes": nbytes}
        return pools

    def _check_pools(self) -> None:
        """Raise RuntimeError (rank-prefixed, an internal error) unless the pools built are
        exactly the memory plan's: names, tiers, counts and bytes."""
        keys = ("tier", "buffers", "buffer_bytes", "capacity_bytes")
        built = {name: {k: rep[k] for k in keys} for name, rep in self._pools_report().items()}
        planned = self.memory_plan.pools_report()
        if built != planned:
            raise RuntimeError(f"rank {self.rank}: internal error: the pools built {built} "
                               f"differ from the memory plan's {planned}")

    def comm_report(self) -> dict:
        """Bytes this rank moved per collective kind, for the last step and in total (ring
        accounting; see :mod:`offload_zero.comm`)."""
        return self.comm.report()

    def full_state_dict(self, rank0_only: bool = False) -> Dict[str, torch.Tensor]:
        """Every parameter as a full fp32 CPU tensor under the model's own names, plus the
        persistent buffers: what ``model.state_dict()`` has, so a fresh model loads it strictly.
        It materialises the whole model in host memory (4 bytes per parameter); for a model
        larger than RAM use :meth:`iter_full_parameters` or :meth:`save_pretrained`.

        Trainable parameters come from the fp32 master weights (all-gathered over ranks);
        frozen ones from the compute-dtype shards. A tied parameter appears under each of its
        names. With ``rank0_only`` other ranks return ``{}`` (they still take part in the
        gathers). Shapes: the original parameter shapes.
        """
        self._check_open()
        with self._together(Phase.EXPORT):
            return self._full_state_dict(rank0_only)

    def _full_state_dict(self, rank0_only: bool) -> Dict[str, torch.Tensor]:
        from offload_zero.hf_export import iter_full_parameters
        self._exposure.take_outside_writes()
        out: Dict[str, torch.Tensor] = dict(iter_full_parameters(self, buffers=False))
        # persistent buffers (and any extra state), as the model's own state_dict() has them
        with self._exposure.exporting():
            own = self.module.state_dict()
        for name, buf in own.items():
            if name not in out:
                out[name] = buf.detach().cpu().clone() if isinstance(buf, torch.Tensor) else buf
        if rank0_only and self.rank != 0:
            return {}
        return out

    def iter_full_parameters(self, dtype: Optional[torch.dtype] = None
                             ) -> Iterator[tuple]:
        """Yield ``(name, tensor)`` for every parameter name, then every persistent buffer,
        gathering one flat parameter at a time: host memory holds one flat parameter's fp32
        values (``padded_numel`` elements) and the tensors yielded from it, not the model.

        Tensors are full CPU tensors of the original shapes: trainable parameters from the
        fp32 master weights, frozen ones from the compute-dtype shards, as fp32 or cast to
        ``dtype`` (floating buffers too). A tied parameter comes under each of its names as
        one tensor object. Collective: every rank must run the iterator to its end (each gets
        every tensor)."""
        self._check_open()
        from offload_zero.hf_export import iter_full_parameters
        with self._together(Phase.EXPORT):
            yield from iter_full_parameters(self, dtype)

    def save_pretrained(self, folder, dtype: Optional[torch.dtype] = None,
                        max_shard_size="5GB", tokenizer=None) -> dict:
        """Write the model as a Hugging Face checkpoint folder that ``from_pretrained`` loads:
        safetensors shards of at most ``max_shard_size`` (bytes, or ``"5GB"``/``"500MiB"``)
        named as transformers names them (``model.safetensors`` when one is enough, else
        ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``), weights in
        ``dtype`` (float32, bfloat16, float16; default None: the compute dtype, the dtype
        ``model.save_pretrained`` writes too), plus ``config.json`` (its ``dtype`` set to
        ``dtype``), ``generation_config.json`` and ``tokenizer``'s files when given. A tied
        parameter is written once, under the name transformers keeps.

        Streamed (see [Note: streamed export] in :mod:`offload_zero.hf_export`): gathered one
        flat parameter at a time across ranks and written by rank 0, so host memory holds
        about one unit. Atomic: the folder is written as a hidden sibling and swapped in; a
        failed export leaves an earlier folder intact. Collective. Returns ``{"dir",
        "weights" (the index or single file), "weights_bytes", "tensors", "shards",
        "dropped_tied", "files"}`` (other ranks list the weight files only). Raises ValueError
        for a bad ``dtype`` or size, or a
        ``folder`` holding files an export does not write; the write's own error (OSError)
        on rank 0, a RuntimeError naming rank 0 on the others."""
        self._check_open()
        from offload_zero.hf_export import save_pretrained
        with self._together(Phase.EXPORT):
            return save_pretrained(self, folder, dtype=dtype, max_shard_size=max_shard_size,
                                   tokenizer=tokenizer)

    def save_checkpoint(self, folder, client_state: Optional[dict] = None) -> None:
        """Save the training state to resume from: every rank writes its shard (fp32 master
        weights, Adam moments and step counts, the parameter shards) to ``folder`` as
        ``rank<r>.safetensors``, and rank 0 writes ``checkpoint.json`` (the parameter groups'
        values, skipped_steps, the loss scaler's state, the layout). Atomic: a failed save
        leaves a previous checkpoint in ``folder`` intact. ``client_state``: a JSON-ready dict
        of your own (a step counter, a data position) that :meth:`load_checkpoint` returns on
        every rank; it is saved from rank 0 only (the other ranks' is ignored). Collective;
        call it between steps. Layout, dtypes and errors:
        :func:`offload_zero.checkpoint.save_checkpoint`."""
        from offload_zero.checkpoint import save_checkpoint
        self._check_open()
        with self._together(Phase.CHECKPOINT):
            self._exposure.take_outside_writes()
            save_checkpoint(self, folder, client_state)

    def load_checkpoint(self, folder) -> dict:
        """Restore the state :meth:`save_checkpoint` wrote to ``folder`` (same model and
        parameter groups; the world size, stage, compute dtype and offload tiers may differ),
        including the groups' values (lr, betas, ...), skipped_steps and the loss scaler;
        returns the ``client_state`` saved with it (``{}`` if none). Collective; call it
        between steps. Raises ValueError naming the mismatched field or the bad file:
        :func:`offload_zero.checkpoint.load_checkpoint`."""
        from offload_zero.checkpoint import load_checkpoint
        with self._together(Phase.CHECKPOINT):
            out = load_checkpoint(self, folder)
        self._exposure.record_versions()  # (the loaded values are the engine's own)
        return out

    # -- lifetime ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"[rank {self.rank}] this OffloadEngine is closed")

    @contextlib.contextmanager
    def _together(self, phase: Phase) -> Iterator[None]:
        """The body's collectives carry ``phase`` in their lockstep fingerprints, and an error
        in it is recorded for the other ranks, which stop waiting for this one (see [Note:
        lockstep])."""
        with self.comm.phase(phase):
            try:
                yield
            except BaseException as exc:
                self.comm.report_failure(exc)
                raise

    def close(self) -> None:
        """Release buffers, remove swap files and hooks; idempotent. Also runs on garbage
        collection, at interpreter exit, and when leaving a ``with`` block (also on error).

        The model's weights live in the engine: take them with :meth:`full_state_dict` first;
        afterwards the wrapped model has no parameters left."""
        if self._closed:
            return
        self._closed = True
        try:
            self._exposure.remove()
            while self._deferred:  # updates cut short by an error: end their I/O first
                self._deferred.pop(0)[1].close()
        except BaseException as exc:
            self.comm.report_failure(exc)
            raise
        finally:
            try:
                self._finalizer()
            except BaseException as exc:
                self.comm.report_failure(exc)
                raise

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close the engine. When the block raised, an error in closing is logged instead of
        raised, so the block's own exception (a Ctrl-C, say) is what the caller sees."""
        if exc is None:
            self.close()
            return
        with _not_replacing(exc, self.rank):
            self.close()

    # -- state for checkpoints ---------------------------------------------------------------
    # What offload_zero/checkpoint/ reads and writes beside the public attributes (flat_params,
    # store, param_home, scheduler, comm, optimizer, module, config, skipped_steps,
    # loss_scaler), so that it uses no private attribute of the engine.
    def settle_between_steps(self, what: str) -> None:
        """Bring the engine to a point between steps for ``what`` (``"save_checkpoint"``,
        ``"load_checkpoint"``): finish every update still streaming (step_in_backward), apply
        those left for the next forward (step_in_forward), and reshard every gathered unit,
        so the shards and optimizer state hold a completed step's values.

        Raises RuntimeError (naming the rank) if the engine is closed, or if gradients of a
        ``backward()`` wait for ``step()`` (nothing is changed then); SwapIOError if an NVMe
        transfer fails."""
        self._check_open()
        if self._backward_pending:
            raise RuntimeError(
                f"[rank {self.rank}] {what} must run between steps, but gradients of a "
                "backward() are waiting for step(): call step() (or zero_grad() to drop them) "
                "first")
        self._finish_updates()
        self.scheduler.reshard_all()

    @property
    def step_counts(self) -> Dict[FlatParam, int]:
        """Each trainable flat parameter's Adam step count (the ``t`` of the bias corrections,
        an int >= 0), the engine's own dict: a checkpoint load writes the saved counts into
        it, between steps."""
        return self._step_count

    @property
    def entry_groups(self) -> Dict[FlatParam, List[int]]:
        """Each trainable flat parameter's list of parameter-group indices into
        ``optimizer.param_groups``, one per entry (model parameter) in layout order (see
        [Note: parameter groups] in :mod:`offload_zero.optim.facade`). Read only."""
        return self._entry_groups


_WRAPPED = "_offload_zero_wrapped"  # set on a model an engine has taken the parameters of


def _exit_on_sigterm() -> None:
    """Make SIGTERM (torchrun stopping the other workers, Slurm, ``docker stop``) end the
    process as ``sys.exit(143)`` instead of at once, so ``with`` blocks, ``close()`` and the
    engines' finalizers run and the swap files go (tens of GB on a disk that the next run
    would otherwise refuse). Only where SIGTERM still has its default action, from the main
    thread, once per process: a handler of the program's own is left as it is."""
    import signal
    import threading
    try:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            signal.signal(signal.SIGTERM, _sigterm_exit)
    except (ValueError, OSError):  # (no signals here: an embedded interpreter, say)
        pass


def _sigterm_exit(signum, frame):
    raise SystemExit(128 + signum)


def _sr_pieces(a: int, b: int, base: int) -> List[tuple]:
    """Elements ``[a, b)`` of a chunk whose element 0 is element ``base`` of its flat
    parameter, as ``(lo, hi, sr_offset)`` calls of the kernel, whose stochastic rounding (bf16
    moments) counts from a multiple of 64: an unaligned start (a parameter group's boundary)
    gives a head of fewer than 64 elements keyed from the 64-element block holding it, and the
    rest is keyed by its own place. Group boundaries and the chunks' (multiples of 64) sit at
    fixed places in the flat parameter, so the rounding is the same however the update is
    chunked and at any world size."""
    g = base + a
    cut = min(b, a + (-g) % 64)
    pieces = [(a, cut, g - g % 64)] if cut > a else []
    if cut < b:
        pieces.append((cut, b, base + cut))
    return pieces


def _collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the ranks fell out of step (another rank failed, or they were at
    different collectives): no further collective can be run then."""
    from offload_zero.lockstep import CollectiveMismatch, PeerFailure
    return isinstance(exc, (CollectiveMismatch, PeerFailure))


def _weakly(method):
    """``method`` (bound to the engine) as a function that holds the engine weakly, for the
    parts the engine's finalizer keeps alive: a strong reference there would keep the engine
    from ever being collected. Once the engine is gone it does nothing and returns None."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    call.__name__ = call.__qualname__ = method.__name__
    return call


@contextlib.contextmanager
def _not_replacing(exc: BaseException, rank: int, doing: str = "releasing the engine"):
    """A clean-up run while ``exc`` (a Ctrl-C, a SIGTERM, the caller's own error) propagates:
    an error of the clean-up is logged as a warning instead of raised, so ``exc`` is what the
    caller sees."""
    try:
        yield
    except Exception as cleanup_exc:  # noqa: BLE001 - the exception in flight goes first
        log.warning("[rank %d] %s after %s raised %s: %s", rank, doing, type(exc).__name__,
                    type(cleanup_exc).__name__, cleanup_exc)


def _release(acct, store, param_home, swapper, pools, scheduler, grads, flat_params) -> None:
    """Close the engine's resources; swap files go first: they must not outlive the process.

    Any of them may be None (a constructor that failed half-way). Every part is closed even if
    an earlier one raises (an interrupt can leave any bookkeeping half updated); the first
    error is raised once all have run."""
    acct.closing()
    parts = [part.close for part in (store, param_home) if part is not None]
    if swapper is not None:
        parts.append(swapper.close)
    if scheduler is not None:
        parts.append(scheduler.remove_hooks)
    if grads is not None:
        parts.append(grads.release)
    parts += [fp.release for fp in flat_params] + [pool.close for pool in pools.values()]
    first = None
    for close in parts:
        try:
            close()
        except BaseException as exc:  # noqa: BLE001 - the rest must still be closed
            first = first or exc
    if first is not None:
        raise first


def _flat_param_names(planned) -> List[str]:
    """The name of each flat parameter of ``planned`` (``(unit, trainable, members)``, in
    construction order): ``unit<i>.trainable``/``.frozen``, ``root.…``; the root's trainable
    parameters split by gradient order are ``root.trainable``, ``root.trainable.1``, ...
    (the embeddings' part last)."""
    names, taken = [], {}
    for unit, trainable, _ in planned:
        tag = "root" if unit.is_root else f"unit{unit.index}"
        name = f"{tag}.{'trainable' if trainable else 'frozen'}"
        taken[name] = taken.get(name, 0) + 1
        names.append(name if taken[name] == 1 else f"{name}.{taken[name] - 1}")
    return names


def _checkpoint_forward(module: nn.Module, offload_to_host: bool) -> None:
    """Recompute ``module``'s forward in backward (non-reentrant torch checkpointing).

    Only the block's inputs are kept; its activations are recomputed when backward reaches it.
    The engine's hooks around the block still run in forward, and the recomputation runs after
    the block's pre-backward hook has gathered its parameters again. With ``offload_to_host`` the
    kept inputs wait in pinned host memory (``save_on_cpu``). Sets an instance attribute
    ``forward`` on this module only; nothing global is patched.
    """
    import contextlib

    from torch.utils.checkpoint import checkpoint
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        ctx = (torch.autograd.graph.save_on_cpu(pin_memory=True) if offload_to_host
               else contextlib.nullcontext())
        with ctx:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def _sr_seed(fp: FlatParam) -> int:
    """The stochastic-rounding seed of ``fp``'s bf16 moments: a CRC-32 of its name, the same
    in every run and on every rank."""
    return zlib.crc32(fp.name.encode())


def _flat_shard_fp32(fp: FlatParam, values: List[torch.Tensor]) -> torch.Tensor:
    """This rank's slice of the padded flat layout of ``values`` in fp32, shape (shard_numel,)."""
    lo, hi = fp.rank * fp.shard_numel, (fp.rank + 1) * fp.shard_numel
    shard = torch.zeros(fp.shard_numel, dtype=torch.float32)
    for e, v in zip(fp.entries, values):
        a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
        if a < b:
            shard[a - lo:b - lo].copy_(v.reshape(-1)[a - e.offset:b - e.offset].float())
    return shard


def _all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Whether every element of ``t`` is finite.

    One sum first (a memory-speed pass, ~20x faster than ``isfinite`` on a CPU): an inf or nan
    anywhere makes the sum inf or nan. Only finite values whose sum overflows give a non-finite
    sum with every element finite, so that case alone is checked element by element, in chunks
    of ``chunk`` elements so the temporary stays small.
    """
    if math.isfinite(float(t.sum())):
        return True
    for i in range(0, t.numel(), chunk):
        if not bool(torch.isfinite(t[i:i + chunk]).all()):
            return False
    return True


def _torch_adam_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, adamw,
                 grad_scale) -> bool:
    """Adam/AdamW on accelerator tensors with torch's single-tensor semantics; returns overflow."""
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if not torch.isfinite(g).all():
        return True
    beta1, beta2 = betas
    if weight_decay:
        if adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    return False


def _to_device(obj, device, dtype):
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != dtype:
            return obj.to(device=device, dtype=dtype)
        return obj.to(device) if obj.device != device else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device, dtype) for k, v in obj.items()}
    return obj


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} (requires_grad={x.requires_grad})"
    return repr(type(x).__name__)
