"""What the lockstep checks cost: step time with ``check_collectives`` on and off, two gloo ranks.

Each check is one all-gather of 64 bytes per rank before each collective (see [Note: lockstep]
in ``offload_zero/lockstep.py``). This runs two ranks on this machine, trains a Llama-shaped
model (two shapes, fp32 and bf16) at ZeRO stages 2 and 3 with ``offload="cpu"``, alternating
rounds with the checks on and off, and prints the median step of each, their ratio, the
collectives checked per step and the seconds spent in the checks per step (which include a
rank waiting for the other, time the collective itself would otherwise wait). Because two ranks
on a small shared machine make step times noisy, it also times the check alone with both ranks
in step (the median of 500 checks in a row) and prints the estimated cost: checks per step
times that latency, over the step without checks.

    python3 benchmarks/bench_lockstep.py [--rounds 3] [--steps 3] [--shapes ...] [--dtypes ...]
        [--stages ...]
"""
import argparse
import datetime
import multiprocessing as mp
import os
import socket
import statistics
import time

SHAPES = {  # name: (hidden, layers, vocab, seq)
    "block-heavy": (256, 12, 4000, 128),
    "root-heavy": (256, 4, 32000, 128),
    "bench-149M": (1024, 8, 32000, 256),  # bench_step.py's model (intermediate 2 x hidden)
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, args, queue):
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from offload_zero import OffloadEngine
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    rows = []
    for shape in args.shapes:
        hidden, layers, vocab, seq = SHAPES[shape]
        for dtype in [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtypes]:
            for stage in args.stages:
                times = {True: [], False: []}
                checks = {True: (0, 0.0)}
                for r in range(args.rounds):
                    for check in ((True, False) if r % 2 == 0 else (False, True)):
                        torch.manual_seed(0)
                        heads = max(4, hidden // 64)
                        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=heads, vocab_size=vocab)
                        model = LlamaForCausalLM(cfg)
                        ids = torch.randint(0, vocab, (2, seq),
                                            generator=torch.Generator().manual_seed(rank))
                        with OffloadEngine(model, offload="cpu", stage=stage, dtype=dtype,
                                           check_collectives=check) as eng:
                            eng.backward(eng(input_ids=ids, labels=ids).loss)  # warm-up
                            eng.step()
                            ls = eng.comm.lockstep
                            n0, s0 = ls.checks, ls.seconds_checking
                            for _ in range(args.steps):
                                dist.barrier()
                                t0 = time.perf_counter()
                                eng.backward(eng(input_ids=ids, labels=ids).loss)
                                eng.step()
                                times[check].append(time.perf_counter() - t0)
                            if check:
                                checks[True] = ((ls.checks - n0) / args.steps,
                                                (ls.seconds_checking - s0) / args.steps)
                on, off = statistics.median(times[True]), statistics.median(times[False])
                rows.append((shape, str(dtype).replace("torch.", ""), stage, off, on,
                             checks[True][0], checks[True][1]))
    from offload_zero.lockstep import Lockstep
    ls = Lockstep(None, rank, 2, torch.device("cpu"))
    lat = []
    for _ in range(500):
        dist.barrier()
        t0 = time.perf_counter()
        ls.before("all_gather", 1024, torch.float32, "unit0.trainable")
        lat.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    queue.put((rank, (rows, statistics.median(lat))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 3], choices=[1, 2, 3])
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    rows, latency = results[0][0], max(r[1] for r in results.values())
    for p in procs:
        p.join()
    print(f"two gloo ranks on {os.cpu_count()} cores; median of {args.rounds * args.steps} "
          "steps each, rounds alternating")
    print(f"one check with both ranks in step: {1e6 * latency:.0f} us (median of 500)")
    print(f"{'shape':12} {'dtype':9} {'stage':>5} {'checks off':>11} {'checks on':>10} "
          f"{'measured':>9} {'checked/step':>13} {'s in checks/step':>17} {'estimated':>10}")
    for shape, dtype, stage, off, on, n, s in rows:
        print(f"{shape:12} {dtype:9} {stage:>5} {off:>10.3f}s {on:>9.3f}s "
              f"{100 * (on / off - 1):>+8.1f}% {n:>13.0f} {s:>17.4f} "
              f"{100 * n * latency / off:>+9.2f}%")


if __name__ == "__main__":
    main()
