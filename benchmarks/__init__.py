"""rlt benchmarks: the offline harness (``python -m benchmarks.offline_bench``) and its helpers."""
