"""The features rlt-decode registers: ``static_buffers``, ``graphs``, ``pipeline`` and ``persistent_loop``.

``static_buffers`` (any platform) wraps the batch builder and the executor so that decode-only
steps run from static, bucketed buffers (:mod:`rlt.decode.batch`, :mod:`rlt.decode.executor`).
``graphs`` (platforms declaring graph capture: CUDA, ROCm) turns on graph capture and replay of
those steps; it needs ``static_buffers`` and says so at composition if that one is off. On a
platform without graph capture (CPU, Ascend) ``graphs`` is absent with the reason and decode
steps of ``static_buffers`` run eagerly from the same buffers (the logic CI tests).
``pipeline`` (platforms declaring async execution: CPU, CUDA, ROCm) replaces the step loop with
:class:`rlt.decode.pipeline.PipelinedStepLoop` and marks decode steps with host-known exits as
lagged; it needs ``static_buffers`` (without it the base synchronous step loop stays, with a
warning). On CPU the device is synchronous, but the same lagged logic
runs (tokens are read ``depth`` steps late), which is what CI tests.
``persistent_loop`` (off by default; platforms declaring graph capture, and at composition an NVIDIA GPU of
compute capability 9.0+ with a bf16 Ouro model of the kernel's shapes) runs the loop of one-row decode
steps as one persistent kernel (:mod:`rlt.decode.persistent`) inside the static path's graphs.
"""

from __future__ import annotations

import inspect
import logging
import os

import attrs

from rlt.platform.engine.assembly import CompositionError
from rlt.platform.engine.core import SyncStepLoop
from rlt.platform.features import Feature
from rlt.platform.platforms import Capability


def _buckets(text) -> tuple[int, ...]:
    if isinstance(text, (tuple, list)):
        return tuple(int(t) for t in text)
    try:
        values = tuple(int(t) for t in str(text).split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--static-buffers-row-buckets: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"--static-buffers-row-buckets: bucket sizes must be >= 1, got {text!r}")
    return values


@attrs.frozen
class StaticBufferOptions:
    row_buckets: tuple[int, ...] = attrs.field(default=(), converter=_buckets, metadata={
        "help": "decode row-count buckets, comma-separated (default: powers of two up to --max-num-seqs)",
        "type": str})


@attrs.frozen
class GraphOptions:
    max_graphs: int = attrs.field(default=128, metadata={"help": "most captured decode graphs (default 128)"})
    memory_mib: float = attrs.field(default=4096.0, metadata={
        "help": "graph memory budget in MiB; past it new shapes run eagerly (default 4096)"})
    capture_at_startup: bool = attrs.field(default=True, metadata={
        "help": "capture every (row bucket, context bucket) decode graph when the engine starts, smallest "
                "contexts first, within the count and memory limits (default on; off: on each shape's first step)"})


@attrs.frozen
class PersistentLoopOptions:
    stages: int = attrs.field(default=12, metadata={
        "help": "16 KB weight stages in each CTA's shared-memory ring of the loop kernel (2..12; default 12)"})

    l2_ahead: int = attrs.field(default=0, metadata={
        "help": "stages of its next phase each CTA's producer prefetches into L2 as it starts a phase (0..32; "
                "default 0: none — not yet measured, docs/decode.md)"})

    @stages.validator
    def _check(self, attribute, value) -> None:
        if not isinstance(value, int) or not 2 <= value <= 12:
            raise ValueError(f"--persistent-loop-stages: expected an integer in 2..12, got {value!r}")

    @l2_ahead.validator
    def _check_ahead(self, attribute, value) -> None:
        if not isinstance(value, int) or not 0 <= value <= 32:
            raise ValueError(f"--persistent-loop-l2-ahead: expected an integer in 0..32, got {value!r}")


@attrs.frozen
class PipelineOptions:
    depth: int = attrs.field(default=2, metadata={
        "help": "decode steps kept in flight before the oldest one's tokens are read (default 2; 0: read "
                "each step's tokens right after launching the next one is planned)"})

    device_exit: bool | None = attrs.field(default=None, metadata={
        "help": "device-planned steps under adaptive exit: a decode step where a row may exit on the gate is "
                "launched without reading its exits, and while the host could plan nothing else (no admission, "
                "finish or max_tokens due) the next steps of the same rows are planned on the device from its exit "
                "mask; exits and tokens are read back with the lag (default: on for a GPU — H200, C=64 at tau 0.7: "
                "4,827 vs 4,131 decode tok/s host-planned; off on CPU, where every op is host work and they were "
                "8-12 %% slower)"})

    @depth.validator
    def _check(self, attribute, value) -> None:
        if not isinstance(value, int) or value < 0 or value > 8:
            raise ValueError(f"--pipeline-depth: expected an integer in 0..8, got {value!r}")


def device_exit_off_reason(ctx) -> str:
    """Why decode steps with gate rows are not open (device-planned steps off), or ""."""
    pipeline = ctx.feature_options.get("pipeline")
    if pipeline is None:
        return "pipeline feature off"
    if pipeline.device_exit is False:
        return "--no-pipeline-device-exit"
    if pipeline.device_exit is None and ctx.device.type == "cpu":
        return "off by default on CPU (no host/device overlap to win; --pipeline-device-exit turns it on)"
    if "preemption" in ctx.feature_options:
        return "preemption is on (incremental KV allocation; the step loop drains before every plan)"
    sample = ctx.parts.sampler.sample
    if not {"device_steps", "committed"} <= set(inspect.signature(sample).parameters):
        return (f"the sampler ({type(ctx.parts.sampler).__name__}) takes no device step counters or "
                "committed-row mask")
    return ""


def _install_static(builder, options: StaticBufferOptions) -> None:
    from rlt.decode.batch import StaticBatchBuilder, context_buckets
    from rlt.decode.executor import StaticDecodeExecutor

    state = {}

    def batch_builder(ctx, inner):
        state["device_exit_off"] = device_exit_off_reason(ctx)
        state["builder"] = StaticBatchBuilder(
            inner, kv=ctx.parts.kv_manager, slots=ctx.parts.slots, layout=ctx.kv.layout, device=ctx.device,
            max_rows=getattr(ctx.parts.scheduler, "max_decode_rows", ctx.max_num_seqs),
            max_model_len=ctx.max_model_len, row_buckets=options.row_buckets,
            pipelined="pipeline" in ctx.feature_options, mapped=ctx.uva.enabled and _kernels_run_on(ctx.device),
            device_exit=not state["device_exit_off"])
        return state["builder"]

    def executor(ctx, inner):
        graphs = ctx.feature_options.get("graphs")
        if graphs is not None and not ctx.attention.spec.graph_safe:
            reason = f"attention backend {ctx.selection.name} is not graph-safe"
        elif graphs is None:
            reason = ("platform lacks graph_capture" if not ctx.platform.has(Capability.GRAPH_CAPTURE)
                      else "graphs disabled (--no-graphs)")
        else:
            reason = ""
        b = state["builder"]
        ex = StaticDecodeExecutor(
            inner, ctx=ctx, buffers=b.buffers, row_buckets=b.row_buckets, use_graphs=not reason,
            max_graphs=graphs.max_graphs if graphs else 0, graph_memory_mib=graphs.memory_mib if graphs else None,
            graphs_off_reason=reason, ring_size=_ring_size(ctx), persistent=_persistent_loop(ctx))
        ex.pipeline.device_exit_off_reason = state["device_exit_off"]
        if graphs is not None and graphs.capture_at_startup:
            ex.capture_startup(context_buckets(ctx.max_model_len))
        return ex

    builder.wrap("batch_builder", batch_builder)
    builder.wrap("executor", executor)


def _persistent_loop(ctx):
    """The ``persistent_loop`` feature's loop kernel for this engine (None when the feature is off); a
    composition error naming why it cannot run here (model, dtype, GPU, compiler)."""
    options = ctx.feature_options.get("persistent_loop")
    if options is None:
        return None
    from rlt.decode.persistent import build_persistent_loop

    try:
        return build_persistent_loop(ctx.model, ctx.cache, ctx.device, stages=options.stages,
                                     l2_ahead=options.l2_ahead)
    except ValueError as exc:
        raise CompositionError(f"persistent_loop: {exc}; drop --persistent-loop") from None


def _kernels_run_on(device) -> bool:
    """Triton kernels run on this device (a GPU; the interpreter in tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _needs_static_buffers(name: str, fix: str):
    """The install of a feature that only configures the static executor (``_install_static`` reads its
    options): at composition, refuse it without ``static_buffers``, saying how to fix it."""
    def install(builder, options) -> None:
        def check(ctx, inner):
            if "static_buffers" not in ctx.feature_options:
                raise CompositionError(f"{name} needs the static_buffers feature; {fix}")
            return inner

        builder.wrap("executor", check)

    return install


def _ring_size(ctx) -> int:
    pipeline = ctx.feature_options.get("pipeline")
    return 2 + (pipeline.depth if pipeline is not None else 0)  # entries live at once: depth + the one launching


def _install_pipeline(builder, options: PipelineOptions) -> None:
    from rlt.decode.pipeline import PipelinedStepLoop

    def step_loop(ctx):
        if "static_buffers" not in ctx.feature_options:  # on by default: not an error, nothing to pipeline
            log.warning("pipeline needs the static_buffers feature, which is off: steps run synchronously")
            return SyncStepLoop()
        executor = ctx.parts.executor
        drain = ("preemption is on (a preempted request is rebuilt from recorded tokens)"
                 if "preemption" in ctx.feature_options else "")
        return PipelinedStepLoop(depth=options.depth, stats=executor.pipeline, max_rows=executor.buffers.max_rows,
                                 drain_every_step=drain)

    builder.replace("step_loop", step_loop)


log = logging.getLogger("rlt.decode")

FEATURES = [
    Feature(name="static_buffers", package="rlt-decode",
            description="decode-only steps from static, bucketed device buffers (one upload per step)",
            options=StaticBufferOptions, install=_install_static),
    Feature(name="graphs", package="rlt-decode",
            description="capture and replay decode-only steps as CUDA/HIP graphs (needs static_buffers)",
            requires=frozenset({Capability.GRAPH_CAPTURE}), options=GraphOptions,
            install=_needs_static_buffers("graphs", "drop --no-static-buffers or add --no-graphs")),
    Feature(name="persistent_loop", package="rlt-decode",
            description="one-row decode steps run each loop as ONE persistent kernel (Ouro, bf16, NVIDIA compute "
                        "capability 9.0+; needs static_buffers; off by default: measured slower than the kernel-per-op "
                        "graph so far, docs/decode.md)",
            requires=frozenset({Capability.GRAPH_CAPTURE}), options=PersistentLoopOptions,
            install=_needs_static_buffers("persistent_loop", "drop --no-static-buffers"), enabled_by_default=False),
    Feature(name="pipeline", package="rlt-decode",
            description="token-level pipeline: decode steps in flight, sampled tokens kept on the device and read "
                        "back with a bounded lag (needs static_buffers)",
            requires=frozenset({Capability.ASYNC_EXECUTION}), options=PipelineOptions, install=_install_pipeline),
]
