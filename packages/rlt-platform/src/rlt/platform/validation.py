"""Checks shared by every front end (the engine's input processing, rlt-serve): one definition
of each rule, each failing with :class:`InvalidRequestError` naming the field."""

from __future__ import annotations

from typing import Sequence

from rlt.platform.errors import InvalidRequestError

#: seeds are 64-bit: signed or unsigned spellings are both accepted (taken modulo 2**64)
SEED_MIN, SEED_END = -(2**63), 2**64


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_token_ids(ids: Sequence, vocab_size: int, field: str = "prompt") -> None:
    """Every id an int in ``[0, vocab_size)``."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return  # the common case at C speed (an 8K prompt: 0.6 ms instead of 1.4 ms on the dev box)
    for bad in ids:  # the first offender (None too), named in the error
        if not is_int(bad) or not 0 <= bad < vocab_size:
            raise InvalidRequestError(f"{field}: token id {bad!r} is outside the vocabulary [0, {vocab_size})", field)


def check_seed(seed, field: str = "seed") -> None:
    if seed is not None and (not is_int(seed) or not SEED_MIN <= seed < SEED_END):
        raise InvalidRequestError(f"{field}: must be an integer in the 64-bit range [{SEED_MIN}, {SEED_END - 1}], "
                                  f"got {seed!r}", field)
