from __future__ import annotations

import pytest

from rlt.spec.bench_checkpoint import scale_loop_updates


@pytest.fixture(scope="session")
def spec_checkpoints(tiny_checkpoint, tmp_path_factory):
    """(random tiny checkpoint, the same with loop updates scaled by 0.03: drafts mostly accepted)."""
    src = tiny_checkpoint(seed=1)
    return src, scale_loop_updates(src, tmp_path_factory.mktemp("scaled"), 0.03)
