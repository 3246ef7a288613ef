"""Building an engine's parts from the model and the resolved settings: units and flat
parameters, the optimizer-state store, the parameter-shard home, the fixed pools, the gradient
shards, the update timings and the unit scheduler.

:func:`build_parts` fills an :class:`EngineParts` as it goes, so that a build that fails half
way leaves what it allocated where the caller releases it
(:func:`offload_zero.lifetime.release`). Nothing here knows the engine: the parts it builds are
given what they work on.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List

import torch
import torch.nn as nn

from offload_zero.config import EngineConfig, Tier, warn_user
from offload_zero.lifetime import exit_on_sigterm
from offload_zero.memory.accounting import StateKind, TierAccountant
from offload_zero.memory.host_cache import REPORT_KEYS
from offload_zero.memory.param_homes import HostParamHome, NVMeParamHome
from offload_zero.memory.pool import GatherPool, HostBufferPool, storage_rebinding_supported
from offload_zero.memory.state_stores import DeviceStore, HostStore, NVMeStore
from offload_zero.partition.flat_param import FlatParam, build_entries, shard_numel_for
from offload_zero.partition.grads import GradientShards
from offload_zero.partition.reduce_order import OrderedReduction, grad_order
from offload_zero.partition.schedule import UnitScheduler, runs_itself
from offload_zero.partition.units import Unit, plan_flat_params
from offload_zero.host_budget import fit_host_budget, host_budget_report
from offload_zero.plan import (layout_of, pipeline_chunk_numel, pipeline_shard_numel,
                               settings_of)
from offload_zero.update.adam import ShardAdam
from offload_zero.update.rules import BACKWARD, NEXT_FORWARD
from offload_zero.update.state import UpdateStates
from offload_zero.update.timings import UpdateTimings

log = logging.getLogger("offload_zero")


class EngineParts:
    """What :func:`build_parts` builds (every field None, or empty, until built).

    Fields: ``plan`` (``(blocks, root, [(unit, trainable, members)], users)``),
    ``memory_plan`` (the :class:`offload_zero.plan.MemoryPlan` every byte below comes from:
    the engine allocates exactly its pools), ``config`` (the :class:`EngineConfig` the parts
    were built with: the one given, or its copy with the ``update_timing`` and ``prefetch`` a
    host budget lowered, see :meth:`EngineConfig.lowered`), ``tail`` (the
    name of the flat parameter ``tail_state_in_host`` keeps, or None), ``in_host`` (names of
    flat parameters whose NVMe-placed state stays in host memory), ``params_in_host`` (names
    of frozen flat parameters whose shard the host cache keeps), ``swapper``, ``param_home``,
    ``pools`` (``{name: HostBufferPool | GatherPool}``), ``store``, ``blocks``, ``root``,
    ``units``, ``flat_params``, ``trainable``, ``grad_order``, ``grads``, ``staging``,
    ``reduction``, ``updates`` (:class:`UpdateTimings`), ``adam`` (:class:`ShardAdam`),
    ``scheduler``; ``step_count`` and ``segments`` (filled by the optimizer's build).
    """

    def __init__(self):
        self.plan = self.memory_plan = self.tail = self.config = None
        self.swapper = self.param_home = self.store = None
        self.blocks = self.root = self.grads = self.staging = self.reduction = None
        self.updates = self.adam = self.scheduler = self.grad_order = None
        self.in_host: set = set()
        self.params_in_host: set = set()
        self.pools: Dict[str, object] = {}
        self.units: List[Unit] = []
        self.flat_params: List[FlatParam] = []
        self.trainable: List[FlatParam] = []
        self.step_count: Dict[FlatParam, int] = {}
        self.segments: Dict[FlatParam, List[tuple]] = {}


def build_parts(parts: EngineParts, model: nn.Module, cfg: EngineConfig, comm,
                acct: TierAccountant, host_alloc, initial, states: UpdateStates,
                loss_scaler) -> None:
    """Build every part of an engine over ``model`` into ``parts``.

    ``cfg``: the resolved config; ``comm``: the communicator (rank, world size); ``acct``: the
    byte accounting; ``host_alloc(numel, dtype)``: aligned (pinned) host tensors; ``initial``:
    None (the model's own values) or the streamed initial values of ``load_from``/``init``;
    ``states``: the update-state owner; ``loss_scaler``: None or the fp16 scaler. Raises
    ValueError for a model without parameters to train; any allocation's error.
    """
    _Builder(parts, cfg, comm, acct, host_alloc, initial, states, loss_scaler).build(model)


class _Builder:
    def __init__(self, parts, cfg, comm, acct, host_alloc, initial, states, loss_scaler):
        self.parts, self.cfg, self.comm, self.acct = parts, cfg, comm, acct
        self.host_alloc, self.initial, self.states = host_alloc, initial, states
        self.loss_scaler = loss_scaler
        self.rank, self.world_size = comm.rank, comm.world_size
        self.device = cfg.device

    def build(self, model: nn.Module) -> None:
        cfg, p = self.cfg, self.parts
        plan = p.plan = self._plan_units(model)
        if not any(members for _, _, members in plan[2]):
            raise ValueError("model has no parameters to train")
        # every byte held below, pools included, comes from this plan (see offload_zero/plan.py),
        # within max_host_bytes when given (buffers shrink to fit: see fit_host_budget)
        p.memory_plan = fit_host_budget(
            layout_of([(-1 if u.is_root else u.index, t, m) for u, t, m in plan[2]]),
            settings_of(cfg, self.world_size, self.device, storage_rebinding_supported()))
        # every part below runs the timing and prefetch the plan settled on
        cfg = self.cfg = p.config = cfg.lowered(p.memory_plan.settings.update_timing,
                                                p.memory_plan.settings.prefetch)
        self.device = cfg.device
        # names of the flat parameters whose optimizer state stays in RAM (see [Note: host cache])
        p.tail, p.in_host = self._state_in_host(plan)
        if "nvme" in (cfg.offload_optimizer, cfg.offload_param):
            from offload_zero.memory.swapper import Swapper
            exit_on_sigterm()
            p.swapper = Swapper(os.path.join(os.fspath(cfg.path), f"rank{self.rank}"),
                                backend=cfg.aio_backend, block_size=cfg.aio_block_size,
                                queue_depth=cfg.aio_queue_depth, claim=True)
        self._build_param_home(plan)
        p.store = self._build_store()
        for name in p.in_host:
            p.store.keep_in_host(name)
        if p.tail is None and cfg.tail_state_in_host:
            warn_user("tail_state_in_host=True has no effect: it needs update_timing="
                      "'backward' or 'next_forward', "
                      f"the optimizer state on NVMe (it is on {cfg.offload_optimizer!r}) "
                      "and trainable root parameters")
        if isinstance(p.param_home, NVMeParamHome) and p.param_home.master_is_param:
            p.param_home.master_source = p.store
        p.blocks, p.root = self._build_units(*plan)
        p.units = p.blocks + [p.root]
        p.flat_params = [fp for u in p.units for fp in u.flat_params]
        p.trainable = [fp for fp in p.flat_params if fp.requires_grad]
        # one order of the gradients' reductions on every rank (see [Note: reduction order])
        p.grad_order = grad_order(model, p.trainable)
        if self.comm.lockstep is not None:
            self.comm.lockstep.register_names({fp.name: f"{fp.name} of {u.label}"
                                               for u in p.units for fp in u.flat_params})
        for mod in model.modules():  # buffers are not sharded; they follow the device
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[k] = b.to(self.device)
        p.grads = GradientShards(p.trainable, cfg.grad_tier, self.comm, cfg.stage, self.acct,
                                 self.host_alloc, host_dtype=cfg.grad_dtype,
                                 share_near_sizes=cfg.update_timing == BACKWARD)
        if p.memory_plan.pool("staging") is not None:
            n = p.memory_plan.pool("staging").buffer_numel
            p.staging = self.host_alloc(n, cfg.dtype)
            self.acct.add(Tier.HOST, StateKind.BUFFERS, n * p.staging.element_size())
        pool_for = self._build_gather_pools()
        self._build_updates()
        self._build_scheduler(pool_for)
        check_pools(p, self.rank)
        check_host_cache(p, self.rank)
        if cfg.activation_checkpointing:
            _checkpoint_blocks(model, p.blocks,
                               cfg.offload_activations and self.device.type != "cpu")

    # -- units and flat parameters ------------------------------------------------------------
    def _plan_units(self, model: nn.Module):
        """Units and, per unit, its trainable and frozen parameter groups (nothing built yet)."""
        cfg = self.cfg
        block_mods, planned, users = plan_flat_params(model, cfg.unit_classes, cfg.leaf_modules)
        blocks = [Unit(i, n, m, is_root=False) for i, (n, m) in enumerate(block_mods)]
        root = Unit(len(blocks), "", model, is_root=True)
        units = blocks + [root]
        planned = [(units[i], trainable, members) for i, trainable, members in planned]
        return blocks, root, planned, users

    def _build_units(self, blocks, root, planned, users):
        cfg, p = self.cfg, self.parts
        units = blocks + [root]
        # master weights in the same memory as the shard of their dtype: the shard is the
        # master (the device, or host "offload" where the CPU itself plays the device); the
        # same for a state kept in host memory when the CPU is the device
        alias_ok = p.memory_plan.master_aliased
        tail_alias_ok = p.memory_plan.host_master_aliased
        owner_of, originals = {}, {}
        for (unit, trainable, members), name in zip(planned, flat_param_names(planned)):
            entries = build_entries(members)
            values = self._initial_values(entries, members)
            fp = FlatParam(name, entries, values,
                           trainable, cfg.dtype, self.device, self.rank, self.world_size,
                           keep_unsharded=self._keeps_full_params(), accountant=self.acct,
                           home=p.param_home)
            if trainable:
                # straight to its tier, unit by unit: the fp32 masters of the whole model never
                # sit in memory at once
                in_host = isinstance(p.store, NVMeStore) and p.store.in_host(fp)
                alias = fp.sharded if alias_ok or (in_host and tail_alias_ok) else None
                p.store.add(fp, _flat_shard_fp32(fp, values), alias=alias)
                p.step_count[fp] = 0
            unit.flat_params.append(fp)
            originals[fp] = [p_ for p_, _ in members]
            del values
            for param, refs in members:
                owner_of[id(param)] = unit
                for mod, attr, _ in refs:
                    mod._parameters.pop(attr, None)
                # the engine holds the only copy now
                param.data = torch.empty(0, dtype=param.dtype,
                                         device="meta" if param.is_meta else "cpu")
        for unit_index, unit in enumerate(units):
            deps = {owner_of[k] for k, us in users.items() if unit_index in us} - {unit, root}
            unit.deps = sorted(deps, key=lambda u: u.index)
        states = self.states
        for unit in units:
            for fp in unit.flat_params:
                fp.set_views() if fp.keep_unsharded else fp.set_placeholders()
                fp.expose(originals[fp])  # (see [Note: model parameters while wrapped])
                # whether a backward since the last step left a gradient of fp in the engine
                fp.grad_pending = (lambda fp=fp: fp.requires_grad and states.grads_pending
                                   and not states.closed)
        return blocks, root

    def _initial_values(self, entries, members) -> List[torch.Tensor]:
        """A flat parameter's initial values, one tensor per entry: the parameters themselves,
        or (``load_from``/``init``) streamed for the elements this rank keeps (see [Note:
        streamed initial values] in :mod:`offload_zero.stream_load`)."""
        if self.initial is None:
            return [param.detach() for param, _ in members]
        numel = sum(e.numel for e in entries)
        shard = shard_numel_for(numel, self.world_size, self.cfg.dtype)
        lo, hi = ((0, numel) if self._keeps_full_params()
                  else (self.rank * shard, min(numel, (self.rank + 1) * shard)))
        return self.initial.flat_values(entries, members, shard * self.world_size, lo, hi)

    def _keeps_full_params(self) -> bool:
        """Whether gathered parameters stay allocated: stages 1 and 2 always; stage 3 when one
        rank holds its shards on the device, since its shard already is the whole parameter
        (gathering would only copy it, and freeing the copy would save nothing)."""
        return self.parts.memory_plan.keeps_full_params

    # -- optimizer state ----------------------------------------------------------------------
    def _state_in_host(self, plan):
        """``(tail, names)``: the name of the flat parameter ``tail_state_in_host`` keeps (with
        update_timing "backward" or "next_forward" and the state on NVMe; see
        :func:`offload_zero.partition.units.host_tail_index`) or None, and the names of every
        flat parameter whose optimizer state stays in host memory: that one and those
        ``host_cache_bytes`` takes (see [Note: host cache]): the memory plan's choice, by name.
        Empty unless the state is on NVMe."""
        names = flat_param_names(plan[2])
        mplan = self.parts.memory_plan
        tail = mplan.tail
        self.parts.params_in_host = {names[i] for i in mplan.params_in_host}
        return (None if tail is None else names[tail]), {names[i] for i in mplan.in_host}

    def _build_store(self):
        cfg, p = self.cfg, self.parts
        moments, master = cfg.moment_torch_dtype, cfg.master_torch_dtype
        if cfg.optimizer_tier is Tier.DEVICE:
            return DeviceStore(self.acct, self.device, moments, master)
        if cfg.optimizer_tier is Tier.HOST:
            return HostStore(self.acct, self.host_alloc, moments, master)
        # (a state kept in host memory never streams through the pipeline)
        return NVMeStore(p.swapper, self.acct, self.host_alloc,
                         pipeline_shard_numel(p.memory_plan),
                         chunk_numel=pipeline_chunk_numel(p.memory_plan),
                         master_is_param=self._master_is_param_on_nvme(), moment_dtype=moments,
                         io_stages=self.states.state_io, master_dtype=master)

    def _master_is_param_on_nvme(self) -> bool:
        """Parameter shards of the master's dtype and optimizer state both on NVMe: a trainable
        shard is read from its master's bytes (see ``NVMeParamHome(master_is_param=...)``)."""
        return self.parts.memory_plan.master_is_param_on_nvme

    # -- parameter shards off the device ------------------------------------------------------
    def _build_param_home(self, plan) -> None:
        cfg, p = self.cfg, self.parts
        if cfg.param_tier is Tier.HOST:
            p.param_home = HostParamHome(self.acct, self.host_alloc)
            return
        if cfg.param_tier is not Tier.NVME:
            return
        mplan = p.memory_plan
        # shards of the master's dtype are their own master weights: read from the optimizer's
        # files and never written back separately, so no write-back ring either
        share = mplan.master_is_param_on_nvme
        # in flight at once: (prefetch + 1) units of at most 2 flat parameters, plus the
        # write-back ring of the step. An outsized root unit (embeddings) gets buffers of
        # its own, so the main pools' buffers are block-sized: one per flat parameter when
        # they are all trainable (each keeps its updated shard for the next forward), else
        # one, through which its flat parameters are read one after the other; the root's
        # small flat parameters (a final norm split off by gradient order, frozen ones) go
        # through the block-sized pools like a block's; trainable and frozen shards each have
        # theirs, none when every such shard stays in host memory (see [Note: pools])
        pools = {name: self._host_pool(mplan.pool(name)) for name in
                 ("param_shards", "param_shards_frozen") if mplan.pool(name) is not None}
        main = lambda fp: pools.get(  # noqa: E731
            "param_shards" if fp.requires_grad else "param_shards_frozen")
        pool_for = main
        keep = follows = None
        # a state kept in host memory is, in the master's dtype, the shard itself; in others the
        # shard stays in host memory beside it; so does a frozen shard the host cache keeps:
        # no buffer, no file
        in_host = p.in_host | p.params_in_host
        spec = mplan.pool("param_shards_root")
        if spec is not None:
            names = flat_param_names(plan[2])
            outsized = {names[i] for i in mplan.outsized_root}
            root = self._host_pool(spec)
            pool_for = lambda fp: root if fp.name in outsized else main(fp)  # noqa: E731
            if mplan.keep_root:
                # the root's buffers are idle between its update and the next forward,
                # which gathers the root first: the updated shards stay there instead of
                # being read back from the files
                keep = lambda fp: fp.name in outsized and fp.name not in in_host  # noqa: E731
        if cfg.update_timing == NEXT_FORWARD:
            # a unit's update runs just before its gather: the new shard stays in its buffer
            # for that gather instead of being written and read back (the gather reads it
            # while the write is in flight, and returns the buffer). The root's parts, in the
            # master's dtype with the state on NVMe too, take no buffer (the gather reads the
            # master the update wrote) but the outsized ones kept as above
            states = self.states
            follows = lambda fp: (states.gather_follows(fp)  # noqa: E731
                                  and fp.name not in in_host
                                  and not (share and fp.name.startswith("root.")))
        p.param_home = NVMeParamHome(p.swapper, pool_for, self.acct, master_is_param=share,
                                     keep_after_update=keep, gather_follows=follows,
                                     io_stages=self.states.shard_io,
                                     in_host=lambda fp: fp.name in in_host,
                                     host_alloc=self.host_alloc,
                                     master_dtype=cfg.master_torch_dtype)

    def _host_pool(self, spec, dtype=None) -> HostBufferPool:
        """The plan's host pool ``spec`` (a :class:`offload_zero.plan.PoolSpec`), built and
        registered in the parts' pools; buffers in ``dtype`` (default: the compute dtype)."""
        pool = HostBufferPool(spec.name, spec.count, spec.buffer_numel,
                              dtype or self.cfg.dtype, self.host_alloc, self.acct)
        self.parts.pools[spec.name] = pool
        return pool

    def _build_gather_pools(self):
        """Device slots for gathered units, sized now (see [Note: gather pool]); returns
        ``f(unit) -> GatherPool | None`` for the scheduler, or None when nothing is gathered.

        Blocks share the plan's ``gather`` slots, the root unit (gathered from the start of
        forward to the end of backward) has ``gather_root`` (see [Note: pools] in
        :mod:`offload_zero.plan`)."""
        if self._keeps_full_params():
            return None
        if not self.parts.memory_plan.settings.rebinding:
            log.info("this torch cannot rebind storages: gathered units are allocated per gather")
            return None

        pools = {}
        for key, name in (("blocks", "gather"), ("root", "gather_root")):
            spec = self.parts.memory_plan.pool(name)
            if spec is not None:
                pools[key] = self.parts.pools[name] = GatherPool(
                    name, spec.count, spec.buffer_bytes, self.device, self.acct)
        return lambda unit: pools.get("root" if unit.is_root else "blocks")

    # -- updates and the schedule -------------------------------------------------------------
    def _build_updates(self) -> None:
        """The per-shard Adam call, the update timings and (NVMe state with updates in
        backward or in the next forward) the read-ahead ring."""
        cfg, p = self.cfg, self.parts
        p.adam = ShardAdam(p.store, p.grads, self.comm, self.states, p.step_count, p.segments,
                           cfg.adamw, cfg.optimizer_tier, self.device, staging=p.staging)
        # the root's trainable parameters, split by gradient order, come as [used after the
        # blocks (final norm, LM head)..., the rest (embeddings)]
        root_trainable = [fp for fp in p.root.flat_params if fp.requires_grad]
        # whether forward reads block parameter shards from NVMe (see read_ahead_in_forward)
        forward_reads_params = any(fp.home is not None and fp.home.tier is Tier.NVME
                                   for u in p.blocks for fp in u.flat_params)
        ring = None
        mplan = p.memory_plan
        spec = mplan.pool("optimizer_prefetch")
        if spec is None and cfg.optimizer_prefetch is not None:
            warn_user(f"optimizer_prefetch={cfg.optimizer_prefetch} has no effect: it needs "
                      "the optimizer state on NVMe (offload='nvme'), update_timing "
                      f"'backward' or 'next_forward' (in force: {cfg.update_timing!r}) and "
                      "a block state not kept in host memory")
        if spec is not None:
            # read-ahead of a block's whole state (master | exp_avg | exp_avg_sq) while other
            # units run (see [Note: pools]; a state kept in host memory needs no read-ahead):
            # a third buffer when the next unit's parameters are gathered from it in backward
            # (see prefetch_state), and with "next_forward", where the next forward's compute
            # is all there is to hide the state's reads and writes behind
            numel = max(sh for i, (f, sh) in enumerate(zip(mplan.layout, mplan.shard_numel))
                        if f.unit != -1 and f.trainable and i not in mplan.in_host)
            ring = self._host_pool(spec, torch.float32)
            p.store.enable_prefetch(ring, numel)
        p.updates = UpdateTimings(cfg, p.store, p.grads, self.comm, p.adam, self.states,
                                  p.param_home, ring, self.loss_scaler, p.blocks, p.root,
                                  p.trainable, set(root_trainable[:-1]), forward_reads_params)
        p.updates.grad_order = p.grad_order

    def _build_scheduler(self, pool_for) -> None:
        """The unit scheduler (``pool_for``: :meth:`_build_gather_pools`), its hooks wired to
        the update timing in force."""
        cfg, p = self.cfg, self.parts
        updates = p.updates
        staging = p.grads.scratch if self.device.type != "cpu" else None
        on_grad, on_unit_backward, on_forward = p.grads.on_full_grad, None, None
        on_unit_forward = before_gather = gather_late = before_late_gather = None
        if cfg.update_timing == BACKWARD:
            on_grad, on_unit_backward = updates.grad_ready, updates.prefetch_state
            # an update still streaming when backward returns ends before weights are read
            on_forward = updates.finish_updates
            if updates.ring is not None:
                on_unit_forward = updates.read_ahead_in_forward
        if cfg.update_timing == NEXT_FORWARD:
            before_gather = updates.before_gather
            gather_late = updates.streaming
            before_late_gather = updates.finish_streaming
            on_unit_backward = updates.read_ahead_in_backward
        if cfg.stage == 2 and self.world_size > 1:
            p.reduction = OrderedReduction(p.grad_order, on_grad, p.grads, self.comm,
                                           flags_in_update=cfg.update_timing == BACKWARD)
            on_grad = p.reduction.grad_ready
            updates.reduction = p.reduction
            reduction = p.reduction  # (its `used` set is replaced each backward)
            p.adam.used = lambda fp: fp in reduction.used
        p.scheduler = UnitScheduler(p.blocks, p.root, self.comm, cfg.prefetch,
                                    reshard_after_forward=cfg.stage == 3,
                                    on_grad=on_grad, pool_for=pool_for, staging=staging,
                                    on_end_backward=(None if p.reduction is None
                                                     else p.reduction.end_backward),
                                    on_forward_error=self.comm.report_failure,
                                    on_unit_backward=on_unit_backward, on_forward=on_forward,
                                    on_unit_forward=on_unit_forward,
                                    before_gather=before_gather, gather_late=gather_late,
                                    before_late_gather=before_late_gather)
        updates.scheduler = p.scheduler


def pools_report(parts: EngineParts) -> dict:
    """``memory_report()["pools"]``: every fixed buffer set of ``parts``, with its tier
    (``{name: {"tier", "buffers", "buffer_bytes", "capacity_bytes", ...}}``, bytes)."""
    pools = {name: {"tier": "device" if isinstance(pool, GatherPool) else "host",
                    **pool.report()} for name, pool in parts.pools.items()}
    if isinstance(parts.store, NVMeStore):
        pools["optimizer_pipeline"] = {"tier": "host", **parts.store.pool_report()}
    for name, tier, buf in (("staging", "host", parts.staging),
                            ("reduce_scratch", "device", parts.grads.scratch)):
        if buf is not None:
            nbytes = buf.numel() * buf.element_size()
            pools[name] = {"tier": tier, "buffers": 1, "buffer_bytes": nbytes,
                           "capacity_bytes": nbytes}
    return pools


def memory_report(acct: TierAccountant, parts: EngineParts, states: UpdateStates) -> dict:
    """``engine.memory_report()``: the accountant's bytes per tier and kind (``acct``), the
    NVMe bytes the swapper moved and the seconds the caller waited for them, the optimizer
    state's part of those bytes (the store's), the scheduler's live units,
    :func:`pools_report`, the I/O stages not at rest (``states``), :func:`host_cache_report`
    and, with ``max_host_bytes``, the host budget against the memory plan
    (:func:`offload_zero.host_budget.host_budget_report`; see
    :meth:`OffloadEngine.memory_report`).
    Units: bytes (``"wait_s"``: seconds)."""
    rep, store, plan, swapper = acct.report(), parts.store, parts.memory_plan, parts.swapper
    # (the swapper's counters, not the store's: with the optimizer state in host memory the
    # parameter shards' I/O goes through the same swapper and no NVMe store)
    rep["nvme"]["read_bytes"] = swapper.bytes_read if swapper is not None else 0
    rep["nvme"]["written_bytes"] = swapper.bytes_written if swapper is not None else 0
    rep["nvme"]["wait_s"] = swapper.wait_s if swapper is not None else 0.0
    for key in ("state_read_bytes", "state_written_bytes"):
        rep["nvme"][key] = getattr(store, key, 0)
    rep["live_units"] = {"current": parts.scheduler.live_units(),
                         "peak": parts.scheduler.live_peak}
    rep["pools"] = pools_report(parts)
    rep["io_stages"] = states.io_report()  # (see [Note: update states])
    rep["host_cache"] = host_cache_report(parts)
    if plan.settings.max_host_bytes is not None:
        rep["host_budget"] = host_budget_report(plan, rep["host"]["peak_bytes"])
    return rep


def host_cache_report(parts: EngineParts) -> Dict[str, int]:
    """``memory_report()["host_cache"]``: where the optimizer state and the parameter shards
    of ``parts`` are kept, host memory or NVMe, as the store and the parameter home allocated
    them: every key of :data:`offload_zero.memory.host_cache.REPORT_KEYS`, 0 where nothing
    applies (see [Note: host cache report] there). Units: bytes (and counts)."""
    rep = dict.fromkeys(REPORT_KEYS, 0)
    for part in (parts.store, parts.param_home):
        if part is not None:
            rep.update(part.cache_report())
    return rep


def check_host_cache(parts: EngineParts, rank: int) -> None:
    """Raise RuntimeError (rank-prefixed, an internal error) unless :func:`host_cache_report`
    is exactly the memory plan's ``host_cache``."""
    built, planned = host_cache_report(parts), parts.memory_plan.host_cache
    if built != planned:
        raise RuntimeError(f"rank {rank}: internal error: the host cache built {built} "
                           f"differs from the memory plan's {planned}")


def check_pools(parts: EngineParts, rank: int) -> None:
    """Raise RuntimeError (rank-prefixed, an internal error) unless the pools built are
    exactly the memory plan's: names, tiers, counts and bytes."""
    keys = ("tier", "buffers", "buffer_bytes", "capacity_bytes")
    built = {name: {k: rep[k] for k in keys} for name, rep in pools_report(parts).items()}
    planned = parts.memory_plan.pools_report()
    if built != planned:
        raise RuntimeError(f"rank {rank}: internal error: the pools built {built} "
                           f"differ from the memory plan's {planned}")


def build_segments(parts: EngineParts, group_of: Dict[int, int]) -> Dict[FlatParam, List[int]]:
    """Each trainable flat parameter's group segments (see [Note: parameter groups] in
    :mod:`offload_zero.optim.facade`): fills ``parts.segments[fp]`` with its shard's runs
    ``(lo, hi, group)`` and returns ``{fp: the group of each of its parameters}``
    (``group_of``: ``{id(parameter): group index}``, from :func:`resolve_param_groups`)."""
    from offload_zero.optim.facade import shard_segments
    planned = parts.plan[2]
    members = {name: m for (_, _, m), name in zip(planned, flat_param_names(planned))}
    entry_groups: Dict[FlatParam, List[int]] = {}
    for fp in parts.trainable:
        entry_groups[fp] = [group_of[id(param)] for param, _ in members[fp.name]]
        runs = [(e.offset, e.numel, g) for e, g in zip(fp.entries, entry_groups[fp])]
        parts.segments[fp] = shard_segments(runs, fp.rank * fp.shard_numel, fp.shard_numel)
    return entry_groups


def flat_param_names(planned) -> List[str]:
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


def _flat_shard_fp32(fp: FlatParam, values: List[torch.Tensor]) -> torch.Tensor:
    """This rank's slice of the padded flat layout of ``values`` in fp32, shape (shard_numel,)."""
    lo, hi = fp.rank * fp.shard_numel, (fp.rank + 1) * fp.shard_numel
    shard = torch.zeros(fp.shard_numel, dtype=torch.float32)
    for e, v in zip(fp.entries, values):
        a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
        if a < b:
            shard[a - lo:b - lo].copy_(v.reshape(-1)[a - e.offset:b - e.offset].float())
    return shard


def _checkpoint_blocks(model: nn.Module, blocks: List[Unit], offload: bool) -> None:
    """``activation_checkpointing``: each block recomputes its forward in backward."""
    # a key/value cache filled in forward and again in the recomputation would make the
    # two passes differ (Hugging Face models turn it off for checkpointing the same way)
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False
        log.info("activation_checkpointing: set model.config.use_cache = False")
    for unit in blocks:
        # (a container unit's children each recompute)
        for mod in ([unit.module] if runs_itself(unit.module) else unit.module.children()):
            _checkpoint_forward(mod, offload)


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
