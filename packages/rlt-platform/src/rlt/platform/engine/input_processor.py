"""Input processing: a prompt and its sampling parameters -> a validated :class:`Request`.

Tokenizes text prompts, checks every limit the engine enforces (vocabulary, context length,
loop bounds, KV capacity, the prompt-chunk budget) and resolves defaults (max_tokens, max_loops,
τ, stop ids, the sampling seed). A rejected request raises :class:`InvalidRequestError` with the
field it is about and changes nothing. Runs on the engine's thread; touches no component state
but the KV manager's capacity (read-only) and the engine's seed RNG.
"""

from __future__ import annotations

import itertools
import random
from typing import Sequence

from rlt.platform.checkpoint.tokenizer import IncrementalDetokenizer
from rlt.platform.engine.request import Request
from rlt.platform.errors import InvalidRequestError
from rlt.platform.sampling_params import SamplingParams
from rlt.platform.validation import check_token_ids


class InputProcessor:
    def __init__(self, ctx, *, kv_manager, scheduler) -> None:
        self.ctx = ctx
        self.kv = kv_manager
        self.scheduler = scheduler
        #: ids that end generation unless a request sets ignore_eos (the model family's stop ids)
        self.eos_token_ids = ctx.eos_token_ids
        self._arrivals = itertools.count()
        self._rng = random.Random(ctx.config.seed)

    def tokenize(self, prompt: str) -> list[int]:
        return self.ctx.tokenizer.encode(prompt, add_special_tokens=True)

    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None) -> Request:
        ctx = self.ctx
        params = params or SamplingParams()
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = ctx.shape.vocab_size
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token", "prompt")
        check_token_ids(ids, vocab)
        n, limit = len(ids), ctx.max_model_len
        if n >= limit:
            raise InvalidRequestError(
                f"prompt has {n} tokens; this model's maximum context length is {limit} tokens "
                "(prompt plus at least one generated token)", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, but the prompt has {n} "
                f"tokens and max_tokens is {max_tokens}; lower max_tokens to at most {limit - n}", "max_tokens")
        if params.min_tokens > max_tokens:  # an explicit max_tokens was checked by SamplingParams
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this request can generate "
                f"(max_tokens unset: the context left after the {n}-token prompt)", "min_tokens")
        if self.scheduler.first_chunk_len(n) > ctx.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {n} tokens, more than max_num_batched_tokens ({ctx.max_num_batched_tokens}) "
                "that full prefill can run in one step; raise --max-num-batched-tokens or install rlt-prefill "
                "(chunked prefill)", "prompt")
        max_loops = params.max_loops if params.max_loops is not None else (ctx.default_loops or ctx.num_loops)
        if max_loops > ctx.num_loops:
            raise InvalidRequestError(f"max_loops {max_loops} exceeds the engine's {ctx.num_loops} loops", "max_loops")
        if params.min_loops > max_loops:
            bound = f"max_loops {max_loops}" if params.max_loops is not None else f"the {max_loops} loops requests run"
            raise InvalidRequestError(f"min_loops: {params.min_loops} exceeds {bound}", "min_loops")
        executor = ctx.parts.executor
        if params.prompt_logprobs is not None and not getattr(executor, "supports_prompt_logprobs", False):
            raise InvalidRequestError(f"prompt_logprobs: this engine's executor ({type(executor).__name__}) "
                                      "cannot compute prompt logprobs; leave prompt_logprobs unset", "prompt_logprobs")
        sampler = ctx.parts.sampler
        if params.penalized and getattr(sampler, "penalties", None) is None:
            field = params.penalties_on[0]
            raise InvalidRequestError(f"{field}: this engine's sampler ({type(sampler).__name__}) keeps no token "
                                      "history for penalties; leave the penalties at their defaults", field)
        if params.speculation is not None and not getattr(self.scheduler, "accepts_speculation", False):
            raise InvalidRequestError("speculation: this engine does not speculate; enable the self_spec feature "
                                      "(rlt-spec, --self-spec) or leave speculation unset", "speculation")
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        check_token_ids([t for t, _ in params.logit_bias], vocab, "logit_bias")
        threshold = params.exit_threshold if params.exit_threshold is not None else ctx.default_threshold
        if threshold < 1.0 and not ctx.model.has_exit_gate:
            raise InvalidRequestError(f"exit_threshold {threshold} asks for adaptive exit, but this model has no exit "
                                      "gate (fixed depth); omit exit_threshold or set it to 1.0", "exit_threshold")
        if threshold < 1.0 and ctx.config.fixed_depth:
            raise InvalidRequestError(
                f"exit_threshold {threshold} asks for adaptive exit, but this engine serves fixed depth "
                "(--fixed-depth); omit exit_threshold or set it to 1.0", "exit_threshold")
        init_scale = params.init_state_scale
        if init_scale is not None and not ctx.model.has_initial_state:
            raise InvalidRequestError(f"init_state_scale: this model ({ctx.model_type}) has no random initial state; "
                                      "leave init_state_scale unset", "init_state_scale")
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        req = Request(
            request_id=request_id, prompt_token_ids=ids, params=params, max_tokens=max_tokens,
            max_loops=max_loops, min_loops=params.min_loops, exit_threshold=float(threshold),
            stop_token_ids=stops, arrival_index=-1,
            init_state_scale=float(ctx.config.init_state_scale if init_scale is None else init_scale)
            if ctx.model.has_initial_state else 0.0,
        )
        if not self.kv.can_ever_fit(req):
            usable = getattr(self.kv, "usable_blocks", self.kv.num_blocks)  # less blocks features reserved
            need = self.kv.blocks_for(n, max_loops)
            if need > usable:  # the prompt alone, whatever max_tokens
                raise InvalidRequestError(
                    f"request needs {need} KV blocks for its prompt alone ({n} positions x up to {max_loops} depth "
                    f"planes) but the pool has {usable}; shorten the prompt or give the KV cache more "
                    "memory", "prompt")
            need = self.kv.blocks_for(req.max_positions, max_loops)
            raise InvalidRequestError(
                f"request needs {need} KV blocks ({req.max_positions} positions x up to {max_loops} depth planes) "
                f"but the pool has {usable}; lower max_tokens or give the KV cache more memory",
                "max_tokens")
        req.detok = IncrementalDetokenizer(ctx.tokenizer, ids, params.skip_special_tokens)
        # Accepted: only now does it take an arrival number and (unseeded) a draw of the engine's RNG.
        req.arrival_index = next(self._arrivals)
        req.seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        return req
