"""The GGUF conversion cache holds the serving dtype (issue 41): a float32 copy of the default 98 MB
model was 517 MB; bf16 halves it, and a float32 serve keeps its own exact copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from core.engine import loader
from tests.conftest import TINY_BASE, char_tokenizer

CPU = torch.device("cpu")


@pytest.fixture
def gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """A fake GGUF file read by stand-ins for transformers' GGUF reader (a float32 tiny Llama, as
    transformers' dequantization gives); ``calls`` counts conversions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    calls = {"model": 0}

    def model(*args, **kwargs):
        calls["model"] += 1
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**TINY_BASE)).eval()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: char_tokenizer())
    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.Q4.gguf"
    src.write_bytes(b"GGUF-cache")
    return {"src": src, "calls": calls}


def weight_dtypes(folder: Path) -> set[torch.dtype]:
    with safe_open(folder / "model.safetensors", framework="pt") as sf:
        return {sf.get_tensor(k).dtype for k in sf.keys()}


def test_cached_in_the_serving_dtype(gguf: dict) -> None:
    src = gguf["src"]
    bf16 = load_path(src, "bfloat16")
    assert weight_dtypes(bf16) == {torch.bfloat16}
    f32 = load_path(src, "float32")
    assert f32 != bf16 and weight_dtypes(f32) == {torch.float32}, "a float32 serve never reads the bf16 copy"
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(bf16) < 0.6 * size(f32)
    assert load_path(src, "bfloat16") == bf16 and load_path(src, "float32") == f32
    assert gguf["calls"]["model"] == 2, "each dtype is converted once"


def test_a_float32_cache_from_before_is_converted_again(gguf: dict) -> None:
    """Unsuffixed folders used to hold float32: one found where the bf16 copy belongs is replaced."""
    src = gguf["src"]
    old = loader.gguf_cache_folder(src, torch.bfloat16)
    loader.convert_gguf(src, torch.float32).rename(old)
    assert json.loads((old / "config.json").read_text())["dtype"] == "float32"
    assert load_path(src, "bfloat16") == old and weight_dtypes(old) == {torch.bfloat16}
    assert [p.name for p in old.parent.iterdir()] == [old.name], "nothing left behind"


def load_path(src: Path, dtype: str) -> Path:
    mc = loader.load_model_config(str(src), dtype, CPU, None)
    assert mc.dtype == getattr(torch, dtype) and mc.gguf_file == src
    return mc.path
