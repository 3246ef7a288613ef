import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import atexit
import shutil
import signal
import tempfile

# A suite started in the background (nohup, `&` in a script) inherits SIGINT ignored, and so would
# every process it starts; the interrupt tests need Python's own Ctrl-C, as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The NVMe self-tuning cache: one fresh file per test session, never the user's ~/.cache; the
# folder goes when the session ends (subprocesses inherit the variable, not the folder's life).
if "OFFLOAD_ZERO_CACHE" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="oz-tuning-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["OFFLOAD_ZERO_CACHE"] = os.path.join(_cache_dir, "aio_tuning.json")


import pytest  # noqa: E402
import torch  # noqa: E402

from offload_zero.optim import available_isas, selected_isa  # noqa: E402

# torch's own ops on one thread in the test process, as the ranks run them: the models are
# tiny, and two OpenMP workers spinning against the Adam kernel's threads (which do not follow
# torch's count) made tests up to several times slower on a busy 2-core machine. No test
# depends on the count.
torch.set_num_threads(1)


@pytest.fixture(params=available_isas())
def isa(request, monkeypatch):
    """Each instruction set this CPU supports in turn, forced through OFFLOAD_ZERO_ADAM_ISA
    (the kernel tests' parameter): its name."""
    monkeypatch.setenv("OFFLOAD_ZERO_ADAM_ISA", request.param)
    assert selected_isa() == request.param
    return request.param


@pytest.fixture(scope="module")
def torch_single_thread():
    """torch's reference ops on one thread: on a small shared machine its OpenMP workers
    otherwise spin against our kernel's threads and other jobs (10x slower, no better test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
