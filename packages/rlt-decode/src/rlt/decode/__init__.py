"""rlt.decode — the decode loop off the host's critical path.

- :mod:`rlt.decode.buffers` — static per-row step buffers (host ring of pinned banks -> one set
  of device buffers), written in place every decode step.
- :mod:`rlt.decode.batch` — the batch builder for decode-only steps: rows padded to a bucket by
  repeating row 0 (harmless: identical KV writes, ignored outputs), one upload per step.
- :mod:`rlt.decode.executor` — runs a decode-only step from the static buffers: eagerly, or as a
  captured CUDA/HIP graph per (row bucket, context bucket); other steps go to the base executor.
- :mod:`rlt.decode.readback` — lagged readback: pinned ring + events, the lagged step's handle,
  the pipeline's counters (host syncs per step, in-flight depth).
- :mod:`rlt.decode.pipeline` — the token-level pipeline's step loop (steps in flight, tokens read
  back ``depth`` steps late).
- :mod:`rlt.decode.feature` — the ``static_buffers``, ``graphs`` and ``pipeline`` features.
"""
