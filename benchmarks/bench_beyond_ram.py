"""Fine-tune a Llama whose fp32 weights exceed a hard memory limit: write, load, train, export.

Everything a run does with the model happens inside a memory cgroup (v1,
``/sys/fs/cgroup/memory/``; needs root) whose ``memory.limit_in_bytes`` is ``--limit``. Going
over it makes the kernel kill the run (the OOM killer of the cgroup), and the script then fails
with the cgroup's own counters; it never passes quietly. Inside the cgroup, in one child
process:

1. **write**: a Llama is built on the meta device and written as a sharded bf16 Hugging Face
   checkpoint unit by unit (embeddings, each decoder layer, final norm, head): each unit is
   materialised, initialised by the model's own ``_init_weights`` (seeded per unit), cast to
   bf16, written as its own ``model-0000k-of-0000N.safetensors`` shard, fsynced, dropped from the
   page cache and put back on meta, so the process never holds more than one unit;
2. **load**: the meta model is wrapped by ``OffloadEngine(..., load_from=DIR)`` (stage 3,
   parameters and optimizer state on NVMe files, one unit streamed at a time);
3. **step** x ``--steps``: forward, backward and update on a fixed random batch;
4. **export**: ``engine.save_pretrained`` (bf16, sharded), then the engine's forward on a fixed
   batch, whose logits are written for the check.

Per phase the child reports its wall time and its peak RSS (VmHWM, reset at the phase's start
through ``/proc/self/clear_refs``), and the cgroup's peak usage (``memory.max_usage_in_bytes``,
page cache included, reset at each phase); the step phase also reports the NVMe bytes read and
written and the time of each step. Outside the cgroup the parent then loads the exported folder
with ``transformers``' ``from_pretrained`` (bf16) and checks that its logits on the same batch
equal the engine's (bf16 tolerance: ``|a - b| <= 2^-7 * max|a| + 2^-7 * |a|``, element by
element). Without a cgroup v1 memory controller the script prints why and exits 0 (skipped).

The child runs with glibc's malloc at a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``,
128 KiB, its default starting value): by default glibc raises the threshold up to 32 MiB after
each free of a large block, so this model's 6-13 MB unit-sized blocks would then come from the
heap, where freed ones stay resident when fragmented (RSS creeping up by a unit per unit with
no live tensor behind it). Units of wider models are above 32 MiB and always mmapped.

The default model, 0.41B parameters in 126 narrow layers (hidden 512, MLP 1408, vocab 8192),
has 1.54 GiB of fp32 weights, 1.54x the default 1 GiB limit; narrow layers keep a unit, and so
the engine's per-unit host buffers, small beside the limit.

Usage: python benchmarks/bench_beyond_ram.py [--limit 1GiB] [--layers 126 --hidden 512
       --intermediate 1408 --vocab 8192 --heads 8] [--steps 3] [--path /tmp] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CGROUP_ROOT = "/sys/fs/cgroup/memory"
SEQ, BATCH = 32, 1


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# -- the child: every phase, inside the cgroup ---------------------------------------------------
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Phase:
    """Times a phase and resets, then reads, the peak RSS (VmHWM) and the cgroup's peak."""

    def __init__(self, name: str, cgroup: str, report: dict):
        self.name, self.cgroup, self.report = name, cgroup, report

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open(os.path.join(self.cgroup, "memory.max_usage_in_bytes"), "w") as f:
            f.write("0")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        with open(os.path.join(self.cgroup, "memory.max_usage_in_bytes")) as f:
            cg_peak = int(f.read())
        self.report[self.name] = {"s": time.perf_counter() - self.t0,
                                  "peak_rss": _status_bytes("VmHWM"), "cgroup_peak": cg_peak}
        print(f"[child] {self.name}: {self.report[self.name]}", flush=True)
        return False


def _config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       max_position_embeddings=max(128, SEQ), tie_word_embeddings=False,
                       use_cache=False, dtype="bfloat16")


def _meta_model(args):
    import torch
    from transformers import LlamaForCausalLM
    from accelerate import init_empty_weights
    with init_empty_weights():  # (buffers real: rotary inv_freq)
        return LlamaForCausalLM(_config(args))


def write_checkpoint(model, folder: str) -> int:
    """Write ``model`` (parameters on meta) as a sharded bf16 checkpoint, one unit per shard,
    never more than one unit materialised. Returns the bytes of weights written."""
    import torch
    import safetensors.torch
    save_file = safetensors.torch.save_file
    units = [("model.embed_tokens", model.model.embed_tokens)]
    units += [(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)]
    units += [("model.norm", model.model.norm), ("lm_head", model.lm_head)]
    os.makedirs(folder)
    model.config.save_pretrained(folder)
    weight_map, total = {}, 0
    for k, (prefix, unit) in enumerate(units):
        unit.to_empty(device="cpu")
        torch.manual_seed(1000 + k)
        with torch.no_grad():
            for sub in unit.modules():
                model._init_weights(sub)
        tensors = {f"{prefix}.{n}": p.detach().to(torch.bfloat16).contiguous()
                   for n, p in unit.named_parameters()}
        name = f"model-{k + 1:05d}-of-{len(units):05d}.safetensors"
        path = os.path.join(folder, name)
        save_file(tensors, path, metadata={"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: name for n in tensors})
        del tensors
        unit.to("meta")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def child(args) -> int:
    import torch
    from offload_zero import OffloadEngine
    torch.manual_seed(0)
    report = {"pid": os.getpid()}
    ckpt, swap, export = (os.path.join(args.path, d) for d in ("ckpt", "swap", "export"))
    g = torch.Generator().manual_seed(0)
    train_ids = torch.randint(0, args.vocab, (BATCH, SEQ), generator=g)
    check_ids = torch.randint(0, args.vocab, (2, 16), generator=g)
    with Phase("write", args.cgroup, report):
        report["checkpoint_bytes"] = write_checkpoint(_meta_model(args), ckpt)
    os.makedirs(swap)
    with Phase("load", args.cgroup, report):
        eng = OffloadEngine(_meta_model(args), stage=3, offload="nvme", offload_param="nvme",
                            path=swap, load_from=ckpt, dtype=torch.bfloat16,
                            grad_dtype=torch.bfloat16, update_timing=args.update_timing,
                            lr=1e-5)
    if args.drop_checkpoint:  # (its values are all in the engine's files now: disk for the export)
        shutil.rmtree(ckpt)
    with eng:
        report["steps"] = []
        with Phase("step", args.cgroup, report):
            for _ in range(args.steps):
                t = time.perf_counter()
                out = eng(input_ids=train_ids, labels=train_ids)
                eng.backward(out.loss)
                eng.step()
                report["steps"].append({"s": time.perf_counter() - t,
                                        "loss": float(out.loss.float().item())})
                print(f"[child] step: {report['steps'][-1]}", flush=True)
                del out
        rep = eng.memory_report()
        report["nvme"] = {"read_bytes": rep["nvme"]["read_bytes"],
                          "written_bytes": rep["nvme"]["written_bytes"],
                          "file_bytes": rep["nvme"]["current_bytes"]}
        with Phase("export", args.cgroup, report):
            info = eng.save_pretrained(export, dtype=torch.bfloat16, max_shard_size="256MB")
        report["export"]["info"] = {k: info[k] for k in ("weights_bytes", "tensors", "shards")}
        with torch.no_grad():
            logits = eng(input_ids=check_ids).logits
        torch.save({"ids": check_ids, "logits": logits.detach().clone()},
                   os.path.join(args.path, "engine_logits.pt"))
    with open(os.path.join(args.path, "report.json"), "w") as f:
        json.dump(report, f)
    return 0


# -- the parent: the cgroup, the check, the table ------------------------------------------------
def cgroup_missing() -> str:
    """Why no memory cgroup can be made here ("" when one can)."""
    if not os.path.isfile(os.path.join(CGROUP_ROOT, "memory.limit_in_bytes")):
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (run as root)"
    return ""


def make_cgroup(limit: int) -> str:
    path = os.path.join(CGROUP_ROOT, f"oz-beyond-ram-{os.getpid()}")
    os.mkdir(path)
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        if os.path.exists(os.path.join(path, name)):
            with open(os.path.join(path, name), "w") as f:
                f.write(str(limit))
    return path


def cgroup_counters(path: str) -> dict:
    out = {}
    with open(os.path.join(path, "memory.failcnt")) as f:
        out["failcnt"] = int(f.read())
    with open(os.path.join(path, "memory.oom_control")) as f:
        for line in f:
            key, value = line.split()
            out[key] = int(value)
    return out


def check_export(folder: str, saved: str) -> dict:
    """Logits of ``from_pretrained(folder)`` against the engine's (bf16 tolerance)."""
    import torch
    from transformers import AutoModelForCausalLM
    ref = torch.load(saved)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        got = model(input_ids=ref["ids"]).logits.float()
    want = ref["logits"].float()
    tol = 2 ** -7 * want.abs().max() + 2 ** -7 * want.abs()
    err = (got - want).abs()
    return {"max_abs_err": float(err.max()), "max_abs_logit": float(want.abs().max()),
            "ok": bool((err <= tol).all())}


def parse_args(argv):
    from offload_zero.fit import parse_bytes
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default="1GiB", help="the cgroup's memory limit (default 1GiB)")
    ap.add_argument("--layers", type=int, default=126)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--update-timing", default="backward",
                    choices=("step", "backward", "next_forward", "auto"),
                    help="the engine's update_timing (default backward: one gradient shard at a "
                         "time in host memory)")
    ap.add_argument("--drop-checkpoint", action="store_true",
                    help="delete the written checkpoint once loaded (frees its disk for the export)")
    ap.add_argument("--path", default="/tmp", help="folder for the run's files (default /tmp)")
    ap.add_argument("--out", default=None, help="also append the report to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.limit_bytes = parse_bytes(args.limit, "--limit")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child(args)
    why = cgroup_missing()
    if why:
        print(f"bench_beyond_ram: skipped: {why}; the limit cannot be enforced here")
        return 0
    import torch
    with torch.device("meta"):
        from transformers import LlamaForCausalLM
        psi = sum(p.numel() for p in LlamaForCausalLM(_config(args)).parameters())
    head = (f"# bench_beyond_ram: {psi / 1e9:.3f}B parameters ({args.layers} layers, hidden "
            f"{args.hidden}, mlp {args.intermediate}, vocab {args.vocab}); fp32 weights "
            f"{gib(4 * psi)} = {4 * psi / args.limit_bytes:.2f}x the cgroup limit "
            f"{gib(args.limit_bytes)}; bf16 compute, stage 3, offload nvme+nvme, "
            f"update_timing={args.update_timing}; cpus {os.cpu_count()}, torch "
            f"{torch.__version__}")
    print(head, flush=True)
    run_dir = tempfile.mkdtemp(prefix="oz-beyond-", dir=args.path)
    cgroup = make_cgroup(args.limit_bytes)
    try:
        user_argv = sys.argv[1:] if argv is None else list(argv)
        cmd = ([sys.executable, os.path.abspath(__file__)] + _without(user_argv, "--out")
               + ["--child", "--cgroup", cgroup, "--path", run_dir])

        def join_cgroup():
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        t0 = time.perf_counter()
        # a fixed mmap threshold (see the module note on glibc's malloc)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 << 10))
        rc = subprocess.run(cmd, preexec_fn=join_cgroup, env=env).returncode
        wall = time.perf_counter() - t0
        counters = cgroup_counters(cgroup)
        if rc != 0:
            killed = rc == -9 or counters.get("oom_kill", 0) > 0
            print(f"# FAILED: the run exited with {rc}"
                  + (" (killed by the memory cgroup: over the limit)" if killed else "")
                  + f"; cgroup counters {counters}", flush=True)
            return 1
        with open(os.path.join(run_dir, "report.json")) as f:
            report = json.load(f)
        check = check_export(os.path.join(run_dir, "export"),
                             os.path.join(run_dir, "engine_logits.pt"))
    finally:
        os.rmdir(cgroup) if os.path.isdir(cgroup) else None
        shutil.rmtree(run_dir, ignore_errors=True)
    lines = [head] + format_report(report, check, counters, args, psi, wall)
    print("\n".join(lines[1:]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if check["ok"] and counters.get("oom_kill", 0) == 0 else 1


def _without(cmd, flag):
    out, skip = [], False
    for a in cmd:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def format_report(report, check, counters, args, psi, wall):
    steps = [s["s"] for s in report["steps"]]
    lines = [f"phase   time_s   peak_RSS   cgroup_peak (limit {gib(args.limit_bytes)})"]
    for name in ("write", "load", "step", "export"):
        r = report[name]
        lines.append(f"{name:<7}{r['s']:>7.1f}   {gib(r['peak_rss']):>9}   {gib(r['cgroup_peak'])}")
    nv = report["nvme"]
    lines += [f"steps: {', '.join(f'{s:.1f}' for s in steps)} s (median "
              f"{sorted(steps)[len(steps) // 2]:.1f} s); losses "
              f"{', '.join(format(s['loss'], '.4f') for s in report['steps'])}",
              f"NVMe: files {gib(nv['file_bytes'])}; read {gib(nv['read_bytes'])}, written "
              f"{gib(nv['written_bytes'])} over {len(steps)} steps",
              f"checkpoint written {gib(report['checkpoint_bytes'])} bf16; export "
              f"{report['export']['info']}",
              f"export check: from_pretrained logits vs the engine's: max |err| "
              f"{check['max_abs_err']:.3g} (max |logit| {check['max_abs_logit']:.3g}) -> "
              f"{'equal within bf16 tolerance' if check['ok'] else 'MISMATCH'}",
              f"cgroup: {counters}; wall {wall:.0f} s"]
    return lines


if __name__ == "__main__":
    sys.exit(main())
