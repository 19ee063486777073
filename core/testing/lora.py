"""Random peft LoRA checkpoints for a Llama-shaped model, written without peft or the model's
weights: what tests and benchmarks of multi-LoRA serving load (``--lora-paths``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path | str, config: Any, rank: int = 16, targets: Sequence[str] = PROJECTIONS,
                         seed: int = 0, b_scale: float = 0.01, alpha: float | None = None) -> Path:
    """A peft checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``) in ``folder`` over
    ``targets`` of every layer of the Llama-shaped ``config``: A ~ N(0, 1 / in_features), B ~
    N(0, ``b_scale``²), ``lora_alpha`` ``alpha`` (default: 2 x rank). Returns the folder."""
    from safetensors.torch import save_file

    h, inter = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config.num_hidden_layers):
        for m in targets:
            fin, fout = shapes[m]
            key = f"base_model.model.model.layers.{i}.{'mlp' if m in _MLP else 'self_attn'}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) / fin**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * b_scale
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank if alpha is None else alpha,
        "target_modules": list(targets), "bias": "none", "task_type": "CAUSAL_LM"}))
    return folder
