"""The features of rlt-prefill: options (CLI flags), requirements and how each installs itself.

``chunked_prefill`` wraps the scheduler policy and sets its ``prompt_chunker`` (the seam of
:mod:`rlt.platform.engine.chunking`) to a :class:`ChunkedPrefillChunker`, so it composes with
any policy that replaces the scheduler (rlt-kvcache's prefix cache and preemption).
``packed_prefill`` wraps the batch builder and the executor; ``prefill_uva`` replaces the
uploader.
"""

from __future__ import annotations

import logging

import attrs

from rlt.platform.engine.assembly import CompositionError
from rlt.platform.engine.interfaces import Wrapped
from rlt.platform.features import Feature
from rlt.platform.platforms import Capability
from rlt.prefill.row_groups import PromptRowGroups, RowGroupBatchBuilder
from rlt.prefill.prompt_backend import choose_prompt_backend
from rlt.prefill.scheduler import (DEFAULT_STEP_OVERHEAD_TOKENS, DEFAULT_STEP_RATIO, ChunkedPrefillChunker, StepCost,
                                   attention_tokens_for)
from rlt.prefill.uva_uploader import StagingUploader

log = logging.getLogger("rlt.prefill")


def _non_negative(flag: str):
    def check(inst, attr, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{flag} must be an integer >= 0, got {value!r}")
    return check


@attrs.frozen
class ChunkedPrefillOptions:
    chunk_size: int = attrs.field(default=0, validator=_non_negative("--prefill-chunk-size"), metadata={
        "flag": "--prefill-chunk-size",
        "help": "most prompt positions in one chunk (0: the step budget, --max-num-batched-tokens)"})
    wavefront: bool = attrs.field(default=False, metadata={
        "help": "wavefront chunked prefill (WCPB): start chunk c+1 once chunk c finished loop 0 "
                "(last_exited layout only)"})
    max_inflight_tokens: int = attrs.field(default=0, validator=_non_negative(
        "--chunked-prefill-max-inflight-tokens"), metadata={
        "help": "most prompt positions in flight between loops, bounding intermediate hidden states "
                "(0: the step budget)"})
    decode_step_ratio: float = attrs.field(default=DEFAULT_STEP_RATIO, metadata={
        "help": "decode smoothness: a step with decode rows carries at most (ratio - 1) x (step overhead + "
                "decode tokens) of attention-weighted prompt row-loops, so it costs at most ratio x a "
                "decode-only step (default 0: no cap, only the step budget; 1.5 aims at decode ITL p99 <= 2x p50 "
                "under long prompts, docs/prefill.md)"})
    step_overhead_tokens: int = attrs.field(default=DEFAULT_STEP_OVERHEAD_TOKENS, metadata={
        "help": "what a decode-only step costs besides its rows (weights read once, launches, host work), in "
                f"prompt row-loops (default {DEFAULT_STEP_OVERHEAD_TOKENS}: the H200 eager executor)"})
    attention_tokens: int = attrs.field(default=0, validator=_non_negative("--chunked-prefill-attention-tokens"),
                                        metadata={
        "help": "context at which a prompt row's attention costs as much as its linear layers "
                "(0: 6 x hidden_size)"})

    @decode_step_ratio.validator
    def _ratio(self, attribute, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value == 0 or value > 1):
            raise ValueError(f"--chunked-prefill-decode-step-ratio must be 0 (off) or a number > 1, got {value!r}")

    @step_overhead_tokens.validator
    def _overhead(self, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--chunked-prefill-step-overhead-tokens must be an integer >= 1, got {value!r}")

    def step_cost(self, hidden_size: int) -> StepCost:
        return StepCost(ratio=float(self.decode_step_ratio), overhead_tokens=self.step_overhead_tokens,
                        attention_tokens=self.attention_tokens or attention_tokens_for(hidden_size))


def install_chunked_prefill(builder, options: ChunkedPrefillOptions) -> None:
    def wrap(ctx, inner):
        policy = inner
        while isinstance(policy, Wrapped):  # the policy itself, under any delegating wrapper
            policy = policy.inner
        if not hasattr(policy, "prompt_chunker"):
            raise CompositionError(f"chunked_prefill needs a scheduler policy with a prompt_chunker (the seam of "
                                   f"rlt.platform.engine.chunking); {type(policy).__name__} has none")
        policy.prompt_chunker = ChunkedPrefillChunker.from_options(
            ctx, chunk_size=options.chunk_size or ctx.max_num_batched_tokens, wavefront=options.wavefront,
            max_inflight_tokens=options.max_inflight_tokens or None,
            step_cost=options.step_cost(ctx.model.shape.hidden_size))
        return inner

    builder.wrap("scheduler", wrap)


@attrs.frozen
class PackedPrefillOptions:
    prompt_backend: str = attrs.field(default="auto", metadata={
        "choices": ("auto", "fa4", "fa3", "fa2"),
        "help": "FlashAttention for prompt rows (auto: the first usable of fa4/fa3/fa2, else none)"})


def install_packed_prefill(builder, options: PackedPrefillOptions, *, prompt_backend=None) -> None:
    """Prompt rows through FlashAttention, the rest through the selected backend, per row group.

    ``prompt_backend``: a backend instance to use instead of choosing one (tests pass the CPU
    stand-in :class:`rlt.prefill.row_groups.PlaneLocalTorchBackend`).
    """
    chosen: dict = {}

    def decide(ctx):
        if ctx not in chosen:
            chosen[ctx] = (prompt_backend, "given") if prompt_backend is not None else \
                choose_prompt_backend(ctx, options.prompt_backend)
            backend, why = chosen[ctx]
            log.info("packed_prefill: %s", why if backend is None else f"{backend.name} for prompt rows ({why})")
        return chosen[ctx][0]

    def wrap_builder(ctx, inner):
        return inner if decide(ctx) is None else RowGroupBatchBuilder(inner, ctx.parts.uploader)

    def wrap_executor(ctx, inner):
        prompt = decide(ctx)
        if prompt is not None:
            other = getattr(ctx.attention, "decode", ctx.attention)  # a fa+triton pair: its decode part
            inner.attention = PromptRowGroups(prompt, other)  # the executor's documented backend attribute
        return inner

    builder.wrap("batch_builder", wrap_builder)
    builder.wrap("executor", wrap_executor)


@attrs.frozen
class PrefillUvaOptions:
    banks: int = attrs.field(default=3, metadata={"help": "staging banks used round robin (reuse waits on events)"})

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.banks, int) or self.banks < 2:
            raise ValueError(f"--prefill-uva-banks must be an integer >= 2, got {self.banks!r}")


def install_prefill_uva(builder, options: PrefillUvaOptions) -> None:
    builder.replace("uploader", lambda ctx: StagingUploader(ctx.device, mapped=ctx.uva.enabled, banks=options.banks))


FEATURES = [
    Feature(name="chunked_prefill", package="rlt-prefill",
            description="prompts in chunks within the step budget (prompts up to max_model_len under any budget); "
                        "--chunked-prefill-wavefront for wavefront chunked prefill",
            requires=frozenset({Capability.CHUNKED_PREFILL}), options=ChunkedPrefillOptions,
            install=install_chunked_prefill, enabled_by_default=True, boundary_attention=True),
    Feature(name="packed_prefill", package="rlt-prefill",
            description="FlashAttention for prompt rows, the selected backend for decode rows (exact under "
                        "adaptive exit)",
            requires=frozenset({Capability.PACKED_PREFILL, Capability.FLASH_ATTENTION}), options=PackedPrefillOptions,
            install=install_packed_prefill, enabled_by_default=True),
    Feature(name="prefill_uva", package="rlt-prefill",
            description="step metadata staged in one pinned host buffer, read by a Triton kernel through UVA",
            requires=frozenset({Capability.MAPPED_HOST_MEMORY, Capability.TRITON}), options=PrefillUvaOptions,
            install=install_prefill_uva, enabled_by_default=False, boundary_attention=True),
]
