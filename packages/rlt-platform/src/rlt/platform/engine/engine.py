"""LLMEngine: the loop-level engine, built from an :class:`EngineConfig`.

``add_request`` validates and queues (a rejected request raises :class:`InvalidRequestError` and
changes nothing); ``step`` runs one call of the recurrent core over every running row and
returns the outputs of requests that produced tokens or finished; ``abort_request`` ends a
request and frees its KV. An exception inside a step aborts the requests of that step with the
error recorded, and the engine stays usable.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from typing import Sequence

import attrs

from rlt.attention import KVCache, KVLayout
from rlt.platform.attention_select import AttentionSelection, build_attention, select_attention
from rlt.platform.checkpoint.demo import resolve_model
from rlt.platform.checkpoint.loader import load_checkpoint, read_config, resolve_dtype
from rlt.platform.checkpoint.tokenizer import IncrementalDetokenizer, RltTokenizer
from rlt.platform.config import EngineConfig
from rlt.platform.engine.batch import build_step_batch
from rlt.platform.engine.executor import EagerExecutor, StepResult
from rlt.platform.engine.request import Request, RequestStatus
from rlt.platform.engine.scheduler import Scheduler
from rlt.platform.engine.slots import SlotTable
from rlt.platform.engine.staging import Staging
from rlt.platform.errors import ConfigError, InvalidRequestError
from rlt.platform.kv import KVPool
from rlt.platform.outputs import RequestMetrics, RequestOutput, TokenLogprob
from rlt.platform.platforms import Platform, detect_platform
from rlt.platform.sampling_params import SamplingParams

log = logging.getLogger("rlt.engine")


@attrs.frozen
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_steps: int
    num_faults: int


def _kv_blocks(config: EngineConfig, platform: Platform, bytes_per_block: int, full_need: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if platform.device_module is not None and hasattr(platform.device_module, "mem_get_info"):
        free, _total = platform.device_module.mem_get_info()
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = int((config.kv_cache_memory_gib or 1.0) * 2**30)
    return max(1, min(full_need, budget // bytes_per_block))


class LLMEngine:
    def __init__(self, config: EngineConfig, *, platform: Platform | None = None, executor_factory=None) -> None:
        self.config = config
        self.platform = platform or detect_platform(config.device)
        self.device = self.platform.device()
        if self.platform.name == "npu":
            self.platform.select_device(self.device.index or 0)
        model_dir = resolve_model(config.model)
        _, raw, family, model_cfg = read_config(model_dir)
        if family.engine_unsupported:
            raise ConfigError(f"{model_dir}: {family.engine_unsupported}")
        self.dtype = resolve_dtype(config.dtype, getattr(model_cfg, "torch_dtype", None))
        ckpt = load_checkpoint(model_dir, dtype=self.dtype, device=self.device)
        self.checkpoint = ckpt
        self.model_dir = model_dir
        self.tokenizer = RltTokenizer.from_dir(model_dir)
        self.model = ckpt.family.build_runtime(ckpt.config, ckpt.weights)
        shape = self.model.shape
        if self.tokenizer.vocab_size > shape.vocab_size:
            raise ConfigError(f"tokenizer has {self.tokenizer.vocab_size} tokens but the model only {shape.vocab_size}")
        self.max_model_len = config.max_model_len or shape.max_position_embeddings
        if self.max_model_len > shape.max_position_embeddings:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {shape.max_position_embeddings}")
        self.num_loops = config.num_loops or shape.num_loops
        # Fixed full depth unless asked otherwise (the checkpoint's early_exit_threshold is not a
        # serving default: HF computes every loop regardless, so adopting it would change semantics).
        self.default_threshold = config.exit_threshold if config.exit_threshold is not None else 1.0
        self.max_num_batched_tokens = config.max_num_batched_tokens or self.max_model_len
        self.selection: AttentionSelection = select_attention(
            self.platform, config.attention_backend, dtype=self.dtype, head_dim=shape.head_dim,
            block_size=config.block_size, kv_layout=config.kv_layout, adaptive_exit=not config.fixed_depth)
        self.attention = build_attention(self.platform, self.selection)
        planes = 1 if config.kv_layout is KVLayout.SHARED else self.num_loops
        bpb = KVCache.bytes_per_block(num_layers=shape.num_layers, block_size=config.block_size,
                                      num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=self.dtype)
        pages = -(-self.max_model_len // config.block_size)
        num_blocks = _kv_blocks(config, self.platform, bpb, config.max_num_seqs * pages * planes)
        cache = KVCache.allocate(num_layers=shape.num_layers, num_blocks=num_blocks, block_size=config.block_size,
                                 num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, num_planes=planes,
                                 layout=config.kv_layout, dtype=self.dtype, device=self.device)
        self.pool = KVPool(cache, max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len)
        self.table = SlotTable(config.max_num_seqs)
        self.staging = Staging(self.device)
        self.scheduler = Scheduler(self.pool, self.table, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens)
        factory = executor_factory or EagerExecutor
        self.executor = factory(self.model, cache, self.attention, self.table,
                                max_num_seqs=config.max_num_seqs, device=self.device)
        self.eos_token_ids = frozenset(ckpt.family.stop_token_ids(ckpt.config, self.tokenizer)) & set(range(shape.vocab_size))
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._rng = random.Random(config.seed)
        self._pending: list[RequestOutput] = []
        self.num_steps = 0
        self.num_faults = 0

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        text = None
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenize(prompt)
        else:
            ids = list(prompt)
        req = self._make_request(request_id, ids, params, text)
        self._requests[request_id] = req
        self.scheduler.add(req)

    def _make_request(self, request_id: str, ids: list[int], params: SamplingParams, text: str | None) -> Request:
        vocab = self.model.shape.vocab_size
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        n = len(ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens; this model's maximum context length is {self.max_model_len} tokens "
                "(prompt plus at least one generated token)")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has {n} "
                f"tokens and max_tokens is {max_tokens}; lower max_tokens to at most {self.max_model_len - n}")
        if self.scheduler.first_chunk_len(n) > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {n} tokens, more than max_num_batched_tokens ({self.max_num_batched_tokens}) "
                "that full prefill can run in one step")
        max_loops = params.max_loops if params.max_loops is not None else self.num_loops
        if max_loops > self.num_loops:
            raise InvalidRequestError(f"max_loops {max_loops} exceeds the engine's {self.num_loops} loops")
        if params.min_loops > max_loops:
            raise InvalidRequestError(f"min_loops {params.min_loops} exceeds max_loops {max_loops}")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids: {bad_stop[0]} is outside the vocabulary [0, {vocab})")
        threshold = params.exit_threshold if params.exit_threshold is not None else self.default_threshold
        if threshold < 1.0 and not self.model.has_exit_gate:
            raise InvalidRequestError(f"exit_threshold {threshold} asks for adaptive exit, but this model has no exit "
                                      "gate (fixed depth); omit exit_threshold or set it to 1.0", "exit_threshold")
        if threshold < 1.0 and self.config.fixed_depth:
            raise InvalidRequestError(
                f"exit_threshold {threshold} asks for adaptive exit, but this engine serves fixed depth "
                "(--fixed-depth); omit exit_threshold or set it to 1.0")
        req = Request(
            request_id=request_id, prompt_token_ids=ids, params=params, max_tokens=max_tokens,
            max_loops=max_loops, min_loops=params.min_loops, exit_threshold=float(threshold),
            stop_token_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids),
            arrival_index=next(self._arrivals), prompt_text=text,
        )
        if not self.pool.can_ever_fit(req.max_positions, max_loops):
            need = self.pool.blocks_needed(req.max_positions, max_loops)
            raise InvalidRequestError(
                f"request needs {need} KV blocks ({req.max_positions} positions x {self.pool.planes_for(max_loops)} "
                f"depth planes) but the pool has {self.pool.allocator.num_blocks}; lower max_tokens or give the "
                "KV cache more memory")
        req.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return req

    def _seed_for(self, req: Request) -> int:
        return req.params.seed if req.params.seed is not None else self._rng.getrandbits(64)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return None
        self._finish(req, "abort")
        out = self._output(req)
        self._requests.pop(request_id, None)
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def stats(self) -> EngineStats:
        a = self.pool.allocator
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, self.pool.usage,
                           a.num_blocks, a.num_free, self.num_steps, self.num_faults)

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        rows = self.scheduler.schedule(self._seed_for)
        if not rows:
            return outputs
        self.num_steps += 1
        try:
            batch = build_step_batch(rows, self.table, self.pool, self.staging)
            result = self.executor.execute(batch).result()
        except Exception as exc:  # an engine fault: abort what this step touched, stay up
            self.num_faults += 1
            log.exception("engine step failed; aborting %d request(s)", len(rows))
            for req in rows:
                req.error = f"engine fault: {type(exc).__name__}: {exc}"
                self._finish(req, "abort")
                outputs.append(self._output(req))
                self._requests.pop(req.request_id, None)
            return outputs
        outputs.extend(self._apply(rows_in_order(rows, batch.slots), result))
        return outputs

    def _apply(self, rows: list[Request], result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        sampled = {int(i): k for k, i in enumerate(result.sampled_rows)}
        outputs = []
        for i, req in enumerate(rows):
            k = sampled.get(i)
            if k is not None:
                self._append_token(req, result, k, now)
            exited = bool(result.exited[i])
            if req.finished:
                outputs.append(self._output(req))
                self._requests.pop(req.request_id, None)
                continue
            self.scheduler.advance(req, exited, k is not None)
            if k is not None:
                outputs.append(self._output(req))
        return outputs

    def _append_token(self, req: Request, result: StepResult, k: int, now: float) -> None:
        tok = int(result.token_ids[k])
        req.output_token_ids.append(tok)
        req.exit_depths.append(req.depth + 1)
        self.table.num_generated[req.slot] = len(req.output_token_ids)
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.logprobs is not None:
            top = ()
            if req.params.logprobs > 0 and result.top_ids is not None:
                n = req.params.logprobs
                top = tuple(zip(result.top_ids[k, :n].tolist(), result.top_logprobs[k, :n].tolist()))
            req.logprobs.append(TokenLogprob(tok, float(result.logprobs[k]), top))
        delta = req.detok.push(tok)
        n_out = len(req.output_token_ids)
        if tok in req.stop_token_ids and n_out >= req.params.min_tokens:
            req.stop_reason = tok if tok not in self.eos_token_ids or tok in req.params.stop_token_ids else None
            self._finish(req, "stop")
            return
        req.text = req.detok.text
        if req.params.stop and n_out >= req.params.min_tokens and delta:
            longest = max(map(len, req.params.stop))
            window_start = max(0, len(req.text) - len(delta) - longest + 1)
            hits = [(req.text.find(s, window_start), s) for s in req.params.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                req.text = req.text[:pos]
                req.stop_reason = s
                self._finish(req, "stop")
                return
        if n_out >= req.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        if req.finish_reason is None:
            req.finish_reason = reason
        if req.detok is not None and not isinstance(req.stop_reason, str):
            req.text = req.detok.text  # a stop string has already cut the text; keep that cut
        slot = req.slot
        running = req.status is RequestStatus.RUNNING
        if running and self.platform.sync_before_reuse:
            self.platform.synchronize()  # the device may still read this slot's pages and metadata
        self.scheduler.finish(req)
        if running:
            self.executor.release(slot)
        req.finished_time = time.monotonic()

    def _output(self, req: Request) -> RequestOutput:
        new_ids = tuple(req.output_token_ids[req.reported_tokens:])
        new_text = req.text[req.reported_text:]
        req.reported_tokens = len(req.output_token_ids)
        req.reported_text = len(req.text)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            token_ids=tuple(req.output_token_ids),
            text=req.text,
            exit_depths=tuple(req.exit_depths),
            finished=req.finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=tuple(req.logprobs) if req.params.logprobs is not None else None,
            new_token_ids=new_ids,
            new_text=new_text,
            metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time),
            error=req.error,
        )


def rows_in_order(rows: list[Request], slots) -> list[Request]:
    by_slot = {r.slot: r for r in rows}
    return [by_slot[int(s)] for s in slots]
