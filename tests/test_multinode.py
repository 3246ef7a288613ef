"""A two-node job under torchrun: two network namespaces of this machine are the two hosts
(tests/netns_pair.py), each running its own ``torchrun --nnodes 2 --nproc-per-node 1``, with the
rendezvous and gloo's traffic over the veth link between them (GLOO_SOCKET_IFNAME). The job is
tests/two_node_job.py. Needs root; skips where namespaces cannot be made.
"""
import contextlib
import functools
import os
import subprocess
import sys
import time

import pytest
import torch

from models import TinyLM, adamw_reference, batches
from netns_pair import NamespacesUnavailable, NodePair
from two_node_job import CASES, LR, STEPS, WEIGHT_DECAY

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_node_job.py")
LAUNCH_TIMEOUT_S = 240
KILL_NOTICED_WITHIN_S = 20


@pytest.fixture(scope="module")
def nodes():
    try:
        pair = NodePair.create(str(os.getpid()))
    except NamespacesUnavailable as exc:
        pytest.skip(f"cannot make two network namespaces: {exc}")
    yield pair
    pair.close()


def _c10d(nodes, node):
    """Dynamic rendezvous at node 0's address. ``is_host`` says which node hosts the store:
    torchrun would pick the node whose hostname or addresses match the endpoint, and here both
    nodes have this machine's hostname and neither resolves it to a veth address."""
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.addresses[0]}:29400",
            "--rdzv-id=two-node-test", f"--rdzv-conf=is_host={int(node == 0)}"]


def _static(nodes, node, port=29500):
    """Static rendezvous: node 0 is the master, ranks follow the node ranks."""
    return [f"--node-rank={node}", f"--master-addr={nodes.addresses[0]}", f"--master-port={port}"]


def _launch(nodes, rendezvous, out_dir, mode, *job_args):
    """Start torchrun in each namespace, running ``two_node_job.py MODE OUT_DIR SWAP_DIR
    *job_args``; node n swaps under out_dir/swap<n> and logs to out_dir/node<n>.log. Returns
    the two processes.

    ``--local-addr``: the address the other node reaches this one at (without it the c10d
    rendezvous hands the workers node 0's fully qualified hostname, here "localhost")."""
    procs = []
    for node in (0, 1):
        swap_dir = out_dir / f"swap{node}"
        swap_dir.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--local-addr={nodes.addresses[node]}", *rendezvous(nodes, node),
               JOB, mode, str(out_dir), str(swap_dir), *job_args]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=nodes.ifnames[node])
        with open(out_dir / f"node{node}.log", "w") as log:
            procs.append(subprocess.Popen(nodes.argv(node, cmd), env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    return procs


@contextlib.contextmanager
def _launched(nodes, rendezvous, out_dir, mode, *job_args):
    """``_launch``; on leaving, whatever still runs in either namespace is killed, so that a
    failed case leaves nothing behind for the next."""
    procs = _launch(nodes, rendezvous, out_dir, mode, *job_args)
    try:
        yield procs
    finally:
        for node, p in enumerate(procs):
            if p.poll() is None:
                nodes.kill(node)
                p.wait(timeout=30)


def _log(out_dir, node):
    return (out_dir / f"node{node}.log").read_text()


def _files_under(folder):
    return sorted(str(p) for p in folder.rglob("*") if not p.is_dir())


# -- stages 1-3 with offload to host memory and to NVMe -----------------------------------------

@pytest.fixture(scope="module")
def two_node_states(nodes, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("two-node-cases")
    with _launched(nodes, _c10d, out_dir, "cases") as procs:
        for node, p in enumerate(procs):
            try:
                p.wait(timeout=LAUNCH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"node {node} still running after {LAUNCH_TIMEOUT_S} s:\n"
                            f"{_log(out_dir, node)}")
            assert p.returncode == 0, _log(out_dir, node)
    for node in (0, 1):
        assert _files_under(out_dir / f"swap{node}") == []
    return [torch.load(out_dir / f"state_rank{r}.pt") for r in (0, 1)]


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return adamw_reference(TinyLM(), batches(STEPS, seed=1, batch=4), lr=LR, wd=WEIGHT_DECAY)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_two_nodes_match_adamw_on_the_global_batch(two_node_states, reference, case):
    """Each node trains on its half of the global batch; both end with the weights that
    single-process AdamW reaches on the whole batch, and with the same weights bit for bit."""
    sd0, sd1 = (states[case] for states in two_node_states)
    assert sd0.keys() == sd1.keys() >= reference.keys()
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    assert max((sd0[n] - v).abs().max().item() for n, v in reference.items()) <= 1e-6


# -- a node lost in the middle of a step --------------------------------------------------------

def _wait_for_files(paths, procs, out_dir, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        for node, p in enumerate(procs):
            if p.poll() is not None:
                pytest.fail(f"node {node} exited {p.returncode} before the step:\n{_log(out_dir, node)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {[str(p) for p in paths]} after {timeout_s} s")
        time.sleep(0.1)


def _kill_in_step(nodes, procs, out_dir, killed):
    """Wait until both ranks are in the second step, then kill node ``killed``; returns the
    monotonic and wall-clock times of the kill."""
    markers = [out_dir / f"in_step_rank{r}" for r in (0, 1)]
    _wait_for_files(markers, procs, out_dir, LAUNCH_TIMEOUT_S)
    time.sleep(1.0)  # the survivor is now blocked in its backward's first collective
    worker_pid = int(markers[killed].read_text())
    killed_at, killed_at_wall = time.monotonic(), time.time()
    assert worker_pid in nodes.kill(killed)
    return killed_at, killed_at_wall


@pytest.mark.parametrize("killed", [1, 0], ids=["worker-node", "master-node"])
def test_a_killed_node_is_an_error_on_the_other_within_seconds(nodes, tmp_path, killed):
    """A node is killed (SIGKILL to every process in its namespace: the agent and its worker)
    while the other waits in a stage-3 backward's collective: the survivor's torchrun exits
    non-zero with the error well before the 300 s collective timeout, and its swap files are
    gone. Node 0 is also the rendezvous master (it hosts the store)."""
    survivor = 1 - killed
    rendezvous = functools.partial(_static, port=29500 + killed)
    with _launched(nodes, rendezvous, tmp_path, "stall", str(killed)) as procs:
        killed_at, killed_at_wall = _kill_in_step(nodes, procs, tmp_path, killed)
        try:
            procs[survivor].wait(timeout=KILL_NOTICED_WITHIN_S + 40)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {survivor} still running {KILL_NOTICED_WITHIN_S + 40} s after "
                        f"the kill:\n{_log(tmp_path, survivor)}")
        exited_s = time.monotonic() - killed_at
    log = _log(tmp_path, survivor)
    assert procs[survivor].returncode != 0, log
    assert exited_s < KILL_NOTICED_WITHIN_S, (exited_s, log)
    raised_at_wall, error = (tmp_path / f"error_rank{survivor}").read_text().split("\n", 1)
    assert float(raised_at_wall) - killed_at_wall < KILL_NOTICED_WITHIN_S, error
    assert _files_under(tmp_path / f"swap{survivor}") == []
