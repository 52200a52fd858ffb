"""``prefill_uva``: a step's metadata staged in one pinned host buffer and read by one kernel.

:class:`StagingUploader` is an :class:`~rlt.platform.engine.interfaces.Uploader`. Every array of
an upload (all depths' rows of the step: token ids, positions, slot mappings, cumulative lengths,
every plane's page tables, the row groups) is packed into one pinned host *bank* as 32-bit words
(8-byte arrays first, every array 16-byte aligned), then moved in one operation:

- mapped (the UVA probe passed, ``ctx.uva.enabled``): :func:`rlt.platform.uva.mapped_copy_`'s
  kernel reads the pinned bank at its host address and writes the device bank — no copy-engine
  transfer, one launch;
- otherwise: one non-blocking copy of the bank.

Banks are used round robin and grow by powers of two; before a bank is refilled the host waits on
the event recorded behind its last use, so the device never reads a bank the host is rewriting.
The device bank is split into views of the original names, shapes and dtypes (no further kernels).
On CPU (tests) the bank is an ordinary tensor and the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np
import torch

from rlt.platform.engine.staging import ALIGN_BYTES, pack_aligned
from rlt.platform.uva import mapped_copy_


class _Bank:
    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.device: torch.Tensor | None = None
        self.event = None

    def reserve(self, words: int, device: torch.device, pinned: bool) -> None:
        if self.event is not None:
            self.event.synchronize()  # the device finished reading this bank's last contents
        if self.host is None or self.host.numel() < words:
            size = 1 << max(10, (words - 1).bit_length())
            self.host = torch.empty(size, dtype=torch.int32, pin_memory=pinned)
            self.device = torch.empty(size, dtype=torch.int32, device=device)


def pack_words(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, tuple[int, np.ndarray]]]:
    """All arrays as one int32 word vector (8-byte arrays first) and each array's word offset.

    Every array starts on a 16-byte boundary (4 words), as in the base uploader
    (``rlt.platform.engine.staging``): Triton specialises kernels on pointer alignment, so views
    whose alignment followed the step's sizes could compile kernel variants mid-serving."""
    order = sorted(arrays, key=lambda n: -arrays[n].dtype.itemsize)
    held = []
    for name in order:
        a = np.ascontiguousarray(arrays[name])
        if a.dtype.itemsize not in (4, 8):
            raise TypeError(f"prefill_uva stages 4- and 8-byte arrays; {name!r} is {a.dtype}")
        held.append(a)
    packed, starts = pack_aligned([a.reshape(-1).view(np.int32) for a in held], ALIGN_BYTES // 4)
    return packed, {name: (int(o), a) for name, a, o in zip(order, held, starts)}


class StagingUploader:
    def __init__(self, device: torch.device, *, mapped: bool, banks: int = 3) -> None:
        self.device = device
        self.mapped = mapped
        self._pinned = device.type == "cuda"
        self._banks = [_Bank() for _ in range(banks)]
        self._next = 0
        #: uploads moved by the kernel / by a copy (for stats and tests)
        self.num_mapped = 0
        self.num_copied = 0

    def _use_kernel(self) -> bool:
        return self.mapped and (self.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def upload(self, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        packed, layout = pack_words(arrays)
        n = packed.size
        bank = self._banks[self._next]
        self._next = (self._next + 1) % len(self._banks)
        bank.reserve(max(n, 1), self.device, self._pinned)
        bank.host[:n].copy_(torch.from_numpy(packed))
        dst = bank.device[:n]
        if n and self._use_kernel():
            mapped_copy_(dst, bank.host[:n])
            self.num_mapped += 1
        elif n:
            dst.copy_(bank.host[:n], non_blocking=self._pinned)
            self.num_copied += 1
        if self._pinned:
            bank.event = torch.cuda.Event()
            bank.event.record()
        out: dict[str, torch.Tensor] = {}
        for name, (offset, a) in layout.items():
            words = a.size * a.dtype.itemsize // 4
            piece = dst[offset:offset + words]
            dtype = {("i", 4): torch.int32, ("i", 8): torch.int64, ("f", 4): torch.float32,
                     ("f", 8): torch.float64, ("u", 4): torch.int32, ("u", 8): torch.int64,
                     ("b", 4): torch.int32}[(a.dtype.kind, a.dtype.itemsize)]
            out[name] = piece.view(dtype).view(a.shape)
        return out
