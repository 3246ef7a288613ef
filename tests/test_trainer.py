"""OffloadTrainer (offload_zero.hf) against the plain transformers.Trainer: the same weights,
logged grad norms, schedule and eval loss on a tiny Llama, on one and two ranks; checkpoints
that resume bit for bit; save_model's Hugging Face folder; construction errors."""
import os

import pytest
import torch

from dist_harness import run_ranks
from trainer_cases import TokenData, logged, run, tiny_llama, training_args, two_rank_job

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain Trainer's run (torch AdamW, accumulation 2, clip 1.0, cosine warmup, weight
    decay 0.01, fp32), with its eval losses."""
    return run("plain", tmp_path_factory.mktemp("plain"), evaluate=True)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_matches_plain_trainer(plain, tmp_path, offload):
    kwargs = dict(offload=offload, stage=3)
    if offload == "nvme":
        kwargs["path"] = str(tmp_path)
    state, norms, lrs, losses, eval_loss, trainer = run("offload", tmp_path / "out", kwargs,
                                                        evaluate=True)
    ref_state, ref_norms, ref_lrs, ref_losses, ref_eval, _ = plain
    assert trainer.engine.config.offload_optimizer == offload
    assert _max_diff(state, ref_state) <= 1e-6
    assert len(norms) == len(ref_norms) == 8
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= 1e-5
    assert lrs == pytest.approx(ref_lrs, rel=1e-12, abs=1e-15)  # the cosine warmup, step by step
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert len(eval_loss) == 3  # (at steps 4 and 8, and after training)
    assert eval_loss == pytest.approx(ref_eval, rel=1e-6)
    groups = trainer.optimizer.param_groups  # HF's no-decay groups: biases and norms undecayed
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert all("norm" in names[id(p)] for p in groups[1]["params"])
    assert len(groups[1]["params"]) == 2 * 4 + 1  # two norms per layer, the final norm
    trainer.engine.close()


def test_two_ranks_match_plain_trainer_with_ddp(tmp_path):
    from transformers import AutoModelForCausalLM
    results = run_ranks(two_rank_job, 2, str(tmp_path), timeout_s=300)
    for plain_state, plain_norms, ours in results:
        for offload in ("cpu", "nvme"):
            state, norms = ours[offload]
            assert max(abs(plain_state[k] - state[k]).max() for k in state) <= 1e-6, offload
            assert len(norms) == len(plain_norms) == 8
            assert max(abs(a - b) / b for a, b in zip(norms, plain_norms)) <= 1e-5, offload
        # resumed from checkpoint-4 on both ranks: bit for bit the uninterrupted run
        state, norms = ours["resumed"]
        assert all((state[k] == ours["nvme"][0][k]).all() for k in state)
        assert norms == ours["nvme"][1]
    for offload in ("cpu", "nvme"):  # (both ranks end with the same weights)
        one, two = results[0][2][offload][0], results[1][2][offload][0]
        assert max(abs(one[k] - two[k]).max() for k in one) == 0
    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32)
    cpu_state = results[0][2]["cpu"][0]
    assert all((v.numpy() == cpu_state[k]).all() for k, v in final.state_dict().items())


def test_resume_from_checkpoint_is_bit_identical(tmp_path):
    kwargs = dict(offload="nvme", stage=3, path=str(tmp_path))
    whole = run("offload", tmp_path / "whole", kwargs, save_strategy="steps", save_steps=4)
    whole[-1].engine.close()
    ckpt = tmp_path / "whole" / "checkpoint-4"
    files = set(os.listdir(ckpt))
    # the Trainer's own files, the model as a HF folder, and the engine's checkpoint
    assert {"trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "training_args.bin", "config.json", "model.safetensors", "offload_zero"} <= files
    assert "rank00000.safetensors" in os.listdir(ckpt / "offload_zero")
    from transformers import Trainer
    from offload_zero.hf import OffloadTrainer
    model = tiny_llama()
    args = training_args(tmp_path / "resumed", save_strategy="steps", save_steps=4)
    trainer = OffloadTrainer(model, args, train_dataset=TokenData(), **kwargs)
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 8
    resumed = model.state_dict()
    for k, v in whole[0].items():
        assert torch.equal(resumed[k], v), k
    assert logged(trainer, "grad_norm") == whole[1]  # (the first 4 from trainer_state.json)
    trainer.engine.close()
    # a checkpoint of the plain Trainer has no engine state: its weights load, with a warning
    plain_ckpt = tmp_path / "plain" / "checkpoint-4"
    plain_trainer = Trainer(model=tiny_llama(), args=training_args(
        tmp_path / "plain", save_strategy="steps", save_steps=4, max_steps=4),
        train_dataset=TokenData())
    plain_trainer.train()
    later = OffloadTrainer(tiny_llama(), training_args(tmp_path / "later", max_steps=4),
                           train_dataset=TokenData())
    with pytest.warns(UserWarning, match="moments start afresh"):
        later._load_from_checkpoint(str(plain_ckpt))
    assert _max_diff(later.model.state_dict(), plain_trainer.model.state_dict()) == 0
    later.engine.close()


def test_save_model_writes_a_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM
    state, *_, trainer = run("offload", tmp_path / "out", dict(offload="cpu"),
                             save_strategy="steps", save_steps=8)
    out = tmp_path / "out"
    trainer.save_model()  # into the output folder, beside checkpoint-8
    assert {"model.safetensors", "config.json", "training_args.bin", "checkpoint-8"} <= set(
        os.listdir(out))
    assert not [f for f in os.listdir(out) if f.startswith(".")]
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert _max_diff(loaded.state_dict(), state) == 0  # (the fp32 master weights)
    trainer.save_model(str(out))  # again: replaces the weights, keeps the rest
    assert "checkpoint-8" in os.listdir(out)
    trainer.engine.close()


def test_activation_checkpointing_is_the_engines(plain, tmp_path):
    state, norms, *_, trainer = run("offload", tmp_path / "out", dict(offload="cpu"),
                                    activation_checkpointing=True)
    assert trainer.engine.config.activation_checkpointing
    assert not trainer.model.is_activation_checkpointing  # (transformers' own stays off)
    assert trainer.args.activation_checkpointing  # (restored after train())
    assert _max_diff(state, plain[0]) <= 1e-6
    trainer.engine.close()


def test_bf16_trains_in_bfloat16(tmp_path):
    from offload_zero.trainer_args import compute_dtype
    state, norms, _, losses, *_, trainer = run("offload", tmp_path / "out", dict(offload="cpu"),
                                               bf16=True, max_steps=2)
    assert trainer.engine.config.dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in state.values())  # the fp32 masters
    assert all(torch.isfinite(torch.tensor(losses)))
    assert compute_dtype(training_args(tmp_path, fp16=True, use_cpu=True)) == torch.float16
    trainer.engine.close()


@pytest.mark.parametrize("overrides, engine_kwargs, error, match", [
    (dict(optim="adafactor"), {}, NotImplementedError, "optim='adafactor'"),
    (dict(optim="sgd"), {}, NotImplementedError, "optim='sgd'"),
    (dict(optim_args="foo=1"), {}, NotImplementedError, "optim_args"),
    (dict(torch_compile=True), {}, NotImplementedError, "torch_compile"),
    (dict(bf16_full_eval=True), {}, NotImplementedError, "bf16_full_eval"),
    (dict(activation_checkpointing=True, activation_checkpointing_kwargs={"offload": True}), {},
     NotImplementedError, "activation_checkpointing_kwargs"),
    ({}, dict(lr=1e-3), ValueError, "learning_rate"),
    ({}, dict(dtype=torch.bfloat16), ValueError, "bf16/fp16"),
    ({}, dict(gradient_accumulation_steps=2), ValueError, "gradient_accumulation_steps"),
    ({}, dict(max_grad_norm=2.0), ValueError, "max_grad_norm"),
    ({}, dict(prefetch=-1), ValueError, "prefetch=-1"),
    ({}, dict(stage=5), ValueError, "stage=5"),
    ({}, dict(tokenizer=None), ValueError, r"unknown keyword argument\(s\) \['tokenizer'\]"),
])
def test_construction_errors(tmp_path, overrides, engine_kwargs, error, match):
    from offload_zero.hf import OffloadTrainer
    model = tiny_llama()
    with pytest.raises(error, match=match):
        OffloadTrainer(model, training_args(tmp_path, **overrides), train_dataset=TokenData(),
                       **engine_kwargs)


def test_construction_errors_for_trainer_arguments(tmp_path):
    from offload_zero.hf import OffloadTrainer
    model = tiny_llama()
    args = training_args(tmp_path)
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(NotImplementedError, match="optimizers="):
        OffloadTrainer(model, args, optimizers=(adamw, None))
    with pytest.raises(NotImplementedError, match="optimizer_cls_and_kwargs"):
        OffloadTrainer(model, args, optimizer_cls_and_kwargs=(torch.optim.SGD, {}))
    with pytest.raises(NotImplementedError, match="model_init"):
        OffloadTrainer(None, args, model_init=tiny_llama)


def _ds_config(swap, **optimizer_params):
    """ZeRO-3 with optimizer state and parameters on NVMe, every value HF's DeepSpeed
    integration fills from TrainingArguments left "auto", and WarmupDecayLR."""
    auto = dict(lr="auto", betas="auto", eps="auto", weight_decay="auto")
    auto.update(optimizer_params)
    nvme = {"device": "nvme", "nvme_path": str(swap)}
    return {"zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme,
                                  "overlap_comm": True, "stage3_prefetch_bucket_size": "auto"},
            "gradient_clipping": "auto", "gradient_accumulation_steps": "auto",
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": auto},
            "scheduler": {"type": "WarmupDecayLR", "params": {
                "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                "total_num_steps": "auto"}}}


def test_deepspeed_config_matches_plain_trainer_with_its_schedule(tmp_path):
    import json
    import math
    from transformers import Trainer
    from offload_zero.hf import OffloadTrainer
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_ds_config(tmp_path)))
    args = training_args(tmp_path / "ours", adam_beta2=0.95)
    trainer = OffloadTrainer(tiny_llama(), args, train_dataset=TokenData(), deepspeed=str(config))
    cfg = trainer.engine.config
    assert (cfg.stage, cfg.offload_optimizer, cfg.offload_param) == (3, "nvme", "nvme")
    assert (cfg.max_grad_norm, cfg.betas, cfg.dtype) == (1.0, (0.9, 0.95), torch.float32)
    assert len(trainer.optimizer.param_groups) == 1  # (DeepSpeed's optimizer: one group)
    assert trainer.engine.lr_scheduler is None  # (one schedule, stepped by the Trainer)
    trainer.train()
    ours = trainer.model.state_dict()
    trainer.engine.close()

    def warmup_decay(t, warmup=2, total=8):  # DeepSpeed's WarmupDecayLR, log warmup, min 0
        if t < warmup:
            return math.log(t + 1) / math.log(warmup)
        return max(0.0, (total - t) / max(1.0, total - warmup))

    model = tiny_llama()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, warmup_decay)
    plain = Trainer(model=model, args=training_args(tmp_path / "plain", adam_beta2=0.95),
                    train_dataset=TokenData(), optimizers=(adamw, schedule))
    plain.train()
    assert logged(trainer, "learning_rate") == pytest.approx(logged(plain, "learning_rate"))
    assert _max_diff(ours, model.state_dict()) <= 1e-6


def test_deepspeed_config_values_must_agree_with_training_arguments(tmp_path):
    from offload_zero.hf import OffloadTrainer
    with pytest.raises(ValueError, match="lr=0.01 conflicts"):
        OffloadTrainer(tiny_llama(), training_args(tmp_path), train_dataset=TokenData(),
                       deepspeed=_ds_config(tmp_path, lr=1e-3))
    with pytest.raises(ValueError, match="thread_count"):
        bad = _ds_config(tmp_path)
        bad["zero_optimization"]["offload_optimizer"]["thread_count"] = 4
        OffloadTrainer(tiny_llama(), training_args(tmp_path), train_dataset=TokenData(),
                       deepspeed=bad)


def test_save_model_of_a_peft_model_writes_its_adapter(tmp_path):
    """A LoRA model under OffloadTrainer: save_model writes peft's adapter folder, as
    transformers' Trainer does (engine.save_pretrained refuses PEFT names), and the adapter
    loaded onto a fresh base gives the trained model's logits."""
    peft = pytest.importorskip("peft")
    from offload_zero.hf import OffloadTrainer
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    trainer = OffloadTrainer(model, training_args(tmp_path / "out", max_steps=2),
                             train_dataset=TokenData(), offload="cpu")
    trainer.train()
    trainer.save_model()
    files = set(os.listdir(tmp_path / "out"))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert "model.safetensors" not in files
    x = torch.arange(12).reshape(2, 6)
    model.eval()
    with torch.no_grad():
        want = trainer.engine(input_ids=x).logits
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, want)
    trainer.engine.close()
