"""The engine with the Triton attention backend on CPU, its kernels run by Triton's interpreter
(``TRITON_INTERPRET=1`` lets the CPU platform select ``triton`` explicitly; ``auto`` never does): fp32
greedy tokens equal the oracle with mixed prefill + decode steps, also with fresh prompt rows read densely
(the default; ``RLT_DENSE_PREFILL=0`` keeps them on the paged kernel) and with split attention merged in the decode kernel (``RLT_FOLD=1``) — the
attention-side options exercised inside the engine, not only kernel by kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from triton_interpreter import fix_interpreter
    fix_interpreter()
    import torch
    from rlt.attention.fold import fold_enabled
    from rlt.platform import EngineConfig, LLMEngine, SamplingParams
    from rlt.platform.checkpoint import load_checkpoint
    from rlt.platform.models.ouro_reference import reference_generate
    path, tau = sys.argv[1], float(sys.argv[3])
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, attention_backend="triton",
                                    max_num_batched_tokens=160, max_num_seqs=3))
    assert engine.selection.name == "triton"
    backend = engine.ctx.attention
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((100, 9, 35, 2))]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, exit_threshold=tau))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    depths = set()
    for i, p in enumerate(prompts):
        out = done[str(i)]
        assert out.error is None, out.error
        want, want_depths = reference_generate(ref, p, max_tokens=5, exit_threshold=tau)
        assert list(out.token_ids) == want and list(out.exit_depths) == want_depths, i
        depths.update(want_depths)
    assert tau == 1.0 or len(depths) > 1, depths  # adaptive: decode rows read keys that exited shallower
    print("ok", backend.takes_new_kv, fold_enabled(torch.empty(1)), len(backend._scratch))
""")


BOTH = {"RLT_DENSE_PREFILL": "1", "RLT_FOLD": "1"}


PAGED = {"RLT_DENSE_PREFILL": "0"}


@pytest.mark.parametrize("env,tau", [(PAGED, 1.0), ({}, 1.0), ({**PAGED, "RLT_FOLD": "1"}, 1.0), (BOTH, 0.5)],
                         ids=["paged", "dense", "fold", "both-adaptive"])
def test_engine_with_triton_attention_matches_oracle_under_interpreter(tiny_checkpoint, env, tau):
    """``both-adaptive``: adaptive exit (LAST_EXITED history at mixed depths) with both options on."""
    full = {**os.environ, "TRITON_INTERPRET": "1", **env}
    path = tiny_checkpoint(seed=21, gate_bias=1.5) if tau < 1 else tiny_checkpoint(seed=21)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(Path(__file__).parents[1]), str(tau)],
                       capture_output=True, text=True, env=full, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    _, dense, fold, split_shapes = r.stdout.split()
    assert dense == str(env.get("RLT_DENSE_PREFILL") != "0") and fold == str("RLT_FOLD" in env)
    assert int(split_shapes) > 0  # split decode attention ran (its scratch exists): the merge (or its fold) too


def test_cpu_platform_takes_triton_only_under_the_interpreter(monkeypatch):
    from rlt.platform.attention_select import AttentionSelectionError, select_attention
    from rlt.platform.platforms import make_platform

    import torch

    cpu = make_platform("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AttentionSelectionError, match="TRITON_INTERPRET=1 runs its kernels"):
        select_attention(cpu, "triton", dtype=torch.float32, head_dim=8, block_size=4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_attention(cpu, "triton", dtype=torch.float32, head_dim=8, block_size=4).name == "triton"
    assert select_attention(cpu, "auto", dtype=torch.float32, head_dim=8, block_size=4).name == "torch"
