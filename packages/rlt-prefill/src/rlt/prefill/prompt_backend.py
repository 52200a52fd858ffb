"""Which FlashAttention backend serves prompt rows (``packed_prefill``), decided once per engine.

Prompt rows never need depth indirection (:mod:`rlt.prefill.row_groups`), so a FlashAttention
backend is asked for as the platform selector would for an engine where no row exits early
(``adaptive_exit=False`` describes prompt rows exactly). Nothing is chosen — and the engine keeps
its backend for every row — when the selected backend already is FlashAttention alone, when no
FlashAttention backend is usable (not importable, wrong arch, dtype or head size), or when the
KV layout is SHARED (one plane: the selected backend is already exact and packs prefill itself).
"""

from __future__ import annotations

from rlt.attention import AttentionBackend, KVLayout
from rlt.platform.attention_select import AttentionSelectionError, build_attention, select_attention

FLASH = ("fa4", "fa3", "fa2")


def choose_prompt_backend(ctx, requested: str = "auto") -> tuple[AttentionBackend | None, str]:
    """``(backend, why)``; backend None means every row stays with the engine's backend."""
    selected = ctx.selection.name
    if selected in FLASH:
        return None, f"the engine's backend is {selected} for every row already"
    prefill = getattr(ctx.attention, "prefill", None)
    if prefill is not None and requested in ("auto", prefill.name):
        return prefill, f"the prefill part of {selected}"
    candidates = FLASH if requested == "auto" else (requested,)
    reasons = []
    for name in candidates:
        try:
            sel = select_attention(ctx.platform, name, dtype=ctx.dtype, head_dim=ctx.shape.head_dim,
                                   block_size=ctx.kv.block_size, kv_layout=KVLayout.LAST_EXITED,
                                   adaptive_exit=False)
        except AttentionSelectionError as exc:
            reasons.append(str(exc))
            continue
        return build_attention(ctx.platform, sel), "usable for prompt rows"
    why = "; ".join(reasons) or "no candidate"
    if requested != "auto":
        from rlt.platform.errors import ConfigError

        raise ConfigError(f"--packed-prefill-prompt-backend {requested}: {why}")
    return None, f"no FlashAttention backend usable for prompt rows ({why}); prompt rows stay with {selected}"
