"""rlt.attention — attention math and paged-KV write ops for looped language models.

This package is the bottom layer of rlt. It owns:

* the depth-aware paged KV storage (:class:`KVCache`) and the ops that write it,
* the per-step attention metadata (:class:`AttentionMetadata`), built once per step and shared
  by every layer and loop of that step,
* the attention backends (:mod:`rlt.attention.backends`): the Torch reference, the Ascend eager
  math, and (where importable) the GPU kernels.

It knows nothing of hardware detection: a backend is parameterised by whoever selects it
(``rlt.platform``), e.g. with the Triton dot precision.
"""

from rlt.attention.backend import AttentionBackend, BackendSpec, UnsuitableBackend
from rlt.attention.kv_cache import KVCache, KVLayout
from rlt.attention.metadata import AttentionMetadata
from rlt.attention.registry import BACKENDS, BackendEntry, create_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKENDS",
    "BackendEntry",
    "BackendSpec",
    "KVCache",
    "KVLayout",
    "UnsuitableBackend",
    "create_backend",
]
