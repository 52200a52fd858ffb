"""rlt-kvcache: incremental KV allocation, preemption and recovery, priority scheduling and the
depth-aware prefix cache, installed through the engine's KV manager and scheduler policy."""

from rlt.kvcache.manager import KVAuditError, KVCacheManager
from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions
from rlt.kvcache.scheduler import KVCacheScheduler
from rlt.kvcache.swap import HostSwapper, SwappedKV

__all__ = ["HostSwapper", "KVAuditError", "KVCacheManager", "KVCacheScheduler", "PreemptionOptions",
           "PrefixCacheOptions", "SwappedKV"]
