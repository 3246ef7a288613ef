"""A job for the multi-node test: train TinyLM a few steps under torchrun and save the params.

Usage: torchrun ... tests/multinode_job.py OUT_DIR [STAGE] [OFFLOAD]
Each rank trains on its slice of the global batch; rank r writes OUT_DIR/params_rank<r>.pt.
"""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
from models import TinyLM, batches, lm_loss  # noqa: E402

from offload_zero import OffloadEngine  # noqa: E402


def main():
    out_dir = sys.argv[1]
    stage = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    offload = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    torch.manual_seed(0)
    model = TinyLM()
    with tempfile.TemporaryDirectory() as swap:
        with OffloadEngine(model, stage=stage, offload=offload, lr=1e-2, timeout_s=60,
                           path=swap if offload == "nvme" else None) as eng:
            n = eng.world_size
            for x, y in batches(3, seed=1, batch=2 * n):
                lo = 2 * eng.rank
                eng.backward(lm_loss(eng(x[lo:lo + 2]), y[lo:lo + 2]))
                eng.step()
            torch.save(eng.full_state_dict(), os.path.join(out_dir, f"params_rank{eng.rank}.pt"))


if __name__ == "__main__":
    main()
