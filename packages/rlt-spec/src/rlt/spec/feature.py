"""The self_spec and async_self_spec features: options (engine defaults and flags), startup
refusals, installation.

``self_spec`` installs by wrapping the scheduler policy (rounds), wrapping the sampler (draft,
verify, check) and replacing the executor (:class:`SpeculativeExecutor`). ``async_self_spec``
(needs ``self_spec``) switches every speculating request from synchronous rounds to overlapped
rounds (chains: the next round drafts while the current one verifies, in the same steps).

Refused at startup, naming the setting: the SHARED KV layout (a draft's loops would overwrite the
only KV plane, so rejected drafts could not be rolled back by frontier), an engine default
``draft_loops`` not below the model's loops, an engine default that speculates every request
while adaptive exit is the default.

rlt-kvcache composes: its prefix cache shares only prompt pages with every plane written, and
rounds write past the prompt in the request's own pages; its preemption skips requests whose
round or chain is open (the scheduler holds them: ``Request.preemption_holds``) and resumes the
others from their recorded tokens.

With rlt-decode installed, its features compose through the platform's interfaces alone: every
speculative row is a one-token decode row with its own state-table entry (``Row.static_decode``,
``Row.state_index``), so rlt-decode's batch builder puts steps of speculative and plain decode
rows into its static buffers (sized by the scheduler's ``max_decode_rows``), its executor runs
their loops from them (replaying the same graphs as plain decode steps) and hands the heads to
this package's executor (``finish_decode``). Synchronous rounds' steps are read at once (the rounds
need their drafts on the host), so the pipelined step loop drains before them; overlapped chains'
steps are lagged like plain decode steps (``finish_decode_lagged``: drafts stay in the device token
table, verdicts reach the scheduler through ``on_result``). Steps with prompt rows run eagerly here.
Nothing here imports rlt.decode.
"""

from __future__ import annotations

import attrs

from rlt.attention import KVLayout
from rlt.platform.engine.assembly import CompositionError
from rlt.platform.errors import ConfigError
from rlt.platform.features import Feature
from rlt.platform.platforms import Capability
from rlt.spec.executor import SpeculativeExecutor
from rlt.spec.scheduler import SpeculativeScheduler
from rlt.spec.verify import SpeculativeSampler

#: a speculative step's cost in plain decode steps where plain steps replay CUDA graphs and are pipelined.
#: Speculative steps replay the same graphs but are host-synchronous (the host reads drafts and verdicts
#: before planning the next step) and add an LM head over the rows reaching depth d or D. MEASURED (H200,
#: Ouro-1.4B shapes, bf16, C = 1, benchmarks/results/h200-20261204-lease6, call h, after adaptive K stopped
#: recomputing its rule at every call): synchronous rounds took 1.57-1.73 ms per step against 1.41 ms for a
#: plain step, 1.11-1.23x (call a, before: 1.21-1.51x).
GRAPH_STEP_COST = 1.2
#: the same for overlapped rounds with rlt-decode's pipeline: chain steps are lagged like plain ones (the
#: host reads their drafts and verdicts steps later) and add only the LM head over the rows reaching depth
#: d or D and its sampling. MEASURED there: 1.06x at d = 2 (1.49-1.50 ms); 1.12-1.16x at d = 1, where every
#: step has a draft reaching its exit (the value rounds up the d = 2 one: d = 1 drafts gain more per step,
#: so the lower cost only makes adaptive K slightly more willing there).
LAGGED_STEP_COST = 1.1
#: ``chain_lag``'s default: lease 6 (H200, C = 1) measured chains at pipeline depth 1 against 2 — d = 2:
#: 1.67x vs 1.60x plain at acceptance 0.918, 1.83x vs 1.81x at 0.98; d = 1: 2.51x vs 2.34x, 3.09x vs
#: 2.99x — with plain decoding unchanged; plain steps keep the pipeline's own depth (host slack when
#: serving many requests, where the max_running gate keeps chains off anyway).
CHAIN_LAG = 1
#: wide chains' defaults (docs/spec.md "Wide chains"): four candidates per new position, for one request at
#: a time. MEASURED (H100s, Ouro-1.4B shapes, bf16, C = 1, d = 2, K = 8, benchmarks/results/h100-20261207-lease17
#: to -lease19): four-wide 1.80-1.84x plain decoding at a plain chain's acceptance 0.83 (the plain chain 1.50-1.52x),
#: 1.51x vs 1.11x at 0.59, 1.86x vs 1.78x at 0.95; a wide step cost 1.065-1.09x a plain one at short contexts.
#: Each candidate row reads its request's whole context, so at several requests with long contexts the extra rows
#: cost more than at C = 1 and nothing measured them there: one lane, and a chain starts wide only while one
#: request runs.
WIDE_WIDTH = 4
WIDE_LANES = 1
#: the most candidates per position: each is a row of every wide step and an unrolled pass of the fused heads
MAX_WIDTH = 16

@attrs.frozen
class SpecOptions:
    num_tokens: int = attrs.field(default=0, metadata={
        "help": "default drafts per round for requests that give no speculation (0: only requests that ask)"})
    draft_loops: int = attrs.field(default=0, metadata={
        "help": "default loops a draft runs (0: half the model's loops, at least 1)"})
    max_num_tokens: int = attrs.field(default=8, metadata={"help": "the most drafts per round a request may ask for"})
    adaptive: bool = attrs.field(default=True, metadata={
        "help": "choose K per request from its acceptance rate (docs/spec.md); off: always the requested K"})
    initial_acceptance: float = attrs.field(default=0.8, metadata={"help": "prior acceptance rate of adaptive K"})
    min_gain: float = attrs.field(default=0.05, metadata={
        "help": "adaptive K speculates only when its expected speedup exceeds 1 + this"})
    probe_interval: int = attrs.field(default=16, metadata={
        "help": "plain tokens after which a request at K = 0 tries one round with K = 1"})
    step_cost: float | None = attrs.field(default=None, metadata={
        "help": "adaptive K counts a speculative step as this many plain decode steps (default: "
                f"{GRAPH_STEP_COST:g} when rlt-decode's graphs are on, where plain steps are pipelined and speculative "
                f"ones host-synchronous; {LAGGED_STEP_COST:g} for overlapped rounds with the pipeline, whose steps are "
                "lagged too (chain_lag > 0); 1 otherwise; measured on the H200: benchmarks/spec_bench.py measures it)"})
    max_running: int = attrs.field(default=8, metadata={
        "help": "adaptive K starts no round while more than this many requests run (0: no limit)"})
    chain_lag: int = attrs.field(default=CHAIN_LAG, metadata={
        "help": "while an overlapped chain is open, rlt-decode's pipeline keeps at most this many steps in flight "
                "(a rejection is read this many steps late; the pipeline's --pipeline-depth when smaller; "
                f"default {CHAIN_LAG}: measured faster than depth 2 for chains on the H200, docs/spec.md)"})

    width: int = attrs.field(default=WIDE_WIDTH, metadata={
        "help": "overlapped chains of greedy requests run each new position as this many candidates, the draft's "
                "best tokens, until the draft depth; the one that ran the full-depth token goes on (1: plain chains; "
                f"needs draft_loops >= half the depth; default {WIDE_WIDTH}: measured faster than plain chains at "
                "every acceptance at C = 1; docs/spec.md, 'Wide chains')"})
    wide_lanes: int = attrs.field(default=WIDE_LANES, metadata={
        "help": "requests that may run wide chains at once (each holds width private KV blocks per draft-depth plane, "
                "reserved at startup); a chain starts wide only while at most this many requests run (each candidate "
                f"row reads its whole context: default {WIDE_LANES}, the concurrency wide chains were measured at)"})

    def __attrs_post_init__(self) -> None:
        for name, lo in (("num_tokens", 0), ("draft_loops", 0), ("max_num_tokens", 1), ("probe_interval", 1),
                         ("max_running", 0), ("chain_lag", 0), ("width", 1), ("wide_lanes", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ConfigError(f"--self-spec-{name.replace('_', '-')}: must be an integer >= {lo}, got {value!r}")
        if self.width > MAX_WIDTH:
            raise ConfigError(f"--self-spec-width: at most {MAX_WIDTH} candidates per position, got {self.width} (the "
                              "draft's four best already hold the full-depth token 94-100 % of the time near "
                              "acceptance 0.8: docs/spec.md, 'Wide chains')")
        if self.num_tokens > self.max_num_tokens:
            raise ConfigError(f"--self-spec-num-tokens: {self.num_tokens} exceeds --self-spec-max-num-tokens "
                              f"({self.max_num_tokens})")
        if not 0.0 <= self.initial_acceptance <= 1.0:
            raise ConfigError(f"--self-spec-initial-acceptance: must be in [0, 1], got {self.initial_acceptance}")
        if self.min_gain < 0:
            raise ConfigError(f"--self-spec-min-gain: must be >= 0, got {self.min_gain}")
        if self.step_cost is not None and not self.step_cost > 0:
            raise ConfigError(f"--self-spec-step-cost: must be > 0, got {self.step_cost}")

    def reserved_kv_blocks(self, *, num_loops: int, max_num_seqs: int, features) -> int:
        """The KV blocks wide chains' lanes take out of the pool (the engine sizes the pool for them):
        per lane, ``width`` private blocks per plane below the model's depth."""
        if self.width < 2 or "async_self_spec" not in features:
            return 0
        return min(max_num_seqs, self.wide_lanes) * self.width * (num_loops - 1)

    def summary(self) -> str:
        k = f"K={self.num_tokens} for every request" if self.num_tokens else "per-request opt-in"
        return (f"{k}, adaptive={'on' if self.adaptive else 'off'}; speculative steps run from static buffers "
                "and graphs where rlt-decode is on; synchronous rounds are read at once, overlapped ones lagged "
                "with its pipeline")

    def resolved_step_cost(self, enabled_features) -> float:
        """``step_cost`` as given, else its default for the composition (the help text says which)."""
        if self.step_cost is not None:
            return self.step_cost
        if "graphs" not in enabled_features:
            return 1.0
        lagged = "async_self_spec" in enabled_features and chains_lagged(enabled_features) and self.chain_lag > 0
        return LAGGED_STEP_COST if lagged else GRAPH_STEP_COST

    def resolved_draft_loops(self, num_loops: int) -> int:
        return self.draft_loops or max(1, num_loops // 2)


def check_context(ctx, options: SpecOptions) -> None:
    """Startup refusals that need the built engine context."""
    if ctx.kv.layout is KVLayout.SHARED:
        raise ConfigError("--kv-layout shared: self-speculation needs per-depth KV planes (last_exited); "
                          "rejected drafts cannot be rolled back in the shared layout")
    if options.draft_loops and options.draft_loops >= ctx.num_loops:
        raise ConfigError(f"--self-spec-draft-loops: {options.draft_loops} must be below the model's "
                          f"{ctx.num_loops} loops")
    if options.num_tokens and ctx.num_loops < 2:
        raise ConfigError(f"--self-spec-num-tokens: a model of {ctx.num_loops} loop cannot draft with fewer loops")
    if options.num_tokens + 1 > ctx.max_num_batched_tokens:
        raise ConfigError(f"--self-spec-num-tokens: {options.num_tokens} + 1 verified positions exceed "
                          f"--max-num-batched-tokens ({ctx.max_num_batched_tokens})")
    if options.num_tokens and ctx.default_threshold < 1.0:
        raise ConfigError(f"--self-spec-num-tokens {options.num_tokens} speculates every request, but the default "
                          f"exit_threshold is {ctx.default_threshold} (adaptive exit); speculation needs fixed depth")


def chains_lagged(features) -> bool:
    """Whether overlapped chains' steps are read back lagged in this composition (names of enabled
    features): with rlt-decode's static buffers and pipeline, unless rlt-kvcache's preemption is on
    (the pipeline then drains before every plan, docs/decode.md). Nothing here imports rlt.decode."""
    return "static_buffers" in features and "pipeline" in features and "preemption" not in features


def verdict_lag(ctx, options: SpecOptions) -> int:
    """Steps until a chain's verdict is read: rlt-decode's pipeline depth, at most ``chain_lag``, when chains
    are lagged, else 0."""
    f = ctx.feature_options
    return min(int(getattr(f["pipeline"], "depth", 0)), options.chain_lag) if chains_lagged(f) else 0


def wide_width(ctx, options: SpecOptions) -> int:
    """Candidates per new position of a wide chain in this engine: ``options.width`` with overlapped
    chains on a model without boundary layers (their KV would need private blocks too), else 1."""
    if options.width > 1 and "async_self_spec" in ctx.feature_options and not ctx.model.shape.num_boundary_layers:
        return options.width
    return 1


def install(builder, options: SpecOptions) -> None:
    def scheduler(ctx, inner):
        # at build time: every enabled feature's options are known by then (install order is by name)
        check_context(ctx, options)
        resolved = attrs.evolve(options, step_cost=options.resolved_step_cost(ctx.feature_options))
        return SpeculativeScheduler(inner, options=resolved, kv=ctx.parts.kv_manager, num_loops=ctx.num_loops,
                                    max_num_batched_tokens=ctx.max_num_batched_tokens, num_slots=ctx.max_num_seqs,
                                    overlap="async_self_spec" in ctx.feature_options, lag=verdict_lag(ctx, options),
                                    width=wide_width(ctx, options))

    builder.wrap("scheduler", scheduler)
    builder.wrap("sampler", lambda ctx, inner: SpeculativeSampler(inner, slots=ctx.parts.slots,
                                                                    uploader=ctx.parts.uploader))
    builder.replace("executor", lambda ctx: SpeculativeExecutor.from_context(ctx, max_drafts=options.max_num_tokens,
                                                                             width=wide_width(ctx, options)))


def install_async(builder, options) -> None:
    def check(ctx, inner):
        if "self_spec" not in ctx.feature_options:
            raise CompositionError("async_self_spec overlaps self_spec's rounds: enable self_spec too (--self-spec)")
        return inner

    builder.wrap("scheduler", check)


def features() -> list[Feature]:
    return [
        Feature(name="self_spec", package="rlt-spec", enabled_by_default=False, options=SpecOptions, install=install,
                requires=frozenset({Capability.SPECULATION}),
                description="synchronous self-speculation: draft with few loops, verify with the rest"),
        Feature(name="async_self_spec", package="rlt-spec", enabled_by_default=False, install=install_async,
                requires=frozenset({Capability.SPECULATION}),
                description="overlapped self-speculation (needs self_spec): the next round drafts while the current "
                            "one verifies, in the same steps; drafts stay on the device and verdicts are read lagged "
                            "with rlt-decode's pipeline (host-synchronous without it)"),
    ]
