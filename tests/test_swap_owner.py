"""A swap folder left by a run killed with SIGKILL: the next run takes it over (see
:mod:`offload_zero.memory.owner`) and, when done, leaves the folder as the killed run would have
left it had it ended normally: a rank folder that run made is removed, not left empty."""
import os
import signal
import subprocess
import sys

import pytest

from offload_zero import OffloadEngine
from models import TinyLM, batches, lm_loss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HOLD = """
import sys, time
sys.path.insert(0, {tests!r})
from offload_zero import OffloadEngine
from models import TinyLM
eng = OffloadEngine(TinyLM(), offload="nvme", path={path!r})
print("ready", flush=True)
time.sleep(600)
"""


def _killed_run(path):
    """Run an engine on ``path`` in a subprocess, then SIGKILL it: its files stay."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-c", _HOLD.format(tests=os.path.join(REPO, "tests"),
                                                                path=str(path))],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (path / "rank0" / ".owner").exists()  # what SIGKILL leaves


def test_the_next_run_removes_the_rank_folder_a_killed_run_made(tmp_path):
    path = tmp_path / "swap"
    path.mkdir()
    _killed_run(path)
    with pytest.warns(RuntimeWarning, match=r"gone.*removing \d+ swap file"):
        with OffloadEngine(TinyLM(), offload="nvme", path=str(path)) as eng:
            for x, y in batches(1):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
    assert list(path.iterdir()) == []  # as after a run that ended normally


def test_a_rank_folder_the_user_made_stays_after_a_takeover(tmp_path):
    """The killed run found ``rank0`` there (the user's): its successor keeps it, emptied."""
    path = tmp_path / "swap"
    (path / "rank0").mkdir(parents=True)
    _killed_run(path)
    with pytest.warns(RuntimeWarning, match=r"gone"):
        OffloadEngine(TinyLM(), offload="nvme", path=str(path)).close()
    assert list(path.iterdir()) == [path / "rank0"]
    assert list((path / "rank0").iterdir()) == []
