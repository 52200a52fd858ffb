"""The engine's extension interfaces: the one public module feature packages program against.

The engine core is an assembly of components, each behind a small protocol defined here. Every
component is built by a factory ``factory(ctx) -> component`` and may be wrapped by features
(``wrap(ctx, inner) -> component``, see :mod:`rlt.platform.engine.assembly`). All factories and
wrappers receive the same frozen :class:`EngineContext`; components built earlier are reachable
through ``ctx.parts`` (build order: uploader, kv_manager, scheduler, sampler, batch_builder,
executor, step_loop).

Threading: one thread owns an engine and calls every component from it (the engine thread of
rlt-serve, or the caller of ``LLM.generate``). Device work is issued on the current stream of the
engine's device; a component that uses other streams orders them with events itself.

The values that travel between components:

- :class:`Row` — the scheduling atom: (request, position range, depth). A request may own several
  rows of one step (wavefront chunks at different depths, speculative verification positions).
- :class:`StepPlan` — what the scheduler decided for a step: the rows, and requests that failed
  at admission (answered with an error; their slot and KV were given back).
- a *batch* — whatever the batch builder produces and its executor consumes; the base pair uses
  :class:`rlt.platform.engine.batch.StepBatch`. It always has ``rows`` (the rows in batch order).
- :class:`StepResult` — the outcome of a step, per row in batch order: which rows exited, and the
  tokens each row produced (ragged: ``num_tokens[i]`` tokens per row, flat arrays after that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

import attrs
import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rlt.attention import AttentionBackend, KVCache, KVLayout
    from rlt.platform.attention_select import AttentionSelection
    from rlt.platform.checkpoint.tokenizer import RltTokenizer
    from rlt.platform.config import EngineConfig
    from rlt.platform.engine.request import Request
    from rlt.platform.engine.slots import SlotTable
    from rlt.platform.models.base import LoopedModel, ModelShape
    from rlt.platform.platforms import Platform
    from rlt.platform.uva import UvaDecision

#: Component names, in build order.
COMPONENTS = ("uploader", "kv_manager", "scheduler", "sampler", "batch_builder", "executor", "step_loop")


# -- values ---------------------------------------------------------------------------------------
@attrs.frozen(eq=False)
class Row:
    """Positions ``[start, start + length)`` of ``request`` run through loop ``depth`` (0-based).

    ``samples``: when this row exits, it produces a token (it ends the prompt, or it is a decode
    row). ``in_prompt``: its positions are prompt positions (they always run the request's full
    depth; the exit gate is not consulted).
    """

    request: "Request"
    slot: int
    start: int
    length: int
    depth: int
    samples: bool
    in_prompt: bool

    @property
    def end(self) -> int:
        return self.start + self.length

    def deeper(self) -> "Row":
        if type(self) is not Row:  # a subclass keeps its type and fields
            return attrs.evolve(self, depth=self.depth + 1)
        return Row(self.request, self.slot, self.start, self.length, self.depth + 1, self.samples, self.in_prompt)

    def token_ids(self) -> Sequence[int]:
        """The input tokens of the row's positions (read for depth-0 rows). The request's own tokens
        here; a row subclass whose positions hold tokens the request has not produced (speculative
        drafts) overrides it, together with :meth:`own_input`."""
        return self.request.token_ids(self.start, self.end)

    def own_input(self) -> bool:
        """Whether the row's input tokens are the request's own (False: :meth:`token_ids` supplies
        tokens the request has not produced). A decode path that keeps sampled tokens on the device
        embeds an own-input decode row's token from there while the host has not read it yet."""
        return True

    def input_on_device(self) -> bool:
        """Whether a depth-0 one-token row's input token exists only on the device, at
        :meth:`input_token_entry` of the executor's token table (rlt-spec: a draft made by the
        previous position's row, never read by the host)."""
        return False

    def input_token_entry(self) -> int:
        """The entry of the executor's token table (``Executor.token_table``) that holds this
        depth-0 row's input token when the host does not have it: the slot's, where the last token
        sampled for the request lands; a row whose input is a device-only draft names the draft's."""
        return self.slot

    #: a one-token row of this type can finish a step without a host read (its feature's
    #: ``finish_decode_lagged``): a static decode path may lag such a step like a plain decode step
    lagged_heads: ClassVar[bool] = True

    #: a one-token decode row of this type may run through a static decode path (rlt-decode's
    #: buffers and graphs): its state between loops lives at :attr:`state_index` of the executor's
    #: state table, and what follows its loops is the executor's ``finish_decode``. A row subclass
    #: whose loops need other inputs (a speculative verification row) sets it False.
    static_decode: ClassVar[bool] = True

    #: a row of this type reads and writes KV through a page table of its own (:meth:`block_table`)
    #: rather than its slot's: rlt-spec's wide-chain candidates, several rows of one request at one
    #: position whose draft-depth KV must stay apart (private blocks in place of the slot's page)
    own_pages: ClassVar[bool] = False

    def block_table(self, tables: np.ndarray) -> np.ndarray:
        """The row's page table ``[planes, pages]`` given the KV manager's ``block_tables``: its
        slot's (a row type with ``own_pages`` substitutes blocks of its own)."""
        return tables[self.slot]

    @property
    def state_index(self) -> int:
        """The row's entry in the executor's state table (``Executor.state_table``) between loops:
        its slot. A row subclass with several one-token rows of one slot in flight (rlt-spec's
        chains) has an entry of its own past the slots."""
        return self.slot


@attrs.frozen(eq=False)
class StepPlan:
    rows: tuple[Row, ...]
    #: (request, error) for requests whose admission failed after resources were taken; the
    #: scheduler gave the resources back, the engine answers them with the error.
    failed: tuple[tuple["Request", BaseException], ...] = ()


@attrs.frozen(eq=False)
class StepResult:
    """Host-side outcome of a step, per row in batch order.

    ``exited[i]``: row i finished its last loop in this step (a prompt row that is not the last
    chunk, or any row that exited, moves on to its next chunk). ``num_tokens[i]`` tokens were
    produced by row i (0 or 1 for plain decoding; several for verification); ``token_ids`` and the
    logprob arrays hold them flat, row after row. ``exit_latency``: how many steps late the exit
    decisions are (0: they describe this step's rows; see ``Executor.exit_latency``).
    """

    exited: np.ndarray
    num_tokens: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    #: row index -> prompt logprob entries of a prompt row that exited (see engine/prompt_logprobs.py)
    prompt_logprobs: Mapping[int, Any] = attrs.field(factory=dict)
    exit_latency: int = 0

    @property
    def token_offsets(self) -> np.ndarray:
        """``[R + 1]``: row i's tokens are ``token_ids[off[i]:off[i + 1]]``."""
        off = np.zeros(len(self.num_tokens) + 1, np.int64)
        np.cumsum(self.num_tokens, out=off[1:])
        return off


@attrs.frozen
class FeatureMetric:
    """One number a component reports for ``/metrics`` (as ``rlt:<name>``, ``_total`` added to
    counters). Any component may define ``feature_metrics() -> Iterable[FeatureMetric]``; the
    engine collects them into ``EngineStats.feature_metrics`` (first of a name wins, so a wrapper
    that delegates does not report twice). ``kind``: "counter" (monotone) or "gauge"."""

    name: str
    value: float
    help: str = ""
    kind: str = "counter"


@attrs.frozen
class KVSpec:
    """Shape of the device KV storage."""

    layout: "KVLayout"
    block_size: int
    num_blocks: int
    num_planes: int
    max_pages: int  # pages of one request at max_model_len


@attrs.define(eq=False)
class Parts:
    """The components built so far, in build order (read them; do not replace them here)."""

    slots: "SlotTable | None" = None
    uploader: Any = None
    kv_manager: Any = None
    scheduler: Any = None
    sampler: Any = None
    batch_builder: Any = None
    executor: Any = None
    step_loop: Any = None


@attrs.frozen(eq=False)
class EngineContext:
    """Everything a component factory needs, fixed when the engine is built."""

    config: "EngineConfig"
    platform: "Platform"
    device: torch.device
    dtype: torch.dtype
    model_dir: str
    model_type: str
    model: "LoopedModel"
    tokenizer: "RltTokenizer"
    cache: "KVCache"
    kv: KVSpec
    attention: "AttentionBackend"
    selection: "AttentionSelection"
    uva: "UvaDecision"
    max_model_len: int
    num_loops: int
    max_num_seqs: int
    max_num_batched_tokens: int
    #: τ for requests that give none (1.0: fixed full depth)
    default_threshold: float
    eos_token_ids: frozenset[int]
    #: options of the enabled features, by feature name
    feature_options: Mapping[str, Any] = attrs.field(factory=dict)
    #: loops of a request that gives no max_loops (``num_loops``, or the model's own count for a
    #: model with per-request depth: Huginn's mean_recurrence); None: ``num_loops``
    default_loops: int | None = None
    #: single-plane KV of the attention layers outside the loop (Huginn's prelude and coda blocks),
    #: block b paired with block b of ``cache`` (addressed through the plane-0 page tables); None
    #: for models without boundary attention
    boundary_cache: "KVCache | None" = None
    parts: Parts = attrs.field(factory=Parts)

    @property
    def shape(self) -> "ModelShape":
        return self.model.shape


# -- component protocols ----------------------------------------------------------------------------
@runtime_checkable
class Uploader(Protocol):
    """Moves a step's small host arrays to the device (copy, pinned async, or mapped host memory).

    ``upload(arrays)`` returns device tensors of the same names, shapes and dtypes. The host
    buffers behind an upload may be reused only after the device has consumed them (ordered by
    events); the arrays passed in may be reused by the caller as soon as ``upload`` returns.
    """

    def upload(self, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class KVManager(Protocol):
    """Host bookkeeping of the paged, depth-aware KV pool (never touches device storage).

    Owns the block allocator, refcounts and the page tables ``block_tables[slot, plane, page]``
    (read-only for everyone else). ``blocks_for`` is the cost of a request up to a number of
    positions; ``allocate`` is all-or-nothing and returns False when the blocks are not free now;
    ``grow`` extends a running request's allocation (incremental managers; the base one allocates
    everything at admission, so ``grow`` is a no-op that returns True); ``match_prefix`` returns
    how many leading prompt positions already have KV (0 without a prefix cache); ``free``
    releases a slot's blocks. A manager may also offer ``reserve(n) -> list[int] | None``: take
    ``n`` free blocks out of the pool for good, for a feature's private use (rlt-spec's wide chains;
    both in-tree managers do), with ``usable_blocks`` the pool less those (what ``can_ever_fit``
    and the admission error measure against).
    """

    block_size: int
    num_planes: int
    block_tables: np.ndarray

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def blocks_for(self, num_positions: int, max_loops: int) -> int: ...

    def can_ever_fit(self, request: "Request") -> bool: ...

    def allocate(self, slot: int, request: "Request") -> bool: ...

    def grow(self, slot: int, request: "Request", num_positions: int) -> bool: ...

    def match_prefix(self, request: "Request") -> int: ...

    def free(self, slot: int) -> None: ...


@runtime_checkable
class SchedulerPolicy(Protocol):
    """Admission, the rows of each step, and how rows move on after a step's outcome.

    ``add`` queues a validated request (it may raise :class:`InvalidRequestError` to veto it);
    ``first_chunk_len`` is the length of a prompt's first chunk (checked against the step budget
    at input processing); ``schedule`` admits what fits and returns the step's plan
    (admission is transactional: a failure after a slot or KV was taken gives both back and lands
    in ``StepPlan.failed``); ``advance`` moves the rows of a finished step on (``done`` holds the
    requests that finished in this step: they own no rows any more); ``finish`` ends a request in
    any state and frees its slot and KV; ``victims`` names running requests to preempt to free
    ``num_blocks`` (none in the base policy, which never overcommits). ``blocked_reason`` says why
    the head of the queue waits. ``supported_exit_latency`` is the largest executor exit latency
    the policy can schedule with. Optional ``on_result(rows, result, done)``: called when a step
    whose rows ``advance`` moved on at launch (with its shape) completes, with the token values —
    a policy that defers decisions to the values (rlt-spec's lagged chains) makes them there.
    Optional ``max_decode_rows``: the most one-token decode rows a step may hold (``max_num_seqs`` when absent; a policy that runs several rows of one request in
    a step, as rlt-spec's chains do, says how many), which a static decode path sizes its buffers by.
    Optional ``rows_of(request)``: the running request's rows in the next step, as ``schedule`` would
    give them (rlt-decode's device-planned steps name the rows the device ran through it; without
    it they never continue). Optional ``max_in_flight``: the most steps a pipelined step loop should
    keep in flight now, or None for the loop's own depth (a policy whose decisions wait on values read
    back late — rlt-spec's chains — asks for fewer while it has such decisions open).
    """

    blocked_reason: str | None
    supported_exit_latency: int

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def add(self, request: "Request") -> None: ...

    def first_chunk_len(self, num_prompt: int) -> int: ...

    def schedule(self) -> StepPlan: ...

    def advance(self, rows: Sequence[Row], result: StepResult, done: set["Request"]) -> None: ...

    def finish(self, request: "Request") -> None: ...

    def running_requests(self) -> Sequence["Request"]: ...

    def victims(self, num_blocks: int) -> list["Request"]: ...


@runtime_checkable
class Sampler(Protocol):
    """Turns the logits of rows that produce a token into tokens (and logprobs).

    ``sample(logits [M, vocab] fp32, slots [M])`` reads the sampling parameters of the slots
    from the slot table. A verifier (speculation) is a sampler that also accepts draft tokens.
    Optional keyword ``device_steps`` (int64 ``[M]`` on the device): the rows' generated counts
    where only the device knows them (seeds and min_tokens use them instead of the slot table's);
    a sampler without it cannot serve rlt-decode's device-planned steps (they stay off).
    Optional keyword ``committed`` (bool ``[M]`` on the device): the rows whose token is produced,
    where only the device knows it (such a step samples every row); the base sampler counts only
    those in a penalised request's token history. rlt-decode passes it with ``device_steps``.
    """

    def sample(self, logits: torch.Tensor, slots: np.ndarray) -> Any: ...


@runtime_checkable
class BatchBuilder(Protocol):
    """Builds a step's batch from its rows: row order, packed token metadata, attention metadata,
    uploaded once through the uploader. The batch has ``rows`` (batch order) and ``num_rows``."""

    def build(self, rows: Sequence[Row]) -> Any: ...


@runtime_checkable
class StepHandle(Protocol):
    def done(self) -> bool: ...

    def result(self) -> StepResult: ...


@runtime_checkable
class Executor(Protocol):
    """Runs a batch on the device: ``execute(batch) -> StepHandle``.

    Owns the device state of every slot (hidden states between loops, exit accumulators) and
    calls the attention backend's ``prepare`` once per step. ``release(slot)`` drops a finished
    slot's state. ``exit_latency``: how many steps late its exit decisions arrive (0: in the
    step's own result). Optional ``supports_prompt_logprobs = True``: it fills
    ``StepResult.prompt_logprobs`` for the batch's jobs (requests asking for them are refused
    otherwise).

    The static decode path (rlt-decode) runs the loops of one-token decode rows itself and needs
    two more members of the executor it wraps: ``state_table`` (``[N, hidden]``, whose first
    ``max_num_seqs`` entries are the per-slot states; a row's state is at ``Row.state_index``) and
    ``finish_decode(batch, last, exited) -> StepResult`` (what follows the loop for those rows:
    exit gate already decided in ``exited``, LM head and sampling of the rows that produce a token,
    or a feature's own heads; ``batch`` has ``rows``, ``slots``, ``depth``, ``row_start``,
    ``fixed_exit``, ``samples`` per row, ``last`` the rows' end-of-loop states). Optional there:
    ``token_table`` (int64 ``[N]``, first ``max_num_seqs`` entries the per-slot last sampled tokens;
    a row whose input is on the device embeds ``token_table[row.input_token_entry()]``; without it
    the static path keeps its own per-slot buffer) and ``finish_decode_lagged(batch, last)`` for
    steps with feature rows that may be lagged: a handle with a host-known ``shape`` (or a
    completed step, when it must read at once).
    """

    exit_latency: int

    def execute(self, batch: Any) -> StepHandle: ...

    def release(self, slot: int) -> None: ...


@runtime_checkable
class StepLoop(Protocol):
    """How steps are driven: ``step(core) -> list[RequestOutput]`` runs (or advances) one step.

    The synchronous loop plans, builds, executes and completes one step per call; a pipelined
    loop may keep several in flight. ``core`` offers ``plan()``, ``launch(plan)`` and
    ``complete(launched)`` (see :class:`rlt.platform.engine.core.EngineCore`).
    """

    def step(self, core: Any) -> list: ...

    def drain(self, core: Any) -> list: ...


@runtime_checkable
class StepObserver(Protocol):
    """Called after every completed step with its batch and result (benchmarks, tests, metrics).
    Must not modify either, and must be cheap: it runs on the engine thread."""

    def on_step(self, batch: Any, result: StepResult) -> None: ...


class Wrapped:
    """Base for a wrapper that changes a few methods of a component and delegates the rest.

    ``class Counting(Wrapped): def schedule(self): ...`` then ``builder.wrap("scheduler",
    lambda ctx, inner: Counting(inner))``. Attribute reads fall through to ``inner``; writes stay
    on the wrapper.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
