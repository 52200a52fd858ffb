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


@pytest.fixture(autouse=True)
def _device_switches_read_again():
    """After each test (and after monkeypatch restored the environment: autouse fixtures are torn down
    last), the device-side switches read RLT_PDL / RLT_PREFETCH / RLT_FOLD again, so a test that flipped
    one — or failed before putting it back — leaves the next test the defaults."""
    yield
    from rlt.attention import fold, pdl

    pdl.refresh()
    fold.refresh()
