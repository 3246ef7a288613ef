"""ZeRO stages 1-3 across gloo ranks: equivalence with single-process AdamW on the global batch,
awkward shapes, memory per rank from the paper's formulas, communication volume."""
import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks
from models import TinyLM, batches, lm_loss

STEPS = 5
CASES_WS2 = [(s, o) for s in (1, 2, 3) for o in ("none", "cpu", "nvme")]
CASES_WS4 = [(3, "none"), (3, "nvme")]


def _reference(model, global_batches, lr=1e-2, wd=0.1):
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd, foreach=False)
    for x, y in global_batches:
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in ref.named_parameters()}


def _equivalence_rank(rank, world_size, cases):
    from offload_zero import OffloadEngine
    out = {}
    for stage, offload in cases:
        torch.manual_seed(0)
        model = TinyLM()
        global_batches = batches(STEPS, seed=1, batch=2 * world_size)
        expected = _reference(model, global_batches)
        with tempfile.TemporaryDirectory() as d:
            eng = OffloadEngine(model, stage=stage, offload=offload, path=d, lr=1e-2, weight_decay=0.1)
            with eng:
                for x, y in global_batches:
                    lo = rank * 2
                    eng.backward(lm_loss(eng(x[lo:lo + 2]), y[lo:lo + 2]))
                    eng.step()
                sd = eng.full_state_dict()
                comm = eng.comm_report()["last_step"]
        diff = max((sd[n] - v).abs().max().item() for n, v in expected.items())
        out[(stage, offload)] = (diff, comm)
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


@pytest.mark.parametrize("case", CASES_WS4, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_equivalence_world_size_4(ws4_results, case):
    for rank_result in ws4_results:
        assert rank_result[case][0] <= 1e-6
