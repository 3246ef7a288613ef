"""A wrapped Hugging Face model keeps its own API: parameters(), device, dtype,
num_parameters(), state_dict(), load_state_dict(), generate(), save_pretrained(), and
clip_grad_norm_ fails loudly instead of returning 0; each checked against an unwrapped copy."""
import copy
import os
import warnings

import pytest
import torch

from offload_zero import OffloadEngine
from tests.dist_harness import run_ranks

transformers = pytest.importorskip("transformers")

LR = 1e-3
CONFIGS = [(1, "none"), (2, "cpu"), (3, "none"), (3, "cpu"), (3, "nvme")]


def tiny_llama(tie=False, seed=0):
    """A Llama of hidden 32, 2 layers, vocabulary 64 (random weights, fixed seed)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def wrap(model, stage, offload, tmp_path, dtype=torch.float32, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return OffloadEngine(model, offload=offload, stage=stage, dtype=dtype, lr=LR,
                             weight_decay=0.0,
                             path=str(tmp_path) if offload == "nvme" else None, **kw)


def tokens(seed, batch=2, seq=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g)


def train(eng, model, steps=2):
    for i in range(steps):
        ids = tokens(100 + i)
        eng.backward(model(input_ids=ids, labels=ids).loss)
        eng.step()


def trained_reference(model_fn, steps=2):
    """The same model trained unwrapped with torch AdamW."""
    ref = model_fn()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    for i in range(steps):
        ids = tokens(100 + i)
        ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ref.opt = opt
    return ref


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage,offload", CONFIGS)
@pytest.mark.parametrize("tie", [False, True])
def test_parameters_device_dtype_and_count(stage, offload, dtype, tie, tmp_path):
    """named_parameters() has the unwrapped names, shapes and requires_grad; num_parameters(),
    .device, .dtype (the compute dtype) and get_input_embeddings() are right (the model had
    no parameters while wrapped)."""
    model = tiny_llama(tie)
    ref = copy.deepcopy(model)
    model.model.norm.weight.requires_grad_(False)
    ref.model.norm.weight.requires_grad_(False)
    with wrap(model, stage, offload, tmp_path, dtype=dtype) as eng:
        got = {n: (p.shape, p.requires_grad) for n, p in model.named_parameters()}
        assert got == {n: (p.shape, p.requires_grad) for n, p in ref.named_parameters()}
        assert model.num_parameters() == ref.num_parameters()
        assert model.num_parameters(only_trainable=True) == ref.num_parameters(only_trainable=True)
        assert model.device == eng.device and model.dtype == dtype
        emb = model.get_input_embeddings()
        assert emb is model.model.embed_tokens and emb.weight.shape == (64, 32)
        assert emb.weight is dict(model.named_parameters())["model.embed_tokens.weight"]
        if tie:
            assert model.lm_head.weight is emb.weight
    assert list(model.parameters()) == []  # close() takes them with it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage,offload", CONFIGS)
def test_state_dict_is_the_full_state_dict(stage, offload, dtype, tmp_path):
    """model.state_dict() after training: the unwrapped model's keys, the values of
    engine.full_state_dict() (fp32 masters), equal to torch AdamW's in fp32."""
    model = tiny_llama(tie=True)
    with wrap(model, stage, offload, tmp_path, dtype=dtype) as eng:
        train(eng, model)
        sd, full = model.state_dict(), eng.full_state_dict()
        assert set(sd) == set(full) and all(torch.equal(sd[k], full[k]) for k in sd)
        assert model.state_dict(keep_vars=True).keys() == sd.keys()
    ref = trained_reference(lambda: tiny_llama(tie=True))
    assert set(sd) == set(ref.state_dict())
    if dtype == torch.float32:
        assert max_diff(sd, ref.state_dict()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage,offload", CONFIGS)
def test_load_state_dict_writes_masters_and_shards(stage, offload, dtype, tmp_path):
    """load_state_dict(sd) puts sd's fp32 values in the masters exactly (not rounded to the
    compute dtype), the next forward uses them and the next step equals torch AdamW starting
    from them (fp32). Before, it copied into placeholders or compute copies only."""
    model = tiny_llama()
    other = tiny_llama(seed=7)
    ref = trained_reference(tiny_llama, steps=1)  # (its moments stay, as the engine's do)
    opt = ref.opt
    ref.load_state_dict(other.state_dict())
    with wrap(model, stage, offload, tmp_path, dtype=dtype) as eng:
        train(eng, model, steps=1)
        res = model.load_state_dict(other.state_dict())
        assert isinstance(res, type(ref.load_state_dict(other.state_dict())))
        assert res.missing_keys == [] and res.unexpected_keys == []
        assert max_diff(eng.full_state_dict(), other.state_dict()) == 0.0
        ids = tokens(5)
        with torch.no_grad():
            assert (model(ids).logits.float() - ref(ids).logits).abs().max().item() < (
                1e-5 if dtype == torch.float32 else 0.1)
        train(eng, model, steps=1)
        got = eng.full_state_dict()
    ids = tokens(100)  # (train's first batch)
    ref(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    if dtype == torch.float32:
        assert max_diff(got, ref.state_dict()) < 1e-5


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
def test_load_state_dict_key_semantics(stage, offload, tmp_path):
    """Missing and unexpected keys, strict or not, and shape mismatches: what torch says for
    the unwrapped model (same NamedTuple, same errors); a partial load changes only the keys
    it has."""
    model, ref = tiny_llama(), tiny_llama()
    other = tiny_llama(seed=3).state_dict()
    del other["model.layers.1.mlp.up_proj.weight"]
    other["extra.weight"] = torch.zeros(2)
    with wrap(model, stage, offload, tmp_path) as eng:
        before = eng.full_state_dict()
        want = ref.load_state_dict(dict(other), strict=False)
        got = model.load_state_dict(dict(other), strict=False)
        assert got == want and got.missing_keys == ["model.layers.1.mlp.up_proj.weight"]
        after = eng.full_state_dict()
        assert torch.equal(after["model.layers.1.mlp.up_proj.weight"],
                           before["model.layers.1.mlp.up_proj.weight"])
        assert torch.equal(after["model.layers.0.mlp.up_proj.weight"],
                           other["model.layers.0.mlp.up_proj.weight"])
        for strict_sd in (dict(other), {**ref.state_dict(),
                                        "lm_head.weight": torch.zeros(3, 32)}):
            with pytest.raises(RuntimeError) as want_err:
                ref.load_state_dict(dict(strict_sd))
            with pytest.raises(RuntimeError) as got_err:
                model.load_state_dict(dict(strict_sd))
            assert str(got_err.value) == str(want_err.value)


@pytest.mark.parametrize("stage,offload", CONFIGS)
def test_generate_greedy_and_sampled(stage, offload, tmp_path):
    """generate() with the KV cache, greedy and sampled, after training: the same tokens as
    the unwrapped model trained the same way; at stage 3 every unit is freed afterwards."""
    model = tiny_llama(tie=True)
    ref = trained_reference(lambda: tiny_llama(tie=True))
    ids = tokens(9, batch=2, seq=5)
    with wrap(model, stage, offload, tmp_path) as eng:
        train(eng, model)
        for sample in (False, True):
            kw = dict(max_new_tokens=8, do_sample=sample, pad_token_id=0, use_cache=True)
            torch.manual_seed(11)
            got = model.generate(ids, **kw)
            torch.manual_seed(11)
            assert torch.equal(got, ref.generate(ids, **kw))
        if stage == 3:
            assert eng.scheduler.live_units() == 0
        with torch.inference_mode():
            logits = model(ids).logits
        assert (logits - ref(ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
def test_save_pretrained_round_trip(stage, offload, tie, tmp_path):
    """save_pretrained while wrapped writes safetensors that from_pretrained loads into the
    trained weights (tied ones once); it wrote empty or placeholder tensors before."""
    model = tiny_llama(tie)
    out = tmp_path / "saved"
    with wrap(model, stage, offload, tmp_path) as eng:
        train(eng, model)
        want = eng.full_state_dict()
        model.save_pretrained(out)
    assert (out / "model.safetensors").exists()
    back = transformers.LlamaForCausalLM.from_pretrained(out)
    assert max_diff(back.state_dict(), want) == 0.0
    if tie:
        assert back.lm_head.weight is back.model.embed_tokens.weight


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (3, "nvme")])
def test_clip_grad_norm_and_a_torch_optimizer_raise_instead_of_doing_nothing(stage, offload,
                                                                              tmp_path):
    """clip_grad_norm_(model.parameters()) after backward raises pointing to max_grad_norm=
    (it returned 0 silently), and a torch optimizer's step over the model's parameters to
    engine.step(); without gradients clipping returns 0 as for the unwrapped model, and
    torch's zero_grad between steps is accepted."""
    model = tiny_llama()
    ids = tokens(1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with wrap(model, stage, offload, tmp_path) as eng:
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item() == 0.0
        opt.zero_grad()
        eng.backward(model(input_ids=ids, labels=ids).loss)
        with pytest.raises(RuntimeError, match="max_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(RuntimeError, match=r"engine\.step\(\)"):
            opt.step()
        eng.step()
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (3, "nvme")])
def test_model_zero_grad_drops_the_engines_gradients(stage, offload, tmp_path):
    """The wrapped model's zero_grad() drops the backward's gradients, as for the unwrapped
    model (it changed nothing: the dropped batch's gradients reached the next step); setting
    one parameter's .grad to None while the engine holds a gradient raises (it cannot drop
    one parameter's part of a flat gradient)."""
    model = tiny_llama()
    ref = trained_reference(tiny_llama, steps=1)
    with wrap(model, stage, offload, tmp_path) as eng:
        bad = tokens(7)
        eng.backward(model(input_ids=bad, labels=bad).loss)
        p = next(model.parameters())
        with pytest.raises(RuntimeError, match=r"zero_grad\(\) on the wrapped model"):
            p.grad = None
        model.zero_grad()
        train(eng, model, steps=1)
        assert max_diff(eng.full_state_dict(), ref.state_dict()) <= 1e-6


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
def test_a_backward_outside_engine_backward_raises_and_changes_nothing(stage, offload,
                                                                        tmp_path):
    """loss.backward() (or torch.autograd.backward) through the wrapped model raises, pointing
    to engine.backward(loss) (it skipped the loss scale, accumulation's 1/N and pending
    updates, silently); after it the next forward and engine.backward train as if it never
    ran."""
    model = tiny_llama()
    ref = trained_reference(tiny_llama, steps=2)
    with wrap(model, stage, offload, tmp_path, gradient_accumulation_steps=1) as eng:
        for plain in (lambda loss: loss.backward(),
                      lambda loss: torch.autograd.backward([loss])):
            ids = tokens(5)
            with pytest.raises(RuntimeError, match=r"call engine\.backward\(loss\)"):
                plain(model(input_ids=ids, labels=ids).loss)
        train(eng, model, steps=2)
        assert max_diff(eng.full_state_dict(), ref.state_dict()) <= 1e-6


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
def test_changing_requires_grad_after_wrapping_raises(stage, offload, tmp_path):
    """p.requires_grad = False and requires_grad_(False) after wrapping raise, saying to freeze
    before wrapping (the first was accepted, read back False, and the parameter still
    trained); the value it has is accepted, and a frozen one stays frozen."""
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    with wrap(model, stage, offload, tmp_path) as eng:
        p, frozen = model.lm_head.weight, model.model.norm.weight
        for change in (lambda: setattr(p, "requires_grad", False),
                       lambda: p.requires_grad_(False), lambda: frozen.requires_grad_(True),
                       lambda: model.requires_grad_(False)):
            with pytest.raises(RuntimeError, match="before OffloadEngine"):
                change()
        p.requires_grad = True
        assert p.requires_grad_() is p and p.requires_grad and not frozen.requires_grad
        before = eng.full_state_dict()
        train(eng, model, steps=1)
        after = eng.full_state_dict()
        assert torch.equal(after["model.norm.weight"], before["model.norm.weight"])
        assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (3, "none")])
def test_loss_term_on_a_parameter_trains_through_the_engine(stage, offload, tmp_path):
    """A loss term computed on a parameter outside the model's forward (a penalty on the LM
    head) gets its gradient into the engine: the steps equal torch AdamW on an unwrapped copy
    (the registered parameter runs such a computation on a view of the engine's buffer)."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    with wrap(model, stage, offload, tmp_path) as eng:
        for i in range(2):
            ids = tokens(100 + i)
            for m in (model, ref):
                loss = m(input_ids=ids, labels=ids).loss + m.lm_head.weight.pow(2).sum()
                eng.backward(loss) if m is model else loss.backward()
            eng.step()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(model.lm_head.weight * 1, eng.full_state_dict()["lm_head.weight"])
        assert max_diff(eng.full_state_dict(), ref.state_dict()) < 1e-5


def _generate_on_rank(rank, world, prompt_len):
    model = tiny_llama(tie=True)
    eng = wrap(model, 3, "cpu", None)
    try:
        ids = tokens(9 + rank, batch=1, seq=prompt_len + rank)  # different lengths per rank
        out = model.generate(ids, max_new_tokens=4 + 3 * rank, do_sample=False,
                             pad_token_id=0, synced_gpus=True)
        return ids.tolist(), out.tolist(), eng.scheduler.live_units()
    finally:
        eng.close()


def test_generate_at_world_size_2_stage_3():
    """Stage 3 on two gloo ranks: every rank calls generate (synced_gpus=True: the ranks'
    lengths differ) and gets the unwrapped model's tokens for its own prompt."""
    results = run_ranks(_generate_on_rank, 2, 4)
    ref = tiny_llama(tie=True)
    for rank, (ids, out, live) in enumerate(results):
        want = ref.generate(torch.tensor(ids), max_new_tokens=4 + 3 * rank, do_sample=False,
                            pad_token_id=0)
        assert out == want.tolist() and live == 0


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "nvme")])
def test_deepcopy_and_pickling_of_wrapped_model_raise(stage, offload, tmp_path):
    """copy.deepcopy of a wrapped model, or of one of its parameters, raises (the copy would
    hold values the engine never sees, and a copy of the engine's hooks); so do pickling and
    torch.save of either (a bare AttributeError about a local hook), not of its state_dict."""
    import io
    import pickle
    model = tiny_llama()
    with wrap(model, stage, offload, tmp_path):
        p = model.lm_head.weight
        with pytest.raises(RuntimeError, match="LlamaForCausalLM: .* deep-copied"):
            copy.deepcopy(model)
        with pytest.raises(RuntimeError, match="parameter 'lm_head.weight'.*deep-copied"):
            copy.deepcopy(p)
        for save in (lambda x: torch.save(x, io.BytesIO()), pickle.dumps):
            with pytest.raises(RuntimeError, match=r"cannot be pickled \(torch.save"):
                save(model)
            with pytest.raises(RuntimeError, match="'lm_head.weight'.*cannot be pickled"):
                save(p)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        assert max_diff(torch.load(io.BytesIO(buf.getvalue())), model.state_dict()) == 0.0


def _load_and_read_on_rank(rank, world, stage, offload, path):
    model = tiny_llama()
    other = tiny_llama(seed=7).state_dict()
    eng = wrap(model, stage, offload, path)
    try:
        res = model.load_state_dict(other)
        sd = model.state_dict()
        ids = tokens(3)
        with torch.no_grad():
            logits = model(ids).logits
        return (res.missing_keys, res.unexpected_keys, max_diff(sd, other),
                logits.tolist())
    finally:
        eng.close()


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "nvme")])
def test_state_dict_round_trip_at_world_size_2(stage, offload, tmp_path):
    """Two gloo ranks: load_state_dict writes each rank's shards, state_dict() gathers the
    full values back on every rank, and the forward equals the unwrapped model's."""
    results = run_ranks(_load_and_read_on_rank, 2, stage, offload, str(tmp_path))
    ref = tiny_llama(seed=7)
    with torch.no_grad():
        want = ref(tokens(3)).logits
    for missing, unexpected, diff, logits in results:
        assert missing == [] and unexpected == [] and diff == 0.0
        assert (torch.tensor(logits) - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_read_between_steps_sees_the_weights_the_step_made(offload, tmp_path):
    """Stage 3 on one rank (the parameters alias the engine's values), update_timing=
    "next_forward": p.detach(), p * 1 and p.sum() after step() equal the updated weights (they
    read the weights from before the step: the update waited for the next forward), and the
    run goes on bit for bit as one that reads nothing."""
    quiet, reader = tiny_llama(), tiny_llama()
    kw = dict(update_timing="next_forward")
    with wrap(quiet, 3, offload, tmp_path, **kw) as e_quiet, \
            wrap(reader, 3, offload, tmp_path, **kw) as e_read:
        for i in range(3):
            ids = tokens(100 + i)
            for eng, model in ((e_quiet, quiet), (e_read, reader)):
                eng.backward(model(input_ids=ids, labels=ids).loss)
                eng.step()
            p = reader.model.norm.weight
            seen = [p.detach().clone(), (p * 1).detach(), p.sum().detach()]
            want = e_read.full_state_dict()["model.norm.weight"]
            assert torch.equal(seen[0], want) and torch.equal(seen[1], want)
            assert torch.equal(seen[2], want.sum())
        assert max_diff(e_quiet.full_state_dict(), e_read.full_state_dict()) == 0.0


def test_detach_of_a_sharded_parameter_is_a_placeholder_that_raises(tmp_path):
    """Stage 3 with the shards on NVMe: p.detach() of a parameter is a placeholder whose use
    raises as the parameter's does (it was a tensor of zeros, read as the weights), and
    state_dict(), which detaches every parameter, still gives the values."""
    model = tiny_llama()
    want = copy.deepcopy(model).state_dict()
    with wrap(model, 3, "nvme", tmp_path) as eng:
        d = model.model.norm.weight.detach()
        assert d.shape == model.model.norm.weight.shape and not d.requires_grad
        for use in (lambda: d.clone(), lambda: d.sum(), lambda: d.numpy()):
            with pytest.raises(RuntimeError, match="model.norm.weight' is sharded"):
                use()
        assert max_diff(model.state_dict(), want) == 0.0
        assert eng.memory_report()["live_units"]["current"] == 0
