"""One validated configuration object for :class:`offload_zero.OffloadEngine`.

Every knob, its default and its unit lives in :class:`EngineConfig`. Validation happens once, in
``EngineConfig.__post_init__``; bad user input raises ``ValueError`` naming the bad value and the
valid choices.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
import numbers
import os
import warnings
from typing import FrozenSet, Optional, Tuple

import torch

from offload_zero.tables import (AIO_BACKENDS, DTYPES, OFFLOADS, TIER_OF_OFFLOAD,
                                 default_offload_param)

OFFLOAD_CHOICES = OFFLOADS + ("auto",)
TIER_CHOICES = OFFLOADS
STAGE_CHOICES = (1, 2, 3)
DTYPE_CHOICES = tuple(DTYPES.values())


class Tier(enum.Enum):
    """Where a piece of training state lives."""

    DEVICE = "device"
    """The accelerator's memory (the CPU itself when there is no accelerator)."""
    HOST = "host"
    """Host RAM (pinned when an accelerator is present)."""
    NVME = "nvme"
    """Files under the engine's swap folder, read and written with O_DIRECT async I/O."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine; all fields are validated on construction.

    Fields:
        offload: shorthand for the two settings below. ``"none"``: everything on the device;
            ``"cpu"``: optimizer state (fp32 master weights, moments) and gradient shards in host
            RAM; ``"nvme"``: optimizer state in files under ``path`` and, at stage 3, the
            parameter shards too (gradient shards in host RAM); ``"auto"``: the engine measures
            the device, host and disk and picks the cheapest placement that fits or, given a
            ``workload``, the one whose estimated step is the fastest (see
            :mod:`offload_zero.placement`). Default ``"none"``.
        offload_optimizer: ``"none"``/``"cpu"``/``"nvme"``, overrides ``offload`` for the fp32
            master weights and moments. Default: from ``offload``.
        offload_param: ``"none"``/``"cpu"``/``"nvme"``, overrides ``offload`` for the
            compute-dtype parameter shards (stage 3 only); NVMe shards are read ahead of use
            into a fixed pool of host buffers. Default: from ``offload``.
        path: folder for NVMe swap files, a str or ``os.PathLike`` (required for
            ``offload="nvme"``; must exist and be writable: a file is created there, and
            removed, to check). Each rank uses its own sub-folder ``rank<r>``. Given when
            nothing goes to NVMe (and ``offload`` is not ``"auto"``), it is unused: a
            UserWarning says so. Default ``None``.
        stage: ZeRO stage, 1 (optimizer state partitioned), 2 (+ gradients) or 3 (+ parameters).
            Default 3.
        lr: learning rate, >= 0 (0 moves the moments, not the weights: a warmup's first step).
            Default 1e-3. ``lr``, ``betas``, ``eps`` and ``weight_decay`` are the defaults of
            the parameter groups (``engine.optimizer.param_groups``), which the updates read.
        betas: Adam (beta1, beta2), each in [0, 1). Default (0.9, 0.999).
        eps: term added to the denominator, >= 0. Default 1e-8.
        weight_decay: >= 0; decoupled (AdamW) when ``adamw`` else L2 added to the gradient.
        adamw: AdamW (Loshchilov & Hutter, 2019) when True, Adam (Kingma & Ba, 2015) when False.
        dtype: compute dtype of parameters and gradients on the device: float32, bfloat16 or
            float16. Master weights are ``master_dtype`` (float32 by default), the moments
            ``moment_dtype``. Default float32.
        device: the accelerator; default ``cuda:<LOCAL_RANK>`` when CUDA is present, else CPU.
        prefetch: how many units ahead (forward) or behind (backward) are gathered before they
            run, >= 0. Live units never exceed ``prefetch + 1`` blocks plus the root. Default
            None: 1, or 0 where ``max_host_bytes`` needs the host buffers of the units read
            ahead (parameter shards on NVMe); after construction the field holds the count
            (1), after the engine's build the count in force.
        unit_classes: module classes whose instances become units; empty means each block of
            the model's largest ``nn.ModuleList``. Default ``()``.
        leaf_modules: module classes, or qualified module names (``"experts"``,
            ``"model.layers.0.mlp"``), whose whole subtree is one unit: it is gathered whole and
            every parameter in it gets a gradient (zeros where unused) on every rank, so
            routing that differs per rank (mixture-of-experts layers) is exact at stage 3. No
            unit is cut inside a leaf. The sparse MoE blocks of transformers models (classes
            named ``*SparseMoeBlock``: Mixtral, Qwen2-MoE, ...) are leaves without asking
            (DeepSpeed's ``set_z3_leaf_modules``). Default ``()``.
        check_collectives: before each collective, check with one small all-gather that every
            rank is at the same one (step, index, kind, size, phase, flat parameter): a
            mismatch raises :class:`offload_zero.lockstep.CollectiveMismatch` on every rank
            instead of pairing different tensors (see [Note: lockstep]). World size > 1 only.
            Default True.
        max_grad_norm: clip the global gradient 2-norm to this value before the update; ``None``
            disables clipping. Default ``None``.
        aio_backend: NVMe I/O backend, ``"auto"``, ``"libaio"`` or ``"threads"``. Default auto.
        aio_block_size: bytes per NVMe request, positive multiple of 4096, or None: chosen by a
            short probe the first time a device is used and remembered per device (see
            :mod:`offload_zero.memory.tuning`). Default None.
        aio_queue_depth: NVMe requests in flight, >= 1, or None (probed, as above). Default None.
        activation_checkpointing: recompute each block unit's forward in backward (ZeRO-R's
            activation partitioning on one rank: non-reentrant torch checkpointing); parameters
            are gathered again for the recomputation. Default False.
        offload_activations: with checkpointing on an accelerator, keep the checkpointed inputs
            in host memory until backward. Default False.
        max_device_bytes, max_host_bytes: budgets (bytes) that ``offload="auto"`` must fit in,
            instead of the measured free device memory and available RAM. Default None. On a
            CPU-only machine without ``max_device_bytes``, ``"auto"`` fits the device and host
            tiers together in ``max_host_bytes`` (both are host memory).
            ``max_host_bytes`` also bounds every placement's host tier (model states, pools,
            read-ahead and pipeline buffers, bytes in flight, as :mod:`offload_zero.plan`
            counts them): the optimizer state then streams in smaller chunks, then, where
            they were left to the engine (``left_to_engine``), ``update_timing`` falls back to
            ``"step"`` (no whole-state read-ahead ring) and ``prefetch`` to 0; a placement
            that cannot fit raises ValueError before allocating
            (:func:`offload_zero.host_budget.fit_host_budget`; ``memory_report()["host_budget"]``
            says what was lowered).
        grad_dtype: dtype of the gradient shards kept in host memory when offloading: float32
            (ZeRO-Offload's choice, the default) or bfloat16 (half the host bytes; the C++ Adam
            reads bf16 gradients directly). Ignored without offload (shards stay in ``dtype``).
        update_timing: when the optimizer update runs (see :mod:`offload_zero.update.rules`,
            where the rules below are written): ``"step"``, ``"backward"``, ``"next_forward"``
            or ``"auto"`` (default). Same numbers in every timing.

            ``"step"``: every update in :meth:`OffloadEngine.step` (the plain step).

            ``"backward"``: update each flat parameter as soon as its gradient shard is final
            in backward (FSDP's "optimizer in backward"). With the optimizer state on NVMe, a
            unit's state is read while the unit's backward runs and written back while the
            units before it run, so the step's I/O hides behind backward; a state too large for
            the read-ahead buffers (an LM head) is streamed chunk by chunk while the next units
            run, and fp32 parameter shards on NVMe are gathered for backward from the state
            read. The root unit's trainable parameters (split by gradient order in every mode:
            the LM head's weight, the rest of what runs after the blocks, the embeddings; see
            :func:`offload_zero.partition.units.split_by_gradient_order`) are updated as their
            gradients are final: the LM head's first, the embeddings' last. Needs stage >= 2,
            no ``max_grad_norm`` (the norm is known only after backward) and one ``backward``
            per ``step`` (no gradient accumulation).

            ``"next_forward"``: at stage 3, :meth:`OffloadEngine.step` decides the update
            (gradient clipping, the inf/nan check, the loss scale, the learning rate) but
            applies it to each unit lazily, just before the unit's parameters are next read
            (its gather or prefetch in the next forward, or whatever reads them first); the
            state of the next units is read ahead meanwhile, so with the optimizer state on
            NVMe the step's I/O overlaps the next forward's compute instead of stalling between
            backward and forward. Works with ``max_grad_norm`` and gradient accumulation
            (unlike ``"backward"``); the updated parameter shards stay in their read buffers
            for the gather. Of the root's parts, the input embeddings are updated as forward
            starts (their state in host memory by default, see ``tail_state_in_host``), and
            those used after the blocks (the LM head's weight, the final norm) stream their
            updates in chunks while the blocks run and are gathered only when their modules
            run (or a computation first reads their weights). Costs host memory: the gradient
            shards of the units not yet updated are held into the next forward, the read-ahead
            ring has three buffers of a block's whole state, and the embeddings' state stays in
            host memory by default. Needs stage 3.

            ``"auto"``: ``"next_forward"`` at stage 3 with the optimizer state on NVMe
            (``offload_optimizer="nvme"``), where the plain step's state I/O would stall
            between backward and forward; ``"step"`` otherwise
            (:func:`offload_zero.update.rules.default_timing`). With ``offload="auto"`` it is
            resolved with the placement. After construction the field holds the timing in
            force (never ``"auto"``); ``max_host_bytes`` may lower ``"backward"`` or
            ``"next_forward"`` chosen this way to ``"step"`` in the engine's build.
        tail_state_in_host: with ``update_timing`` ``"backward"`` or ``"next_forward"`` and
            the optimizer state on NVMe, keep the state (fp32 master weights, moments) of the flat parameter
            updated last in backward (the root's parameters used before the blocks: the input
            embeddings) in host memory instead of NVMe. Its gradient is final only when
            backward ends, and the next forward needs it first, so its reads and writes have no
            compute to hide behind; kept in memory it moves no bytes. Costs
            12 bytes per element of its shard in host RAM (2 less with bf16 masters; the
            master's bytes less when it is the parameter shard itself, on a CPU device). ``None`` (default): on when that state is
            at most a quarter of the model's (so the NVMe tier still holds most of it); True or
            False forces it (True where it cannot act warns).
        host_cache_bytes: with the optimizer state on NVMe, host memory (bytes, an int >= 0)
            that may hold the state of some flat parameters instead of their files: no I/O for
            those, the same numbers. It is filled in a fixed order (the root's parts: input
            embeddings, LM head; then the blocks from both ends of the update order), each flat
            parameter whose state fits in what is left, at 12 bytes per element of its shard (8
            with bf16 moments, 2 less with bf16 masters; the master's bytes less when it is the
            parameter shard itself, on a CPU device); the state
            ``tail_state_in_host`` keeps counts against it (see [Note: host cache] in
            :mod:`offload_zero.memory.host_cache`). A flat parameter whose state it keeps
            keeps its parameter shard in host memory too (not counted against it). With the
            parameter shards on NVMe, what the states leave holds frozen parameter shards
            (PEFT/LoRA's base weights), the blocks' first. The NVMe bytes read and written per
            step are then the state bytes of the flat parameters left on NVMe, each way;
            :meth:`OffloadEngine.memory_report` shows the split (``"host_cache"``). Unused
            (a UserWarning) when the optimizer state is not on NVMe. ``"auto"`` (with
            ``offload="auto"`` only): when the chosen placement puts the optimizer state on
            NVMe, half the host memory the measured budget leaves beside it (see
            :mod:`offload_zero.placement`). Default 0.
        optimizer_prefetch: with the optimizer state on NVMe and updates in backward or in
            the next forward, how many whole states (a block's master weights and moments:
            12 bytes per element of its shard with fp32 moments) are read ahead into host
            buffers (the ``optimizer_prefetch`` pool), an int >= 2 (>= 3 with
            ``"next_forward"``, or in fp32 with the parameter shards on NVMe and
            ``"backward"``). A deeper ring keeps the disk reading while earlier states are
            still being written: with ``"next_forward"`` the next forward's compute is all
            there is to hide a step's state reads and writes behind, and with three buffers
            a read may wait for the write-back that frees its buffer (measured gain: see
            docs/update_timing.md). Same numbers at any depth. Default None: 3 with
            ``"next_forward"``, else 2 (3 as above). Never more buffers than block flat
            parameters whose state streams (a model with two such gets two, whatever N;
            ``memory_report()["pools"]["optimizer_prefetch"]``). Unused (a UserWarning)
            without that ring.
        moment_dtype: ``"fp32"`` (default: exact AdamW, as torch's), ``"bf16"`` or ``"int8"``:
            the dtype of Adam's two moments wherever the optimizer state lives (host buffers, NVMe files,
            the read-ahead ring, the pipeline, checkpoints). bf16 moments are updated in fp32
            by the C++ kernel and stored with stochastic rounding (see
            :func:`offload_zero.optim.kernel.adam_step_`), so the state takes 8 bytes per
            parameter instead of 12 (4 fp32 master + 2 + 2): a third fewer bytes in RAM and on
            NVMe, and read and written per step. Not bit-identical to fp32 moments (the losses
            stay close; see the README); deterministic, and independent of how the update is
            chunked and of the world size. A checkpoint records its moments' dtype; loading
            one of the other dtype converts them (bf16 -> fp32 exactly, fp32 -> bf16 rounding
            to nearest). ``"int8"``: blockwise 8-bit moments (a dynamic 8-bit map and an fp32
            absmax per 256 elements, updated in the same fused pass with stochastic rounding;
            see :mod:`offload_zero.optim.int8_moments` and docs/moments.md): 6 bytes per
            parameter on NVMe and per step each way, 6.03 in host memory (the scales stay
            there); checkpoints hold them decoded as fp32, which encode back exactly. bf16 or
            int8 on an accelerator's optimizer state (``offload="none"`` with CUDA) raises
            NotImplementedError (its update runs in torch ops). ``"auto"`` (with
            ``offload="auto"`` only; ValueError otherwise): the placement picks the format with
            the split, fp32 unless a smaller one makes the estimated step faster by more than 5%
            of the compute (see :mod:`offload_zero.placement`); after construction the field
            holds the format in force.
        master_dtype: ``"fp32"`` (default: exact AdamW) or ``"bf16"`` (or ``torch.float32`` /
            ``torch.bfloat16``; the field then holds the name): the master weights' dtype. ``"bf16"`` needs ``dtype=torch.bfloat16`` (ValueError otherwise) and the
            optimizer state off an accelerator (NotImplementedError otherwise, as for
            ``moment_dtype``): the master is then the bf16 parameter shard itself, updated in
            fp32 by the C++ kernel and stored with stochastic rounding (random bits independent
            of the moments'; see [Note: bf16 master weights] in
            :mod:`offload_zero.memory.state_format`). 2 bytes per parameter less of state in
            memory and on NVMe; with the state and the parameters both on NVMe the parameter
            shards are read from the masters' bytes, so a step moves 6 bytes per parameter
            each way with bf16 moments (10 + 2 written, 8 + 2 read with an fp32 master), 4 with
            int8 moments. Not bit-identical to fp32 masters (losses in docs/moments.md);
            deterministic, independent of the chunking and the world size. Checkpoints hold
            the master as fp32 values (exact) and load across master dtypes (fp32 -> bf16
            rounds to nearest).
        workload: with ``offload="auto"``, what each rank computes: ``{"batch_size": B,
            "seq_len": T}`` (sequences per micro-batch on each rank, tokens per sequence; ints
            >= 1). The placement then counts one micro-batch's activations on the device (for
            a model whose ``config`` is a Llama-style decoder's, as ``offload-zero estimate``
            does) and picks the fitting placement with the fastest estimated step (compute
            from a timed matmul, NVMe bytes per step, the disk's probed rates; see
            :mod:`offload_zero.step_time`). ``activation_checkpointing``,
            ``offload_activations`` and ``gradient_accumulation_steps`` are read from their own
            fields. None (default): the first placement that fits, activations not counted.
            Unused (a UserWarning) with another ``offload``.
        loss_scale: ``"dynamic"``, a number > 0 (a static scale) or None: dynamic with
            ``dtype=torch.float16``, none otherwise. The loss is multiplied by the scale before
            backward and the gradients divided by it in the update (fused into the C++ Adam's
            pass); a step whose gradients hold an inf/nan on any rank is skipped whole and a
            dynamic scale halves (see :class:`offload_zero.optim.loss_scale.LossScaler`). With
            ``update_timing="backward"`` only the flat parameters with an inf/nan are skipped (the
            others were updated during backward). Default None.
        initial_loss_scale: the first dynamic scale, > 0. Default 2**16.
        loss_scale_window: steps without overflow before a dynamic scale doubles, >= 1.
            Default 2000.
        min_loss_scale: a dynamic scale never halves below this, > 0. Default 1.0.
        gradient_accumulation_steps: N >= 1, as DeepSpeed's: ``backward`` divides the loss by
            N and only every N-th ``step`` call updates (the others return without updating
            or zeroing), so a loop calling backward and step on each micro-batch trains as N
            accumulated micro-batches of their mean loss. Not with ``update_timing="backward"`` (its
            updates run in each backward). Default 1.
        left_to_engine: not an argument: the settings the user left to the engine, which
            ``max_host_bytes`` may lower (a frozenset of ``"update_timing"``, given as
            ``"auto"``, and ``"prefetch"``, not given; empty with ``offload="auto"``, whose
            placement fits the budget with the settings as they are).
    """

    offload: str = "none"
    path: Optional[str] = None
    stage: int = 3
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw: bool = True
    dtype: torch.dtype = torch.float32
    device: Optional[torch.device] = None
    prefetch: Optional[int] = None
    unit_classes: Tuple[type, ...] = ()
    leaf_modules: Tuple[object, ...] = ()
    check_collectives: bool = True
    max_grad_norm: Optional[float] = None
    aio_backend: str = "auto"
    aio_block_size: Optional[int] = None
    aio_queue_depth: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_param: Optional[str] = None
    activation_checkpointing: bool = False
    offload_activations: bool = False
    max_device_bytes: Optional[int] = None
    max_host_bytes: Optional[int] = None
    grad_dtype: torch.dtype = torch.float32
    update_timing: str = "auto"
    tail_state_in_host: Optional[bool] = None
    host_cache_bytes: object = 0
    optimizer_prefetch: Optional[int] = None
    moment_dtype: str = "fp32"
    master_dtype: str = "fp32"
    workload: Optional[dict] = None
    loss_scale: Optional[object] = None
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 2000
    min_loss_scale: float = 1.0
    gradient_accumulation_steps: int = 1
    left_to_engine: FrozenSet[str] = dataclasses.field(init=False, default=frozenset())

    def __post_init__(self):
        if self.offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload={self.offload!r} is not valid; choose one of {OFFLOAD_CHOICES}")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"path={self.path!r} is not valid; give the folder for NVMe swap "
                             "files as a str or os.PathLike, or None (no NVMe)")
        stage = _scalar(self.stage)
        if (isinstance(stage, bool) or not isinstance(stage, numbers.Integral)
                or stage not in STAGE_CHOICES):
            raise ValueError(f"stage={self.stage!r} is not valid; choose one of {STAGE_CHOICES}")
        object.__setattr__(self, "stage", int(stage))  # (numpy's ints too)
        if self.offload != "auto":
            if self.offload_optimizer is None:
                object.__setattr__(self, "offload_optimizer", self.offload)
            if self.offload_param is None:
                object.__setattr__(self, "offload_param",
                                   default_offload_param(self.offload, self.stage))
            for name in ("offload_optimizer", "offload_param"):
                value = getattr(self, name)
                if value not in TIER_CHOICES:
                    raise ValueError(f"{name}={value!r} is not valid; choose one of {TIER_CHOICES}")
            if self.offload_param != "none" and self.stage != 3:
                raise ValueError(f"offload_param={self.offload_param!r} needs stage=3 (parameters "
                                 f"are only partitioned at stage 3); got stage={self.stage}")
        for name in ("max_device_bytes", "max_host_bytes"):
            value = getattr(self, name)
            if value is not None:
                try:
                    object.__setattr__(self, name, check_int(name, value, 0))
                except ValueError:
                    raise ValueError(f"{name}={value!r} is not valid; it must be an int >= 0 "
                                     "(bytes) or None") from None
        if self.host_cache_bytes == "auto" and self.offload != "auto":
            raise ValueError(f"host_cache_bytes='auto' needs offload='auto' (it sizes the cache "
                             f"from the measured RAM the placement leaves); got "
                             f"offload={self.offload!r}: give a number of bytes")
        try:
            if self.host_cache_bytes != "auto":
                object.__setattr__(self, "host_cache_bytes",
                                   check_int("host_cache_bytes", self.host_cache_bytes, 0))
        except ValueError:
            raise ValueError(f"host_cache_bytes={self.host_cache_bytes!r} is not valid; it must "
                             "be an int >= 0 (bytes of host memory for optimizer state that "
                             "would otherwise be on NVMe), or 'auto' with offload='auto'") from None
        if self.optimizer_prefetch is not None:
            object.__setattr__(self, "optimizer_prefetch",
                               check_int("optimizer_prefetch", self.optimizer_prefetch, 2))
        if (self.host_cache_bytes and self.offload != "auto"
                and self.offload_optimizer != "nvme"):
            warnings.warn(f"host_cache_bytes={self.host_cache_bytes} is not used: the optimizer "
                          f"state is on {self.offload_optimizer!r}, not NVMe (set "
                          "offload='nvme' or offload_optimizer='nvme')", UserWarning,
                          stacklevel=4)
        self._check_moments_and_workload()
        _check_float(self, "lr", low=0.0)
        try:
            betas = tuple(self.betas)
        except TypeError:
            betas = ()
        if len(betas) != 2:
            raise ValueError(f"betas={self.betas!r} must be a pair (beta1, beta2), each in [0, 1)")
        object.__setattr__(self, "betas", tuple(check_number(f"betas[{i}]", b, 0.0, high=1.0)
                                                for i, b in enumerate(betas)))
        _check_float(self, "eps", low=0.0)
        _check_float(self, "weight_decay", low=0.0)
        if self.grad_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"grad_dtype={self.grad_dtype!r} is not valid; choose torch.float32 or torch.bfloat16")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype={self.dtype!r} is not valid; choose one of {DTYPE_CHOICES}")
        left = {"prefetch"} if self.prefetch is None and self.offload != "auto" else set()
        object.__setattr__(self, "prefetch", 1 if self.prefetch is None
                           else check_int("prefetch", self.prefetch, 0))
        if self.max_grad_norm is not None:
            _check_float(self, "max_grad_norm", low=0.0, low_inclusive=False)
        for name in ("adamw", "activation_checkpointing", "offload_activations",
                     "tail_state_in_host"):
            _check_bool(self, name, automatic=name == "tail_state_in_host")
        object.__setattr__(self, "gradient_accumulation_steps", check_int(
            "gradient_accumulation_steps", self.gradient_accumulation_steps, 1))
        from offload_zero.update import rules
        if self.update_timing == rules.AUTO and self.offload != "auto":
            left.add("update_timing")
        object.__setattr__(self, "left_to_engine", frozenset(left))
        # (offload="auto": "auto" stays until the placement knows the optimizer tier)
        object.__setattr__(self, "update_timing", rules.resolve(
            self.update_timing, self.stage, self.offload_optimizer))
        rules.check(self.update_timing, self.stage, self.gradient_accumulation_steps,
                    self.max_grad_norm)
        from offload_zero.optim.loss_scale import finite_positive
        if self.loss_scale not in (None, "dynamic") and not finite_positive(self.loss_scale):
            raise ValueError(f"loss_scale={self.loss_scale!r} is not valid; use 'dynamic', a "
                             "finite number > 0 (a static scale) or None (dynamic with float16)")
        if self.aio_backend not in AIO_BACKENDS:
            raise ValueError(f"aio_backend={self.aio_backend!r} is not valid; choose one of {AIO_BACKENDS}")
        if self.aio_block_size is not None and (self.aio_block_size <= 0 or self.aio_block_size % 4096):
            raise ValueError(f"aio_block_size={self.aio_block_size!r} must be a positive multiple "
                             f"of 4096 bytes, or None to probe the device")
        if self.aio_queue_depth is not None and self.aio_queue_depth < 1:
            raise ValueError(f"aio_queue_depth={self.aio_queue_depth!r} must be >= 1, or None to probe the device")
        scaler = self.make_loss_scaler()  # validates initial_loss_scale, loss_scale_window, ...
        if scaler is None or not scaler.dynamic:
            knobs = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                     if f.name in ("initial_loss_scale", "loss_scale_window", "min_loss_scale")
                     and getattr(self, f.name) != f.default]
            if knobs:
                why = ("loss scaling is off (it is on by default only with dtype=torch.float16, "
                       "or with loss_scale='dynamic')" if scaler is None else
                       f"the loss scale is static (loss_scale={self.loss_scale!r})")
                warnings.warn(f"{', '.join(knobs)} not used: {why}", UserWarning, stacklevel=4)
        object.__setattr__(self, "unit_classes", tuple(self.unit_classes))
        for cls in self.unit_classes:
            if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
                raise ValueError(f"unit_classes entry {cls!r} is not a torch.nn.Module subclass")
        if isinstance(self.leaf_modules, (str, type)):
            object.__setattr__(self, "leaf_modules", (self.leaf_modules,))
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))
        for leaf in self.leaf_modules:
            if not (isinstance(leaf, str) or (isinstance(leaf, type)
                                              and issubclass(leaf, torch.nn.Module))):
                raise ValueError(f"leaf_modules entry {leaf!r} is neither a torch.nn.Module "
                                 "subclass nor a qualified module name (str)")
        if not isinstance(self.check_collectives, bool):
            raise ValueError(f"check_collectives={self.check_collectives!r} must be True or False")
        object.__setattr__(self, "device", _resolve_device(self.device))
        if (self.moment_dtype in ("bf16", "int8") and self.offload_optimizer == "none"
                and self.device.type != "cpu"):
            raise NotImplementedError(
                f"moment_dtype={self.moment_dtype!r} with the optimizer state on {self.device} "
                "(offload_optimizer='none'): its update runs in torch ops, which have no "
                "stochastically rounded bf16 or 8-bit moments; use offload='cpu' or 'nvme', or "
                "moment_dtype='fp32'")
        if (self.master_dtype == "bf16" and self.offload_optimizer == "none"
                and self.device.type != "cpu"):
            raise NotImplementedError(
                f"master_dtype='bf16' with the optimizer state on {self.device} "
                "(offload_optimizer='none'): its update runs in torch ops, which have no "
                "stochastically rounded bf16 master weights; use offload='cpu' or 'nvme', or "
                "master_dtype='fp32'")
        # name the setting that asked for NVMe: offload="nvme" alone, or the finer keywords
        nvme = [f"{k}='nvme'" for k, v in (("offload_optimizer", self.offload_optimizer),
                                           ("offload_param", self.offload_param)) if v == "nvme"]
        asks = ["offload='nvme'"] if nvme and self.offload == "nvme" else nvme
        if asks:
            _check_swap_path(self.path, " and ".join(asks))
        elif self.path is not None and self.offload != "auto":
            fix = ("set offload_optimizer or offload_param to 'nvme'" if self.offload == "nvme"
                   else "set offload='nvme'")
            warnings.warn(f"path={os.fspath(self.path)!r} is not used: offload={self.offload!r} "
                          f"(optimizer state on {self.offload_optimizer!r}, parameters on "
                          f"{self.offload_param!r}) puts nothing on NVMe; {fix} to use it",
                          UserWarning, stacklevel=4)

    def lowered(self, update_timing: str, prefetch: int) -> "EngineConfig":
        """This config with the ``update_timing`` and ``prefetch`` a host budget left in force
        (see :func:`offload_zero.host_budget.fit_host_budget`): ``self`` when they are
        unchanged, else a copy holding them (validated already; ``left_to_engine`` kept), which
        the engine's build and the engine then use, so that ``engine.config`` says what runs. Raises
        RuntimeError (an internal error) for a change of a setting not in
        ``left_to_engine``."""
        changes = {name: value for name, value in (("update_timing", update_timing),
                                                   ("prefetch", prefetch))
                   if value != getattr(self, name)}
        if not changes:
            return self
        for name, value in changes.items():
            if name not in self.left_to_engine:
                raise RuntimeError(f"internal error: {name}={getattr(self, name)!r} was "
                                   f"given, the host budget may not change it to {value!r}")
        out = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(out, name, value)  # (a fresh copy: no one else holds it yet)
        return out

    def _check_moments_and_workload(self) -> None:
        """Validate (and normalise) ``moment_dtype``, ``master_dtype`` and ``workload``."""
        from offload_zero.memory.state_format import (MASTER_DTYPES, MOMENT_DTYPES,
                                                      master_dtype_of, moment_dtype_of)
        master = master_dtype_of(self.master_dtype)
        object.__setattr__(self, "master_dtype",
                           next(k for k, v in MASTER_DTYPES.items() if v == master))
        # (an invalid dtype is named by its own check)
        if (self.master_dtype == "bf16" and self.dtype in DTYPE_CHOICES
                and self.dtype != torch.bfloat16):
            raise ValueError(f"master_dtype='bf16' needs bf16 compute (the master is the bf16 "
                             f"parameter shard itself); got dtype={self.dtype}: compute in bf16 "
                             "(dtype=torch.bfloat16; OffloadTrainer: TrainingArguments(bf16="
                             "True); a DeepSpeed config: bf16.enabled), or master_dtype='fp32' "
                             "(DeepSpeed: bf16_master_weights_and_grads false)")
        if self.moment_dtype == "auto":
            if self.offload != "auto":
                raise ValueError(f"moment_dtype='auto' needs offload='auto' (the placement "
                                 f"chooses the format with the split); got "
                                 f"offload={self.offload!r}: choose one of "
                                 f"{tuple(MOMENT_DTYPES)}")
        else:
            try:
                moments = moment_dtype_of(self.moment_dtype)
            except ValueError as exc:
                raise ValueError(f"{exc}; or 'auto' with offload='auto'") from None
            object.__setattr__(self, "moment_dtype",
                               next(k for k, v in MOMENT_DTYPES.items() if v == moments))
        if self.workload is None:
            return
        keys = ("batch_size", "seq_len")
        if not isinstance(self.workload, dict) or set(self.workload) != set(keys):
            raise ValueError(f"workload={self.workload!r} is not valid; give a dict with the "
                             f"keys {keys} (ints >= 1), or None")
        object.__setattr__(self, "workload", {k: check_int(f"workload[{k!r}]",
                                                           self.workload[k], 1) for k in keys})
        if self.offload != "auto":
            warnings.warn(f"workload={self.workload!r} is not used: only offload='auto' reads "
                          f"it (got offload={self.offload!r})", UserWarning, stacklevel=5)

    @property
    def auto_workload(self):
        """``workload`` with this config's activation checkpointing, activation offload and
        gradient accumulation, as a :class:`offload_zero.step_time.Workload` (what
        ``offload="auto"`` reads), or None without a workload."""
        if self.workload is None:
            return None
        from offload_zero.step_time import Workload
        return Workload(self.workload["batch_size"], self.workload["seq_len"],
                        self.activation_checkpointing, self.offload_activations,
                        self.gradient_accumulation_steps)

    def make_loss_scaler(self):
        """The :class:`offload_zero.optim.loss_scale.LossScaler` that ``loss_scale`` and
        ``dtype`` ask for, or None (no scaling). Raises ValueError for an invalid
        ``initial_loss_scale``, ``loss_scale_window`` or ``min_loss_scale``."""
        from offload_zero.optim.loss_scale import LossScaler
        mode = self.loss_scale
        if mode is None:
            mode = "dynamic" if self.dtype == torch.float16 else None
        if mode is None:
            return None
        try:
            if mode == "dynamic":
                return LossScaler(self.initial_loss_scale, dynamic=True,
                                  growth_interval=self.loss_scale_window,
                                  min_scale=self.min_loss_scale)
            return LossScaler(float(mode), dynamic=False, min_scale=min(float(mode), 1.0),
                              max_scale=max(float(mode), 2.0 ** 24))
        except ValueError as exc:  # name the engine's keywords, not the scaler's
            msg = str(exc).replace("init_scale", "initial_loss_scale").replace(
                "growth_interval", "loss_scale_window").replace("min_scale", "min_loss_scale")
            raise ValueError(msg) from None

    @property
    def master_torch_dtype(self) -> torch.dtype:
        """``master_dtype`` as a torch dtype (float32 or bfloat16)."""
        from offload_zero.memory.state_format import MASTER_DTYPES
        return MASTER_DTYPES[self.master_dtype]

    @property
    def moment_torch_dtype(self) -> torch.dtype:
        """``moment_dtype`` as a torch dtype (float32, bfloat16, or uint8: int8's codes)."""
        from offload_zero.memory.state_format import MOMENT_DTYPES
        return MOMENT_DTYPES[self.moment_dtype]

    @property
    def optimizer_tier(self) -> Tier:
        """Tier of the fp32 master weights and moments."""
        return _TIERS[self.offload_optimizer]

    @property
    def param_tier(self) -> Tier:
        """Tier of the compute-dtype parameter shards."""
        return _TIERS[self.offload_param]

    @property
    def grad_tier(self) -> Tier:
        """Tier of the reduced gradient shards (fp32 on the host when offloading)."""
        return Tier.DEVICE if self.offload_optimizer == "none" else Tier.HOST


_TIERS = {offload: Tier(tier) for offload, tier in TIER_OF_OFFLOAD.items()}


def _scalar(value):
    """A 0-d torch tensor or numpy array as its Python number (torch.optim takes a tensor lr);
    anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype is not torch.bool:
        return value.item()
    if (type(value).__module__ == "numpy" and getattr(value, "shape", None) == ()
            and getattr(value, "dtype", None) is not None and value.dtype.kind in "iuf"):
        return value.item()
    return value


def check_number(name: str, value, low: float, low_inclusive: bool = True,
                 high: Optional[float] = None) -> float:
    """``value`` as a Python float, if it is a finite real number (Python's, numpy's, or a 0-d
    tensor or array; not a bool) above ``low`` (or at it, ``low_inclusive``) and below
    ``high`` when given. Raises ValueError naming ``name``, the value and the valid range (an
    inf learning rate would otherwise poison every weight at the next update)."""
    x = _scalar(value)
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    ok = ok and (x >= low if low_inclusive else x > low) and (high is None or x < high)
    if not ok:
        rel = ">=" if low_inclusive else ">"
        below = "" if high is None else f" and < {high}"
        raise ValueError(f"{name}={value!r} is not valid; it must be a finite number "
                         f"{rel} {low}{below}")
    return float(x)


def _check_float(cfg, name: str, low: float, low_inclusive: bool = True) -> None:
    """Check ``cfg.<name>`` with :func:`check_number` and store it as a Python float."""
    object.__setattr__(cfg, name, check_number(name, getattr(cfg, name), low, low_inclusive))


def warn_user(message: str, category=UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside this package
    (the user's call that led here, however deep the engine's build is). ``message``: the
    text; ``category``: a Warning subclass (default UserWarning). Returns None; raises only
    what ``warnings.warn`` raises (the category itself under an "error" filter)."""
    import sys
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def check_int(name: str, value, low: int) -> int:
    """``value`` as a Python int, if it is an integer (Python's, numpy's, or a 0-d tensor or
    array; not a bool) >= ``low``. Raises ValueError naming ``name``, the value and the valid range."""
    x = _scalar(value)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < low:
        raise ValueError(f"{name}={value!r} is not valid; it must be an int >= {low}")
    return int(x)


def check_switch(name: str, value, automatic: Optional[str] = None) -> Optional[bool]:
    """``value`` as a Python bool (numpy's bool too), or None where ``automatic`` names what
    None means. Raises ValueError naming ``name``, the value and what is valid (a string
    such as 'no' would otherwise count as true)."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        value = bool(value)
    if not (isinstance(value, bool) or (automatic and value is None)):
        valid = f"None ({automatic}), True or False" if automatic else "True or False"
        raise ValueError(f"{name}={value!r} is not valid; use {valid}")
    return value


def _check_bool(cfg, name: str, automatic: bool = False) -> None:
    """Check ``cfg.<name>`` with :func:`check_switch` and store it as a Python bool."""
    value = check_switch(name, getattr(cfg, name), "automatic" if automatic else None)
    object.__setattr__(cfg, name, value)


def _resolve_device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a valid torch device: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asks for CUDA, but CUDA is not available here")
    return dev


def _check_swap_path(path, asked_by: str = "offload='nvme'") -> None:
    if path is None:
        raise ValueError(f"{asked_by} needs path=<folder for swap files>; got path=None")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path={path!r} does not exist or is not a folder; {asked_by} needs an "
                         "existing writable folder")
    require_writable(path, f"path={path!r}", f"{asked_by} needs an existing folder this "
                     "process can write to: give another path=")


def require_writable(folder, what: str, fix: str) -> None:
    """Raise ValueError ``"<what> is not writable (creating a file there: <OS error>); <fix>"``
    unless a file can be created in the existing folder ``folder`` (:func:`write_error`)."""
    error = write_error(folder)
    if error is not None:
        raise ValueError(f"{what} is not writable (creating a file there: {error}); {fix}")


def write_error(folder) -> Optional[str]:
    """Why no file can be created in the existing folder ``folder`` (the OS error, as
    ``"[Errno 13] Permission denied"``), or None when one can: found by creating (and at once
    removing) an empty file there, the only test that holds everywhere. ``os.access`` passes
    for root on read-only file systems and on virtual ones such as ``/proc``, where every
    write then fails."""
    import tempfile
    try:
        fd, name = tempfile.mkstemp(prefix=".offload-zero-write-test-", dir=os.fspath(folder))
    except OSError as exc:
        return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
    os.close(fd)
    try:
        os.remove(name)
    except OSError:
        pass
    return None
