"""The features of rlt-kvcache and how they install.

``preemption``: incremental KV allocation, preemption with swap / recompute recovery, priority
scheduling (one feature: incremental allocation cannot guarantee progress without preemption).
``prefix_cache``: the depth-aware prefix cache. Both live in one KV manager and one scheduler
policy, so whichever of the two is installed first replaces the engine's ``kv_manager`` and
``scheduler`` and the components read both features' options from ``ctx.feature_options``
(with ``prefix_cache`` alone, allocation stays full reservation and nothing is preempted).
Neither is enabled by default: ``--preemption``, ``--prefix-cache`` (or ``LLM(features=...)``).
"""

from __future__ import annotations

from rlt.kvcache.manager import KVCacheManager
from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions
from rlt.kvcache.scheduler import KVCacheScheduler
from rlt.platform.features import Feature

PREEMPTION = "preemption"
PREFIX_CACHE = "prefix_cache"
OURS = (PREEMPTION, PREFIX_CACHE)


def build_kv_manager(ctx) -> KVCacheManager:
    opts = ctx.feature_options
    return KVCacheManager.from_context(ctx, incremental=PREEMPTION in opts, prefix_cache=PREFIX_CACHE in opts)


def build_scheduler(ctx) -> KVCacheScheduler:
    return KVCacheScheduler.from_context(ctx, ctx.feature_options.get(PREEMPTION))


def install(builder, options) -> None:
    enabled_before = [n for n in OURS if n in builder.feature_options and n != builder.feature]
    if enabled_before:
        return  # the other rlt-kvcache feature installed the shared components; they read our options too
    builder.replace("kv_manager", build_kv_manager)
    builder.replace("scheduler", build_scheduler)


FEATURES = [
    Feature(name=PREEMPTION, package="rlt-kvcache",
            description="incremental KV allocation, preemption (swap to host / recompute) and priority scheduling",
            options=PreemptionOptions, install=install, enabled_by_default=False),
    Feature(name=PREFIX_CACHE, package="rlt-kvcache",
            description="depth-aware prefix cache of full prompt pages (per plane count, LRU)",
            options=PrefixCacheOptions, install=install, enabled_by_default=False),
]
