"""offload="auto" picks by estimated step time, not only by fit, and counts activations when
it knows the workload ([Note: step-time model] in offload_zero/step_time.py): with injected
disk rates, FLOP/s and budgets, the split, the update timing, the host cache and the moments'
format it picks follow the numbers."""
import copy
import os
import re
import types

import pytest
import torch

from models import TinyLM, batches, big_root_lm, last_step_nvme_bytes, lm_loss
from offload_zero import OffloadEngine, step_time
from offload_zero.activations import DecoderShape, activation_bytes
from offload_zero.estimator import model_layout, placement_bytes
from offload_zero.memory.swapper import SwapHandle
from offload_zero.placement import MOMENT_TOLERANCE, choose_placement
from offload_zero.step_time import (ComputeEstimate, DiskRates, Workload, compute_estimate,
                                    nvme_traffic)

SLOW = DiskRates(1e6, 1e6)     # 1 MB/s: any state on NVMe costs more than the compute
FAST = DiskRates(1e12, 1e12)   # 1 TB/s: the compute hides every byte
FLOPS = 1e9
WORK = Workload(batch_size=4, seq_len=16)
CPU = torch.device("cpu")
CONFIG = dict(hidden_size=24, num_hidden_layers=4, num_attention_heads=2, intermediate_size=37,
              vocab_size=53)


def _model(n_blocks=32, config=False):
    torch.manual_seed(0)
    model = TinyLM(n_blocks=n_blocks)
    if config:  # (a Llama-style decoder's sizes, so its activations can be counted)
        model.config = types.SimpleNamespace(**CONFIG)
    return model


def _need(model, opt, param, **kw):
    p = placement_bytes(model, 3, opt, param, dtype=torch.float32, accelerator=False, **kw)
    return {t: p.tier_bytes(t) for t in ("device", "host", "nvme")}


def _choose(model, path, device=CPU, **kw):
    return choose_placement(model, 3, 1, torch.float32, 1, (), device, str(path), **kw)


def _small_host(model):
    """Budgets where the parameter shards must leave the device and the fp32 optimizer state
    does not fit in host memory beside them: only NVMe placements fit (fp32 moments)."""
    return {"max_device_bytes": _need(model, "cpu", "none")["device"] - 1,
            "max_host_bytes": _need(model, "cpu", "cpu")["host"] - 1}


def _no_measuring(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measured although the numbers were given or not needed")
    monkeypatch.setattr(step_time, "measured_flops", refuse)
    monkeypatch.setattr(step_time, "disk_rates", refuse)


# -- the split -----------------------------------------------------------------------------------
def test_a_slow_disk_and_room_in_host_take_the_host_without_probing(tmp_path, monkeypatch):
    """Host memory for the whole state: the host placement moves no NVMe byte, so nothing can
    be faster; the disk is not even probed."""
    model = _model()
    _no_measuring(monkeypatch)
    choice = _choose(model, tmp_path, workload=WORK, flops=FLOPS,
                     max_device_bytes=_need(model, "cpu", "none")["device"] - 1,
                     max_host_bytes=10 ** 12)
    assert (choice.offload_optimizer, choice.offload_param) == ("cpu", "cpu")
    assert choice.step.exposed_s == 0 and choice.step.traffic.total_bytes == 0
    assert "moves no NVMe byte" in choice.reason


def test_a_fast_disk_and_a_small_host_take_nvme_with_the_cache_the_budget_allows(tmp_path):
    """Every NVMe placement's I/O hides behind the compute: equal times go to the cheaper, the
    state on NVMe with the shards in host memory, updates in the next forward, and the host
    cache is half the host memory it leaves."""
    model = _model()
    budgets = _small_host(model)
    choice = _choose(model, tmp_path, workload=WORK, disk=FAST, flops=FLOPS,
                     host_cache_bytes="auto", **budgets)
    assert (choice.offload_optimizer, choice.offload_param) == ("nvme", "cpu")
    assert choice.update_timing == "next_forward" and choice.step.exposed_s == 0
    without = _need(model, "nvme", "cpu", update_timing="next_forward")
    assert choice.host_cache_bytes == (budgets["max_host_bytes"] - without["host"]) // 2 > 0
    assert "the fastest of 4 that fit" in choice.reason and "given" in choice.reason
    assert sum("s a step" in line for line in choice.tried) == 4


def test_a_slow_disk_takes_the_placement_that_moves_the_fewest_bytes(tmp_path):
    """Where the disk dominates, the placement that leaves the largest cache and the fewest
    NVMe bytes wins (parameter shards on NVMe free host memory for the cache), not the first
    that fits (optimizer state alone on NVMe, updates in the next forward); with compute
    enough to hide the next forward's I/O, that one wins again."""
    model = _model()
    budgets = _small_host(model)
    choice = _choose(model, tmp_path, workload=WORK, disk=SLOW, flops=FLOPS,
                     host_cache_bytes="auto", **budgets)
    assert (choice.offload_optimizer, choice.offload_param, choice.update_timing) == (
        "nvme", "nvme", "next_forward")
    fitting = [line for line in choice.tried if "-> fits" in line]
    assert len(fitting) == 4 and fitting[0].startswith("nvme+cpu next_forward")
    seconds = [float(re.search(r"~([0-9.]+) s a step", line).group(1)) for line in fitting]
    assert seconds[1] == min(seconds) < seconds[0]  # (fit alone would take the first)
    first = _choose(model, tmp_path, **budgets, host_cache_bytes="auto")
    assert first.update_timing == "next_forward"  # (no workload: by fit)
    assert choice.step.traffic.total_bytes < first.need["nvme"] * 2
    slow_compute = FLOPS / 200  # the step's compute is now longer than any NVMe I/O
    hidden = _choose(model, tmp_path, workload=WORK, disk=SLOW, flops=slow_compute,
                     host_cache_bytes="auto", **budgets)
    assert hidden.step.compute_s > hidden.step.io_s
    assert (hidden.offload_optimizer, hidden.offload_param, hidden.update_timing) == (
        "nvme", "cpu", "next_forward")
    assert hidden.step.exposed_s == 0


def test_parameter_shards_go_to_nvme_where_the_cache_they_free_saves_more(tmp_path):
    """Parameter shards on NVMe free host memory for the cache: with compute that hides part
    of the I/O (updates in the next forward), the smaller state on NVMe costs less than the
    shards' reads add."""
    model = _model()
    budgets = _small_host(model)
    choice = _choose(model, tmp_path, workload=WORK, disk=SLOW, flops=FLOPS / 10,
                     host_cache_bytes="auto", **budgets)
    assert (choice.offload_optimizer, choice.offload_param, choice.update_timing) == (
        "nvme", "nvme", "next_forward"), choice.tried
    assert 0 < choice.step.exposed_s < choice.step.io_s
    assert choice.step.traffic.param_read_bytes > 0


# -- the moments' format ------------------------------------------------------------------------
def _host_fits_bf16_only(model):
    budgets = {"max_device_bytes": _need(model, "cpu", "none")["device"] - 1,
               "max_host_bytes": _need(model, "cpu", "cpu")["host"] - 1}
    assert _need(model, "cpu", "cpu", moment_dtype="bf16")["host"] <= budgets["max_host_bytes"]
    return budgets


def test_auto_moments_take_a_smaller_format_with_a_slow_disk_and_fp32_with_a_fast_one(tmp_path):
    model = _model()
    budgets = _host_fits_bf16_only(model)
    slow = _choose(model, tmp_path, workload=WORK, disk=SLOW, flops=FLOPS, moment_dtype="auto",
                   **budgets)
    # bf16 moments keep the state in host memory: no NVMe I/O; int8 would too, bf16 is closer
    assert (slow.offload_optimizer, slow.offload_param, slow.moment_dtype) == ("cpu", "cpu",
                                                                               "bf16")
    assert "bf16 moments, the most exact format within 5%" in slow.reason
    fast = _choose(model, tmp_path, workload=WORK, disk=FAST, flops=FLOPS, moment_dtype="auto",
                   **budgets)
    assert (fast.offload_optimizer, fast.moment_dtype) == ("nvme", "fp32")
    # without the workload: fp32 wherever fp32 fits, whatever the disk
    by_fit = _choose(model, tmp_path, disk=SLOW, moment_dtype="auto", **budgets)
    assert (by_fit.offload_optimizer, by_fit.moment_dtype) == ("nvme", "fp32")


@pytest.mark.parametrize("fraction, moments", [(0.5, "fp32"), (2.0, "bf16")])
def test_auto_moments_keep_fp32_within_the_tolerance(fraction, moments, tmp_path):
    """With the plain step fp32's state I/O is all exposed, bf16's (in host memory) none:
    fp32 is kept while its exposed I/O is within MOMENT_TOLERANCE of the compute."""
    model = _model()
    budgets = _host_fits_bf16_only(model)
    compute = compute_estimate(model_layout(model), WORK, FLOPS).seconds
    kw = dict(workload=WORK, flops=FLOPS, update_timing="step", **budgets)
    io_s = _choose(model, tmp_path, disk=SLOW, **kw).step.io_s  # (fp32's best)
    scale = io_s / (fraction * MOMENT_TOLERANCE * compute)  # (exposed: that fraction of it)
    disk = DiskRates(SLOW.read_bytes_per_s * scale, SLOW.write_bytes_per_s * scale)
    choice = _choose(model, tmp_path, disk=disk, moment_dtype="auto", **kw)
    assert choice.moment_dtype == moments
    fp32 = _choose(model, tmp_path, disk=disk, **kw).step
    assert fp32.exposed_s == pytest.approx(fraction * MOMENT_TOLERANCE * compute)


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_an_explicit_moment_dtype_is_never_changed(moments, tmp_path):
    model = _model()
    budgets = _host_fits_bf16_only(model)
    for disk in (SLOW, FAST):
        choice = _choose(model, tmp_path, workload=WORK, disk=disk, flops=FLOPS,
                         moment_dtype=moments, **budgets)
        assert choice.moment_dtype == moments
        assert all("moments" not in line for line in choice.tried)


# -- activations --------------------------------------------------------------------------------
def _acts(workload=WORK):
    return activation_bytes(DecoderShape.from_config(types.SimpleNamespace(**CONFIG)),
                            workload.batch_size, workload.seq_len, torch.float32,
                            workload.activation_checkpointing)


def test_activations_that_do_not_fit_beside_a_placement_take_the_next(tmp_path):
    model = _model(n_blocks=4, config=True)
    acts = _acts().total
    budgets = {"max_device_bytes": _need(model, "none", "none")["device"] + acts - 1,
               "max_host_bytes": 10 ** 12}
    assert _choose(model, tmp_path, **budgets).offload_optimizer == "none"  # (not counted)
    choice = _choose(model, tmp_path, workload=WORK, flops=FLOPS, **budgets)
    assert (choice.offload_optimizer, choice.offload_param) == ("cpu", "none")
    assert choice.activation_bytes == acts > 0
    assert choice.need["device"] == _need(model, "cpu", "none")["device"] + acts
    assert f"activations {acts} B a micro-batch counted" in choice.reason
    plain = _choose(_model(n_blocks=4), tmp_path, workload=WORK, flops=FLOPS, **budgets)
    assert plain.activation_bytes == 0 and "activations not counted" in plain.reason


def test_activations_count_in_the_one_ram_of_a_cpu_only_machine(tmp_path, monkeypatch):
    """No budgets given on a CPU-only machine: device and host are one RAM, and the
    activations count against it; offloading to host frees nothing there, so the state goes
    to NVMe."""
    import psutil
    model = _model(n_blocks=4, config=True)
    none = _need(model, "none", "none")
    acts = _acts().total
    room = none["device"] + none["host"] + acts - 1  # 90% of the RAM measured
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: types.SimpleNamespace(available=int(room / 0.9) + 1))
    assert _choose(model, tmp_path).offload_optimizer == "none"
    choice = _choose(model, tmp_path, workload=WORK, disk=FAST, flops=FLOPS)
    assert choice.budgets["shared"] and choice.offload_optimizer == "nvme"
    assert choice.need["device"] + choice.need["host"] <= choice.budgets["host"]


def test_offloaded_activations_put_the_checkpointed_inputs_in_host_memory(tmp_path):
    """On an accelerator with activation checkpointing and offload_activations, the blocks'
    inputs count in host memory, the rest on the device."""
    model = _model(n_blocks=4, config=True)
    work = Workload(4, 16, activation_checkpointing=True, offload_activations=True)
    acts = _acts(work)
    kw = dict(max_device_bytes=10 ** 12, max_host_bytes=10 ** 12, flops=FLOPS, workload=work)
    choice = _choose(model, tmp_path, device=torch.device("cuda"), **kw)
    p = placement_bytes(model, 3, "none", "none", dtype=torch.float32, accelerator=True)
    inputs = acts.blocks - acts.per_layer
    assert inputs == CONFIG["num_hidden_layers"] * 4 * work.batch_size * work.seq_len * 24
    assert choice.need["host"] == p.tier_bytes("host") + inputs
    assert choice.need["device"] == p.tier_bytes("device") + acts.total - inputs


# -- where the numbers come from -----------------------------------------------------------------
def test_without_a_workload_it_picks_by_fit_and_measures_nothing(tmp_path, monkeypatch):
    model = _model()
    _no_measuring(monkeypatch)
    choice = _choose(model, tmp_path, **_small_host(model))
    assert (choice.offload_optimizer, choice.offload_param) == ("nvme", "cpu")
    assert choice.step is None and "no workload" in choice.reason
    assert not any("s a step" in line for line in choice.tried)


def test_unknown_disk_rates_fall_back_to_the_first_that_fits(tmp_path, monkeypatch):
    model = _model()
    why = f"disk rates unknown under {str(tmp_path)!r}: the filesystem refuses O_DIRECT"
    monkeypatch.setattr(step_time, "disk_rates", lambda path, backend="auto": (None, why))
    choice = _choose(model, tmp_path, workload=WORK, flops=FLOPS, host_cache_bytes="auto",
                     **_small_host(model))
    assert (choice.offload_optimizer, choice.update_timing) == ("nvme", "next_forward")
    assert why in choice.reason and "the first placement that fits" in choice.reason


class _TwoRanks:
    """A communicator whose other rank measured ``factor`` times each figure this one did."""

    world_size = 2

    def __init__(self, factor):
        self.factor, self.gathered = factor, []

    def all_gather_object(self, obj, what=""):
        other = {k: v if isinstance(v, bool) else type(v)(v * self.factor)
                 for k, v in obj.items()}
        self.gathered.append(sorted(obj))
        return [obj, other]


def test_ranks_agree_on_the_smallest_of_each_measured_figure(tmp_path, monkeypatch):
    """Every rank must make the same choice: the budgets, FLOP/s and disk rates are the
    smallest any rank measured (here the other rank's, half of this one's)."""
    model = _model()
    monkeypatch.setattr(step_time, "measured_flops", lambda device, dtype: FLOPS)
    monkeypatch.setattr(step_time, "disk_rates", lambda path, backend="auto": (FAST, ""))
    budgets = _small_host(model)
    comm = _TwoRanks(0.5)
    choice = _choose(model, tmp_path, workload=WORK, comm=comm, **budgets)
    assert comm.gathered == [["device", "host", "nvme", "shared"], ["flops"], ["read", "write"]]
    assert choice.budgets["host"] == budgets["max_host_bytes"] // 2
    assert choice.need["host"] <= budgets["max_host_bytes"] // 2
    assert choice.step.compute_s == pytest.approx(
        compute_estimate(model_layout(model), WORK, FLOPS / 2).seconds)
    assert "disk read 500 GB/s, write 500 GB/s" in choice.reason


def test_measured_rates_are_the_chosen_pairs_trial():
    from offload_zero.memory.tuning import measured_rates
    trials = [dict(block_size=1 << 20, queue_depth=8, read_gbps=2.0, write_gbps=1.0),
              dict(block_size=4 << 20, queue_depth=8, read_gbps=3.0, write_gbps=1.5)]
    settings = dict(block_size=4 << 20, queue_depth=8, measured=dict(trials=trials))
    assert measured_rates(settings) == (3e9, 1.5e9)
    assert measured_rates(dict(settings, queue_depth=32)) is None
    assert measured_rates(dict(block_size=1 << 20, queue_depth=8,
                               measured=dict(trials=[], reason="no O_DIRECT"))) is None


def test_compute_estimate_counts_six_flop_per_parameter_and_token():
    model = _model(n_blocks=4)
    layout = model_layout(model)
    total = sum(p.numel() for p in model.parameters())
    est = compute_estimate(layout, Workload(4, 16, gradient_accumulation_steps=3), 1e9)
    assert est.seconds == pytest.approx(6 * total * 4 * 16 * 3 / 1e9)
    assert est.backward_share == pytest.approx(2 / 3)
    ckpt = compute_estimate(layout, Workload(4, 16, activation_checkpointing=True), 1e9)
    assert ckpt.seconds == pytest.approx(8 * total * 64 / 1e9)
    model.emb.weight.requires_grad_(False)  # frozen: forward and its activations' backward
    frozen = compute_estimate(model_layout(model), Workload(4, 16), 1e9)
    assert frozen.seconds == pytest.approx((6 * total - 2 * model.emb.weight.numel()) * 64 / 1e9)
    with pytest.raises(ValueError, match=r"flops=0 is not valid"):
        compute_estimate(layout, WORK, 0)


@pytest.mark.parametrize("timing", ["step", "backward", "next_forward"])
def test_the_state_io_is_hidden_by_the_compute_its_timing_overlaps(timing):
    """The plain step exposes all of the state's I/O; updates in backward hide what backward's
    share of the compute can; in the next forward, what the whole compute can."""
    model = _model(n_blocks=4)
    plan = placement_bytes(model, 3, "nvme", "cpu", dtype=torch.float32, accelerator=False,
                           update_timing=timing).plan
    state = nvme_traffic(plan).state_bytes
    assert state > 0
    io_s = 2 * state / 1e6
    for compute_s in (io_s / 4, io_s, 4 * io_s):
        t = step_time.step_time(plan, ComputeEstimate(compute_s, 2 / 3, 1.0), SLOW)
        share = {"step": 0, "backward": 2 / 3, "next_forward": 1}[timing]
        assert t.io_s == pytest.approx(io_s)
        assert t.exposed_s == pytest.approx(max(0.0, io_s - share * compute_s))
        assert t.step_s == pytest.approx(compute_s + t.exposed_s)


_REAL_DONE = SwapHandle.done
_WRITES = {  # SwapHandle.done of a parameter shard's write as the engine sees it: as the disk
    "as_they_come": None,  # runs, always behind the engine (done once waited for), or ahead
    "slow": lambda h: h.observed if h.key.endswith(".param") else _REAL_DONE(h),
    "fast": lambda h: h.wait() is None if h.key.endswith(".param") else _REAL_DONE(h),
}


@pytest.mark.parametrize("dtype,timing,exact,writes,master", [
    (torch.bfloat16, "step", True, "as_they_come", "fp32"),
    (torch.bfloat16, "backward", True, "as_they_come", "fp32"),
    (torch.bfloat16, "next_forward", True, "as_they_come", "fp32"),
    (torch.bfloat16, "next_forward", True, "slow", "fp32"),
    (torch.bfloat16, "next_forward", True, "fast", "fp32"),
    (torch.float32, "step", True, "as_they_come", "fp32"),
    (torch.float32, "next_forward", False, "as_they_come", "fp32"),
    (torch.bfloat16, "step", True, "as_they_come", "bf16"),
    (torch.bfloat16, "next_forward", False, "as_they_come", "bf16")])
@pytest.mark.parametrize("shape", ["plain", "outsized_root", "frozen", "cached"])
def test_nvme_bytes_per_step_are_the_engines(dtype, timing, exact, writes, master, shape,
                                             tmp_path, torch_single_thread, monkeypatch):
    """The model's NVMe bytes per step (state and parameter shards on NVMe) are what the
    engine reads and writes in a steady step; an upper bound where fp32 gathers take some
    shards from the state read. Also with a root larger than a block (its parts kept in
    buffers of their own from step to step, and still written), and with frozen parts (the
    embeddings, the blocks' norms: read in forward and in backward, never written). However
    fast the disk: a write seen in flight when a buffer is needed takes no new shard from the
    gather that follows its update (it read the file again). With a host cache of 40% of the
    state: a cached flat parameter's shard never reaches the disk (in fp32 it is the host
    master, in bf16 it stays in host memory beside it): no file, no bytes. With bf16 master
    weights a bf16 shard is its master's bytes, as an fp32 one is: no shard files, no shard
    writes."""
    if _WRITES[writes] is not None:
        monkeypatch.setattr(SwapHandle, "done", _WRITES[writes])
    torch.manual_seed(0)
    model = big_root_lm(n_blocks=4, vocab_scale=4) if shape == "outsized_root" else \
        _model(n_blocks=4)
    if shape == "frozen":
        for p in [model.emb.weight, *(p for b in model.blocks for p in b.ln.parameters())]:
            p.requires_grad_(False)
    cache = {} if shape != "cached" else {
        "host_cache_bytes": int(0.4 * 12 * sum(p.numel() for p in model.parameters()))}
    plan = placement_bytes(model, 3, "nvme", "nvme", dtype=dtype, accelerator=False,
                           update_timing=timing, master_dtype=master, **cache).plan
    traffic = nvme_traffic(plan)
    if master == "bf16":
        assert plan.master_is_param_on_nvme and traffic.param_written_bytes == 0
    with OffloadEngine(copy.deepcopy(model), offload="nvme", path=str(tmp_path), dtype=dtype,
                       update_timing=timing, master_dtype=master, **cache) as eng:
        cached = {fp.name for fp in eng.trainable if eng.store.in_host(fp)}
        assert cached or shape != "cached"
        files = {os.path.basename(f) for f in eng.swapper.files}
        assert not {f"{name}.param.swp" for name in cached} & files
        if master == "bf16":
            assert not {f"{fp.name}.param.swp" for fp in eng.trainable} & files
        on_nvme = [fp for fp in eng.flat_params if fp.name not in cached]
        assert eng.memory_report()["nvme"]["by_kind"]["parameters"]["current_bytes"] == (
            sum(fp.shard_numel * fp.itemsize for fp in on_nvme))
        # (a transfer counts once it completes)
        read, written = last_step_nvme_bytes(eng, batches(3))
    model_read = traffic.state_bytes + traffic.param_read_bytes
    assert written == traffic.state_bytes + traffic.param_written_bytes
    assert traffic.param_read_bytes > 0
    if exact:
        assert read == model_read
    else:
        # (fp32 "next_forward": a gather that follows its update takes the shard from the
        # state read; with few units on NVMe, as cached, every one may, whatever the timing)
        assert traffic.state_bytes <= read <= model_read
        assert shape == "cached" or traffic.state_bytes < read


# -- the engine and the command line -----------------------------------------------------------
def test_the_engine_passes_its_workload_and_runs_the_format_chosen(tmp_path, monkeypatch):
    model = _model(n_blocks=32, config=True)
    monkeypatch.setattr(step_time, "measured_flops", lambda device, dtype: FLOPS)
    monkeypatch.setattr(step_time, "disk_rates", lambda path, backend="auto": (SLOW, ""))
    acts = _acts().total
    budgets = _host_fits_bf16_only(model)
    budgets["max_device_bytes"] += acts
    with OffloadEngine(model, offload="auto", path=str(tmp_path), moment_dtype="auto",
                       workload={"batch_size": 4, "seq_len": 16},
                       gradient_accumulation_steps=2, **budgets) as eng:
        assert eng.config.moment_dtype == "bf16" and eng.store.fmt.moment_dtype == torch.bfloat16
        assert (eng.config.offload_optimizer, eng.config.offload_param) == ("cpu", "cpu")
        assert eng.placement.activation_bytes == acts
        work = Workload(4, 16, gradient_accumulation_steps=2)
        assert eng.config.auto_workload == work
        assert eng.placement.step.compute_s == pytest.approx(
            compute_estimate(model_layout(model), work, FLOPS).seconds)
        x, y = batches(1)[0]
        for _ in range(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        assert eng.memory_report()["host"]["peak_bytes"] <= budgets["max_host_bytes"]


@pytest.mark.parametrize("kw, match", [
    ({"offload": "cpu", "moment_dtype": "auto"},
     r"moment_dtype='auto' needs offload='auto'.*got offload='cpu'"),
    ({"offload": "auto", "workload": {"batch_size": 4}},
     r"workload=\{'batch_size': 4\} is not valid; give a dict with the keys"),
    ({"offload": "auto", "workload": {"batch_size": 0, "seq_len": 8}},
     r"workload\['batch_size'\]=0 is not valid; it must be an int >= 1"),
    ({"moment_dtype": "fp16"}, r"moment_dtype='fp16' is not valid.*or 'auto' with offload='auto'"),
])
def test_bad_auto_settings_raise_value_error(kw, match):
    from offload_zero.config import EngineConfig
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_a_workload_without_offload_auto_warns_that_it_is_unused():
    from offload_zero.config import EngineConfig
    with pytest.warns(UserWarning, match=r"workload=.* is not used: only offload='auto'"):
        EngineConfig(offload="cpu", workload={"batch_size": 2, "seq_len": 8})


def test_the_cli_passes_its_batch_and_prints_the_reason(tmp_path, monkeypatch, capsys):
    from offload_zero import cli, train
    from train_cli_helpers import FAST, _engine_keywords, _parse
    seen = _engine_keywords(monkeypatch)
    summary = train.run(_parse("--preset", "tiny", "--steps", 1, "--no-progress", "--offload",
                               "auto", "--path", tmp_path, "--moment-dtype", "auto", *FAST))
    assert seen["workload"] == {"batch_size": 4, "seq_len": 64}
    assert "s a step" in summary["placement"] and "a micro-batch counted" in summary["placement"]
    assert f"  placement    {summary['placement']}" in capsys.readouterr().out
    assert cli.main(["train", "--moment-dtype", "auto", "--steps", "1"]) == 2
    assert "--moment-dtype auto needs --offload auto" in capsys.readouterr().err
