"""KVCacheManager units: LRU eviction of cached pages, a failed admission evicts nothing
(vllm-rlt F6), claimed cached pages are charged, incremental growth of all planes together."""

from __future__ import annotations

from rlt.attention import KVLayout
from rlt.kvcache.manager import KVCacheManager
from rlt.platform.engine.request import Request
from rlt.platform.sampling_params import SamplingParams


def _req(i, prompt, max_tokens=4, max_loops=2):
    return Request(f"q{i}", list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   max_loops=max_loops, min_loops=1, exit_threshold=1.0, stop_token_ids=frozenset(), arrival_index=i)


def _kv(num_blocks=12):
    return KVCacheManager(layout=KVLayout.LAST_EXITED, block_size=4, num_blocks=num_blocks, num_planes=2,
                          max_num_seqs=4, max_pages=8, incremental=True, prefix_cache=True)


def _cache(kv, slot, req):
    assert kv.admit(slot, req, req.num_prompt, cached_pages=kv.match_pages(req))
    kv.publish(slot, req.num_prompt)
    kv.free(slot)
    kv.audit()


def test_cached_pages_count_as_free_and_evict_least_recently_used_first():
    kv = _kv()
    a, b = _req(0, range(10, 19)), _req(1, range(30, 39))  # 9 tokens: 2 full pages x 2 planes each
    _cache(kv, 0, a)
    _cache(kv, 1, b)
    assert kv.index.num_pages == 4 and kv.num_free == 12
    again = _req(2, range(10, 19))
    assert kv.match_pages(again) == 2
    _cache(kv, 0, again)  # a is now the most recently used
    big = _req(3, range(100, 120), max_loops=2)  # 5 pages x 2 planes = 10 blocks: 4 free, 3 entries evicted
    assert kv.admit(1, big, 20)
    kv.audit()
    assert kv.index.evictions == 3 and kv.match_pages(_req(4, range(30, 39))) == 0  # b went first
    assert kv.match_pages(_req(5, range(10, 19))) == 1  # then a's tail page; its first page stays reachable


def test_failed_admission_evicts_nothing():
    kv = _kv()
    _cache(kv, 0, _req(0, range(10, 19)))
    too_big = _req(1, range(50, 80))  # 8 pages x 2 planes = 16 > 12 blocks
    assert not kv.admit(0, too_big, 30)
    assert kv.index.evictions == 0 and kv.index.num_pages == 2
    kv.audit()


def test_claimed_evictable_pages_are_charged_and_growth_takes_every_plane():
    kv = _kv(num_blocks=8)
    _cache(kv, 0, _req(0, range(10, 19)))  # 4 evictable blocks, 4 free
    hit = _req(1, range(10, 19), max_tokens=8)
    assert kv.match_pages(hit) == 2
    assert not kv.admit(1, hit, 9, cached_pages=2, reserve=3)  # 2 new + 4 claimed + 3 reserve > 8
    assert kv.admit(1, hit, 9, cached_pages=2)  # 1 new page x 2 planes
    assert kv.num_free == 2 and kv.held_blocks(1) == 6
    assert kv.grow(1, hit, 13) and kv.held_blocks(1) == 8
    assert not kv.grow(1, hit, 17)  # no block left: nothing changes
    assert kv.held_blocks(1) == 8
    kv.audit()


def test_pages_being_computed_make_sharers_wait_until_published_or_released():
    kv = _kv(num_blocks=24)
    owner = _req(0, range(10, 23))  # 13 tokens: 3 full pages it computes and publishes
    sharer = _req(1, list(range(10, 18)) + [99, 98])  # shares pages 0-1, then diverges
    short = _req(2, range(10, 14))  # one page, which holds its last token: it takes nothing from the cache
    assert not kv.waits_for_inflight(sharer)
    assert kv.admit(0, owner, owner.num_prompt)
    kv.audit()
    assert kv.waits_for_inflight(sharer) and not kv.waits_for_inflight(short)
    kv.publish(0, 4)  # page 0 written at every plane: page 1 is still being computed
    assert kv.match_pages(sharer) == 1 and kv.waits_for_inflight(sharer)
    kv.publish(0, 8)
    kv.audit()
    assert kv.match_pages(sharer) == 2 and not kv.waits_for_inflight(sharer)
    assert kv.inflight_waits == 1  # counted once per request
    other = _req(3, list(range(10, 22)) + [7, 7, 7, 7])  # shares pages 0-2; page 2 is still in flight
    assert kv.match_pages(other) == 2 and kv.waits_for_inflight(other)
    kv.free(0)  # released before page 2 was published: nobody computes it any more
    kv.audit()
    assert kv.match_pages(other) == 2 and not kv.waits_for_inflight(other)
