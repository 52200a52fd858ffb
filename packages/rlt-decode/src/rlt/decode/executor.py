"""The static decode executor: decode-only steps from static buffers, eagerly or as graph replays.

For a :class:`DecodeBatch` the whole loop step — input (embedding of depth-0 rows, else the slot's
hidden state), depth stamps, every layer, the end-of-loop norm, the gate and the exit accumulator,
the slot's new hidden state — is one function of the static buffers (:meth:`_loop_step`). With
graphs on, it is captured once per (row bucket, context bucket) and replayed: every shape when the
engine starts (:meth:`capture_startup`, within the count and memory limits), or, with startup
capture off or past the limits, on the first step of the shape, which runs it eagerly (compiling
the kernels) and then captures it, so a capture never runs a step twice. The LM head and sampling of exiting rows follow eagerly (their row count
varies); the host reads the exit mask only when a row consults the gate — unless the step is
*open* (device-planned steps on): then every row is sampled, exits and tokens are read back with
the lag, and :meth:`continue_open` runs the next step as the device plans it from the exit mask.

Every sampled token also lands in the resident per-slot token buffer (``tokens``); a depth-0 row
whose token the host has not read yet embeds from it (inside the graph). A *lagged* batch
(the pipeline on, every exit known on the host) returns a :class:`rlt.decode.readback.LaggedStep`:
its tokens are copied into a pinned ring entry without a host wait and read when the step loop
consumes the step. Host syncs per step and in-flight depth are counted in ``describe()["pipeline"]``.

The per-slot device state (hidden states, exit accumulators) is the inner executor's: a row may
run one loop in an eager step (mixed with prefill) and the next from the static buffers. Every
other batch goes to the inner executor. Capture time, graph memory, replays and eager fallbacks
(with their reasons) are counted in :meth:`describe` (``/v1/engine``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import attrs
import numpy as np
import torch

from rlt.attention import AttentionMetadata, KVLayout
from rlt.decode.batch import DecodeBatch, context_bucket
from rlt.decode.readback import LaggedStep, OpenStep, PipelineStats, PinnedRing
from rlt.platform.engine.executor import CompletedStep
from rlt.platform.engine.exit_policy import OuroGateExit
from rlt.platform.engine.interfaces import StepResult, Wrapped
from rlt.platform.engine.staging import to_device

log = logging.getLogger("rlt.decode")


@attrs.define(eq=False)
class _DeviceRun:
    """The open step the next device-planned step follows: its batch (the host-planned first step
    of the run), its rows' slots and generated counts on the device."""

    batch: DecodeBatch
    slots: torch.Tensor  # [R] device
    generated: torch.Tensor  # [R] int64 device: tokens each row's request has generated before the next step
    steps: int = 0  # steps planned on the device since the host planned ``batch``


class StaticDecodeExecutor(Wrapped):
    def __init__(self, inner, *, ctx, buffers, row_buckets, use_graphs: bool, max_graphs: int = 64,
                 graph_memory_mib: float | None = None, graphs_off_reason: str = "", ring_size: int = 4,
                 persistent=None) -> None:
        super().__init__(inner)
        missing = [m for m in ("state_table", "remaining", "finish_decode") if not hasattr(inner, m)]
        if missing:
            raise TypeError(f"static_buffers wraps an executor with {', '.join(missing)} (the platform's Executor "
                            f"protocol, static decode path); {type(inner).__name__} lacks them")
        #: the inner executor's state table: per-slot states first, then any feature's own entries
        self.states = inner.state_table
        self.model = ctx.model
        self.kv = ctx.cache
        self.attention = ctx.attention
        self.sampler = ctx.parts.sampler
        self.device = ctx.device
        self.buffers = buffers
        self.row_buckets = tuple(row_buckets)
        self.exit_policy = OuroGateExit
        self.use_graphs = use_graphs
        self.max_graphs = max_graphs
        self.graph_memory_bytes = None if graph_memory_mib is None else int(graph_memory_mib * 2**20)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._pool = None
        self.stats = Counter()
        self.fallbacks: Counter = Counter()
        #: why decode steps do not replay graphs, when they cannot
        self.graphs_off_reason = "" if use_graphs else (graphs_off_reason or "graphs off")
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.startup_seconds = 0.0
        self.startup_graphs = 0
        #: the resident per-slot token buffer: every token a decode step samples lands here, and
        #: depth-0 rows whose token is still in flight embed from it (inside the captured graph)
        #: (the inner executor's token table when it has one: its first entries are these, the rest
        #: a feature's device-only tokens, e.g. rlt-spec's drafts)
        self.tokens = getattr(inner, "token_table", None)
        if self.tokens is None:
            self.tokens = torch.zeros(ctx.max_num_seqs, dtype=torch.int64, device=self.device)
        self.ring = PinnedRing(ring_size, buffers.max_rows, self.device)
        self.pipeline = PipelineStats()
        self.slot_table = ctx.parts.slots
        self.max_model_len = ctx.max_model_len
        #: the run of open steps the device may continue (None: the last step was not open)
        self._device_run: _DeviceRun | None = None
        #: what the device planning of the next step reads (static: its graphs replay over them): the
        #: last open step's exit mask and the run's real row count
        self._exited = torch.zeros(buffers.max_rows, dtype=torch.bool, device=self.device)
        self._num_rows = torch.zeros((), dtype=torch.int64, device=self.device)
        #: the device planning captured per row bucket (with graphs on), and why it runs eagerly if not
        self._advance_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.advance_off_reason = ""
        #: one-row decode steps' loop as one kernel (``persistent_loop``, :mod:`rlt.decode.persistent`), or None
        self.persistent = persistent

    @property
    def exit_latency(self) -> int:
        return self.inner.exit_latency

    # -- the captured function ------------------------------------------------------------------
    def _loop_step(self, bucket: int, context: int):
        f = self.buffers.fields(bucket)
        pages = -(-context // self.kv.block_size)
        tables = self.buffers.tables.index_select(0, f.table)[:, :, :pages]
        meta = AttentionMetadata(
            query_start_loc=self.buffers.qsl[: bucket + 1], seq_lens=f.seq_len, query_depth=f.depth,
            block_tables=tables, slot_mapping=f.slot_mapping, plane0_slot_mapping=f.plane0,
            token_query_depth=f.depth, positions=f.position, max_query_len=1, max_seq_len=context,
            layout=self.kv.layout)
        if self.kv.layout is KVLayout.LAST_EXITED:
            self.kv.stamp_depth(f.plane0, f.depth)
        meta = self.attention.prepare(self.kv, meta)
        states, remaining = self.states, self.inner.remaining
        # ``token`` is a token-table entry where ``from_device`` is 1 (else a token id: gather entry 0)
        token = torch.where(f.from_device != 0, self.tokens.index_select(0, f.token * f.from_device), f.token)
        x = torch.where((f.depth == 0)[:, None], self.model.prelude(token), states.index_select(0, f.state))
        rope = self.model.rotary(f.position)
        if self.persistent is not None and bucket == 1:
            h = self.persistent(x, rope, meta)
        else:
            h = self.model.recurrent(x, rope, self.kv, self.attention, meta)
        states.index_copy_(0, f.state, h)
        carried = torch.where(f.loop == 1, 1.0, remaining.index_select(0, f.slot))
        exited, carried = self.exit_policy.decide(self.model.exit_logit(h), carried, f.loop, f.min_loops,
                                                  f.max_loops, f.threshold)
        remaining.index_copy_(0, f.slot, carried)
        return h, exited

    def _record(self, fn):
        """Capture ``fn()`` as a graph in the shared memory pool, its time and graph memory counted;
        returns (graph, fn's output). Raises what the capture raised."""
        before = torch.cuda.memory_reserved(self.device)
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        self._pool = graph.pool()
        self.capture_seconds += time.perf_counter() - t0
        self.graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        return graph, out

    def _capture(self, key: tuple[int, int]) -> None:
        if len(self._graphs) >= self.max_graphs:
            self.fallbacks[f"graph count limit ({self.max_graphs})"] += 1  # this shape stays eager
            return
        try:
            self._graphs[key] = self._record(lambda: self._loop_step(*key))
        except Exception as exc:  # noqa: BLE001 - the step still ran eagerly; record why graphs are off
            self.use_graphs = False
            self.graphs_off_reason = f"capture failed: {type(exc).__name__}: {exc}"[:200]
            log.warning("graph capture of decode bucket %s failed; decode steps run eagerly: %s", key, exc)
            return
        if self.graph_memory_bytes is not None and self.graph_bytes > self.graph_memory_bytes:
            self.use_graphs = False
            self.graphs_off_reason = f"graph memory budget ({self.graph_memory_bytes >> 20} MiB) reached"
        log.info("captured decode graph rows=%d context=%d (%.2f s total capture, %.1f MiB)", key[0], key[1],
                 self.capture_seconds, self.graph_bytes / 2**20)

    def capture_startup(self, contexts) -> None:
        """Capture every (row bucket, context bucket) decode graph now, smallest contexts first,
        within the count limit and the memory budget (shapes left out are captured on first use,
        or run eagerly past the limits, as recorded). Each shape runs once eagerly (compiling its
        kernels) on a dummy step: slot 0, position 0, one key - it writes KV only into the first
        slot of block 0 and slot 0's state, which no request owns before the engine serves."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        steps = Counter(self.stats)
        with torch.inference_mode():
            self._capture_all(contexts)
        self.stats = steps  # the dummy steps are not the engine's steps
        self.startup_seconds = time.perf_counter() - t0
        self.startup_graphs = len(self._graphs)
        log.info("captured %d decode graphs at startup in %.2f s (%.1f MiB graph memory)", self.startup_graphs,
                 self.startup_seconds, self.graph_bytes / 2**20)

    def _capture_all(self, contexts) -> None:
        for context in contexts:
            for bucket in self.row_buckets:
                if not self.use_graphs or len(self._graphs) >= self.max_graphs:
                    break
                f = self.buffers.fields(bucket)
                for t in (f.token, f.from_device, f.slot, f.state, f.table, f.position, f.slot_mapping, f.plane0,
                          f.depth):
                    t.zero_()
                for t in (f.seq_len, f.loop, f.min_loops, f.max_loops):
                    t.fill_(1)
                f.threshold.fill_(1.0)
                self._run_shape((bucket, context))

    def _run(self, batch: DecodeBatch):
        return self._run_shape((batch.bucket, batch.context))

    def _run_shape(self, key: tuple[int, int]):
        entry = self._graphs.get(key)
        if entry is not None:
            entry[0].replay()
            self.stats["graph_replays"] += 1
            return entry[1]
        out = self._loop_step(*key)  # eager: the step's real work (and the kernels' compilation)
        self.stats["eager_decode_steps"] += 1
        if self.use_graphs:
            self._capture(key)
        return out

    # -- the executor interface -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch):
        self._device_run = None
        if not isinstance(batch, DecodeBatch):
            self.stats["eager_other_steps"] += 1
            handle = self.inner.execute(batch)
            if handle.done():  # the base executor read its exits and tokens back inside execute
                result = handle.result()
                self.pipeline.sync_step(int(bool(batch.adaptive.any())) + int(bool(result.num_tokens.any())))
            return handle
        n = batch.num_rows
        h, exited_dev = self._run(batch)
        if batch.feature_rows:
            self.stats["with_feature_rows"] += 1
        gate = bool(batch.adaptive.any())
        if batch.open:
            run = _DeviceRun(batch, to_device(batch.slots, self.device),
                             to_device(self.slot_table.num_generated[batch.slots], self.device))
            self._device_run = run
            self._num_rows.fill_(n)
            return self._open_tail(run, h, exited_dev)
        if batch.lagged and not batch.feature_rows:
            return self._lagged_tail(batch, h)
        if batch.lagged:  # their feature finishes the step: a lagged handle, or (it must read) at once
            handle = self.inner.finish_decode_lagged(batch, h[:n])
            if hasattr(handle, "shape"):
                self.pipeline.lagged_step()
                self.stats["lagged_with_feature_rows"] += 1
                return handle
            result = handle.result()
        else:
            exited = exited_dev[:n].cpu().numpy() if gate else batch.fixed_exit.copy()
            result = self.inner.finish_decode(batch, h[:n], exited)
        if len(result.token_ids):  # each row's last token (a verification row may yield several)
            produced = result.num_tokens > 0
            self.tokens.index_copy_(0, to_device(batch.slots[produced], self.device),
                                    to_device(result.token_ids[result.token_offsets[1:][produced] - 1], self.device))
        self.pipeline.sync_step(int(gate) + int(bool(len(result.token_ids))))
        return CompletedStep(result)

    def _lagged_tail(self, batch: DecodeBatch, h: torch.Tensor) -> LaggedStep:
        """LM head and sampling of the rows that exit (known on the host); the tokens go into the
        device token buffer and, by a non-blocking copy, into a pinned ring entry: nothing waits."""
        exited = batch.fixed_exit.copy()
        rows = np.nonzero(exited & batch.samples)[0]
        num_tokens = np.zeros(batch.num_rows, np.int64)
        num_tokens[rows] = 1
        shape = StepResult(exited, num_tokens, np.zeros(0, np.int64))
        self.pipeline.lagged_step()
        if len(rows) == 0:
            return LaggedStep(shape, None, self.pipeline)
        slots = batch.slots[rows]
        last = h.index_select(0, to_device(rows, self.device))
        out = self.sampler.sample(self.model.coda(last), slots)
        self.tokens.index_copy_(0, to_device(slots, self.device), out.token_ids)
        return LaggedStep(shape, self.ring.put(out), self.pipeline)

    @torch.inference_mode()
    def continue_open(self) -> tuple[DecodeBatch, OpenStep]:
        """Run the next decode step of the last open step's rows as the device plans it
        (:meth:`StaticDecodeBuffers.advance` from that step's exit mask): same rows, same bucket,
        the context bucket of the highest position any row can have reached. Returns the step's
        batch (the first step's, for its rows and arrays) and its open handle. The step loop calls
        it only while the host could plan nothing else (no admission, finish, or max_tokens due)."""
        run = self._device_run
        if run is None:
            raise RuntimeError("no open decode step to continue: the last step was planned by the host and not open")
        b = run.batch
        run.steps += 1
        context = context_bucket(int(b.row_start.max()) + run.steps + 1, self.max_model_len)
        self._advance(b.bucket)
        h, exited = self._run_shape((b.bucket, context))
        return attrs.evolve(b, context=context), self._open_tail(run, h, exited)

    def _advance(self, bucket: int) -> None:
        """The device planning of the next step (:meth:`StaticDecodeBuffers.advance`): a graph replay
        once the bucket's was captured (on its first use, after running it eagerly), else eagerly."""
        graph = self._advance_graphs.get(bucket)
        if graph is not None:
            graph.replay()
            return
        args = (bucket, self._num_rows, self._exited, self.kv.block_size, self.kv.layout is KVLayout.SHARED)
        self.buffers.advance(*args)
        if not self.use_graphs or self.advance_off_reason:
            return
        try:
            self._advance_graphs[bucket] = self._record(lambda: self.buffers.advance(*args))[0]
        except Exception as exc:  # noqa: BLE001 - it still ran eagerly; record why it stays eager
            self.advance_off_reason = f"capture failed: {type(exc).__name__}: {exc}"[:200]
            log.warning("graph capture of the device planning (bucket %d) failed; it runs eagerly: %s", bucket, exc)

    def _open_tail(self, run: _DeviceRun, h: torch.Tensor, exited: torch.Tensor) -> OpenStep:
        """LM head and sampling of every row of an open step (whose exits the host does not
        know); the token table keeps the tokens of the rows that exited; exit mask, tokens and each
        row's depth and position go to a pinned ring entry — nothing waits."""
        b = run.batch
        n = b.num_rows
        e = exited[:n]
        out = self.sampler.sample(self.model.coda(h[:n]), b.slots, device_steps=run.generated, committed=e)
        self.tokens.index_copy_(0, run.slots, torch.where(e, out.token_ids, self.tokens.index_select(0, run.slots)))
        run.generated.add_(e.long())
        self._exited[: b.bucket].copy_(exited)  # a graph's output is overwritten by its next replay
        f = self.buffers.fields(b.bucket)
        entry = self.ring.put(out, rows=(e, f.depth[:n], f.position[:n]))  # last: nothing can fail holding it
        self.pipeline.open_step(device_planned=run.steps > 0)
        return OpenStep(entry, self.pipeline)

    def describe(self) -> dict:
        return {
            "static_buffers": True, "graphs": self.use_graphs, "graphs_off_reason": self.graphs_off_reason, "graphs_captured": len(self._graphs),
            "graph_buckets": sorted(self._graphs), "capture_seconds": round(self.capture_seconds, 3),
            "graph_memory_mib": round(self.graph_bytes / 2**20, 1), "row_buckets": list(self.row_buckets),
            "graphs_captured_at_startup": self.startup_graphs, "startup_capture_seconds": round(self.startup_seconds, 3),
            "steps": dict(self.stats), "eager_fallbacks": dict(self.fallbacks),
            "pipeline": self.pipeline.describe(),
            "persistent_loop": self.persistent.describe() if self.persistent is not None else None,
            "device_planning_graphs": len(self._advance_graphs), "device_planning_off_reason": self.advance_off_reason,
            "step_metadata": {"moved_by": "mapped-memory kernel (UVA)" if self.buffers.mapped else "copy",
                              "mapped_uploads": self.buffers.num_mapped, "copied_uploads": self.buffers.num_copied},
        }
