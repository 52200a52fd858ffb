"""The per-step metadata upload: one copy per element size, views with the original dtypes/shapes."""

import numpy as np
import torch

from rlt.platform.engine.staging import CopyUploader


def test_upload_round_trips_every_array():
    rng = np.random.default_rng(0)
    arrays = {
        "a32": rng.integers(-5, 5, 7).astype(np.int32),
        "f32": rng.standard_normal(3).astype(np.float32),
        "tables": rng.integers(0, 100, (2, 3, 4)).astype(np.int32),
        "b64": rng.integers(0, 2**40, 5).astype(np.int64),
        "empty": np.zeros(0, np.int64),
    }
    out = CopyUploader(torch.device("cpu")).upload(arrays)
    assert set(out) == set(arrays)
    for name, a in arrays.items():
        t = out[name]
        assert tuple(t.shape) == a.shape and t.dtype == torch.from_numpy(a).dtype, name
        assert np.array_equal(t.numpy(), a), name


def test_every_view_starts_16_byte_aligned():
    """Kernels are specialised on pointer alignment: a view's alignment must not depend on the sizes
    of the arrays packed before it (odd lengths here)."""
    arrays = {"a": np.arange(3, dtype=np.int32), "b": np.arange(5, dtype=np.int32), "c": np.arange(1, dtype=np.int64),
              "d": np.arange(7, dtype=np.int64), "e": np.ones(2, np.float32)}
    out = CopyUploader(torch.device("cpu")).upload(arrays)
    base = {4: out["a"].data_ptr(), 8: out["c"].data_ptr()}
    for name, a in arrays.items():
        assert (out[name].data_ptr() - base[a.dtype.itemsize]) % 16 == 0, name
        assert np.array_equal(out[name].numpy(), a), name
