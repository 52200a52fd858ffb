"""``rlt-server generate``: offline generation, one JSON object per prompt on stdout, in order.

The engine is composed like ``serve``'s (installed features for the platform, the same flags);
the feature table is logged (``--log-level info`` shows it on stderr; stdout stays JSON lines).
"""

from __future__ import annotations

import argparse
import json

from rlt.platform.engine.llm import LLM
from rlt.platform.sampling_params import SamplingParams
import logging

from rlt.platform.composition import format_feature_table
from rlt_server.common import add_engine_arguments, add_feature_flags, die, engine_config, plan, positive_int


log = logging.getLogger("rlt.generate")


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="offline generation to stdout (JSON lines)")
    add_engine_arguments(p)
    g = p.add_argument_group("prompts and sampling")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--prompt-token-ids", action="append", default=[], type=_token_ids,
                   help="prompt as comma-separated token ids (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each --prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=positive_int, default=16)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the best one's probability")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from generated tokens' logits")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence of a generated token")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="prompt and generated tokens: positive logits divided by it, negative ones multiplied")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", dest="request_seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-loops", type=int, default=1)
    g.add_argument("--max-loops", type=int, default=None)
    g.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="stderr log level; info shows the feature table (default: warning)")
    add_feature_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.prompt and not args.prompt_token_ids:
        die("give at least one --prompt or --prompt-token-ids")
    params = SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        seed=args.request_seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        min_loops=args.min_loops, max_loops=args.max_loops, exit_threshold=args.exit_threshold,
    )
    composition = plan(args)
    llm = LLM.from_engine(composition.build_engine(engine_config(args)))
    logging.getLogger().setLevel(args.log_level.upper())
    for line in ["features:", *format_feature_table(llm.engine.features)]:
        log.info("%s", line)
    prompts: list = []
    for text in args.prompt:
        if args.chat:
            text = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            prompts.append(llm.tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(text)
    prompts.extend(args.prompt_token_ids)
    for out in llm.generate(prompts, params):
        print(json.dumps({
            "prompt_token_ids": list(out.prompt_token_ids),
            "token_ids": list(out.token_ids),
            "text": out.text,
            "exit_depths": list(out.exit_depths),
            "finish_reason": out.finish_reason,
        }), flush=True)
    return 0
