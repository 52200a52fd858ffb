"""Where the full-depth token ranks among a depth-``d`` draft's candidates (issue 13's tree question).

Overlapped chains (``docs/spec.md``) cost ``d + (1 - a)(D - d + L)`` steps per token at per-draft
acceptance ``a``: d = 2 of 4 is capped at 1.67x plain decoding at a = 0.8, short of the issue's 1.8x.
Drafting an *alternative* (the draft's second choice, run at the same position beside the first)
saves the rejection's ``D - d`` steps whenever the full-depth token is that second choice. Whether
that can reach 1.8x depends on how often it is, which this script measures instead of assuming.

For each scale of the controlled-acceptance checkpoint (:mod:`rlt.spec.bench_checkpoint`): the
engine decodes ``--out`` greedy tokens after a random prompt (fixed depth, the same prompts as
``spec_bench``); then one teacher-forced pass of the oracle (:class:`OuroReference`, every loop's
state for every position) gives, for every generated position, the draft logits at depth ``d`` and
the full-depth token. Reported per scale and ``d``: ``top1`` (= the chains' per-draft acceptance),
``top2`` and ``top4`` coverage (the full-depth token among the draft's 2 / 4 best), and the step
model's speedups (:func:`rlt.spec.adaptive.async_steps_per_token`) — chains at acceptance ``top1``, and
chains with one alternative per position, taken as chains at acceptance ``top2`` (an upper bound: the
alternative rows' own cost and the switch to them are not counted), and chains whose newest position runs
the draft's four best (``wide``, at acceptance ``top4``, the same bound) — at pipeline lags 0 and ``--lag``.

CPU, fp32 by default (``--dtype``); the 1.4B shapes take a few minutes per scale on two cores.
    python -m benchmarks.spec_draft_ranks --model ouro-1.4b --scales 0.01,0.004,0.002 --out 64
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_model import write_random_checkpoint
import attrs

from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint.loader import DTYPES, load_checkpoint
from rlt.platform.engine.engine import LLMEngine
from rlt.platform.models.ouro_reference import OuroReference
from rlt.spec.adaptive import async_steps_per_token
from rlt.spec.bench_checkpoint import scale_weights


def chain_steps(d: int, depth: int, a: float, lag: int) -> float:
    """Steps per token of an unthrottled overlapped chain at acceptance ``a`` (rlt-spec's cost model)."""
    return async_steps_per_token(a, 8, d, depth, lag)


def ranks(ref: OuroReference, tokens: list[int], prompt_len: int, depth: int) -> tuple[torch.Tensor, float]:
    """``[depth, generated]``: the rank of the full-depth token among each loop's logits, for every
    generated position (the logits at position i - 1 predict token i); and the fraction of the
    engine's tokens that are the oracle's full-depth argmax (1.0 in fp32: the pass is the run's)."""
    with torch.no_grad():
        states = ref.forward_last_exited(tokens, [depth - 1] * len(tokens), depth)  # [D, S, H]
        pred = states[:, prompt_len - 1:len(tokens) - 1]
        logits = torch.stack([ref.logits(s) for s in pred])  # [D, G, V]
    full = logits[-1].argmax(-1)
    agree = (full == torch.tensor(tokens[prompt_len:])).float().mean().item()
    target = logits.gather(-1, full.expand(depth, -1).unsqueeze(-1))
    return (logits > target).sum(-1), agree  # strictly better candidates = the rank (0: top-1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.spec_draft_ranks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ouro-1.4b", help="named configuration (random weights) or checkpoint dir")
    ap.add_argument("--scales", default="0.01,0.004,0.002")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    work = Path(tempfile.mkdtemp(prefix="rlt-ranks-"))
    src = Path(args.model) if Path(args.model).is_dir() else write_random_checkpoint(work / "src", args.model)
    base = load_checkpoint(src, dtype=DTYPES[args.dtype])
    depth = base.config.default_loops
    results = []
    for scale in [float(s) for s in args.scales.split(",")]:
        t0 = time.perf_counter()
        scaled = attrs.evolve(base, weights=scale_weights(base.weights, scale))
        engine = LLMEngine(EngineConfig(model=str(src), device="cpu", dtype=args.dtype, max_num_seqs=args.prompts,
                                        max_model_len=args.input_len + args.out + 8),
                           load_checkpoint=lambda *_, **__: scaled)
        rng = random.Random(0)  # spec_bench's prompts
        vocab = min(base.config.vocab_size, 30000)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.prompts)]
        outs = {}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = list(o.token_ids)
        del engine
        ref = OuroReference(base.config, scaled.weights)
        per = [ranks(ref, p + outs[str(i)], len(p), depth) for i, p in enumerate(prompts)]
        all_ranks = torch.cat([r for r, _ in per], dim=1)
        row = {"scale": scale, "positions": all_ranks.shape[1], "oracle_agreement": min(a for _, a in per),
               "seconds": round(time.perf_counter() - t0, 1)}
        for d in range(1, depth):
            r = all_ranks[d - 1]
            top1, top2, top4 = ((r < k).float().mean().item() for k in (1, 2, 4))
            row[f"d{d}"] = {"top1": top1, "top2": top2, "top4": top4}
            for lag in sorted({0, args.lag}):
                row[f"d{d}"][f"chain_speedup_lag{lag}"] = depth / chain_steps(d, depth, top1, lag)
                row[f"d{d}"][f"alt_speedup_lag{lag}"] = depth / chain_steps(d, depth, top2, lag)
                row[f"d{d}"][f"wide_speedup_lag{lag}"] = depth / chain_steps(d, depth, top4, lag)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return {"results": results}


if __name__ == "__main__":
    main()
