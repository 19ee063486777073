"""A tensor-parallel rank other than 0: its shard of the model and of the KV pool, and a
loop that runs whatever step rank 0 broadcasts (``core.engine.distributed.tensor_parallel``).

It never schedules or samples: it joins the group, builds its shard of the model exactly as
rank 0 does (``build_model`` under ``building(group)``), allocates the KV pool rank 0 sized,
then runs ``forward_step`` per broadcast step until told to stop. Any error is final: the
process exits non-zero, which rank 0 sees (a collective fails, its watcher sees the exit).
The process also exits when its parent does, so no rank outlives its server.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import attrs
import structlog
import torch

from core.engine import gc_watch
from core.engine.config import EngineArgs
from core.engine.distributed.collectives import DistPlan, KVSpec, agree, broadcast, describe, init_rank, rank_device
from core.engine.device import configure_cpu_runtime, placed_device, use_cuda_device
from core.engine.hybrid_attention import build_attention_backend
from core.engine.memory_saver import RankMemory, rank_job as memory_job
from core.engine.mem_cache.kv_cache import allocate_kv_cache
from core.engine.model_loader.loader import load_model_config
from core.engine.model_loader.model_build import build_model
from core.engine.model_loader.weight_sync import rank_job
from core.engine.model_runner import forward_step
from core.interfaces import AttentionConfig
from core.layers import local_heads
from core.parallel import building

log = structlog.get_logger("core.engine.distributed.tp_worker")


def rank_main(rank: int, args: EngineArgs, plan: DistPlan) -> None:
    """Entry point of a spawned rank process; exits 0 when rank 0 stops it, 1 on any error."""
    from core.log import configure_logging

    configure_logging(args.log_level)
    configure_cpu_runtime(args.cpu_threads)
    _exit_with_parent()
    try:
        code = _serve(rank, args, plan)
    except BaseException as e:  # noqa: BLE001 - any error ends this rank; rank 0 reports it
        log.error("tp.rank_failed", rank=rank, error=describe(e), exc_info=not isinstance(e, KeyboardInterrupt))
        code = 1
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a process group torn down by atexit can hang on dead peers


def _serve(rank: int, args: EngineArgs, plan: DistPlan) -> int:
    from core.plugins import load_plugins

    device = rank_device(placed_device(args), plan, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    use_cuda_device(device, args)
    tp, control = init_rank(plan, rank)
    error, model = None, None
    try:
        plugins = load_plugins(args.plugins, strict=args.strict_plugins)
        mc = load_model_config(args.model_path, args.dtype, device, args.context_length, args.served_model_name,
                               args.json_model_override_args)
        with building(tp):
            model = build_model(plugins, args, mc, device)
    except Exception as e:
        error = describe(e)
    if any(agree(control, error)):
        return 1
    kind, spec = broadcast(control)
    assert kind == "kv" and isinstance(spec, KVSpec)
    backend, kv, error = None, None, None
    try:
        backend, kv = _attention_backend(plugins, mc, spec, tp, device)
    except Exception as e:
        error = describe(e)
    if any(agree(control, error)):
        return 1
    log.info("tp.rank_ready", rank=rank, device=str(device), threads=torch.get_num_threads())
    gc_watch.freeze(f"tensor-parallel rank {rank}")  # the model and modules: out of later collector passes
    gc_watch.configure(args)
    lora = None  # core.engine.lora.tp.RankLoRA with --enable-lora
    groups: dict = {}  # this rank's trainer process groups (weight_sync.rank_job)
    memory = None  # this rank's released memory (core.engine.memory_saver.RankMemory)
    with torch.inference_mode():
        while True:
            msg = broadcast(control)
            if msg[0] == "step":
                if msg[1].lora_sync is not None:
                    lora.apply(msg[1].lora_sync)
                forward_step(model, backend, msg[1], device, kv=kv)
            elif msg[0] in ("lora", "lora_add"):  # the adapters' pool, then each adapter rank 0 loads
                error = None
                try:
                    if msg[0] == "lora":
                        from core.engine.lora.tp import RankLoRA

                        lora = RankLoRA(model, msg[1], mc.dtype, device)
                    else:
                        lora.add(*msg[1:])
                except Exception as e:
                    error = describe(e)
                agree(control, error)
            elif msg[0] == "weights":  # a trainer's weights, its process group (core.engine.model_loader.weight_sync)
                agree(control, rank_job(model, groups, device, rank, msg[1]))
            elif msg[0] == "memory":  # --enable-memory-saver's release or resume (core.engine.memory_saver)
                memory = memory or RankMemory(kv, args.enable_weights_cpu_backup)
                agree(control, memory_job(memory, model, msg[1], msg[2]))
            elif msg[0] == "reload":
                model = _reload(plugins, args, mc, msg[1], device, tp, control) or model
                gc_watch.refreeze()
            elif msg[0] == "stop":
                for name in list(groups):  # (a live gloo group can abort the interpreter's exit)
                    rank_job(model, groups, device, rank, ("leave", name))
                return 0
            else:
                raise RuntimeError(f"unknown message from rank 0: {msg[0]!r}")


def _attention_backend(plugins, mc, spec: KVSpec, tp, device: torch.device):
    """This rank's backend and its shard of the KV pool (its KV heads, rank 0's page count)."""
    cfg = mc.hf_config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    heads, kv_heads = local_heads(heads, getattr(cfg, "num_key_value_heads", None) or heads, tp)
    kv = allocate_kv_cache(cfg.num_hidden_layers, spec.num_pages, spec.page_size, kv_heads, head_dim, spec.dtype, device)
    return build_attention_backend(plugins, spec.backend,  # (a "prefill=..,decode=.." name: both, core.engine.hybrid_attention)
                                   AttentionConfig(cfg.num_hidden_layers, heads, kv_heads, head_dim, mc.dtype, device, kv)), kv


def _reload(plugins, args: EngineArgs, old, model_path: str, device: torch.device, tp, control):
    """``/update_weights_from_disk`` on this rank: the new model when every rank loaded it, else None."""
    model, error = None, None
    try:
        new = load_model_config(model_path, args.dtype, device, args.context_length, args.served_model_name,
                                args.json_model_override_args)
        new = attrs.evolve(new, context_len=old.context_len, served_name=old.served_name, dtype=old.dtype)
        with building(tp):
            model = build_model(plugins, args, new, device, "auto")
    except Exception as e:
        error = describe(e)
    return None if any(agree(control, error)) else model


def _exit_with_parent() -> None:
    """Exit when the process that started this rank is gone (a killed server leaves no ranks)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="core-tp-parent-watch", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
