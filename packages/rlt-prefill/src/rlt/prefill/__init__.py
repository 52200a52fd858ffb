"""rlt-prefill: how prompts run — chunked and wavefront chunked prefill, FlashAttention for prompt
rows under adaptive exit, and prefill metadata through mapped host memory.

Features (entry point ``rlt.features``, see :mod:`rlt.prefill.features`):

- ``chunked_prefill`` (:mod:`rlt.prefill.scheduler`): prompts in chunks of at most
  ``--prefill-chunk-size`` within the step budget; ``--chunked-prefill-wavefront`` for WCPB;
- ``packed_prefill`` (:mod:`rlt.prefill.row_groups`): prompt rows through FlashAttention, decode
  rows through Triton, per row group within a step;
- ``prefill_uva`` (:mod:`rlt.prefill.uva_uploader`): a step's metadata staged in one pinned host
  buffer, read by a Triton kernel through UVA (copied where the probe fails).

This package imports only public modules of rlt-platform and rlt-attention.
"""
