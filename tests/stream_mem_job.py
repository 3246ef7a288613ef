"""Peak host memory (VmHWM) of streaming a checkpoint in and exporting it, as deltas (JSON).

Usage: python tests/stream_mem_job.py CHECKPOINT_DIR SWAP_DIR EXPORT_DIR

The peak counter is reset (``5`` into /proc/self/clear_refs) just before each phase, so each
figure is that phase's own peak above the memory resident when it started.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
import hf_tiny  # noqa: E402

from offload_zero import OffloadEngine  # noqa: E402

BIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=24, num_attention_heads=4,
           num_key_value_heads=4, vocab_size=256, tie_word_embeddings=False)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _peak_delta(start: int) -> int:
    return _status_kib("VmHWM") * 1024 - start


def main():
    ckpt, swap, out = sys.argv[1:4]
    torch.set_num_threads(1)
    # warm up on a tiny model: lazy imports, allocator pools, the aio tuning
    warm = os.path.join(os.path.dirname(out), "warm")
    small = hf_tiny.write_checkpoint(warm + "_ckpt", False)
    os.makedirs(os.path.join(swap, "w"))
    with OffloadEngine(hf_tiny.empty_model(False), offload="nvme", offload_param="nvme",
                       path=os.path.join(swap, "w"), load_from=small) as eng:
        eng.save_pretrained(warm, max_shard_size="20KB")
    model = hf_tiny.empty_model(False, "init_empty_weights", **BIG)
    start = _reset_peak()
    eng = OffloadEngine(model, offload="nvme", offload_param="nvme", path=swap, load_from=ckpt)
    load_peak = _peak_delta(start)
    report = eng.memory_report()  # (the fixed buffers the engine holds, for the record)
    pools = report["host"]["current_bytes"] + report["device"]["current_bytes"]
    start = _reset_peak()
    eng.save_pretrained(out, dtype=torch.bfloat16, max_shard_size="8MB")
    export_peak = _peak_delta(start)
    unit = max(4 * sum(fp.padded_numel for fp in u.flat_params) for u in eng.units)
    model_bytes = 4 * sum(fp.numel for fp in eng.flat_params)
    eng.close()
    print(json.dumps(dict(load_peak=load_peak, export_peak=export_peak, pools=pools,
                          unit_fp32_bytes=unit, model_fp32_bytes=model_bytes)))


if __name__ == "__main__":
    main()
