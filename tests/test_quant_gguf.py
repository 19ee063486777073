"""The embedded SmolLM2 GGUF (Q4_1 layers, Q8_0 embedding / tied head) served from its quantized
blocks: the default on a CPU with bf16 activations, and with float32 ones where the AVX2 kernels run
(``--dtype auto`` on a CPU without native bf16); `--quantization none` for the dequantized path.

The repacked weights equal transformers' dequantization of the file within
bf16 rounding, and the model's next-token choices under teacher forcing agree with the dequantized
model's on >= 90 % of a text's positions with a small mean KL divergence.
"""

from __future__ import annotations

import pytest
import torch

from core.engine.model_loader import loader
from core_kernels import cpu_gemv
from tests.test_quant_kernels import BF16_REL, rel_err
from tests.test_quant_models import MIN_AGREEMENT, agreement_and_kl, teacher_forced_logits


@pytest.fixture(autouse=True)
def _packed_kernels_only(monkeypatch):
    """These tests check the packed kernels: no dense copy for GEMMs of many rows (see packed.DENSE_MIN_ROWS)."""
    from core_plugins.quant import packed

    monkeypatch.setattr(packed, "DENSE_MIN_ROWS", None)


pytestmark = pytest.mark.slow

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital "
        "of Germany. Water boils at one hundred degrees Celsius at sea level, and it freezes at zero degrees. "
        "In the morning the baker opens the shop, and by noon most of the bread has been sold to the neighbours.")


@pytest.fixture(scope="module")
def engines():
    import core

    opts = dict(dtype="bfloat16", max_total_tokens=1024, cpu_threads=1, device="cpu")
    kept, dense = core.Engine(**opts), core.Engine(quantization="none", **opts)
    yield kept, dense
    kept.shutdown()
    dense.shutdown()


def test_default_gguf_is_kept_quantized_on_cpu(engines):
    kept, dense = engines
    assert type(kept.engine.model.model.layers[0].mlp.down_proj.quant_method).__name__ == "GGUFQuant"
    formats = {m.quant_format for m in kept.engine.model.modules() if hasattr(m, "quant_format")}
    assert formats == {"int4"}, "every Q4_1 linear weight is served as group-32 int4"
    assert not any(hasattr(m, "quant_format") for m in dense.engine.model.modules())
    mc = kept.engine.model_config
    table = loader.gguf_tensor_table(mc.gguf_file, mc.path)
    assert len(table["tensors"]) == 30 * 7 and table["head_type"] == 8  # every linear weight; head Q8_0
    permuted = {name.rsplit(".", 2)[-2] for name, (_, heads) in table["tensors"].items() if heads}
    assert permuted == {"q_proj", "k_proj"}, "llama.cpp interleaves q/k rows; transformers undoes it"


def test_repacked_weights_equal_transformers_dequantized_weights(engines):
    """Against gguf's dequantization of the file in transformers' row order, rounded to bf16: what
    transformers' conversion holds (``gguf_tensor_table`` listed these tensors because they are equal;
    the cache keeps no dequantized copy of them)."""
    import gguf

    from core.engine.model_loader.gguf_cache import gguf_dequantized

    kept, _ = engines
    mc = kept.engine.model_config
    layer0 = kept.engine.model.model.layers[0]
    table = loader.gguf_tensor_table(mc.gguf_file, mc.path)["tensors"]
    by_name = {t.name: t for t in gguf.GGUFReader(mc.gguf_file).tensors}

    def hf(n: str) -> torch.Tensor:
        gname, heads = table[f"model.layers.0.{n}.weight"]
        return gguf_dequantized(by_name[gname], heads).bfloat16().float()

    cases = {"self_attn.qkv_proj": torch.cat([hf(f"self_attn.{p}_proj") for p in "qkv"]),
             "mlp.down_proj": hf("mlp.down_proj")}
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(0)).bfloat16()
    for name, want in cases.items():
        layer = layer0.get_submodule(name)
        got = layer.quant_method.dequantize(layer)
        step = want.abs().amax(1, keepdim=True)  # bf16 rounding of the scale/zero pair, relative to the row
        assert ((got - want).abs() <= step * BF16_REL).all(), name
        xi = x[:, : want.shape[1]]
        assert rel_err(layer(xi), xi.float() @ want.T) < 3 * BF16_REL, name


HEAD_FORMAT = "int8_blocks" if cpu_gemv.available_for(torch.bfloat16) else "int8"


def test_the_q8_0_head_keeps_the_files_codes_and_gives_float32_logits(engines):
    """Issue 41: the file's Q8_0 head (one fp16 scale per 32 values) is served with its own codes
    and scales, not re-quantized per row, and its logits come out in float32 (no bf16 top ties)."""
    import gguf

    from core.engine.model_loader.gguf_cache import raw_rows

    kept, _ = engines
    if HEAD_FORMAT != "int8_blocks":
        pytest.skip("this CPU runs no kernels/cpu_gemv bf16 kernels: the head is per-channel int8 here")
    head = kept.engine.model.model.embed_tokens.head()
    table = loader.gguf_tensor_table(kept.engine.model_config.gguf_file, kept.engine.model_config.path)
    _, offset, ggml_type, vocab, nbytes = table["head"]
    assert ggml_type == gguf.GGMLQuantizationType.Q8_0
    blocks = raw_rows(kept.engine.model_config.gguf_file, [offset, ggml_type, vocab, nbytes]).reshape(vocab, -1, 34)
    scales = blocks[..., :2].contiguous().view(torch.float16).float().squeeze(-1)
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(vocab, -1)
    assert torch.equal(cpu_gemv.unpack_int8(head.qweight_int8_cpu)[:vocab], codes)
    assert torch.equal(cpu_gemv.unpack_block_scales(head.qscale_blocks)[:vocab], scales)
    x = torch.randn(3, codes.shape[1]).bfloat16()
    assert kept.engine.model.model.embed_tokens.logits(x).dtype == torch.float32


def test_kept_model_tracks_the_dequantized_model(engines):
    kept, dense = engines
    ids = kept.engine.tokenizer.encode(TEXT)
    assert len(ids) >= 60
    ref, got = teacher_forced_logits(dense, ids), teacher_forced_logits(kept, ids)
    head = kept.engine.model.model.embed_tokens
    assert head.packed_head is not None and head.packed_head.quant_format == HEAD_FORMAT, "the Q8_0 head is packed"
    agree, kl = agreement_and_kl(ref, got)
    assert agree >= MIN_AGREEMENT and kl < 0.05, f"agreement {agree:.3f}, mean KL {kl:.4f}"


def test_float32_gguf_is_kept_quantized_where_the_kernel_runs(monkeypatch):
    """The float32 default of a CPU without native bf16 (``--dtype auto`` choosing float32, here
    made to): the file's blocks on the float32 kernels, tracking the dequantized float32 model as
    the bf16 one does. An explicit ``--dtype float32`` serves the dequantized model, the exact
    reference (transformers' greedy tokens), unless ``--quantization gguf`` asks for the blocks."""
    import core
    from core.engine import device as device_mod
    from core_kernels import cpu_gemv

    if not cpu_gemv.available_f32():
        pytest.skip("this CPU has no AVX2 (or no C++ compiler): a float32 GGUF model is served dequantized")
    monkeypatch.setattr(device_mod, "cpu_native_bf16", lambda flags=None: (False, "test: an AVX2-only CPU"))
    opts = dict(max_total_tokens=1024, cpu_threads=1, device="cpu")
    kept, dense = core.Engine(dtype="auto", **opts), core.Engine(dtype="float32", **opts)
    asked = core.Engine(dtype="float32", quantization="gguf", **opts)
    try:
        assert kept.engine.model_config.dtype == torch.float32
        assert not any(hasattr(m, "quant_format") for m in dense.engine.model.modules())
        assert asked.engine.model.model.layers[0].mlp.down_proj.quant_format == "int4"
        down = kept.engine.model.model.layers[0].mlp.down_proj
        assert down.quant_format == "int4" and down.qscale_zero_cpu.dtype == torch.float16
        ids = kept.engine.tokenizer.encode(TEXT)
        agree, kl = agreement_and_kl(teacher_forced_logits(dense, ids), teacher_forced_logits(kept, ids))
        assert agree >= MIN_AGREEMENT and kl < 0.05, f"agreement {agree:.3f}, mean KL {kl:.4f}"
        assert kept.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})["text"]
    finally:
        for e in (kept, dense, asked):
            e.shutdown()
