"""benchmarks/spec_bench.py runs end to end on CPU (its ``cpu`` preset, cut down): every section
produces its rows, plain decoding takes D steps per token, the max_running gate keeps C above it
on the plain path, and the cost model's steps per token is the measured one's order."""

from __future__ import annotations

import json
import math

from benchmarks import spec_bench


def test_spec_bench_cpu_preset(tmp_path):
    res = spec_bench.main(["--preset", "cpu", "--scales", "1.0,0.03", "--targets", "0.9", "--ks", "2", "--ds", "1,2",
                           "--out", "16", "--calib-out", "12", "--big-c", "10", "--cap", "60",
                           "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "spec_bench.json").read_text())["chosen_scales"] == res["chosen_scales"]
    assert set(res["baselines"]) == {"plain_eager", "plain_default"}
    for r in res["baselines"].values():
        assert r["steps_per_token"] == 4.0 and not r["capped"]
    assert len(res["calibration"]) == 2 and res["chosen_scales"] == [0.03]  # the higher-acceptance scale
    modes = [(r["mode"], r["k"], r["d"]) for r in res["c1"]]
    assert modes[:5] == [("sync", 2, 1), ("sync", 2, 2), ("async", 2, 1), ("async", 2, 2), ("adaptive", 2, 2)]
    assert len(modes) == 6 and modes[5][0].startswith("adaptive@")  # with the measured step cost
    for r in res["c1"][:5]:
        assert r["judged_drafts"] > 0 and 0 <= r["acceptance"] <= 1
        assert r["steps_per_token"] < 4.0  # accepted drafts: fewer steps than plain
        assert math.isclose(r["steps_per_token"], r["model_steps_per_token"], rel_tol=0.35)
    big = {r["run"]: r for r in res["big_c"]}
    assert set(big) == {"plain", "adaptive_gate_default", "adaptive_gate_off"}
    assert big["adaptive_gate_default"]["judged_drafts"] == 0  # 10 running > max_running 8: plain path
    assert big["adaptive_gate_default"]["steps_per_token"] == 4.0
    assert big["adaptive_gate_off"]["judged_drafts"] > 0


def test_draft_ranks_cpu(capsys):
    """benchmarks/spec_draft_ranks.py on the tiny model: the engine's greedy tokens are the oracle's
    full-depth argmax (the teacher-forced pass is the run's), coverage grows with the candidates counted,
    a smaller loop-update scale gives drafts that agree more, and the step model's speedups follow."""
    from benchmarks import spec_draft_ranks

    res = spec_draft_ranks.main(["--model", "ouro-tiny", "--scales", "1.0,0.001", "--out", "16"])["results"]
    assert [r["scale"] for r in res] == [1.0, 0.001]
    for r in res:
        assert r["oracle_agreement"] == 1.0 and r["positions"] == 32
        for d in (1, 2, 3):
            c = r[f"d{d}"]
            assert 0 <= c["top1"] <= c["top2"] <= c["top4"] <= 1
            assert c["wide_speedup_lag1"] >= c["alt_speedup_lag1"] >= c["chain_speedup_lag1"]
            assert c["chain_speedup_lag0"] == 4 / spec_draft_ranks.chain_steps(d, 4, c["top1"], 0)
    assert res[1]["d2"]["top1"] > res[0]["d2"]["top1"] + 0.5
    assert math.isclose(spec_draft_ranks.chain_steps(2, 4, 0.8, 1), 2 + 0.2 * 3)   # docs/spec.md's d + (1-a)(D-d+L)


def test_spec_profile_cpu(tmp_path):
    """benchmarks/spec_profile.py on the tiny model: plain decoding yields one token per D = 4 steps, an
    accepting chain more; both windows are profiled (aten ops counted) and the report compares them."""
    from benchmarks import spec_profile

    res = spec_profile.main(["--preset", "cpu", "--scales", "0.01", "--ks", "4", "--ds", "2", "--out", "120",
                             "--steps", "12", "--warm-steps", "4", "--work-dir", str(tmp_path / "work"),
                             "--out-dir", str(tmp_path / "out")])
    plain, chain = res["plain"], res["chain"]
    assert plain["tokens_per_step"] == 0.25
    assert chain["tokens_per_step"] > 0.3  # drafts accepted at this scale: fewer steps per token
    for r in (plain, chain):
        assert r["aten_ops_per_step"] > 0 and r["top_host_ops"] and r["device_busy_ms_per_step"] is None
    text = (tmp_path / "out" / "spec_profile.md").read_text()
    assert "| tokens per step | 0.250 |" in text and "chain - plain" in text
