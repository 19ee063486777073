"""The shared layers' GPU fusions (core/layers.py, applied by the loader after the weights are
in): gate and up as one GEMM over one merged weight, and the residual added inside the output
projection's GEMM. On a GPU they are on by default; here they are switched on for the CPU, where
the same torch calls run, and checked against the unfused layers and against transformers."""

from __future__ import annotations

import pytest
import torch

import core.layers
from core.layers import GatedMLP, RowParallelLinear
from core_plugins.quant.unquantized import Unquantized
from tests.conftest import make_engine
from tests.test_model_llama import check_logprobs, prompt

CPU = ("cpu",)


def fuse(module: torch.nn.Module, device_types: tuple[str, ...] = CPU) -> None:
    """What the loader does after loading, with the fusions allowed on ``device_types``."""
    for m in module.modules():
        if hasattr(m, "fuse_after_loading"):
            m.fuse_after_loading(device_types)


def mlp(bias: bool = False) -> GatedMLP:
    torch.manual_seed(0)
    m = GatedMLP(16, 24, "silu", Unquantized(), torch.float32, bias=bias)
    for p in m.parameters():
        p.data.normal_(0, 0.3)
    return m


@pytest.mark.parametrize("bias", [False, True])
def test_merged_gate_up_and_residual_equal_the_separate_layers(bias):
    m = mlp(bias)
    x, r = torch.randn(5, 16), torch.randn(5, 16)
    want = r + m(x)
    fuse(m)
    w = m.__dict__["gate_up"]
    assert w.shape == (48, 16) and m.gate_proj.weight.data_ptr() == w.data_ptr()  # views: no second copy
    assert m.up_proj.weight.data_ptr() == w[24:].data_ptr()
    assert m.down_proj.__dict__["add_in_gemm"] is not bias  # a biased projection keeps the separate add
    torch.testing.assert_close(m(x, residual=r.clone()), want, atol=1e-5, rtol=1e-5)


def test_a_weight_reload_writes_through_to_the_merged_weight():
    m = mlp()
    fuse(m)
    new_up = torch.randn(24, 16)
    m.up_proj.weight.weight_loader(m.up_proj.weight, new_up)
    torch.testing.assert_close(m.__dict__["gate_up"][24:], new_up)
    x = torch.randn(3, 16)
    ref = m.down_proj(core.layers.gated_act("silu", m.gate_proj(x), x @ new_up.T))
    torch.testing.assert_close(m(x), ref, atol=1e-5, rtol=1e-5)


def test_residual_add_in_the_gemm_adds_in_place():
    o = RowParallelLinear(24, 16, False, Unquantized(), torch.float32)
    o.weight.data.normal_()
    o.fuse_after_loading(CPU)
    x, r = torch.randn(4, 24), torch.randn(4, 16)
    want = r + x @ o.weight.T
    out = o(x, residual=r)
    assert out.data_ptr() == r.data_ptr()  # the residual is handed over
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_no_fusion_off_the_gpu_or_for_other_weights():
    m = mlp()
    for sub in (m, m.down_proj):
        sub.fuse_after_loading()  # the default: CUDA only
    assert "gate_up" not in m.__dict__ and not m.down_proj.__dict__["add_in_gemm"]

    class NotDense(Unquantized):
        dense = False

    o = RowParallelLinear(24, 16, False, NotDense(), torch.float32)
    o.weight.data.normal_()  # created empty: garbage (NaN even) otherwise
    o.fuse_after_loading(CPU)
    assert not o.__dict__["add_in_gemm"]
    x, r = torch.randn(2, 24), torch.randn(2, 16)
    torch.testing.assert_close(o(x, residual=r), r + o(x))


@pytest.fixture
def fused_on_cpu(monkeypatch):
    for cls in (GatedMLP, RowParallelLinear):
        monkeypatch.setattr(cls.fuse_after_loading, "__defaults__", (("cpu", "cuda"),))


def test_engine_with_the_fusions_matches_transformers(tiny_llama, fused_on_cpu):
    """torch_native runs the Python layers (the C++ decode stack plans only the cpu backend)."""
    path, hf = tiny_llama("gqa")
    eng = make_engine(path, skip_tokenizer_init=True, attention_backend="torch_native")
    try:
        layer = eng.engine.model.model.layers[0]
        assert "gate_up" in layer.mlp.__dict__ and layer.self_attn.o_proj.__dict__["add_in_gemm"]
        prompts = [prompt(1, 1), prompt(9, 2), prompt(23, 3)]
        outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 5},
                            return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
        for p, out in zip(prompts, outs):
            check_logprobs(out, p, hf, 3)
    finally:
        eng.shutdown()
