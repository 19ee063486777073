"""SGLang's ``/get_weights_by_name``: a parameter's values by its checkpoint (Hugging Face) name,
for a trainer to check a weight sync. A packed layer's part (``q_proj`` of ``qkv_proj``) is its
rows; a quantized layer's weight is its dequantized matrix; a tied ``lm_head.weight`` is the
embedding table, as SGLang answers."""

from __future__ import annotations

import torch

from core.errors import InvalidRequest


def weights_by_name(model: torch.nn.Module, name: str, truncate_size: int = 100) -> list:
    """The first ``truncate_size`` rows (values, for a vector) of parameter ``name``, as float32 lists."""
    if not isinstance(name, str) or not isinstance(truncate_size, int) or truncate_size < 0:
        raise InvalidRequest("name must be a parameter name and truncate_size a nonnegative integer", param="name")
    if name == "lm_head.weight" and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        name = "model.embed_tokens.weight"
    module_name, _, attr = name.rpartition(".")
    parent, _, last = module_name.rpartition(".")
    dst, shard = getattr(model, "packed_modules", {}).get(last, (last, None))
    try:
        module = model.get_submodule(f"{parent}.{dst}" if parent else dst)
    except AttributeError:
        module = None
    tp = getattr(module, "tp", None)
    if tp is not None and tp.size > 1:
        raise InvalidRequest("get_weights_by_name is not supported with --tp-size > 1 (each rank holds a shard)",
                             param="name")
    value = getattr(module, attr, None) if module is not None else None
    if not isinstance(value, torch.Tensor) and attr == "weight" and hasattr(getattr(module, "quant_method", None),
                                                                          "dequantize"):
        value = module.quant_method.dequantize(module)
    if not isinstance(value, torch.Tensor):
        raise InvalidRequest(f"this model has no parameter named {name!r}", param="name")
    if shard is not None:
        value = value.narrow(0, *module.shard_span(shard))
    return value[:truncate_size].detach().to("cpu", torch.float32).tolist()
