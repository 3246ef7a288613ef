"""max_host_bytes bounds the host tier of any placement (see plan.fit_host_budget): the
optimizer pipeline streams the state in smaller chunks to fit, with the same weights bit for
bit; the measured host peak stays within the budget; a budget nothing fits raises first."""
import copy

import pytest
import torch

from offload_zero import OffloadEngine
from models import TinyLM, batches, lm_loss

WIDE = dict(n_blocks=3)


def _train(model, tmp_path, name, **kw):
    folder = tmp_path / name
    folder.mkdir()
    with OffloadEngine(model, offload="nvme", path=str(folder), lr=1e-2, weight_decay=0.1,
                       tail_state_in_host=False, **kw) as eng:
        for x, y in batches(3):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        eng.apply_pending_updates()
        return eng.full_state_dict(), eng.memory_report()


@pytest.mark.parametrize("timing", ["step", "next_forward"])
def test_a_tight_budget_shrinks_the_pipeline_and_keeps_the_numbers(timing, tmp_path):
    torch.manual_seed(0)
    model = TinyLM(**WIDE)
    ref, rep = _train(copy.deepcopy(model), tmp_path, "ref", update_timing=timing)
    full_pipeline = rep["pools"]["optimizer_pipeline"]["capacity_bytes"]
    host_need = rep["host"]["peak_bytes"]
    budget = host_need - full_pipeline // 2  # room for less than the whole pipeline
    got, rep = _train(copy.deepcopy(model), tmp_path, "tight", update_timing=timing,
                      max_host_bytes=budget)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    hb = rep["host_budget"]
    assert hb["max_host_bytes"] == budget
    assert hb["planned_bytes"] <= budget and hb["peak_bytes"] <= budget
    assert hb["peak_bytes"] == hb["planned_bytes"] == rep["host"]["peak_bytes"]
    assert rep["pools"]["optimizer_pipeline"]["capacity_bytes"] < full_pipeline
    assert hb["pipeline_chunk_numel"] % 1024 == 0


def test_a_budget_that_holds_everything_changes_nothing(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(**WIDE)
    _, rep = _train(copy.deepcopy(model), tmp_path, "ref")
    _, got = _train(copy.deepcopy(model), tmp_path, "roomy", max_host_bytes=1 << 40)
    assert got["pools"] == rep["pools"] and "host_budget" not in rep
    assert got["host_budget"]["peak_bytes"] == rep["host"]["peak_bytes"]


def test_a_budget_nothing_fits_raises_before_allocating(tmp_path):
    with pytest.raises(ValueError, match=r"max_host_bytes=1000 is short by \d+ bytes: this "
                                         r"placement needs \d+ bytes of host memory.*"
                                         r"raise max_host_bytes"):
        OffloadEngine(TinyLM(**WIDE), offload="cpu", max_host_bytes=1000)
    with pytest.raises(ValueError, match=r"max_host_bytes=1000 is short"):
        OffloadEngine(TinyLM(**WIDE), offload="nvme", path=str(tmp_path), max_host_bytes=1000)
    assert list(tmp_path.iterdir()) == []  # no swap files, no rank folder
