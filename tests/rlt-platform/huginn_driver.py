"""A test-only executor for Huginn: drives HuginnModel's stages over paged KV, per its contract.

It follows the executor contract of :mod:`rlt.platform.models.huginn` literally (two KV caches, the
boundary one single-plane; per-slot injection and state; per-request recurrence count and seed)
and batches the way the engine does: every step runs ONE recurrent call over all running rows at
their mixed depths, prelude for rows entering, coda for rows that reached their own count. Block
tables are random permutations, so a read of the wrong page, plane or layer shows up as a wrong
token. Greedy only. It is not the engine; it exists to prove the stages are callable as documented.
"""

from __future__ import annotations

import attrs
import torch

from rlt.attention import AttentionMetadata, KVCache, KVLayout, create_backend


@attrs.define
class _Request:
    slot: int
    tokens: list[int]
    num_steps: int
    seed: int
    init_scale: float
    max_tokens: int
    out: list[int] = attrs.field(factory=list)
    # the work item: tokens at positions [start, start + n) with their injection and state
    start: int = 0
    n: int = 0
    depth: int = -1  # -1: not yet through the prelude
    injection: torch.Tensor | None = None
    state: torch.Tensor | None = None


class HuginnDriver:
    def __init__(self, model, *, max_steps: int, max_seqs: int = 8, max_len: int = 64, block_size: int = 4,
                 seed: int = 0) -> None:
        self.model, self.bs = model, block_size
        s = model.shape
        self.pages = -(-max_len // block_size)
        self.max_steps = max_steps
        self.attention = create_backend("torch")
        gen = torch.Generator().manual_seed(seed)
        kw = dict(block_size=block_size, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, dtype=model.dtype,
                  device=model.device)
        n_core = max_seqs * max_steps * self.pages
        self.core = KVCache.allocate(num_layers=s.num_layers, num_blocks=n_core, num_planes=max_steps,
                                     layout=KVLayout.LAST_EXITED, **kw)
        self.core_tables = torch.randperm(n_core, generator=gen).view(max_seqs, max_steps, self.pages)
        n_bnd = max_seqs * self.pages
        self.boundary = KVCache.allocate(num_layers=s.num_boundary_layers, num_blocks=n_bnd, num_planes=1,
                                         layout=KVLayout.SHARED, **kw)
        self.boundary_tables = torch.randperm(n_bnd, generator=gen).view(max_seqs, 1, self.pages)
        self.free = list(range(max_seqs))
        self.running: dict[str, _Request] = {}
        self.done: dict[str, list[int]] = {}

    # -- metadata ------------------------------------------------------------------------------
    def _meta(self, reqs: list[_Request], tables: torch.Tensor, layout: KVLayout, depths: list[int]) -> AttentionMetadata:
        starts, lens, toks_pos, slot_map, plane0, tok_depth = [0], [], [], [], [], []
        for r, d in zip(reqs, depths):
            pos = torch.arange(r.start, r.start + r.n)
            t = tables[r.slot]
            slot_map.append(t[d, pos // self.bs] * self.bs + pos % self.bs)
            plane0.append(t[0, pos // self.bs] * self.bs + pos % self.bs)
            toks_pos.append(pos)
            tok_depth.append(torch.full((r.n,), d, dtype=torch.int32))
            starts.append(starts[-1] + r.n)
            lens.append(r.start + r.n)
        dev = self.model.device
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_depth=torch.tensor(depths, dtype=torch.int32, device=dev),
            block_tables=tables[[r.slot for r in reqs]].to(dev, torch.int32),
            slot_mapping=torch.cat(slot_map).to(dev),
            plane0_slot_mapping=torch.cat(plane0).to(dev),
            token_query_depth=torch.cat(tok_depth).to(dev),
            positions=torch.cat(toks_pos).to(dev),
            max_query_len=max(r.n for r in reqs), max_seq_len=max(lens), layout=layout,
        )

    def _boundary_meta(self, reqs):
        return self._meta(reqs, self.boundary_tables, KVLayout.SHARED, [0] * len(reqs))

    # -- requests ------------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], *, num_steps: int, max_tokens: int, seed: int = 0,
            init_scale: float = 0.0) -> None:
        if not 1 <= num_steps <= self.max_steps:
            raise ValueError(f"num_steps must be in 1..{self.max_steps}")
        self.running[rid] = _Request(self.free.pop(0), list(prompt), num_steps, seed, init_scale, max_tokens,
                                     start=0, n=len(prompt))

    @torch.inference_mode()
    def step(self) -> None:
        m = self.model
        reqs = list(self.running.values())
        if not reqs:
            return
        entering = [r for r in reqs if r.depth < 0]
        if entering:  # prelude + initial state of the new work items
            meta = self._boundary_meta(entering)
            ids = torch.tensor([t for r in entering for t in r.tokens[r.start:r.start + r.n]], device=m.device)
            e = m.prelude(ids, m.rotary(meta.positions), self.boundary, self.attention, meta)
            seeds = [r.seed for r in entering for _ in range(r.n)]
            scales = [r.init_scale for r in entering for _ in range(r.n)]
            s0 = m.initial_state(seeds, meta.positions.tolist(), scales)
            for r, part_e, part_s in zip(entering, e.split([r.n for r in entering]), s0.split([r.n for r in entering])):
                r.injection, r.state, r.depth = part_e, part_s, 0
        # one recurrence for every running row, each at its own depth
        meta = self._meta(reqs, self.core_tables, KVLayout.LAST_EXITED, [r.depth for r in reqs])
        self.core.stamp_depth(meta.plane0_slot_mapping, meta.token_query_depth)
        out = m.recurrent(torch.cat([r.state for r in reqs]), m.rotary(meta.positions), self.core, self.attention,
                          meta, injection=torch.cat([r.injection for r in reqs]))
        for r, part in zip(reqs, out.split([r.n for r in reqs])):
            r.state, r.depth = part, r.depth + 1
        exiting = [r for r in reqs if r.depth == r.num_steps]
        if not exiting:
            return
        meta = self._boundary_meta(exiting)
        last = torch.tensor([0] + [r.n for r in exiting]).cumsum(0)[1:] - 1
        logits = m.coda(torch.cat([r.state for r in exiting]), m.rotary(meta.positions), self.boundary,
                        self.attention, meta, sample_rows=last.to(m.device))
        for r, tok in zip(exiting, logits.argmax(-1).tolist()):
            r.out.append(tok)
            rid = next(k for k, v in self.running.items() if v is r)
            if len(r.out) >= r.max_tokens:
                self.done[rid] = r.out
                del self.running[rid]
                self.free.append(r.slot)
                continue
            r.tokens.append(tok)
            r.start, r.n, r.depth, r.injection, r.state = len(r.tokens) - 1, 1, -1, None, None

    def run(self, arrivals: list[tuple[int, str, list[int], dict]]) -> dict[str, list[int]]:
        """``arrivals``: (step index, request id, prompt, add() keywords); steps until all finish."""
        pending = sorted(arrivals, key=lambda a: a[0])
        step = 0
        while pending or self.running:
            while pending and pending[0][0] <= step:
                _, rid, prompt, kw = pending.pop(0)
                self.add(rid, prompt, **kw)
            self.step()
            step += 1
        return self.done
