import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

collect_ignore_glob = [] if torch.cuda.is_available() else []


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
