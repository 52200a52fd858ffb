"""The offline benchmark harness end to end on CPU with tiny models (no timing asserts).

Runs ``benchmarks.offline_bench`` on a tiny checkpoint for a few tokens and checks that the JSON
and markdown it writes carry every field the issue asks for; checks the roofline arithmetic
against the published Ouro-1.4B numbers (pure arithmetic, no device).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("benchmarks.offline_bench")

from benchmarks.offline_bench import main  # noqa: E402
from benchmarks.roofline import Ceilings, ModelCost, decode_step_cost, workload_floor  # noqa: E402
from benchmarks.workload import Workload  # noqa: E402

MEDIAN_FIELDS = ("e2e_tok_s", "decode_tok_s", "ms_per_loop_step", "ms_per_token_step", "ttft_ms_p50",
                 "ttft_ms_p95", "tpot_ms_p50", "tpot_ms_p95", "mean_exit_depth", "prefill_tok_s")


def test_harness_on_tiny_checkpoint(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           max_position_embeddings=256, gate_bias=0.0)
    out = tmp_path / "out"
    main(["--model", str(ckpt), "--device", "cpu", "--reps", "2", "--warmup-output-len", "2",
          "--workload", "c=2,in=12,out=4,name=fixed",
          "--workload", "c=2,in=12,out=4,req=3,tau=0.5,name=adaptive",
          "--baseline", "reference:c=1,in=12,out=3", "--baseline", "dense:c=2,in=12,out=3",
          "--profile", "c=2,in=12", "--out-dir", str(out)])
    data = json.loads((out / "results.json").read_text())
    assert data["schema"] == "rlt-offline-bench/1"
    for key in ("device", "driver", "torch", "triton", "rlt_packages", "rlt_commit"):
        assert key in data["environment"]
    assert data["ceilings"]["copy_bytes_per_s"] > 0 and data["ceilings"]["matmul_flops_per_s"] > 0
    assert data["model"]["random_weights"] is False

    fixed, adaptive = data["workloads"]
    for r in (fixed, adaptive):
        assert "error" not in r, r.get("error")
        assert r["backend"] == "torch"
        assert r["reps_run"] == 2 and len(r["reps"]) == 2
        for f in MEDIAN_FIELDS:
            assert r["median"][f] is not None and r["median"][f] > 0, f
        assert set(r["floor"]) >= {"e2e_s", "prefill_s", "decode_step_s", "decode_tok_s", "e2e_tok_s"}
        assert r["floor"]["decode_step_s"] > 0
    assert fixed["workload"]["requests"] == 4  # default 2 x C
    assert fixed["median"]["requests"] == 4 and fixed["median"]["output_tokens"] == 16
    assert fixed["median"]["mean_exit_depth"] == 4.0  # fixed full depth
    assert adaptive["median"]["requests"] == 3
    assert 1.0 <= adaptive["median"]["mean_exit_depth"] <= 4.0

    kinds = [b["kind"] for b in data["baselines"]]
    assert kinds == ["reference", "dense"]
    for b in data["baselines"]:
        assert "error" not in b, b.get("error")
        assert b["median"]["e2e_tok_s"] > 0 and b["median"]["ttft_ms"] > 0
        # the reference's decode rate is a difference of two timed runs: on a loaded machine it can be
        # unmeasurable (None), never negative or zero
        assert b["median"]["decode_tok_s"] is None or b["median"]["decode_tok_s"] > 0
        assert b["floor"]["decode_step_s"] > 0

    (prof,) = data["profiles"]
    assert "error" not in prof, prof.get("error")
    assert prof["rows"] == 2 and prof["aten_ops_per_step"] > 0 and prof["host_wall_ms_per_step"] > 0
    assert prof["top_host_ops"]

    md = (out / "results.md").read_text()
    for text in ("fixed", "adaptive", "baseline: reference", "baseline: dense", "×", "torch"):
        assert text in md
    assert (out / "profile_summary.md").is_file()


def test_random_named_config_cpu(tmp_path):
    out = tmp_path / "out"
    data = main(["--model", "ouro-tiny", "--device", "cpu", "--reps", "1", "--warmup-output-len", "1",
                 "--workload", "c=1,in=8,out=3", "--work-dir", str(tmp_path / "w"), "--out-dir", str(out)])
    assert data["model"]["random_weights"] is True and data["model"]["name"] == "ouro-tiny"
    assert "random weights" in (out / "results.md").read_text()
    (r,) = data["workloads"]
    assert "error" not in r and r["median"]["output_tokens"] == 6


def test_workload_spec_parsing():
    wl = Workload.parse("c=64,in=1024,out=128,tau=0.8,min_loops=2")
    assert (wl.concurrency, wl.prompt_len, wl.output_len, wl.requests) == (64, 1024, 128, 128)
    assert wl.adaptive and wl.min_loops == 2
    assert Workload.parse("c=8,in=16,out=4,req=3,name=x").requests == 3
    with pytest.raises(ValueError, match="lacks"):
        Workload.parse("c=8,in=16")
    with pytest.raises(ValueError, match="bad workload field"):
        Workload.parse("c=8,in=16,out=4,foo=1")


def test_roofline_matches_published_ouro_floors():
    """Issue 5: C=1 decode floor ~2.56 ms, C=64 1K ~14.5 ms (all-depth KV), 8K prefill ~60K tok/s."""
    from benchmarks.bench_model import named_shape

    m = ModelCost.from_config(named_shape("ouro-1.4b"), 2)
    assert m.kv_bytes_per_position_plane == 196_608
    assert m.params_per_loop == 24 * (3 * 2048 * 2048 + 2048 * 2048 + 3 * 2048 * 5632)
    h200 = Ceilings(copy_bytes_per_s=4.3e12, matmul_flops_per_s=790e12, copy_bytes=0, matmul_n=0, dtype="bfloat16")
    c1 = decode_step_cost(m, 1, 1024, 4).floor_s(h200)
    c64 = decode_step_cost(m, 64, 1024, 4).floor_s(h200)
    assert 2.4e-3 < c1 < 2.7e-3
    assert 13.8e-3 < c64 < 15.2e-3
    pre = workload_floor(m, h200, concurrency=1, prompt_len=8192, output_len=1, num_requests=1, loops=4)
    assert 55_000 < 8192 / pre.prefill_s < 65_000
    assert pre.prefill_bound == "compute"
    assert workload_floor(m, h200, concurrency=64, prompt_len=1024, output_len=128, num_requests=128,
                          loops=4).decode_bound == "bandwidth"


def test_roofline_ouro_2_6b_shapes():
    """Ouro-2.6B: 48 layers, so twice the 1.4B's per-loop weights and KV (393,216 B per position-plane)."""
    from benchmarks.bench_model import named_shape

    big, small = (ModelCost.from_config(named_shape(n), 2)
                  for n in ("ouro-2.6b", "ouro-1.4b"))
    assert big.num_layers == 48 and big.kv_bytes_per_position_plane == 393_216
    assert big.params_per_loop == 2 * small.params_per_loop
    h200 = Ceilings(copy_bytes_per_s=4.3e12, matmul_flops_per_s=790e12, copy_bytes=0, matmul_n=0, dtype="bfloat16")
    c1_big, c1_small = (decode_step_cost(m, 1, 1024, 4).floor_s(h200) for m in (big, small))
    assert 1.8 * c1_small < c1_big < 2.0 * c1_small  # the LM head is not duplicated


def test_roofline_nanbeige_and_huginn_shapes():
    """models.md §2.2 / §3.1 parameter counts: Nanbeige 22 layers of 143,130,624 linear weights and
    2 loops; Huginn 4 core blocks + the 2E x E adapter per loop, 4 boundary blocks once per token."""
    from benchmarks.bench_model import named_shape

    nb = ModelCost.from_config(named_shape("nanbeige4.2-3b"), 2)
    assert nb.params_per_loop == 22 * 143_130_624 and nb.num_loops == 2 and nb.boundary_layers == 0
    assert nb.kv_bytes_per_position_plane == 22 * 4096
    hg, hg4 = (ModelCost.from_config(named_shape(n), 2) for n in ("huginn-0125", "huginn-0125-r4"))
    block = 3 * 5280**2 + 5280**2 + 3 * 5280 * 17920
    assert hg.params_per_loop == 4 * block + 2 * 5280**2 and hg.boundary_params == 4 * block
    assert (hg.num_loops, hg4.num_loops) == (32, 4)
    h200 = Ceilings(copy_bytes_per_s=4.3e12, matmul_flops_per_s=790e12, copy_bytes=0, matmul_n=0, dtype="bfloat16")
    # one token: 32 loops of the core + the boundary blocks once; r=4 is much cheaper
    c32, c4 = (decode_step_cost(m, 1, 1024, m.num_loops).floor_s(h200) for m in (hg, hg4))
    assert 5 < c32 / c4 < 8


def test_prefill_profile_kinds_kernels_by_name():
    """FlashAttention-4's kernel counts as attention although its name also says cutlass (lease 7's
    profiles had counted its 48 ms as GEMM time)."""
    from benchmarks.prefill_bench import kernel_kind

    assert kernel_kind("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object") == "attention"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kernel_kind("dense_prefill_kernel") == "attention"
    assert kernel_kind("_silu_mul_kernel") == "swiglu"
    assert kernel_kind("Memset (Device)") == "other"


def test_tile_overrides_from_a_sweep():
    """benchmarks/decode_kernels.py --tiles-from: the sweep's winners (more than 3 % faster than the default)
    as an RLT_LINEAR_TILES value fused_linear parses back to the same launch shapes."""
    from benchmarks.decode_kernels import tile_overrides
    from rlt.platform.models.fused_linear import Tiles, parse_tile_overrides

    rows = [
        {"shape": "qkv+rope+kv", "rows": 64, "fused_us": 12.1, "best_us": 9.0, "best_tiles": [64, 64, 128, 8, 3], "best_splits": 2},
        {"shape": "gate_up+silu", "rows": 64, "fused_us": 16.5, "best_us": 16.2, "best_tiles": [64, 64, 128, 8, 3], "best_splits": 1},
        {"shape": "gate_up+silu", "rows": 1, "fused_us": 14.1, "best_us": 12.0, "best_tiles": [16, 16, 256, 4, 4], "best_splits": 1},
        {"shape": "gate_up+silu", "rows": 4, "fused_us": 14.3},             # not swept
        {"shape": "o_proj", "rows": 64, "unfused_us": 8.0},                  # not swept
        # split-K plans at 128 rows: down_proj saves the most; o_proj's best changed the split count (left out)
        {"shape": "o_proj", "rows": 128, "split_plan": [[64, 32, 128, 4, 4, True], 2], "split_norm_us": 9.0,
         "split_best_us": 7.0, "split_best_plan": [[64, 64, 128, 4, 4, True], 4]},
        {"shape": "down_proj", "rows": 128, "split_plan": [[64, 32, 128, 4, 4, True], 4], "split_norm_us": 20.0,
         "split_best_us": 14.2, "split_best_plan": [[128, 64, 128, 4, 4, True], 4]},
        {"shape": "down_proj", "rows": 64, "split_plan": [[64, 32, 128, 4, 4, True], 4], "split_norm_us": 12.0,
         "split_best_us": 11.9, "split_best_plan": [[64, 64, 128, 4, 4, True], 4]},   # under 3 %
    ]
    text = tile_overrides(rows)
    # gate/up at 64 rows: only 1.8 % faster
    assert text == "rope_kv:64=64x64x128x8x3/2,silu_mul:1=16x16x256x4x4/1,split_k:128=128x64x128x4x4x1"
    assert parse_tile_overrides(text) == {("rope_kv", 1): (Tiles(64, 64, 128, 8, 3), 2),
                                          ("silu_mul", 0): (Tiles(16, 16, 256, 4, 4), 1),
                                          ("split_k", 2): (Tiles(128, 64, 128, 4, 4, True), None)}
    assert tile_overrides(rows, min_gain=0.5) == ""
    # two sweeps' rows together (the pointer sweep and the TMA one): each shape's best over both
    tma = [{"shape": "gate_up+silu", "rows": 64, "fused_us": 16.5, "best_us": 13.0,
            "best_tiles": [64, 64, 128, 8, 3, True], "best_splits": 2},
           {"shape": "qkv+rope+kv", "rows": 64, "fused_us": 12.1, "best_us": 9.5,
            "best_tiles": [64, 64, 128, 8, 3, True], "best_splits": 1}]
    text = tile_overrides(rows + tma)
    assert text == ("rope_kv:64=64x64x128x8x3/2,silu_mul:64=64x64x128x8x3x1/2,silu_mul:1=16x16x256x4x4/1,"
                    "split_k:128=128x64x128x4x4x1")
    assert parse_tile_overrides(text)[("silu_mul", 1)] == (Tiles(64, 64, 128, 8, 3, True), 2)


def test_decode_tile_overrides_from_an_attention_sweep():
    """benchmarks/decode_kernels.py --decode-tiles-from: per kind, the launch shape with the least time summed over
    that kind's cases, if it beats the default's sum by more than --min-gain; it parses as RLT_DECODE_TILES."""
    from benchmarks.decode_kernels import decode_tile_overrides
    from rlt.attention.backends.triton_backend import DecodeTiles, decode_tiles_from_env

    def row(rows, variant, us):
        return {"rows": rows, "context": 1024, "variant": variant, "us_per_layer": us}

    sweep = [row(64, "prepare, default", 186.0), row(64, "prepare, decode_tiles 128x4x2x1", 182.5),
             row(64, "prepare, decode_tiles 64x4x3x1", 183.8),
             row(128, "prepare, default", 369.8), row(128, "prepare, decode_tiles 128x4x2x1", 355.5),
             row(128, "prepare, decode_tiles 64x4x3x1", 352.5),
             row(1, "prepare, default", 8.7), row(1, "prepare, split_decode_tiles 32x4x2x0", 8.3)]
    text = decode_tile_overrides(sweep, min_gain=0.02)
    assert text == "decode=64x4x3x1,split=32x4x2x0"   # 536.3 us beats 538.0 (128x4x2x1) and 555.8 (default)
    assert decode_tiles_from_env(text) == {"decode_tiles": DecodeTiles(64, 4, 3, True),
                                           "split_decode_tiles": DecodeTiles(32, 4, 2, False)}
    assert decode_tile_overrides(sweep, min_gain=0.04) == "split=32x4x2x0"  # decode: 3.5 %, split: 4.6 %
    assert decode_tile_overrides(sweep, min_gain=0.5) == ""
