"""The batch builder of decode-only steps, writing into static buffers.

A step whose rows are all decode rows (one position each, past the prompt) becomes a
:class:`DecodeBatch`: its rows padded to a *row bucket* by repeating row 0 — a padded row is an
exact copy of row 0 (same slot, token, position, KV slot), so it writes the same KV values to the
same place and its outputs are ignored: padding needs no special case anywhere — and a *context
bucket* (a power of two >= the longest context) that bounds the attention's host-side sizing.
All per-row fields go to the device in one move from a pinned bank (a ring of two, reused only
after the event behind its last move completed): a kernel reading the bank at its host address
when the UVA probe passed (:func:`rlt.platform.uva.mapped_copy_`), one non-blocking copy otherwise; page tables are mirrored on the device per slot
and re-sent only for slots whose pages changed. Any other step is built by the inner builder.

With the pipeline on, a depth-0 row whose input token is still in flight takes it from the
executor's device token buffer (``from_device``), and a step whose exits are all known on the
host is marked ``lagged``; with device-planned steps on (``--pipeline-device-exit``), a step of
plain rows where a row may exit on the gate is marked ``open``, and :meth:`StaticDecodeBuffers.advance`
writes the next step of the same rows on the device from its exit mask.

Rows of other features take this path when their type says so (``Row.static_decode``: one-token
decode rows, e.g. rlt-spec's draft and chain rows): each row's state lives at its
``Row.state_index`` of the executor's state table (several rows of one slot may share a step,
each with its own entry), a depth-0 row embeds ``token_ids()`` when its input is not the
request's own token (or, when that token is a draft only the device has, the device token table at
``Row.input_token_entry``), and such a step is lagged only when every row's type allows it
(``Row.lagged_heads``: its feature finishes it without a host read).

Owns: the host banks, the device field buffers, the device page-table mirror. Must not: read
device memory (no host sync) or keep references to rows after ``build`` returns the batch.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np
import torch

from rlt.attention import KVLayout
from rlt.platform.engine.exit_policy import row_thresholds
from rlt.platform.engine.interfaces import Row, Wrapped
from rlt.platform.engine.staging import to_device
from rlt.platform.uva import mapped_copy_

#: int64 fields (rows of the int64 block) and int32 fields (rows of the int32 block; threshold as fp32 bits)
#: ``from_device``: 1 where the row's input token is still on the device (sampled by a step whose
#: tokens the host has not read yet, or a device-only draft): the step gathers it from the resident
#: token table at the entry held in ``token`` (the slot for a sampled token)
#: ``state``: the row's entry in the executor's state table (``Row.state_index``; the slot for plain rows)
#: ``table``: the row's page table in the device mirror (its slot's; for a row with ``Row.own_pages``, the
#: mirror's entry ``num_slots + i`` for batch row ``i``)
I64 = ("token", "from_device", "slot", "state", "table", "position", "slot_mapping", "plane0")
I32 = ("seq_len", "depth", "loop", "min_loops", "max_loops", "threshold")


def buckets_upto(limit: int, given: Sequence[int] | None = None) -> tuple[int, ...]:
    """Row buckets: the given sizes, or powers of two, up to ``limit`` (which is always one)."""
    sizes = sorted({b for b in (given or []) if 0 < b <= limit})
    if not given:
        b = 1
        while b < limit:
            sizes.append(b)
            b *= 2
    if not sizes or sizes[-1] != limit:
        sizes.append(limit)
    return tuple(sizes)


def context_bucket(max_seq_len: int, limit: int, smallest: int = 256) -> int:
    b = smallest
    while b < max_seq_len:
        b *= 2
    return min(b, limit)


def context_buckets(limit: int, smallest: int = 256) -> tuple[int, ...]:
    """Every value :func:`context_bucket` can return for contexts up to ``limit``, ascending."""
    out = [min(smallest, limit)]
    while out[-1] < limit:
        out.append(min(out[-1] * 2, limit))
    return tuple(out)


@attrs.frozen(eq=False)
class DecodeFields:
    """Device views of one bucket's rows (``[B]`` each)."""

    token: torch.Tensor
    from_device: torch.Tensor
    slot: torch.Tensor
    state: torch.Tensor
    table: torch.Tensor
    position: torch.Tensor
    slot_mapping: torch.Tensor
    plane0: torch.Tensor
    seq_len: torch.Tensor
    depth: torch.Tensor
    loop: torch.Tensor
    min_loops: torch.Tensor
    max_loops: torch.Tensor
    threshold: torch.Tensor


@attrs.frozen(eq=False)
class DecodeBatch:
    rows: tuple[Row, ...]  # batch order (as scheduled)
    slots: np.ndarray  # [R] host
    bucket: int  # B >= R rows run
    context: int  # S: the attention's host-side length bound
    fixed_exit: np.ndarray  # [R] rows at their max_loops
    adaptive: np.ndarray  # [R] rows that consult the gate
    samples: np.ndarray  # [R] (all True: decode rows produce a token when they exit)
    depth: np.ndarray  # [R] the loop each row runs (0-based)
    row_start: np.ndarray  # [R] each row's position
    from_device: np.ndarray  # [R] the row embeds the token in the device token buffer (in flight)
    #: rows of other features (a Row subclass) share the step (their feature finishes it)
    feature_rows: bool = False
    #: the step's exits are known on the host (no row can exit on the gate this loop) and the
    #: pipeline is on: the executor leaves its tokens on the device and reads them with a lag
    lagged: bool = False
    #: a row may exit on the gate and device-planned steps are on (plain rows only): every row is
    #: sampled, exits and tokens are read back with the lag, and the device may plan the next
    #: steps of the same rows from its exit mask (:meth:`StaticDecodeBuffers.advance`)
    open: bool = False
    prompt_logprobs: dict = attrs.field(factory=dict)  # never any: no prompt rows here

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def has_prompt_rows(self) -> bool:
        return False


class StaticDecodeBuffers:
    """Pinned host banks and the device buffers they are copied into, for up to ``max_rows`` rows."""

    def __init__(self, max_rows: int, device: torch.device, *, num_slots: int, planes: int, pages: int,
                 mapped: bool = False) -> None:
        self.max_rows = max_rows
        self.device = device
        #: the UVA decision: a kernel reads the pinned bank at its host address instead of a copy
        self.mapped = mapped
        self.num_mapped = self.num_copied = 0
        n64, n32 = len(I64) * max_rows, len(I32) * max_rows
        self.nbytes = 8 * n64 + 4 * n32
        pin = device.type == "cuda"
        self._banks = [torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._events: list = [None, None]
        self._flip = 0
        self.dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self._i64 = self.dev[: 8 * n64].view(torch.int64).view(len(I64), max_rows)
        self._i32 = self.dev[8 * n64:].view(torch.int32).view(len(I32), max_rows)
        #: device mirror of the KV manager's page tables, per slot, then one entry per batch row for rows
        #: with page tables of their own (``Row.own_pages``), and the host copy of what it holds
        self.num_slots = num_slots
        self.tables = torch.zeros((num_slots + max_rows, planes, pages), dtype=torch.int32, device=device)
        self._shadow = np.zeros((num_slots + max_rows, planes, pages), dtype=np.int32)
        self.qsl = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        #: row indices, for :meth:`advance`'s padding
        self._rows = torch.arange(max_rows, device=device)

    def fields(self, bucket: int) -> DecodeFields:
        v = {n: self._i64[i, :bucket] for i, n in enumerate(I64)}
        v.update({n: self._i32[i, :bucket] for i, n in enumerate(I32)})
        v["threshold"] = v["threshold"].view(torch.float32)
        return DecodeFields(**v)

    def sync_tables(self, host_tables: np.ndarray, slots: np.ndarray, own: dict[int, np.ndarray] | None = None) -> None:
        """Send the page tables of ``slots`` whose pages changed since they were last sent, and the
        own page tables ``own`` (mirror entry -> table) that changed."""
        rows = host_tables[slots]
        changed = (rows != self._shadow[slots]).reshape(len(slots), -1).any(axis=1)
        dirty = np.unique(slots[changed]) if changed.any() else slots[:0]  # the common case: nothing changed
        self._shadow[dirty] = host_tables[dirty]
        if own:
            entries = np.fromiter(own, np.int64, len(own))
            new = np.stack([own[int(e)] for e in entries])
            diff = (new != self._shadow[entries]).reshape(len(entries), -1).any(axis=1)
            self._shadow[entries[diff]] = new[diff]
            dirty = np.concatenate([dirty, entries[diff]])
        if len(dirty):
            self.tables.index_copy_(0, to_device(dirty, self.device), to_device(self._shadow[dirty], self.device))

    def advance(self, bucket: int, num_rows: torch.Tensor, exited: torch.Tensor, block_size: int,
                shared: bool) -> None:
        """Plan the next decode step of the same rows on the device, in place, from the step that
        just ran from these fields and its exit mask ``exited [bucket]``: a row that exited moves to
        its next position at depth 0, embedding the token it just sampled (the token table at its
        slot); one that did not runs its next loop at the same position. Its context length, KV
        slot (its page table, mirrored here, at its new depth plane; plane 0 under SHARED) and
        LAST_EXITED stamp address follow, as the host builder would write them. Rows from
        ``num_rows`` (a device scalar) on are padding: they copy row 0 again. Device tensors and
        the bucket only, nothing read on the host: capturable as a graph per bucket. The rows are
        plain one-token decode rows (state and token entry = slot) whose pages for every position
        they can reach are mapped (all-at-admission allocation)."""
        old64 = dict(zip(I64, self._i64[:, :bucket]))  # each field's rows, by name
        old32 = dict(zip(I32, self._i32[:, :bucket]))
        e = exited[:bucket].bool()
        slot = old64["slot"]
        depth = torch.where(e, 0, old32["depth"] + 1)
        pos = old64["position"] + e.long()
        page = pos // block_size
        off = pos - page * block_size
        planes, pages = self.tables.shape[1:]
        first = slot * (planes * pages) + page  # plane 0's entry; the row's plane is ``depth`` pages on
        entries = torch.stack([first if shared else first + depth.long() * pages, first])
        addr = self.tables.view(-1).index_select(0, entries.view(-1)).view(2, bucket).long() * block_size + off
        new64 = {**old64, "token": torch.where(e, slot, old64["token"]),
                 "from_device": torch.where(e, 1, old64["from_device"]),
                 "position": pos, "slot_mapping": addr[0], "plane0": addr[1]}
        new32 = {**old32, "seq_len": (pos + 1).int(), "depth": depth, "loop": depth + 1}
        rows = self._rows[:bucket]
        pad = torch.where(rows < num_rows, rows, 0)
        self._i64[:, :bucket].copy_(torch.stack([new64[k] for k in I64]).index_select(1, pad))
        self._i32[:, :bucket].copy_(torch.stack([new32[k] for k in I32]).index_select(1, pad))

    def upload(self, i64: np.ndarray, i32: np.ndarray) -> None:
        """Copy ``i64 [len(I64), B]`` and ``i32 [len(I32), B]`` into the device buffers (one copy)."""
        bank = self._banks[self._flip]
        event = self._events[self._flip]
        if event is not None:
            event.synchronize()  # the copy that last read this bank has completed
        host = bank.numpy()
        n64 = len(I64) * self.max_rows
        h64 = host[: 8 * n64].view(np.int64).reshape(len(I64), self.max_rows)
        h32 = host[8 * n64:].view(np.int32).reshape(len(I32), self.max_rows)
        b = i64.shape[1]
        h64[:, :b] = i64
        h32[:, :b] = i32
        if self.mapped:
            mapped_copy_(self.dev, bank)
            self.num_mapped += 1
        else:
            self.dev.copy_(bank, non_blocking=True)
            self.num_copied += 1
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._flip] = ev
        self._flip ^= 1


def decode_only(rows: Sequence[Row], max_rows: int) -> bool:
    """Whether a step of ``rows`` is built as a :class:`DecodeBatch`: one-position decode rows
    only, of types that allow it (``Row.static_decode``); prompt chunks and other rows go to the
    inner builder."""
    return 0 < len(rows) <= max_rows and all(
        not r.in_prompt and r.length == 1 and r.static_decode for r in rows)


def exits_known(loop: np.ndarray, min_loops: np.ndarray, max_loops: np.ndarray, adaptive: np.ndarray) -> np.ndarray:
    """Per row: whether its exit this loop is known without the gate (it does not consult it, it
    is below min_loops, or it is at max_loops)."""
    return ~adaptive | (loop < min_loops) | (loop >= max_loops)


class StaticBatchBuilder(Wrapped):
    """Decode-only steps into :class:`StaticDecodeBuffers`; every other step by ``inner``."""

    def __init__(self, inner, *, kv, slots, layout: KVLayout, device: torch.device, max_rows: int,
                 max_model_len: int, row_buckets: Sequence[int] | None = None, pipelined: bool = False,
                 mapped: bool = False, device_exit: bool = False) -> None:
        super().__init__(inner)
        #: decode steps whose exits are host-known are lagged (the pipeline feature sets it)
        self.pipelined = pipelined
        #: decode steps of plain rows where a row may exit on the gate are open (read back lagged;
        #: the device may plan the next ones): the pipeline's --pipeline-device-exit, when it can run
        #: (``rlt.decode.feature.device_exit_off_reason``, which also needs the pipeline)
        self.device_exit = device_exit
        self.kv = kv
        self.slots = slots
        self.layout = layout
        #: up to the most one-token rows a step may hold (the scheduler's ``max_decode_rows``)
        self.row_buckets = buckets_upto(max_rows, row_buckets)
        self.max_model_len = max_model_len
        t = kv.block_tables
        self.buffers = StaticDecodeBuffers(self.row_buckets[-1], device, num_slots=t.shape[0], planes=t.shape[1],
                                           pages=t.shape[2], mapped=mapped)

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.row_buckets if b >= rows)

    def build(self, rows: Sequence[Row]):
        # one-position decode rows only: prompt chunks and rows that need other inputs go to the
        # inner builder
        if not decode_only(rows, self.row_buckets[-1]):
            return self.inner.build(rows)
        n = len(rows)
        bucket = self.bucket_for(n)
        slots = np.fromiter((r.slot for r in rows), np.int64, n)
        pos = np.fromiter((r.start for r in rows), np.int64, n)
        depth = np.fromiter((r.depth for r in rows), np.int64, n)
        plain = all(type(r) is Row for r in rows)
        state = slots if plain else np.fromiter((r.state_index for r in rows), np.int64, n)
        # depth-0 rows embed the token sampled last: the host's copy, or (while the step that
        # sampled it is in flight) the device's token table at the slot; a row whose input is not
        # the request's own token embeds that (a draft: the host's value, or the device's at the
        # row's entry). ``token`` holds the table entry for rows that embed from the device.
        if plain:
            from_device = np.fromiter((r.depth == 0 and r.request.num_pending > 0 for r in rows), np.int64, n)
            token = np.where(from_device != 0, slots, np.fromiter(
                (0 if r.depth or r.request.num_pending else r.request.output_token_ids[-1] for r in rows), np.int64, n))
        else:
            from_device, token = np.zeros(n, np.int64), np.zeros(n, np.int64)
            for i, r in enumerate(rows):
                if r.depth:
                    continue
                if r.input_on_device() or (r.own_input() and r.request.num_pending > 0):
                    from_device[i], token[i] = 1, r.input_token_entry()
                else:
                    token[i] = r.request.output_token_ids[-1] if r.own_input() else r.token_ids()[0]
        bs = self.kv.block_size
        tables = self.kv.block_tables
        plane = np.zeros_like(depth) if self.layout is KVLayout.SHARED else depth
        page, off = pos // bs, pos % bs
        table = slots
        own = None
        if not plain and any(r.own_pages for r in rows):  # rows with page tables of their own
            table = slots.copy()
            own = {}
            for i, r in enumerate(rows):
                if r.own_pages:
                    table[i] = self.buffers.num_slots + i
                    own[int(table[i])] = r.block_table(tables)
        slot_mapping = tables[slots, plane, page].astype(np.int64) * bs + off
        plane0 = tables[slots, 0, page].astype(np.int64) * bs + off
        if own is not None:
            for i in np.nonzero(table != slots)[0]:
                t = own[int(table[i])]
                slot_mapping[i] = int(t[plane[i], page[i]]) * bs + off[i]
                plane0[i] = int(t[0, page[i]]) * bs + off[i]
        t = self.slots
        adaptive = t.adaptive[slots]
        loop = depth + 1
        max_loops = t.max_loops[slots].astype(np.int64)
        min_loops = t.min_loops[slots].astype(np.int64)
        threshold = row_thresholds(t.threshold[slots], adaptive).view(np.int32)
        pad = np.concatenate([np.arange(n), np.zeros(bucket - n, np.int64)])  # padded rows repeat row 0
        i64 = np.stack([token, from_device, slots, state, table, pos, slot_mapping, plane0])[:, pad]
        i32 = np.stack([pos + 1, depth, loop, min_loops, max_loops,
                        threshold.astype(np.int64)]).astype(np.int64)[:, pad].astype(np.int32)
        self.buffers.sync_tables(tables, slots, own)
        self.buffers.upload(i64, i32)
        context = context_bucket(int(pos.max()) + 1, self.max_model_len)
        known = bool(exits_known(loop, min_loops, max_loops, adaptive).all())
        return DecodeBatch(rows=tuple(rows), slots=slots, bucket=bucket, context=context,
                           fixed_exit=loop >= max_loops, adaptive=adaptive, samples=np.ones(n, bool),
                           depth=depth, row_start=pos, from_device=from_device.astype(bool), feature_rows=not plain,
                           lagged=self.pipelined and (plain or all(r.lagged_heads for r in rows)) and known,
                           open=self.device_exit and plain and not known)
