"""master_dtype="bf16": the master weights of a bf16 model are the bf16 parameter shards
themselves, updated in fp32 and stored with stochastic rounding: training next to fp32
masters, the same numbers across timings, tiers, chunking and ranks, the bytes in memory and
on NVMe, checkpoints across master dtypes, the estimate, and the errors."""
import copy
import os

import pytest
import torch

from offload_zero import OffloadEngine
from offload_zero.estimator import estimate_memory
from offload_zero.memory.state_format import StateFormat
from offload_zero.memory.tiers import NVMeStore
from models import TinyLM
from test_host_cache import CacheLM
from test_moment_dtype import (_engine, _run_and_save_halfway, _train,
                               assert_estimate_is_measured, assert_resumes_exactly,
                               assert_same_everywhere, train_runs_on_rank)

BF16 = torch.bfloat16


def test_state_format_bytes_with_a_bf16_master():
    """2 bytes of master per element: 10, 6 and 4 bytes a state with fp32, bf16 and int8
    moments; the master region is padded to 4096 bytes like the moments'."""
    fmts = [StateFormat(m, BF16) for m in (torch.float32, BF16, torch.uint8)]
    assert [f.bytes_per_element for f in fmts] == [10, 6, 4]
    assert [f.chunk_multiple for f in fmts] == [2048, 2048, 4096]
    fp32_moments, bf16 = fmts[0], fmts[1]
    assert bf16.nbytes(2048) == 6 * 2048
    assert bf16.offsets(3072) == (0, 8192, 16384)  # each region padded to 4096 bytes
    assert fp32_moments.offsets(2048) == (0, 4096, 4096 + 8192)
    buf = torch.zeros(bf16.buffer_numel(3072))
    master, m, v = bf16.views(buf, 3072, 1024, padded=True)
    assert (master.dtype, master.numel(), m.numel()) == (BF16, 2048, 2048)
    assert master.data_ptr() + 8192 == m.data_ptr()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_bf16_master_trains_close_to_fp32_master(offload, tmp_path):
    """Thirty steps on one batch in bf16: the loss falls as with fp32 masters, within 2% of it
    at every step from the fifth, and the weights the model shows are the masters'."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=3)
    runs, weights = {}, {}
    for master in ("fp32", "bf16"):
        with _engine(copy.deepcopy(model), tmp_path, f"{offload}-{master}", offload=offload,
                     stage=3, lr=3e-3, dtype=BF16, master_dtype=master) as eng:
            runs[master] = _train(eng, steps=30, seed=1, repeat=True)
            weights[master] = eng.full_state_dict()
            if master == "bf16":
                for fp in eng.trainable:
                    shard = eng.store.read_master(fp)
                    assert torch.equal(shard.to(BF16).float(), shard)  # (bf16 values)
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16[-1] < 0.9 * bf16[0]
    assert all(abs(a - b) <= 0.02 * a for a, b in zip(fp32[4:], bf16[4:])), (fp32, bf16)
    assert any(not torch.equal(weights["fp32"][k], weights["bf16"][k]) for k in weights["fp32"])


def test_small_updates_still_move_bf16_masters(tmp_path):
    """An update far under half a bf16 ulp of a weight is lost to round-to-nearest; stochastic
    rounding moves the weights by it on average: after 20 steps with lr 1e-4 the mean change of
    the large weights is within 25% of the fp32 masters' (and not zero)."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    with torch.no_grad():
        for p in model.parameters():
            # |w| in [4, 8), bf16 values: a bf16 ulp is 2^-5, the steps ~1e-4
            p.copy_((p + torch.sign(p) * 4.0).to(BF16).float())
    start = copy.deepcopy(model.state_dict())
    changes = {}
    for master in ("fp32", "bf16"):
        with _engine(copy.deepcopy(model), tmp_path, master, offload="cpu", stage=3, lr=1e-4,
                     weight_decay=0.0, dtype=BF16, master_dtype=master) as eng:
            _train(eng, steps=20, seed=2, repeat=True)
            now = eng.full_state_dict()  # (the masters, as fp32 values)
        changes[master] = torch.cat([(now[k] - start[k]).view(-1) for k in start])
    fp32, bf16 = changes["fp32"], changes["bf16"]
    assert fp32.abs().mean() > 1e-3
    assert (bf16 - fp32).mean().abs() <= 0.25 * fp32.abs().mean()
    assert bf16.abs().mean() >= 0.5 * fp32.abs().mean()


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_bf16_master_is_the_same_in_every_mode_tier_and_chunking(moments, tmp_path,
                                                                 monkeypatch):
    """The master's rounding is keyed by each element's place in its flat parameter, so the
    plain step, update timings "backward" and "next_forward", a host cache, offload="cpu" and
    the NVMe state streamed in chunks of 4096 elements give the same weights bit for bit, with
    every moment format."""
    assert_same_everywhere(tmp_path, monkeypatch,
                           {"stage": 3, "dtype": BF16, "master_dtype": "bf16",
                            "moment_dtype": moments}, 150_000, 4096)


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_parameter_groups_that_cut_a_block_with_bf16_masters(moments, tmp_path, monkeypatch):
    """Two parameter groups (no decay for biases and norms) whose runs start inside 64- and
    256-element blocks: bf16 masters give the same weights on the CPU tier, on NVMe and
    streamed in chunks of 4096 elements, close to fp32 masters'."""
    torch.manual_seed(0)
    model = CacheLM()

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.dim() > 1]
        rest = [p for n, p in m.named_parameters() if p.dim() <= 1]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    out = {}
    runs = {"cpu": {"offload": "cpu"}, "nvme": {"update_timing": "step"},
            "chunked": {"update_timing": "step"}, "fp32": {"master_dtype": "fp32"}}
    for name, kw in runs.items():
        if name == "chunked":
            monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 4096)
        m = copy.deepcopy(model)
        kw = {"master_dtype": "bf16", "moment_dtype": moments, **kw}
        with _engine(m, tmp_path, name, stage=3, dtype=BF16, param_groups=groups(m),
                     **kw) as eng:
            cuts = [a for segs in eng._updates.adam.segments.values() for a, _, _ in segs[1:]]
            assert any(a % 64 for a in cuts)
            assert name != "chunked" or max(eng.store.chunks(fp) for fp in eng.trainable) > 1
            _train(eng, steps=4)
            out[name] = eng.full_state_dict()
    for name in ("nvme", "chunked"):
        assert all(torch.equal(out["cpu"][k], out[name][k]) for k in out["cpu"]), name
    assert all(torch.allclose(out["cpu"][k], out["fp32"][k], atol=0.05) for k in out["cpu"])


@pytest.mark.parametrize("moments,per_element", [("fp32", 10), ("bf16", 6), ("int8", 4)])
def test_bf16_master_files_and_bytes(moments, per_element, tmp_path):
    """With the state and the shards on NVMe, each state file holds 2 bytes of master and the
    moments per element (regions padded to 4096 bytes) and is the shard's only file; memory
    shows 2 bytes of master per element nowhere (it is the parameters' bytes); a step writes
    exactly the state files, nothing else."""
    torch.manual_seed(0)
    with _engine(CacheLM(), tmp_path, "e", stage=3, dtype=BF16, master_dtype="bf16",
                 moment_dtype=moments, update_timing="step", tail_state_in_host=False) as eng:
        fmt = eng.store.fmt
        pad = lambda nbytes: -(-nbytes // 4096) * 4096  # noqa: E731
        files = {os.path.basename(f) for f in eng.swapper.files}
        for fp in eng.trainable:
            assert f"{fp.name}.param.swp" not in files
            n = fp.shard_numel
            assert eng.store.state_file_bytes(fp) == pad(2 * n) + fmt.moment_bytes(n)
        assert fmt.bytes_per_element == per_element
        rep = eng.memory_report()
        assert rep["nvme"]["by_kind"]["master_weights"]["current_bytes"] == 0
        assert rep["nvme"]["by_kind"]["parameters"]["current_bytes"] == sum(
            2 * fp.shard_numel for fp in eng.flat_params)
        state = sum(eng.store.state_file_bytes(fp) for fp in eng.trainable)
        assert rep["host_cache"]["nvme_state_bytes"] == state
        before = rep["nvme"]["state_written_bytes"]
        _train(eng, steps=2)
        eng.store.drain()
        written = eng.memory_report()["nvme"]["state_written_bytes"] - before
        assert eng.memory_report()["nvme"]["written_bytes"] >= written
    assert written == 2 * state
    assert state <= pad(per_element * sum(fp.shard_numel for fp in eng.trainable)) + 2 * 4096 * \
        len(eng.trainable)


@pytest.mark.parametrize("offload,stage,mode,moments", [
    ("nvme", 3, "next_forward", "fp32"), ("nvme", 3, "backward", "bf16"),
    ("nvme", 2, "plain", "int8"), ("cpu", 3, "plain", "bf16"), ("cpu", 2, "plain", "fp32")])
def test_estimate_counts_bf16_masters(offload, stage, mode, moments, tmp_path):
    """The estimate's bytes per tier and kind equal memory_report's peaks with bf16 masters
    (on a CPU device with offload="cpu" the master is the shard itself: no bytes of its own)."""
    assert_estimate_is_measured(tmp_path, offload, stage, mode, BF16, moment_dtype=moments,
                                master_dtype="bf16")


def test_estimate_table_counts_two_bytes_of_master():
    """``estimate_memory``: the offloaded rows' master weights halve with a bf16 master."""
    fp32 = estimate_memory(1e9, offload="cpu", dtype="bf16")
    bf16 = estimate_memory(1e9, offload="cpu", dtype="bf16", master_dtype="bf16")
    for a, b in zip(fp32.table, bf16.table):
        if a.offload == "cpu":
            assert b.by_kind("host")["master_weights"] * 2 == a.by_kind("host")["master_weights"]
    with pytest.raises(ValueError, match=r"master_dtype='bf16' needs dtype bf16.*got dtype=fp32"):
        estimate_memory(1e9, dtype="fp32", master_dtype="bf16")


def test_bf16_master_checkpoint_resumes_bit_for_bit_and_converts(tmp_path):
    """Saved with bf16 masters (as fp32 values), loaded into a fresh engine, two more steps:
    the weights of the run that did not stop. An fp32-master engine loads the same values
    exactly; its checkpoint loads back into a bf16-master engine rounded to nearest."""
    kw = {"stage": 3, "dtype": BF16, "master_dtype": "bf16", "moment_dtype": "bf16"}
    model, whole, xs, saved, _ = _run_and_save_halfway(tmp_path, kw)
    assert_resumes_exactly(tmp_path, kw, model, whole, xs)
    with _engine(copy.deepcopy(model), tmp_path, "fp32", stage=3, dtype=BF16,
                 moment_dtype="bf16") as c:
        c.load_checkpoint(str(tmp_path / "ckpt"))
        for fp in c.trainable:
            assert torch.equal(c.store.read_master(fp), saved[fp.name][0])
        _train(c, steps=1)  # (fp32 masters off the bf16 grid now)
        c.save_checkpoint(str(tmp_path / "ckpt32"))
        masters = {fp.name: c.store.read_master(fp) for fp in c.trainable}
    assert any(not torch.equal(m.to(BF16).float(), m) for m in masters.values())
    with _engine(copy.deepcopy(model), tmp_path, "back", **kw) as d:
        d.load_checkpoint(str(tmp_path / "ckpt32"))
        for fp in d.trainable:
            assert torch.equal(d.store.read_master(fp), masters[fp.name].to(BF16).float())


@pytest.mark.parametrize("value", ["fp16", "int8", torch.float16, 2, None])
def test_bad_master_dtype_raises_value_error(value):
    with pytest.raises(ValueError, match=r"master_dtype=.* is not valid; choose one of "
                                         r"\('fp32', 'bf16'\)"):
        OffloadEngine(TinyLM(n_blocks=2), dtype=BF16, master_dtype=value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bf16_master_needs_a_bf16_model(dtype):
    """The error names the dtype and how each way in sets bf16 compute; an invalid dtype is
    named as such first."""
    with pytest.raises(ValueError, match=r"master_dtype='bf16' needs bf16 compute .*got dtype="
                                         r"torch.float.*dtype=torch.bfloat16; OffloadTrainer: "
                                         r"TrainingArguments\(bf16=True\)"):
        OffloadEngine(TinyLM(n_blocks=2), dtype=dtype, master_dtype="bf16")
    with pytest.raises(ValueError, match=r"dtype='bf16' is not valid; choose one of"):
        OffloadEngine(TinyLM(n_blocks=2), dtype="bf16", master_dtype="bf16")


def test_auto_with_bf16_master_keeps_the_state_off_an_accelerator(tmp_path):
    """offload="auto" with bf16 masters on an accelerator skips the placements that keep the
    optimizer state there (its update would run in torch ops), with a line saying why."""
    from offload_zero.placement import choose_placement
    choice = choose_placement(TinyLM(n_blocks=2), 3, 1, BF16, 1, (), torch.device("cuda"),
                              str(tmp_path), max_device_bytes=10 ** 12, max_host_bytes=10 ** 12,
                              master_dtype="bf16")
    assert (choice.offload_optimizer, choice.offload_param) == ("cpu", "none")
    assert choice.tried[0].startswith("none+none: skipped, master_dtype='bf16'")


def _two_rank_run(rank, world_size):
    """Stage 3 at two ranks with bf16 masters: all on NVMe with the plain step, with a host
    cache and update_timing="backward", and on the CPU tier. The weights on this rank."""
    return train_runs_on_rank(rank, world_size, {
        "nvme": {"update_timing": "step"},
        "cache+sib": {"host_cache_bytes": 100_000, "update_timing": "backward"},
        "cpu": {"offload": "cpu"}},
        base={"dtype": BF16, "master_dtype": "bf16", "moment_dtype": "bf16"})


def test_bf16_master_is_the_same_at_two_ranks_on_every_tier():
    from dist_harness import run_ranks
    results = run_ranks(_two_rank_run, 2)
    for result in results:
        for other in ("cache+sib", "cpu"):
            assert all((result["nvme"][k] == result[other][k]).all() for k in result["nvme"])
    assert all((results[0]["nvme"][k] == results[1]["nvme"][k]).all() for k in results[0]["nvme"])
