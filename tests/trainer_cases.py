"""Shared pieces of the OffloadTrainer tests: a tiny Llama, token data, TrainingArguments, and
one run of the plain ``transformers.Trainer`` or of ``OffloadTrainer`` (also on gloo ranks)."""
import torch

import hf_tiny


class TokenData(torch.utils.data.Dataset):
    """``n`` rows of 12 random token ids (labels = inputs), fixed by ``seed``."""

    def __init__(self, n: int = 32, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, hf_tiny.VOCAB, (n, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama():
    """The same tiny LlamaForCausalLM (untied, 4 layers) every call."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_tiny.config(tied=False))


def training_args(out, **overrides):
    """8 optimizer steps of 2 micro-batches of 2 rows, clipping at 1.0, cosine with 2 warmup
    steps, weight decay 0.01, fp32 on the CPU, a log line per step, no checkpoints."""
    from transformers import TrainingArguments
    fields = dict(output_dir=str(out), per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_steps=8, learning_rate=1e-2,
                  weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=2,
                  max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    fields.update(overrides)
    return TrainingArguments(**fields)


def logged(trainer, key):
    """Every value of ``key`` in the trainer's log history, in order."""
    return [h[key] for h in trainer.state.log_history if key in h]


def run(kind, out, engine_kwargs=None, train_dataset_rows=32, evaluate=False, **overrides):
    """Train the tiny Llama with ``kind`` ("plain" or "offload") and return ``(state dict of
    the model after training, logged grad norms, logged learning rates, logged losses, eval
    losses, the trainer)``; with ``evaluate``, the eval losses are those of an evaluation
    every 4 steps and one after training (else empty)."""
    from transformers import Trainer
    from offload_zero.hf import OffloadTrainer
    model = tiny_llama()
    if evaluate:
        overrides.update(eval_strategy="steps", eval_steps=4)
    args = training_args(out, **overrides)
    data = dict(train_dataset=TokenData(train_dataset_rows),
                eval_dataset=TokenData(8, seed=5) if evaluate else None)
    if kind == "plain":
        trainer = Trainer(model=model, args=args, **data)
    else:
        trainer = OffloadTrainer(model, args, **data, **(engine_kwargs or {}))
    trainer.train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if evaluate:
        trainer.evaluate()
    return (state, logged(trainer, "grad_norm"), logged(trainer, "learning_rate"),
            logged(trainer, "loss"), logged(trainer, "eval_loss"), trainer)


def two_rank_job(rank, world_size, out):
    """On each gloo rank: the plain Trainer (DDP), then OffloadTrainer at stage 3 with the
    optimizer state on the CPU (then ``save_model`` to ``out/final``) and on NVMe (with
    checkpoints every 4 steps, then a second run resumed from ``checkpoint-4``), on the same
    data. Returns ``(plain weights, plain grad norms, {"cpu"|"nvme"|"resumed": (weights,
    grad norms)})``, weights as numpy arrays (a queue passes tensors by file descriptor)."""
    import os
    from offload_zero.hf import OffloadTrainer
    torch.set_num_threads(1)
    plain = run("plain", os.path.join(out, "plain"))
    ours = {}
    swap = os.path.join(out, f"swap{rank}")
    os.makedirs(swap, exist_ok=True)
    for offload in ("cpu", "nvme"):
        kwargs = dict(offload=offload, stage=3, path=swap if offload == "nvme" else None)
        saves = dict(save_strategy="steps", save_steps=4) if offload == "nvme" else {}
        state, norms, *_, trainer = run("offload", os.path.join(out, offload), kwargs, **saves)
        if offload == "cpu":
            trainer.save_model(os.path.join(out, "final"))
        trainer.engine.close()
        ours[offload] = (state, norms)
    model = tiny_llama()
    args = training_args(os.path.join(out, "resumed"))
    trainer = OffloadTrainer(model, args, train_dataset=TokenData(), offload="nvme", path=swap)
    trainer.train(resume_from_checkpoint=os.path.join(out, "nvme", "checkpoint-4"))
    ours["resumed"] = (model.state_dict(), logged(trainer, "grad_norm"))
    trainer.engine.close()
    numpy = lambda state: {k: v.numpy() for k, v in state.items()}  # noqa: E731
    return numpy(plain[0]), plain[1], {k: (numpy(s), n) for k, (s, n) in ours.items()}
