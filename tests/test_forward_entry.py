"""A forward entered below the wrapped model (PEFT's generate runs the base model's forward;
a script calls the embedding or one layer's MLP, or takes its loss from the base model)
computes what the unwrapped model computes, on every tier the parameter shards can live on;
and once the engine is closed the model's forward, state_dict(), load_state_dict() and
save_pretrained raise instead of returning an empty state dict."""
import copy
import warnings

import pytest
import torch

from offload_zero import OffloadEngine

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PLACEMENTS = [{"offload": "none"}, {"offload": "cpu"}, {"offload": "nvme"},
              {"offload": "nvme", "update_timing": "step"}, {"offload_param": "nvme"}]


def tiny_llama():
    """A tiny Llama (hidden 32, 2 layers, vocabulary 64), random weights."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def lora_llama():
    """:func:`tiny_llama` with LoRA adapters of rank 4 on q and v (random adapter weights, so
    the adapters change the output)."""
    model = tiny_llama()
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        init_lora_weights=False))


def wrap(model, kw, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return OffloadEngine(model, lr=1e-2, path=str(tmp_path), **kw)


def prompt():
    return torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3))


def greedy(model, ids):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("kw", PLACEMENTS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_peft_generate_equals_unwrapped(kw, train, tmp_path):
    """Greedy generate of the wrapped PEFT model gives the same tokens as generate of an
    unwrapped copy holding the same weights (after a training step: the wrapped model's
    state_dict() loaded into the copy), and leaves no unit gathered."""
    model = lora_llama()
    ref = copy.deepcopy(model)
    ids = prompt()
    with wrap(model, kw, tmp_path) as eng:
        if train:
            eng.backward(model(input_ids=ids, labels=ids).loss)
            eng.step()
            ref.load_state_dict(model.state_dict())
        before = eng.scheduler.live_units()
        model.eval()
        ref.eval()
        got = greedy(model, ids)
        assert eng.scheduler.live_units() == before
        assert not eng.scheduler.forward_running
        assert torch.equal(got, greedy(ref, ids))
        assert got.shape == (2, 11)


@pytest.mark.parametrize("kw", [{"offload": "cpu"}, {"offload": "nvme"}],
                         ids=lambda kw: kw["offload"])
def test_a_submodule_called_on_its_own(kw, tmp_path):
    """The embedding (a root-unit module) and one decoder layer's MLP (inside a block unit)
    called directly, outside any forward of the model, equal the unwrapped modules' outputs;
    then a forward of the whole model still equals the unwrapped one."""
    model = lora_llama()
    ref = copy.deepcopy(model)
    ids = prompt()
    with wrap(model, kw, tmp_path) as eng, torch.no_grad():
        emb = model.get_input_embeddings()(ids)
        assert torch.equal(emb, ref.get_input_embeddings()(ids))
        mlp = model.base_model.model.model.layers[1].mlp
        assert torch.allclose(mlp(emb), ref.base_model.model.model.layers[1].mlp(emb),
                              atol=1e-6, rtol=0)
        assert not eng.scheduler.forward_running
        assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                              atol=1e-5, rtol=0)


def test_closed_engine_refuses_state_dict_forward_and_save(tmp_path):
    """After close() the weights are gone: the model's state_dict() (and a submodule's),
    load_state_dict(), forward, a submodule's forward and PEFT's save_pretrained raise
    RuntimeError saying the engine is closed and to take the state dict first."""
    model = lora_llama()
    ids = prompt()
    eng = wrap(model, {"offload": "cpu"}, tmp_path)
    sd = model.state_dict()
    eng.close()
    calls = [model.state_dict, model.base_model.model.model.layers[0].state_dict,
             lambda: model.load_state_dict(sd, strict=False),
             lambda: model(input_ids=ids),
             lambda: model.get_input_embeddings()(ids),
             lambda: model.save_pretrained(str(tmp_path / "adapter"))]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"OffloadEngine is closed.*before engine.close"):
            call()
    assert not (tmp_path / "adapter").exists()


def test_closed_engine_refuses_hf_save_pretrained_and_generate(tmp_path):
    """A plain Hugging Face model's save_pretrained after close() raises the same
    RuntimeError, and writes nothing; so does generate() (it raised a bare StopIteration from
    reading the device of a model without parameters)."""
    model = tiny_llama()
    wrap(model, {"offload": "cpu"}, tmp_path).close()
    with pytest.raises(RuntimeError, match=r"OffloadEngine is closed.*before engine.close"):
        model.save_pretrained(str(tmp_path / "saved"))
    assert not (tmp_path / "saved").exists()
    with pytest.raises(RuntimeError, match=r"OffloadEngine is closed"):
        model.generate(prompt(), max_new_tokens=2)


@pytest.mark.parametrize("kw", [{"offload": "cpu"}, {"offload": "nvme"}],
                         ids=lambda kw: kw["offload"])
def test_training_through_the_base_models_forward(kw, tmp_path):
    """Three steps with the loss from the PEFT model's base model (``model.base_model.model``,
    a forward entered below the wrapped model) end with the same weights as three steps
    through the wrapped model itself (which tests/test_peft.py holds equal to torch + peft),
    and no unit is left gathered."""
    top, below = lora_llama(), lora_llama()
    ids = prompt()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with wrap(top, kw, tmp_path / "a") as e_top, wrap(below, kw, tmp_path / "b") as e_below:
        for _ in range(3):
            e_top.backward(top(input_ids=ids, labels=ids).loss)
            e_top.step()
            e_below.backward(below.base_model.model(input_ids=ids, labels=ids).loss)
            e_below.step()
        want, got = top.state_dict(), below.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)
        assert any(not torch.equal(want[k], lora_llama().state_dict()[k])
                   for k in want if "lora_" in k)
        assert e_below.scheduler.live_units() == e_top.scheduler.live_units()
