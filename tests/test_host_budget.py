"""max_host_bytes bounds the host tier of any placement (see host_budget.fit_host_budget): the
optimizer pipeline streams the state in smaller chunks, then an update_timing left at "auto"
falls back to the plain step and a prefetch left at its default to 0, with the same weights bit
for bit; the measured host peak stays within the budget; a budget nothing fits raises first,
naming what would fit."""
import copy
import dataclasses

import pytest
import torch

from offload_zero import OffloadEngine
from offload_zero.host_budget import fit_host_budget
from offload_zero.plan import memory_plan
from models import TinyLM, adamw_reference, batches, lm_loss

WIDE = dict(n_blocks=3)
SMALLEST_CHUNK = 1024  # fp32 moments' chunk_multiple


def _train(model, tmp_path, name, **kw):
    """``(full state dict, memory_report(), config, memory plan)`` after 3 steps."""
    folder = tmp_path / name
    folder.mkdir()
    with OffloadEngine(model, offload="nvme", path=str(folder), lr=1e-2, weight_decay=0.1,
                       tail_state_in_host=False, **kw) as eng:
        for x, y in batches(3):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        eng.apply_pending_updates()
        return eng.full_state_dict(), eng.memory_report(), eng.config, eng.memory_plan


def _host_bytes(plan, **settings) -> int:
    """The host tier of ``plan``'s layout with some of its settings changed."""
    return memory_plan(plan.layout, dataclasses.replace(plan.settings, **settings)).tier_bytes(
        "host")


def _check_shrunk(model, ref, got, budget):
    """``got`` (a budgeted run of :func:`_train`) fits ``budget`` and has ``ref``'s weights
    (the run without a budget) bit for bit, and torch AdamW's to 1e-6."""
    (ref_state, _, _, _), (state, rep, _, _) = ref, got
    torch_state = adamw_reference(model, batches(3))
    for name in ref_state:
        assert torch.equal(state[name], ref_state[name]), name
        assert (state[name] - torch_state[name]).abs().max().item() < 1e-6, name
    hb = rep["host_budget"]
    assert hb["peak_bytes"] == hb["planned_bytes"] == rep["host"]["peak_bytes"] <= budget


@pytest.mark.parametrize("timing", ["step", "next_forward"])
def test_a_tight_budget_shrinks_the_pipeline_and_keeps_the_numbers(timing, tmp_path):
    torch.manual_seed(0)
    model = TinyLM(**WIDE)
    ref, rep, _, _ = _train(copy.deepcopy(model), tmp_path, "ref", update_timing=timing)
    full_pipeline = rep["pools"]["optimizer_pipeline"]["capacity_bytes"]
    host_need = rep["host"]["peak_bytes"]
    budget = host_need - full_pipeline // 2  # room for less than the whole pipeline
    got, rep, cfg, _ = _train(copy.deepcopy(model), tmp_path, "tight", update_timing=timing,
                              max_host_bytes=budget)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    hb = rep["host_budget"]
    assert hb["max_host_bytes"] == budget
    assert hb["planned_bytes"] <= budget and hb["peak_bytes"] <= budget
    assert hb["peak_bytes"] == hb["planned_bytes"] == rep["host"]["peak_bytes"]
    assert rep["pools"]["optimizer_pipeline"]["capacity_bytes"] < full_pipeline
    assert hb["pipeline_chunk_numel"] % 1024 == 0
    # only the chunk changed: an explicit timing stays
    assert hb["shrunk"] == [f"pipeline_chunk_numel {1 << 22}->{hb['pipeline_chunk_numel']}"]
    assert cfg.update_timing == timing and cfg.prefetch == 1


def test_an_automatic_timing_falls_back_to_the_plain_step(tmp_path):
    """update_timing left at "auto" (next_forward here): a budget that even the smallest
    chunks with next_forward's read-ahead ring do not fit runs the plain step, its pipeline
    chunk the one given again; the config says so."""
    torch.manual_seed(0)
    model = TinyLM(**WIDE)
    kw = dict(offload_param="none")  # (no parameter-shard buffers to lower)
    ref = _train(copy.deepcopy(model), tmp_path, "ref", **kw)
    plan = ref[3]
    assert plan.settings.update_timing == "next_forward" and plan.pool("optimizer_prefetch")
    budget = _host_bytes(plan, pipeline_chunk_numel=SMALLEST_CHUNK) - 1
    assert _host_bytes(plan, update_timing="step") <= budget
    got = _train(copy.deepcopy(model), tmp_path, "tight", max_host_bytes=budget, **kw)
    _check_shrunk(model, ref, got, budget)
    _, rep, cfg, _ = got
    assert rep["host_budget"]["shrunk"] == ["update_timing next_forward->step"]
    assert cfg.update_timing == "step"
    assert "optimizer_prefetch" not in rep["pools"]
    assert rep["pools"]["optimizer_pipeline"] == ref[1]["pools"]["optimizer_pipeline"]


@pytest.mark.parametrize("timing", ["step", "next_forward"])
def test_a_default_prefetch_drops_to_zero(timing, tmp_path):
    """Parameter shards on NVMe, prefetch left at its default (1): a budget the smallest
    chunks do not fit reads no unit ahead, with a parameter-shard buffer fewer (fp32 shards
    with their state on NVMe: prefetch + 2 for one flat parameter per block, no write-back
    ring)."""
    torch.manual_seed(0)
    model = TinyLM(**WIDE)
    ref = _train(copy.deepcopy(model), tmp_path, "ref", update_timing=timing)
    plan = ref[3]
    budget = _host_bytes(plan, pipeline_chunk_numel=SMALLEST_CHUNK) - 1
    got = _train(copy.deepcopy(model), tmp_path, "tight", update_timing=timing,
                 max_host_bytes=budget)
    _check_shrunk(model, ref, got, budget)
    _, rep, cfg, _ = got
    chunk = rep["host_budget"]["pipeline_chunk_numel"]
    assert rep["host_budget"]["shrunk"] == [f"pipeline_chunk_numel {1 << 22}->{chunk}",
                                            "prefetch 1->0"]
    assert cfg.prefetch == 0 and cfg.update_timing == timing
    assert ref[1]["pools"]["param_shards"]["buffers"] == 3
    assert rep["pools"]["param_shards"]["buffers"] == 2


@pytest.mark.parametrize("timing", ["next_forward", "backward"])
def test_an_explicit_timing_is_kept_and_the_error_names_the_one_that_fits(timing, tmp_path):
    model = TinyLM(**WIDE)
    with OffloadEngine(copy.deepcopy(model), offload="nvme", offload_param="none",
                       path=str(tmp_path), tail_state_in_host=False,
                       update_timing=timing) as eng:
        plan = eng.memory_plan
    budget = _host_bytes(plan, pipeline_chunk_numel=SMALLEST_CHUNK) - 1
    # the plain step within that budget (its chunk shrunk where it must be)
    step = fit_host_budget(plan.layout, dataclasses.replace(
        plan.settings, update_timing="step", max_host_bytes=budget)).tier_bytes("host")
    with pytest.raises(ValueError, match=rf"max_host_bytes={budget} is short by 1 bytes.*"
                                         rf"update_timing='step' \(or 'auto'\) would fit: it "
                                         rf"needs {step} bytes, update_timing='{timing}'"):
        OffloadEngine(copy.deepcopy(model), offload="nvme", offload_param="none",
                      path=str(tmp_path), tail_state_in_host=False, update_timing=timing,
                      max_host_bytes=budget)


def test_explicit_prefetch_and_host_cache_are_never_lowered(tmp_path):
    """A prefetch given (even the default's value) stays; so does host_cache_bytes, which
    the error names."""
    model = TinyLM(**WIDE)
    with OffloadEngine(copy.deepcopy(model), offload="nvme", path=str(tmp_path),
                       update_timing="step") as eng:
        plan = eng.memory_plan
    budget = _host_bytes(plan, pipeline_chunk_numel=SMALLEST_CHUNK) - 1
    assert _host_bytes(plan, prefetch=0, pipeline_chunk_numel=SMALLEST_CHUNK) <= budget
    with pytest.raises(ValueError, match=rf"max_host_bytes={budget} is short by 1 bytes"):
        OffloadEngine(copy.deepcopy(model), offload="nvme", path=str(tmp_path),
                      update_timing="step", prefetch=1, max_host_bytes=budget)
    cache = 1 << 20
    with pytest.raises(ValueError, match=rf"lower host_cache_bytes={cache} \(never lowered"):
        OffloadEngine(copy.deepcopy(model), offload="nvme", path=str(tmp_path),
                      update_timing="step", host_cache_bytes=cache, max_host_bytes=budget)


def test_a_budget_that_holds_everything_changes_nothing(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(**WIDE)
    _, rep, _, _ = _train(copy.deepcopy(model), tmp_path, "ref")
    _, got, cfg, _ = _train(copy.deepcopy(model), tmp_path, "roomy", max_host_bytes=1 << 40)
    assert got["pools"] == rep["pools"] and "host_budget" not in rep
    assert got["host_budget"]["peak_bytes"] == rep["host"]["peak_bytes"]
    assert got["host_budget"]["shrunk"] == [] and cfg.update_timing == "next_forward"


def test_a_budget_nothing_fits_raises_before_allocating(tmp_path):
    with pytest.raises(ValueError, match=r"max_host_bytes=1000 is short by \d+ bytes: this "
                                         r"placement needs \d+ bytes of host memory.*"
                                         r"raise max_host_bytes"):
        OffloadEngine(TinyLM(**WIDE), offload="cpu", max_host_bytes=1000)
    with pytest.raises(ValueError, match=r"max_host_bytes=1000 is short"):
        OffloadEngine(TinyLM(**WIDE), offload="nvme", path=str(tmp_path), max_host_bytes=1000)
    assert list(tmp_path.iterdir()) == []  # no swap files, no rank folder


def test_auto_on_a_cpu_device_counts_the_device_tier_in_the_host_budget(tmp_path):
    """With the CPU as the device the device tier is host memory: offload="auto" with
    max_host_bytes checks device and host together against it (it chose offload="none", all
    state in the device tier, past a budget no placement fits), and takes a placement whose
    two tiers together fit."""
    from offload_zero.estimator import placement_bytes
    model = TinyLM(n_blocks=8)
    with pytest.raises(ValueError, match=r"offload='auto'.*short of device\+host"):
        OffloadEngine(model, offload="auto", path=str(tmp_path), max_host_bytes=1000)
    kw = dict(update_timing="step", tail_state_in_host=False)
    need = {o: placement_bytes(model, 3, o, o, dtype=torch.float32, accelerator=False,
                               **kw).plan for o in ("none", "nvme")}
    both = {o: p.tier_bytes("device") + p.tier_bytes("host") for o, p in need.items()}
    assert both["nvme"] < both["none"]
    with OffloadEngine(model, offload="auto", path=str(tmp_path), dtype=torch.float32,
                       max_host_bytes=both["nvme"], **kw) as eng:
        plan = eng.memory_plan
        assert eng.config.offload_optimizer != "none"
        assert plan.tier_bytes("device") + plan.tier_bytes("host") <= both["nvme"]


def test_auto_names_a_path_it_cannot_write_instead_of_a_small_disk():
    """offload="auto" with a path no file can be created in (it counted 0 bytes of NVMe and
    advised "a larger disk at path=") says the path cannot be written when nothing fits."""
    from train_cli_helpers import unwritable_folder
    folder = unwritable_folder()
    with pytest.raises(ValueError, match=rf"path='{folder}' cannot be written \(creating a "
                                         r"file there: .*\), so nothing could go to NVMe"):
        OffloadEngine(TinyLM(**WIDE), offload="auto", path=folder, max_host_bytes=1000)


def test_the_steps_run_in_order_each_only_where_it_is_needed():
    """The plan alone: a budget that needs all three steps lowers the chunk, the timing and
    prefetch, in that order; the chunk is the largest that then fits; without them left to the
    engine the same budget raises."""
    from offload_zero.estimator import model_layout
    from offload_zero.plan import PlanSettings
    layout = model_layout(TinyLM(**WIDE), (), ())
    given = PlanSettings(3, "nvme", "nvme", dtype=torch.float32, accelerator=False,
                         update_timing="next_forward", tail_state_in_host=False,
                         left_to_engine=frozenset({"update_timing", "prefetch"}))
    plan = memory_plan(layout, given)
    budget = _host_bytes(plan, update_timing="step", pipeline_chunk_numel=SMALLEST_CHUNK) - 1
    fitted = fit_host_budget(layout, dataclasses.replace(given, max_host_bytes=budget))
    assert fitted.shrunk == (f"pipeline_chunk_numel {1 << 22}->{SMALLEST_CHUNK}",
                             "update_timing next_forward->step", "prefetch 1->0")
    assert (fitted.settings.update_timing, fitted.settings.prefetch) == ("step", 0)
    assert fitted.tier_bytes("host") <= budget
    # a budget the plain step fits with whole chunks keeps them
    roomy = _host_bytes(plan, update_timing="step")
    fitted = fit_host_budget(layout, dataclasses.replace(given, max_host_bytes=roomy))
    assert fitted.shrunk == ("update_timing next_forward->step",)
    with pytest.raises(ValueError, match=r"update_timing='step' \(or 'auto'\) would fit"):
        fit_host_budget(layout, dataclasses.replace(given, max_host_bytes=roomy,
                                                    left_to_engine=frozenset()))


def test_auto_placement_takes_a_placement_that_fits_with_smaller_chunks(tmp_path):
    """offload="auto" with max_host_bytes counts each candidate as the build will hold it, its
    optimizer state streamed in the chunks the budget needs: a budget that only smaller chunks
    fit keeps the NVMe placement's own timing (counted at full-size chunks, it used to fall
    back to the plain step), and the engine runs it within the budget with the weights of
    offload="nvme"."""
    from offload_zero.estimator import placement_bytes
    torch.manual_seed(0)
    model = TinyLM(**WIDE)
    full = placement_bytes(model, 3, "nvme", "nvme", dtype=torch.float32, accelerator=False,
                           tail_state_in_host=False)
    budget = _host_bytes(full.plan, pipeline_chunk_numel=SMALLEST_CHUNK)
    assert budget < full.plan.tier_bytes("host")
    folder = tmp_path / "auto"
    folder.mkdir()
    with OffloadEngine(copy.deepcopy(model), offload="auto", path=str(folder), lr=1e-2,
                       weight_decay=0.1, tail_state_in_host=False, max_host_bytes=budget,
                       max_device_bytes=full.plan.tier_bytes("device")) as eng:
        assert (eng.config.offload_optimizer, eng.config.offload_param) == ("nvme", "nvme")
        assert eng.config.update_timing == "next_forward"
        for x, y in batches(3):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        eng.apply_pending_updates()
        rep, state = eng.memory_report(), eng.full_state_dict()
    hb = rep["host_budget"]
    assert hb["peak_bytes"] <= budget and hb["shrunk"][0].startswith("pipeline_chunk_numel")
    ref = _train(copy.deepcopy(model), tmp_path, "ref", update_timing=eng.config.update_timing)
    assert all(torch.equal(state[k], ref[0][k]) for k in ref[0])
