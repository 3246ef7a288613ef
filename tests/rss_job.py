"""Train a small model for many steps with NVMe offload; print peak RSS at two points (JSON).

Usage: python tests/rss_job.py SWAP_DIR STEPS CHECKPOINT_STEP
"""
import json
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
from models import TinyLM, batches, lm_loss  # noqa: E402

from offload_zero import OffloadEngine  # noqa: E402


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main():
    path, steps, mark = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = {}
    with OffloadEngine(TinyLM(n_blocks=8), offload="nvme", path=path, lr=1e-3) as eng:
        data = batches(4, batch=8, seq=32)
        for step in range(1, steps + 1):
            x, y = data[step % len(data)]
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            if step == mark:
                out["rss_at_mark"] = peak_rss_bytes()
                out["pools_at_mark"] = eng.memory_report()["pools"]
        out["rss_at_end"] = peak_rss_bytes()
        out["pools_at_end"] = eng.memory_report()["pools"]
        out["host_peak"] = eng.memory_report()["host"]["peak_bytes"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
