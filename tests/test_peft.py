"""PEFT/LoRA under the engine: get_peft_model(...) then wrapped trains only the adapters, equal
to torch + peft on an unwrapped copy, keeps optimizer state for the adapters alone, never
writes frozen base weights back to NVMe, and peft's save_pretrained writes the trained
adapter."""
import copy
import warnings

import pytest
import torch

from offload_zero import OffloadEngine

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

LR = 1e-3


def lora_llama():
    """A tiny Llama (hidden 32, 2 layers, vocabulary 64) with LoRA adapters of rank 4 on the
    attention's q and v projections (random adapter weights, so every gradient is nonzero)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        init_lora_weights=False))


def wrap(model, stage, offload, tmp_path, dtype=torch.float32, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return OffloadEngine(model, offload=offload, stage=stage, dtype=dtype, lr=LR,
                             weight_decay=0.0,
                             path=str(tmp_path) if offload == "nvme" else None, **kwargs)


def tokens(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 64, (2, 7), generator=g)


CONFIGS = [(1, "none"), (2, "cpu"), (3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("stage,offload", CONFIGS)
def test_lora_trains_like_torch_and_peft(stage, offload, tmp_path):
    """Three steps: the adapters equal torch AdamW on an unwrapped copy to 1e-6, the frozen
    base weights do not move, and peft's save_pretrained while wrapped writes the trained
    adapter (the same tensors as the unwrapped copy's)."""
    model = lora_llama()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            weight_decay=0.0)
    base = {k: v.clone() for k, v in ref.state_dict().items() if "lora_" not in k}
    with wrap(model, stage, offload, tmp_path) as eng:
        names = {n for fp in eng.trainable for e in fp.entries for n in e.names}
        assert names == {n for n, p in ref.named_parameters() if p.requires_grad}
        assert all("lora_" in n for n in names)
        for i in range(3):
            ids = tokens(i)
            loss = model(input_ids=ids, labels=ids).loss
            ref_loss = ref(input_ids=ids, labels=ids).loss
            assert abs(loss.item() - ref_loss.item()) < 1e-6
            eng.backward(loss)
            ref_loss.backward()
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
            eng.step()
            opt.step()
            opt.zero_grad()
        sd = model.state_dict()
        model.save_pretrained(tmp_path / "adapter")
    ref.save_pretrained(tmp_path / "ref_adapter")
    for name, p in ref.named_parameters():
        assert (sd[name] - p.detach()).abs().max().item() < 1e-6, name
    for name, value in base.items():
        assert torch.equal(sd[name], value), name
    got = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    want = load_file(tmp_path / "ref_adapter" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and got
    for k in want:
        assert (got[k] - want[k]).abs().max().item() < 1e-6, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "nvme")])
def test_lora_optimizer_state_is_adapters_only(stage, offload, dtype, tmp_path):
    """memory_report: 12 bytes of optimizer state (fp32 master + two moments) per trainable
    element of this rank's shards (padded to the 4 KiB alignment), none for the frozen base."""
    model = lora_llama()
    with wrap(model, stage, offload, tmp_path, dtype=dtype) as eng:
        rep = eng.memory_report()
        trainable_numel = sum(fp.shard_numel for fp in eng.trainable)
        frozen_numel = sum(fp.shard_numel for fp in eng.flat_params if not fp.requires_grad)
        tiers = ("device", "host", "nvme")
        moments = sum(rep[t]["by_kind"]["moments"]["current_bytes"] for t in tiers)
        masters = sum(rep[t]["by_kind"]["master_weights"]["current_bytes"] for t in tiers)
        assert moments == 8 * trainable_numel
        if eng.store.aliases(eng.trainable[0]) or getattr(eng.param_home, "master_is_param", False):
            assert masters == 0  # (the fp32 shard is the master: counted as parameters)
        else:
            assert masters == 4 * trainable_numel
        assert frozen_numel > 0  # (and none of it holds state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_base_on_nvme_is_read_never_written(dtype, tmp_path):
    """Stage 3 with parameters on NVMe: each step reads the frozen base shards and writes 0
    bytes to their files (only the adapters' state and shards are written)."""
    model = lora_llama()
    with wrap(model, 3, "nvme", tmp_path, dtype=dtype) as eng:
        written, read = {}, {}
        sw = eng.swapper
        out, inn = sw.swap_out, sw.swap_in

        def swap_out(key, tensor, offset_bytes=0):
            written[key] = written.get(key, 0) + tensor.numel() * tensor.element_size()
            return out(key, tensor, offset_bytes)

        def swap_in(key, tensor, offset_bytes=0, **kw):
            read[key] = read.get(key, 0) + tensor.numel() * tensor.element_size()
            return inn(key, tensor, offset_bytes, **kw)

        sw.swap_out, sw.swap_in = swap_out, swap_in
        frozen = [fp.name for fp in eng.flat_params if not fp.requires_grad]

        def bytes_to(counts, of_frozen):
            return sum(v for k, v in counts.items()
                       if (k.split(".param")[0] in frozen) == of_frozen)

        adapters_written = 0
        for i in range(3):
            ids = tokens(i)
            eng.backward(model(input_ids=ids, labels=ids).loss)
            eng.step()
            assert bytes_to(written, of_frozen=True) == 0
            for name in frozen:
                assert any(k.startswith(name) for k in read), name
            adapters_written += bytes_to(written, of_frozen=False)
            written.clear()
            read.clear()
        # (with update_timing="next_forward" the update of a step is written in the next forward)
        assert adapters_written > 0


def test_engine_save_pretrained_of_a_peft_model_says_what_saves_it(tmp_path):
    """engine.save_pretrained would write peft's names (base_model.model...), which
    transformers' from_pretrained loads as missing weights, silently random: it raises before
    writing anything, naming the adapter's save and the merge."""
    model = lora_llama()
    (tmp_path / "swap").mkdir()
    with wrap(model, 3, "nvme", tmp_path / "swap") as eng:
        with pytest.raises(ValueError, match=r"PEFT model.*model.save_pretrained\(folder\).*"
                                             r"merge_and_unload\(\)"):
            eng.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def other_lora():
    return peft.LoraConfig(r=2, target_modules=["k_proj"], init_lora_weights=False)


# peft's (and transformers') calls that would change the adapters or the structure
CHANGING_CALLS = {
    "load_adapter": lambda m, folder: m.load_adapter(folder, adapter_name="other"),
    "load_adapter_trainable": lambda m, folder: m.load_adapter(folder, adapter_name="other",
                                                               is_trainable=True),
    "add_adapter": lambda m, folder: m.add_adapter("other", other_lora()),
    "add_weighted_adapter": lambda m, folder: m.add_weighted_adapter(
        ["default"], [1.0], "mix", combination_type="linear"),
    "delete_adapter": lambda m, folder: m.delete_adapter("default"),
    "set_adapter": lambda m, folder: m.set_adapter("default", inference_mode=True),
    "set_requires_grad": lambda m, folder: m.set_requires_grad("default", False),
    "disable_adapter_layers": lambda m, folder: m.base_model.disable_adapter_layers(),
    "enable_adapter_layers": lambda m, folder: m.base_model.enable_adapter_layers(),
    "merge_adapter": lambda m, folder: m.merge_adapter(),
    "unmerge_adapter": lambda m, folder: m.unmerge_adapter(),
    "merge_and_unload": lambda m, folder: m.merge_and_unload(),
    "unload": lambda m, folder: m.unload(),
    "transformers' add_adapter": lambda m, folder: m.base_model.model.add_adapter(
        other_lora(), adapter_name="other"),
    "transformers' disable_adapters": lambda m, folder: m.base_model.model.disable_adapters(),
}


def model_facts(model):
    """What a refused call must leave as it was: the modules, the state_dict's keys, peft's
    adapters, which parameters train, and the logits of one batch."""
    with torch.no_grad():
        logits = model(input_ids=tokens(9)).logits.clone()
    return ([n for n, _ in model.named_modules()], list(model.state_dict()),
            list(model.peft_config), model.active_adapter,
            [(n, p.requires_grad) for n, p in model.named_parameters()], logits)


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
@pytest.mark.parametrize("call", list(CHANGING_CALLS))
def test_peft_calls_that_change_the_model_refuse_before_changing_it(call, stage, offload,
                                                                     tmp_path):
    """Each call raises NotImplementedError naming itself, saying nothing was changed and
    what to do; the model keeps its modules, state_dict keys, adapters and bit-identical
    logits, and a training step then equals torch AdamW on an unwrapped copy."""
    model = lora_llama()
    ref = copy.deepcopy(model)
    ref.save_pretrained(tmp_path / "adapter")
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            weight_decay=0.0)
    (tmp_path / "swap").mkdir()
    with wrap(model, stage, offload, tmp_path / "swap") as eng:
        before = model_facts(model)
        name = call.split("' ")[-1].replace("_trainable", "")
        with pytest.raises(NotImplementedError,
                           match=rf"{name}\(.*nothing was changed.*before OffloadEngine"):
            CHANGING_CALLS[call](model, str(tmp_path / "adapter"))
        after = model_facts(model)
        assert after[:5] == before[:5]
        assert torch.equal(after[5], before[5])
        x = tokens(0)
        eng.backward(model(input_ids=x, labels=x).loss)
        eng.step()
        ref(input_ids=x, labels=x).loss.backward()
        opt.step()
        sd = model.state_dict()
    for n, p in ref.named_parameters():
        assert (sd[n] - p.detach()).abs().max().item() < 1e-6, n


def test_peft_calls_that_change_nothing_fixed_still_work(tmp_path):
    """load_adapter of the adapter the model has (transformers' Trainer loading its best or
    resumed checkpoint) loads its weights; set_adapter of the active adapter is accepted."""
    other = lora_llama()
    with torch.no_grad():
        for n, p in other.named_parameters():
            if "lora_" in n:
                p.add_(0.5)
    other.save_pretrained(tmp_path / "adapter")
    model = lora_llama()
    (tmp_path / "swap").mkdir()
    with wrap(model, 3, "nvme", tmp_path / "swap"):
        model.load_adapter(str(tmp_path / "adapter"), adapter_name="default", is_trainable=True)
        model.set_adapter("default")
        x = tokens(0)
        with torch.no_grad():
            got, want = model(input_ids=x).logits, other(input_ids=x).logits
        assert (got - want).abs().max().item() < 1e-6
        sd = model.state_dict()
    for n, p in other.named_parameters():
        assert torch.equal(sd[n], p.detach()), n


DISABLE_CONFIGS = [(1, "cpu", {}), (1, "nvme", {}), (2, "cpu", {}), (2, "nvme", {}),
                   (3, "cpu", {}), (3, "nvme", {}),
                   (3, "nvme", {"unit_classes": (torch.nn.Linear,),
                                "update_timing": "next_forward"})]


def train_with_disabled_forwards(model, eng, ref, enter):
    """Three steps; with ``enter``, before each one forward under ``torch.no_grad()`` and one
    with autograd on inside ``model.disable_adapter()``, equal to peft's on ``ref`` (the
    unwrapped copy, trained alongside by torch AdamW) to 1e-6, and after it the adapters'
    logits again equal to ``ref``'s."""
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            weight_decay=0.0)
    for i in range(3):
        x = tokens(i)
        if enter:
            with torch.no_grad(), ref.disable_adapter():
                want = ref(input_ids=x).logits
            with torch.no_grad(), model.disable_adapter():
                got = model(input_ids=x).logits
            with model.disable_adapter():
                got_grad = model(input_ids=x).logits
            assert (got - want).abs().max().item() < 1e-6
            assert (got_grad - want).abs().max().item() < 1e-6 and not got_grad.requires_grad
            with torch.no_grad():
                on, ref_on = model(input_ids=x).logits, ref(input_ids=x).logits
            assert (on - ref_on).abs().max().item() < 1e-6
            assert (on - want).abs().max().item() > 1e-3  # (the adapters are on again)
        eng.backward(model(input_ids=x, labels=x).loss)
        eng.step()
        ref(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("stage,offload,kwargs", DISABLE_CONFIGS)
def test_disable_adapter_gives_the_base_models_logits(stage, offload, kwargs, tmp_path):
    """TRL's reference logits: ``with torch.no_grad(), model.disable_adapter():`` on a wrapped
    model equals peft's on an unwrapped copy; after it the adapters are on, and training ends
    bit-identical to a run that never entered the context (and equal to torch + peft)."""
    runs = []
    for enter in (True, False):
        model = lora_llama()
        ref = copy.deepcopy(model)
        (tmp_path / str(enter)).mkdir()
        with wrap(model, stage, offload, tmp_path / str(enter), **kwargs) as eng:
            runs.append(train_with_disabled_forwards(model, eng, ref, enter))
        for n, p in ref.named_parameters():
            assert (runs[-1][n] - p.detach()).abs().max().item() < 1e-6, n
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_disable_adapter_restores_the_adapters_after_an_error(tmp_path):
    """An error inside the context leaves the adapters on, and nothing of peft's requires_grad
    changed on the way in or out."""
    model = lora_llama()
    with wrap(model, 3, "cpu", tmp_path):
        x = tokens(0)
        with torch.no_grad():
            before = model(input_ids=x).logits.clone()
        flags = [(n, p.requires_grad) for n, p in model.named_parameters()]
        with pytest.raises(KeyError):
            with torch.no_grad(), model.disable_adapter():
                assert [(n, p.requires_grad) for n, p in model.named_parameters()] == flags
                raise KeyError("inside")
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, before)
        assert [(n, p.requires_grad) for n, p in model.named_parameters()] == flags

