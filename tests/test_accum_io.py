"""Gradient accumulation amortises the optimizer state's NVMe traffic: with
``gradient_accumulation_steps=N`` the state crosses the disk once per optimizer step, not once
per micro-batch (the micro-batches between two updates only add into the gradient shards)."""
import copy

import pytest
import torch

from offload_zero import OffloadEngine
from models import TinyLM, batches, lm_loss

UPDATES = 2


def _state_moved(eng):
    nvme = eng.memory_report()["nvme"]
    return nvme["state_read_bytes"], nvme["state_written_bytes"]


@pytest.mark.parametrize("stage,kw", [(2, {}), (3, {}), (3, {"offload_param": "none"})])
@pytest.mark.parametrize("n", [1, 3])
def test_state_crosses_the_disk_once_per_optimizer_step(stage, kw, n, tmp_path,
                                                        torch_single_thread):
    """Over ``UPDATES`` optimizer steps of ``n`` micro-batches each, the optimizer-state bytes
    read and written through NVMe are ``UPDATES`` x the state bytes on NVMe (12 per shard
    element, the store's own formula), whatever ``n``: checked at the end of every window, so
    the micro-batches inside one add nothing (the state a window reads ahead in its first
    backward is the state its update uses)."""
    torch.manual_seed(0)
    model = TinyLM()
    with OffloadEngine(copy.deepcopy(model), stage=stage, offload="nvme", path=str(tmp_path),
                       lr=1e-2, gradient_accumulation_steps=n, tail_state_in_host=False,
                       **kw) as eng:
        per_step = eng.memory_report()["host_cache"]["nvme_state_bytes"]
        assert per_step == 12 * sum(fp.shard_numel for fp in eng.trainable) > 0
        start = _state_moved(eng)
        for i, (x, y) in enumerate(batches(UPDATES * n)):
            eng.backward(lm_loss(eng(x), y))
            boundary = eng.is_gradient_accumulation_boundary()
            eng.step()
            if boundary:
                eng.apply_pending_updates()
                eng.store.drain()
                done = (i + 1) // n
                moved = tuple(b - a for a, b in zip(start, _state_moved(eng)))
                assert moved == (done * per_step, done * per_step), (i, moved, per_step)
        read, written = (b - a for a, b in zip(start, _state_moved(eng)))
        assert (read, written) == (UPDATES * per_step, UPDATES * per_step)
