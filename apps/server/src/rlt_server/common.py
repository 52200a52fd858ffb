"""Flags shared by every subcommand, and the one place bad input becomes one line on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

from rlt.attention import KVLayout
from rlt.platform.attention_select import ATTENTION_CHOICES
from rlt.platform.config import EngineConfig
from rlt.platform.errors import RltError
from rlt.platform.platforms import DEVICE_CHOICES, PlatformError


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="checkpoint directory (Hugging Face layout); default: the built-in demo model")
    g.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_CHOICES)
    g.add_argument("--kv-layout", default="last_exited", choices=[k.value for k in KVLayout])
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--num-kv-blocks", type=positive_int, default=None, help="KV pool size in blocks (default: from memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-gib", type=float, default=None, help="KV budget on CPU (default 1 GiB)")
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--max-model-len", type=positive_int, default=None)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    g.add_argument("--num-loops", type=positive_int, default=None, help="depth planes / most loops per token (default: the model's)")
    g.add_argument("--fixed-depth", action="store_true",
                   help="no request may exit early (exit_threshold < 1 is rejected); lets FlashAttention serve "
                        "the last_exited layout")
    g.add_argument("--engine-seed", type=int, default=0, help="seeds the sampling of requests that give no seed")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
        kv_layout=args.kv_layout, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, num_loops=args.num_loops, seed=args.engine_seed,
        fixed_depth=args.fixed_depth,
    )


def die(message: str) -> NoReturn:
    print(f"rlt-server: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_guarded(fn: Callable[[], int]) -> int:
    """Run ``fn``; user-facing errors become one stderr line and exit code 2, never a traceback."""
    try:
        return fn()
    except (RltError, PlatformError, ValueError) as exc:
        die(str(exc))
    except KeyboardInterrupt:
        return 130
