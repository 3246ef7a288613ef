import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import tempfile

# The NVMe self-tuning cache: one fresh file per test session, never the user's ~/.cache.
os.environ.setdefault("OFFLOAD_ZERO_CACHE", os.path.join(tempfile.mkdtemp(prefix="oz-tuning-"),
                                                         "aio_tuning.json"))
