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
    if args.enable_fp32_lm_head:  # (a packed head is dropped: its output is rounded, or its weights quantized)
        for m in model.modules():
            if isinstance(m, VocabEmbedding):
                m.pack_head, m.packed_head = Float32Head, None
    return model.eval()


class Float32Head(torch.nn.Module):
    """``--enable-fp32-lm-head`` (SGLang's flag): a ``VocabEmbedding``'s logits in float32, not rounded
    to the activations' dtype, from the table itself: on a GPU a bf16 / fp16 product accumulating
    into float32 outputs, elsewhere through a float32 copy of the table, made on first use (only a
    table used as the head gets one)."""

    def __init__(self, emb: VocabEmbedding) -> None:
        super().__init__()
        self.__dict__["emb"] = emb  # (not a submodule: the table is the embedding's)
        self.__dict__["table"] = None

    def table_updated(self, embedding: torch.nn.Module) -> None:
        self.__dict__["table"] = None  # (made again on the next use)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.__dict__["emb"].weight
        if w.device.type == "cuda" and w.dtype in (torch.bfloat16, torch.float16) and hidden.dtype == w.dtype:
            return torch.mm(hidden, w.t(), out_dtype=torch.float32)
        if self.__dict__["table"] is None:
            self.__dict__["table"] = w.detach().float()  # (a float32 table: the table itself)
        return torch.nn.functional.linear(hidden.float(), self.__dict__["table"])


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
