"""``OffloadEngine``: the user-facing training loop — forward, backward, step, state export,
checkpoints — for ZeRO-DP (Rajbhandari et al., 2019) stages 1-3, the partitioned fp32 optimizer
state on the device, in host memory (ZeRO-Offload) or in NVMe files (ZeRO-Infinity).

A facade (DESIGN.md has the architecture): :mod:`offload_zero.construct` checks its arguments,
:mod:`offload_zero.build` builds its parts, :mod:`offload_zero.update` runs the updates (and
counts accumulated micro-batches), :mod:`offload_zero.lifetime` releases it, and
:mod:`offload_zero.partition.schedule` says when units are gathered and freed.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn as nn

from offload_zero.accelerate_guard import RefusePrepare, refuse_in_accelerate
from offload_zero.build import EngineParts, build_segments, memory_report
from offload_zero.config import EngineConfig, check_number
from offload_zero.construct import Resolved, build_guarded, check_arguments, releasable, resolve
from offload_zero.inputs import to_device
from offload_zero.lifetime import WRAPPED, close_engine, collective_error, not_replacing, release
from offload_zero.lockstep import Phase
from offload_zero.partition.flat_param import FlatParam
from offload_zero.update.accumulation import Accumulation
from offload_zero.update import rules
from offload_zero.update.rules import BACKWARD
from offload_zero.update.timings import UpdateTimings


class OffloadEngine:
    """Wrap ``model`` for ZeRO training with optional CPU or NVMe offload of optimizer state.

    Args:
        model: any ``torch.nn.Module`` with its parameters on the CPU (or the device). They
            move into flat shards the engine owns; the module keeps parameter objects of the
            true shapes in the compute dtype (the current values at stages 1 and 2,
            placeholders at stage 3; views while their unit runs) and its own API
            (``parameters()``, ``state_dict()``: full fp32 values, collective;
            ``load_state_dict()`` and in-place writes under ``torch.no_grad()`` reach the master
            weights; ``generate()``; see :mod:`offload_zero.exposure`). At stage 3 under
            torchrun every rank must run each forward, ``generate()`` included (with
            ``synced_gpus=True`` when the ranks' lengths differ).
        offload, path, stage, lr, betas, eps, weight_decay, adamw, dtype, device, **kwargs: the
            :class:`offload_zero.config.EngineConfig` fields (its docstring lists every field,
            default, unit and valid value): where the fp32 master weights and moments live
            (``"none"``, ``"cpu"``, ``"nvme"``, ``"auto"``); the NVMe swap folder (files in
            ``path/rank<r>/``, mode 0600, removed by :meth:`close`; its ``.owner`` file hands a
            gone process's folder over, with a warning, and refuses a running one's:
            ValueError); the ZeRO stage (1, 2, 3); the optimizer (AdamW when ``adamw`` else
            Adam with L2, torch's semantics; ``lr`` to ``weight_decay`` are the parameter
            groups' defaults); the compute dtype (master weights and moments are fp32); the
            accelerator (default CUDA when present, else the CPU); further fields (prefetch,
            max_grad_norm, update_timing, gradient_accumulation_steps: see :meth:`step`, ...).
            ``step_in_backward``/``step_in_forward``, which ``update_timing`` replaced, raise
            TypeError naming the value to pass instead.
        process_group: the data-parallel group (default: the world; none needed at world size 1).
        timeout_s: collective timeout in seconds when the engine initialises the process group
            (a finite number > 0; ValueError otherwise).
        param_groups: None (one group of every trainable parameter), or torch's format: a list
            of dicts, each with ``params`` (parameters of ``model``, taken before wrapping) and
            any of ``lr``, ``betas``, ``eps``, ``weight_decay``. Trainable parameters in no group
            go to a last group with the defaults. See :attr:`optimizer`.
        load_from: a Hugging Face safetensors checkpoint folder whose weights (any float dtype)
            become the fp32 master weights, streamed one flat parameter at a time, each rank
            reading its shard's bytes only; the model may be on the meta device (never
            materialised whole) or not (its values are replaced). Names follow
            ``from_pretrained`` (see :func:`offload_zero.stream_load.initial_values`).
        init: ``"model"``: parameters not in ``load_from`` (all without it) come from the
            model's own initialiser (transformers' ``_init_weights``, else
            ``reset_parameters()``), one unit at a time; seed torch first for determinism.
        strict: with ``load_from``, missing or unexpected keys raise ValueError; False
            loads anyway and lists them in :attr:`load_report`.

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
        skipped_steps: steps that updated nothing (or, with ``update_timing="backward"``, not
            every flat parameter) because a gradient held an inf/nan.
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
        check_arguments(model, kwargs)  # (the model, unknown or replaced keywords)
        cfg = EngineConfig(offload=offload, path=path, stage=stage, lr=lr, betas=betas, eps=eps,
                           weight_decay=weight_decay, adamw=adamw, dtype=dtype, device=device,
                           **kwargs)
        r = resolve(model, cfg, process_group, timeout_s, param_groups)
        cfg = self.config = r.config
        self.comm, self.placement = r.comm, r.placement  # (placement: with offload="auto")
        self.device, self.rank, self.world_size = cfg.device, r.comm.rank, r.comm.world_size
        self.module, self._closed = model, False
        self._backward_interrupted = False  # (Ctrl-C / exit in a backward with updates in it)
        self._acct, self._states = r.acct, r.states  # (see [Note: update states])
        self.lr_scheduler = None  # stepped after each update (see the class docstring)
        self.loss_scaler = r.loss_scaler  # (fp16: scales the loss up, the update scales down)
        self.load_report = build_guarded(model, r, load_from, init, strict,
                                         lambda parts: self._take(parts, r))
        # Hooks on tensors live in C++, where the cycle collector cannot see them: the finalizer
        # must not reference the engine, and it removes the hooks itself.
        self._finalizer = weakref.finalize(self, release, self._acct, *releasable(self._parts))
        object.__setattr__(model, WRAPPED, True)
        # the model's own parameters(), state_dict(), load_state_dict() and in-place writes
        from offload_zero.exposure import ModelExposure
        self._exposure = ModelExposure(self)
        # accelerator.prepare(model) raises (see [Note: accelerate's prepare])
        object.__setattr__(model, "_is_accelerate_prepared", RefusePrepare("model"))

    def _take(self, parts: EngineParts, r: Resolved) -> None:
        """Hold the parts built (stores, homes, units, schedule) and build the optimizer and the
        accumulation count on them, inside the build's guard (an error releases the parts)."""
        self.config = parts.config  # (the settings in force: see EngineConfig.lowered)
        self.swapper, self.param_home, self.store = parts.swapper, parts.param_home, parts.store
        self.blocks, self.root, self.units = parts.blocks, parts.root, parts.units
        self.flat_params, self.trainable = parts.flat_params, parts.trainable
        self.grads, self.scheduler = parts.grads, parts.scheduler
        self.memory_plan = parts.memory_plan
        self.pools = parts.pools  # HostBufferPool | GatherPool, by name
        self._parts = parts  # (the pools' report reads them)
        self._updates: UpdateTimings = parts.updates
        self._step_count: Dict[FlatParam, int] = parts.step_count  # (checkpoints read it)
        from offload_zero.optim.facade import EngineOptimizer
        # (see [Note: parameter groups] in offload_zero.optim.facade)
        self._entry_groups = build_segments(parts, r.group_of)
        self.optimizer = EngineOptimizer(self, r.groups, r.defaults)
        self._updates.hypers = self.optimizer.hypers
        self._accum = Accumulation(self.config.gradient_accumulation_steps,
                                   self.config.update_timing, self._states, self.scheduler,
                                   self.optimizer.hypers)

    @property
    def __class__(self):
        """``type(self)``; but an ``isinstance`` test of the engine by accelerate (its
        ``prepare(engine)``) raises ValueError naming the pattern that works (see [Note:
        accelerate's prepare] in :mod:`offload_zero.accelerate_guard`)."""
        refuse_in_accelerate(sys._getframe(1), "engine")
        return type(self)

    # -- state the step keeps ---------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps that updated nothing (or, with ``update_timing="backward"``, not every flat
        parameter) because a gradient held an inf/nan; a checkpoint restores it."""
        return self._updates.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._updates.skipped_steps = value

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient 2-norm of the last step that clipped (``max_grad_norm``), before
        clipping and after unscaling (inf or nan for a step skipped for it); None before the
        first such step, and always without ``max_grad_norm``: the norm is computed only to
        clip (one more pass over the gradient shards and an all-reduce), so a large
        ``max_grad_norm`` measures it without clipping in effect."""
        return self._updates.last_grad_norm

    @property
    def _backward_pending(self) -> bool:
        """Whether a backward since the last step left gradients in the engine."""
        return self._states.grads_pending

    # -- training loop -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run the model's forward on ``args``/``kwargs`` and return its output unchanged.

        Tensor arguments are moved to the engine's device, and floating-point ones are cast to
        the compute dtype (as FSDP's mixed precision casts forward inputs).
        """
        self._check_open()
        args, kwargs = to_device((args, kwargs), self.device, self.config.dtype)
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (a scalar tensor); gradients land in this rank's shards.

        Calling it several times before :meth:`step` accumulates gradients. If an error ends
        backward early, the units are freed as at its end and the error is raised; the gradients
        then hold what that backward finished: :meth:`zero_grad` drops them (to skip the batch),
        :meth:`step` applies them. With ``update_timing="backward"`` the updates it made stay
        and the step ends there, as :meth:`step` would end it; an interrupt (KeyboardInterrupt,
        SystemExit) starts no more I/O: :meth:`close`, or :meth:`zero_grad` to go on, ends it.
        With ``gradient_accumulation_steps=N`` the loss is divided by N first (so N
        micro-batches' gradients sum to their mean loss's). With a loss scale (fp16) the loss is
        then multiplied by ``loss_scaler.scale`` in fp32; the update divides it out.
        Raises ValueError if ``loss`` is not a scalar tensor that requires grad, or (with
        ``update_timing="backward"``) if a parameter group's hyperparameter is bad. A backward
        through the wrapped model that does not come from here (``loss.backward()``) raises
        RuntimeError saying to call this instead: it would skip the steps above.
        """
        self._check_open()
        self._accum.check_backward(loss)  # (ValueError, RuntimeError: see the docstring)
        with self.comm.together(Phase.BACKWARD):
            self.apply_pending_updates()  # (units the last forward did not run)
            loss = self._accum.start_backward(loss)  # (divided by gradient_accumulation_steps)
            if self.loss_scaler is not None:
                # in fp32: a scaled fp16 loss would overflow long before its gradients do
                loss = loss.float() * self.loss_scaler.scale
            self.scheduler.in_engine_backward = True
            self._backward_interrupted = False
            try:
                loss.backward()
            except BaseException as exc:
                with not_replacing(exc, self.rank, "ending the backward"):
                    self.scheduler.end_backward()  # (the end-of-backward callback did not run)
                    if self.config.update_timing == BACKWARD:
                        if isinstance(exc, Exception) and not collective_error(exc):
                            self._step()
                        else:  # (Ctrl-C or exit: no more I/O; zero_grad() or step() ends it)
                            self._backward_interrupted = True
                raise
            finally:
                self.scheduler.in_engine_backward = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last :meth:`step` (to skip a batch, say
        after an error in backward); the next backward starts afresh. Without a backward since
        the last step (torch's habit of ``step(); zero_grad()``) there is nothing to drop and
        nothing changes: ``update_timing="next_forward"``'s pending updates stay for the next
        forward. With ``update_timing="backward"`` the weights already changed in backward, so
        a batch cannot be skipped: after a backward that ran to its end this raises
        RuntimeError saying so (call :meth:`step`, or use ``update_timing="step"`` or
        ``"next_forward"`` to skip batches); after one a Ctrl-C or exit interrupted, it ends the
        step as :meth:`step` does. With ``gradient_accumulation_steps`` > 1 a
        :meth:`step` that only ended a micro-batch counts as a step here too (nothing is dropped
        until the next backward), so ``step(); zero_grad()`` after each micro-batch accumulates;
        after a backward it drops every micro-batch's gradient since the last update, and the
        next N :meth:`step` calls make the next update. ``set_to_none`` is accepted as torch's
        optimizers take it and changes nothing: the gradient shards are the engine's buffers,
        zeroed either way. Raises RuntimeError if the engine is closed, or as above."""
        self._check_open()
        if self._accum.nothing_to_drop():
            return
        if not rules.check_zero_grad(self.config.update_timing, self._backward_interrupted):
            self._step()  # (an interrupted "backward": its updates are partly made)
            return
        self.grads.zero()  # (pending "next_forward" updates: backward applied them)
        self._accum.dropped()

    def apply_pending_updates(self) -> None:
        """Apply every update that :meth:`step` decided and ``update_timing="next_forward"``
        left for the units' next gathers (no-op otherwise): before anything reads the weights or
        the optimizer state as a whole (checkpoints, :meth:`full_state_dict`, the next
        :meth:`step`), and by :meth:`backward` for units the last forward did not run. Raises
        SwapIOError if an NVMe transfer fails (file and offset named), RuntimeError if the
        engine is closed."""
        self._check_open()
        self._updates.apply_pending()

    def _finish_updates(self) -> None:
        """Finish every update still streaming and apply every pending one (see
        :meth:`UpdateTimings.finish_updates`): before anything reads the weights whole."""
        self._updates.finish_updates()

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
        return self._accum.is_boundary()

    @torch.no_grad()
    def _step(self) -> None:
        """:meth:`step`'s work (``engine.optimizer.step()`` calls it): count the micro-batch,
        and at a gradient accumulation boundary update (:meth:`UpdateTimings.step`)."""
        self._check_open()
        with self.comm.together(Phase.STEP):
            if self._accum.ends_micro_batch():
                return
            skipped = self.skipped_steps
            hypers = self.optimizer.hypers()
            self._exposure.before_step()  # writes to the model's parameters since the forward
            self._updates.step(hypers)
            self._accum.updated()
            if self.lr_scheduler is not None and self.skipped_steps == skipped:
                self.lr_scheduler.step()

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group of ``engine.optimizer`` (for
        schedules; a torch LR scheduler on ``engine.optimizer`` does the same per group). It
        applies from the next update decided: the next :meth:`step`, or with
        ``update_timing="backward"`` the next backward (an update still streaming after a backward
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
        (cumulative bytes moved through the swapper: optimizer state and parameter shards),
        ``"wait_s"`` (cumulative seconds this process's training thread stood waiting for NVMe
        transfers: the I/O that did not hide behind compute), ``"state_read_bytes"`` and
        ``"state_written_bytes"`` (the optimizer state's part of them, counted as each transfer
        starts). ``"host_cache"``, in every configuration with the same keys (0 where nothing
        applies): where this rank keeps its optimizer state and its parameter shards, host
        memory or NVMe, as counts of flat parameters and bytes: ``"host_flat_params"``,
        ``"nvme_flat_params"``, ``"host_state_bytes"``, ``"nvme_state_bytes"`` (master weights
        and moments), ``"host_param_flat_params"``, ``"nvme_param_flat_params"``,
        ``"host_param_bytes"``, ``"nvme_param_bytes"`` (compute-dtype parameter shards in host
        memory, or read from NVMe by each gather), ``"host_frozen_flat_params"``,
        ``"host_frozen_bytes"`` (the frozen ones among the shards in host memory); equal to
        :attr:`memory_plan`'s ``host_cache`` (see [Note: host cache report] in
        :mod:`offload_zero.memory.host_cache`).
        ``"pools"`` lists the fixed buffers sized at start-up, each with its ``"tier"`` (the
        device gather pool for unsharded units, parameter-shard read-ahead, the NVMe optimizer
        pipeline, the host staging buffer, the reduce-scatter scratch): exactly
        :attr:`memory_plan`'s pools (see :mod:`offload_zero.plan`). With ``max_host_bytes``,
        ``"host_budget"`` gives the budget, the planned and measured host peak and what was
        lowered to fit (:func:`offload_zero.host_budget.host_budget_report`). ``"io_stages"``: each
        flat parameter whose NVMe bytes are not at rest, ``{name: {"optimizer_state",
        "parameter_shard"}}`` (see :meth:`UpdateStates.io_report`). Units:
        bytes (``"wait_s"``: seconds).
        """
        return memory_report(self._acct, self._parts, self._states)

    def update_states(self) -> Dict[str, str]:
        """``{flat parameter name: state}`` of every trainable flat parameter whose update is
        under way (see [Note: update states] in :mod:`offload_zero.update.state`):
        ``"pending"`` (decided by the last step, applied before its unit's next read, listed
        first in the order the next forward needs them), ``"streaming"``, or, with
        ``update_timing="backward"`` between a backward and its step, ``"applied"``,
        ``"overflowed"`` or ``"unused"``. Empty between steps of the plain step."""
        return self._states.report()

    def comm_report(self) -> dict:
        """Bytes this rank moved per collective kind, for the last step and in total (ring
        accounting; see :mod:`offload_zero.comm`)."""
        return self.comm.report()

    def full_state_dict(self, rank0_only: bool = False) -> Dict[str, torch.Tensor]:
        """Every parameter as a full fp32 CPU tensor under the model's own names, plus the
        persistent buffers: what ``model.state_dict()`` has, so a fresh model loads it strictly.
        It materialises the whole model in host memory (4 bytes per parameter); for a model
        larger than RAM use :meth:`iter_full_parameters` or :meth:`save_pretrained`.

        Trainable parameters come from the master weights (all-gathered over ranks);
        frozen ones from the compute-dtype shards. A tied parameter appears under each of its
        names. With ``rank0_only`` other ranks return ``{}`` (they still take part in the
        gathers). Shapes: the original parameter shapes.
        """
        self._check_open()
        from offload_zero.hf_export import full_state_dict
        with self.comm.together(Phase.EXPORT):
            return full_state_dict(self, self._exposure, rank0_only)

    def iter_full_parameters(self, dtype: Optional[torch.dtype] = None
                             ) -> Iterator[tuple]:
        """Yield ``(name, tensor)`` for every parameter name, then every persistent buffer,
        gathering one flat parameter at a time: host memory holds one flat parameter's fp32
        values (``padded_numel`` elements) and the tensors yielded from it, not the model.

        Tensors are full CPU tensors of the original shapes: trainable parameters from the
        master weights, frozen ones from the compute-dtype shards, as fp32 or cast to
        ``dtype`` (floating buffers too). A tied parameter comes under each of its names as
        one tensor object. Collective: every rank must run the iterator to its end (each gets
        every tensor)."""
        self._check_open()
        from offload_zero.hf_export import iter_full_parameters
        with self.comm.together(Phase.EXPORT):
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
        flat parameter at a time across ranks and written by rank 0, so host memory holds about
        one unit. Atomic: the folder is written as a hidden sibling and swapped in; a failed
        export leaves an earlier folder intact. Collective. Returns ``{"dir", "weights" (the
        index or single file), "weights_bytes", "tensors", "shards", "dropped_tied", "files"}``
        (other ranks list the weight files only). Raises ValueError for a bad ``dtype`` or size,
        a ``folder`` holding files an export does not write, or a PEFT model (its parameter
        names, ``base_model.model...lora_A...``, are not transformers' layout, which would
        load as missing weights: the message says what saves it); the write's own error
        (OSError) on rank 0, a RuntimeError naming rank 0 on the others."""
        self._check_open()
        if hasattr(self.module, "peft_config"):
            raise ValueError(
                "save_pretrained: the wrapped model is a PEFT model, whose names transformers' "
                "from_pretrained cannot load (it would start from random weights). Save the "
                "adapter with model.save_pretrained(folder) (peft, while wrapped), or load "
                "engine.full_state_dict() into an unwrapped copy of the PEFT model and save its "
                "merge_and_unload() for full weights")
        from offload_zero.hf_export import save_pretrained
        with self.comm.together(Phase.EXPORT):
            return save_pretrained(self, folder, dtype=dtype, max_shard_size=max_shard_size,
                                   tokenizer=tokenizer)

    def save_checkpoint(self, folder, client_state: Optional[dict] = None) -> None:
        """Save the training state to resume from: every rank writes its shard (master
        weights as fp32 values, Adam moments and step counts, the parameter shards) to ``folder`` as
        ``rank<r>.safetensors``, and rank 0 writes ``checkpoint.json`` (the parameter groups'
        values, skipped_steps, the loss scaler's state, the layout). Atomic: a failed save
        leaves a previous checkpoint in ``folder`` intact. ``client_state``: a JSON-ready dict
        of your own (a step counter, a data position) that :meth:`load_checkpoint` returns on
        every rank; it is saved from rank 0 only (the other ranks' is ignored). Collective;
        call it between steps. Layout, dtypes and errors:
        :func:`offload_zero.checkpoint.save_checkpoint`."""
        from offload_zero.checkpoint import save_checkpoint
        self._check_open()
        with self.comm.together(Phase.CHECKPOINT):
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
        with self.comm.together(Phase.CHECKPOINT):
            out = load_checkpoint(self, folder)
        self._exposure.record_versions()  # (the loaded values are the engine's own)
        return out

    # -- lifetime ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"[rank {self.rank}] this OffloadEngine is closed")

    def close(self) -> None:
        """Release buffers, remove swap files and hooks; idempotent. Also runs on garbage
        collection, at interpreter exit, and when leaving a ``with`` block (also on error).

        The model's weights live in the engine: take them with :meth:`full_state_dict` first;
        afterwards the wrapped model has no parameters left."""
        if self._closed:
            return
        self._closed = self._states.closed = True
        close_engine(self.comm, self._exposure, self._updates, self._finalizer)

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close the engine. When the block raised, an error in closing is logged instead of
        raised, so the block's own exception (a Ctrl-C, say) is what the caller sees."""
        with contextlib.nullcontext() if exc is None else not_replacing(exc, self.rank):
            self.close()

    # -- state for checkpoints ---------------------------------------------------------------
    # What offload_zero/checkpoint/ reads and writes beside the public attributes (flat_params,
    # store, param_home, scheduler, comm, optimizer, module, config, skipped_steps,
    # loss_scaler), so that it uses no private attribute of the engine.
    def settle_between_steps(self, what: str) -> None:
        """Bring the engine to a point between steps for ``what`` (``"save_checkpoint"``,
        ``"load_checkpoint"``): finish every update still streaming (``update_timing``
        ``"backward"``), apply those left for the next forward (``"next_forward"``), and reshard
        every gathered unit, so the shards and optimizer state hold a completed step's values.

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
