"""Triton kernels of the ``triton`` attention backend (CUDA and ROCm; the interpreter on CPU).

Modules: :mod:`.paging` (depth-resolved page addressing shared by every kernel),
:mod:`.paged_decode` (one-token rows, split-KV flash-decoding plus its merge kernel),
:mod:`.paged_prefill` (ragged multi-token causal rows), :mod:`.kv_write` (fused K/V scatter).
Importing this package imports Triton; the backend does so lazily, on first use. Host-side
policy (which kernel, tile sizes, split counts, scratch) lives in
``rlt.attention.backends.triton_backend``, not here.
"""
