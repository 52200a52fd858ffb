"""Offline end-to-end throughput on exactly the prompts ``serve_bench.py`` sends.

The CPU side of "serving costs what offline costs": build the engine as ``rlt-server serve``
builds it (same checkpoint, dtype and features), hand it the very prompts that
``benchmarks/serve_bench.py`` would send with the same ``--seed`` / ``--num-prompts`` /
``--input-len``, and time ``LLM.generate`` end to end (tokenising the prompts included, as the
server does) at the same ``max_tokens`` and ``ignore_eos``. Reports output tokens per second,
the median of ``--reps`` runs after one warm-up run::

    python benchmarks/offline_same_prompts.py --num-prompts 64 --input-len 128 --output-len 64 \\
        --ignore-eos --reps 3 --result-file offline.json

``--max-num-seqs`` bounds the requests the engine runs at once (the server's clients:
``serve_bench --max-concurrency``). Owns nothing of the engine; it only drives ``LLM``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from benchmarks import serve_bench
from rlt.platform.config import EngineConfig
from rlt.platform.engine.llm import LLM
from rlt.platform.sampling_params import SamplingParams


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model, as the server)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="words per random prompt (serve_bench's)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="serve_bench's --seed: the same prompts")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


def same_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts serve_bench sends for these arguments (its own generator, same seed)."""
    bench_args = serve_bench.parse_args(["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                                         "--seed", str(args.seed)])
    return serve_bench.make_prompts(bench_args, random.Random(args.seed))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    llm = LLM.from_config(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs))
    prompts = same_prompts(args)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=args.ignore_eos)
    runs = []
    for rep in range(args.reps + 1):  # the first is the warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        if rep:
            runs.append({"duration_s": dt, "output_tokens": tokens, "output_throughput": tokens / dt})
            print(f"rep {rep}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tok/s", flush=True)
    summary = {"num_prompts": args.num_prompts, "input_len_words": args.input_len, "output_len": args.output_len,
               "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs), "runs": runs,
               "output_throughput_median": statistics.median(r["output_throughput"] for r in runs)}
    print(f"offline median: {summary['output_throughput_median']:.1f} output tok/s", flush=True)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
