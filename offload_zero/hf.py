"""``OffloadTrainer``: a ``transformers.Trainer`` that trains through an :class:`OffloadEngine`.

The two-line change from a Trainer script::

    from offload_zero.hf import OffloadTrainer
    trainer = OffloadTrainer(model=model, args=args, train_dataset=ds,
                             offload="nvme", path="/nvme/swap")      # or deepspeed="ds.json"

The Trainer keeps its loop, data loaders, logging, callbacks, evaluation and checkpoint
rotation; the engine owns the model's parameters, gradients, optimizer and their placement.
What changes, through the Trainer's own extension points:

- ``create_optimizer``: ``trainer.optimizer`` is ``engine.optimizer`` (AdamW with the
  Trainer's two parameter groups, see :mod:`offload_zero.trainer_args`); ``create_scheduler``
  puts the Trainer's schedule (``lr_scheduler_type``, warmup) on it, or a DeepSpeed config's
  schedule, which the Trainer's loop steps as it steps its own.
- ``training_step``: the Trainer's loss (``compute_loss``, its scaling for gradient
  accumulation and ``num_items_in_batch``) goes to ``engine.backward``; the loop's
  ``optimizer.step()`` at each accumulation boundary is the engine's update, which clips by
  ``max_grad_norm`` (the global norm over every rank's shards, logged as ``grad_norm``).
- the model is never handed to ``accelerator.prepare`` (no DDP, no autocast): the engine
  reduces gradients across ranks and computes in its dtype (``bf16``/``fp16``: bfloat16 /
  float16 compute, float32 master weights, as DeepSpeed's mixed precision). The data loaders
  are still prepared by accelerate, so every rank sees the batches it would under DDP.
- checkpoints: ``checkpoint-N/`` holds the Trainer's files (``trainer_state.json``,
  ``optimizer.pt`` with the groups' values, ``scheduler.pt``, ``rng_state*.pth``), the model as
  a Hugging Face folder, and :data:`ENGINE_DIR` (``engine.save_checkpoint``: master weights,
  moments, step counts). ``resume_from_checkpoint`` loads it: the run continues bit for bit.
- ``save_model`` writes the Hugging Face folder with the engine's streamed ``save_pretrained``
  (in the dtype the model's parameters had when wrapped), from every rank (it is collective).
"""
from __future__ import annotations

import inspect
import os
import re
from typing import Any, Dict, Optional

import torch
from transformers import Trainer

from offload_zero import trainer_args as targs

ENGINE_DIR = "offload_zero"
"""The engine checkpoint's folder inside each ``checkpoint-N/``."""
_STAGING = ".offload_zero_export"
_WEIGHTS_RE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
_TRAINER_KEYWORDS = frozenset(inspect.signature(Trainer.__init__).parameters) - {"self"}


class OffloadTrainer(Trainer):
    """``transformers.Trainer`` that trains ``model`` through an :class:`OffloadEngine`.

    Args:
        model: the model (a ``torch.nn.Module``; transformers models keep their API while
            wrapped). Required (``model_init`` is not supported).
        args: ``TrainingArguments``. Honoured: ``learning_rate``, ``weight_decay`` (HF's
            no-decay groups), ``adam_beta1``/``adam_beta2``/``adam_epsilon``,
            ``lr_scheduler_type`` and warmup, ``gradient_accumulation_steps``,
            ``max_grad_norm``, ``bf16``/``fp16`` (the engine's compute dtype),
            ``activation_checkpointing`` (the engine's), evaluation, ``save_steps`` /
            ``save_only_model`` / ``resume_from_checkpoint``, and torchrun with any number of
            ranks. What cannot be honoured raises at construction
            (:func:`offload_zero.trainer_args.check_supported`).
        deepspeed: a DeepSpeed config (dict, or path to its JSON file), read by
            :func:`offload_zero.deepspeed_config.parse_deepspeed_config`; its ``"auto"``
            values come from ``args`` as in Hugging Face's DeepSpeed integration, and a value
            that disagrees with ``args`` is a ValueError. Its ``optimizer`` section, when
            given, puts every trainable parameter in one group (as DeepSpeed's optimizer
            does); its ``scheduler`` section replaces ``lr_scheduler_type``.
        offload, path, stage: the engine's placement (see :class:`OffloadEngine`); defaults
            ``"none"``, None, 3, or the DeepSpeed config's.
        **kwargs: the Trainer's keyword arguments (``train_dataset``, ``eval_dataset``,
            ``data_collator``, ``processing_class``, ``callbacks``, ``compute_metrics``, ...);
            any other keyword goes to the engine (``prefetch``, ``moment_dtype``,
            ``host_cache_bytes``, ``grad_dtype``, ...).

    Attributes:
        engine: the :class:`OffloadEngine` (built at construction). ``trainer.model`` stays the
            model; ``trainer.optimizer`` is ``engine.optimizer``. Call ``trainer.engine.close()``
            when done to release its memory and NVMe files at once (else at garbage collection).

    Raises:
        ValueError: an engine keyword that ``TrainingArguments`` sets (``lr=``, ``dtype=``, ...:
            the argument to use is named), ``TrainingArguments.deepspeed``, a bad DeepSpeed
            config or engine setting (named).
        NotImplementedError: an argument the engine cannot honour (``optim="adafactor"``,
            ``fsdp``, ``torch_compile``, ...), named.
    """

    def __init__(self, model=None, args=None, *trainer_args, deepspeed=None,
                 offload: Optional[str] = None, path=None, stage: Optional[int] = None,
                 **kwargs):
        if model is None or kwargs.get("model_init") is not None:
            raise NotImplementedError("OffloadTrainer needs model=... (model_init is not "
                                      "supported: the engine wraps one model)")
        if trainer_args:
            raise ValueError("OffloadTrainer takes model and args by position; give the "
                             "Trainer's other arguments by keyword")
        trainer_kwargs = {k: v for k, v in kwargs.items() if k in _TRAINER_KEYWORDS}
        engine_kwargs = {k: v for k, v in kwargs.items() if k not in _TRAINER_KEYWORDS}
        engine_kwargs.update({k: v for k, v in (("offload", offload), ("path", path),
                                                ("stage", stage)) if v is not None})
        if args is None:
            from transformers import TrainingArguments
            args = TrainingArguments(output_dir="tmp_trainer")
        targs.check_supported(args, engine_kwargs, trainer_kwargs)
        targs.check_engine_keywords(engine_kwargs, _TRAINER_KEYWORDS)
        self._deepspeed = deepspeed
        self._engine_kwargs = engine_kwargs
        self._export_dtype = next((p.dtype for p in model.parameters()
                                   if p.is_floating_point()), torch.float32)
        self.engine = None
        super().__init__(model=model, args=args, **trainer_kwargs)
        # the engine recomputes the blocks itself; the Trainer must not enable transformers'
        # checkpointing on the model too (see train())
        self._activation_checkpointing = bool(self.args.activation_checkpointing)
        self.engine = self._build_engine(model)
        self.optimizer = self.engine.optimizer
        self.callback_handler.optimizer = self.optimizer

    # -- construction ----------------------------------------------------------------------
    def _build_engine(self, model):
        """The engine for ``model``: ``args`` mapped (:mod:`offload_zero.trainer_args`), with
        the DeepSpeed config's settings when one was given."""
        from offload_zero.engine import OffloadEngine
        settings = targs.engine_settings(self.args)
        groups = targs.decay_groups(self, model)
        if self._deepspeed is None:
            return OffloadEngine(model, param_groups=groups, **settings,
                                 **self._engine_kwargs)
        ds = self._parse_deepspeed()
        if any(k.startswith("optimizer.") for k in _given_keys(self._deepspeed)):
            groups = None  # (DeepSpeed's optimizer: one group of every trainable parameter)
        fixed = {k: settings[k] for k in ("device", "activation_checkpointing",
                                          "gradient_accumulation_steps")}
        engine = ds.build(model, param_groups=groups, **fixed)
        engine.lr_scheduler = None  # (the Trainer's loop steps the schedule: create_scheduler)
        return engine

    def _parse_deepspeed(self, max_steps: Optional[int] = None):
        from offload_zero.deepspeed_config import parse_deepspeed_config
        overrides, fallbacks = targs.deepspeed_overrides(self.args, max_steps)
        overrides.update(self._engine_kwargs)
        return parse_deepspeed_config(self._deepspeed, overrides, fallbacks)

    def _move_model_to_device(self, model, device):
        """Nothing: the engine places the parameters (a full copy on the device first would
        defeat the offload)."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """The engine, for the evaluation and prediction loops (they call it and its
        ``.eval()``); being another object than ``self.model``, it is not handed to
        ``accelerator.prepare_model``. (Training gets the model from
        :meth:`_prepare_for_training`; :meth:`training_step` runs the engine.)"""
        return self.engine if self.engine is not None else model

    def create_optimizer(self, model=None):
        """``engine.optimizer`` (built with the engine, see :class:`OffloadTrainer`)."""
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's schedule on ``engine.optimizer``; with a DeepSpeed config that has a
        ``scheduler``, that one (its ``"auto"`` steps from ``num_training_steps`` and the
        warmup arguments), as a ``LambdaLR`` the Trainer's loop steps after each update."""
        if self.lr_scheduler is None and self._deepspeed is not None:
            schedule = self._parse_deepspeed(num_training_steps).schedule
            if schedule is not None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.engine.optimizer,
                                                                      schedule)
                self._created_lr_scheduler = True
                return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    # -- training ----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        """``Trainer.train``, with the Trainer's own activation checkpointing left off (the
        engine's is on when ``args.activation_checkpointing``)."""
        self.args.activation_checkpointing = False
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        finally:
            self.args.activation_checkpointing = self._activation_checkpointing

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The optimizer (the engine's), the schedule, and on resume the Trainer's optimizer
        and scheduler files (the engine's state was loaded by :meth:`_load_from_checkpoint`);
        nothing goes through ``accelerator.prepare`` but the data loader, already prepared."""
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.engine
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        # (the loop counts and zeroes the model's parameters; training_step runs the engine)
        return self.model, train_dataloader

    def training_step(self, model, inputs: Dict[str, Any], num_items_in_batch=None):
        """One micro-batch through the engine (``model``, the wrapped model, is not called
        itself): the Trainer's ``compute_loss``, divided by the micro-batches of this update
        unless it is already normalised over them (``num_items_in_batch``), then
        ``engine.backward``. Returns the loss (detached), as the Trainer logs it."""
        self.engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(self.engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                      or self.compute_loss_func is not None)
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        self.engine.backward(loss)
        return loss.detach()

    def _clip_grad_norm(self, model):
        """Nothing here: the engine clips in its update (``max_grad_norm``)."""
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        """None here: the norm is the engine's, known after the update (see
        :meth:`_maybe_log_save_evaluate`)."""
        return None

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        """The Trainer's, with ``grad_norm`` the engine's global gradient norm of the last
        update (before clipping; with ``max_grad_norm`` set, as the Trainer logs it)."""
        if self.engine.config.max_grad_norm is not None:
            grad_norm = getattr(self.engine, "last_grad_norm", None)
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # -- checkpoints and export ----------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint into ``output_dir/offload_zero`` (every rank), then the
        Trainer's ``optimizer.pt`` (the groups' values) and ``scheduler.pt``."""
        os.makedirs(output_dir, exist_ok=True)
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))
        super()._save_optimizer_and_scheduler(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Load the engine's checkpoint in ``resume_from_checkpoint/offload_zero`` (master
        weights, moments, step counts: training continues exactly). A checkpoint without
        one (written by another trainer) loads its model weights through the Trainer's own
        code, into the master weights; the moments then start afresh (a warning says so)."""
        folder = os.path.join(resume_from_checkpoint, ENGINE_DIR)
        if os.path.isdir(folder):
            self.engine.load_checkpoint(folder)
            return
        import warnings
        warnings.warn(f"{resume_from_checkpoint!r} holds no {ENGINE_DIR}/ engine checkpoint: "
                      "loading its model weights only (Adam's moments start afresh)",
                      UserWarning, stacklevel=2)
        super()._load_from_checkpoint(resume_from_checkpoint, self.model)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write the model to ``output_dir`` (default ``args.output_dir``) as a Hugging Face
        folder: the engine's streamed ``save_pretrained`` (one flat parameter gathered at a
        time; in the dtype the model's parameters had; a PEFT model: its adapter, peft's
        folder), then, on the main process, the
        processing class and ``training_args.bin``. Collective: every rank calls it, as the
        Trainer does. Weight files of an earlier export there are replaced, others kept."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        self._export(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            from transformers.trainer import TRAINING_ARGS_NAME
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _export(self, output_dir: str) -> None:
        """``engine.save_pretrained`` into a staging folder inside ``output_dir``, whose files
        rank 0 then moves up (``output_dir`` may hold checkpoints and other files, which an
        export folder of its own could not). A PEFT model's adapter instead, as transformers'
        Trainer saves one: peft's ``save_pretrained`` on every rank (it reads the wrapped
        model's state_dict), written by rank 0 (``engine.save_pretrained`` refuses PEFT
        models: their names are not transformers' layout)."""
        os.makedirs(output_dir, exist_ok=True)
        if hasattr(self.engine.module, "peft_config"):
            self.engine.module.save_pretrained(output_dir, is_main_process=self.engine.rank == 0)
            return
        staging = os.path.join(output_dir, _STAGING)
        self.engine.save_pretrained(staging, dtype=self._export_dtype)
        if self.engine.rank != 0:
            return
        new = set(os.listdir(staging))
        for name in os.listdir(output_dir):  # (an earlier export's shards, now stale)
            if _WEIGHTS_RE.fullmatch(name) and name not in new:
                os.remove(os.path.join(output_dir, name))
        for name in new:
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        os.rmdir(staging)


def _given_keys(config) -> list:
    """The dotted key paths of a DeepSpeed config (a dict, or a JSON file's)."""
    from offload_zero.deepspeed_config import load_config

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from walk(v, prefix + k + ".")
            else:
                yield prefix + k

    return list(walk(load_config(config), ""))
