"""engine.optimizer and parameter groups: torch's LR schedulers and transformers' schedules drive
the engine unchanged, element by element against torch.optim.AdamW on an unwrapped copy."""
import copy
import tempfile
import warnings

import pytest
import torch

from dist_harness import run_ranks
from models import VOCAB, WIDTH, Block, TinyLM, batches, lm_loss

from offload_zero import OffloadEngine

STEPS = 8
LR = 1e-2
CASES = [(s, o) for s in (1, 2, 3) for o in ("none", "cpu", "nvme")]
CASES_WS2 = CASES


def _no_decay(name: str) -> bool:
    return (name.endswith("bias") or ".ln." in name or name.startswith("norm.")
            or name.startswith("pos."))


def _groups(model, lr=LR):
    """Weight decay 0.1 on the weights, none on biases and norms, at twice the lr."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.1},
            {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0,
             "lr": 2 * lr}]


def _cosine(opt):
    from transformers import get_cosine_schedule_with_warmup
    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)


def _reference(model, data, make_schedule=_cosine, accumulate=1):
    """torch.optim.AdamW with :func:`_groups` and ``make_schedule`` on a copy of ``model``;
    ``accumulate`` micro-batches per step, their mean loss. Returns the weights after each
    step."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(_groups(ref), lr=LR, foreach=False)
    sched = make_schedule(opt)
    out = []
    for i in range(0, len(data), accumulate):
        opt.zero_grad()
        for x, y in data[i:i + accumulate]:
            (lm_loss(ref(x), y) / accumulate).backward()
        opt.step()
        sched.step()
        out.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return out


def _diff(state, expected) -> float:
    return max((state[n] - v).abs().max().item() for n, v in expected.items())


def _engine(model, stage, offload, path, **kw):
    kw = {"lr": LR, **kw}
    return OffloadEngine(model, stage=stage, offload=offload,
                         path=path if offload == "nvme" else None,
                         param_groups=_groups(model, kw["lr"]), **kw)


def _train(eng, data, make_schedule=_cosine):
    """Train ``eng`` on ``data`` with ``make_schedule(eng.optimizer)``, calling engine.step()
    and engine.optimizer.step() in turn; returns the weights after each step and the
    warnings about the order of scheduler and optimizer steps."""
    sched = make_schedule(eng.optimizer)
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data):
            eng.backward(lm_loss(eng(x), y))
            (eng.step if i % 2 else eng.optimizer.step)()
            eng.zero_grad()
            sched.step()
            out.append(eng.full_state_dict())
    order = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return out, order


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_two_groups_with_cosine_warmup_match_torch(case, tmp_path, torch_single_thread):
    stage, offload = case
    torch.manual_seed(0)
    model = TinyLM()
    data = batches(STEPS, seed=1)
    expected = _reference(model, data)
    with _engine(model, stage, offload, tmp_path) as eng:
        got, order = _train(eng, data)
        assert [g["lr"] for g in eng.optimizer.param_groups] == [0.0, 0.0]  # (the schedule's end)
    assert not order
    assert max(_diff(g, e) for g, e in zip(got, expected)) <= 1e-6


def _ws2_rank(rank, world_size, cases):
    torch.set_num_threads(1)
    out = {}
    for stage, offload in cases:
        torch.manual_seed(0)
        model = TinyLM()
        data = batches(STEPS, seed=1, batch=2 * world_size)
        expected = _reference(model, data)
        with tempfile.TemporaryDirectory() as d, _engine(model, stage, offload, d) as eng:
            got, _ = _train(eng, [(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
                                  for x, y in data])
        out[(stage, offload)] = max(_diff(g, e) for g, e in zip(got, expected))
    return out


def test_two_groups_with_cosine_warmup_match_torch_world_size_2():
    for result in run_ranks(_ws2_rank, 2, CASES_WS2):
        assert all(d <= 1e-6 for d in result.values()), result


def _lambda_from_zero(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 3)


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[LR, 2 * LR], total_steps=STEPS)


def _sequential(opt):
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.25, total_iters=3),
                                    sched.CosineAnnealingLR(opt, T_max=STEPS - 3)],
                              milestones=[3])


def _linear_warmup(opt):
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=STEPS)


SCHEDULES = {"lambda_from_zero": _lambda_from_zero, "one_cycle": _one_cycle,
             "sequential": _sequential, "linear_warmup": _linear_warmup,
             "cosine_annealing": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 4)}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_torch_schedulers_match_torch(name, tmp_path, torch_single_thread):
    """OneCycleLR cycles beta1 too (the groups' betas), SequentialLR chains two schedulers."""
    make = SCHEDULES[name]
    torch.manual_seed(0)
    model = TinyLM()
    data = batches(STEPS, seed=2)
    expected = _reference(model, data, make)
    with _engine(model, 3, "cpu", tmp_path) as eng:
        got, order = _train(eng, data, make)
        if name == "one_cycle":
            assert eng.optimizer.param_groups[0]["betas"][0] != 0.9
    assert not order
    assert max(_diff(g, e) for g, e in zip(got, expected)) <= 1e-6


def test_warmup_from_lr_zero_changes_no_weight_but_the_moments(tmp_path, torch_single_thread):
    """The first step at lr 0 leaves every weight as it was, bit for bit; its moments count
    (the later steps match torch's, whose first step updates the moments too)."""
    torch.manual_seed(0)
    model = TinyLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = batches(4, seed=3)
    expected = _reference(model, data, _lambda_from_zero)
    with _engine(model, 3, "nvme", tmp_path) as eng:
        got, _ = _train(eng, data, _lambda_from_zero)
    assert all(torch.equal(got[0][n], v) for n, v in before.items())
    assert _diff(got[1], before) > 0
    assert max(_diff(g, e) for g, e in zip(got, expected)) <= 1e-6


@pytest.mark.parametrize("mode", ["backward", "next_forward"])
def test_update_in_backward_and_forward_read_the_groups_as_documented(mode, tmp_path,
                                                                    torch_single_thread):
    """update_timing="backward" updates in backward with the values in force then (the scheduler
    stepped after the last step); update_timing="next_forward" decides at step() and applies in the next
    forward with those values, whatever the groups say by then (here: the scheduler's next
    value, and a hand edit to 0 before the forward that applies the update)."""
    torch.manual_seed(0)
    model = TinyLM()
    data = batches(STEPS, seed=4)
    expected = _reference(model, data)
    kw = {"update_timing": mode}
    with _engine(model, 3, "nvme", tmp_path, **kw) as eng:
        sched = _cosine(eng.optimizer)
        for x, y in data:
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            sched.step()
            if mode == "next_forward":
                saved = [g["lr"] for g in eng.optimizer.param_groups]
                for g in eng.optimizer.param_groups:  # the pending update keeps its values
                    g["lr"] = 0.0
                with torch.no_grad():
                    eng(x)  # (applies the pending updates)
                for g, lr in zip(eng.optimizer.param_groups, saved):
                    g["lr"] = lr
        got = eng.full_state_dict()
    assert _diff(got, expected[-1]) <= 1e-6


def test_set_lr_sets_every_group_and_lr_zero_is_valid():
    torch.manual_seed(0)
    model = TinyLM()
    with _engine(model, 2, "none", None) as eng:
        assert [g["lr"] for g in eng.optimizer.param_groups] == [LR, 2 * LR]
        eng.set_lr(0)
        assert [g["lr"] for g in eng.optimizer.param_groups] == [0.0, 0.0] and eng.lr == 0.0
        for bad in (-1e-3, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=rf"^lr={bad!r} is not valid"):
                eng.set_lr(bad)
    with OffloadEngine(TinyLM(), lr=0.0) as eng:
        assert eng.lr == 0.0 and len(eng.optimizer.param_groups) == 1


def test_a_bad_group_value_is_refused_by_name_before_the_update():
    torch.manual_seed(0)
    x, y = batches(1)[0]
    with _engine(TinyLM(), 3, "cpu", None) as eng:
        before = eng.full_state_dict()
        eng.backward(lm_loss(eng(x), y))
        for key, value, shown in (("lr", float("nan"), r"\['lr'\]=nan"),
                                  ("lr", -0.5, r"\['lr'\]=-0.5"),
                                  ("weight_decay", -1.0, r"\['weight_decay'\]=-1.0"),
                                  ("betas", (0.9, 1.0), r"\['betas'\]\[1\]=1.0")):
            good = eng.optimizer.param_groups[1][key]
            eng.optimizer.param_groups[1][key] = value
            with pytest.raises(ValueError, match=r"^param_groups\[1\]" + shown):
                eng.step()
            eng.optimizer.param_groups[1][key] = good
        assert _diff(eng.full_state_dict(), before) == 0
        eng.step()


def test_bad_param_groups_are_refused_by_name():
    model = TinyLM()
    named = dict(model.named_parameters())
    cases = [
        ([{"params": [named["head.weight"]]}, {"params": [named["head.weight"]]}],
         r"parameter 'head.weight' is in param_groups\[0\] and param_groups\[1\]"),
        ([{"params": [torch.nn.Parameter(torch.zeros(3, 5))]}],
         r"param_groups\[0\]\['params'\]\[0\] \(a tensor of shape \(3, 5\)\) is not a "
         r"parameter of the model"),
        ([{"params": [named["emb.weight"]], "lr": -0.1}],
         r"^param_groups\[0\]\['lr'\]=-0.1 is not valid"),
        ([{"params": [named["emb.weight"]], "lr": float("nan")}],
         r"^param_groups\[0\]\['lr'\]=nan is not valid"),
        ([{"lr": 0.1}], r"param_groups\[0\] must be a dict with 'params'"),
        ({"params": list(named.values())}, r"param_groups must be a list of dicts"),
    ]
    for groups, match in cases:
        with pytest.raises(ValueError, match=match):
            OffloadEngine(model, param_groups=groups)
    assert all(p.numel() for p in model.parameters())  # (nothing was wrapped)


def test_tied_parameter_is_one_parameter_and_the_rest_get_a_default_group():
    """A tied weight listed under both names (or twice) counts once; parameters in no group
    get a last group with the constructor's values."""
    model = TinyLM(tie=True)
    named = dict(model.named_parameters(remove_duplicate=False))
    groups = [{"params": [named["emb.weight"], named["head.weight"]], "lr": 0.5}]
    distinct = len(list(model.parameters()))
    with OffloadEngine(model, lr=LR, weight_decay=0.01, param_groups=groups) as eng:
        first, rest = eng.optimizer.param_groups
        assert len(first["params"]) == 1 and first["lr"] == 0.5
        assert rest["lr"] == LR and rest["weight_decay"] == 0.01
        assert len(rest["params"]) == distinct - 1
        # the groups hold the model's own parameter objects, which stay registered on it
        own = {id(p) for p in model.parameters()}
        assert all(id(p) in own for g in (first, rest) for p in g["params"])
        assert first["params"][0] is model.emb.weight is model.head.weight
        with pytest.raises(NotImplementedError, match="pass param_groups"):
            eng.optimizer.add_param_group({"params": []})


def test_optimizer_state_dict_round_trip():
    torch.manual_seed(0)
    with _engine(TinyLM(), 3, "cpu", None) as eng:
        sched = _one_cycle(eng.optimizer)
        sd = copy.deepcopy(eng.optimizer.state_dict())
        assert sd["state"] == {} and len(sd["param_groups"]) == 2
        for g in eng.optimizer.param_groups:
            g["lr"], g["betas"], g["weight_decay"] = 0.123, (0.5, 0.6), 0.7
        eng.optimizer.load_state_dict(sd)
        keys = ("lr", "betas", "eps", "weight_decay", "initial_lr", "max_lr")
        assert [{k: g[k] for k in keys} for g in eng.optimizer.param_groups] == \
            [{k: g[k] for k in keys} for g in sd["param_groups"]]
        bad = copy.deepcopy(sd)
        bad["param_groups"][1]["lr"] = -1.0
        with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\]=-1.0"):
            eng.optimizer.load_state_dict(bad)
        assert eng.optimizer.param_groups[1]["lr"] == sd["param_groups"][1]["lr"]
        del sched


def test_optimizer_state_dict_cannot_restart_adam_silently(tmp_path, torch_single_thread):
    """torch's resume habit (model.state_dict() + optimizer.state_dict() into a new engine)
    would restart the moments, which the dict does not hold: loading it into an engine at
    another Adam step count raises, pointing to save_checkpoint; after load_checkpoint (same
    count) it loads. A torch optimizer's dict (with per-parameter moments) is refused too."""
    torch.manual_seed(0)
    model = TinyLM()
    fresh = copy.deepcopy(model)
    with _engine(model, 3, "cpu", None) as eng:
        _train_steps(eng, _one_cycle(eng.optimizer), batches(2))
        sd = copy.deepcopy(eng.optimizer.state_dict())
        eng.save_checkpoint(str(tmp_path / "ckpt"))
    assert sd["state"] == {} and sd["offload_zero_adam_steps"] == 2
    with _engine(fresh, 3, "cpu", None) as new:
        def values():
            return [{k: v for k, v in g.items() if k != "params"}
                    for g in new.optimizer.param_groups]
        groups = values()
        with pytest.raises(ValueError, match=r"saved after 2 Adam step\(s\).*at 0.*"
                                             r"engine\.load_checkpoint"):
            new.optimizer.load_state_dict(sd)
        assert values() == groups
        ref = torch.nn.Linear(2, 2)
        opt = torch.optim.AdamW(ref.parameters())
        ref(torch.ones(1, 2)).sum().backward()
        opt.step()
        with pytest.raises(ValueError, match=r"holds state for 2 parameter\(s\)"):
            new.optimizer.load_state_dict(opt.state_dict())
        new.load_checkpoint(str(tmp_path / "ckpt"))
        new.optimizer.load_state_dict(sd)
        assert new.optimizer.state_dict()["offload_zero_adam_steps"] == 2


def _train_steps(eng, sched, data):
    for x, y in data:
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        sched.step()


def test_checkpoint_restores_the_groups_and_a_scheduler_saved_beside_it(tmp_path,
                                                                       torch_single_thread):
    """Save after 3 of 8 steps with the scheduler's state_dict beside the checkpoint; a new
    engine built with other values loads both and ends where the run without a break does."""
    torch.manual_seed(0)
    model = TinyLM()
    twin = copy.deepcopy(model)
    data = batches(STEPS, seed=5)
    expected = _reference(model, data)[-1]
    with _engine(model, 3, "cpu", None) as a:
        sched = _cosine(a.optimizer)
        _train_steps(a, sched, data[:3])
        a.save_checkpoint(tmp_path / "ckpt")
        torch.save(sched.state_dict(), tmp_path / "ckpt-scheduler.pt")
        saved = [{k: v for k, v in g.items() if k != "params"} for g in a.optimizer.param_groups]
    with _engine(twin, 3, "nvme", tmp_path, lr=0.5, betas=(0.5, 0.5)) as b:
        sched = _cosine(b.optimizer)  # (as torch: the scheduler first, then the states)
        b.load_checkpoint(tmp_path / "ckpt")
        assert [{k: v for k, v in g.items() if k != "params"}
                for g in b.optimizer.param_groups] == saved
        sched.load_state_dict(torch.load(tmp_path / "ckpt-scheduler.pt"))
        _train_steps(b, sched, data[3:])
        assert _diff(b.full_state_dict(), expected) <= 1e-6


def test_checkpoint_into_other_groups_is_refused_naming_the_parameter(tmp_path):
    torch.manual_seed(0)
    with _engine(TinyLM(), 3, "cpu", None) as a:
        a.save_checkpoint(tmp_path / "ckpt")
    model = TinyLM()
    named = list(model.named_parameters())
    moved = [{"params": [p for n, p in named if not _no_decay(n) and n != "blocks.2.up.weight"]},
             {"params": [p for n, p in named if _no_decay(n) or n == "blocks.2.up.weight"]}]
    with OffloadEngine(model, param_groups=moved) as b:
        with pytest.raises(ValueError, match=r"parameter 'blocks.2.up.weight' is in "
                                             r"param_groups\[0\] in the checkpoint but in "
                                             r"param_groups\[1\] in this engine"):
            b.load_checkpoint(tmp_path / "ckpt")
    with OffloadEngine(TinyLM()) as c:
        with pytest.raises(ValueError, match=r"the number of param_groups is 2 in the "
                                             r"checkpoint but 1"):
            c.load_checkpoint(tmp_path / "ckpt")


class _PositionalLM(TinyLM):
    """Input embeddings of 4 x VOCAB rows and learned positions (no weight decay) before three
    blocks: the root's part used before the blocks holds both groups and outgrows a block."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.emb = torch.nn.Embedding(4 * VOCAB, WIDTH)
        self.pos = torch.nn.Embedding(9, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x) + self.pos.weight[:x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


@pytest.mark.parametrize("mode", [{"update_timing": "step"}, {"update_timing": "next_forward"},
                                  {"update_timing": "backward"}], ids=lambda m: next(iter(m)))
def test_groups_in_chunks_streamed_from_nvme_match_torch(mode, tmp_path, monkeypatch,
                                                         torch_single_thread):
    """With 1024-element pipeline chunks the states too large to be read whole (each block's
    in the plain step, the embeddings' in the others) stream in chunks that cut across runs of
    both groups: each run of a chunk is updated with its group's values."""
    from offload_zero.memory.tiers import NVMeStore
    from offload_zero.update.adam import ShardAdam
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    seen = []
    update = ShardAdam.update

    def spy(self, fp, lo, hi, *args, **kwargs):
        seen.append(sum(1 for a, b, _ in self.segments[fp] if a < hi and b > lo) > 1 and lo > 0)
        return update(self, fp, lo, hi, *args, **kwargs)
    monkeypatch.setattr(ShardAdam, "update", spy)
    torch.manual_seed(0)
    model = _PositionalLM()
    data = batches(4, seed=8)
    expected = _reference(model, data)
    with _engine(model, 3, "nvme", tmp_path, tail_state_in_host=False, **mode) as eng:
        got, _ = _train(eng, data)
    assert any(seen)
    assert max(_diff(g, e) for g, e in zip(got, expected)) <= 1e-6


def test_two_groups_of_equal_values_give_one_groups_numbers_bit_for_bit(tmp_path):
    """bf16 compute, stage 3, optimizer state and parameters on NVMe: cutting the shards into
    runs changes no bit (the kernel's bf16 copy of each run included)."""
    weights = []
    for groups in (None, _groups):
        torch.manual_seed(0)
        model = TinyLM()
        given = None if groups is None else groups(model)
        if given is not None:
            given[1]["lr"], given[1]["weight_decay"] = LR, 0.1
        folder = tmp_path / str(len(weights))
        folder.mkdir()
        with OffloadEngine(model, stage=3, offload="nvme", path=folder, lr=LR,
                           weight_decay=0.1, dtype=torch.bfloat16, param_groups=given) as eng:
            for x, y in batches(3, seed=9):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            weights.append(eng.full_state_dict())
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
