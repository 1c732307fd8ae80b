import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py, tests/optim_info.py


def pytest_configure(config):
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
