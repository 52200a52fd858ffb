"""rlt-decode on a GPU: decode steps replayed as CUDA graphs are token-identical to the base
eager engine (fp32 greedy, Triton attention), across row buckets with padding, adaptive exit and
mid-decode arrivals, with the token-level pipeline on (the default where async execution is
declared); bf16 agreement reported. Features are composed explicitly from
``rlt.decode.feature`` (no install needed on the device)."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import first_token_gap, random_prompts, run_prompts

pytestmark = pytest.mark.gpu


def _engines(path, dtype, options=None, **kw):
    from rlt.decode.feature import FEATURES
    from rlt.platform import EngineConfig, LLMEngine
    from rlt.platform.composition import plan_composition
    from rlt.platform.platforms import detect_platform

    config = EngineConfig(model=str(path), device="cuda", dtype=dtype, attention_backend="triton", **kw)
    plan = plan_composition(detect_platform("cuda"), FEATURES, options=options)
    return LLMEngine(config), plan.build_engine(config)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_graph_decode_equals_eager_fp32(tiny_checkpoint, batch, threshold):
    from rlt.platform import SamplingParams

    path = tiny_checkpoint(seed=31, gate_bias=0.5, num_hidden_layers=2, hidden_size=64, head_dim=16)
    eager, graphs = _engines(path, "float32", block_size=16)
    prompts = random_prompts(batch, 320, seed=batch)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=threshold)
    want = run_prompts(eager, prompts, sp)
    got = run_prompts(graphs, prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.exit_depths for o in got] == [o.exit_depths for o in want]
    info = graphs.describe()["executor"]
    print(f"batch={batch} tau={threshold}: {info}")
    assert info["graphs"] and info["graphs_captured"] >= 1 and info["steps"].get("graph_replays", 0) > 0
    # every shape was captured at startup (on dummy steps), so no decode step ran eagerly
    assert info["graphs_captured_at_startup"] == info["graphs_captured"]
    assert info["steps"].get("eager_decode_steps", 0) == 0
    # step metadata: read by the mapped-memory kernel when the UVA probe passed (H200: it does)
    if graphs.describe()["uva"]["enabled"]:
        assert info["step_metadata"]["moved_by"].startswith("mapped") and info["step_metadata"]["mapped_uploads"] > 0


def test_graph_decode_bf16_agreement(tiny_checkpoint):
    from rlt.platform import SamplingParams

    path = tiny_checkpoint(seed=32, num_hidden_layers=2, hidden_size=128, head_dim=32, num_attention_heads=4)
    eager, graphs = _engines(path, "bfloat16", block_size=16)
    prompts = random_prompts(16, 320, seed=5)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want, got = run_prompts(eager, prompts, sp), run_prompts(graphs, prompts, sp)
    same = sum(a.token_ids == b.token_ids for a, b in zip(want, got))
    print(f"bf16 graph vs eager: {same}/{len(prompts)} sequences identical")
    assert same >= len(prompts) - 2  # kernel-shape rounding (padded buckets) may flip a near-tie


def test_graph_replay_after_admission_and_finish(tiny_checkpoint):
    """Row counts change between steps (arrivals, finishes): each shape replays its own graph."""
    from rlt.platform import SamplingParams

    path = tiny_checkpoint(seed=33)
    eager, graphs = _engines(path, "float32", block_size=16)
    prompts = random_prompts(6, 320, seed=9)
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]

    def staggered(engine):
        done, pending, step = {}, list(enumerate(prompts)), 0
        while pending or engine.has_unfinished_requests():
            if pending and step % 5 == 0:
                i, p = pending.pop(0)
                engine.add_request(f"r{i}", p, params[i])
            done.update({o.request_id: o for o in engine.step() if o.finished})
            step += 1
        return [done[f"r{i}"].token_ids for i in range(len(prompts))]

    assert staggered(graphs) == staggered(eager)
    assert graphs.describe()["executor"]["graphs_captured"] >= 2
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_planned_steps_equal_eager(tiny_checkpoint, dtype):
    """--pipeline-device-exit with graphs: under adaptive exit the steps after an open one are
    planned on the device (fields advanced in place, the captured step replayed, exits and tokens
    read back through the pinned ring); greedy and seeded tokens identical to the base engine in
    fp32; in bf16 within the graph path's usual near-tie allowance."""
    from rlt.decode.feature import PipelineOptions
    from rlt.platform import SamplingParams

    path = tiny_checkpoint(seed=35, gate_bias=0.5, num_hidden_layers=2, hidden_size=64, head_dim=16)
    eager, planned = _engines(path, dtype, options={"pipeline": PipelineOptions(device_exit=True)}, block_size=16)
    prompts = random_prompts(8, 320, seed=12)
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=50 + i, ignore_eos=True,
                             exit_threshold=(0.5, 0.7, 1.0, 0.6)[i % 4], min_loops=1 + i % 2) for i in range(8)]
    want = run_prompts(eager, prompts, params)
    got = run_prompts(planned, prompts, params)
    info = planned.describe()["executor"]
    print(f"device-planned {dtype}: {info['pipeline']}")
    assert info["pipeline"]["device_exit"]["device_planned_steps"] > 0 and info["steps"].get("graph_replays", 0) > 0
    # the device planning itself replays a graph per row bucket (captured on first use)
    assert info["device_planning_graphs"] > 0 and not info["device_planning_off_reason"], info
    same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in zip(got, want))
    print(f"device-planned {dtype}: {same}/{len(prompts)} sequences identical to eager")
    assert same == len(prompts) if dtype == "float32" else same >= len(prompts) - 2
    torch.cuda.synchronize()


@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_pipelined_graph_decode_equals_eager_fp32(tiny_checkpoint, threshold):
    """The token-level pipeline with graphs (tokens gathered from the device buffer inside the
    graph, read back through the pinned ring with events): token-identical to the base engine;
    at fixed depth the decode steps are really lagged."""
    from rlt.platform import SamplingParams

    path = tiny_checkpoint(seed=34, gate_bias=0.5, num_hidden_layers=2, hidden_size=64, head_dim=16)
    eager, piped = _engines(path, "float32", block_size=16)
    prompts = random_prompts(6, 320, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=threshold)
    want = run_prompts(eager, prompts, params)
    got = run_prompts(piped, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.exit_depths for o in got] == [o.exit_depths for o in want]
    info = piped.describe()["executor"]
    print(f"pipelined tau={threshold}: {info['pipeline']}")
    assert info["pipeline"]["enabled"]
    if threshold >= 1.0:  # fixed depth: decode steps are lagged (with τ < 1 every row may exit: synchronous)
        assert info["pipeline"]["lagged_steps"] > 0
    assert info["graphs"] and info["steps"].get("graph_replays", 0) > 0
    torch.cuda.synchronize()


@pytest.mark.parametrize("device_exit", [False, True])
def test_penalised_decode_equals_the_penalised_oracle_fp32(tiny_checkpoint, device_exit):
    """Repetition / frequency / presence penalties with graphs and the pipeline (lagged steps at fixed
    depth; device-planned steps under adaptive exit): the token history on the GPU (index_add of the
    committed tokens, the open steps' exit mask) gives the oracle's penalised greedy tokens."""
    from rlt.decode.feature import PipelineOptions
    from rlt.platform import SamplingParams
    from rlt.platform.checkpoint import load_checkpoint
    from rlt.platform.models.ouro_reference import reference_generate

    path = tiny_checkpoint(seed=36, gate_bias=0.5, num_hidden_layers=2, hidden_size=64, head_dim=16)
    eager, piped = _engines(path, "float32", options={"pipeline": PipelineOptions(device_exit=device_exit)},
                            block_size=16)
    prompts = random_prompts(6, 320, seed=13)
    settings = [(0.0, 1.25, 1.0), (0.0, 0.0, 2.0), (1.5, 0.5, 1.5), (0.0, 0.0, 1.0), (-0.5, 0.0, 0.5), (0.0, 2.0, 1.0)]
    threshold = 0.6 if device_exit else 1.0
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, exit_threshold=threshold,
                             presence_penalty=p, frequency_penalty=f, repetition_penalty=r) for p, f, r in settings]
    got = run_prompts(piped, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in run_prompts(eager, prompts, params)]
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for prompt, out, s in zip(prompts, got, settings):
        want, depths = reference_generate(ref, prompt, max_tokens=16, exit_threshold=threshold, penalties=s)
        assert list(out.token_ids) == want and list(out.exit_depths) == depths, s
    info = piped.describe()["executor"]
    assert info["graphs"] and info["steps"].get("graph_replays", 0) > 0
    if device_exit:
        assert info["pipeline"]["device_exit"]["device_planned_steps"] > 0
    else:
        assert info["pipeline"]["lagged_steps"] > 0
    torch.cuda.synchronize()


@pytest.mark.parametrize("env,module_name,key", [("RLT_PDL", "pdl", "pdl"), ("RLT_FOLD", "fold", "fold"),
                                                  ("RLT_PREFETCH", "pdl", "weight_prefetch")])
def test_device_side_switches_change_nothing(tiny_checkpoint, monkeypatch, env, module_name, key):
    """PDL (rlt.attention.pdl: each decode kernel waits for its predecessor before touching memory), the
    weight prefetch before that wait (RLT_PREFETCH) and the last-arriver folds (rlt.attention.fold: split
    attention merged, split-K o_proj / down_proj normalised by the program storing the last piece; the
    K-split q/k/v and gate/up reorder sums and are tested in test_fused_ops_gpu.py) give
    bit-identical bf16 logprobs to the plain kernels (the folds: within bf16 noise — their reductions run in
    another kernel, possibly laid out over other threads), through captured graphs and the base engine's mixed
    steps, with split attention (long contexts) and split-K projections (head_dim 128, hidden 2048). One
    request at a time too, so the folded split-K path (at most MAX_ROWS_FOLD rows) is taken."""
    import importlib

    from rlt.platform import SamplingParams

    module = importlib.import_module(f"rlt.attention.{module_name}")
    if key == "fold":  # the folds that keep every sum's order; the K-split projections (which reorder the
        from rlt.platform.models import fused_linear  # dot's sums) have their own test, within bounds

        monkeypatch.setattr(fused_linear, "MIN_TILE_SPLIT_K", 1 << 30)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    expect_on = hopper or key == "fold"  # PDL and its prefetch need sm_90; the folds run on any CUDA GPU
    path = tiny_checkpoint(seed=33, num_hidden_layers=2, hidden_size=2048, head_dim=128, num_attention_heads=16,
                           num_key_value_heads=16, intermediate_size=5632, max_position_embeddings=1024)
    prompts = random_prompts(5, 320, seed=9, lo=200, hi=400)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(env, flag)
        module.refresh()  # read at import otherwise
        eager, graphs = _engines(path, "bfloat16", block_size=16)
        runs[flag, "graphs"] = run_prompts(graphs, prompts, sp)
        assert graphs.describe()["executor"]["steps"].get("graph_replays", 0) > 0
        assert graphs.describe()[key]["enabled"] == (flag == "1" and expect_on)
        runs[flag, "eager"] = run_prompts(eager, prompts, sp)  # the base engine: mixed prompt + decode steps
        runs[flag, "single"] = [run_prompts(graphs, [p], sp)[0] for p in prompts[:2]]
    assert graphs.describe()[key]["enabled"] == expect_on  # still =1 here
    monkeypatch.delenv(env)
    module.refresh()  # back to the default for the tests after this one
    for path_kind in ("graphs", "eager", "single"):
        if key == "fold":  # same sums in the same order, but inside another kernel: its reductions may be laid
            # out over other threads (last-bit differences); a race would show as garbage, not as 1e-3
            worst, agree, total = first_token_gap(runs["0", path_kind], runs["1", path_kind])
            print(f"fold {path_kind}: first-token logprob gap {worst:.2e}, {agree}/{total} tokens agree")
            assert worst <= 0.02 and agree >= 0.9 * total, (path_kind, worst, agree, total)
            continue
        for a, b in zip(runs["0", path_kind], runs["1", path_kind]):
            assert a.token_ids == b.token_ids, path_kind
            assert a.logprobs == b.logprobs and len(a.logprobs) == 12, path_kind
