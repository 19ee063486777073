"""Reloading the served weights in place (SGLang's ``/update_weights_from_disk``): the update waits
for the running requests, swaps in a freshly loaded module (the old one stays on any failure) and
flushes the prefix cache, while requests submitted meanwhile are held (``AsyncEngine._held``)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

import attrs
import structlog
import torch

from core.engine import gc_watch
from core.engine.model_loader.hub import is_hub_id, resolve_hub_path
from core.engine.model_loader.loader import load_model_config, with_tokenizer_eos
from core.errors import CoreError

if TYPE_CHECKING:
    from core.engine.async_engine import AsyncEngine

log = structlog.get_logger("core.engine")
UPDATE_IDLE_POLL_S = 0.005  # how often a weight update checks whether the running requests have finished


async def update_weights(engine: AsyncEngine, model_path: str, flush_cache: bool, torch_empty_cache: bool,
                         load_format: str) -> tuple[bool, str]:
    """``AsyncEngine.update_weights_from_disk``: wait for the running requests, swap, flush, admit the held ones."""
    return await exclusive(engine, flush_cache, torch_empty_cache, reload_weights, engine, model_path, load_format)


async def exclusive(engine: AsyncEngine, flush_cache: bool, torch_empty_cache: bool,
                    job: Callable[..., tuple[bool, str]], *args: Any) -> tuple[bool, str]:
    """``job(*args)`` -> (success, message) on the forward thread with nothing running: one update
    at a time, after the queued and running requests finish (at once while generation is paused),
    requests submitted meanwhile held; then, on success, the prefix cache flushed (``flush_cache``)."""
    async with engine._update_lock:
        try:
            await hold_until_idle(engine)
            ok, message = await engine._on_forward_thread(job, *args)
            if ok:  # (weights that came back without their values have them now: core.engine.memory_saver)
                engine.memory_saver.weights_stale = False
            if ok and flush_cache and engine.scheduler.flush_cache():  # idle: always succeeds
                log.info("engine.cache_flushed", reason="weights updated")
                getattr(engine.tree_cache, "clear_storage", bool)()  # a stored page has no weight version
            if torch_empty_cache and engine.device.type == "cuda":
                torch.cuda.empty_cache()
            return ok, message
        finally:
            release_held(engine)


async def hold_until_idle(engine: AsyncEngine) -> None:
    """Hold new requests (``AsyncEngine.submit``) and wait until the queued and running ones have
    finished, or at once while generation is paused (under ``engine._update_lock``)."""
    engine._held = [] if engine._held is None else engine._held  # (memory released: already holding)
    while engine.scheduler.has_work and engine.fatal_error is None and not engine.paused:
        await asyncio.sleep(UPDATE_IDLE_POLL_S)


def release_held(engine: AsyncEngine) -> None:
    """Admit the requests held during a weight update (or fail them if the engine stopped); not
    while memory is released (``core.engine.memory_saver``)."""
    if engine.memory_saver.holds and engine.fatal_error is None:
        return
    held, engine._held = engine._held or [], None
    if not held:
        return
    try:
        engine.submit(held)
    except CoreError as e:
        for r in held:
            r.finish_reason, r.finish_time = {"type": "abort", "message": str(e)}, time.perf_counter()
            engine._finished(r)


def reload_weights(engine: AsyncEngine, model_path: str, load_format: str = "auto") -> tuple[bool, str]:
    """A fresh model from ``model_path`` in place of the served one, on the forward thread; (success, message)."""
    old = engine.model_config
    args = engine.args
    if engine.lora is not None:  # its pool's layers are the served module's: the new one would run without them
        return False, ("Failed to update weights: not supported with --enable-lora (the adapters are bound to the "
                       "served weights); restart the server with the new model")
    try:
        if is_hub_id(model_path):  # (into --download-dir, as the served model was)
            model_path = str(resolve_hub_path(model_path, cache_dir=args.download_dir))
        new = load_model_config(model_path, args.dtype, engine.device, args.context_length, args.served_model_name,
                                args.json_model_override_args)
    except Exception as e:
        return False, f"Failed to get weights iterator: {e}"
    if new.architecture != old.architecture:
        return False, (f"Failed to update weights: architecture {new.architecture} differs from the served "
                       f"{old.architecture}; only weights of the same architecture can be loaded")
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "intermediate_size", "head_dim", "tie_word_embeddings")
    diff = [k for k in keys if getattr(new.hf_config, k, None) != getattr(old.hf_config, k, None)]
    if diff:
        return False, f"Failed to update weights: the new config differs in {', '.join(diff)}"
    new = attrs.evolve(new, context_len=old.context_len, served_name=old.served_name, dtype=old.dtype)
    try:
        # a fresh module: a failure half-way leaves the served one intact (on every rank)
        load = lambda: engine._load_model(new, load_format)  # noqa: E731
        model = load() if engine.tp_group is None else engine.tp_group.reload(model_path, load)
    except Exception as e:
        log.warning("engine.update_weights_failed", model_path=model_path, error=str(e))
        return False, f"Failed to update weights: {type(e).__name__}: {e}"
    engine.model = model
    engine.runner.model = model
    engine.model_config = with_tokenizer_eos(new, engine.tokenizer)
    if engine.multimodal is not None:  # its vision tower is the new module's (same architecture: same processor)
        engine.multimodal.model = model
    if engine.runner.graphs is not None:  # the captured graphs read the old weights
        engine.runner.graphs = engine._capture_cuda_graphs()
    gc_watch.refreeze()  # (the old module out of the permanent generation)
    log.info("engine.weights_updated", model_path=model_path)
    return True, "Succeeded to update model weights."
