"""The fused greedy heads of lagged steps (rlt.spec.heads): the Triton kernel, run in Triton's
interpreter, against a row-by-row statement of what the general path does — drafts written at their
entries, checks judged against theirs (first-index argmax, ties included), the slot's rejection flag
and token changed only by a valid check, plain rows' samples at their slots — plus the condition
under which the engine takes it (rlt.platform.engine.sampler.argmax_only)."""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest
import torch

from rlt.platform.engine.sampler import argmax_only

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")


@pytest.fixture
def interpreted(monkeypatch):
    """rlt.spec.heads with its kernel built by Triton's interpreter (CPU tensors), and usable."""
    from triton_interpreter import fix_interpreter

    fix_interpreter()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import rlt.spec.heads_kernel as kernel

    importlib.reload(kernel)
    from rlt.spec import heads

    yield heads
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    importlib.reload(kernel)


class _Logits:
    """A model whose LM head returns fixed logits per batch row: a row's state is its index."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def coda(self, h):
        return self.logits[h[:, 0].long()]


def _expected(logits_of, rows, token_table, dead):
    """Row by row, the general path's effects: (tokens, counts, verdicts) per row, table, flags."""
    table, flags = token_table.clone(), dead.clone()
    n = len(rows)
    out = np.zeros((3, n), np.int64)
    for r, (role, entry, slot) in enumerate(rows):
        if role == "none":
            continue
        z = logits_of(r)
        tok = int(np.flatnonzero(z == z.max())[0])  # the first largest
        if role == "draft":
            table[entry] = tok
        elif role == "check":
            accept = int(token_table[entry]) == tok
            valid = not bool(dead[slot])
            if valid:
                flags[slot] = not accept
                table[slot] = tok
            out[:, r] = tok, int(valid), int(accept)
        else:  # a plain row's sample
            table[slot] = tok
            out[:, r] = tok, 1, 0
    return out, table, flags


@pytest.mark.parametrize("tiles", ["1024x4", "2048x8"])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_the_general_paths_effects(interpreted, monkeypatch, seed, tiles):
    monkeypatch.setenv("RLT_SPEC_HEADS_TILES", tiles)
    rng = np.random.default_rng(seed)
    vocab, n_slots, ring = 4099, 6, 4  # a vocabulary that is not a multiple of the kernel's block
    n = int(rng.integers(1, 7))
    slots = rng.permutation(n_slots)[:n]  # one row per slot: one check per slot and step at most
    roles = rng.choice(["none", "draft", "check", "sample"], size=n)
    entries = n_slots + np.arange(n) * ring + rng.integers(0, ring, n)  # distinct ring entries
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))
    tie_row = int(rng.integers(0, n))
    # a tie within the kernel's first block (17, 40) and in a later one (3000): the first, 17, wins
    logits[tie_row, [17, 40, 3000]] = logits[tie_row].max() + 1
    model, last = _Logits(logits), torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 4)
    table = torch.as_tensor(rng.integers(0, vocab, n_slots * (1 + ring)), dtype=torch.int64)
    for r in range(n):  # some checks accept: their entry holds the row's argmax
        if roles[r] == "check" and rng.random() < 0.5:
            table[entries[r]] = int(logits[r].argmax())
    dead = torch.as_tensor(rng.random(n_slots) < 0.3)
    want, want_table, want_dead = _expected(lambda r: logits[r].numpy(), list(zip(roles, entries, slots)), table, dead)
    pick = {name: np.flatnonzero(roles == name) for name in ("sample", "draft", "check")}
    got_table, got_dead = table.clone(), dead.clone()
    packed = interpreted.greedy_heads(model, last, sampled=pick["sample"], drafting=pick["draft"],
                                      checking=pick["check"], entries=entries[np.concatenate([pick["draft"], pick["check"]])],
                                      slots=slots, token_table=got_table, dead=got_dead)
    assert np.array_equal(packed.numpy(), want)
    assert torch.equal(got_table, want_table) and torch.equal(got_dead, want_dead)
    if roles[tie_row] != "none" and roles[tie_row] != "draft":
        assert packed[0, tie_row] == 17


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("tiles", [(1024, 4), (4096, 8)])
def test_wide_drafts_take_the_w_best_in_one_pass(interpreted, width, tiles):
    """Wide drafts (WDRAFT) write a row's W best tokens, best first, in (value descending, index
    ascending) order — what a stable sort of the logits gives — from one pass over the vocabulary:
    each block's W best merged with the running W best. Coarse logits make ties within and across
    blocks; a vocabulary of 4 blocks + 3 leaves a tail block with fewer than W entries; one row has
    its W best all in the tail and in the last full block, one all equal to the row's maximum at
    indices in three blocks."""
    from rlt.spec.heads_kernel import WDRAFT

    rng = np.random.default_rng(width)
    vocab, n = 4 * 1024 + 3, 6
    logits = torch.as_tensor(rng.integers(0, 40, (n, vocab)) / 8.0, dtype=torch.float32)
    logits[1, [4098, 4097, 3071, 4096]] = torch.tensor([9.0, 9.0, 8.5, 8.5])  # the tail and the block before
    logits[2, [2000, 5, 4097, 1030]] = 7.0  # equal best values in three blocks: index order
    table = torch.full((n * width,), -1, dtype=torch.int64)
    desc = torch.tensor(np.concatenate([np.arange(n), np.full(n, WDRAFT), np.arange(n) * width, np.arange(n),
                                        np.arange(n)]), dtype=torch.int64)
    interpreted.launch(logits, desc, n, table, torch.zeros(n, dtype=torch.bool), tiles, width=width)
    for r in range(n):
        want = np.lexsort((np.arange(vocab), -logits[r].numpy()))[:width]  # by value descending, then index
        assert table[r * width:(r + 1) * width].tolist() == want.tolist(), r


def test_usable_by_default_with_triton_unless_turned_off(interpreted, monkeypatch):
    t = torch.zeros(1)
    monkeypatch.delenv("RLT_SPEC_FUSED_HEADS", raising=False)
    assert interpreted.fused_heads_usable(t)  # the default since lease 14 timed it (docs/spec.md)
    monkeypatch.setenv("RLT_SPEC_FUSED_HEADS", "0")
    assert not interpreted.fused_heads_usable(t)
    monkeypatch.setenv("RLT_SPEC_FUSED_HEADS", "1")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not interpreted.fused_heads_usable(t)  # a CPU tensor outside the interpreter


def test_argmax_only_names_every_processing_that_needs_the_sampler():
    from rlt.platform.engine.slots import SlotTable

    table = SlotTable(4, max_stop_ids=2)
    rows = np.array([0, 2])
    assert argmax_only(table, rows)
    changes = [("temperature", 0.7), ("logprobs", 0), ("bias_len", 1), ("penalized", True), ("min_tokens", 3)]
    for name, value in changes:
        column = getattr(table, name)
        saved = column[2]
        column[2] = value
        assert not argmax_only(table, rows), name
        assert argmax_only(table, np.array([0, 1]))  # other slots unaffected
        column[2] = saved
    table.min_tokens[2], table.num_generated[2] = 3, 3  # past min_tokens: no suppression left
    assert argmax_only(table, rows)


COMPILE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks.triton_aot_report import compile_sass
from rlt.spec.heads_kernel import greedy_heads_kernel, promote_kernel
from rlt.spec.heads import DEFAULT_TILES
out = {}
for block, warps in {DEFAULT_TILES, (16384, 16), (2048, 4)}:  # the default, the sweep's largest, the old default
    for dtype in ("bf16", "fp32"):
        for w, wp in ((1, 1), (3, 4), (4, 4)):  # plain chains; wide chains' roles (W best drafts, checks)
            types = {"LOGITS": "*" + dtype, "DESC": "*i64", "TABLE": "*i64", "DEAD": "*u8", "OUT": "*i64",
                     "WINNER": "*i64", "stride_l": "i32"}
            ops, usage, _ = compile_sass(greedy_heads_kernel, {"BLOCK": block, "W": w, "WP": wp}, 90, types, set(),
                                         num_warps=warps)
            out[f"{block}x{warps}/{dtype}/W{w}"] = {"ops": len(ops), "local": usage.get("local")}
for dtype in ("bf16", "fp32"):  # the wide chains' promotion
    types = {"DESC": "*i64", "TABLE": "*i64", "WINNER": "*i64", "STATE": "*" + dtype, "K": "*" + dtype,
             "V": "*" + dtype, "STAMPS": "*i32", "layer_stride": "i64"}
    ops, usage, _ = compile_sass(promote_kernel, {"W": 4, "BLOCK": 1024}, 90, types, set(), num_warps=4)
    out[f"promote/{dtype}"] = {"ops": len(ops), "local": usage.get("local")}
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90():
    """The kernel through Triton's compiler for sm_90 (no GPU needed): the interpreter runs the kernel's
    Python and misses what only the compiler rejects (lease 14's first GPU run failed on a module
    global read without ``tl.constexpr``). Run in a subprocess: the fixture above may have left the
    kernel built by the interpreter in this process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", COMPILE, str(root)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(result) >= 2, result
    for shape in result.values():
        assert shape["ops"] > 0 or shape["local"] is None  # SASS listed where cuobjdump ships
        assert shape["local"] in (0, None), result  # no spills


def test_launch_shape_from_the_environment(monkeypatch):
    from rlt.spec.heads import DEFAULT_TILES, heads_tiles

    monkeypatch.delenv("RLT_SPEC_HEADS_TILES", raising=False)
    assert heads_tiles() == DEFAULT_TILES
    monkeypatch.setenv("RLT_SPEC_HEADS_TILES", "8192X16")
    assert heads_tiles() == (8192, 16)
    for bad in ("8192", "3000x4", "4096x3", "ax4", "8x4"):
        monkeypatch.setenv("RLT_SPEC_HEADS_TILES", bad)
        with pytest.raises(ValueError, match="RLT_SPEC_HEADS_TILES"):
            heads_tiles()


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_the_sweeps_descriptor_through_the_kernel(interpreted, rows):
    """``benchmarks/spec_heads_sweep.py``'s rows (a lone sample; draft / check pairs) through ``launch`` at an
    explicit shape, as the sweep calls it: every row's argmax lands where its role puts it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.spec_heads_sweep import descriptor
    from rlt.spec.heads_kernel import CHECK

    logits = torch.randn(rows, 3000, generator=torch.Generator().manual_seed(rows))
    desc = descriptor(rows, "cpu")
    table, dead = torch.full((2 * rows,), -1, dtype=torch.int64), torch.zeros(rows, dtype=torch.bool)
    out = interpreted.launch(logits, desc, rows, table, dead, (1024, 4))
    best = logits.argmax(dim=1)
    roles, entries = desc[1].tolist(), desc[2].tolist()
    for r in range(rows):
        if rows == 1 or roles[r] == CHECK:  # a sample or a check: the row's token out, its slot's token in the table
            assert out[0, r] == best[r] and table[r] == best[r]
        else:  # a draft: its entry holds the token
            assert table[entries[r]] == best[r] and out[1, r] == 0
