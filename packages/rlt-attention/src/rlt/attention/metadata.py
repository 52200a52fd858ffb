"""Per-step attention metadata, built once per step and read by every layer and loop.

A *row* is (request, contiguous position range, loop depth). Rows are packed: the new tokens of
all rows are concatenated (``query_start_loc`` is the cumulative query length, as ``cu_seqlens_q``
in FlashAttention), and each row brings its own context length, depth and page tables.

Everything a kernel reads is a device tensor, so the same metadata object can be refilled in place
and replayed inside a graph; ``max_query_len`` / ``max_seq_len`` are host-side upper bounds that a
backend may use to size tiles (they must not be computed with a host sync by the builder).
"""

from __future__ import annotations

import attrs
import torch

from rlt.attention.kv_cache import KVLayout


@attrs.frozen(eq=False)
class AttentionMetadata:
    #: [R+1] int32, cumulative number of new (query) tokens per row.
    query_start_loc: torch.Tensor
    #: [R] int32, context length of each row *including* its new tokens.
    seq_lens: torch.Tensor
    #: [R] int32, loop depth (0-based) the row runs at.
    query_depth: torch.Tensor
    #: [R, planes, max_pages] int32, physical block of page i in plane p.
    block_tables: torch.Tensor
    #: [N] int64, flat slot (block * block_size + offset) each new token writes, in its row's plane.
    slot_mapping: torch.Tensor
    #: [N] int64, flat slot of each new token in plane 0 (where the version map lives).
    plane0_slot_mapping: torch.Tensor
    #: [N] int32, depth each new token runs at (its row's depth, per token).
    token_query_depth: torch.Tensor
    #: [N] int64, absolute position of each new token.
    positions: torch.Tensor
    #: Host-side upper bounds.
    max_query_len: int
    max_seq_len: int
    layout: KVLayout
    #: Host-side: True only when every row starts at position 0 (its context is exactly its own new
    #: tokens), so attention over this step's K/V alone (a backend's ``new_kv``) equals attention over
    #: the pages. False when some row has earlier context, or when the builder does not know.
    fresh: bool = False
    #: Backend-owned per-step state set by ``AttentionBackend.prepare`` (None until then): the Triton
    #: backend's depth-resolved key slots ``[R, max_seq_len]`` int32, resolved once for every layer.
    resolved_slots: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
