"""Multi-process test harness: run a function on N gloo ranks on this machine.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forkserver), initialises a
gloo process group over 127.0.0.1 on a free port, calls ``fn(rank, world_size, *args)`` in
each, and returns the list of return values ordered by rank. An exception on any rank fails
the call with that rank's traceback. ``fn`` must be importable (defined at module level).
"""
import multiprocessing as mp
import os
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks fork from a server that has imported torch, transformers and the package once per test
# session ("forkserver"), instead of each importing them afresh ("spawn": ~2 s a launch on 2
# cores). Each rank still starts from a clean process, with the caller's environment of now.
PRELOAD = ["torch", "torch.distributed", "transformers", "offload_zero", "models"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(fn, rank, world_size, port, args, queue, timeout_s, init, env):
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn, world_size, *args, timeout_s=120, init=True):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results.

    With ``init=False`` no process group is created: the environment is set as torchrun sets
    it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and ``fn`` (or the engine) initialises it.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, timeout_s,
                                               init, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout_s + 60)
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RankFailure("\n".join(errors))
    return [results[r] for r in range(world_size)]


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each one's traceback."""
