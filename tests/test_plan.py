"""The memory plan against the engine: ``memory_report()["pools"]`` is the plan's pools, and the
peak bytes per tier and kind are the plan's, which the estimate (``placement_bytes``, what
``offload="auto"`` budgets) sums, over a grid of models (tied and untied heads, odd sizes, frozen
parts, an outsized root, gradients taken as autograd made them), stages 1-3, offload
none/cpu/nvme, fp32/bf16/fp16 and every update timing, at world size 1 and (a sub-grid) 2."""
import collections
import itertools
import tempfile

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks
from models import WIDTH, Block, TinyLM, UnpaddedHeadLM, big_root_lm, lm_loss
from offload_zero import OffloadEngine
from offload_zero.estimator import placement_bytes
from offload_zero.memory.state_format import StateFormat, moment_dtype_of
from offload_zero.placement import CANDIDATES
from offload_zero.plan import KINDS, FlatSpec, PlanSettings, memory_plan
from offload_zero.tables import OFFLOADS, TIERS, default_offload_param

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the engine's options of each update timing
TIMINGS = {t: {"update_timing": t} for t in ("step", "backward", "next_forward")}
POOL_KEYS = ("tier", "buffers", "buffer_bytes", "capacity_bytes")


def _untied_odd():
    """Untied head, blocks of odd widths (several 4096-byte pages each, none a multiple)."""
    model = TinyLM(n_blocks=3)
    model.blocks = nn.ModuleList(Block(WIDTH, hidden=173 + 40 * i) for i in range(3))
    return model


def _frozen_parts():
    """A frozen block and a frozen final norm: frozen flat parameters beside trainable ones."""
    model = TinyLM(n_blocks=3)
    model.blocks[1].requires_grad_(False)
    model.norm.requires_grad_(False)
    return model


def _tied_unpadded():
    """A tied LM head of one unpadded parameter (its gradient taken as autograd made it)."""
    model = UnpaddedHeadLM(vocab=512, width=16)
    model.head.weight = model.emb.weight
    return model


# name -> (model factory, vocabulary of its inputs)
MODELS = {"tied": (lambda: TinyLM(n_blocks=3, tie=True), 53), "untied_odd": (_untied_odd, 53),
          "frozen": (_frozen_parts, 53), "big_root": (lambda: big_root_lm(3, vocab_scale=6), 53),
          "tied_unpadded": (_tied_unpadded, 512)}
# models whose NVMe cells keep part of the optimizer state in host memory (host_cache_bytes)
CACHED = ("untied_odd", "frozen")

# the update timings of each stage (updates in backward need reduced gradient shards, stage 2;
# in the next forward, units gathered before each forward, stage 3)
TIMINGS_OF_STAGE = {1: ("step",), 2: ("step", "backward"), 3: ("step", "backward", "next_forward")}


def _grid(models, stages=(1, 2, 3), offloads=OFFLOADS, dtypes=DTYPES, timings=tuple(TIMINGS)):
    return [(m, s, o, d, t) for m, s, o, d, t in itertools.product(models, stages, offloads,
                                                                   dtypes, timings)
            if t in TIMINGS_OF_STAGE[s]]


def _mismatches(name, stage, offload, dtype, timing, world_size=1, moment_dtype="fp32") -> list:
    """Build and train the engine of one grid cell; the differences between what it holds and
    its plan, and between its plan and the estimate, as lines (empty: none)."""
    make, vocab = MODELS[name]
    torch.manual_seed(0)
    model = make()
    kw = dict(TIMINGS[timing], moment_dtype=moment_dtype)
    offload, _, param = offload.partition("+")  # ("opt+param": offload="auto"'s candidates)
    param = param or default_offload_param(offload, stage)
    if offload == "nvme" and name in CACHED:
        # about 37% of the optimizer state in host memory instead of its files
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        kw["host_cache_bytes"] = int(0.37 * StateFormat(moment_dtype_of(moment_dtype))
                                     .resident_bytes_per_element * numel)
    est = placement_bytes(model, stage, offload, param, world_size, dtype, accelerator=False, **kw)
    cell = (name, stage, offload, param, str(dtype), timing, world_size, moment_dtype)
    with tempfile.TemporaryDirectory() as path:
        with OffloadEngine(model, stage=stage, offload=offload, offload_param=param, dtype=dtype,
                           path=path if "nvme" in (offload, param) else None, **kw) as eng:
            g = torch.Generator().manual_seed(1)
            for _ in range(2):
                x = torch.randint(0, vocab, (2, 7), generator=g)
                eng.backward(lm_loss(eng(x).float(), x))
                eng.step()
            eng(x)  # (the next forward: updates deferred to it run here)
            rep, plan = eng.memory_report(), eng.memory_plan
    out = []
    pools = {n: {k: p[k] for k in POOL_KEYS} for n, p in rep["pools"].items()}
    if pools != plan.pools_report():
        out.append(f"{cell}: pools {pools} != plan {plan.pools_report()}")
    out += _idle_buffers(cell, rep["pools"], plan)
    if est.plan.pools_report() != plan.pools_report():
        out.append(f"{cell}: estimate's pools {est.plan.pools_report()} != engine's plan")
    for tier in TIERS:
        measured = {k: rep[tier]["by_kind"][k]["peak_bytes"] for k in KINDS}
        if measured != plan.by_kind(tier):
            out.append(f"{cell}: {tier} measured {measured} != plan {plan.by_kind(tier)}")
        if est.tier_bytes(tier) != sum(measured.values()):
            out.append(f"{cell}: {tier} estimate {est.tier_bytes(tier)} != measured "
                       f"{sum(measured.values())}")
    if stage == 3 and rep["live_units"]["peak"] > eng.config.prefetch + 2:
        out.append(f"{cell}: {rep['live_units']['peak']} units live, more than the plan's "
                   f"prefetch + 1 blocks and the root")
    if rep.get("host_cache") != plan.host_cache:
        out.append(f"{cell}: host cache {rep.get('host_cache')} != plan {plan.host_cache}")
    return out


def _idle_buffers(cell, pools, plan) -> list:
    """The plan's counts against what the run used (not against the plan, which the engine
    built them from): every buffer of a pool was in use at once at some point (the optimizer
    pipeline's sets are its fixed depth); the parameter-shard read-ahead keeps a margin of up
    to three buffers per flat parameter of a block (``f``: 1, or 2 with trainable and frozen
    parts), for the units that these short runs never have in flight at once (see [Note:
    pools] in :mod:`offload_zero.plan`)."""
    per_block = max(collections.Counter(f.unit for f in plan.layout if f.unit != -1).values(),
                    default=1)
    out = []
    for name, p in pools.items():
        if name == "optimizer_pipeline" or "peak_in_use" not in p:
            continue
        margin = 3 * per_block if name.startswith("param_shards") else 0
        if p["peak_in_use"] < p["buffers"] - margin or p.get("grown"):
            out.append(f"{cell}: pool {name} has {p['buffers']} buffers (grown "
                       f"{p.get('grown', 0)}) but at most {p['peak_in_use']} were in use")
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_engine_holds_exactly_its_plan_at_world_size_1(name, torch_single_thread):
    """Every stage x offload x dtype x update timing the engine takes, for each model."""
    cells = _grid([name])
    assert len(cells) == 3 * 3 * (1 + 2 + 3)
    bad = [line for cell in cells for line in _mismatches(*cell)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_low_precision_moments_hold_exactly_their_plan(moment_dtype, torch_single_thread):
    """bf16 and int8 moments (the int8 codes on their tier, their per-block scales in host
    memory): stages 2-3 x cpu/nvme (the host cache too) x every update timing, in fp32 and
    bf16 compute."""
    cells = _grid(["untied_odd"], stages=(2, 3), offloads=("cpu", "nvme"),
                  dtypes=(torch.float32, torch.bfloat16))
    bad = [line for cell in cells for line in _mismatches(*cell, moment_dtype=moment_dtype)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_placement_candidates_hold_exactly_their_plan(dtype, torch_single_thread):
    """offload="auto"'s candidates (optimizer and parameter tiers apart) at stage 3, every
    update timing, an outsized root: what placement_bytes budgets is what the engine holds."""
    cells = [("big_root", 3, f"{opt}+{param}", dtype, timing) for opt, param in CANDIDATES
             for timing in TIMINGS_OF_STAGE[3]]
    bad = [line for cell in cells for line in _mismatches(*cell)]
    assert not bad, "\n".join(bad)


def _rank_cells(rank, world_size, cells):
    return [line for cell in cells for line in _mismatches(*cell, world_size=world_size)]


def test_engine_holds_exactly_its_plan_at_world_size_2():
    """A representative sub-grid on two gloo ranks: the reduce-scatter scratch, sharded
    parameters at every stage, each rank's plan the same."""
    cells = (_grid(["tied"], dtypes=(torch.bfloat16,), timings=("step",))
             + [("big_root", 3, "nvme", torch.float32, "step"),
                ("big_root", 3, "cpu", torch.float16, "next_forward"),
                ("frozen", 3, "nvme", torch.bfloat16, "next_forward"),
                ("untied_odd", 2, "nvme", torch.float32, "backward"),
                ("tied_unpadded", 3, "none", torch.float32, "backward")])
    per_rank = run_ranks(_rank_cells, 2, cells, timeout_s=300)
    bad = [line for lines in per_rank for line in lines]
    assert not bad, "\n".join(bad)


def test_unpadded_plan_is_the_papers_arithmetic():
    """Without padding (a layout assumed from a parameter count) the plan's model states are
    ZeRO's 2Ψ + 2Ψ + 12Ψ, partitioned as each stage says (Rajbhandari et al., 2019, sec. 5)."""
    psi, n = 1_000_000, 4
    layout = [FlatSpec(psi // 2, 0, True), FlatSpec(psi // 2, -1, True)]
    want = {1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n, 3: 16 * psi // n}
    for stage, total in want.items():
        plan = memory_plan(layout, PlanSettings(stage, "none", "none", world_size=n,
                                                padded=False))
        assert sum(plan.states()["device"].values()) == total


@pytest.mark.parametrize("settings,needle", [
    (PlanSettings(4, "none", "none"), "stage=4"), (PlanSettings(3, "none", "none", world_size=0),
                                                   "world_size=0"),
    (PlanSettings(3, "none", "none", prefetch=-1), "prefetch=-1")])
def test_bad_settings_raise_value_error(settings, needle):
    with pytest.raises(ValueError, match=needle):
        memory_plan([FlatSpec(10, 0, True)], settings)
    with pytest.raises(ValueError, match="layout is empty"):
        memory_plan([], PlanSettings(3, "none", "none"))
