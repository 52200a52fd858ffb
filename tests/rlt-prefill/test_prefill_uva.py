"""prefill_uva's staging uploader: one bank of words per upload, moved by the Triton kernel when
mapped (run here in Triton's interpreter) or copied, round-robin banks, exact round trips; and an
engine using it stays token-identical to the oracle."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from prefill_helpers import GREEDY, oracle, prompts, run
from rlt.prefill.uva_uploader import StagingUploader, pack_words

ARRAYS = {
    "qsl": np.array([0, 3, 4, 9], np.int32), "slot_mapping": np.arange(9, dtype=np.int64) * 7 - 2,
    "threshold": np.array([0.5, 2.0, 0.25], np.float32), "tables": np.arange(24, dtype=np.int32).reshape(2, 3, 4),
    "positions": np.array([5, 6, 7], np.int64), "empty": np.zeros(0, np.int64),
}


def _check(out):
    for name, a in ARRAYS.items():
        got = out[name].cpu().numpy()
        assert got.dtype == a.dtype and got.shape == a.shape
        assert np.array_equal(got, a), name


def test_pack_words_puts_8_byte_arrays_first_and_every_array_16_byte_aligned():
    packed, layout = pack_words(ARRAYS)
    offsets = {n: off for n, (off, _) in layout.items()}
    assert all(off % 4 == 0 for off in offsets.values())  # every array 16-byte aligned (stable kernel specialisation)
    padded = sum(-(-a.nbytes // 16) * 16 for a in ARRAYS.values()) // 4
    assert packed.dtype == np.int32 and packed.size == padded
    assert min(offsets[n] for n, a in ARRAYS.items() if a.dtype.itemsize == 8) == 0
    assert max(offsets[n] for n, a in ARRAYS.items() if a.dtype.itemsize == 8 and a.size) < min(
        offsets[n] for n, a in ARRAYS.items() if a.dtype.itemsize == 4)


def test_copy_path_round_trips():
    import torch

    up = StagingUploader(torch.device("cpu"), mapped=False)
    _check(up.upload(ARRAYS))
    assert (up.num_copied, up.num_mapped) == (1, 0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")
def test_mapped_path_runs_the_kernel(monkeypatch):
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    up = StagingUploader(torch.device("cpu"), mapped=True, banks=2)
    outs = [up.upload(ARRAYS) for _ in range(3)]
    for out in outs[-2:]:  # the last `banks` uploads are intact (bank reuse is round robin)
        _check(out)
    assert up.num_mapped == 3


def test_banks_grow_and_rotate():
    import torch

    up = StagingUploader(torch.device("cpu"), mapped=False, banks=3)
    big = {"x": np.arange(5000, dtype=np.int64)}
    a = up.upload(big)["x"]
    b = up.upload(ARRAYS)
    assert np.array_equal(a.numpy(), big["x"])  # a different bank: not overwritten
    _check(b)
    with pytest.raises(TypeError, match="4- and 8-byte"):
        up.upload({"flags": np.zeros(3, bool)})


def test_engine_with_staging_uploader_matches_oracle(tiny_checkpoint):
    from rlt.platform import EngineConfig
    from rlt.platform.composition import build_engine
    from rlt.platform.features import Feature
    from rlt.prefill.features import FEATURES, ChunkedPrefillOptions, PrefillUvaOptions, install_prefill_uva

    path = tiny_checkpoint(seed=21)
    # prefill_uva needs mapped host memory (absent on CPU): installed here as a test feature.
    uva = Feature(name="zz_uva", package="tests", description="test",
                  install=lambda b, o: install_prefill_uva(b, PrefillUvaOptions()))
    engine = build_engine(EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=8),
                          features=[*FEATURES, uva], enabled={"packed_prefill": False, "prefill_uva": False},
                          options={"chunked_prefill": ChunkedPrefillOptions(chunk_size=5, wavefront=True)})
    assert isinstance(engine.ctx.parts.uploader, StagingUploader)
    ps = prompts((19, 4, 11), seed=3)
    outs = run(engine, ps, GREEDY, arrive_every=2)
    for o, (want, _) in zip(outs, oracle(path, ps, GREEDY)):
        assert list(o.token_ids) == want
    assert engine.ctx.parts.uploader.num_copied > 0


def test_banks_option_is_validated():
    from rlt.prefill.features import PrefillUvaOptions

    with pytest.raises(ValueError, match="--prefill-uva-banks must be an integer >= 2"):
        PrefillUvaOptions(banks=1)
