"""OffloadEngine at world size 1, numerics: the weights against torch.optim on an unsharded copy
(Adam and AdamW, stages 1-3, every tier, bf16/fp32, tied, frozen, skipped and repeated units,
accumulation, clipping, activation checkpointing), and the full state dict."""
import copy

import pytest
import torch
import torch.nn as nn

from engine_common import OFFLOADS, make_engine, train_both
from models import TinyLM, batches, lm_loss, max_param_diff
from offload_zero import OffloadEngine


def _saved_bytes_and_grads(checkpointing, steps=1):
    torch.manual_seed(10)
    model = TinyLM(n_blocks=8)
    calls = []
    for b in model.blocks:
        b.up.register_forward_hook(
            lambda mod, a, o: calls.append(mod.weight.untyped_storage().nbytes() > 0))
    with OffloadEngine(model, activation_checkpointing=checkpointing) as eng:
        x, y = batches(1, batch=8, seq=32)[0]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            loss = lm_loss(eng(x), y)
        eng.backward(loss)
        grads = {fp.name: eng.grads.buf[fp].clone() for fp in eng.trainable}
        gathers = eng.comm_report()["total"]["all_gather"]
    return loss.item(), grads, sum(saved), calls


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_matches_torch_adam(offload, adamw, stage, tmp_path):
    torch.manual_seed(0)
    eng, ref = train_both(TinyLM(), {"stage": stage}, tmp_path, offload, adamw=adamw)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6


@pytest.mark.parametrize("offload", OFFLOADS)
def test_tied_embedding_is_one_parameter(offload, tmp_path):
    torch.manual_seed(1)
    model = TinyLM(tie=True)
    eng, ref = train_both(model, {}, tmp_path, offload)
    with eng:
        sd = eng.full_state_dict()
        assert torch.equal(sd["emb.weight"], sd["head.weight"])
        assert max_param_diff(sd, ref) <= 1e-6
        flat_numel = sum(fp.numel for fp in eng.flat_params)
        assert flat_numel == sum(p.numel() for p in ref.parameters())  # counted once


def test_full_state_dict_loads_strictly_into_a_fresh_llama():
    """Non-persistent buffers (rotary inv_freq) are not in the export, as in the model's own
    state_dict(), so a fresh Hugging Face model loads it strictly."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    expected = set(model.state_dict())
    with OffloadEngine(model, offload="cpu") as eng:
        x = torch.randint(0, 100, (2, 8))
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
        sd = eng.full_state_dict()
    assert set(sd) == expected
    LlamaForCausalLM(config).load_state_dict(sd)  # strict


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_a_module_used_under_two_names_exports_both(offload, tmp_path):
    """A module registered twice (``self.c = self.a``) has its parameters under both names in
    ``model.state_dict()``: the export has both too (it had only the first, so a fresh model's
    strict ``load_state_dict`` failed), with the trained values, and a checkpoint restores the
    model. Training matches torch's AdamW (one parameter each, however many names)."""
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.c = self.a

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x))))).pow(2).mean()

    torch.manual_seed(0)
    model = Shared()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    path = str(tmp_path) if offload == "nvme" else None
    x = torch.randn(4, 8)
    with OffloadEngine(model, offload=offload, path=path, lr=1e-2, weight_decay=0.1) as eng:
        for _ in range(3):
            eng.backward(eng(x))
            eng.step()
            ref(x).backward()
            opt.step()
            opt.zero_grad()
        sd = eng.full_state_dict()
        assert set(sd) == set(ref.state_dict()) == {f"{m}.{k}" for m in "abc" for k in
                                                     ("weight", "bias")}
        assert max_param_diff(sd, ref) <= 1e-6
        fresh = Shared()
        fresh.load_state_dict(sd)  # strict
        assert fresh.c is fresh.a and torch.equal(fresh.a.weight, sd["c.weight"])
        eng.save_checkpoint(tmp_path / "ck")
    with OffloadEngine(Shared(), offload=offload, path=path, lr=1e-2) as other:
        other.load_checkpoint(tmp_path / "ck")
        assert all(torch.equal(v, sd[k]) for k, v in other.full_state_dict().items())


def test_full_state_dict_names_and_shapes(tmp_path):
    model = TinyLM()
    expected = {n: p.shape for n, p in model.state_dict().items()}
    with OffloadEngine(model) as eng:
        sd = eng.full_state_dict()
    assert {n: t.shape for n, t in sd.items()} == expected
    assert all(t.dtype == torch.float32 for t in sd.values())
    fresh = TinyLM()
    fresh.load_state_dict(sd)  # strict


def test_skipped_and_repeated_units_and_two_forwards(tmp_path):
    torch.manual_seed(3)
    model = TinyLM()

    def vary(i, m, ref):
        for mm in (m, ref):
            mm.skip = {2} if i % 2 else set()
            mm.repeat = {4} if i == 1 else set()

    eng, ref = train_both(model, {}, tmp_path, "cpu", before_step=vary)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        # two forwards before one backward accumulate into the same gradients
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        (x1, y1), (x2, y2) = batches(2, seed=9)
        eng.backward(lm_loss(eng(x1), y1) + lm_loss(eng(x2), y2))
        eng.step()
        ref_opt.zero_grad()
        (lm_loss(ref(x1), y1) + lm_loss(ref(x2), y2)).backward()
        # fresh AdamW state on the reference: compare only the direction of the accumulated grad
        assert all(p.grad is not None for p in ref.parameters())


def test_gradient_accumulation_over_two_backwards(tmp_path):
    torch.manual_seed(4)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    with OffloadEngine(model, offload="cpu", lr=1e-2) as eng:
        for step in range(3):
            bs = batches(2, seed=step)
            for x, y in bs:
                eng.backward(lm_loss(eng(x), y))
            eng.step()
            opt.zero_grad()
            for x, y in bs:
                lm_loss(ref(x), y).backward()
            opt.step()
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6


def test_frozen_parameters_stay_sharded_and_unchanged(tmp_path):
    torch.manual_seed(5)
    model = TinyLM()
    for b in model.blocks[:3]:
        b.up.weight.requires_grad_(False)
    model.emb.weight.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    eng, ref = train_both(model, {"update_timing": "step"}, tmp_path, "nvme")
    with eng:
        sd = eng.full_state_dict()
        for n, v in frozen.items():
            assert torch.equal(sd[n], v), n
        assert max_param_diff(sd, ref) <= 1e-6
        assert all(fp.requires_grad for fp in eng.trainable)
        frozen_fps = [fp for fp in eng.flat_params if not fp.requires_grad]
        assert len(frozen_fps) == 4  # three blocks + root
        # optimizer state for the trainable shards (fp32: a trainable shard is its master's
        # bytes), the frozen shards in files of their own
        assert eng.memory_report()["nvme"]["current_bytes"] == 12 * sum(
            fp.shard_numel for fp in eng.trainable) + 4 * sum(fp.shard_numel for fp in frozen_fps)


def test_buffers_are_not_sharded_and_eval_between_steps():
    torch.manual_seed(6)

    class WithBN(nn.Module):
        def __init__(self):
            super().__init__()
            # no bias before the norm: its gradient would be pure rounding noise, which Adam
            # normalises into full-size steps in both runs alike but not identically
            # (nor a norm right after a norm, through a linear map, for the same reason)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8),
                                                      nn.Tanh()) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = WithBN()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    with OffloadEngine(model, lr=1e-2) as eng:
        target = torch.randn(16, 8)
        for i in range(3):
            x = torch.randn(16, 8)
            eng.train()
            eng.backward((eng(x) - target).pow(2).mean())
            eng.step()
            ref.train()
            opt.zero_grad()
            (ref(x) - target).pow(2).mean().backward()
            opt.step()
            eng.eval()
            ref.eval()
            with torch.no_grad():
                assert torch.allclose(eng(x), ref(x), atol=1e-5)
            with torch.inference_mode():
                assert torch.allclose(eng(x), ref(x), atol=1e-5)
        sd = eng.full_state_dict()
        for n, b in ref.named_buffers():
            assert torch.allclose(sd[n].to(b.dtype), b), n
        assert max_param_diff(sd, ref) <= 1e-6


def test_reading_another_units_parameter_names_it():
    class Peeking(TinyLM):
        def forward(self, x):
            return super().forward(x) + self.blocks[3].up.bias.sum()

    # shards off the device: the other unit is not gathered, so the read fails, naming it
    with OffloadEngine(Peeking(), offload_param="cpu") as eng:
        x, _ = batches(1)[0]
        with pytest.raises(RuntimeError, match=r"blocks\.3\.up\.bias"):
            eng(x)
    # one rank with its shards on the device: every parameter is always there, so it reads
    # the real value
    torch.manual_seed(0)
    model = Peeking()
    ref = copy.deepcopy(model)
    with OffloadEngine(model) as eng:
        x, _ = batches(1)[0]
        assert torch.equal(eng(x), ref(x))


def test_bf16_compute_trains_and_keeps_fp32_master(tmp_path):
    torch.manual_seed(7)
    model = TinyLM()
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), dtype=torch.bfloat16, lr=1e-2) as eng:
        losses = []
        x, y = batches(1)[0]
        for _ in range(15):
            loss = lm_loss(eng(x), y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
        assert losses[-1] < losses[0] - 0.5
        assert all(fp.dtype == torch.bfloat16 for fp in eng.flat_params)
        assert eng.pools["param_shards"].dtype == torch.bfloat16
        sd = eng.full_state_dict()
        # master weights carry precision bf16 cannot hold
        assert any(not torch.equal(t, t.bfloat16().float()) for t in sd.values())


@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_parameter_offload_matches_and_bounds_host_residency(offload_param, tmp_path):
    torch.manual_seed(8)
    model = TinyLM(n_blocks=8)
    seen = []
    holder = []

    def probe(mod, args):
        if holder:
            rep = holder[0].memory_report()
            seen.append((rep["host"]["by_kind"]["parameters"]["current_bytes"],
                         rep["pools"].get("param_shards", {}).get("in_use", 0)))

    for b in model.blocks:
        b.register_forward_pre_hook(probe)
    eng, ref = train_both(model, {"offload_param": offload_param, "offload_optimizer": "cpu",
                                   "path": str(tmp_path)}, tmp_path, "cpu", on_engine=holder.append)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        s_all = sum(fp.shard_numel for fp in eng.flat_params)
        rep = eng.memory_report()
        if offload_param == "cpu":
            assert rep["host"]["by_kind"]["parameters"]["current_bytes"] == 4 * s_all
            assert rep["device"]["by_kind"]["parameters"]["current_bytes"] == 0
        else:
            # host holds parameter shards only for the units in flight: the current unit and
            # the one being read ahead (prefetch=1), never all eight
            assert rep["nvme"]["by_kind"]["parameters"]["current_bytes"] == 4 * s_all
            assert seen and all(host == 0 for host, _ in seen)
            assert max(in_use for _, in_use in seen) <= 2
            assert rep["pools"]["param_shards"]["peak_in_use"] <= eng.pools["param_shards"].count
            assert rep["pools"]["param_shards"]["in_use"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvme_matches_cpu_offload_bit_for_bit(dtype, tmp_path):
    """offload="nvme" (optimizer state and parameter shards in files; fp32 shards read from the
    master's bytes; the root's updated shard kept for the next forward) against host offload
    of both."""
    results = []
    for offload in ("cpu", "nvme"):
        torch.manual_seed(9)
        with make_engine(TinyLM(), offload, tmp_path, lr=1e-2, dtype=dtype, stage=3,
                     offload_param=offload) as eng:
            for x, y in batches(5):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            results.append(eng.full_state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_activation_checkpointing_same_numbers_less_memory():
    loss0, grads0, saved0, calls0 = _saved_bytes_and_grads(False)
    loss1, grads1, saved1, calls1 = _saved_bytes_and_grads(True)
    assert abs(loss0 - loss1) <= 1e-6
    for name in grads0:
        assert (grads0[name] - grads1[name]).abs().max().item() <= 1e-6, name
    assert saved1 < 0.5 * saved0, (saved0, saved1)  # only block inputs are kept
    # each block's Linear ran once without checkpointing, twice with (the recomputation), and
    # every time its weight was gathered
    assert len(calls0) == 8 and len(calls1) == 16
    assert all(calls1)


def test_activation_checkpointing_on_a_llama_matches_plain_backward():
    """Regression: views set in a pre-backward hook (grad mode off there) must still track
    gradients, else the recomputation saves fewer tensors and gives no weight gradients."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        with OffloadEngine(LlamaForCausalLM(cfg), activation_checkpointing=checkpointing) as eng:
            eng.backward(eng(input_ids=x, labels=x).loss)
            grads.append({fp.name: eng.grads.buf[fp].clone() for fp in eng.trainable})
    for name, g in grads[0].items():
        assert g.abs().sum() > 0
        assert (g - grads[1][name]).abs().max().item() <= 1e-6, name


def test_gradient_clipping_matches_torch_clip_grad_norm(tmp_path):
    torch.manual_seed(12)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    with OffloadEngine(copy.deepcopy(model), offload="cpu", lr=1e-2) as unclipped:
        unclipped.backward(lm_loss(unclipped(batches(1)[0][0]), batches(1)[0][1]))
        unclipped.step()
        assert unclipped.last_grad_norm is None  # (measured only to clip)
    with OffloadEngine(model, offload="cpu", lr=1e-2, max_grad_norm=0.5) as eng:
        assert eng.last_grad_norm is None  # (before the first step)
        for x, y in batches(5):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            opt.zero_grad()
            lm_loss(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
            opt.step()
            assert abs(eng.last_grad_norm - ref_norm) <= 1e-5 * max(1.0, ref_norm)
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        # a non-finite gradient skips the step and changes nothing
        before = eng.full_state_dict()
        x, y = batches(1)[0]
        loss = lm_loss(eng(x), y) * float("inf")
        eng.backward(loss)
        eng.step()
        assert eng.skipped_steps == 1
        after = eng.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_check_before_a_chunked_update(dtype):
    """The check that guards a chunked update: exact for inf and nan wherever they sit, and
    finite values whose sum overflows are still finite (checked element by element)."""
    from offload_zero.update.adam import all_finite as _all_finite
    t = torch.randn(10_000, dtype=dtype)
    assert _all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[7_777] = bad
        assert not _all_finite(u, chunk=1024)
    u = t.clone()
    u[3], u[9_000] = float("inf"), float("-inf")  # the sum is nan, not 0
    assert not _all_finite(u)
    big = torch.full((4096,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not torch.isfinite(big.sum()) and _all_finite(big, chunk=1000)
