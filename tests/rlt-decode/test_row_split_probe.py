"""The row-split probe (benchmarks/row_split_overlap): its row groups cover the step's rows exactly, and
every grouping computes what one call over all rows computes (rows are independent within a loop
step) — so a device call of the probe only times streams, it does not have to be trusted on values."""

from __future__ import annotations

import pytest

from benchmarks import row_split_overlap as probe
from rlt.platform.checkpoint.tiny import write_tiny_checkpoint


@pytest.mark.parametrize("rows,groups", [(1, 1), (64, 2), (64, 4), (7, 3), (5, 5)])
def test_bounds_cover_the_rows_in_near_equal_groups(rows, groups):
    b = probe.bounds(rows, groups)
    assert len(b) == groups and b[0][0] == 0 and b[-1][1] == rows
    assert all(hi == lo2 for (_, hi), (lo2, _) in zip(b, b[1:]))
    sizes = [hi - lo for lo, hi in b]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("groups", [0, 8])
def test_bounds_refuse_impossible_groupings(groups):
    with pytest.raises(ValueError, match="groups"):
        probe.bounds(7, groups)


def test_every_grouping_computes_the_one_call_rows(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=3)
    report = probe.main(["--model", str(path), "--device", "cpu", "--rows", "6", "--prompt-len", "20",
                         "--groups", "2,3,6", "--iters", "1", "--reps", "1", "--out", str(tmp_path / "r.json")])
    names = set(report["variants"])
    assert names == {"one", "seq-2", "par-2", "seq-3", "par-3", "seq-6", "par-6"}
    for name, v in report["variants"].items():
        assert v["ms"] > 0
        if name != "one":
            assert v["rel_err"] < 1e-5, name  # fp32: the same rows up to matmul-shape rounding
