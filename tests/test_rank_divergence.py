"""Ranks that run different things: mixture-of-experts routing, skipped units, different
numbers of forwards, a rank that fails. Each case either equals the single-process reference
or raises on every rank within seconds (see [Note: reduction order] and [Note: lockstep])."""
import copy
import os
import tempfile
import time

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks
from models import TinyLM, batches, lm_loss


class TwoExperts(nn.Module):
    """Two equal-shaped experts; ``forward(x, ids)`` sums the experts named in ``ids``."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, ids):
        return sum(self.experts[e](x) for e in ids)


ROUTES = [[0], [1]]  # rank 0 runs expert 0, rank 1 expert 1


def _experts_rank(rank, world_size, stage, offload, kwargs, routes, steps=3):
    from offload_zero import OffloadEngine
    torch.manual_seed(0)
    model = TwoExperts()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(world_size, 3, 4, generator=g) for _ in range(steps)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x in xs:
        opt.zero_grad()
        losses = [ref(x[r], routes[r]).pow(2).mean() for r in range(world_size) if routes[r]]
        (sum(losses) / world_size).backward()
        opt.step()
    with tempfile.TemporaryDirectory() as d:
        with OffloadEngine(model, offload=offload, path=d if offload == "nvme" else None,
                           stage=stage, lr=1e-2, weight_decay=0.1, **kwargs) as eng:
            for x in xs:
                out = eng(x[rank], routes[rank])
                loss = out.pow(2).mean() if routes[rank] else (out * 0.0).sum()
                eng.backward(loss)
                eng.step()
            sd = eng.full_state_dict()
    return max((sd[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


EXPERT_CASES = [  # (stage, offload, engine keywords, routes per rank)
    (1, "cpu", {}, ROUTES), (1, "none", {}, ROUTES), (2, "cpu", {}, ROUTES),
    (2, "nvme", {}, ROUTES), (2, "cpu", {"update_timing": "backward"}, ROUTES),
    (2, "nvme", {"update_timing": "backward"}, ROUTES),
    (3, "cpu", {"leaf_modules": ["experts"]}, ROUTES),
    (3, "nvme", {"leaf_modules": ["experts"]}, ROUTES),
    (3, "cpu", {"leaf_modules": ["experts"], "update_timing": "backward"}, ROUTES),
    # expert 1 runs on no rank: torch.optim skips it (no .grad), and so must the engine;
    # weight decay would move it if it were updated with a zero gradient
    (2, "cpu", {}, [[0], [0]]), (2, "cpu", {"update_timing": "backward"}, [[0], [0]]),
]


def _expert_cases_rank(rank, world_size):
    return [_experts_rank(rank, world_size, *case) for case in EXPERT_CASES]


@pytest.fixture(scope="module")
def expert_diffs():
    """Every case of :data:`EXPERT_CASES` in one launch of two ranks: ``[rank][case]``."""
    return run_ranks(_expert_cases_rank, 2, timeout_s=300)


@pytest.mark.parametrize("case", range(len(EXPERT_CASES)),
                         ids=[f"stage{c[0]}-{c[1]}-{'-'.join(c[2]) or 'step'}-{c[3]}"
                              for c in EXPERT_CASES])
def test_experts_routed_per_rank_equal_adamw(expert_diffs, case):
    diffs = [expert_diffs[r][case] for r in range(2)]
    assert max(diffs) <= 1e-6, (EXPERT_CASES[case], diffs)


def _mismatch_rank(rank, world_size, stage, kwargs):
    from offload_zero import OffloadEngine
    from offload_zero.lockstep import CollectiveMismatch
    torch.manual_seed(0)
    eng = OffloadEngine(TwoExperts(), offload="cpu", stage=stage, lr=1e-2, **kwargs)
    t0 = time.monotonic()
    try:
        eng.backward(eng(torch.randn(3, 4), ROUTES[rank]).pow(2).mean())
        eng.step()
    except CollectiveMismatch as exc:
        return "mismatch", time.monotonic() - t0, str(exc)
    finally:
        eng.close()
    return "no error", time.monotonic() - t0, ""


def test_stage3_experts_as_units_raise_on_every_rank():
    # without leaf_modules each expert is a unit of its own: the ranks gather different units
    results = run_ranks(_mismatch_rank, 2, 3, {}, timeout_s=60)
    for outcome, waited_s, text in results:
        assert outcome == "mismatch" and waited_s < 10, results
        assert "experts.0" in text and "experts.1" in text and "leaf_modules" in text, text


def _moe_rank(rank, world_size, arch, offload, steps=3):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from offload_zero import OffloadEngine
    from offload_zero.partition.units import find_leaf_modules
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=1)
    torch.manual_seed(0)  # (every rank builds the same weights)
    if arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, **common))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(num_experts=4, moe_intermediate_size=24,
                                                   shared_expert_intermediate_size=24, **common))
    model.float()
    leaves = find_leaf_modules(model)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    # a few tokens per rank and top-1 routing: some experts get no token on one rank
    data = [torch.randint(0, 64, (world_size, 3), generator=g) for _ in range(steps)]
    # eps 1e-5: with torch's 1e-8, elements whose gradient is almost zero magnify the
    # rounding of a sum in another order (two ranks' halves) to lr-sized differences
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, eps=1e-5)
    for ids in data:
        opt.zero_grad()
        loss = sum(ref(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss for r in range(world_size))
        (loss / world_size).backward()
        opt.step()
    with tempfile.TemporaryDirectory() as d:
        with OffloadEngine(model, offload=offload, path=d if offload == "nvme" else None,
                           stage=3, lr=1e-2, eps=1e-5) as eng:
            for ids in data:
                eng.backward(eng(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss)
                eng.step()
            sd = eng.full_state_dict()
    diff = max((sd[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return diff, leaves


def _moe_archs_rank(rank, world_size):
    return {arch: _moe_rank(rank, world_size, arch, "cpu") for arch in ("mixtral", "qwen2_moe")}


def test_transformers_moe_at_stage3_equal_adamw():
    for rank_result in run_ranks(_moe_archs_rank, 2, timeout_s=300):
        for arch, (diff, leaves) in rank_result.items():
            assert leaves == ["model.layers.0.mlp", "model.layers.1.mlp"], (arch, leaves)
            assert diff <= 1e-6, (arch, diff)


def _forward_counts_rank(rank, world_size, counts):
    from offload_zero import OffloadEngine
    from offload_zero.lockstep import CollectiveMismatch
    torch.manual_seed(0)
    x, y = batches(1, batch=2)[0]
    with OffloadEngine(TinyLM(n_blocks=3), offload="cpu", stage=3) as eng:
        t0 = time.monotonic()
        try:
            for _ in range(2):
                with torch.no_grad():
                    for _ in range(counts[rank]):  # evaluation, generation steps
                        eng(x)
                eng.backward(lm_loss(eng(x), y))
                eng.step()
        except CollectiveMismatch as exc:
            return "mismatch", time.monotonic() - t0, str(exc)
        return "ok", time.monotonic() - t0, ""


def test_different_numbers_of_no_grad_forwards_raise_on_every_rank():
    results = run_ranks(_forward_counts_rank, 2, [2, 3], timeout_s=60)
    for outcome, waited_s, text in results:
        assert outcome == "mismatch" and waited_s < 10, results
        assert "forward no grad" in text and "synced_gpus=True" in text, text


def test_no_grad_forwards_in_lockstep_work():
    # synced_gpus-style: the rank that is done runs the same number of forwards as the others
    results = run_ranks(_forward_counts_rank, 2, [3, 3], timeout_s=60)
    assert [r[0] for r in results] == ["ok", "ok"], results


# -- a rank that fails and stays alive -------------------------------------------------------

class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("bad gradient on this rank")


class Faulty(nn.Module):
    """A block that raises in forward (``armed == "forward"``) or in backward."""

    def __init__(self, d=24):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.armed = None

    def forward(self, x):
        if self.armed == "forward":
            raise RuntimeError("bad batch on this rank")
        h = x + self.lin(x)
        return _RaiseInBackward.apply(h) if self.armed == "backward" else h


class FaultyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(53, 24)
        self.blocks = nn.ModuleList(Faulty() for _ in range(3))
        self.head = nn.Linear(24, 53)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _failing_step(*args, **kwargs):
    raise OSError("disk error on this rank")


def _lingering_rank(rank, world_size, where, shared, linger_s=60.0):
    """Rank 1 fails at step 1 (in ``where``), catches the error and lingers up to
    ``linger_s`` without calling the engine; rank 0 goes on and must raise PeerFailure."""
    from offload_zero import OffloadEngine
    from offload_zero.lockstep import PeerFailure
    torch.manual_seed(0)
    model = FaultyLM()
    x, y = batches(1, batch=2)[0]
    path = os.path.join(shared, f"swap{rank}")
    os.makedirs(path)
    raised_mark = os.path.join(shared, "rank0_raised")
    outcome = None
    with OffloadEngine(model, offload="nvme", path=path, stage=3, timeout_s=300) as eng:
        for step in range(3):
            if rank == 1 and step == 1:
                if where == "step":
                    eng.store.iter_states = _failing_step
                elif where == "checkpoint":  # before the save's first collective
                    eng._finish_updates = _failing_step
                else:
                    model.blocks[1].armed = where
            try:
                eng.backward(lm_loss(eng(x), y))
                eng.step()
                if where == "checkpoint":
                    eng.save_checkpoint(os.path.join(shared, "ckpt"), client_state={"step": step})
            except PeerFailure as exc:
                outcome = ("peer failure", time.time(), str(exc))
                open(raised_mark, "w").close()
                break
            except Exception as exc:  # noqa: BLE001 - the failure injected on this rank
                # the script catches it to write its logs, and stays alive
                outcome = ("raised", time.time(), f"{type(exc).__name__}: {exc}")
                deadline = time.monotonic() + linger_s
                while time.monotonic() < deadline and not os.path.exists(raised_mark):
                    time.sleep(0.2)
                break
    return outcome, sorted(os.listdir(path))


@pytest.mark.parametrize("where", ["forward", "backward", "step", "checkpoint"])
def test_a_failed_rank_that_lingers_stops_the_others(tmp_path, where):
    (r0, files0), (r1, files1) = run_ranks(_lingering_rank, 2, where, str(tmp_path),
                                           timeout_s=150)
    assert r1[0] == "raised", r1
    assert r0[0] == "peer failure", r0
    assert r0[1] - r1[1] < 20, (r0, r1)  # seconds from rank 1's error to rank 0's
    assert "rank 1 failed with" in r0[2] and r1[2].split(": ", 1)[1] in r0[2], r0[2]
    assert files0 == [] and files1 == []  # swap files removed on both ranks
    if where == "checkpoint":  # the step-0 checkpoint is still the current one, whole
        from offload_zero.checkpoint import read_metadata
        assert read_metadata(tmp_path / "ckpt")["client_state"] == {"step": 0}
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "ckpt", "rank0_raised", "swap0", "swap1"]


# -- leaf modules -----------------------------------------------------------------------------

class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        return self.experts[int(self.gate(x).sum() > 0)](x)


class MyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MoEBlock()

    def forward(self, x):
        return x + self.mlp(x)


class LayeredMoE(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.layers = nn.ModuleList(MyLayer() for _ in range(n))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _unit_names(model, **kwargs):
    from offload_zero.partition.units import find_unit_modules
    return [n for n, _ in find_unit_modules(model, **kwargs)]


def test_a_leaf_is_one_unit_and_nothing_is_cut_inside_it():
    m = LayeredMoE(n=2)
    # the experts' lists are larger than the layers' list by count, but not by elements
    assert _unit_names(m) == ["layers.0", "layers.1"]
    # unit_classes would cut inside the MoE block: a leaf (by class) keeps it whole
    assert _unit_names(m, unit_classes=(nn.Linear,)) == [
        "layers.0.mlp.gate", "layers.0.mlp.experts.0", "layers.0.mlp.experts.1",
        "layers.1.mlp.gate", "layers.1.mlp.experts.0", "layers.1.mlp.experts.1", "head"]
    assert _unit_names(m, unit_classes=(nn.Linear,), leaf_modules=(MoEBlock,)) == [
        "layers.0.mlp", "layers.1.mlp", "head"]
    # by name; a container (ModuleList) leaf too
    assert _unit_names(TwoExperts(), leaf_modules=("experts",)) == ["experts"]
    assert _unit_names(TwoExperts()) == ["experts.0", "experts.1"]


def test_sparse_moe_blocks_are_leaves_without_asking():
    from offload_zero.partition.units import find_leaf_modules

    class QwenLikeSparseMoeBlock(MoEBlock):
        pass

    m = LayeredMoE(n=2)
    m.layers[1].mlp = QwenLikeSparseMoeBlock()
    assert find_leaf_modules(m) == ["layers.1.mlp"]
    assert _unit_names(m, unit_classes=(nn.Linear,))[3:] == ["layers.1.mlp", "head"]


def test_bad_leaf_modules_name_the_value():
    from offload_zero import OffloadEngine
    with pytest.raises(ValueError, match=r"leaf_modules names \['expert'\].*experts"):
        OffloadEngine(TwoExperts(), leaf_modules=["expert"])
    with pytest.raises(ValueError, match="leaf_modules entry 3"):
        OffloadEngine(TwoExperts(), leaf_modules=[3])
    with pytest.raises(ValueError, match="check_collectives"):
        OffloadEngine(TwoExperts(), check_collectives="yes")


def test_a_container_leaf_trains_like_torch_on_one_rank():
    from offload_zero import OffloadEngine
    torch.manual_seed(0)
    model = TwoExperts()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    xs = [torch.randn(3, 4) for _ in range(3)]
    for x in xs:
        opt.zero_grad()
        ref(x, [0, 1, 0]).pow(2).mean().backward()
        opt.step()
    with OffloadEngine(model, stage=3, offload="cpu", offload_param="cpu", lr=1e-2,
                       leaf_modules=["experts"]) as eng:
        for x in xs:
            eng.backward(eng(x, [0, 1, 0]).pow(2).mean())  # expert 0 twice: one gather
            eng.step()
        assert eng.scheduler.live_peak <= 2
        sd = eng.full_state_dict()
    assert max((sd[n] - p).abs().max().item() for n, p in ref.named_parameters()) <= 1e-6


def _generate_then_train_rank(rank, world_size, synced):
    """Generation of a different length per rank at stage 3 (evaluation), then a step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from offload_zero import OffloadEngine
    from offload_zero.lockstep import CollectiveMismatch
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(rank))
    with OffloadEngine(model, offload="cpu", stage=3) as eng:
        t0 = time.monotonic()
        try:
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=2 + 3 * rank, min_new_tokens=2 + 3 * rank,
                                     do_sample=False, pad_token_id=0, synced_gpus=synced)
            eng.backward(eng(input_ids=ids, labels=ids).loss)
            eng.step()
        except CollectiveMismatch as exc:
            return "mismatch", time.monotonic() - t0, str(exc)
        return "ok", time.monotonic() - t0, out.shape[1]


def test_generation_of_per_rank_length_needs_synced_gpus():
    results = run_ranks(_generate_then_train_rank, 2, False, timeout_s=120)
    for outcome, waited_s, text in results:
        assert outcome == "mismatch" and waited_s < 30, results
        assert "synced_gpus=True" in text, text
    results = run_ranks(_generate_then_train_rank, 2, True, timeout_s=120)
    assert [(r[0], r[2]) for r in results] == [("ok", 6), ("ok", 9)], results
