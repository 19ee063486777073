"""GPU paths: fp8 weights (``kernels/wo_gemm`` for few rows, ``torch._scaled_mm`` for many) and the CUDA int4 kernel. Skipped, with the reason,
where no CUDA GPU with fp8 support (compute capability >= 8.9) is present; the CPU refusal is
tested in test_quant_models.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from core_plugins.quant.fp8 import FP8_MAX, fp8_unsupported

CUDA = torch.device("cuda")
no_fp8 = fp8_unsupported(CUDA) if torch.cuda.is_available() else "no CUDA GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(no_fp8 is not None, reason=f"fp8 GEMMs cannot run here: {no_fp8}")]


def test_fp8_and_cuda_int4_pass_the_conformance_kit():
    from core.testing import check_plugin

    for name in ("fp8", "int4wo-32", "int8wo"):
        results = check_plugin(name, "quant_method", device="cuda", dtypes=(torch.bfloat16,))
        assert all(r.status == "passed" for r in results), [(r.case, r.message) for r in results]


def test_fp8_model_tracks_the_dense_model(tmp_path):
    from tests.conftest import make_engine
    from tests.test_quant_models import check_close, rule_sequences, teacher_forced_logits, train_tiny_llama

    train_tiny_llama(tmp_path / "tiny")
    opts = dict(device="cuda", dtype="bfloat16", skip_tokenizer_init=True)
    dense, fp8 = make_engine(tmp_path / "tiny", **opts), make_engine(tmp_path / "tiny", quantization="fp8", **opts)
    try:
        assert fp8.engine.model.model.layers[0].mlp.down_proj.quant_format == "fp8"
        forced = lambda e: torch.cat([teacher_forced_logits(e, ids).cpu() for ids in rule_sequences()])  # noqa: E731
        check_close(forced(dense), forced(fp8), 0.01)
    finally:
        dense.shutdown()
        fp8.shutdown()


def test_prequantized_fp8_checkpoint_loads_its_blocks(tmp_path):
    """transformers' fine-grained fp8 layout: fp8 weights, fp32 ``weight_scale_inv`` per block (32x32 here:
    the tiny model's k/v shards are 32 rows; real checkpoints use 128x128)."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import make_engine
    from tests.test_quant_models import LINEAR, check_close, rule_sequences, teacher_forced_logits, train_tiny_llama

    train_tiny_llama(tmp_path / "tiny")
    shutil.copytree(tmp_path / "tiny", tmp_path / "fp8")
    state = load_file(tmp_path / "fp8" / "model.safetensors")
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEAR]:
        w = state[name].float()
        n, k = w.shape
        blocks = w.reshape(n // 32, 32, k // 32, 32)
        scale = blocks.abs().amax((1, 3)).clamp_min(1e-12) / FP8_MAX
        state[name] = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
        state[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(state, tmp_path / "fp8" / "model.safetensors")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    opts = dict(device="cuda", dtype="bfloat16", skip_tokenizer_init=True)
    dense, fp8 = make_engine(tmp_path / "tiny", **opts), make_engine(tmp_path / "fp8", **opts)
    try:
        forced = lambda e: torch.cat([teacher_forced_logits(e, ids).cpu() for ids in rule_sequences()])  # noqa: E731
        check_close(forced(dense), forced(fp8), 0.01)
    finally:
        dense.shutdown()
        fp8.shutdown()
