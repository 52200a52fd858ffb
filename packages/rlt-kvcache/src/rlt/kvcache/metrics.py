"""The counters rlt-kvcache reports through ``EngineStats.feature_metrics`` (``/metrics`` as
``rlt:<name>``): preemptions, swapped bytes and recompute tokens of the scheduler policy; hit rate,
cached pages and evictions of the prefix cache. Must not: compute anything it reports."""

from __future__ import annotations

from rlt.platform.engine.interfaces import FeatureMetric


def scheduler_metrics(c) -> list[FeatureMetric]:
    return [
        FeatureMetric("kv_preemptions", c.preemptions, "Requests preempted (swap or recompute)."),
        FeatureMetric("kv_preemptions_swap", c.swaps, "Preemptions that swapped the victim's KV to host memory."),
        FeatureMetric("kv_preemptions_recompute", c.recomputes, "Preemptions that dropped the victim's KV for recompute."),
        FeatureMetric("kv_priority_preemptions", c.priority_preemptions,
                      "Preemptions made to admit a strictly higher-priority request."),
        FeatureMetric("kv_swapped_out_bytes", c.swapped_out_bytes, "Bytes of KV copied to host memory."),
        FeatureMetric("kv_swapped_in_bytes", c.swapped_in_bytes, "Bytes of KV copied back from host memory."),
        FeatureMetric("kv_recompute_tokens", c.recompute_tokens, "Positions recomputed to restore preempted KV."),
        FeatureMetric("kv_resumed", c.resumed, "Preempted requests resumed."),
        FeatureMetric("kv_resumed_in_other_slot", c.resumed_in_other_slot,
                      "Preempted requests resumed in a different slot than they left."),
        FeatureMetric("kv_growth_stalls", c.stalls, "Rows deferred one step because their KV could not grow."),
    ]


def kv_metrics(kv) -> list[FeatureMetric]:
    q = kv.query_tokens
    return [
        FeatureMetric("prefix_cache_query_tokens", q, "Prompt tokens looked up in the prefix cache."),
        FeatureMetric("prefix_cache_hit_tokens", kv.hit_tokens, "Prompt tokens served from the prefix cache."),
        FeatureMetric("prefix_cache_hit_rate", kv.hit_tokens / q if q else 0.0,
                      "Hit tokens / query tokens so far.", kind="gauge"),
        FeatureMetric("prefix_cache_pages", kv.index.num_pages, "Pages in the prefix cache (one block per plane each).",
                      kind="gauge"),
        FeatureMetric("prefix_cache_evictions", kv.index.evictions, "Prefix cache pages evicted (LRU)."),
        FeatureMetric("prefix_cache_inflight_waits", kv.inflight_waits,
                      "Requests whose admission waited for a running request to publish the prompt pages they "
                      "share (instead of computing them again)."),
    ]
