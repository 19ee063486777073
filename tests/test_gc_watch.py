"""The garbage collector on the serving path (issue 42, ``core.engine.gc_watch``): freezing moves
what is alive out of later passes, and ``--gc-warning-threshold-secs`` logs slow passes."""

from __future__ import annotations

import gc

import pytest
from structlog.testing import capture_logs

from core.engine import gc_watch
from tests.conftest import make_engine


@pytest.fixture
def unfrozen():
    """Whatever a test freezes goes back to the collector afterwards (this process runs many tests)."""
    before, thresholds = [cb for cb in gc.callbacks], gc.get_threshold()
    yield
    gc.unfreeze()
    gc.callbacks[:] = before
    gc.set_threshold(*thresholds)


def test_freeze_moves_what_is_alive_out_of_later_passes(unfrozen) -> None:
    keep = [[i] for i in range(1000)]  # tracked objects, alive
    gc.unfreeze()
    with capture_logs() as logs:
        frozen = gc_watch.freeze("test")
    assert frozen >= len(keep) and gc.get_freeze_count() >= len(keep)  # (some frozen objects die by refcount since)
    assert not any(x is keep for x in gc.get_objects(generation=2))  # no generation scans them any more
    assert [e for e in logs if e["event"] == "gc.frozen"] == [
        {"event": "gc.frozen", "log_level": "info", "context": "test", "objects": frozen}]
    garbage = []
    garbage.append(garbage)  # a cycle made after the freeze is still collected
    del garbage
    assert gc.collect() >= 1


def test_a_weight_reload_refreezes_and_the_old_model_is_freed(tiny_llama, unfrozen) -> None:
    import weakref

    path, _ = tiny_llama()
    eng = make_engine(path)
    try:
        eng.freeze_gc()  # as core serve does once ready: the served model is frozen
        old = weakref.ref(eng.engine.model)
        with capture_logs() as logs:
            ok, msg = eng._call(eng.engine.update_weights_from_disk(str(path)))
        assert ok, msg
        assert old() is None  # nothing of it left, even in the permanent generation
        assert any(e["event"] == "gc.frozen" and e["context"] == "weight update" for e in logs)
        assert gc.get_freeze_count() > 0
    finally:
        eng.shutdown()


def test_slow_passes_are_logged_past_the_threshold_and_the_watch_is_one_callback(unfrozen) -> None:
    gc_watch.watch(1e-9)
    gc_watch.watch(1e-9)
    assert sum(isinstance(cb, gc_watch._SlowPasses) for cb in gc.callbacks) == 1
    with capture_logs() as logs:
        gc.collect()
    slow = [e for e in logs if e["event"] == "gc.slow_pass"]
    assert slow and slow[0]["generation"] == 2 and slow[0]["seconds"] >= 0 and "freeze_gc" in slow[0]["hint"]
    gc_watch.watch(3600.0)  # the threshold moves: nothing is that slow
    with capture_logs() as logs:
        gc.collect()
    assert not [e for e in logs if e["event"] == "gc.slow_pass"]
    gc_watch.watch(0)
    assert not any(isinstance(cb, gc_watch._SlowPasses) for cb in gc.callbacks)


def test_the_flag_reaches_the_engine_and_engine_freeze_gc_freezes(tiny_llama, unfrozen) -> None:
    path, _ = tiny_llama()
    eng = make_engine(path, gc_warning_threshold_secs=1e-9, gc_threshold=[5000, 20])
    try:
        assert any(isinstance(cb, gc_watch._SlowPasses) and cb.threshold_s == 1e-9 for cb in gc.callbacks)
        assert gc.get_threshold()[:2] == (5000, 20)  # SGLang's --gc-threshold: gc.set_threshold
        gc.unfreeze()
        eng.freeze_gc()
        assert gc.get_freeze_count() > 0
        assert eng.generate("hello", {"max_new_tokens": 3, "temperature": 0})["meta_info"]["completion_tokens"] == 3
    finally:
        eng.shutdown()


def test_the_flags_parse_with_sglangs_defaults_and_bad_values_are_refused(tiny_llama) -> None:
    from core.cli import build_parser
    from core.engine.config import engine_args_from_namespace
    from core.errors import CoreError
    from core.server.args import validate_serve_args

    args = engine_args_from_namespace(build_parser().parse_args(["serve"]))
    assert args.gc_warning_threshold_secs == 0.0 and args.gc_threshold is None
    ns = build_parser().parse_args(["serve", "--gc-warning-threshold-secs", "0.05", "--gc-threshold", "700", "10", "10"])
    args = engine_args_from_namespace(ns)
    assert args.gc_warning_threshold_secs == 0.05 and args.gc_threshold == [700, 10, 10]
    for bad, match in ((["--gc-warning-threshold-secs", "-1"], "--gc-warning-threshold-secs must be >= 0"),
                       (["--gc-threshold", "1", "2", "3", "4"], "--gc-threshold takes 1 to 3 integers"),
                       (["--gc-threshold", "-5"], "--gc-threshold takes 1 to 3 integers")):
        with pytest.raises(CoreError, match=match):
            validate_serve_args(build_parser().parse_args(["serve", *bad]))
    with pytest.raises(SystemExit):  # argparse: not an integer
        build_parser().parse_args(["serve", "--gc-threshold", "x"])
    with pytest.raises(CoreError, match="--gc-threshold takes 1 to 3 integers"):  # the offline Engine's kwargs too
        make_engine(tiny_llama()[0], gc_threshold=[])
