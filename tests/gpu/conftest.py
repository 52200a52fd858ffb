"""GPU tests: skipped as a whole (explicit environment skip) where no CUDA/ROCm device is visible."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no GPU visible to torch")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
