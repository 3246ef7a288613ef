"""Training-step time and peak memory of a Llama-style model: offload-zero beside plain torch.

One run prints one table. Every configuration runs in its own fresh Python subprocess, so its
peak resident set size is its own; with ``--rounds`` > 1 the configurations are run in turn
(A B C ... A B C ...) so background load on a shared machine spreads over all of them.

Model: ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, untied
embeddings), default hidden 1024, intermediate 2048, 8 layers, 16 heads, vocab 32000:
149.4M parameters, 598 MB in fp32. Input: one fixed batch of random token ids
(``--batch`` x ``--seq``, default 4 x 256), labels = inputs. Same ``--dtype`` in every row.

Rows (a step = ``--grad-accum`` N micro-batches of forward + backward, then one optimizer step,
AdamW lr 1e-4, wd 0.01; N = 1 by default):
- ``torch``: the plain module, ``torch.optim.AdamW(fused=True)`` on its parameters. The floor:
  at fp32 it keeps 16 B/param (weights, grads, two moments); at bf16 it trains purely in bf16
  (no fp32 master copy), so it is a floor in time and memory, not the same arithmetic.
- ``torch+io``: the ``torch`` row while a background thread reads and writes back 12 bytes per
  parameter each step (Adam's fp32 master weights and two moments) through the engine's NVMe
  store, chunk by chunk as its plain step's update does (:class:`_StateTraffic`); the step ends when both are done. The floor of any design that
  keeps the optimizer state on this disk: the same compute, the same bytes, perfect overlap.
- ``ours-cpu``: ``OffloadEngine(model, stage=3, offload="cpu")``.
- ``ours-nvme``: ``OffloadEngine(model, stage=3, offload="nvme", path=--path)``: at stage 3
  this puts both the optimizer state and the parameter shards on NVMe, and the engine's
  default there is ``update_timing="next_forward"`` (the step decides the update, each unit gets it just
  before its next gather, the state's I/O overlaps the next forward).
- ``ours-nvme-opt``: the same with ``offload_param="none"``: optimizer state on NVMe, parameter
  shards in RAM (the device is the CPU here).
- ``ours-nvme+sib``, ``ours-nvme-opt+sib``: the two above with ``update_timing="backward"`` (each
  unit updated as soon as its gradient is final; the main job's default; no clipping, no
  accumulation). Same losses.
- ``ours-nvme+plain``, ``ours-nvme-opt+plain``: the same with ``update_timing="step"``: the
  whole update in ``step()``, its state I/O between backward and the next forward. Same
  losses.
- ``ours-nvme+cache``: ``ours-nvme`` with ``host_cache_bytes`` = ``--host-cache-frac`` (default
  0.5) of the optimizer state's bytes (12, or 8 with bf16 moments, per parameter): those flat
  parameters' state stays in RAM (no I/O), the rest on NVMe. Same losses.
- ``ours-nvme+int8m``: ``ours-nvme`` with ``moment_dtype="int8"`` (6.03 bytes of state per
  parameter); suffixes combine in any order: ``ours-nvme+cache+bf16m`` is both,
  ``ours-nvme+cache+sib`` the cache with ``update_timing="backward"``.
- ``ours-nvme+ra6``: ``ours-nvme`` with ``optimizer_prefetch=6`` (six whole states read
  ahead for the updates instead of three; any ``raN``, combined with the other suffixes).
- ``ours-nvme+bf16m``: ``ours-nvme`` with ``moment_dtype="bf16"`` (8 bytes of state per
  parameter instead of 12; close to, not equal to, fp32 moments' losses).
- ``ours-nvme+bf16w``: ``ours-nvme`` with ``master_dtype="bf16"`` (bf16 master weights, 2 bytes
  of state per parameter less; ``--dtype bf16`` only): with the parameter shards on NVMe they
  are the masters' bytes, so ``ours-nvme+bf16m+bf16w`` moves 6 bytes per parameter each way.
- ``--moment-dtype bf16`` gives every other ``ours-*`` row bf16 moments too.
- ``ds-cpu``, ``ds-nvme-opt``, ``ds-nvme-opt+param``: DeepSpeed ZeRO-3 (only when
  ``import deepspeed`` works), with optimizer and parameters offloaded to the CPU; optimizer to
  NVMe (parameters on the CPU); both to NVMe. Model built under ``deepspeed.zero.Init``;
  ``DS_ACCELERATOR=cpu`` and a one-rank gloo group when there is no GPU.

``--device cuda`` runs every row on the GPU (the model, its inputs and gathered units on the
device; ours keeps shards and optimizer state on the host or NVMe as its row says); each step
ends with ``torch.cuda.synchronize()``, and a ``dev GB`` column gives
``torch.cuda.max_memory_allocated`` over the steps, in GB (the ``ds-*`` rows are left out:
they are set up for the CPU). Without it (default ``cpu``) the
CPU plays the accelerator and the memory columns are the whole machine's.

Columns:
- ``tok/s``: tokens per second of the median step, N x ``--batch`` x ``--seq`` / ``step s``.
  With N > 1 the optimizer state crosses the disk once per step, not per micro-batch, so the
  state I/O is spread over N micro-batches' compute.
- ``step s``: median wall seconds of steps ``--skip``+1 .. ``--steps`` (default 3..10), pooled
  over rounds. ``min``/``max``: the spread of those steps.
- ``vs torch``: overhead of the median step over the ``torch`` row's, in percent.
- ``peak RSS GB``: ``getrusage(RUSAGE_SELF).ru_maxrss`` at the end of the run (whole process
  life: imports, model construction, the engine's set-up, the steps), in GB (1e9 bytes).
- ``train GB``: the peak RSS over the steps alone (Linux ``VmHWM`` after resetting it through
  ``/proc/self/clear_refs`` once the model and optimizer are built), in GB; this excludes the
  one-off construction peak (the model's own weights plus the engine's copies).
- ``d torch``: ``train GB`` minus the ``torch`` row's, in GB.
- ``faults/step``: minor page faults of the process per step (``getrusage`` ``ru_minflt``),
  median of the same steps, in thousands: memory mapped afresh and touched each step (on a CPU
  device, each fault is a 4 KiB page the kernel zeroes and maps).
- ``dev GB`` (``--device cuda`` only): the CUDA allocator's peak over the steps, in GB.
- ``state R/W MB``: optimizer-state bytes read / written per step (``memory_report()["nvme"]``'s
  ``state_read_bytes`` / ``state_written_bytes``, mean over the measured steps), in MB (1e6),
  beside ``formula``: the state bytes of the flat parameters on NVMe (``memory_report()
  ["host_cache"]["nvme_state_bytes"]``), what each step must read and write. ``all R/W MB``:
  everything the swapper moved (parameter shards too), per step.
With several rounds the memory figures are the median over rounds.

Usage: PYTHONPATH=. python benchmarks/bench_step.py [--layers 8] [--hidden 1024]
       [--intermediate 2048] [--vocab 32000] [--seq 256] [--batch 4] [--dtype fp32|bf16]
       [--steps 10] [--skip 2] [--rounds 1] [--path DIR] [--configs torch,ours-cpu,...]
       [--device cpu|cuda] [--host-cache-frac 0.5] [--moment-dtype fp32|bf16] [--grad-accum 1]

The peers: ``benchmarks/install_peers.sh`` installs DeepSpeed 0.19.8 (its ``ds-*`` rows).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["torch", "torch+io", "ours-cpu", "ours-nvme", "ours-nvme-opt", "ours-nvme+sib",
           "ours-nvme-opt+sib", "ours-nvme+plain", "ours-nvme-opt+plain", "ours-nvme+cache",
           "ours-nvme+bf16m", "ours-nvme+int8m", "ours-nvme+cache+bf16m",
           "ours-nvme+cache+int8m", "ds-cpu", "ds-nvme-opt", "ds-nvme-opt+param"]
SUFFIXES = ("sib", "plain", "cache", "bf16m", "int8m", "bf16w")  # (an ours-* row's, any order)
RING_SUFFIX = re.compile(r"ra([0-9]+)")  # ``raN``: optimizer_prefetch=N
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
GB = 1e9


def known_config(name: str) -> bool:
    """Whether ``name`` is a row: one of :data:`CONFIGS`, or an ``ours-*`` base with ``+``
    suffixes of :data:`SUFFIXES` (at most one of ``sib``/``plain`` and of ``bf16m``/``int8m``)
    or one ``raN`` (:data:`RING_SUFFIX`), e.g. ``ours-nvme+cache+sib`` or ``ours-nvme+ra6``."""
    if name in CONFIGS:
        return True
    base, *parts = name.split("+")
    return (base in ("ours-cpu", "ours-nvme", "ours-nvme-opt") and bool(parts)
            and all(p in SUFFIXES or RING_SUFFIX.fullmatch(p) for p in parts)
            and len(set(parts)) == len(parts)
            and sum(1 for p in parts if RING_SUFFIX.fullmatch(p)) <= 1
            and not {"sib", "plain"} <= set(parts) and not {"bf16m", "int8m"} <= set(parts))


# -- worker: one configuration, in its own process ------------------------------------------------
class _StateTraffic:
    """The optimizer state's disk traffic without the optimizer: the ``torch+io`` row's I/O.

    Each :meth:`start` streams the state of one flat parameter of ``nbytes / 12`` fp32
    elements (master weights and two moments, 12 B each) through the engine's own
    :class:`offload_zero.memory.tiers.NVMeStore` on a background thread: every chunk read and
    written back through its three host buffer sets, its :class:`Swapper` with the probed
    block size and queue depth, exactly the I/O of the plain step's update with nothing
    computed; :meth:`wait` waits for the end. With ``nbytes`` = 12 B/param this is the traffic
    any design that keeps Adam's state on this disk must add to each step, so the ``torch+io``
    step time is the floor of such a design on this machine: the same compute as ``torch``, the
    same bytes, and perfect overlap of the two. Raises SwapIOError if an I/O fails.
    """

    class _Flat:
        name = "state"  # (what the store needs of a flat parameter: a name; a key by identity)

    def __init__(self, folder: str, nbytes: int):
        import torch
        from offload_zero.memory.accounting import TierAccountant
        from offload_zero.memory.aligned import aligned_empty
        from offload_zero.memory.swapper import Swapper
        from offload_zero.memory.tiers import NVMeStore
        numel = -(-nbytes // (12 * 1024)) * 1024  # (whole 4096-byte pages, as shards are)
        self.swapper = Swapper(folder, block_size=None, queue_depth=None)  # probed, as the engine
        self.store = NVMeStore(self.swapper, TierAccountant(), aligned_empty, numel)
        self.flat = self._Flat()
        self.store.add(self.flat, torch.zeros(numel))
        self.thread = None
        self.error = None

    def _run(self) -> None:
        try:
            for _ in self.store.iter_states([self.flat]):
                pass
            self.store.drain()
        except BaseException as exc:  # reported by wait()
            self.error = exc

    def start(self) -> None:
        """Start one step's traffic (``nbytes`` read, then written back) on a new thread."""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Wait for the step's traffic; raises the error that ended it, if any."""
        self.thread.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Remove the swap file and its folder (the swapper's)."""
        try:
            self.store.close()
        finally:
            self.swapper.close()


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _llama_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       max_position_embeddings=max(args.seq, 2048), tie_word_embeddings=False,
                       use_cache=False)


def _build_model(args, dtype):
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(args))
    return model.to(dtype).train()


def ours_engine(args, config: str, model, dtype, dev):
    """The ``OffloadEngine`` of row ``config`` (an ``ours-*`` name, see the module docstring)
    around ``model``, with the benchmark's AdamW settings and ``args``' path, cache fraction,
    moment format and accumulation."""
    import torch
    from offload_zero import OffloadEngine
    base = config.split("+")[0]
    offload = base.split("-")[1]
    extra = {"offload_param": "none"} if base == "ours-nvme-opt" else {}
    parts = config.split("+")[1:]
    if "sib" in parts:
        extra["update_timing"] = "backward"
    if "plain" in parts:
        extra["update_timing"] = "step"
    for p in parts:
        if RING_SUFFIX.fullmatch(p):
            extra["optimizer_prefetch"] = int(RING_SUFFIX.fullmatch(p).group(1))
    extra["moment_dtype"] = ("bf16" if "bf16m" in parts else "int8" if "int8m" in parts
                             else args.moment_dtype)
    extra["master_dtype"] = "bf16" if "bf16w" in parts else "fp32"
    if "cache" in parts:
        from offload_zero.memory.state_format import StateFormat, moment_dtype_of
        per_param = StateFormat(moment_dtype_of(extra["moment_dtype"]),
                                torch.bfloat16 if "bf16w" in parts else torch.float32
                                ).resident_bytes_per_element
        state = per_param * sum(p.numel() for p in model.parameters())
        extra["host_cache_bytes"] = int(args.host_cache_frac * state)
    return OffloadEngine(model, stage=3, offload=offload,
                         path=args.path if offload == "nvme" else None, **extra,
                         lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=dtype,
                         device=dev, gradient_accumulation_steps=args.grad_accum)


def _ds_init(args, dtype, config: str, path: str):
    """DeepSpeed engine for ``config``; returns (engine, step function)."""
    import torch
    import torch.distributed as dist
    import deepspeed
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                 ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    cfg_m = _llama_config(args)
    largest = max(args.vocab * args.hidden, args.hidden * args.intermediate)
    offload_opt = {"device": "cpu"} if config == "ds-cpu" else {"device": "nvme", "nvme_path": path}
    offload_param = ({"device": "nvme", "nvme_path": path} if config == "ds-nvme-opt+param"
                     else {"device": "cpu"})
    offload_param.update(buffer_count=16, buffer_size=largest)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                   "weight_decay": WD}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": offload_opt, "offload_param": offload_param,
            "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 0,
        },
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = LlamaForCausalLM(cfg_m)
    model.train()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_cfg)

    def step(x):
        for _ in range(args.grad_accum):  # (DeepSpeed's step() updates every N-th call)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        return loss
    return engine, step


def worker(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    config = args.worker
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(dev)
    closer = None
    moved = None  # f() -> NVMe byte counters (ours-* rows)
    if config in ("torch", "torch+io"):
        model = _build_model(args, dtype).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                weight_decay=WD, fused=True)
        traffic = None
        if config == "torch+io":
            traffic = _StateTraffic(os.path.join(args.path, f"torch-io-{os.getpid()}"),
                                    12 * sum(p.numel() for p in model.parameters()))
            closer = traffic.close

        def step(x):
            if traffic is not None:
                traffic.start()
            for _ in range(args.grad_accum):
                loss = model(input_ids=x, labels=x).loss
                (loss / args.grad_accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if traffic is not None:
                traffic.wait()
            return loss
    elif config.startswith("ours-"):
        engine = ours_engine(args, config, _build_model(args, dtype), dtype, dev)
        closer = engine.close

        def step(x):
            for _ in range(args.grad_accum):  # (every N-th step() updates)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
            return loss

        def moved():
            rep = engine.memory_report()
            nvme = rep["nvme"]
            return (nvme["state_read_bytes"], nvme["state_written_bytes"], nvme["read_bytes"],
                    nvme["written_bytes"], rep["host_cache"]["nvme_state_bytes"])
    elif config.startswith("ds-"):
        _, step = _ds_init(args, dtype, config, args.path)
    else:
        raise SystemExit(f"unknown config {config!r}; choose from {CONFIGS}")
    nparams = sum(p.numel() for p in _count_model(args))
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    hwm_ok = _reset_hwm()
    times, losses, faults, io = [], [], [], []
    for _ in range(args.steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        b0 = moved() if moved else None
        t0 = time.perf_counter()
        loss = step(x)
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        if moved:
            b1 = moved()
            io.append([b - a for a, b in zip(b0[:4], b1[:4])] + [b1[4]])
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        losses.append(float(loss.detach().float()))
    train_peak = _hwm_bytes() if hwm_ok else None
    dev_peak = torch.cuda.max_memory_allocated(dev) if cuda else None
    if closer is not None:
        closer()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"config": config, "times": times, "losses": losses,
                                  "faults": faults,
                                  "peak_rss": peak, "train_peak_rss": train_peak,
                                  "dev_peak": dev_peak, "io": io,
                                  "params": nparams}), flush=True)


def _count_model(args):
    """Parameter shapes without allocating them (meta device)."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return list(LlamaForCausalLM(_llama_config(args)).parameters())


# -- driver ---------------------------------------------------------------------------------------
def _deepspeed_status() -> str:
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    r = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                       capture_output=True, text=True, env=env)
    if r.returncode == 0:
        return r.stdout.strip().splitlines()[-1]
    return ""


def _run_one(args, config: str) -> Dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", config] + args.passthrough
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if config.startswith("ds-") and args.device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["wall"] = time.time() - t0
            return res
    tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
    return {"config": config, "error": f"exit {r.returncode}: " + " | ".join(tail)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=10, help="steps per run")
    p.add_argument("--skip", type=int, default=2, help="leading steps left out of the median")
    p.add_argument("--rounds", type=int, default=1, help="runs per configuration, alternating")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--path", default=None, help="folder for NVMe files (default: temp under /tmp)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the rows compute (cuda: the GPU; the ds-* rows need cpu)")
    p.add_argument("--host-cache-frac", type=float, default=0.5,
                   help="ours-nvme+cache: host_cache_bytes as this fraction of the state's bytes")
    p.add_argument("--moment-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="moment_dtype of the ours-* rows (ours-nvme+bf16m: always bf16)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (gradient accumulation), >= 1")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.grad_accum < 1:
        p.error(f"--grad-accum must be >= 1, got {args.grad_accum}")
    if args.worker:
        return worker(args)

    tmp = None
    if args.path is None:
        tmp = args.path = tempfile.mkdtemp(prefix="bench_step_", dir="/tmp")
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if not known_config(c)]
    if bad:
        p.error(f"unknown configs {bad}; choose from {CONFIGS}, or an ours-* row with "
                f"+suffixes of {SUFFIXES}")
    if args.device == "cuda" and any(c.startswith("ds-") for c in configs):
        p.error("the ds-* rows run with --device cpu only; leave them out of --configs")
    ds_version = _deepspeed_status() if any(c.startswith("ds-") for c in configs) else ""
    skipped_ds = [c for c in configs if c.startswith("ds-")] if not ds_version else []
    configs = [c for c in configs if c not in skipped_ds]
    args.passthrough = []
    for k in ("layers", "hidden", "intermediate", "heads", "vocab", "seq", "batch", "dtype",
              "steps", "threads", "path", "device", "host_cache_frac", "moment_dtype", "grad_accum"):
        args.passthrough += [f"--{k.replace('_', '-')}", str(getattr(args, k))]

    import torch
    load0 = os.getloadavg()
    results: Dict[str, List[Dict]] = {c: [] for c in configs}
    try:
        for rnd in range(args.rounds):
            for c in configs:
                res = _run_one(args, c)
                results[c].append(res)
                msg = res.get("error") or (f"median {statistics.median(res['times'][args.skip:]):.2f} s"
                                           f", load {os.getloadavg()[0]:.2f}")
                print(f"# round {rnd + 1} {c}: {msg}", file=sys.stderr, flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()

    rows = {}
    for c in configs:
        ok = [r for r in results[c] if "error" not in r]
        if not ok:
            rows[c] = {"error": results[c][0]["error"]}
            continue
        ts = [t for r in ok for t in r["times"][args.skip:]]
        train = [r["train_peak_rss"] for r in ok if r["train_peak_rss"] is not None]
        rows[c] = {"median": statistics.median(ts), "min": min(ts), "max": max(ts),
                   "peak": statistics.median(r["peak_rss"] for r in ok),
                   "train": statistics.median(train) if train else float("nan"),
                   "dev": (statistics.median(r["dev_peak"] for r in ok)
                           if ok[0].get("dev_peak") is not None else None),
                   "faults": statistics.median(f for r in ok for f in r["faults"][args.skip:]),
                   "io": [statistics.mean(s[i] for r in ok for s in r.get("io", [])[args.skip:])
                          for i in range(5)] if ok[0].get("io") else None,
                   "loss": ok[0]["losses"], "params": ok[0]["params"], "n": len(ts)}

    nparams = next((r["params"] for r in rows.values() if "params" in r), 0)
    ds_text = ds_version or ("not importable" if any(c.startswith("ds-") for c in configs)
                             else "no row")
    print(f"# bench_step: {platform.node()} cpus={len(os.sched_getaffinity(0))} "
          f"threads={args.threads} device={args.device} torch={torch.__version__} "
          f"deepspeed={ds_text} "
          f"date={time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# model: Llama layers={args.layers} hidden={args.hidden} "
          f"intermediate={args.intermediate} heads={args.heads} vocab={args.vocab} "
          f"params={nparams / 1e6:.1f}M ({nparams * 4 / 1e6:.0f} MB fp32) dtype={args.dtype} "
          f"batch={args.batch} seq={args.seq} grad_accum={args.grad_accum}")
    print(f"# median of steps {args.skip + 1}..{args.steps} over {args.rounds} round(s), "
          f"fresh process per run; load average 1/5/15 min: before "
          f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, after "
          f"{load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")
    base = rows.get("torch", {})
    tokens = args.grad_accum * args.batch * args.seq
    hdr = (f"{'config':<20}{'tok/s':>8}{'step s':>8}{'min':>7}{'max':>7}{'vs torch':>10}"
           f"{'peak RSS GB':>13}{'train GB':>10}{'d torch':>9}{'faults/step':>12}"
           + (f"{'dev GB':>9}" if args.device == "cuda" else "")
           + f"{'state R/W MB':>15}{'formula':>9}{'all R/W MB':>14}")
    print(hdr)
    print("-" * len(hdr))
    for c in configs:
        r = rows[c]
        if "error" in r:
            print(f"{c:<20} failed: {r['error'][:300]}")
            continue
        over = (f"{(r['median'] / base['median'] - 1) * 100:+9.1f}%" if "median" in base
                else f"{'':>10}")
        dgb = f"{(r['train'] - base['train']) / GB:+9.2f}" if "train" in base else f"{'':>9}"
        print(f"{c:<20}{tokens / r['median']:8.0f}{r['median']:8.2f}{r['min']:7.2f}{r['max']:7.2f}{over}"
              f"{r['peak'] / GB:13.2f}{r['train'] / GB:10.2f}{dgb}{r['faults'] / 1e3:11.0f}k"
              + (f"{r['dev'] / GB:9.2f}" if r.get("dev") is not None else "")
              + (f"{r['io'][0] / 1e6:8.0f}/{r['io'][1] / 1e6:<6.0f}{r['io'][4] / 1e6:9.0f}"
                 f"{r['io'][2] / 1e6:7.0f}/{r['io'][3] / 1e6:<6.0f}" if r.get("io") else ""))
    for c in skipped_ds:
        print(f"{c:<20} skipped: deepspeed not importable")
    print("# first/last loss: " + "; ".join(
        f"{c} {rows[c]['loss'][0]:.3f}/{rows[c]['loss'][-1]:.3f}" for c in configs
        if "loss" in rows[c]))


if __name__ == "__main__":
    main()
