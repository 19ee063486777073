"""The fused per-layer kernels (kernels/fused_ops.py) against the torch ops of core/layers.py
that they replace on a GPU: RMS norm (plain and Gemma's offset), rotary (full, partial,
llama3-scaled, on strided views of a fused QKV output) and the gated activations.

Without a GPU the kernels run in triton's interpreter; the reference is always the torch
path on the CPU (``core.layers.fused`` answers None for CPU tensors)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

from transformers import LlamaConfig  # noqa: E402

from core.layers import ACTIVATIONS, FUSED_ACT, RMSNorm, RotaryEmbedding, fused  # noqa: E402
from core_kernels import fused_ops, interpreting  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (float32: reduction order only). Triton's
    interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest: two steps there."""
    if ref.dtype == torch.float32:
        tol = dict(atol=1e-5, rtol=1e-5)
    else:
        tol = dict(atol=2e-2, rtol=1.6e-2) if interpreting() else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got.cpu(), ref, **tol)


def test_fused_is_never_used_for_cpu_tensors():
    assert fused(torch.zeros(2)) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_the_torch_layer(dtype, offset):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5, offset=offset)
    norm.weight.data = torch.randn(96, generator=g) * 0.5 + 1
    norm = norm.to(dtype)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    ref = norm(x)
    got = fused_ops.rms_norm(x.to(DEV), norm.weight.to(DEV), norm.eps, offset)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, ref)


def test_rms_norm_of_head_views_qk_norm():
    """Qwen 3 normalises q and k per head: a strided [T, H, D] view of the QKV output."""
    qkv = torch.randn(5, 3 * 4 * 32, dtype=torch.bfloat16)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    norm = RMSNorm(32, eps=1e-6).to(torch.bfloat16)
    close(fused_ops.rms_norm(q.to(DEV), norm.weight.to(DEV), 1e-6), norm(q))


def test_rms_norm_of_no_rows():
    assert fused_ops.rms_norm(torch.zeros(0, 8, device=DEV), torch.ones(8, device=DEV), 1e-6).shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", list(FUSED_ACT))
def test_gated_act_matches_torch(dtype, act):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(6, 2 * 1100, generator=g) * 2).to(dtype)  # 1100: two column blocks, the second masked
    gate, up = gate_up.chunk(2, dim=-1)  # row-strided views, as Phi-3's fused gate_up gives
    ref = ACTIVATIONS[act](gate) * up
    d = gate_up.to(DEV)
    got = fused_ops.gated_act(*d.chunk(2, dim=-1), FUSED_ACT[act])
    close(got, ref)


def test_gated_act_refuses_bad_input():
    with pytest.raises(ValueError, match="gated_act"):
        fused_ops.gated_act(torch.zeros(2, 4, device=DEV), torch.zeros(2, 4, device=DEV), "relu")
    with pytest.raises(ValueError, match="gated_act"):
        fused_ops.gated_act(torch.zeros(2, 4, device=DEV), torch.zeros(2, 5, device=DEV))


ROPES = {
    "default": ({}, 1.0),
    "partial": ({}, 0.5),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, 1.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_matches_the_torch_layer(dtype, rope):
    scaling, partial = ROPES[rope]
    h, hkv, d, t = 4, 2, 64, 9
    cfg = LlamaConfig(hidden_size=h * d, num_attention_heads=h, num_key_value_heads=hkv, head_dim=d,
                      max_position_embeddings=256, rope_theta=10000.0, partial_rotary_factor=partial,
                      rope_scaling=scaling or None)
    with torch.device("cpu"):
        rot = RotaryEmbedding(cfg, d, 256)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)  # strided views
    pos = torch.tensor([0, 1, 2, 17, 100, 255, 3, 3, 64])
    ref_q, ref_k = rot(pos, q, k)
    got_q, got_k = fused_ops.rotary(pos.to(DEV), q.to(DEV), k.to(DEV), rot.cos.to(DEV), rot.sin.to(DEV), rot.rotary_dim)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    close(got_q, ref_q)
    close(got_k, ref_k)


def test_rotary_refuses_mismatched_shapes():
    q, k = torch.zeros(2, 4, 16, device=DEV), torch.zeros(3, 2, 16, device=DEV)
    with pytest.raises(ValueError, match="rotary"):
        fused_ops.rotary(torch.zeros(2, dtype=torch.int64, device=DEV), q, k, torch.zeros(8, 16, device=DEV),
                         torch.zeros(8, 16, device=DEV), 16)
