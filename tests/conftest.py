import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import tempfile

# The NVMe self-tuning cache: one fresh file per test session, never the user's ~/.cache.
os.environ.setdefault("OFFLOAD_ZERO_CACHE", os.path.join(tempfile.mkdtemp(prefix="oz-tuning-"),
                                                         "aio_tuning.json"))


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def torch_single_thread():
    """torch's reference ops on one thread: on a small shared machine its OpenMP workers
    otherwise spin against our kernel's threads and other jobs (10x slower, no better test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
