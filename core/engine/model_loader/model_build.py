"""Building a model from its config and loading its weights, the same way on every rank.

``AsyncEngine`` (rank 0) and the other tensor-parallel ranks (``core.engine.distributed.tp_worker``) both
call :func:`build_model`; under ``core.parallel.building(group)`` the shared layers shard
themselves and their weight loaders keep this rank's slice of each checkpoint tensor.
"""

from __future__ import annotations

import torch

from core.engine.config import EngineArgs
from core.engine.model_loader.loader import ModelConfig, build_quant_method, check_load_format, checkpoint_weights, finish_loading
from core.errors import ModelLoadError, UnknownNameError
from core.interfaces import ModelContext
from core.layers import VocabEmbedding


def build_model(plugins, args: EngineArgs, mc: ModelConfig, device: torch.device,
                load_format: str | None = None) -> torch.nn.Module:
    """The model of ``mc`` on ``device`` with its weights loaded (``load_format`` overrides
    ``args.load_format``; ``dummy``: random weights seeded by ``--random-seed``), in eval mode."""
    try:
        factory = plugins.resolve("model", mc.architecture)
    except UnknownNameError as e:
        raise ModelLoadError(f"architecture {mc.architecture!r} is not supported: {e}") from None
    load_format = load_format or args.load_format
    check_load_format(mc, load_format)
    quant = build_quant_method(plugins, args.quantization, getattr(args, "torchao_config", None), mc, device, load_format)
    with torch.device(device):
        model = factory(mc.hf_config, ModelContext(mc.dtype, device, quant))
    for p in model.parameters():
        if p.dtype.is_floating_point and p.dtype != mc.dtype and not getattr(p, "keep_dtype", False):
            p.data = p.data.to(mc.dtype)
    if load_format == "dummy":
        init_dummy_weights(model, args.random_seed or 0)
    else:
        model.load_weights(checkpoint_weights(mc, model, quant, load_format, mmap=not args.weight_loader_disable_mmap))
    finish_loading(model, quant)
    if args.enable_fp32_lm_head:
        for m in model.modules():
            if isinstance(m, VocabEmbedding):
                m.use_fp32_logits()
    return model.eval()


def init_dummy_weights(model: torch.nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """``--load-format dummy``: every parameter uniform in [low, high] (SGLang's dummy
    loader), so a model shape runs from its config.json alone, e.g. for benchmarks."""
    gens: dict[torch.device, torch.Generator] = {}
    for p in model.parameters():
        if p.dtype.is_floating_point:
            # drawn where the parameter lives: 8B random floats on the CPU take minutes
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            if p.dtype in (torch.float32, torch.bfloat16, torch.float16):
                p.data.uniform_(low, high, generator=gen)
            else:  # fp8 scales and weights: drawn in float32, then cast
                p.data.copy_(torch.empty(p.shape, device=p.device).uniform_(low, high, generator=gen).to(p.dtype))
        else:
            p.data.zero_()
