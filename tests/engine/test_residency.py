"""Where the bytes are: live units from tensor storages, memory_report against numel
arithmetic, alignment, the fixed gather pool and parameter-shard pools, host memory over many
steps."""
import copy
import os
import subprocess

import pytest
import torch

from engine_common import OFFLOADS, make_engine, train_both
from models import TinyLM, batches, big_root_lm, lm_loss, max_param_diff
from offload_zero import OffloadEngine


def _slot_of(eng, ptr):
    """(pool name, slot index) of a device address inside a gather pool, or None."""
    for name in ("gather", "gather_root"):
        pool = eng.pools.get(name)
        for i, slot in enumerate(pool._slots if pool else []):
            if slot.data_ptr() <= ptr < slot.data_ptr() + pool.slot_bytes:
                return name, i
    return None


@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_at_most_three_blocks_hold_storage(offload_param, tmp_path):
    """Residency from the tensors' own storage: the views a block's modules see while it runs
    share the storage of the gathered buffer, so their ``nbytes`` tell whether it is held.

    Parameter shards off the device (host or NVMe): the device holds only gathered units. (One
    rank with its shards on the device keeps them as the parameters; see the next test.)"""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=8)
    offload = "cpu"
    blocks = list(model.blocks)
    views = {}
    counts = []

    def held_blocks():
        return sum(any(t.untyped_storage().nbytes() > 0 for t in views[i]) for i in views)

    def pre_forward(i):
        def hook(mod, args):  # runs after the engine's pre-forward hook: views are live
            views[i] = [mod.up.weight, mod.down.weight, mod.ln.weight]
            assert all(t.untyped_storage().nbytes() > 0 for t in views[i])
            counts.append(("forward", i, held_blocks()))
        return hook

    def post_forward(i):
        def hook(mod, args, out):
            out.register_hook(lambda grad: counts.append(("backward", i, held_blocks())))
        return hook

    eng = make_engine(model, offload, tmp_path, offload_param=offload_param, path=str(tmp_path))
    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(pre_forward(i))
        b.register_forward_hook(post_forward(i))
    with eng:
        for step, (x, y) in enumerate(batches(3)):
            counts.clear()
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            assert len(counts) == 16
            if step:  # from the second step every block's views are known
                assert max(c for _, _, c in counts) <= 3, counts
                assert min(c for _, _, c in counts) >= 1, counts
            assert held_blocks() == 0  # nothing stays gathered between steps
            assert eng.memory_report()["live_units"]["current"] == 0
        assert eng.memory_report()["live_units"]["peak"] <= 4  # 3 blocks + root


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_with_device_shards_gathers_nothing(stage):
    """World size 1, shards on the device: the shard is the whole parameter, so no unit is
    copied into a second buffer (device parameter bytes never exceed the shards)."""
    with OffloadEngine(TinyLM(n_blocks=8), stage=stage, offload="cpu") as eng:
        shards = 4 * sum(fp.shard_numel for fp in eng.flat_params)
        for x, y in batches(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        params = eng.memory_report()["device"]["by_kind"]["parameters"]
        assert params["current_bytes"] == params["peak_bytes"] == shards
        assert all(fp.sharded.data_ptr() == fp.full_values().data_ptr() for fp in eng.flat_params)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_memory_report_matches_numel_arithmetic(offload, tmp_path):
    with make_engine(TinyLM(), offload, tmp_path, update_timing="step") as eng:
        s = sum(fp.shard_numel for fp in eng.trainable)
        rep = eng.memory_report()
        kinds = {t: {k: v["current_bytes"] for k, v in rep[t]["by_kind"].items()} for t in ("device", "host", "nvme")}
        param_tier = "nvme" if offload == "nvme" else "device"  # offload="nvme" at stage 3: both
        assert kinds[param_tier]["parameters"] == 4 * s  # fp32 shards at rest, nothing gathered
        tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[offload]
        assert kinds[tier]["moments"] == 8 * s
        # fp32 compute with master and shard in one memory (the device, the host when the CPU
        # is the device, or NVMe at stage 3): the shard is the master (no second copy)
        assert kinds[tier]["master_weights"] == 0
        grad_tier = "device" if offload == "none" else "host"
        # with the host as the device, one rank adopts the reduced gradient as its host shard
        # (no copy): the shard bytes exist from backward to step
        assert kinds[grad_tier]["gradients"] == (4 * s if offload == "none" else 0)
        for x, y in batches(1):
            eng.backward(lm_loss(eng(x), y))
            held = eng.memory_report()[grad_tier]["by_kind"]["gradients"]["current_bytes"]
            assert held == 4 * s
            eng.step()
        rep = eng.memory_report()
        biggest_unit = max(fp.padded_numel for fp in eng.flat_params)
        if offload == "nvme":  # a unit's full gradient comes and goes on the device
            assert rep["device"]["peak_bytes"] >= rep["device"]["current_bytes"] + 4 * biggest_unit
        if offload == "cpu":  # the CPU is the device: the fp32 master is the shard's memory
            assert all(eng.store._state[fp][0].data_ptr() == fp.sharded.data_ptr()
                       for fp in eng.trainable)
        # storage-level check: every resident shard really holds its bytes
        if offload != "nvme":
            assert sum(fp.sharded.untyped_storage().nbytes() for fp in eng.flat_params) == 4 * sum(
                fp.shard_numel for fp in eng.flat_params)
        else:
            assert all(fp.sharded is None for fp in eng.flat_params)
            assert rep["pools"]["param_shards"]["in_use"] == 0


def test_shards_are_4096_byte_aligned():
    with OffloadEngine(TinyLM(), dtype=torch.bfloat16) as eng:
        for fp in eng.flat_params:
            assert (fp.shard_numel * 2) % 4096 == 0 and fp.padded_numel >= fp.numel
            assert fp.sharded.data_ptr() % 64 == 0


def test_host_memory_flat_over_200_steps_with_nvme(tmp_path):
    """Fixed pools sized at start-up: peak RSS after step 20 and after step 200 within 2%."""
    import json
    import sys
    job = os.path.join(os.path.dirname(os.path.dirname(__file__)), "rss_job.py")  # (tests/)
    r = subprocess.run([sys.executable, job, str(tmp_path), "200", "20"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(out["rss_at_end"] - out["rss_at_mark"]) / out["rss_at_mark"] < 0.02, out
    assert out["pools_at_end"] == out["pools_at_mark"]  # same buffers, same peak use
    assert out["pools_at_end"]["param_shards"]["in_use"] == 0


def test_bf16_gradient_shards_on_host_halve_their_bytes(tmp_path):
    torch.manual_seed(11)
    model = TinyLM()
    ref_model = copy.deepcopy(model)
    with OffloadEngine(model, offload="cpu", grad_dtype=torch.bfloat16, lr=1e-2) as eng, \
            OffloadEngine(ref_model, offload="cpu", lr=1e-2) as ref:
        s = sum(fp.shard_numel for fp in eng.trainable)
        for i, (x, y) in enumerate(batches(5)):
            for e in (eng, ref):
                e.backward(lm_loss(e(x), y))
            if i == 0:  # gradient shards held between backward and step
                assert eng.memory_report()["host"]["by_kind"]["gradients"]["current_bytes"] == 2 * s
                assert ref.memory_report()["host"]["by_kind"]["gradients"]["current_bytes"] == 4 * s
            for e in (eng, ref):
                e.step()
        a, b = eng.full_state_dict(), ref.full_state_dict()
        # bf16 gradients move each step by at most lr-sized amounts differently; close, not equal
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-2
    with pytest.raises(ValueError, match="grad_dtype"):
        OffloadEngine(TinyLM(), grad_dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameter_pool_is_block_sized_with_a_separate_root_pool(dtype, tmp_path):
    """Reads ahead for (prefetch + 2) units of one flat parameter, plus a write-back ring of two
    where the shard is not its master (bf16); the root's outsized parts (embeddings, LM head)
    have a buffer each apart (their read and their write-back never overlap: the step's writes
    are done before the next forward reads), its final norm goes through the blocks' pool."""
    k, ring = (4, 0) if dtype == torch.float32 else (2, 2)
    with OffloadEngine(big_root_lm(4, vocab_scale=4), offload="nvme", path=str(tmp_path),
                       dtype=dtype, update_timing="step") as eng:
        blocks = [fp for u in eng.blocks for fp in u.flat_params]
        roots = eng.root.flat_params
        assert len(roots) == 3
        pools = eng.memory_report()["pools"]
        assert pools["param_shards"]["buffer_bytes"] == k * max(fp.shard_numel for fp in blocks)
        assert pools["param_shards"]["buffers"] == 1 * (1 + 2) + ring
        assert pools["param_shards_root"]["buffers"] == 2
        assert pools["param_shards_root"]["buffer_bytes"] == k * max(fp.shard_numel for fp in roots)
        for x, y in batches(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        pools = eng.memory_report()["pools"]
        assert pools["param_shards_root"]["peak_in_use"] == 2
        assert pools["param_shards"]["in_use"] == 0


@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_gathered_units_live_in_the_fixed_gather_pool(offload_param, tmp_path):
    """Every gathered parameter the modules see, in forward and backward, lies in the pool's
    slots sized at start-up; a unit may come back in another slot for backward and autograd's
    saved views still see its values (the numbers match plain AdamW)."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=8)
    seen = {"forward": {}, "backward": {}, "root": []}

    def on_engine(eng):
        def record(phase, i, ptr):
            seen[phase].setdefault(i, []).append(_slot_of(eng, ptr))

        def pre(mod, args, i):
            record("forward", i, mod.up.weight.data_ptr())

        def post(mod, args, out, i):
            out.register_hook(lambda g: record("backward", i, mod.up.weight.data_ptr()))

        for i, b in enumerate(model.blocks):
            b.register_forward_pre_hook(lambda mod, args, i=i: pre(mod, args, i))
            b.register_forward_hook(lambda mod, args, out, i=i: post(mod, args, out, i))
        model.head.register_forward_pre_hook(
            lambda mod, args: seen["root"].append(_slot_of(eng, mod.weight.data_ptr())))

    kw = {"stage": 3, "offload_param": offload_param, "path": str(tmp_path)}
    eng, ref = train_both(model, kw, tmp_path, "cpu", steps=4, on_engine=on_engine)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        rep = eng.memory_report()
        pools = rep["pools"]
        slots = 1 if offload_param == "nvme" else 2  # prefetch + 1, one for NVMe-resident shards
        block_bytes = max(sum(fp.padded_numel * 4 for fp in u.flat_params) for u in eng.blocks)
        assert pools["gather"]["buffers"] == slots and pools["gather"]["grown"] == 0
        assert pools["gather"]["buffer_bytes"] == block_bytes
        assert pools["gather"]["in_use"] == 0 and pools["gather"]["peak_in_use"] == slots
        assert pools["gather_root"]["buffers"] == 1
        assert rep["device"]["by_kind"]["buffers"]["peak_bytes"] == (
            slots * block_bytes + pools["gather_root"]["buffer_bytes"])
        assert rep["device"]["by_kind"]["parameters"]["peak_bytes"] == 0  # nothing else gathered
    every = [s for phase in ("forward", "backward") for v in seen[phase].values() for s in v]
    assert len(every) == 2 * 8 * 4 and all(s is not None and s[0] == "gather" for s in every)
    assert len(seen["root"]) == 4 and all(s == ("gather_root", 0) for s in seen["root"])
    if slots > 1:
        moved = [i for i in range(8) if seen["forward"][i] != seen["backward"][i]]
        assert moved, seen


@pytest.mark.parametrize("timing", ["auto", "backward"])
@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_without_storage_rebinding_gathers_allocate_and_train_the_same(
        offload_param, timing, tmp_path, monkeypatch, caplog):
    """A torch without storage rebinding (torch 2.11 has none) runs stage 3 without the
    gather pool: each gather allocates its unit, the log says so, the report has no pool, and
    the weights after 4 steps are bit for bit those of the run with the pool."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=4)
    kw = {"stage": 3, "offload_param": offload_param, "update_timing": timing}
    finals = []
    for rebind in (True, False):
        import offload_zero.build as build_mod
        monkeypatch.setattr(build_mod, "storage_rebinding_supported", lambda r=rebind: r)
        run = tmp_path / str(rebind)
        run.mkdir()
        with caplog.at_level("INFO", logger="offload_zero"):
            eng, ref = train_both(copy.deepcopy(model), dict(kw, path=str(run)), run, "nvme",
                                   steps=4)
        with eng:
            assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
            assert ("gather" in eng.memory_report()["pools"]) is rebind
            finals.append(eng.full_state_dict())
    assert "cannot rebind storages" in caplog.text
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_gather_pool_grows_once_when_a_schedule_holds_more_units(tmp_path, caplog):
    """Blocks that share a weight gather each other (deps): more units at once than the pool was
    sized for. It adds slots with a warning during the first step, the numbers stay right, and
    later steps allocate nothing more."""
    torch.manual_seed(3)
    model = TinyLM(n_blocks=6)
    for i in (2, 4):
        model.blocks[i].up.weight = model.blocks[i - 2].up.weight  # tied across blocks
    engines, grown = [], []

    def before_step(i, model, ref):
        if i:
            grown.append(engines[0].memory_report()["pools"]["gather"]["grown"])

    kw = {"stage": 3, "offload_param": "cpu"}
    with caplog.at_level("WARNING", logger="offload_zero.memory.pool"):
        eng, ref = train_both(model, kw, tmp_path, "cpu", steps=4, before_step=before_step,
                               on_engine=engines.append)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        pool = eng.memory_report()["pools"]["gather"]
        assert pool["grown"] >= 1 and pool["buffers"] == 2 + pool["grown"]
        assert grown == [pool["grown"]] * 3  # grown during the first step only
    assert any("gather pool 'gather'" in r.getMessage() and "adding one slot" in r.getMessage()
               for r in caplog.records)


def test_views_of_a_gathered_unit_keep_their_values_after_close():
    """An error inside a unit's forward leaves it gathered; closing the engine gives the pool
    back but copies the unit's values out first, so views still referenced stay readable."""
    torch.manual_seed(0)
    model = TinyLM()
    held = []

    def boom(mod, args):
        held.append(mod.up.weight)
        raise KeyError("stop")

    eng = OffloadEngine(model, stage=3, offload="cpu", offload_param="cpu")
    expected = eng.full_state_dict()["blocks.2.up.weight"].clone()
    model.blocks[2].register_forward_pre_hook(boom)
    with pytest.raises(KeyError):
        eng(batches(1)[0][0])
    assert eng.pools["gather"].in_use >= 1
    eng.close()
    assert torch.equal(held[0].float(), expected)


@pytest.mark.parametrize("offload,offload_param", [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "none")])
def test_units_left_gathered_by_an_error_in_forward_are_freed_by_the_next_forward(
        offload, offload_param, tmp_path, caplog):
    """An error inside a block's forward leaves that block (and the one prefetched after it)
    gathered. Catching it and training on, as a loop that skips a failed batch does, never
    holds more units than a clean run nor grows the gather pool: the next forward frees what
    the failed one left. The weights then
    match plain AdamW that never saw the failed batch."""
    torch.manual_seed(4)
    model = TinyLM(n_blocks=4)
    fail = [False]

    def boom(mod, args):
        if fail[0]:
            raise KeyError("injected")

    model.blocks[2].register_forward_pre_hook(boom)

    engines = []

    def before_step(i, model, ref):
        if i in (1, 2):  # a failed forward before steps 1 and 2, then the batch is trained
            fail[0] = True
            with pytest.raises(KeyError, match="injected"):
                engines[0](batches(1)[0][0])
            fail[0] = False

    with caplog.at_level("WARNING", logger="offload_zero.memory.pool"):
        eng, ref = train_both(model, {"stage": 3, "offload_param": offload_param}, tmp_path,
                               offload, steps=4, before_step=before_step,
                               on_engine=engines.append)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        pool = eng.memory_report()["pools"].get("gather", {"grown": 0})  # none: no param tier
        assert pool["grown"] == 0, pool
        assert eng.scheduler.live_peak <= 3  # root, a block and the one prefetched
    assert not [r for r in caplog.records if "adding one slot" in r.getMessage()]


def test_blocks_with_frozen_weights_are_freed_during_backward(tmp_path):
    """Frozen weights (the LayerNorm that runs first, and a Linear) are still used by backward
    after the block's trainable gradients are accumulated; the block is freed once its inputs'
    gradients are computed, so backward holds as few blocks as forward and the gather pool never
    grows. Numbers match plain AdamW."""
    torch.manual_seed(6)
    model = TinyLM(n_blocks=8)
    for b in model.blocks:
        b.ln.requires_grad_(False)
        b.up.weight.requires_grad_(False)
    live = []

    def on_engine(eng):
        for b in model.blocks:
            b.register_forward_hook(lambda mod, args, out: out.register_hook(
                lambda g: live.append(eng.scheduler.live_units())) and None)

    kw = {"stage": 3, "offload_param": "cpu"}
    eng, ref = train_both(model, kw, tmp_path, "cpu", steps=3, on_engine=on_engine)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        pool = eng.memory_report()["pools"]["gather"]
        assert pool["grown"] == 0 and pool["peak_in_use"] <= 2
        assert len(live) == 3 * 8 and max(live) <= 3, live  # two blocks + root


def test_pools_never_exceed_the_blocks_whatever_prefetch(tmp_path):
    """prefetch counts at most the other blocks: a huge value sizes no huge pool (it used to
    ask the allocator for prefetch-many buffers) and costs no time (the scheduler looped
    prefetch times per unit), and the estimate follows the same rule."""
    from offload_zero.estimator import estimate_memory
    model = TinyLM(n_blocks=2)
    est = estimate_memory(model, stage=3, offload="nvme", dtype=torch.float32, prefetch=10 ** 12,
                          accelerator=False)
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), prefetch=10 ** 12) as eng:
        pools = eng.memory_report()["pools"]
        assert pools["param_shards"]["buffers"] == 1 + 2  # one block ahead, no ring at fp32
        x, y = batches(1)[0]
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        rep = eng.memory_report()
    assert {k: rep["host"]["by_kind"][k]["peak_bytes"] for k in ("buffers",)} == {
        "buffers": est.by_kind("host")["buffers"]}
    with OffloadEngine(TinyLM(n_blocks=2), stage=3, offload="cpu", offload_param="cpu",
                       prefetch=10 ** 12) as eng:
        assert eng.memory_report()["pools"]["gather"]["buffers"] == 2
