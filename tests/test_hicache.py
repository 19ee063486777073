"""HiCache's host tier (issue 46): the tiered radix bookkeeping on its own (evict -> host-resident ->
match -> load back, the bytes included), then engines over a tiny float32 Llama with a deliberately
small device pool: a long prefix evicted by other prompts and requested again is loaded back from
the host and gives the tokens of a fresh prefill, under each write policy and page size; flush
clears every tier; a full host pool drops its LRU entries and the tree stays consistent."""

from __future__ import annotations

import random
import re

import pytest
import torch

from core.engine.config import EngineArgs, engine_args_from_kwargs
from core.engine.mem_cache.kv_cache import PageAllocator, allocate_kv_cache
from core.engine.mem_cache.hierarchical import HiRadixCache, build_tree_cache, check_hicache_args
from core.engine.mem_cache.host_pool import HostKVPool
from core.errors import CoreError
from core.server.metrics import Metrics
from tests.conftest import assert_pool_free, greedy

POLICIES = ("write_back", "write_through", "write_through_selective")


# --------------------------------------------------------------------------- the tiered tree, model-free
def _tiered(ps: int, device_pages: int, host_pages: int, policy: str):
    alloc = PageAllocator(device_pages + 1, ps)
    kv = allocate_kv_cache(2, device_pages + 1, ps, 2, 3, torch.float32, torch.device("cpu"))
    tree = HiRadixCache(ps, "lru", alloc, HostKVPool(kv, host_pages), policy)
    return alloc, kv, tree


def _fill(kv, pages: list[int], ids: list[int]) -> None:
    """Write a recognisable K/V for each token: its id (K) and minus its id (V), every layer."""
    ps = kv.page_size
    for pos, tok in enumerate(ids):
        slot = pages[pos // ps] * ps + pos % ps
        for layer in range(len(kv.k)):
            kv.k[layer][slot] = tok + layer
            kv.v[layer][slot] = -tok - layer


def _read(kv, pages: list[int], n: int) -> list[float]:
    ps = kv.page_size
    return [kv.k[1][pages[p // ps] * ps + p % ps][0, 0].item() for p in range(n)] + \
           [kv.v[0][pages[p // ps] * ps + p % ps][1, 2].item() for p in range(n)]


def _insert(alloc, kv, tree, ids):
    pages = alloc.allocate(len(ids) // alloc.page_size)
    _fill(kv, pages, ids)
    assert tree.insert(ids, pages) == 0
    return pages


def _load_back(tree, ids):
    """An admission's match, then the load the batch carries, issued (the model runner's part)."""
    got = tree.match_prefix(ids, load_back=True)
    if (loads := tree.take_loads()) is not None:
        loads.issue()
    return got


@pytest.mark.parametrize("ps", [1, 4])
def test_evicted_prefix_stays_host_resident_and_loads_back_with_its_kv(ps):
    alloc, kv, tree = _tiered(ps, device_pages=8, host_pages=12, policy="write_back")
    a = list(range(100, 100 + 6 * ps))
    pages = _insert(alloc, kv, tree, a)
    want = _read(kv, pages, len(a))
    assert tree.host_used_pages == 0  # write_back: nothing on the host before an eviction
    alloc.free(tree.evict(6))
    tree.check()
    assert alloc.num_free == alloc.capacity and tree.total_pages == 0
    assert tree.host_used_pages == 6 and tree.stats.bytes_to_host == 6 * tree.host_pool.bytes_per_page
    # the node stays, host-resident: a plain match sees nothing on the device
    assert tree.match_prefix(a) == ([], tree.root)
    _fill(kv, list(range(1, 9)), [0] * 8 * ps)  # the device pool is overwritten meanwhile
    got, node = tree.match_prefix(a[: 5 * ps], load_back=True)  # a match ending inside the node splits it
    tree.check()
    expect = [x for i, x in enumerate(want) if i % len(a) < 5 * ps]
    assert _read(kv, got, 5 * ps) != expect  # queued, not copied: the batch being built carries the load
    loads = tree.take_loads()
    assert tree.take_loads() is None and loads.issue().issued  # (the runner's part, as its forward starts)
    assert len(got) == 5 and _read(kv, got, 5 * ps) == expect
    assert tree.stats.host_hit_tokens == 5 * ps and tree.stats.bytes_to_device == 5 * tree.host_pool.bytes_per_page
    assert tree.evictable_pages == 5 and tree.host_used_pages == 6  # loaded pages keep their host copy
    tree.inc_lock_ref(node)
    assert tree.evict(8) == [] and tree.protected_pages == 5  # locked: neither tier lets go of it
    tree.dec_lock_ref(node)
    # the rest of the prefix loads too; a second eviction needs no new copy (already backed up)
    got, _ = _load_back(tree, a)
    assert len(got) == 6 and _read(kv, got, len(a)) == want
    before = tree.stats.bytes_to_host
    alloc.free(tree.evict(6))
    assert tree.stats.bytes_to_host == before and tree.host_used_pages == 6
    tree.check()


def test_insert_over_a_host_resident_node_takes_the_callers_pages():
    alloc, kv, tree = _tiered(1, device_pages=8, host_pages=12, policy="write_back")
    a = list(range(10, 16))
    want = _read(kv, _insert(alloc, kv, tree, a[:4]), 4)
    alloc.free(tree.evict(4))
    pages = alloc.allocate(6)
    _fill(kv, pages, [0] * 6)  # the caller's own (numerically different) KV for the same tokens
    assert tree.insert(a, pages) == 0  # nothing was on the device: every page is the tree's now
    tree.check()
    assert tree.match_prefix(a)[0] == pages and tree.total_pages == 6
    assert _read(kv, pages, 4) == want  # the tree's copy wins, as on the device: both tiers agree


@pytest.mark.parametrize("policy", POLICIES)
def test_write_policies_back_up_at_their_moment(policy):
    alloc, kv, tree = _tiered(2, device_pages=8, host_pages=12, policy=policy)
    a = list(range(40, 48))
    _insert(alloc, kv, tree, a)
    assert tree.host_used_pages == (4 if policy == "write_through" else 0)
    for hit in range(1, 3):
        tree.match_prefix(a, load_back=True)
        assert tree.host_used_pages == (0 if policy == "write_back" or (policy.endswith("selective") and hit < 2) else 4)
    alloc.free(tree.evict(4))
    assert tree.host_used_pages == 4 and tree.total_pages == 0  # all three keep it on the host now
    tree.check()


def test_write_through_copies_on_the_writer_thread_and_eviction_waits_for_it(monkeypatch):
    """A write-through backup never runs on the caller's (the scheduler's) thread: ``insert``
    returns while the copy is still blocked; evicting the node's device pages waits for the copy,
    and the host copy then holds the node's KV (loaded back intact)."""
    import threading
    import time

    from core.engine.mem_cache import host_pool

    gate, threads = threading.Event(), []
    real = host_pool.copy_rows

    def slow_copy(*a):
        threads.append(threading.current_thread().name)
        gate.wait(5)
        real(*a)

    monkeypatch.setattr(host_pool, "copy_rows", slow_copy)
    alloc, kv, tree = _tiered(2, device_pages=8, host_pages=12, policy="write_through")
    a = list(range(60, 68))
    want = _read(kv, _insert(alloc, kv, tree, a), 8)  # returns with the copy still blocked
    assert tree.host_used_pages == 4 and len(tree._writing) == 1 and tree.stats.bytes_to_host == 0
    threading.Timer(0.2, gate.set).start()
    t0 = time.perf_counter()
    alloc.free(tree.evict(4))  # the device pages are freed only once the copy is done
    assert time.perf_counter() - t0 >= 0.15 and not tree._writing
    assert threads == ["core-hicache-writer_0"] and tree.stats.bytes_to_host == 4 * tree.host_pool.bytes_per_page
    pages, _ = _load_back(tree, a)
    assert _read(kv, pages, 8) == want
    tree.check()
    tree.close()


def test_unbacked_leaf_leaves_the_tree_and_host_pool_drops_its_lru_entries():
    alloc, kv, tree = _tiered(1, device_pages=4, host_pages=6, policy="write_back")
    a, b = [1, 2, 3, 4], [9, 8, 7, 6]
    _insert(alloc, kv, tree, a)
    alloc.free(tree.evict(4))  # a -> host (4 of 6 host pages)
    _insert(alloc, kv, tree, b)
    alloc.free(tree.evict(4))  # b needs 4: a, the least recently used host entry, leaves the tree
    tree.check()
    assert tree.stats.host_evicted_pages == 4 and tree.host_used_pages == 4
    assert tree.match_prefix(a, load_back=True)[0] == [] and not tree.root.children.get((1,))
    assert len(tree.match_prefix(b, load_back=True)[0]) == 4
    # write_through with a full host pool: a backup that cannot fit is skipped, eviction drops the node
    alloc, kv, tree = _tiered(1, device_pages=10, host_pages=9, policy="write_through")
    _insert(alloc, kv, tree, list(range(20, 28)))  # 8 host pages
    _insert(alloc, kv, tree, [50, 51])  # no room (nothing host-only to drop): not backed up
    assert tree.host_used_pages == 8
    tree.match_prefix(list(range(20, 28)))  # (the other one is the least recently used)
    alloc.free(tree.evict(2))
    tree.check()
    assert tree.match_prefix([50, 51], load_back=True)[0] == [] and tree.host_used_pages == 8


def test_lpm_ranks_a_host_resident_prefix_by_its_whole_length():
    """The lpm queue order counts the tokens a host-tier hit would load back, not just the device
    match; counting them leaves the host-resident nodes as they were (no split, no hit counted)."""
    from core.engine.request import Req
    from core.engine.sampling_params import SamplingParams
    from core.engine.schedule_policy import SchedulePolicy

    alloc, kv, tree = _tiered(2, device_pages=8, host_pages=12, policy="write_back")
    host_ids, dev_ids = list(range(10, 22)), [90, 91, 92, 93]
    _insert(alloc, kv, tree, host_ids)
    alloc.free(tree.evict(6))  # host-resident now: 12 tokens
    _insert(alloc, kv, tree, dev_ids)  # on the device: 4 tokens
    before = [(n.id, n.hit_count, len(n.key)) for n in tree._nodes() if not n.pages]
    assert tree.cached(host_ids[:10] + [1, 2, 3]) == (10, tree.root)  # (a partial host node counts its pages)
    assert tree.cached(dev_ids + [5, 6])[0] == 4
    assert [(n.id, n.hit_count, len(n.key)) for n in tree._nodes() if not n.pages] == before
    reqs = [Req(rid=str(i), prompt_ids=ids + [7, 7, 7], params=SamplingParams()) for i, ids in enumerate((dev_ids, host_ids))]
    order = SchedulePolicy("lpm", tree).order(reqs, lambda r: tree.cached(r.prompt_ids[:-1]))
    assert [r.rid for r in order] == ["1", "0"] and [r.prefix_len for r in order] == [12, 4]


def test_a_load_evicted_before_any_batch_took_it_is_dropped():
    """A loaded-back node evicted again before the next batch carried its load (the request that
    matched it was not admitted) must not be copied later into pages handed out meanwhile; a reset
    drops the queue too."""
    alloc, kv, tree = _tiered(1, device_pages=8, host_pages=12, policy="write_back")
    a = [1, 2, 3, 4]
    _insert(alloc, kv, tree, a)
    alloc.free(tree.evict(4))
    got, _ = tree.match_prefix(a, load_back=True)
    assert len(got) == 4 and tree.host_pool._queued
    alloc.free(tree.evict(4))  # unlocked: evicted again, host-resident
    assert tree.take_loads() is None
    tree.match_prefix(a, load_back=True)
    alloc.free(tree.reset())
    assert tree.take_loads() is None
    tree.check()
    # one load spanning two nodes, one of them evicted again: the other's pages still get their copy
    alloc, kv, tree = _tiered(1, device_pages=12, host_pages=16, policy="write_back")
    b = [1, 2, 3, 4, 5, 6]
    first = _insert(alloc, kv, tree, b[:3])  # two nodes: [1, 2, 3] and, below it, [4, 5, 6]
    pages = first + alloc.allocate(3)
    _fill(kv, pages, b)
    assert tree.insert(b, pages) == 3
    want = _read(kv, pages, 6)
    alloc.free(tree.evict(6))
    got, node = tree.match_prefix(b, load_back=True)
    tree.inc_lock_ref(node.parent)  # the first node stays, the second goes again
    alloc.free(tree.evict(3))
    _fill(kv, list(range(1, 13)), [0] * 12)
    tree.take_loads().issue()
    assert _read(kv, got[:3], 3) == want[:3] + want[6:9]
    tree.dec_lock_ref(node.parent)
    tree.check()


def test_the_forward_waits_for_each_layers_load_before_its_attention(tiny_llama):
    """Where a batch's load-backs land layer by layer (a GPU), the runner hands the forward
    ``layer_ready`` and every shared Attention layer calls it, in order, before reading the pool;
    a model whose attention layers are not all the shared ones waits for every layer first."""
    from tests.conftest import make_engine

    path, _ = tiny_llama()
    # (torch_native: the model's Python layers, as on a GPU; the CPU's one-op layers never see a
    # load in flight, since the CPU copies a batch's loads before its forward)
    eng = make_engine(path, max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=4.0,
                      attention_backend="torch_native")
    ae = eng.engine
    layers = len(ae.kv_cache.k)
    calls: list = []

    class Landing:  # a GPU's KVLoads, as the runner sees it once issued
        issued, events = True, [object()] * layers

        def issue(self):
            calls.append("issue")
            return self

        def wait_layer(self, layer):
            calls.append(layer)

        def wait_all(self):
            calls.append("all")

    take = ae.tree_cache.take_loads
    ae.tree_cache.take_loads = lambda: Landing() if not calls else take()
    try:
        eng.generate(input_ids=list(range(5, 30)), sampling_params=greedy(2))
        assert calls == ["issue", *range(layers)]
        calls.clear()
        Landing.events = [object()] * (layers + 1)  # (as if one attention layer were the model's own)
        eng.generate(input_ids=list(range(6, 31)), sampling_params=greedy(2))
        assert calls == ["issue", "all"]
    finally:
        ae.tree_cache.take_loads = take
        eng.shutdown()


def test_reset_clears_every_tier():
    alloc, kv, tree = _tiered(1, device_pages=8, host_pages=12, policy="write_through")
    _insert(alloc, kv, tree, [1, 2, 3])
    alloc.free(tree.evict(2))
    assert tree.host_used_pages == 3
    alloc.free(tree.reset())
    tree.check()
    assert tree.host_used_pages == 0 and alloc.num_free == alloc.capacity and not tree.root.children


# --------------------------------------------------------------------------- flags
def test_flags_parse_and_bad_values_are_clear_errors():
    args = engine_args_from_kwargs({"model_path": "/m", "enable_hierarchical_cache": True, "hicache_ratio": 3.0,
                                    "hicache_write_policy": "write_back", "hicache_io_backend": "direct",
                                    "hicache_mem_layout": "page_first", "hicache_size": 0})
    assert args.enable_hierarchical_cache and args.hicache_write_policy == "write_back"
    check_hicache_args(args)
    for policy in ("best_effort", "wait_complete", "timeout"):  # SGLang's values (the storage tier: test_hicache_storage)
        check_hicache_args(EngineArgs(model_path="/m", hicache_storage_prefetch_policy=policy))
    for kw, flag in [({"hicache_storage_backend": "file"}, "--enable-hierarchical-cache"),
                     ({"hicache_storage_prefetch_policy": "eager"}, "--hicache-storage-prefetch-policy"),
                     ({"hicache_write_policy": "write_around"}, "--hicache-write-policy"),
                     ({"hicache_mem_layout": "head_first"}, "--hicache-mem-layout"),
                     ({"hicache_io_backend": "fast"}, "--hicache-io-backend"),
                     ({"enable_hierarchical_cache": True, "tp_size": 2}, "--tp-size"),
                     ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "--disable-radix-cache")]:
        with pytest.raises(CoreError, match=re.escape(flag)):
            check_hicache_args(EngineArgs(model_path="/m", **kw))
    # the host pool must be larger than the device pool (SGLang's rule)
    alloc = PageAllocator(65, 1)
    kv = allocate_kv_cache(1, 65, 1, 1, 2, torch.float32, torch.device("cpu"))
    with pytest.raises(CoreError, match="--hicache-ratio"):
        build_tree_cache(EngineArgs(model_path="/m", enable_hierarchical_cache=True, hicache_ratio=1.0), alloc, kv, 16)
    tree = build_tree_cache(EngineArgs(model_path="/m", enable_hierarchical_cache=True, hicache_size=1), alloc, kv, 16)
    assert tree.host_pool.capacity == 10**9 // 16  # --hicache-size is in GB and overrides the ratio


# --------------------------------------------------------------------------- engines
def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def fresh(tiny_llama, engine_factory):
    path, _ = tiny_llama()
    return engine_factory(path, max_total_tokens=1024, disable_radix_cache=True)


def _host_hit_metric(metrics: Metrics) -> float:
    text = metrics.render().decode()
    return float(re.search(r'^core:hicache_host_hit_tokens_total\{[^}]*\} (\S+)$', text, re.M).group(1))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_prefix_evicted_by_other_prompts_is_served_from_the_host(tiny_llama, engine_factory, fresh, policy, page_size):
    path, _ = tiny_llama()
    eng = engine_factory(path, max_total_tokens=160, page_size=page_size, enable_hierarchical_cache=True,
                         hicache_write_policy=policy, hicache_ratio=4.0)
    ae = eng.engine
    metrics = Metrics("tiny")
    metrics.attach(ae)
    rng = random.Random(7)
    prefix = _ids(rng, 100)
    a, others = prefix + _ids(rng, 5), [_ids(rng, 110) for _ in range(2)]
    ref = fresh.generate(input_ids=a, sampling_params=greedy(6))["output_ids"]
    first = eng.generate(input_ids=a, sampling_params=greedy(6))
    again = eng.generate(input_ids=a, sampling_params=greedy(6))  # (a second hit: selective backs up)
    assert first["output_ids"] == again["output_ids"] == ref
    for p in others:  # each alone nearly fills the device pool: the prefix leaves the device
        eng.generate(input_ids=p, sampling_params=greedy(6))
    tree = ae.tree_cache
    assert tree.match_prefix(prefix)[0] == [] and tree.host_used_pages > 0
    hits = tree.stats.host_hit_tokens
    out = eng.generate(input_ids=a, sampling_params=greedy(6))
    assert out["output_ids"] == ref  # loaded back: the tokens of a fresh prefill
    assert out["meta_info"]["cached_tokens"] >= 100 // page_size * page_size - page_size
    assert tree.stats.host_hit_tokens - hits >= 96 and tree.stats.bytes_to_device > 0
    assert _host_hit_metric(metrics) == tree.stats.host_hit_tokens > 0
    ae.scheduler.check_accounting()
    assert_pool_free(eng)
    assert ae.flush_cache()  # /flush_cache clears the host tier too
    assert tree.host_used_pages == 0 and tree.total_pages == 0 and not tree.root.children
    assert_pool_free(eng)
    out = eng.generate(input_ids=a, sampling_params=greedy(6))
    assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] == 0


def test_full_host_pool_drops_its_lru_prefixes_and_stays_consistent(tiny_llama, engine_factory, fresh):
    path, _ = tiny_llama()
    eng = engine_factory(path, max_total_tokens=128, enable_hierarchical_cache=True, hicache_ratio=1.5,
                         hicache_write_policy="write_back")
    ae, rng = eng.engine, random.Random(3)
    prompts = [_ids(rng, 90) for _ in range(5)]  # 5 x ~95 tokens through a 192-token host pool
    refs = [o["output_ids"] for o in fresh.generate(input_ids=prompts, sampling_params=greedy(4))]
    for p, ref in zip(prompts, refs):
        assert eng.generate(input_ids=p, sampling_params=greedy(4))["output_ids"] == ref
        ae.scheduler.check_accounting()
    tree = ae.tree_cache
    assert tree.stats.host_evicted_pages > 0 and tree.host_used_pages <= tree.host_pool.capacity
    assert tree.match_prefix(prompts[0], load_back=True)[0] == []  # the oldest left every tier
    tree.check()
    out = eng.generate(input_ids=prompts[-2], sampling_params=greedy(4))  # recent: still on the host
    assert out["output_ids"] == refs[-2] and out["meta_info"]["cached_tokens"] >= 80
    assert_pool_free(eng)


def test_unknown_storage_backend_is_a_start_up_error(tiny_llama):
    from tests.conftest import make_engine

    path, _ = tiny_llama()
    with pytest.raises(CoreError, match="--hicache-storage-backend 'nfs'"):
        make_engine(path, enable_hierarchical_cache=True, hicache_storage_backend="nfs")
