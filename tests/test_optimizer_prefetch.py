"""optimizer_prefetch: how many whole optimizer states the NVMe store reads ahead for updates in
backward or in the next forward. Any depth gives the same weights and moves the same bytes;
too few for the update timing, or a depth with no ring to size, is refused or warned about."""
import copy

import pytest
import torch

from models import TinyLM, batches, lm_loss
from offload_zero import OffloadEngine


def _run(model, folder, **kw):
    folder.mkdir()
    with OffloadEngine(copy.deepcopy(model), offload="nvme", path=str(folder), lr=1e-2,
                       weight_decay=0.1, **kw) as eng:
        marks = []
        for x, y in batches(4):
            loss = lm_loss(eng(x), y)
            eng.backward(loss)
            eng.step()
            eng.swapper.wait_all()
            nvme = eng.memory_report()["nvme"]
            marks.append((nvme["state_read_bytes"], nvme["state_written_bytes"]))
        eng.apply_pending_updates()
        ring = eng.memory_report()["pools"]["optimizer_prefetch"]
        return (eng.full_state_dict(), ring, [b - a for a, b in zip(marks[-2], marks[-1])],
                eng.memory_plan.pool("optimizer_prefetch").count)


@pytest.mark.parametrize("dtype,timing,least", [(torch.bfloat16, "next_forward", 3),
                                                (torch.bfloat16, "backward", 2),
                                                (torch.float32, "backward", 3)])
def test_a_deeper_ring_gives_the_same_weights_and_bytes(dtype, timing, least, tmp_path):
    """Six blocks: the default ring (the least the timing needs), five buffers, and more than
    the blocks (capped at the six whose state streams): same weights bit for bit, same state
    bytes per step, and the pool has the buffers asked for."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=6)
    kw = dict(dtype=dtype, update_timing=timing, tail_state_in_host=False)
    ref, ring, moved, _ = _run(model, tmp_path / "default", **kw)
    assert ring["buffers"] == least
    for depth, buffers in ((5, 5), (9, 6)):
        got, ring, moved_n, planned = _run(model, tmp_path / str(depth), optimizer_prefetch=depth,
                                           **kw)
        assert ring["buffers"] == planned == buffers
        assert ring["capacity_bytes"] == buffers * ring["buffer_bytes"]
        assert moved_n == moved
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("value,match", [
    (1, "optimizer_prefetch=1 is not valid; it must be an int >= 2"),
    (True, "optimizer_prefetch=True is not valid"), ("4", "optimizer_prefetch='4' is not valid"),
    (2, "optimizer_prefetch=2 is too few for update_timing='next_forward' here: it needs at "
        "least 3")])
def test_too_few_or_not_a_count_is_refused_before_anything_is_written(value, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(n_blocks=2), offload="nvme", path=str(tmp_path), dtype=torch.bfloat16,
                      optimizer_prefetch=value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw", [dict(offload="cpu"), dict(offload="nvme", update_timing="step")])
def test_a_depth_without_a_ring_warns_at_the_users_line(kw, tmp_path):
    with pytest.warns(UserWarning, match="optimizer_prefetch=4 has no effect") as got:
        with OffloadEngine(TinyLM(n_blocks=2), optimizer_prefetch=4, dtype=torch.bfloat16,
                           **({"path": str(tmp_path)} if kw["offload"] == "nvme" else {}), **kw):
            pass
    assert [w.filename for w in got if "optimizer_prefetch" in str(w.message)] == [__file__]


def test_auto_without_nvme_state_says_the_host_cache_is_unused():
    with pytest.warns(UserWarning, match="host_cache_bytes=1000000 is not used: offload='auto' "
                                         "put the optimizer state on 'none'") as got:
        with OffloadEngine(TinyLM(n_blocks=2), offload="auto", host_cache_bytes=10 ** 6):
            pass
    assert [w.filename for w in got if "host_cache_bytes" in str(w.message)] == [__file__]


def test_the_estimate_counts_the_ring_asked_for(tmp_path):
    """placement_bytes (what offload='auto' fits) counts optimizer_prefetch's buffers as the
    engine allocates them: the engine's host buffers equal the estimate's, five block states
    instead of three."""
    from offload_zero.estimator import placement_bytes
    torch.manual_seed(0)
    model = TinyLM(n_blocks=6)
    kw = dict(dtype=torch.bfloat16, accelerator=False, update_timing="next_forward",
              tail_state_in_host=False)
    three = placement_bytes(model, 3, "nvme", "nvme", **kw)
    five = placement_bytes(model, 3, "nvme", "nvme", optimizer_prefetch=5, **kw)
    block = three.plan.pool("optimizer_prefetch").buffer_bytes
    assert five.extras["host"]["buffers"] - three.extras["host"]["buffers"] == 2 * block
    with OffloadEngine(copy.deepcopy(model), offload="nvme", path=str(tmp_path),
                       dtype=torch.bfloat16, tail_state_in_host=False,
                       optimizer_prefetch=5) as eng:
        assert eng.memory_report()["host"]["by_kind"]["buffers"]["peak_bytes"] == (
            five.model_states["host"].get("buffers", 0) + five.extras["host"]["buffers"])
