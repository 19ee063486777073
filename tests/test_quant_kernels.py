"""Packed weight formats against dequantize-then-matmul: int8 / int4 packing, GGUF block repacking
(Q4_0, Q4_1, Q4_K exact into int4; Q8_0, Q6_K into int8), AWQ and GPTQ unpacking from synthetic
checkpoints built the way their quantizers pack, and the conformance kit for the methods that
quantize float weights at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.engine.device import cpu_flags
from core.layers import Linear
from core_plugins.quant import gguf as gguf_quant
from core_plugins.quant import packed
from core_plugins.quant.awq import AWQ
from core_plugins.quant.gptq import GPTQ

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402


@pytest.fixture(autouse=True)
def _packed_kernels_only(monkeypatch):
    """These tests check the packed kernels: no dense copy for GEMMs of many rows (see packed.DENSE_MIN_ROWS)."""
    from core_plugins.quant import packed

    monkeypatch.setattr(packed, "DENSE_MIN_ROWS", None)


BF16_REL = 2 ** -7  # one bf16 rounding of a scale/zero or an output, relative


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the output rows' scale (max |want| per row)."""
    return float(((got.float() - want.float()).abs().amax(-1) / want.float().abs().amax(-1).clamp_min(1e-6)).max())


class Holder(torch.nn.Module):
    """A bare layer to pack onto (what Linear is to a quant method)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = None
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)


# --------------------------------------------------------------------------- int8 / int4 formats


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_int8_gemm_matches_dequantized(dtype, tokens):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g)
    q, scale = packed.quantize_int8(w)
    assert q.dtype == torch.int8 and (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6
    layer = Holder()
    packed.set_int8(layer, q, scale, dtype)
    assert layer.quant_format == "int8"
    x = torch.randn(tokens, 160, generator=g).to(dtype)
    ref = x.float() @ (q.float() * scale.to(dtype).float()[:, None]).T
    assert rel_err(packed.packed_linear(layer, x), ref) < 2 * BF16_REL


def test_int8_width_the_kernel_mishandles_stays_dense():
    """torch 2.13's int8 kernel crashes or returns garbage when in_features % 16 != 0."""
    w = torch.randn(16, 40)
    q, scale = packed.quantize_int8(w)
    layer = Holder()
    packed.set_int8(layer, q, scale, torch.bfloat16)
    assert layer.quant_format == "dense"
    x = torch.randn(5, 40, dtype=torch.bfloat16)
    assert rel_err(packed.packed_linear(layer, x), x.float() @ (q.float() * scale[:, None]).T) < 2 * BF16_REL


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_int4_gemm_matches_dequantized(group, tokens):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(48, 256, generator=g)
    q, scale, zero = packed.quantize_int4(w, group)
    assert q.max() <= 15 and scale.shape == (48, 256 // group)
    deq = packed.dequantize_int4(q, scale, zero)
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-5, "min/max 4-bit rounding: at most half a step"
    layer = Holder()
    packed.set_int4(layer, q, scale, zero, torch.bfloat16)
    assert layer.quant_format == "int4" and layer.group_size == group
    x = torch.randn(tokens, 256, generator=g).to(torch.bfloat16)
    y = packed.packed_linear(layer, x)
    ref = x.float() @ packed.dequantize_int4(q, scale.bfloat16(), zero.bfloat16()).T
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) < 2 * BF16_REL
    torch.testing.assert_close(packed.dequantize(layer), packed.dequantize_int4(q, scale.bfloat16(), zero.bfloat16()),
                               atol=0.05, rtol=BF16_REL)


def test_int4_shapes_the_kernel_refuses_stay_dense():
    for n, k, group in [(24, 64, 32), (32, 96, 64)]:  # out % 16, in % group
        w = torch.randn(n, k)
        q, scale, zero = packed.quantize_int4(w, 32)
        layer = Holder()
        packed.set_int4(layer, q, scale, zero, torch.bfloat16)
        assert layer.quant_format == ("dense" if n % 16 else "int4")
    assert not packed.int4_supported(32, 96, 64) and not packed.int4_supported(24, 64, 32)
    assert packed.int4_supported(32, 96, 32)


def test_quant_methods_pass_the_conformance_kit():
    """Float-quantizing methods load float weights; gguf / awq / gptq load what their
    ``checkpoint_tensors`` writes (a Q4_1 tensor, AutoAWQ's and AutoGPTQ's packing)."""
    from core.testing import check_plugin

    for name in ("int8wo", "int4wo-32", "int4wo-128", "fp8", "gguf", "awq", "gptq"):
        results = check_plugin(name, "quant_method", device="cpu", dtypes=(torch.bfloat16,))
        assert all(r.ok for r in results), [r.message for r in results if not r.ok]
        passed = {r.case for r in results if r.status == "passed"}
        if name == "fp8":  # refused on CPU, by name and reason; the GEMM cases are skipped
            assert passed == {"device_support"}
            assert all("compute capability >= 8.9" in r.message for r in results if r.status == "skipped")
        else:
            assert passed == {"device_support", "load_round_trip", "gemm_vs_dequantized", "gemm_vs_float"}


# --------------------------------------------------------------------------- GGUF blocks


def gguf_rows(ggml: T, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw rows uint8 [n, bytes], gguf's dequantization float32 [n, k]). Types gguf can quantize
    are made from random weights; K-quants (no quantizer in gguf-py) from random blocks with sane
    fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    if ggml in (T.Q4_K, T.Q6_K):
        block, size = gguf.GGML_QUANT_SIZES[ggml]
        blocks = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
        d = (rng.random(len(blocks)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
        if ggml == T.Q4_K:
            blocks[:, 0:2] = d
            blocks[:, 2:4] = (rng.random(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        else:
            blocks[:, -2:] = d
        raw = blocks.reshape(n, -1)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), ggml)
    return torch.from_numpy(raw.copy()), torch.from_numpy(gguf.quants.dequantize(raw, ggml).copy())


def gguf_linear(shards: list[tuple[T, torch.Tensor]], k: int, dtype=torch.bfloat16) -> Linear:
    """A Linear under the gguf method with ``shards`` (type, raw rows) loaded the way the engine does."""
    sizes = [raw.shape[0] for _, raw in shards]
    names = tuple("qkv"[: len(shards)]) if len(shards) > 1 else ()
    layer = Linear(k, sizes if len(shards) > 1 else sizes[0], False, gguf_quant.GGUFQuant(), dtype, names)
    for i, (ggml, raw) in enumerate(shards):
        shard = names[i] if names else None
        layer.qweight.weight_loader(layer.qweight, raw, shard)
        layer.qweight_type.weight_loader(layer.qweight_type, torch.tensor([int(ggml)], dtype=torch.int32), shard)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("ggml,fmt", [(T.Q4_0, "int4"), (T.Q4_1, "int4"), (T.Q4_K, "int4"), (T.Q8_0, "int8"),
                                      (T.Q6_K, "int8"), (T.F16, "dense")])
def test_gguf_tensor_repacked_times_x_equals_dequantized_times_x(ggml, fmt):
    n, k = 64, 512
    if ggml == T.F16:
        w = torch.randn(n, k).half()
        raw, deq = w.view(torch.uint8).reshape(n, -1), w.float()
    else:
        raw, deq = gguf_rows(ggml, n, k, seed=int(ggml))
    decoded = gguf_quant.decode(raw, int(ggml), k)
    assert decoded[0] == fmt
    if fmt == "int4":  # the repack itself is exact with float32 scale/zero (up to float32 rounding, for Q4_K)
        torch.testing.assert_close(packed.dequantize_int4(*decoded[1:]), deq, atol=1e-6, rtol=0)
    layer = gguf_linear([(ggml, raw)], k)
    assert layer.quant_format == fmt
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = layer(x)
    ref = x.float() @ deq.T
    # int4/dense: bf16 rounding of scale/zero and of the output; int8: plus the per-row requantization
    # of the exactly dequantized values (half an int8 step of each row's largest weight).
    bound = 3 * BF16_REL if fmt != "int8" else 3 * BF16_REL + float(
        (x.float().abs() @ (deq.abs().amax(1, keepdim=True) / 254).expand_as(deq).T).max() / ref.abs().amax(1).min())
    assert rel_err(y, ref) < bound, (rel_err(y, ref), bound)


def test_gguf_fused_layer_takes_the_widest_shard_format():
    k = 256
    q4_a, deq_a = gguf_rows(T.Q4_1, 32, k, 1)
    q4_b, deq_b = gguf_rows(T.Q4_0, 16, k, 2)
    layer = gguf_linear([(T.Q4_1, q4_a), (T.Q4_0, q4_b)], k)
    assert layer.quant_format == "int4"
    torch.testing.assert_close(layer.quant_method.dequantize(layer), torch.cat([deq_a, deq_b]), atol=0.02, rtol=BF16_REL)
    q8, deq_c = gguf_rows(T.Q8_0, 16, k, 3)
    layer = gguf_linear([(T.Q4_1, q4_a), (T.Q4_0, q4_b), (T.Q8_0, q8)], k)
    assert layer.quant_format == "int8", "an int8 shard makes the fused layer int8"
    want = torch.cat([deq_a, deq_b, deq_c])
    step = want.abs().amax(1, keepdim=True) / 127
    assert ((layer.quant_method.dequantize(layer) - want).abs() <= step / 2 + want.abs() * BF16_REL).all()


def test_gguf_rows_of_the_wrong_size_are_refused():
    raw, _ = gguf_rows(T.Q4_1, 32, 64, 0)
    layer = Linear(64, 48, False, gguf_quant.GGUFQuant(), torch.bfloat16)
    with pytest.raises(ValueError, match="do not match the layer's 48 output rows"):
        layer.qweight.weight_loader(layer.qweight, raw, None)


# --------------------------------------------------------------------------- AWQ / GPTQ


def quantize_zero_point(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ / AutoGPTQ-style asymmetric 4-bit with integer zeros: (q [N, K], z [N, K/G], s [N, K/G])."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo) / 15).clamp_min(1e-5).half().float()
    z = torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, 15)
    return q.reshape(n, k).int(), z.int(), s


def pack_awq(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing loop: int [R, C] -> int32 [R, C/8], nibble i = column order_map[i]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    out = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            out[:, col] |= intweight[:, col * 8 + order_map[i]].int() << (i * 4)
    return out


def pack_gptq_rows(intweight: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight packing: int [K, N] -> int32 [K/8, N], nibble i = row 8r + i."""
    out = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int32)
    for i in range(8):
        out |= intweight[i::8].int() << (4 * i)
    return out


def pack_gptq_cols(intweight: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qzeros packing: int [R, N] -> int32 [R, N/8], nibble i = column 8c + i."""
    return pack_gptq_rows(intweight.T.contiguous()).T.contiguous()


def load_linear(method, k: int, sizes: list[int], tensors: list[dict[str, torch.Tensor]], dtype=torch.bfloat16) -> Linear:
    names = ("q", "k", "v")[: len(sizes)] if len(sizes) > 1 else ()
    layer = Linear(k, sizes if len(sizes) > 1 else sizes[0], False, method, dtype, names)
    params = dict(layer.named_parameters())
    for i, shard in enumerate(tensors):
        for name, t in shard.items():
            params[name].weight_loader(params[name], t.to(params[name].dtype), names[i] if names else None)
    method.process_weights_after_loading(layer)
    return layer


def test_awq_checkpoint_unpacks_to_the_reference_weight():
    group, k, sizes = 32, 128, [64, 32, 32]
    g = torch.Generator().manual_seed(3)
    refs, shards = [], []
    for n in sizes:
        q, z, s = quantize_zero_point(torch.randn(n, k, generator=g), group)
        refs.append((q.float() - z.repeat_interleave(group, 1)) * s.repeat_interleave(group, 1))
        shards.append({"qweight": pack_awq(q.T), "qzeros": pack_awq(z.T), "scales": s.T.half()})
    method = AWQ.from_config({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    layer = load_linear(method, k, sizes, shards)
    assert layer.quant_format == "int4"
    ref = torch.cat(refs)
    torch.testing.assert_close(method.dequantize(layer), ref, atol=0.02, rtol=BF16_REL)
    x = torch.randn(5, k, generator=g).bfloat16()
    assert rel_err(layer(x), x.float() @ ref.T) < 3 * BF16_REL


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_checkpoint_unpacks_to_the_reference_weight(act_order, fmt):
    group, k, sizes = 32, 128, [32, 16]
    g = torch.Generator().manual_seed(4)
    # act-order: input row k belongs to group g_idx[k], a permutation of the contiguous assignment
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)] if act_order else torch.arange(k) // group
    refs, shards = [], []
    for n in sizes:
        w = torch.randn(n, k, generator=g)
        order = torch.argsort(g_idx, stable=True)  # quantize each group's rows together
        q_sorted, z, s = quantize_zero_point(w[:, order], group)
        q = torch.empty_like(q_sorted)
        q[:, order] = q_sorted
        refs.append((q.float() - z[:, g_idx]) * s[:, g_idx])
        stored_z = z - 1 if fmt == "gptq" else z
        shards.append({"qweight": pack_gptq_rows(q.T), "qzeros": pack_gptq_cols(stored_z.T & 0xF), "scales": s.T.half(),
                       "g_idx": g_idx.int()})
    method = GPTQ.from_config({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                               "checkpoint_format": fmt})
    layer = load_linear(method, k, sizes, shards)
    assert layer.quant_format == "int4" and (layer.input_perm is not None) == act_order
    ref = torch.cat(refs)
    torch.testing.assert_close(method.dequantize(layer), ref, atol=0.02, rtol=BF16_REL)
    x = torch.randn(3, k, generator=g).bfloat16()
    assert rel_err(layer(x), x.float() @ ref.T) < 3 * BF16_REL


def test_quantized_checkpoint_configs_we_cannot_serve_are_refused():
    from core.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="only 4-bit GPTQ"):
        GPTQ.from_config({"bits": 8, "group_size": 128})
    with pytest.raises(ModelLoadError, match="only 4-bit GEMM-layout AWQ"):
        AWQ.from_config({"bits": 4, "group_size": 128, "version": "gemv"})
    with pytest.raises(ModelLoadError, match="does not fit group size 128"):
        Linear(96, 64, False, AWQ(128), torch.bfloat16)
    k = 64
    g_a, g_b = torch.arange(k) // 32, torch.arange(k).flip(0) // 32
    method = GPTQ(32)
    layer = Linear(k, [16, 16], False, method, torch.bfloat16, ("q", "k"))
    layer.g_idx.weight_loader(layer.g_idx, g_a.int(), "q")
    with pytest.raises(ValueError, match="different g_idx"):
        layer.g_idx.weight_loader(layer.g_idx, g_b.int(), "k")


def test_fp8_checkpoint_blocks_fold_into_per_channel_scales():
    """Loading a block-scaled fp8 checkpoint: each row's scale becomes its largest block scale and the
    fp8 values are re-rounded to it."""
    from core_plugins.quant.fp8 import FP8, FP8_MAX, Fp8

    g = torch.Generator().manual_seed(5)
    method = Fp8.from_config({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]})
    shards, refs = [], []
    for n in (64, 32):
        w = torch.randn(n, 96, generator=g) * torch.rand(n // 32, 1, 3, 1, generator=g).expand(-1, 32, -1, 32).reshape(n, 96)
        blocks = w.reshape(n // 32, 32, 3, 32)
        scale = blocks.abs().amax((1, 3)) / FP8_MAX
        q = (blocks / scale[:, None, :, None]).reshape(n, 96).to(FP8)
        refs.append(q.float() * scale.repeat_interleave(32, 0).repeat_interleave(32, 1))
        shards.append({"weight": q, "weight_scale_inv": scale})
    layer = load_linear(method, 96, [64, 32], shards)
    assert layer.quant_format == "fp8" and layer.fp8_weight.dtype == FP8 and layer.fp8_scale.shape == (1, 96)
    want = torch.cat(refs)
    err = (method.dequantize(layer) - want).abs()
    assert (err <= want.abs().amax(1, keepdim=True) * 2 ** -4).all(), "within one fp8 rounding of the row's range"
    # torch's CPU _scaled_mm is a slow reference kernel (serving refuses it), enough to check apply's
    # per-token activation scaling against the dequantized weight
    x = torch.randn(5, 96, generator=g).bfloat16()
    assert rel_err(layer(x), x.float() @ method.dequantize(layer).T) < 2 ** -4


def test_cpu_dense_copy_serves_many_rows_and_packed_serves_few(monkeypatch):
    """On CPU a packed layer keeps a bf16 copy: GEMMs of DENSE_MIN_ROWS rows or more use it (faster
    there), fewer rows use the packed kernel; both compute the same product."""
    monkeypatch.setattr(packed, "DENSE_MIN_ROWS", 16)
    monkeypatch.setattr(packed, "GEMV_DENSE_MIN_ROWS", 16)  # this machine's own kernel, where it runs
    monkeypatch.setattr(packed, "_dense_beats_gemv", lambda dtype: True)  # (a CPU where oneDNN wins)
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    layer = torch.nn.Module()
    layer.bias = None
    q, scale, zero = packed.quantize_int4(w, 32)
    packed.set_int4(layer, q, scale, zero, torch.bfloat16)
    assert layer.dense_weight.dtype == torch.bfloat16 and layer.dense_weight.shape == (64, 128)
    ref_w = packed.dequantize_int4(q, scale, zero)
    calls = []  # rows given to a packed int4 kernel: torch's, or this machine's AVX512-BF16 one
    real, ours = torch._weight_int4pack_mm_for_cpu, packed.cpu_gemv.mm
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(packed.cpu_gemv, "mm", lambda *a: calls.append(a[0].shape[0]) or ours(*a))
    for rows in (1, 15, 16, 40):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        assert rel_err(packed.packed_linear(layer, x), x.float() @ ref_w.T) < 2 * BF16_REL
    assert calls == [1, 15]  # 16 and 40 rows went to the dense copy
    monkeypatch.setattr(packed, "DENSE_MIN_ROWS", None)
    bare = torch.nn.Module()
    bare.bias = None
    packed.set_int4(bare, q, scale, zero, torch.bfloat16)
    assert not hasattr(bare, "dense_weight")  # disabled: no copy is kept


# --------------------------------------------------------------------------- oneDNN-packed dense GEMMs

def _onednn_bf16() -> bool:
    from core_plugins.quant import onednn

    return onednn.bf16_supported()


needs_onednn = pytest.mark.skipif(not _onednn_bf16(), reason="oneDNN's bf16 path needs AVX512BW/VL/DQ or AVX-NE-CONVERT")


def test_bf16_layer_is_not_packed_where_onednn_has_no_bf16(monkeypatch):
    """On an AVX2-only CPU oneDNN's bf16 reorder raises: an explicit --dtype bfloat16 there keeps
    the plain weight (and still computes the layer) instead of failing at load."""
    from core_plugins.quant import onednn
    from core_plugins.quant.unquantized import Unquantized

    monkeypatch.setattr(onednn, "bf16_supported", lambda: False)
    method = Unquantized()
    layer = torch.nn.Module()
    method.create_weights(layer, 64, 32, True, torch.bfloat16)
    torch.manual_seed(0)
    layer.weight.data.normal_()
    method.process_weights_after_loading(layer)
    assert "onednn_weight" not in layer.__dict__
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(method.apply(layer, x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 3, 96)])
def test_onednn_packed_linear_equals_f_linear(shape):
    from core_plugins.quant import onednn

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    p = onednn.prepack(w)
    assert p.is_mkldnn and tuple(p.shape) == (48, 96)
    x = torch.randn(*shape, generator=g).bfloat16()
    for bias in (None, b):
        got = onednn.linear(x, p, bias)
        assert got.shape == (*shape[:-1], 48) and got.dtype == torch.bfloat16
        assert rel_err(got, torch.nn.functional.linear(x, w, bias)) < BF16_REL
    assert torch.equal(onednn.linear(x, w, b), torch.nn.functional.linear(x, w, b))  # a plain weight passes through


@needs_onednn
def test_unquantized_cpu_bf16_packs_layers_and_head(monkeypatch):
    from core_plugins.quant import onednn
    from core_plugins.quant.unquantized import Unquantized

    method = Unquantized()
    layer = torch.nn.Module()
    method.create_weights(layer, 64, 32, True, torch.bfloat16)
    torch.manual_seed(0)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    method.process_weights_after_loading(layer)
    assert layer.onednn_weight.is_mkldnn
    x = torch.randn(5, 64).bfloat16()
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert rel_err(method.apply(layer, x), want) < BF16_REL
    table = torch.nn.Module()
    table.weight = torch.nn.Parameter(torch.randn(40, 64).bfloat16(), requires_grad=False)
    head = method.pack_lm_head(table)
    assert rel_err(head(x), x.float() @ table.weight.float().T) < 2 * BF16_REL
    # float32, or packing switched off: the plain GEMM, no copy
    assert not onednn.wanted(torch.zeros(4, 4))
    monkeypatch.setenv("CORE_ONEDNN_PREPACK", "0")
    method.process_weights_after_loading(layer)
    assert "onednn_weight" not in layer.__dict__ and method.pack_lm_head(table) is None
    assert torch.equal(method.apply(layer, x), want)


@needs_onednn
def test_cpu_dense_copy_of_a_packed_layer_is_onednn_packed(monkeypatch):
    monkeypatch.setattr(packed, "DENSE_MIN_ROWS", 4)
    monkeypatch.setattr(packed, "_dense_beats_gemv", lambda dtype: True)
    torch.manual_seed(0)
    q, scale, zero = packed.quantize_int4(torch.randn(64, 128), 32)
    layer = torch.nn.Module()
    layer.bias = None
    packed.set_int4(layer, q, scale, zero, torch.bfloat16)
    assert layer.dense_weight.is_mkldnn
    x = torch.randn(6, 128, dtype=torch.bfloat16)
    assert rel_err(packed.packed_linear(layer, x), x.float() @ packed.dequantize_int4(q, scale, zero).T) < 2 * BF16_REL


def test_a_cpu_where_the_gemv_kernel_wins_keeps_no_dense_copy(monkeypatch):
    """Where oneDNN's dense GEMM does not beat this machine's int4 / int8 kernels at a prefill's size
    (timed once: ``_dense_beats_gemv``), packed layers keep no dense copy (their size in memory) and
    every row count runs the kernel; the probe's answer is a cached bool."""
    if "amx_bf16" in cpu_flags() or not packed.cpu_gemv.available():
        pytest.skip("needs the bf16 gemv kernels and no AMX (with AMX the copies always serve)")
    answer = packed._dense_beats_gemv(torch.bfloat16)
    assert isinstance(answer, bool) and packed._dense_beats_gemv(torch.bfloat16) is answer
    monkeypatch.setattr(packed, "_dense_beats_gemv", lambda dtype: False)
    q, scale, zero = packed.quantize_int4(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), 32)
    layer = torch.nn.Module()
    layer.bias = None
    packed.set_int4(layer, q, scale, zero, torch.bfloat16)
    i8 = torch.nn.Module()
    i8.bias = None
    packed.set_int8(i8, *packed.quantize_int8(torch.randn(64, 128)), torch.bfloat16)
    assert "dense_weight" not in layer.__dict__ and "dense_weight" not in i8.__dict__
    calls = []
    real = packed.cpu_gemv.mm
    monkeypatch.setattr(packed.cpu_gemv, "mm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 70, 300):
        packed.packed_linear(layer, torch.randn(rows, 128, dtype=torch.bfloat16))
    assert calls == [1, 70, 300]


def test_gptq_refuses_a_sorted_g_idx_with_unequal_groups():
    """A non-decreasing g_idx skipped the check that each group holds group_size rows, and was
    served as arange(K) // group_size: other scales and zeros than the checkpoint's."""
    from core.errors import ModelLoadError
    from core_plugins.quant.gptq import GPTQ

    group, k, n = 32, 64, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g)
    z = torch.randint(0, 15, (n, k // group), generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).half().float()
    shard = {"qweight": pack_gptq_rows(q.T), "qzeros": pack_gptq_cols((z - 1).T & 0xF), "scales": s.T.half(),
             "g_idx": torch.tensor([0] * 48 + [1] * 16).int()}  # group 0 holds 48 rows
    method = GPTQ.from_config({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True})
    with pytest.raises(ModelLoadError, match="g_idx does not assign 32 input rows"):
        load_linear(method, k, [n], [shard], dtype=torch.float32)
