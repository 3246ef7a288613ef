"""The job that tests/test_multinode.py runs on two nodes under torchrun, one rank per node.

Usage: torchrun ... tests/two_node_job.py MODE OUT_DIR SWAP_DIR [STALLED_RANK]

``cases``: for each ZeRO stage (1, 2, 3) and offload ("cpu", "nvme", swapping under SWAP_DIR),
train TinyLM ``STEPS`` steps, each rank on its half of the global batch; rank r writes
OUT_DIR/state_rank<r>.pt, ``{(stage, offload): full_state_dict()}``.

``stall``: stage 3 with offload "nvme": one step, then in the second STALLED_RANK sleeps after
its forward while the other enters its backward, whose collectives wait for it. Each rank writes
OUT_DIR/in_step_rank<r> (its pid) when it got there, so that the test can kill the stalled
rank's node then; a rank whose step raises writes the error and the time it was caught to
OUT_DIR/error_rank<r> before raising it on.
"""
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
from models import TinyLM, batches, lm_loss  # noqa: E402

from offload_zero import OffloadEngine  # noqa: E402

STEPS = 5
CASES = [(s, o) for s in (1, 2, 3) for o in ("cpu", "nvme")]
LR, WEIGHT_DECAY = 1e-2, 0.1


def _engine(stage, offload, swap_dir, **kwargs):
    torch.manual_seed(0)
    return OffloadEngine(TinyLM(), stage=stage, offload=offload, lr=LR, weight_decay=WEIGHT_DECAY,
                         path=swap_dir if offload == "nvme" else None, **kwargs)


def _train_step(eng, x, y):
    lo = 2 * eng.rank
    eng.backward(lm_loss(eng(x[lo:lo + 2]), y[lo:lo + 2]))
    eng.step()


def run_cases(out_dir, swap_dir):
    states = {}
    for stage, offload in CASES:
        with _engine(stage, offload, swap_dir, timeout_s=60) as eng:
            for x, y in batches(STEPS, seed=1, batch=2 * eng.world_size):
                _train_step(eng, x, y)
            states[(stage, offload)] = eng.full_state_dict()
    torch.save(states, os.path.join(out_dir, f"state_rank{eng.rank}.pt"))


def _mark(out_dir, name, rank, text):
    path = os.path.join(out_dir, f"{name}_rank{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # the test sees the whole file or none


def run_stall(out_dir, swap_dir, stalled_rank):
    with _engine(3, "nvme", swap_dir) as eng:  # the default timeout_s: 300 s
        (x, y), (x2, y2) = batches(2, seed=1, batch=2 * eng.world_size)
        _train_step(eng, x, y)
        lo = 2 * eng.rank
        try:
            loss = lm_loss(eng(x2[lo:lo + 2]), y2[lo:lo + 2])
            _mark(out_dir, "in_step", eng.rank, str(os.getpid()))
            if eng.rank == int(stalled_rank):
                time.sleep(600)  # killed here
            eng.backward(loss)
            eng.step()
        except Exception as exc:
            _mark(out_dir, "error", eng.rank,
                  f"{time.time()}\n{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise


def main():
    mode, *args = sys.argv[1:]
    torch.set_num_threads(1)
    {"cases": run_cases, "stall": run_stall}[mode](*args)


if __name__ == "__main__":
    main()
