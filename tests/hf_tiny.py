"""Tiny transformers Llama models and checkpoints for the load and export tests."""
import os

import torch

VOCAB = 64


def config(tied: bool, **overrides):
    from transformers import LlamaConfig
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=64, tie_word_embeddings=tied,
                  max_position_embeddings=64)
    fields.update(overrides)
    return LlamaConfig(**fields)


def write_checkpoint(folder, tied: bool, dtype=torch.bfloat16, max_shard_size="20KB",
                     seed: int = 0, **overrides) -> str:
    """A reference model saved by transformers (sharded), in ``dtype``; returns the folder."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config(tied, **overrides)).to(dtype)
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    return str(folder)


def empty_model(tied: bool, how: str = "meta", **overrides):
    """A LlamaForCausalLM with its parameters on the meta device: built under
    ``torch.device("meta")`` (buffers on meta too) or accelerate's ``init_empty_weights``."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    if how == "meta":
        with torch.device("meta"):
            return LlamaForCausalLM(config(tied, **overrides))
    from accelerate import init_empty_weights
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config(tied, **overrides))


def eager_model(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(n)]


def train(engine, data):
    losses = []
    for ids in data:
        out = engine(ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses


def shard_files(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
