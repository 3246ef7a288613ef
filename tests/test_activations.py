"""The activation formula ([Note: activation arithmetic]) against the bytes autograd saves for
backward in transformers' Llama (eager attention), on two sizes, fp32 and bf16, with and without
activation checkpointing."""
import pytest
import torch

from offload_zero.activations import (DecoderShape, activation_bytes, saved_storages,
                                      saved_tensor_bytes)

DOCUMENTED_ERROR = 0.01  # the module note's bound
# two sizes: plain attention; grouped-query attention with an explicit head_dim
SIZES = {"small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, intermediate_size=176, vocab_size=128),
         "larger": dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6,
                        num_key_value_heads=2, intermediate_size=256, vocab_size=256,
                        head_dim=24)}
BATCH, SEQ = 3, 20


def _model(size, dtype, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    fields = {**SIZES[size], **overrides}
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=64, attn_implementation="eager", **fields)
    return LlamaForCausalLM(config).to(dtype).train()


def _ids(model):
    return torch.randint(0, model.config.vocab_size, (BATCH, SEQ),
                         generator=torch.Generator().manual_seed(0))


def _measured(model):
    ids = _ids(model)
    return saved_tensor_bytes(lambda: model(input_ids=ids, labels=ids), model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", sorted(SIZES))
def test_formula_matches_saved_tensors(size, dtype):
    model = _model(size, dtype)
    want = activation_bytes(DecoderShape.from_config(model.config), BATCH, SEQ, dtype)
    got = _measured(model)
    assert abs(want.total - got) <= DOCUMENTED_ERROR * got, (want, got)
    # and one block's share: one layer more adds per_layer
    deeper = _model(size, dtype, num_hidden_layers=SIZES[size]["num_hidden_layers"] + 1)
    assert abs((_measured(deeper) - got) - want.per_layer) <= DOCUMENTED_ERROR * want.per_layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", sorted(SIZES))
def test_checkpointing_keeps_block_inputs_plus_one_block(size, dtype):
    """Measured: what the checkpointed forward saves, plus every tensor the checkpoint keeps as
    a block's input (its arguments), plus one block's saved tensors (the measured difference
    of one layer more, uncheckpointed)."""
    model = _model(size, dtype)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    kept = {}

    def keep_inputs(module, args, kwargs):
        for t in list(args) + [v for x in kwargs.values()
                               for v in (x if isinstance(x, tuple) else (x,))]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for layer in model.model.layers:
        layer.register_forward_pre_hook(keep_inputs, with_kwargs=True)
    ids = _ids(model)
    seen, _ = saved_storages(lambda: model(input_ids=ids, labels=ids), model.parameters())
    seen.update(kept)
    plain, deeper = _model(size, dtype), _model(
        size, dtype, num_hidden_layers=SIZES[size]["num_hidden_layers"] + 1)
    got = sum(seen.values()) + _measured(deeper) - _measured(plain)
    want = activation_bytes(DecoderShape.from_config(model.config), BATCH, SEQ, dtype, True)
    assert abs(want.total - got) <= DOCUMENTED_ERROR * got, (want, got)
    assert want.total < activation_bytes(DecoderShape.from_config(model.config), BATCH, SEQ,
                                         dtype).total


def test_bad_inputs_name_the_value():
    shape = DecoderShape(64, 2, 4, 16, 176, 128)
    with pytest.raises(ValueError, match="batch_size=0"):
        activation_bytes(shape, 0, 8)
    with pytest.raises(ValueError, match="seq_len=2.5"):
        activation_bytes(shape, 1, 2.5)
    with pytest.raises(ValueError, match="float64"):
        activation_bytes(shape, 1, 8, torch.float64)
    from transformers import GPT2Config
    with pytest.raises(NotImplementedError, match="GPT2Config.*intermediate_size"):
        DecoderShape.from_config(GPT2Config())
