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
