"""RotaryEmbedding builds its frequencies and cos/sin caches on the device the model is built
on (``with torch.device(...)``, as the engine builds models), for every rope type. The scaled
types once took ``inv_freq`` from the CPU while the positions landed on the build device, which
broke Llama-3 on CUDA; the ``meta`` device shows the same mix-up on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from core.layers import RotaryEmbedding

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def rope_config(name: str) -> LlamaConfig:
    extra = {"rope_parameters": ROPES[name]} if ROPES[name] else {}
    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128, **extra)


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_caches_are_built_on_the_build_device(name):
    cfg = rope_config(name)
    with torch.device("meta"):
        rope = RotaryEmbedding(cfg, 16, 128)
    assert rope.cos.device.type == rope.sin.device.type == "meta"
    assert rope.cos.shape == (128, 16)
    cpu = RotaryEmbedding(cfg, 16, 128)
    assert cpu.cos.device.type == "cpu" and torch.isfinite(cpu.cos).all() and torch.isfinite(cpu.sin).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(ROPES))
def test_rope_caches_on_cuda_equal_the_cpu_ones(name):
    cfg = rope_config(name)
    with torch.device("cuda"):
        rope = RotaryEmbedding(cfg, 16, 128)
    assert rope.cos.is_cuda and rope.sin.is_cuda
    cpu = RotaryEmbedding(cfg, 16, 128)
    torch.testing.assert_close(rope.cos.cpu(), cpu.cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope.sin.cpu(), cpu.sin, atol=1e-5, rtol=1e-5)
