"""The base :class:`Uploader`: one host-to-device copy per call for a set of small arrays.

Arrays are grouped by element size (4 or 8 bytes; float32 travels as its int32 bit pattern),
packed into one buffer per group and copied once, then split on the device into views — no
extra kernels. Each view starts on a 16-byte boundary (arrays are padded in the pack): Triton
specialises a kernel on whether each pointer argument is 16-byte aligned, so a view at an
offset that depends on the step's sizes could flip that and compile a kernel variant
mid-serving (each compile stalls its step for 0.3-2 s). On CUDA-like devices the packed buffer
is pinned and copied asynchronously; a buffer is reused only after the event recorded behind
its previous copy has completed.
"""

from __future__ import annotations

import numpy as np
import torch

_GROUPS = {4: (np.int32, torch.int32), 8: (np.int64, torch.int64)}
#: bytes every array's device view is aligned to
ALIGN_BYTES = 16


def pack_aligned(flat: list[np.ndarray], per: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate 1-D arrays of one dtype so each starts at a multiple of ``per`` elements
    (zero padding between them). Returns (the packed array, each array's start; one more entry:
    the total)."""
    starts = np.zeros(len(flat) + 1, np.int64)
    np.cumsum([-(-a.size // per) * per for a in flat], out=starts[1:])
    if len(flat) == 1:
        return flat[0], starts
    dtype = flat[0].dtype if flat else np.int32
    packed = np.zeros(int(starts[-1]), dtype)
    for a, o in zip(flat, starts):
        packed[o:o + a.size] = a
    return packed, starts


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without a host wait: through (cached) pinned memory and a
    non-blocking copy on CUDA-like devices (the caching host allocator keeps the pinned block
    until the copy has run). A plain ``.to(device)`` from pageable memory would synchronise the
    stream — wait for every queued kernel — which a step that must not wait (a lagged one) cannot
    afford. A plain copy elsewhere."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class CopyUploader:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._events: dict[tuple[int, int], object] = {}
        self._flip = 0

    def _host_buffer(self, size: int, nbytes: int) -> torch.Tensor:
        key = (size, self._flip)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            dtype = _GROUPS[size][1]
            buf = torch.empty(max(nbytes, 1024), dtype=dtype, pin_memory=True)
            self._buffers[key] = buf
        event = self._events.get(key)
        if event is not None:
            event.synchronize()
        return buf

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for size, (np_dtype, torch_dtype) in _GROUPS.items():
            names = [n for n, a in arrays.items() if a.dtype.itemsize == size]
            if not names:
                continue
            flat = [np.ascontiguousarray(arrays[n]).reshape(-1).view(np_dtype) for n in names]
            packed, starts = pack_aligned(flat, ALIGN_BYTES // size)  # 16-byte aligned views (module docstring)
            host = torch.from_numpy(packed)
            if self._pinned:
                buf = self._host_buffer(size, packed.size)[: packed.size]
                buf.copy_(host)
                dev = buf.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._events[(size, self._flip)] = event
            else:
                dev = host.to(self.device)
            for n, a, offset in zip(names, flat, starts):
                piece = dev[offset:offset + a.size]
                src = arrays[n]
                if src.dtype.kind == "f":
                    piece = piece.view(torch.float32 if size == 4 else torch.float64)
                out[n] = piece.view(src.shape)
        self._flip ^= 1
        return out
