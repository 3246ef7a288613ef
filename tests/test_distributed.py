"""ZeRO stages 1-3 across gloo ranks: equivalence with single-process AdamW on the global batch,
awkward shapes, memory per rank from the paper's formulas, communication volume."""
import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks
from models import (BackwardFault, TinyLM, WideNet, adamw_reference, batches, big_root_lm,
                    lm_loss, unique_storage_bytes)

STEPS = 5
CASES_WS2 = [(s, o) for s in (1, 2, 3) for o in ("none", "cpu", "nvme")]
CASES_WS4 = [(3, "none"), (3, "nvme")]


def _equivalence_rank(rank, world_size, cases):
    from offload_zero import OffloadEngine
    out = {}
    for stage, offload in cases:
        torch.manual_seed(0)
        model = TinyLM()
        global_batches = batches(STEPS, seed=1, batch=2 * world_size)
        expected = adamw_reference(model, global_batches)
        with tempfile.TemporaryDirectory() as d:
            eng = OffloadEngine(model, stage=stage, offload=offload,
                                path=d if offload == "nvme" else None, lr=1e-2, weight_decay=0.1)
            with eng:
                for x, y in global_batches:
                    lo = rank * 2
                    eng.backward(lm_loss(eng(x[lo:lo + 2]), y[lo:lo + 2]))
                    eng.step()
                sd = eng.full_state_dict()
                comm = eng.comm_report()["last_step"]
        diff = max((sd[n] - v).abs().max().item() for n, v in expected.items())
        # numpy arrays pickle by value (tensors would travel as shared memory of a dying process)
        out[(stage, offload)] = (diff, comm, {k: v.numpy() for k, v in sd.items()} if stage == 3 else None)
    return out


@pytest.fixture(scope="module")
def ws2_results():
    return run_ranks(_equivalence_rank, 2, CASES_WS2)


@pytest.fixture(scope="module")
def ws4_results():
    return run_ranks(_equivalence_rank, 4, CASES_WS4)


@pytest.mark.parametrize("case", CASES_WS2, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_equivalence_world_size_2(ws2_results, case):
    for rank_result in ws2_results:
        assert rank_result[case][0] <= 1e-6


def test_nvme_matches_cpu_bit_for_bit_world_size_2(ws2_results):
    # offload="nvme" at stage 3 keeps parameter shards and optimizer state on disk
    for rank_result in ws2_results:
        cpu, nvme = rank_result[(3, "cpu")][2], rank_result[(3, "nvme")][2]
        assert all((cpu[k] == nvme[k]).all() for k in cpu)


def _update_timing_rank(rank, world_size):
    """Stage 3, offload="nvme" (fp32 parameter shards and optimizer state on NVMe) with the
    plain step, update_timing "backward" and "next_forward", a root larger than the blocks so the LM
    head's state streams in chunks: the weights of each run on this rank."""
    from offload_zero import OffloadEngine
    from offload_zero.memory.tiers import NVMeStore
    NVMeStore.CHUNK_NUMEL = 1024
    out = {}
    for mode in ("plain", "backward", "next_forward"):
        torch.manual_seed(0)
        model = big_root_lm(3, vocab_scale=4)
        kw = {} if mode == "plain" else {"update_timing": mode}
        with tempfile.TemporaryDirectory() as d, OffloadEngine(
                model, stage=3, offload="nvme", path=d, lr=1e-2, weight_decay=0.1, **kw) as eng:
            for x, y in batches(4, seed=1, batch=2 * world_size):
                lo = rank * 2
                eng.backward(lm_loss(eng(x[lo:lo + 2]), y[lo:lo + 2]))
                eng.step()
            out[mode] = {k: v.numpy() for k, v in eng.full_state_dict().items()}
    return out


def test_update_in_backward_and_in_forward_world_size_2_bit_for_bit():
    """Updates inside backward on two ranks (reduce-scatter per flat parameter, the LM head's
    state streamed in chunks, blocks gathered from the state read ahead), or applied before
    each unit's gather in the next forward, give the weights of the plain step exactly, on
    every rank."""
    for result in run_ranks(_update_timing_rank, 2):
        for mode in ("backward", "next_forward"):
            assert all((result["plain"][k] == result[mode][k]).all() for k in result["plain"])


@pytest.mark.parametrize("case", CASES_WS4, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_equivalence_world_size_4(ws4_results, case):
    for rank_result in ws4_results:
        assert rank_result[case][0] <= 1e-6


# -- memory per rank and communication volume (Rajbhandari et al., 2019, sec. 5 and 7) --------

PAPER_FORMULA = {1: lambda psi, n: 4 * psi + 12 * psi / n,
                 2: lambda psi, n: 2 * psi + 14 * psi / n,
                 3: lambda psi, n: 16 * psi / n}


def _memory_and_comm_rank(rank, world_size):
    from offload_zero import OffloadEngine
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = WideNet()
        psi = sum(p.numel() for p in model.parameters())
        eng = OffloadEngine(model, stage=stage, dtype=torch.bfloat16)
        with eng:
            x = torch.randn(4, 640)
            for _ in range(2):
                eng.backward(eng(x).float().pow(2).mean())
                rep = eng.memory_report()["device"]["by_kind"]
                measured = sum(rep[k]["current_bytes"] for k in ("parameters", "gradients", "master_weights", "moments"))
                tensors = [fp.full if stage < 3 else fp.sharded for fp in eng.flat_params]
                tensors += [g for g in eng.grads.buf.values()]
                tensors += [fp.full.grad for fp in eng.flat_params if fp.full.grad is not None]
                for fp in eng.trainable:
                    tensors += list(eng.store._state[fp])
                storage = unique_storage_bytes(tensors)
                eng.step()
            padded = sum(fp.padded_numel for fp in eng.flat_params)
            out[stage] = dict(psi=psi, padded=padded, measured=measured, storage=storage,
                              comm=eng.comm_report()["last_step"], flags=len(eng.trainable))
    return out


def _check_memory(results, world_size):
    for rank_result in results:
        for stage, r in rank_result.items():
            psi, pad = r["psi"], r["padded"]
            exact = PAPER_FORMULA[stage](pad, world_size)  # the formula on the padded layout
            assert r["measured"] == exact, (stage, r)
            assert r["storage"] == exact, (stage, r)
            low = PAPER_FORMULA[stage](psi, world_size)
            assert low <= r["measured"] <= low + 16 * (pad - psi), (stage, r)
            assert (r["measured"] - low) / low < 0.02


def _check_comm(results, world_size):
    for rank_result in results:
        for stage, r in rank_result.items():
            ddp = 2 * (world_size - 1) / world_size * r["psi"] * 2  # all-reduce of bf16 grads
            moved = sum(r["comm"].values())
            ratio = moved / ddp
            # beyond the paper's collectives only the inf/nan flags: 4 bytes per flat parameter
            flags = 4 * r["flags"] * 2 * (world_size - 1) / world_size
            assert r["comm"]["all_reduce"] == round(flags), r["comm"]
            expected = 1.5 if stage == 3 else 1.0
            assert abs(ratio - expected) / expected < 0.02, (stage, r["comm"], ratio)


def test_memory_per_rank_world_size_1():
    import torch.distributed as dist
    assert not dist.is_initialized()
    results = [_memory_and_comm_rank(0, 1)]
    _check_memory(results, 1)


@pytest.fixture(scope="module")
def mem_ws2():
    return run_ranks(_memory_and_comm_rank, 2)


@pytest.fixture(scope="module")
def mem_ws4():
    return run_ranks(_memory_and_comm_rank, 4)


def test_memory_per_rank_world_size_2(mem_ws2):
    _check_memory(mem_ws2, 2)


def test_memory_per_rank_world_size_4(mem_ws4):
    _check_memory(mem_ws4, 4)


def test_communication_volume_world_size_2(mem_ws2):
    _check_comm(mem_ws2, 2)


def test_communication_volume_world_size_4(mem_ws4):
    _check_comm(mem_ws4, 4)


# -- awkward shapes -----------------------------------------------------------------------------

class AwkwardNet(nn.Module):
    """Units with a numel not divisible by N, a numel-1 parameter, a 0-d parameter, and a unit
    smaller than N elements."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)                                   # 42: not divisible by 4
        self.blocks = nn.ModuleList([
            nn.Linear(7, 7, bias=False),                             # 49
            _Scale(torch.tensor(0.7)),                               # 0-d, a unit of 1 element
            _Scale(torch.full((1,), 1.3)),                           # numel 1
            nn.Linear(7, 3),                                         # 24
        ])

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks[:3]:
            x = torch.tanh(b(x))
        return self.blocks[3](x)


class _Scale(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.s = nn.Parameter(value)

    def forward(self, x):
        return x * self.s


def _awkward_rank(rank, world_size):
    from offload_zero import OffloadEngine
    out = {}
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(2 * world_size, 5, generator=g), torch.randn(2 * world_size, 3, generator=g))
            for _ in range(STEPS)]
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = AwkwardNet()
        ref = copy.deepcopy(model)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        with OffloadEngine(model, stage=stage, offload="cpu", lr=1e-2, weight_decay=0.1) as eng:
            for x, y in data:
                lo = 2 * rank
                eng.backward((eng(x[lo:lo + 2]) - y[lo:lo + 2]).pow(2).mean())
                eng.step()
                opt.zero_grad()
                (ref(x) - y).pow(2).mean().backward()
                opt.step()
            sd = eng.full_state_dict()
        assert sd["blocks.1.s"].shape == torch.Size([])
        out[stage] = max((sd[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_awkward_shapes(world_size):
    for rank_result in run_ranks(_awkward_rank, world_size):
        assert all(d <= 1e-6 for d in rank_result.values()), rank_result


# -- a lost rank is an error on the others, not a hang ------------------------------------------

def _failing_rank(rank, world_size, timeout_s):
    import time

    from offload_zero import OffloadEngine
    eng = OffloadEngine(TinyLM(), timeout_s=timeout_s)  # initialises the group from the env
    x, y = batches(1)[0]
    eng.backward(lm_loss(eng(x), y))
    eng.step()
    if rank == 1:
        # raise in the middle of the next step and stay alive (no exit, no destroy): the other
        # rank must not wait for it forever
        try:
            eng(x)
            raise RuntimeError("injected failure on rank 1")
        except RuntimeError as exc:
            time.sleep(timeout_s + 5)
            return ("raised", 0.0, str(exc))
    start = time.monotonic()
    try:
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    except Exception as exc:  # the collective timed out
        return ("error", time.monotonic() - start, type(exc).__name__)
    return ("finished", time.monotonic() - start, "")


def test_lost_rank_raises_within_timeout():
    timeout_s = 5
    rank0, rank1 = run_ranks(_failing_rank, 2, timeout_s, init=False, timeout_s=60)
    assert rank1 == ("raised", 0.0, "injected failure on rank 1")
    outcome, waited_s, _ = rank0
    assert outcome == "error", rank0
    assert waited_s < timeout_s + 10, rank0


def test_engine_initialises_group_from_torchrun_env():
    results = run_ranks(_init_from_env_rank, 2, init=False)
    assert results == [(0, 2), (1, 2)]


def _init_from_env_rank(rank, world_size):
    import torch.distributed as dist

    from offload_zero import OffloadEngine
    assert not dist.is_initialized()
    with OffloadEngine(TinyLM()) as eng:
        assert dist.get_backend() == "gloo"
        return (eng.rank, eng.world_size)


# -- two nodes on one machine under torchrun ----------------------------------------------------

def test_two_torchrun_nodes_end_identical(tmp_path):
    import subprocess
    import sys

    from dist_harness import free_port
    port = free_port()
    job = os.path.join(os.path.dirname(__file__), "multinode_job.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
         "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
         job, str(tmp_path), "3", "nvme"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    sd0 = torch.load(tmp_path / "params_rank0.pt")
    sd1 = torch.load(tmp_path / "params_rank1.pt")
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    torch.manual_seed(0)
    expected = adamw_reference(TinyLM(), batches(3, seed=1, batch=4), wd=0.0)
    assert max((sd0[n] - v).abs().max().item() for n, v in expected.items()) <= 1e-6


# -- a data-parallel group that is not the world -------------------------------------------------

def _subgroup_rank(rank, world_size):
    import torch.distributed as dist

    from offload_zero import OffloadEngine
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = rank // 2
    torch.manual_seed(0)
    model = TinyLM()
    data = batches(3, seed=1 + mine, batch=4)  # each group trains on its own data
    expected = adamw_reference(model, data, wd=0.0)
    with OffloadEngine(model, stage=3, offload="cpu", lr=1e-2, process_group=groups[mine]) as eng:
        assert (eng.world_size, eng.rank) == (2, rank % 2)
        for x, y in data:
            lo = 2 * eng.rank
            eng.backward(lm_loss(eng(x[lo:lo + 2]), y[lo:lo + 2]))
            eng.step()
        sd = eng.full_state_dict()
    return max((sd[n] - v).abs().max().item() for n, v in expected.items())


def test_process_group_selects_the_data_parallel_group():
    diffs = run_ranks(_subgroup_rank, 4)
    assert all(d <= 1e-6 for d in diffs), diffs


def _one_rank_nan_rank(rank, world_size, stage, offload, sib):
    import torch.nn.functional as F
    from offload_zero import OffloadEngine
    torch.manual_seed(0)
    model = TinyLM(n_blocks=3)
    ln = model.blocks[0].ln
    bad = {"on": False}
    ln.forward = lambda x: F.layer_norm(
        x, ln.normalized_shape, BackwardFault.apply(ln.weight, "nan" if bad["on"] else None),
        ln.bias, ln.eps)
    states = []
    with tempfile.TemporaryDirectory() as d, OffloadEngine(
            model, stage=stage, offload=offload, path=d if offload == "nvme" else None,
            lr=1e-2, update_timing="backward" if sib else "auto") as eng:
        for i, (x, y) in enumerate(batches(3, seed=1, batch=2 * world_size)):
            bad["on"] = i == 1 and rank == 0  # the nan lies in rank 0's gradient only
            lo = rank * 2
            eng.backward(lm_loss(eng(x[lo:lo + 2]), y[lo:lo + 2]))
            eng.step()
            states.append({k: v.numpy() for k, v in eng.full_state_dict().items()})
        return eng.skipped_steps, states


@pytest.mark.parametrize("stage,offload,sib", [(2, "cpu", False), (3, "nvme", False),
                                               (3, "nvme", True)])
def test_a_nan_in_one_ranks_gradient_skips_the_same_update_on_every_rank(stage, offload, sib):
    """Each rank sees only its shard of a gradient; an inf/nan in one rank's shard must skip
    that flat parameter's update on every rank, or the ranks' shards of it drift apart (one
    half updated, the other not). Every rank ends with the same weights and the same count."""
    results = run_ranks(_one_rank_nan_rank, 2, stage, offload, sib)
    (skips0, states0), (skips1, states1) = results
    assert skips0 == skips1 == 1
    for s0, s1 in zip(states0, states1):
        assert all((s0[k] == s1[k]).all() for k in s0)
    before, after = states0[0], states0[1]
    block0 = [k for k in before if k.startswith("blocks.0.")]
    assert all((before[k] == after[k]).all() for k in block0)  # that unit's update skipped
    assert any((before[k] != after[k]).any() for k in before if k not in block0)


def _fp16_rank(rank, world_size, stage, offload):
    from offload_zero import OffloadEngine
    torch.manual_seed(0)
    model = TinyLM(n_blocks=3)
    bad = {"on": False}
    model.blocks[1].register_forward_hook(
        lambda mod, args, out: BackwardFault.apply(out, "nan" if bad["on"] else None))
    scales, states = [], []
    with tempfile.TemporaryDirectory() as d, OffloadEngine(
            model, stage=stage, offload=offload, path=d if offload == "nvme" else None, lr=1e-2,
            dtype=torch.float16, initial_loss_scale=2.0 ** 12, loss_scale_window=2) as eng:
        for i, (x, y) in enumerate(batches(6, seed=1, batch=2 * world_size)):
            bad["on"] = i == 3 and rank == 1  # an overflow in rank 1's gradient only
            lo = rank * 2
            eng.backward(lm_loss(eng(x[lo:lo + 2]), y[lo:lo + 2]))
            eng.step()
            scales.append(eng.loss_scaler.scale)
            states.append({k: v.float().numpy() for k, v in eng.full_state_dict().items()})
        return eng.skipped_steps, scales, states


@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (3, "nvme")])
def test_fp16_loss_scale_moves_alike_on_every_rank(stage, offload):
    """An overflow in one rank's gradient skips the whole step on every rank and halves every
    rank's scale; good steps double it alike: the ranks end with the same weights and scale."""
    (skips0, scales0, states0), (skips1, scales1, states1) = run_ranks(_fp16_rank, 2, stage, offload)
    assert skips0 == skips1 >= 1 and scales0 == scales1
    assert scales0[3] == scales0[2] / 2  # the step with rank 1's nan
    assert max(scales0[4:]) > scales0[3]  # grows back after two good steps
    for s0, s1 in zip(states0, states1):
        assert all((s0[k] == s1[k]).all() for k in s0)
    assert all((states0[2][k] == states0[3][k]).all() for k in states0[2])  # nothing moved
