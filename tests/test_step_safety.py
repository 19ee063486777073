"""The engine step contains its own failures: a bug in scheduling or in result processing fails
the requests it concerns with a message naming the stage, and later requests complete; a
scheduler loop that dies fails everything pending and reports the engine unhealthy. Runs on
every available device (the CPU always, CUDA when present)."""

from __future__ import annotations

import pytest

from core.errors import Unavailable
from tests.conftest import assert_greedy_matches, assert_pool_free, greedy

pytestmark = pytest.mark.timeout(120)  # a regression here is a hang: fail it quickly


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama("gqa")


def _aborted_with(out: dict, text: str) -> bool:
    reason = out["meta_info"]["finish_reason"]
    return reason["type"] == "abort" and text in reason["message"]


def _after_two_tokens(ae) -> bool:
    return any(len(r.output_ids) >= 2 for r in ae.scheduler.running)


def test_schedule_raising_once_fails_its_requests_and_later_ones_complete(tiny, engine_factory, monkeypatch):
    """``schedule()`` raises once, after it has taken pages and advanced the requests (the worst
    case: its batch is lost half-built). Every request it held fails with the stage and the
    error; the pool is whole again; the next requests are served and still match transformers."""
    path, hf = tiny
    eng = engine_factory(path, skip_tokenizer_init=True)
    ae, real = eng.engine, eng.engine.scheduler.schedule
    fired = []

    def flaky():
        out = real()
        if not fired and _after_two_tokens(ae):
            fired.append(True)
            raise RuntimeError("injected scheduler bug")
        return out

    monkeypatch.setattr(ae.scheduler, "schedule", flaky)
    outs = eng.generate(input_ids=[[1, 5, 6], [1, 7]], sampling_params=greedy(12))
    assert fired
    for out in outs:
        assert _aborted_with(out, "internal error (scheduling): RuntimeError: injected scheduler bug"), out
        assert 2 <= len(out["output_ids"]) < 12
    assert ae.healthy and ae.fatal_error is None
    assert_pool_free(eng)
    again = eng.generate(input_ids=[[1, 5, 6], [1, 9, 9, 4]], sampling_params=greedy(6))
    for prompt, out in zip([[1, 5, 6], [1, 9, 9, 4]], again):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert_greedy_matches(hf, prompt, out["output_ids"], 6)
    assert_pool_free(eng)


def test_result_processing_raising_fails_only_that_batch(tiny, engine_factory, monkeypatch):
    """With one running slot, the running request's result processing raises once: it fails
    with the stage named, and the queued request behind it then runs to completion."""
    path, _ = tiny
    eng = engine_factory(path, skip_tokenizer_init=True, max_running_requests=1)
    ae, real = eng.engine, eng.engine.scheduler.process
    fired = []

    def flaky(batch, result):
        updates = real(batch, result)
        if not fired and _after_two_tokens(ae):
            fired.append(True)
            raise ValueError("injected processing bug")
        return updates

    monkeypatch.setattr(ae.scheduler, "process", flaky)
    first, second = eng.generate(input_ids=[[1, 5, 6], [1, 7]], sampling_params=greedy(8))
    assert _aborted_with(first, "internal error (result processing): ValueError: injected processing bug"), first
    assert second["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert ae.healthy
    assert_pool_free(eng)


def test_forward_raising_fails_its_batch_and_serving_goes_on(tiny, engine_factory, monkeypatch):
    path, _ = tiny
    eng = engine_factory(path, skip_tokenizer_init=True)
    ae, real = eng.engine, eng.engine.runner.run
    fired = []

    def flaky(batch):
        if not fired and not batch.is_prefill:
            fired.append(True)
            raise RuntimeError("injected forward bug")
        return real(batch)

    monkeypatch.setattr(ae.runner, "run", flaky)
    out = eng.generate(input_ids=[1, 5, 6], sampling_params=greedy(4))
    assert _aborted_with(out, "internal error (forward): RuntimeError: injected forward bug")
    assert eng.generate(input_ids=[1, 5, 6], sampling_params=greedy(4))["meta_info"]["finish_reason"]["type"] == "length"
    assert_pool_free(eng)


def test_a_listener_that_raises_does_not_fail_requests(tiny, engine_factory):
    path, _ = tiny
    eng = engine_factory(path, skip_tokenizer_init=True)
    ae = eng.engine

    def broken(*args):
        raise RuntimeError("observer bug")

    ae.step_listeners.append(broken)
    ae.finish_listeners.append(broken)
    try:
        out = eng.generate(input_ids=[1, 5, 6], sampling_params=greedy(3))
    finally:
        ae.step_listeners.remove(broken)
        ae.finish_listeners.remove(broken)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert ae.healthy


def test_a_dead_loop_fails_everything_pending_and_reports_unhealthy(tiny, engine_factory):
    """The loop itself raising (here: a step that cannot even be contained) stops the engine for
    good: the running and the queued requests all fail with the reason, ``healthy`` turns False
    with ``fatal_error`` saying why, and new work is refused instead of hanging."""
    path, _ = tiny
    eng = engine_factory(path, skip_tokenizer_init=True, max_running_requests=1)
    ae = eng.engine
    real_step = ae._step

    async def dying():
        if _after_two_tokens(ae):
            raise RuntimeError("injected loop bug")
        await real_step()

    ae._step = dying
    outs = eng.generate(input_ids=[[1, 5, 6], [1, 7], [1, 8, 9]], sampling_params=greedy(20))
    for out in outs:
        assert _aborted_with(out, "the scheduler loop died: RuntimeError: injected loop bug"), out
    assert [len(o["output_ids"]) for o in outs] == [2, 0, 0]  # one ran, two were still queued
    assert not ae.healthy and "injected loop bug" in ae.fatal_error
    assert not ae.scheduler.has_work
    with pytest.raises(Unavailable, match="injected loop bug"):
        eng.generate(input_ids=[1, 5, 6], sampling_params=greedy(2))
