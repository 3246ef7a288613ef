"""``transformers.TrainingArguments`` as :class:`~offload_zero.OffloadEngine` settings, for
:class:`offload_zero.hf.OffloadTrainer`.

:func:`check_supported` refuses, before anything is built, what the engine cannot honour (an
optimizer other than AdamW, FSDP, DataParallel, ...), naming the argument. :func:`engine_settings`
maps the rest: AdamW's ``lr``, ``betas``, ``eps`` and the two parameter groups of the Trainer's
own ``create_optimizer`` (weight decay on :meth:`Trainer.get_decay_parameter_names`, none on
biases and norms), the compute dtype (``bf16``/``fp16``), ``max_grad_norm`` and
``activation_checkpointing``. Gradient accumulation stays the Trainer's: its loop calls
``backward`` once per micro-batch and ``optimizer.step()`` once per update, with its own
scaling of the loss, so the engine is built with ``gradient_accumulation_steps=1``.

A DeepSpeed config (:func:`deepspeed_overrides`) has its ``"auto"`` values filled from the
arguments as Hugging Face's own DeepSpeed integration fills them, and a value it gives that
disagrees with the arguments is a ValueError (as there).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

# TrainingArguments.optim values whose update is torch's AdamW (the engine's C++ AdamW)
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# engine keywords that TrainingArguments decides (the argument to use instead)
FROM_ARGS = {"lr": "learning_rate", "betas": "adam_beta1/adam_beta2", "eps": "adam_epsilon",
             "weight_decay": "weight_decay", "adamw": "optim", "dtype": "bf16/fp16",
             "max_grad_norm": "max_grad_norm", "device": "the device TrainingArguments sets up",
             "gradient_accumulation_steps": "gradient_accumulation_steps",
             "activation_checkpointing": "activation_checkpointing",
             "param_groups": "weight_decay (HF's no-decay groups)"}


def check_supported(args, engine_kwargs: Dict[str, Any], trainer_kwargs: Dict[str, Any]) -> None:
    """Raise for what :class:`OffloadTrainer` cannot honour, naming the argument and what to
    use instead: NotImplementedError for a valid Trainer feature the engine does not have
    (``optim`` other than AdamW, ``optim_args``, FSDP, ``torch_compile``, ``fp16_full_eval`` /
    ``bf16_full_eval``, several GPUs in one process, ``model_init``, an ``optimizers`` or
    ``optimizer_cls_and_kwargs`` of one's own, ``activation_checkpointing_kwargs`` other than
    ``use_reentrant``), ValueError for an engine keyword that ``TrainingArguments`` sets
    (:data:`FROM_ARGS`) or ``TrainingArguments.deepspeed`` (give the config to the trainer)."""
    for key, instead in FROM_ARGS.items():
        if key in engine_kwargs:
            raise ValueError(f"OffloadTrainer({key}=...): set TrainingArguments' {instead} "
                             "instead (the trainer passes it to the engine)")
    if getattr(args, "deepspeed", None):
        raise ValueError(f"TrainingArguments(deepspeed={args.deepspeed!r}) would start "
                         "DeepSpeed's own engine: leave it unset and pass the config as "
                         "OffloadTrainer(..., deepspeed=...)")
    optim = getattr(args.optim, "value", args.optim)  # (an OptimizerNames member)
    if optim not in ADAMW_OPTIMS:
        raise NotImplementedError(f"TrainingArguments(optim={optim!r}) is not "
                                  f"supported: the engine runs AdamW; use optim in "
                                  f"{ADAMW_OPTIMS}")
    refused = [("optim_args", args.optim_args, "AdamW takes no further arguments here"),
               ("fsdp", args.fsdp, "the engine shards the model itself"),
               ("torch_compile", args.torch_compile, "the engine's hooks run eagerly"),
               ("fp16_full_eval", args.fp16_full_eval, "evaluation runs in the compute dtype"),
               ("bf16_full_eval", args.bf16_full_eval, "evaluation runs in the compute dtype")]
    for name, value, why in refused:
        if value:
            raise NotImplementedError(f"TrainingArguments({name}={value!r}) is not supported "
                                      f"with OffloadTrainer: {why}")
    if args.n_gpu > 1:
        raise NotImplementedError(f"{args.n_gpu} GPUs in one process (torch DataParallel): run "
                                  "one process per GPU with torchrun")
    extra = sorted(set(args.activation_checkpointing_kwargs or {}) - {"use_reentrant"})
    if extra:
        raise NotImplementedError(f"TrainingArguments(activation_checkpointing_kwargs) keys "
                                  f"{extra} are not supported: the engine recomputes each "
                                  "block (non-reentrant torch checkpointing)")
    for name in ("model_init", "optimizer_cls_and_kwargs"):
        if trainer_kwargs.get(name) is not None:
            raise NotImplementedError(f"OffloadTrainer({name}=...) is not supported: the "
                                      "engine wraps one model and runs its own AdamW")
    optimizers = trainer_kwargs.get("optimizers", (None, None))
    if tuple(optimizers) != (None, None):
        raise NotImplementedError("OffloadTrainer(optimizers=...) is not supported: the "
                                  "optimizer is the engine's (trainer.optimizer), and the "
                                  "schedule comes from lr_scheduler_type (or override "
                                  "create_scheduler)")


def check_engine_keywords(engine_kwargs: Dict[str, Any], trainer_keywords) -> None:
    """Raise ValueError for a keyword that is neither the Trainer's (``trainer_keywords``) nor
    the engine's, naming it and both lists (before anything is built)."""
    import dataclasses
    from offload_zero.config import EngineConfig
    engine = {f.name for f in dataclasses.fields(EngineConfig)} | {
        "process_group", "timeout_s", "load_from", "init", "strict"}
    unknown = sorted(set(engine_kwargs) - engine)
    if unknown:
        raise ValueError(f"OffloadTrainer got unknown keyword argument(s) {unknown}: neither "
                         f"the Trainer's ({sorted(trainer_keywords)}) nor the engine's "
                         f"({sorted(engine - set(FROM_ARGS))})")


def compute_dtype(args) -> torch.dtype:
    """The engine's compute dtype for ``args``: bfloat16 with ``bf16``, float16 with ``fp16``,
    else float32 (master weights and moments are float32 in every case)."""
    if args.bf16:
        return torch.bfloat16
    return torch.float16 if args.fp16 else torch.float32


def decay_groups(trainer, model: torch.nn.Module) -> list:
    """The Trainer's two parameter groups: the trainable parameters that
    ``trainer.get_decay_parameter_names(model)`` names, with ``args.weight_decay``, and the
    others (biases, norms) with 0."""
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay],
             "weight_decay": trainer.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def engine_settings(args) -> Dict[str, Any]:
    """The engine keywords ``args`` decides (see the module docstring)."""
    clip = args.max_grad_norm
    return dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon, weight_decay=args.weight_decay, adamw=True,
                dtype=compute_dtype(args), device=args.device,
                max_grad_norm=clip if clip is not None and clip > 0 else None,
                activation_checkpointing=bool(args.activation_checkpointing),
                gradient_accumulation_steps=1)


def deepspeed_overrides(args, max_steps: Optional[int] = None) -> tuple:
    """``(overrides, fallbacks)`` for :func:`offload_zero.deepspeed_config.parse_deepspeed_config`
    from ``args``: the values Hugging Face's DeepSpeed integration fills ``"auto"`` with and
    checks given values against (batch sizes, accumulation, clipping, AdamW's values, the
    precision), and the schedule's ``warmup_num_steps`` / ``total_num_steps`` (fallbacks only:
    ``max_steps`` is known once training starts; before, 1 and 2 stand in)."""
    settings = engine_settings(args)
    overrides = {k: settings[k] for k in ("lr", "betas", "eps", "weight_decay", "dtype")}
    overrides.update(train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
                     gradient_accumulation_steps=args.gradient_accumulation_steps)
    if settings["max_grad_norm"] is not None:
        overrides["max_grad_norm"] = settings["max_grad_norm"]
    steps = max(2, max_steps or 2)
    warmup = args.get_warmup_steps(steps) if max_steps else 1
    fallbacks = dict(warmup_min_lr=0.0, warmup_max_lr=args.learning_rate,
                     warmup_num_steps=warmup, total_num_steps=steps,
                     max_grad_norm=settings["max_grad_norm"])
    return overrides, fallbacks
