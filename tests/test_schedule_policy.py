"""Schedule policies (fcfs, lpm, dfs-weight, lof, random) and priority scheduling: admission order."""

from __future__ import annotations

import pytest
import torch

from core.engine.mem_cache.kv_cache import PageAllocator, ReqToTokenTable
from core.engine.mem_cache.radix_cache import RadixCache
from core.engine.request import Req
from core.engine.sampler import SampleOutput
from core.engine.sampling_params import SamplingParams
from core.engine.scheduler import Scheduler, StepResult
from tests.conftest import assert_pool_free, greedy

A = list(range(10, 30))  # a cached 20-token prefix
B = list(range(50, 60))  # a cached 10-token prefix


def _sched(policy: str, max_running: int = 1, cache: bool = True, **kw) -> Scheduler:
    alloc = PageAllocator(513, 1)
    table = ReqToTokenTable(max_running, 128 + 1, torch.device("cpu"))
    return Scheduler(alloc, table, max_running_requests=max_running, max_prefill_tokens=4096, context_len=128, eos_ids=(2,),
                     tree_cache=RadixCache(1) if cache else None, schedule_policy=policy, **kw)


def _warm(s: Scheduler) -> None:
    """Cache A and B by running them to completion."""
    for i, p in enumerate((A, B)):
        s.add(Req(f"warm{i}", p, SamplingParams(max_new_tokens=1)))
    _drain(s)


def _drain(s: Scheduler) -> list[str]:
    order = []
    while s.has_work:
        batch, _ = s.schedule()
        order += [r.rid for r in batch.reqs if batch.is_prefill]
        s.process(batch, StepResult(SampleOutput([7] * len(batch.reqs), None, None)))
    return order


def _req(rid: str, ids: list[int], max_new: int = 1, priority: int | None = None) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new), priority=priority)


def _queue() -> list[Req]:
    return [
        _req("none", [99, 98, 97, 96], max_new=3),
        _req("b", B + [1, 2], max_new=5),
        _req("a_short", A[:5] + [3], max_new=1),
        _req("a", A + [4, 5], max_new=2),
    ]


def test_lpm_orders_by_longest_cached_prefix():
    s = _sched("lpm")
    _warm(s)
    for r in _queue():
        s.add(r)
    assert _drain(s) == ["a", "b", "a_short", "none"]
    assert s.tree_cache.protected_pages == 0


def test_fcfs_keeps_arrival_order():
    s = _sched("fcfs")
    _warm(s)
    for r in _queue():
        s.add(r)
    assert _drain(s) == ["none", "b", "a_short", "a"]


def test_lof_orders_by_longest_output_first():
    s = _sched("lof")
    for r in _queue():
        s.add(r)
    assert _drain(s) == ["b", "none", "a", "a_short"]


def test_dfs_weight_visits_the_heaviest_subtree_first():
    s = _sched("dfs-weight", max_running=8)  # one admission round: the order of a single sort
    _warm(s)
    queue = [_req("b1", B + [1]), _req("a1", A + [1]), _req("b2", B + [2]), _req("b3", B + [3]), _req("a2", A + [2])]
    for r in queue:
        s.add(r)
    order = _drain(s)
    # three requests wait under B, two under A: B's subtree first, each subtree's requests together
    assert order[:3] == ["b1", "b2", "b3"] and set(order[3:]) == {"a1", "a2"}


def test_random_is_a_seeded_permutation():
    orders = []
    for _ in range(2):
        s = _sched("random", seed=1)
        for i in range(8):
            s.add(_req(f"r{i}", [10 + i, 11]))
        orders.append(_drain(s))
    assert orders[0] == orders[1] and sorted(orders[0]) == [f"r{i}" for i in range(8)]
    assert orders[0] != [f"r{i}" for i in range(8)]


def test_cache_aware_policies_fall_back_to_fcfs_without_the_cache():
    s = _sched("lpm", cache=False)
    for r in _queue():
        s.add(r)
    assert _drain(s) == ["none", "b", "a_short", "a"]


@pytest.mark.parametrize("low_first,expected", [(False, ["hi", "mid1", "mid2", "lo", "none"]),
                                                (True, ["lo", "mid1", "mid2", "hi", "none"])])
def test_priority_scheduling(low_first, expected):
    """No priority comes after every priority, either way round (SGLang gives it the lowest);
    equal priorities keep arrival order."""
    s = _sched("fcfs", enable_priority_scheduling=True, schedule_low_priority_values_first=low_first)
    for rid, p in [("mid1", 5), ("lo", -1), ("hi", 10), ("none", None), ("mid2", 5)]:
        s.add(_req(rid, [10, 11, 12], priority=p))
    assert _drain(s) == expected


def test_priority_is_ignored_unless_enabled():
    s = _sched("fcfs")
    for rid, p in [("a", 1), ("b", 10)]:
        s.add(_req(rid, [10, 11], priority=p))
    assert _drain(s) == ["a", "b"]


def test_engine_policies_give_the_same_outputs(tiny_llama, engine_factory):
    path, _ = tiny_llama()
    prompts = [A + [i, i + 1] for i in range(3)] + [B + [i] for i in range(3)] + [[7, 8, 9]]
    ref = None
    for policy in ("fcfs", "lpm", "dfs-weight", "lof", "random"):
        eng = engine_factory(path, schedule_policy=policy, max_running_requests=2)
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy(4))]
        ref = ref or outs
        assert outs == ref, policy
        assert_pool_free(eng)


def test_priority_field_reaches_the_request(tiny_llama, engine_factory):
    from core.errors import InvalidRequest

    path, _ = tiny_llama()
    eng = engine_factory(path, enable_priority_scheduling=True)
    (r,) = eng.engine.make_requests([5, 6, 7], SamplingParams(max_new_tokens=1), priority=3)
    assert r.priority == 3
    with pytest.raises(InvalidRequest, match="priority"):
        eng.engine.make_requests([5, 6, 7], SamplingParams(max_new_tokens=1), priority="high")


def test_default_priority_value_and_abort_on_priority_when_disabled(tiny_llama, engine_factory):
    """SGLang's --default-priority-value stands for a request's missing priority under priority
    scheduling; --abort-on-priority-when-disabled refuses (503) a priority the server would ignore."""
    from core.errors import Unavailable

    path, _ = tiny_llama()
    eng = engine_factory(path, enable_priority_scheduling=True, default_priority_value=7)
    (r,) = eng.engine.make_requests([5, 6, 7], SamplingParams(max_new_tokens=1))
    (q,) = eng.engine.make_requests([5, 6, 7], SamplingParams(max_new_tokens=1), priority=-2)
    assert (r.priority, q.priority) == (7, -2)
    eng = engine_factory(path, abort_on_priority_when_disabled=True)
    with pytest.raises(Unavailable, match="Using priority is disabled for this server"):
        eng.engine.make_requests([5, 6, 7], SamplingParams(max_new_tokens=1), priority=1)
    (r,) = eng.engine.make_requests([5, 6, 7], SamplingParams(max_new_tokens=1))
    assert r.priority is None
    eng = engine_factory(path)  # (without either flag, a priority is accepted and ignored, as SGLang)
    (r,) = eng.engine.make_requests([5, 6, 7], SamplingParams(max_new_tokens=1), priority=1)
    assert r.priority == 1
