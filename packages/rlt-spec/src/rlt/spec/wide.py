"""Wide chains on the device: the heads of a wide chain's drafting rows, the choice of the
candidate that ran the right token, and the KV copies that keep candidates' private blocks and the
request's own pages in step (docs/spec.md, "Wide chains").

A wide chain's newest position runs ``W`` candidates (:class:`rlt.spec.rows.CandidateRow`), one
per draft among the ``W`` best of the previous position's draft depth; below depth ``d`` each writes
its KV into private blocks standing in for the position's page (one block per plane). Three
device-only moves, all with host-known addresses (no host read, so lagged steps stay lagged):

- a chain's **first row** reaching depth ``d`` writes its ``W`` best tokens as the candidates'
  inputs and copies the page holding its position (planes below ``d``, every layer and the
  LAST_EXITED stamps) into every candidate's private blocks, so the candidates read the same
  earlier positions as the request's own page holds (:func:`sync_pages`);
- **candidates** reaching depth ``d`` each take their ``W`` best tokens; the winner is the candidate
  whose input is the slot's full-depth token (the previous position's check wrote it, at this step
  or earlier: wide chains need ``d >= D - d``), the first candidate when none is (the check then
  rejected, the chain is dead and its results invalid); its state goes to the position's chain-row
  entry, its drafts become the next position's candidate inputs, and its KV at the position (planes
  below ``d``) goes to the request's page and to every candidate's private block
  (:func:`promote_winners`), which keeps the private blocks equal to the page below the newest
  position without copying the page again;
- a wide chain's **check** accepts when the full-depth token is any candidate's
  (:func:`wide_accepted`).

Greedy requests only (the scheduler gives other requests a plain chain): the candidates are the
draft's ``W`` best tokens and the full-depth token is the argmax, so the output is the full-depth
model's whichever candidate wins.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from rlt.platform.engine.staging import to_device


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A KV tensor ``[layers, blocks, block_size, heads, dim]`` as ``[layers, blocks * block_size, heads * dim]``."""
    return t.view(t.shape[0], t.shape[1] * t.shape[2], -1)


def copy_entries(kv, src: torch.Tensor, dst: torch.Tensor) -> None:
    """KV entries (flat ``block * block_size + offset`` addresses) ``src[i]`` to ``dst[i]`` in every
    layer, K and V, and the LAST_EXITED stamps with them. ``dst`` holds no address twice."""
    for t in (kv.k, kv.v):
        f = _flat(t)
        f.index_copy_(1, dst, f.index_select(1, src))
    if kv.token_depth is not None:
        stamps = kv.token_depth.view(-1)
        stamps.index_copy_(0, dst, stamps.index_select(0, src))


def sync_pages(kv, src_blocks: np.ndarray, dst_blocks: np.ndarray, device) -> None:
    """Copy whole blocks: ``src_blocks [E]`` into each of ``dst_blocks [E, W]`` (a first row's page,
    per plane below ``d``, into its candidates' private blocks). One upload, no host wait."""
    bs = kv.block_size
    within = np.arange(bs)
    src = (np.repeat(src_blocks, dst_blocks.shape[1])[:, None] * bs + within).reshape(-1)
    dst = (dst_blocks.reshape(-1)[:, None] * bs + within).reshape(-1)
    both = to_device(np.concatenate([src, dst]).astype(np.int64), device)
    copy_entries(kv, both[: len(src)], both[len(src):])


def wide_accepted(candidate_tokens: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """A wide check's verdict ``[M]``: the full-depth token is one of the row's candidates ``[M, W]``."""
    return (candidate_tokens == token_ids[:, None]).any(dim=1)


@attrs.frozen
class Groups:
    """``G`` candidate groups (one per slot) reaching depth ``d`` in one step, with ``P`` draft-depth
    planes: the host-known addresses of their promotion (flat ``block * block_size + offset`` for KV)."""

    slots: np.ndarray  # [G]
    candidate_entries: np.ndarray  # [G, W] the candidates' state / token-table entries
    chain_entries: np.ndarray  # [G] the state entry of the position's chain row
    private: np.ndarray  # [G, P, W] each candidate's KV entry at the position, per plane
    page: np.ndarray  # [G, P] the request's own KV entry at the position, per plane

    @classmethod
    def of(cls, rows, block_tables: np.ndarray, block_size: int) -> "Groups":
        """From one candidate row per group (any of its candidates; one draft depth for all)."""
        slots = np.fromiter((r.slot for r in rows), np.int64, len(rows))
        pos = np.fromiter((r.start for r in rows), np.int64, len(rows))
        off = pos % block_size
        planes = len(rows[0].lane[0])
        page = block_tables[slots[:, None], np.arange(planes)[None, :], (pos // block_size)[:, None]]
        return cls(slots=slots, candidate_entries=np.asarray([r.candidates for r in rows], np.int64),
                   chain_entries=np.fromiter((r.chain_entry for r in rows), np.int64, len(rows)),
                   private=np.asarray([r.lane for r in rows], np.int64).transpose(0, 2, 1) * block_size
                   + off[:, None, None],
                   page=page.astype(np.int64) * block_size + off[:, None])

    @property
    def num_planes(self) -> int:
        return self.private.shape[1]

    def descriptor(self, scratch: np.ndarray) -> np.ndarray:
        """``[G, 4 + P * (1 + W)]``: :func:`rlt.spec.heads_kernel.promote_kernel`'s per-group row — slot,
        first candidate entry, scratch entry (``scratch [G]``: each candidate's W best next tokens), chain
        row entry, then per plane the page's address and the W private ones."""
        per_plane = np.concatenate([self.page[:, :, None], self.private], axis=2).reshape(len(self.slots), -1)
        head = np.stack([self.slots, self.candidate_entries[:, 0], scratch, self.chain_entries], axis=1)
        return np.concatenate([head, per_plane], axis=1).astype(np.int64)


def first_row_pages(rows, block_tables: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """What wide chains' first rows reaching depth ``d`` copy (:func:`sync_pages`): per row and plane
    below ``d``, the request's block of the row's page (``src [E]``) and the candidates' private blocks
    (``dst [E, W]``); nothing for a row whose next position opens a new page. None when nothing."""
    src, dst = [], []
    for r in rows:
        if (r.start + 1) % block_size:
            lane = np.asarray(r.lane, np.int64)  # [W, d]
            src.append(block_tables[r.slot, : lane.shape[1], r.start // block_size])
            dst.append(lane.T)
    return (np.concatenate(src).astype(np.int64), np.concatenate(dst)) if src else None


def promote_winners(*, kv, state_table: torch.Tensor, token_table: torch.Tensor, logits: torch.Tensor,
                    groups: Groups, device) -> None:
    """Finish the candidate ``groups`` that reached depth ``d`` this step, their ``W`` rows' logits
    ``logits [G * W, V]`` group by group in candidate order."""
    g, w = groups.candidate_entries.shape
    planes = groups.num_planes
    # every host-known index in one upload (no host wait)
    parts = [groups.candidate_entries.reshape(-1), groups.slots, groups.chain_entries, groups.private.reshape(-1),
             groups.page.reshape(-1)]
    cuts = np.cumsum([0] + [len(p) for p in parts])
    packed = to_device(np.concatenate(parts).astype(np.int64), device)
    entries, slot_dev, chain_dev, priv, page = (packed[cuts[i]:cuts[i + 1]] for i in range(len(parts)))
    entries, priv, page = entries.view(g, w), priv.view(g, planes, w), page.view(g, planes, 1)
    top = logits.topk(w, dim=-1).indices.view(g, w, w)  # per candidate, its W best next tokens
    inputs = token_table[entries]  # [G, W] the tokens the candidates ran
    truth = token_table[slot_dev]  # [G] the full-depth token at the position (the last check's)
    winner = (inputs == truth[:, None]).int().argmax(dim=1)  # first match; 0 when none (dead chain)
    rows = torch.arange(g, device=logits.device)
    state_table[chain_dev] = state_table[entries[rows, winner]]
    token_table[entries.view(-1)] = top[rows, winner].reshape(-1)
    # the winner's KV at the position, per plane below d: into the page and every private block
    src = priv.gather(2, winner.view(g, 1, 1).expand(g, planes, 1))  # [G, P, 1]
    dst = torch.cat([page, priv], dim=2)  # [G, P, 1 + W]
    copy_entries(kv, src.expand_as(dst).reshape(-1), dst.reshape(-1))
