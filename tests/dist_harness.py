"""Multi-process test harness: run a function on N gloo ranks on this machine, or the
``offload-zero`` command, in processes forked from one that imported the heavy modules once.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forkserver), initialises a
gloo process group over 127.0.0.1 on a free port, calls ``fn(rank, world_size, *args)`` in
each, and returns the list of return values ordered by rank. An exception on any rank fails
the call with that rank's traceback. ``fn`` must be importable (defined at module level).

``run_cli(argv, cwd)`` runs ``python -m offload_zero.cli ARGV`` the same way (see its
docstring).
"""
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks fork from a server that has imported torch, transformers and the package once per test
# session ("forkserver"), instead of each importing them afresh ("spawn": ~2 s a launch on 2
# cores). Each rank still starts from a clean process, with the caller's environment of now.
PRELOAD = ["torch", "torch.distributed", "transformers", "offload_zero", "models",
           "offload_zero.train", "transformers.models.llama.modeling_llama", "safetensors.torch"]


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


def _cli_child(argv, cwd, env, out_path, err_path):
    """In the forked child: the command's run as ``python -m offload_zero.cli`` makes it, with
    its own folder, environment, argv and standard output and error (descriptors 1 and 2, so
    output from C too); exits with the code such a run exits with, after the atexit handlers."""
    import atexit
    import runpy

    import torch
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["offload_zero.cli", *argv]  # (runpy puts the module's path first)
    code = 0
    try:
        runpy.run_module("offload_zero.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_cli(argv, cwd, env=None, timeout=240) -> subprocess.CompletedProcess:
    """``python -m offload_zero.cli ARGV`` in folder ``cwd`` with environment ``env`` (default:
    this process's), as a child forked from the harness's forkserver: torch, transformers and
    the package are imported already, which saves each run the interpreter's start and those
    imports (about 3 s on 2 cores). Returns a ``subprocess.CompletedProcess`` (text ``stdout``,
    ``stderr``, ``returncode``). Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds
    (the child is killed). Runs that need a process of their own (a signal sent to it,
    torchrun) start one instead."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="oz-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = _context().Process(target=_cli_child, args=(argv, str(cwd), env, out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, "-m", "offload_zero.cli", *argv],
                                            timeout)
        texts = []
        for path in (out, err):
            try:
                with open(path, errors="replace") as f:
                    texts.append(f.read())
            except FileNotFoundError:  # (the child died before it made them)
                texts.append("")
    return subprocess.CompletedProcess([sys.executable, "-m", "offload_zero.cli", *argv],
                                       proc.exitcode, texts[0], texts[1])
