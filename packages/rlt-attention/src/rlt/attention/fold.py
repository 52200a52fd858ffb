"""Last-arriver folds: a small reduction kernel folded into the kernel that makes its pieces (policy).

Two kernels of a decode layer exist only to combine pieces another kernel just wrote: the merge of
split decode attention (``merge_splits_kernel``) and the reduction of split-K o_proj / down_proj
pieces with the sandwich norm (``add_norm_norm``). At a few rows each is microseconds of launch,
ramp-up and flush for kilobytes of work — two or three of the eight kernels a layer launches. A fold
removes the second kernel: every program of the producer writes its piece as before, then takes a
ticket from a per-output counter; the program that draws the last ticket has every piece available
and does the reduction itself, then resets the counter to zero for the next launch.

The device-side pattern (``triton_kernels/fold.py``): pieces stored by all threads, a CTA barrier,
one ``atom.add.acq_rel.gpu`` per program (release: the barrier makes the CTA's stores observed by the
thread that releases them; acquire: the last program sees every other program's pieces), the
pieces then read with ``.cg`` loads (L2, never a stale L1 line), and the sums in the same order and
rounding as the kernel it replaces — results are bit-identical to the unfolded pair (tested under
the interpreter on CPU, and on the GPU in the GPU suite). Counters are zero-initialised int32
buffers allocated with the scratch (before capture), zero again after every launch, so graph
replays need nothing.

``RLT_FOLD=1`` turns the folds on, ``0`` off, a comma list of :data:`SITES` only those (to time each
alone: ``attention`` — the split-attention merge; ``split_k`` — add_norm_norm into the split-K o_proj /
down_proj; ``tiles`` — the fused q/k/v and gate/up projections split over K by the wave rule); unset:
:data:`DEFAULT` (read once, at import; :func:`refresh` reads it again). On CUDA only (the ordering above is written against the PTX memory
model; ROCm is not verified) and under the Triton interpreter (which runs programs one after another,
so the last program folds — how CI tests it).
"""

from __future__ import annotations

import os

import torch

#: ``RLT_FOLD`` when unset: off until an H200 A/B measures it (the GPU suite checks exactness;
#: ``benchmarks/decode_kernels.py`` and ``scripts/decode_h200.sh VARIANTS=fold`` time it).
DEFAULT = "0"
#: the places a fold can ride (module docstring), each switched on by name in ``RLT_FOLD``
SITES = ("attention", "split_k", "tiles")


def parse_sites(value: str) -> frozenset[str]:
    """The sites ``RLT_FOLD=value`` turns on: ``1`` all, ``0`` none, else a comma list of :data:`SITES`."""
    if value in ("0", "1"):
        return frozenset(SITES if value == "1" else ())
    sites = frozenset(v.strip() for v in value.split(",") if v.strip())
    if not sites or not sites <= set(SITES):
        raise ValueError(f"RLT_FOLD={value!r}: expected 0, 1 or a comma list of {', '.join(SITES)}")
    return sites


class _Setting:
    """``RLT_FOLD`` / ``TRITON_INTERPRET`` as read once, and the per-device decisions made from them."""

    def __init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        self.value = os.environ.get("RLT_FOLD") or DEFAULT
        self.sites = parse_sites(self.value)
        self.flag = bool(self.sites)
        self.interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        self.by_index: dict[int | None, bool] = {}


_SETTING = _Setting()


def refresh() -> None:
    """Read ``RLT_FOLD`` / ``TRITON_INTERPRET`` again (tests that flip them call this)."""
    _SETTING.refresh()


def fold_capable(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` can run the last-arriver pattern at all, whatever ``RLT_FOLD`` says, and why.
    (A launch shape that asks for K splits explicitly — ``RLT_LINEAR_TILES``, a tile sweep — needs
    only this: its last program sums the splits with the fold's tickets.)"""
    if device.type == "cpu" and _SETTING.interpreting:
        return True, "Triton interpreter"
    if device.type != "cuda":
        return False, f"{device.type} device: the folded kernels are Triton kernels for CUDA"
    if torch.version.hip is not None:
        return False, "ROCm: the fold's memory ordering is not verified there"
    return True, "CUDA device"


def fold_status(device: torch.device) -> tuple[bool, str]:
    """Whether the folds run on ``device``, and why (for ``/v1/engine``)."""
    if not _SETTING.flag:
        return False, "RLT_FOLD=0" if os.environ.get("RLT_FOLD") == "0" else "off by default (RLT_FOLD=1 turns it on)"
    on, why = fold_capable(device)
    return on, f"{why} (RLT_FOLD={_SETTING.value})" if on else why


def fold_enabled(t: torch.Tensor, site: str | None = None) -> bool:
    """Whether kernels over ``t``'s device fold their reductions at ``site`` (one of :data:`SITES`; None:
    at any) — from the device only: graph-safe; one dict lookup after the device's first call."""
    if not _SETTING.flag or (site is not None and site not in _SETTING.sites):
        return False
    device = t.device
    if device.type != "cuda":
        return device.type == "cpu" and _SETTING.interpreting
    on = _SETTING.by_index.get(device.index)
    if on is None:
        on = _SETTING.by_index[device.index] = fold_status(device)[0]
    return on
