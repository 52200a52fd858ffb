"""FlashAttention for prompt rows under adaptive exit, proven on CPU with FlashAttention's
semantics in Torch (:class:`PlaneLocalTorchBackend`: each row reads its own plane only).

Dispatched per row group (prompt rows -> plane-local, decode rows -> the depth-indirecting torch
backend) the engine stays token-identical to the fp32 oracle with early exits; the same
plane-local backend on every row does not — so the exactness comes from the dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_helpers import oracle, prompts, run
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import build_engine
from rlt.platform.features import Feature
from rlt.prefill.features import FEATURES, ChunkedPrefillOptions, PackedPrefillOptions, install_packed_prefill
from rlt.prefill.row_groups import PlaneLocalTorchBackend, PromptRowGroups, RowGroupMetadata

ADAPTIVE = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.6)


class CountingPlaneLocal(PlaneLocalTorchBackend):
    def __init__(self) -> None:
        super().__init__()
        self.rows_seen = 0
        self.decode_rows_seen = 0

    def forward(self, query, kv, layer, meta, scale):
        if layer == 0:
            qsl = meta.query_start_loc.cpu().numpy()
            self.rows_seen += len(qsl) - 1
        return super().forward(query, kv, layer, meta, scale)


def _engine(path, install, *, wavefront=True, chunk=5, budget=12):
    cfg = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=budget)
    test_feature = Feature(name="zz_test_attention", package="tests", description="test", install=install)
    return build_engine(cfg, features=[*FEATURES, test_feature],
                        enabled={"chunked_prefill": True, "packed_prefill": False, "prefill_uva": False},
                        options={"chunked_prefill": ChunkedPrefillOptions(chunk_size=chunk, wavefront=wavefront)})


@pytest.mark.parametrize("wavefront", [False, True], ids=["sequential", "wavefront"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_prompt_rows_on_plane_local_backend_are_exact_under_adaptive_exit(tiny_checkpoint, wavefront, kv_heads):
    path = tiny_checkpoint(seed=7, gate_bias=1.0, num_key_value_heads=kv_heads)
    prompt_backend = CountingPlaneLocal()
    engine = _engine(path, lambda b, o: install_packed_prefill(b, PackedPrefillOptions(), prompt_backend=prompt_backend),
                     wavefront=wavefront)
    assert isinstance(engine.ctx.parts.executor.attention, PromptRowGroups)
    mixed = []
    engine.add_observer(type("Obs", (), {"on_step": lambda self, b, r: mixed.append(
        isinstance(b.meta, RowGroupMetadata) and b.in_prompt.any() and (~b.in_prompt).any())})())
    ps = prompts((23, 6, 17, 11), seed=kv_heads)
    outs = run(engine, ps, ADAPTIVE, arrive_every=3)
    for o, (want, depths) in zip(outs, oracle(path, ps, ADAPTIVE)):
        assert (list(o.token_ids), list(o.exit_depths)) == (want, depths)
    assert any(d < 4 for o in outs for d in o.exit_depths[1:]), "no early exit: the test proves nothing"
    assert any(mixed), "no step mixed prompt and decode rows"
    assert prompt_backend.rows_seen > 0


class DenseFreshPlaneLocal(CountingPlaneLocal):
    """FlashAttention's dense varlen call in Torch for fresh calls (``meta.fresh``): each row attends over
    the step's K/V only (``new_kv``), never the pages — what ``FA4Backend(dense_fresh=True)`` does."""

    takes_new_kv = True

    def __init__(self) -> None:
        super().__init__()
        self.dense_calls = self.paged_calls = 0

    def forward(self, query, kv, layer, meta, scale, new_kv=None):
        if new_kv is None or not meta.fresh:
            self.paged_calls += 1
            return super().forward(query, kv, layer, meta, scale)
        self.dense_calls += 1
        k, v = new_kv
        group = query.shape[1] // k.shape[1]
        out = torch.empty_like(query)
        qsl = meta.query_start_loc.tolist()
        for a, b in zip(qsl[:-1], qsl[1:]):
            kk, vv = (t[a:b].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
            scores = query[a:b].transpose(0, 1) @ kk.transpose(1, 2) * scale
            scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            out[a:b] = (scores.softmax(-1) @ vv).transpose(0, 1)
        return out.reshape(query.shape[0], -1)


@pytest.mark.parametrize("chunk,budget", [(5, 12), (0, 64)], ids=["chunked", "whole-prompts"])
def test_fresh_prompt_rows_read_the_steps_kv_densely_and_stay_exact(tiny_checkpoint, chunk, budget):
    """Prompt rows that start at position 0 (whole prompts, first chunks) take the dense call over the
    step's K/V; later chunks (earlier context in the pages) and mixed groups keep the paged call. Exact
    under adaptive exit; a fresh flag set on a later chunk would drop its context and change tokens."""
    path = tiny_checkpoint(seed=7, gate_bias=1.0, num_key_value_heads=2)
    prompt_backend = DenseFreshPlaneLocal()
    engine = _engine(path, lambda b, o: install_packed_prefill(b, PackedPrefillOptions(), prompt_backend=prompt_backend),
                     wavefront=True, chunk=chunk, budget=budget)
    assert engine.ctx.parts.executor.attention.takes_new_kv
    ps = prompts((23, 6, 17, 11), seed=4)
    outs = run(engine, ps, ADAPTIVE, arrive_every=3)
    for o, (want, depths) in zip(outs, oracle(path, ps, ADAPTIVE)):
        assert (list(o.token_ids), list(o.exit_depths)) == (want, depths)
    assert any(d < 4 for o in outs for d in o.exit_depths[1:]), "no early exit: the test proves nothing"
    assert prompt_backend.dense_calls > 0
    if chunk:
        assert prompt_backend.paged_calls > 0, "no later chunk: the paged fallback was not exercised"


def test_plane_local_backend_on_decode_rows_breaks_adaptive_exit(tiny_checkpoint):
    """The control: FlashAttention semantics for every row differ from the oracle after early exits."""
    path = tiny_checkpoint(seed=7, gate_bias=1.0, num_key_value_heads=2)

    def everything_plane_local(builder, options):
        def wrap(ctx, inner):
            inner.attention = PlaneLocalTorchBackend()
            return inner
        builder.wrap("executor", wrap)

    engine = _engine(path, everything_plane_local)
    ps = prompts((23, 6, 17, 11), seed=2)
    outs = run(engine, ps, ADAPTIVE, arrive_every=3)
    got = [(list(o.token_ids), list(o.exit_depths)) for o in outs]
    want = [(w, d) for w, d in oracle(path, ps, ADAPTIVE)]
    assert [t for t, _ in got] != [t for t, _ in want]


def test_row_group_split_is_a_partition_of_rows_and_tokens(tiny_checkpoint):
    path = tiny_checkpoint(seed=6)
    seen = []

    def install(builder, options):
        install_packed_prefill(builder, PackedPrefillOptions(), prompt_backend=PlaneLocalTorchBackend())

    engine = _engine(path, install)
    engine.add_observer(type("Obs", (), {"on_step": lambda self, b, r: seen.append(b)})())
    run(engine, prompts((14, 3, 9), seed=1), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        arrive_every=2)
    kinds = {(bool(b.in_prompt.any()), bool(b.in_prompt.all())) for b in seen}
    assert kinds == {(True, True), (True, False), (False, False)}  # prompt-only, mixed, decode-only steps
    for b in seen:
        if not b.in_prompt.any() or b.in_prompt.all():
            assert not isinstance(b.meta, RowGroupMetadata) or b.meta.groups is None
            assert isinstance(b.meta, RowGroupMetadata) == bool(b.in_prompt.any())
            continue
        g = b.meta.groups
        rows = np.concatenate([g.prompt_rows.numpy(), g.other_rows.numpy()])
        tokens = np.concatenate([g.prompt_tokens.numpy(), g.other_tokens.numpy()])
        assert sorted(rows.tolist()) == list(range(b.num_rows))
        assert sorted(tokens.tolist()) == list(range(int(b.row_len.sum())))
        assert np.array_equal(b.in_prompt[g.prompt_rows.numpy()], np.ones(g.num_prompt_rows, bool))
        qsl = g.prompt_qsl.numpy()
        assert np.array_equal(np.diff(qsl), b.row_len[g.prompt_rows.numpy()])


def test_packed_prefill_without_flash_attention_keeps_the_engine_backend(tiny_checkpoint):
    """On CPU no FlashAttention backend is usable: the feature records why and changes nothing."""
    path = tiny_checkpoint(seed=6)

    def install(builder, options):
        install_packed_prefill(builder, PackedPrefillOptions())

    engine = _engine(path, install)
    assert not isinstance(engine.ctx.parts.executor.attention, PromptRowGroups)
    assert engine.ctx.parts.executor.attention is engine.ctx.attention


def test_packed_prefill_explicit_backend_that_cannot_run_is_an_error(tiny_checkpoint):
    from rlt.platform.errors import ConfigError

    path = tiny_checkpoint(seed=6)

    def install(builder, options):
        install_packed_prefill(builder, PackedPrefillOptions(prompt_backend="fa4"))

    with pytest.raises(ConfigError, match="--packed-prefill-prompt-backend fa4"):
        _engine(path, install)


def test_packed_prefill_feature_is_absent_on_cpu():
    from rlt.platform.features import feature_statuses
    from rlt.platform.platforms import detect_platform

    rows = {s.name: s for s in feature_statuses(detect_platform("cpu"), FEATURES, {})}
    assert rows["chunked_prefill"].enabled
    assert not rows["packed_prefill"].available and "flash_attention" in rows["packed_prefill"].reason
    assert not rows["prefill_uva"].available and "mapped_host_memory" in rows["prefill_uva"].reason
    assert torch.tensor(0).device.type == "cpu"
