"""host_cache_bytes: with the optimizer state on NVMe, the state of as many flat parameters as
the budget allows stays in host memory (see [Note: host cache]): the same weights bit for bit
as the all-NVMe run, and the NVMe bytes per step are the state bytes of the rest."""
import copy

import pytest
import torch
import torch.nn as nn

from offload_zero import OffloadEngine
from offload_zero.estimator import KINDS, TIERS, estimate_memory, placement_bytes
from offload_zero.memory.host_cache import cache_order, plan_host_cache
from models import WIDTH, Block, TinyLM, batches, last_step_nvme_bytes, lm_loss

STEPS = 5
FRACTIONS = (0.0, 0.37, 1.0)


class CacheLM(TinyLM):
    """TinyLM with five blocks of five sizes (9216..17408 fp32 shard elements) and an untied
    LM head: the root's three parts (final norm, LM head, embeddings) are smaller than any
    block, so a budget of ~37% of the state takes the root and two blocks."""

    def __init__(self):
        super().__init__(n_blocks=5)
        self.blocks = nn.ModuleList(Block(WIDTH, hidden=173 + 40 * i) for i in range(5))


def _state_bytes(eng, fps):
    return 12 * sum(fp.shard_numel for fp in fps)


# -- the rule -----------------------------------------------------------------------------------
def test_cache_order_takes_the_root_then_both_ends_of_the_blocks():
    # construction order: blocks 0..4 (block 2 with a frozen part), then the root's parts
    # [final norm, LM head, embeddings]
    flat = [(0, True, 10), (1, True, 10), (2, True, 10), (2, False, 10), (3, True, 10),
            (4, True, 10), (None, True, 1), (None, True, 5), (None, True, 5)]
    assert cache_order(flat) == [8, 7, 6, 0, 5, 1, 4, 2]
    assert cache_order(flat, blocks_reversed=True) == [8, 7, 6, 5, 0, 4, 1, 2]
    assert plan_host_cache(flat, 0, 12) == set()
    # 12 bytes per element: the root (11 elements, 132 bytes) and the first block
    assert plan_host_cache(flat, 12 * 21, 12) == {8, 7, 6, 0}
    # a part that does not fit is passed over, a smaller later one is taken
    assert plan_host_cache(flat, 12 * 6, 12) == {8, 6}
    # the tail is kept whatever the budget, and counts against it
    assert plan_host_cache(flat, 0, 12, tail=8) == {8}
    assert plan_host_cache(flat, 12 * 16, 12, tail=8) == {8, 7, 6}
    assert plan_host_cache(flat, 10 ** 9, 8) == {i for i, (_, t, _) in enumerate(flat) if t}


# -- the engine: same weights, fewer bytes -----------------------------------------------------
def _run(model, tmp_path, name, budget, measure_each_step, **kw):
    """Five steps of ``model`` on NVMe with ``host_cache_bytes=budget``; returns
    ``(full_state_dict, names kept in host memory, state bytes per step on NVMe, report)``
    after checking the NVMe bytes each step moved (every step when ``measure_each_step``,
    else over the run, the last updates applied)."""
    folder = tmp_path / name
    folder.mkdir()
    with OffloadEngine(model, offload="nvme", path=str(folder), lr=1e-2, weight_decay=0.1,
                       host_cache_bytes=budget, tail_state_in_host=False, **kw) as eng:
        in_host = [fp for fp in eng.trainable if eng.store.in_host(fp)]
        on_nvme = [fp for fp in eng.trainable if fp not in in_host]
        per_step = _state_bytes(eng, on_nvme)  # the plan's formula: read and written each step
        rep = eng.memory_report()
        params_on_nvme = eng.config.offload_param == "nvme"
        # with the shards on NVMe, a cached state's shard stays in host memory: beside it, or
        # in fp32 as the master itself; the others' are read from NVMe
        beside = [fp for fp in in_host if fp.itemsize != 4] if params_on_nvme else []
        read = on_nvme if params_on_nvme else []
        assert rep["host_cache"] == {
            "host_flat_params": len(in_host), "nvme_flat_params": len(on_nvme),
            "host_state_bytes": rep["host"]["by_kind"]["master_weights"]["current_bytes"]
            + rep["host"]["by_kind"]["moments"]["current_bytes"],
            "nvme_state_bytes": per_step, "host_param_flat_params": len(beside),
            "host_param_bytes": sum(fp.itemsize * fp.shard_numel for fp in beside),
            "nvme_param_flat_params": len(read),
            "nvme_param_bytes": sum(fp.itemsize * fp.shard_numel for fp in read),
            "host_frozen_flat_params": 0, "host_frozen_bytes": 0}
        start = _moved(rep, params_on_nvme)
        for i, (x, y) in enumerate(batches(STEPS)):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            if measure_each_step:
                now = _moved(eng.memory_report(), params_on_nvme)
                assert [b - a for a, b in zip(start, now)] == [per_step, per_step], (name, i)
                start = now
        eng.apply_pending_updates()
        eng.store.drain()
        if not measure_each_step:
            now = _moved(eng.memory_report(), params_on_nvme)
            assert [b - a for a, b in zip(start, now)] == [STEPS * per_step] * 2, name
        report = eng.memory_report()
        return eng.full_state_dict(), {fp.name for fp in in_host}, per_step, report


def _moved(rep, params_on_nvme):
    """(read, written) bytes of optimizer state: the swapper's whole count when nothing else
    is on NVMe, else the store's own."""
    nvme = rep["nvme"]
    if params_on_nvme:
        return nvme["state_read_bytes"], nvme["state_written_bytes"]
    assert (nvme["read_bytes"], nvme["written_bytes"]) == (nvme["state_read_bytes"],
                                                           nvme["state_written_bytes"])
    return nvme["read_bytes"], nvme["written_bytes"]


@pytest.mark.parametrize("stage,mode,dtype,offload_param", [
    (3, "plain", torch.float32, "nvme"), (3, "backward", torch.float32, "nvme"),
    (3, "next_forward", torch.float32, "nvme"), (3, "next_forward", torch.bfloat16, "nvme"),
    (3, "backward", torch.bfloat16, "none"), (3, "next_forward", torch.float32, "none"),
    (2, "plain", torch.float32, None), (2, "backward", torch.bfloat16, None)])
def test_host_cache_gives_the_all_nvme_weights_and_moves_only_the_rest(stage, mode, dtype,
                                                                       offload_param, tmp_path):
    """Host caches of 0%, ~37% and 100% of the state: after five steps the weights equal the
    all-NVMe plain step's bit for bit, in every step mode, and the NVMe bytes of optimizer state
    read and written per step are the state bytes of the flat parameters left on NVMe (12 per
    shard element, each way)."""
    torch.manual_seed(0)
    model = CacheLM()
    kw = {"stage": stage, "dtype": dtype}
    if offload_param is not None:
        kw["offload_param"] = offload_param
    modes = {"plain": {"update_timing": "step"} if stage == 3 else {},
             "backward": {"update_timing": "backward"}, "next_forward": {}}
    ref, _, total, _ = _run(copy.deepcopy(model), tmp_path, "ref", 0, True, **kw,
                            **modes["plain"])
    for frac in FRACTIONS:
        budget = int(frac * total)
        got, in_host, per_step, rep = _run(copy.deepcopy(model), tmp_path, f"cache{frac}", budget,
                                           mode != "next_forward", **kw, **modes[mode])
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), (frac, name)
        assert rep["host_cache"]["host_state_bytes"] <= budget
        if frac == 0.0:
            assert not in_host and per_step == total
        elif frac == 1.0:
            assert per_step == 0 and rep["host_cache"]["nvme_flat_params"] == 0
        else:
            # the root's three parts and the blocks at both ends of the update order
            assert {n for n in in_host if n.startswith("root.")} == {
                "root.trainable", "root.trainable.1", "root.trainable.2"}
            # (the middle block comes last in that order)
            blocks = {n for n in in_host if not n.startswith("root.")}
            assert blocks and "unit2.trainable" not in blocks
            assert 0 < per_step < total


def test_checkpoint_moves_between_cached_and_all_nvme(tmp_path):
    """A checkpoint saved with part of the state in host memory loads into an engine with all
    of it on NVMe (and back), and training goes on with the same weights bit for bit."""
    torch.manual_seed(0)
    model = CacheLM()
    runs = {}
    for name, save_budget, load_budget in (("a", 300_000, 0), ("b", 0, 10 ** 7)):
        for part in ("save", "load"):
            (tmp_path / name / part).mkdir(parents=True)
        xs = batches(4)
        with OffloadEngine(copy.deepcopy(model), offload="nvme", stage=3,
                           path=str(tmp_path / name / "save"), host_cache_bytes=save_budget) as a:
            for x, y in xs[:2]:
                a.backward(lm_loss(a(x), y))
                a.step()
            a.save_checkpoint(str(tmp_path / name / "ckpt"))
        with OffloadEngine(copy.deepcopy(model), offload="nvme", stage=3,
                           path=str(tmp_path / name / "load"), host_cache_bytes=load_budget) as b:
            b.load_checkpoint(str(tmp_path / name / "ckpt"))
            for x, y in xs[2:]:
                b.backward(lm_loss(b(x), y))
                b.step()
            runs[name] = b.full_state_dict()
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])


# -- the estimate -------------------------------------------------------------------------------
@pytest.mark.parametrize("stage,mode,dtype,offload_param", [
    (3, "plain", torch.float32, "nvme"), (3, "next_forward", torch.float32, "nvme"),
    (3, "backward", torch.bfloat16, "nvme"), (3, "next_forward", torch.float32, "none"),
    (2, "backward", torch.float32, "none"), (3, "plain", torch.bfloat16, "none")])
def test_estimate_counts_the_host_cache(stage, mode, dtype, offload_param, tmp_path):
    """With a host cache of ~37% of the state the estimate's bytes per tier and kind equal
    memory_report's peaks (the cached state in host memory, its files and read-ahead gone)."""
    torch.manual_seed(0)
    model = CacheLM()
    total = 12 * sum(fp.shard_numel for fp in _layout_shards(model, dtype))
    budget = int(0.37 * total)
    kw = {"update_timing": "step"} if mode == "plain" and stage == 3 else (
        {"update_timing": "backward"} if mode == "backward" else {})
    est = placement_bytes(model, stage, "nvme", offload_param, dtype=dtype, accelerator=False,
                          host_cache_bytes=budget, **kw)
    if offload_param == "nvme" and stage == 3 and mode != "backward":
        # (estimate_memory's row of the same placement: its own offload_param and step mode)
        row = estimate_memory(model, stage=3, offload="nvme", dtype=dtype, accelerator=False,
                              host_cache_bytes=budget,
                              update_timing="step" if mode == "plain" else "next_forward")
        assert all(row.by_kind(t) == est.by_kind(t) for t in TIERS)
    with OffloadEngine(model, stage=stage, offload="nvme", path=str(tmp_path), dtype=dtype,
                       offload_param=offload_param, host_cache_bytes=budget, **kw) as eng:
        assert eng.memory_report()["host_cache"]["host_flat_params"] >= 3
        for x, y in batches(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        eng(batches(1)[0][0])  # (update_timing="next_forward": the last step's updates run here)
        rep = eng.memory_report()
    for tier in TIERS:
        measured = {k: rep[tier]["by_kind"][k]["peak_bytes"] for k in KINDS}
        assert measured == est.by_kind(tier), tier


class _Shard:
    def __init__(self, n):
        self.shard_numel = n


def _layout_shards(model, dtype):
    from offload_zero.estimator import _shard_numel, model_layout
    k = torch.empty(0, dtype=dtype).element_size()
    return [_Shard(_shard_numel(s.numel, 1, k, True)) for s in model_layout(model) if s.trainable]


# -- input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, 1.5, "1GB", True, None])
def test_bad_host_cache_bytes_raise_value_error(value, tmp_path):
    with pytest.raises(ValueError, match=r"host_cache_bytes=.* is not valid; it must be an int"):
        OffloadEngine(TinyLM(n_blocks=2), offload="nvme", path=str(tmp_path),
                      host_cache_bytes=value)
    with pytest.raises(ValueError, match=r"host_cache_bytes=-1 is not valid"):
        estimate_memory(1000, host_cache_bytes=-1)


def test_host_cache_without_nvme_state_warns():
    with pytest.warns(UserWarning, match="host_cache_bytes=4096 is not used"):
        OffloadEngine(TinyLM(n_blocks=2), offload="cpu", host_cache_bytes=4096).close()


def test_auto_sizes_the_cache_from_the_host_memory_left(tmp_path):
    """offload="auto" with host_cache_bytes="auto": the placement chosen puts the optimizer
    state on NVMe, and its cache is half the host budget it leaves; the engine runs with it."""
    from offload_zero.placement import choose_placement
    torch.manual_seed(0)
    model = CacheLM()
    plain = placement_bytes(model, 3, "nvme", "nvme", dtype=torch.float32, accelerator=False)
    budgets = {"max_device_bytes": plain.tier_bytes("device"),
               "max_host_bytes": plain.tier_bytes("host") + 400_000}
    choice = choose_placement(model, 3, 1, torch.float32, 1, (), torch.device("cpu"),
                              str(tmp_path), host_cache_bytes="auto", **budgets)
    assert choice.offload_optimizer == "nvme"
    without = placement_bytes(model, 3, "nvme", choice.offload_param, dtype=torch.float32,
                              accelerator=False)
    assert choice.host_cache_bytes == (budgets["max_host_bytes"] - without.tier_bytes("host")) // 2
    assert choice.need["host"] <= budgets["max_host_bytes"]
    with OffloadEngine(model, offload="auto", path=str(tmp_path), host_cache_bytes="auto",
                       **budgets) as eng:
        assert eng.config.host_cache_bytes == choice.host_cache_bytes > 0
        assert eng.memory_report()["host_cache"]["host_flat_params"] >= 3
    with pytest.raises(ValueError, match="host_cache_bytes='auto' needs offload='auto'"):
        OffloadEngine(TinyLM(n_blocks=2), offload="nvme", path=str(tmp_path),
                      host_cache_bytes="auto")


@pytest.mark.parametrize("timing", ["step", "backward", "next_forward"])
def test_host_cache_keeps_frozen_shards_with_what_the_states_leave(timing, tmp_path):
    """PEFT-like: the blocks' Linear layers and the embeddings frozen, their norms and the LM
    head trained, bf16 parameter shards on NVMe. A budget of the trainable state keeps every
    state and its shard in host memory, and no frozen shard; 1.5 of the blocks' frozen
    shards and the embeddings' more keep the first block's frozen shard (the next one does
    not fit; the embeddings' fit after it): no file of those, two reads a step of the block's
    and one of the embeddings' fewer, nothing else changed; a budget of all of it moves
    nothing. The NVMe bytes per step are the estimate's plan's, and the weights bit for bit
    those of the uncached run. The parameter-shard read-ahead pools hold buffers only for
    the shards still read from files, trainable and frozen apart, each sized to its own
    shards: no trainable pool once their shards stay in host memory, none at all once every
    shard does."""
    from offload_zero.step_time import nvme_traffic
    torch.manual_seed(0)
    model = CacheLM()
    for p in [model.emb.weight, *(p for b in model.blocks for p in (*b.up.parameters(),
                                                                     *b.down.parameters()))]:
        p.requires_grad_(False)
    kw = dict(stage=3, offload="nvme", dtype=torch.bfloat16, update_timing=timing, lr=1e-2,
              weight_decay=0.1, tail_state_in_host=False)
    runs, budgets = [], [0]
    while len(runs) < 4:
        budget = budgets[-1]
        traffic = nvme_traffic(placement_bytes(model, 3, "nvme", "nvme", dtype=torch.bfloat16,
                                               accelerator=False, update_timing=timing,
                                               tail_state_in_host=False,
                                               host_cache_bytes=budget).plan)
        folder = tmp_path / str(len(runs))
        folder.mkdir()
        with OffloadEngine(copy.deepcopy(model), path=str(folder), host_cache_bytes=budget,
                           **kw) as eng:
            shard = {fp.name: fp.shard_numel for fp in eng.flat_params}
            state = 12 * sum(fp.shard_numel for fp in eng.trainable)
            rep = eng.memory_report()["host_cache"]
            moved = last_step_nvme_bytes(eng, batches(4))
            assert moved == [traffic.state_bytes + traffic.param_read_bytes,
                             traffic.state_bytes + traffic.param_written_bytes], budget
            files = {f.name for f in folder.rglob("*.swp")}
            eng.apply_pending_updates()
            pools = eng.memory_report()["pools"]
            runs.append((eng.full_state_dict(), rep, files, moved, pools))
            frozen = {name: n for name, n in shard.items() if "frozen" in name}
        budgets.append(state if len(runs) == 1 else state + 2 * (
            shard["unit0.frozen"] + shard["unit1.frozen"] // 2 + shard["root.frozen"])
            if len(runs) == 2 else state + 2 * sum(frozen.values()))
    ((ref, rep0, files0, _, pools0), (s1, rep1, files1, moved1, pools1),
     (s2, rep2, files2, moved2, pools2), (s3, rep3, files3, moved3, pools3)) = runs
    kept = {"unit0.frozen.param.swp", "root.frozen.param.swp"}
    assert rep0["host_frozen_flat_params"] == rep0["host_frozen_bytes"] == 0 and kept < files0
    # the states (and their shards) first: nothing of them on the disk, no frozen shard kept
    assert rep1["nvme_flat_params"] == rep1["host_frozen_flat_params"] == 0
    assert not any("trainable" in f for f in files1) and kept < files1
    assert moved1[1] == 0
    # then the frozen shards, the blocks' in forward order, each that fits
    assert rep2["host_frozen_flat_params"] == 2
    assert rep2["host_frozen_bytes"] == 2 * (shard["unit0.frozen"] + shard["root.frozen"])
    assert not kept & files2 and "unit1.frozen.param.swp" in files2
    assert moved1[0] - moved2[0] == 2 * (2 * shard["unit0.frozen"] + shard["root.frozen"])
    assert moved2[1] == 0
    # everything kept: no file, no byte moved, no read-ahead pool
    assert rep3["host_frozen_flat_params"] == len(frozen) and moved3 == [0, 0]
    assert not any(f.endswith(".param.swp") for f in files3)
    assert not {"param_shards", "param_shards_frozen"} & pools3.keys()
    # trainable and frozen shards each with a pool of their size (one a block; the frozen
    # never written: no ring); the states' shards kept: the frozen pool alone
    largest = {t: 2 * max(fp.shard_numel for fp in eng.flat_params
                          if fp.requires_grad == t and fp.name.startswith("unit"))
               for t in (True, False)}
    assert {n: (p["buffers"], p["buffer_bytes"]) for n, p in pools0.items()
            if n.startswith("param_shards")} == {"param_shards": (3 + 2, largest[True]),
                                                 "param_shards_frozen": (3, largest[False])}
    assert "param_shards" not in pools1 and pools1["param_shards_frozen"] == pools0[
        "param_shards_frozen"] and pools2["param_shards_frozen"]["buffers"] == 3
    for got in (s1, s2, s3):
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


# -- memory_report()["host_cache"] in every configuration -----------------------------------------
REPORT_KEYS = {"host_flat_params", "nvme_flat_params", "host_state_bytes", "nvme_state_bytes",
               "host_param_flat_params", "nvme_param_flat_params", "host_param_bytes",
               "nvme_param_bytes", "host_frozen_flat_params", "host_frozen_bytes"}
# host_cache_bytes, as a share of (all trainable states' bytes, all frozen shards' bytes)
BUDGETS = {"none": (0, 0), "states": (0.37, 0), "frozen": (1, 0.5), "all": (1, 1)}


def _report_cells():
    cells = []
    for stage in (1, 2, 3):
        for param in (("none", "cpu", "nvme") if stage == 3 else ("none",)):
            for opt in ("none", "cpu", "nvme"):
                for budget in (BUDGETS if opt == "nvme" else ("none",)):
                    cells += [(stage, opt, param, budget, dtype)
                              for dtype in (torch.float32, torch.bfloat16)]
    return cells


def _frozen_cache_lm():
    """CacheLM with each block's ``up`` and the embeddings frozen: a frozen and a trainable flat
    parameter in every unit."""
    torch.manual_seed(0)
    model = CacheLM()
    for p in [model.emb.weight, *(p for b in model.blocks for p in b.up.parameters())]:
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("stage,opt,param,budget,dtype", _report_cells())
def test_host_cache_report_has_every_key_and_the_bytes_kept(stage, opt, param, budget, dtype,
                                                            tmp_path):
    """Every stage x optimizer tier x parameter tier x host_cache_bytes (none, ~37% of the
    states, the states and half the frozen shards, everything) x dtype: memory_report() has a
    "host_cache" section with the same keys, equal to the plan's, whose bytes are the shards
    (K bytes per element) and states (4 bytes per element of fp32 master, unless it is the
    parameter shard itself, plus 8 of moments) of the flat parameters the plan keeps in host
    memory or on NVMe, and to the accountant's bytes of those kinds."""
    model = _frozen_cache_lm()
    k = torch.empty(0, dtype=dtype).element_size()
    from offload_zero.estimator import _shard_numel, model_layout
    layout = model_layout(model)
    shards = [_shard_numel(s.numel, 1, k, True) for s in layout]
    states, frozen = (sum(w * n for s, n in zip(layout, shards) if s.trainable == t)
                      for w, t in ((12, True), (k, False)))
    share_states, share_frozen = BUDGETS[budget]
    kw = ({"host_cache_bytes": int(share_states * states + share_frozen * frozen)}
          if opt == "nvme" else {})
    with OffloadEngine(model, stage=stage, offload=opt, offload_param=param, dtype=dtype,
                       path=str(tmp_path) if "nvme" in (opt, param) else None, **kw) as eng:
        rep, plan = eng.memory_report(), eng.memory_plan
        fps = eng.flat_params
        assert [(fp.numel, fp.requires_grad) for fp in fps] == [(s.numel, s.trainable)
                                                               for s in plan.layout]
        trainable = {i for i, fp in enumerate(fps) if fp.requires_grad}
        # the flat parameters whose state (shard) the plan keeps in host memory / on NVMe
        state_host = {"none": set(), "cpu": trainable, "nvme": set(plan.in_host)}[opt]
        state_nvme = trainable - state_host if opt == "nvme" else set()
        # a shard whose NVMe state the plan keeps in host memory stays there too: beside it,
        # or in fp32 as the master itself (in neither parameter count)
        kept = set(plan.in_host)
        beside = set() if dtype == torch.float32 else kept
        param_host = {"none": set(), "cpu": set(range(len(fps))),
                      "nvme": set(plan.params_in_host) | beside}[param]
        param_nvme = (set(range(len(fps))) - set(plan.params_in_host) - kept
                      if param == "nvme" else set())
        aliased = param == "none" and dtype == torch.float32  # (a CPU device)
        numel = lambda idx: sum(fps[i].shard_numel for i in idx)  # noqa: E731
        frozen_host = param_host - trainable
        expected = {
            "host_flat_params": len(state_host), "nvme_flat_params": len(state_nvme),
            "host_state_bytes": (8 if aliased else 12) * numel(state_host),
            "nvme_state_bytes": 12 * numel(state_nvme),
            "host_param_flat_params": len(param_host), "nvme_param_flat_params": len(param_nvme),
            "host_param_bytes": k * numel(param_host), "nvme_param_bytes": k * numel(param_nvme),
            "host_frozen_flat_params": len(frozen_host),
            "host_frozen_bytes": k * numel(frozen_host)}
        got = rep["host_cache"]
        assert got.keys() == REPORT_KEYS
        assert got == expected == plan.host_cache
        kinds = {t: {kind: rep[t]["by_kind"][kind]["current_bytes"] for kind in KINDS}
                 for t in TIERS}
        assert got["host_state_bytes"] == (kinds["host"]["master_weights"]
                                           + kinds["host"]["moments"])
        assert (got["host_param_bytes"], got["nvme_param_bytes"]) == (
            kinds["host"]["parameters"], kinds["nvme"]["parameters"])
        if opt == "nvme":  # the budgets' cells: none, part, all of the states, then the frozen
            # (the state tail_state_in_host keeps is kept whatever the budget; what part of
            # the states leaves may take frozen shards)
            states, shards = {"none": (0, 0), "states": (1, None), "frozen": (2, 1),
                              "all": (2, 2)}[budget]
            assert _share(len(state_host - {plan.tail}) if states == 0 else len(state_host),
                          len(trainable)) == states
            if param == "nvme" and shards is not None:
                assert _share(len(frozen_host), len(fps) - len(trainable)) == shards


def _share(part, whole):
    """0: none of ``whole``, 1: some, 2: all (an empty whole: 0)."""
    return 0 if part == 0 else (2 if part == whole else 1)
