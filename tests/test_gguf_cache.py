"""The GGUF conversion cache (issue 41) holds the serving dtype: a float32 copy of the default 98 MB
model was 517 MB; bf16 halves it, and a float32 serve keeps its own exact copy. Served from the file's
packed blocks, the cache holds no dequantized copy of the linear weights fed from the file (57 MB
instead of 260 MB in bf16); a dequantized serve (``--quantization none``) gets the whole model in its
own folder, made from the packed one without running transformers again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest
import torch
import transformers
from safetensors import safe_open

from core.engine.model_loader import gguf_cache, loader
from core.interfaces import ModelContext
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
    old = gguf_cache.gguf_cache_folder(src, torch.bfloat16)
    gguf_cache.convert_gguf(src, torch.float32).rename(old)
    assert json.loads((old / "config.json").read_text())["dtype"] == "float32"
    assert load_path(src, "bfloat16") == old and weight_dtypes(old) == {torch.bfloat16}
    assert [p.name for p in old.parent.iterdir()] == [old.name], "nothing left behind"


def test_a_dense_folder_from_before_is_read_not_converted_again(gguf: dict, monkeypatch) -> None:
    """A whole dequantized folder (the layout before packed folders, or a ``--quantization none``
    serve's) in the serving dtype gives the packed folder without transformers; one in another dtype
    (an unsuffixed float32 folder from before dtype keys) is not read."""
    src = gguf["src"]
    dense = gguf_cache.gguf_cache_folder(src, torch.bfloat16, dense=True)
    gguf_cache.convert_gguf(src, torch.float32).rename(dense)  # float32 where bf16 belongs: stale
    assert weight_dtypes(load_path(src, "bfloat16")) == {torch.bfloat16} and gguf["calls"]["model"] == 2
    shutil.rmtree(dense)
    gguf_cache.gguf_cache_folder(src, torch.bfloat16).rename(dense)  # a bf16 whole folder, no packed one
    (dense / gguf_cache.GGUF_TABLE).unlink()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _fail)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _fail)
    packed = load_path(src, "bfloat16")
    assert packed == gguf_cache.gguf_cache_folder(src, torch.bfloat16) and (packed / "tokenizer.json").is_file()
    assert weight_dtypes(packed) == {torch.bfloat16} and (packed / gguf_cache.GGUF_TABLE).is_file()
    # this stand-in file is no GGUF gguf can read: its table lists nothing, so the packed folder is whole
    assert "error" in json.loads((packed / gguf_cache.GGUF_TABLE).read_text())
    assert gguf_cache.gguf_dense_folder(src, packed) == packed



def test_a_big_dense_folder_is_written_in_shards(tmp_path, monkeypatch) -> None:
    """A whole dequantized model is written in files of at most SHARD_BYTES with transformers' index
    (an 8B model is 16 GB in bf16: never one file held in memory)."""
    monkeypatch.setattr(gguf_cache, "SHARD_BYTES", 1000)
    tensors = {f"t{i}": torch.full((100,), float(i), dtype=torch.bfloat16) for i in range(7)}  # 200 bytes each
    gguf_cache._save_sharded(iter(tensors.items()), tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(set(index["weight_map"].values())) == files and set(index["weight_map"]) == set(tensors)
    got = dict(loader.iter_weights(tmp_path))
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert not list(tmp_path.glob("*.tmp"))

def _fail(*a, **k):
    raise AssertionError("GGUF converted again through transformers")


def _no_gguf(load):
    """``load`` (a ``from_pretrained``) refusing to read a GGUF file (transformers' conversion)."""
    return lambda *a, **k: _fail() if k.get("gguf_file") else load(*a, **k)


def load_path(src: Path, dtype: str) -> Path:
    mc = loader.load_model_config(str(src), dtype, CPU, None)
    assert mc.dtype == getattr(torch, dtype) and mc.gguf_file == src
    return mc.path


# --------------------------------------------------------------------------- the default model (slow)

DENSE_BF16_BYTES = 269_060_552  # model.safetensors of the whole default model in bf16 (272 tensors)
# greedy tokens for "The capital of France is" before packed folders (bf16, CPU): packed and dense serve
PACKED_TOKENS = [7042, 30, 198, 198, 504, 1797, 1918, 553]
DENSE_TOKENS = [7042, 30, 198, 198, 504, 2988, 314, 42]


def _listing(root: Path) -> dict[str, dict[str, int]]:
    return {d.name: {f.name: f.stat().st_size for f in d.iterdir()} for d in sorted((root / "gguf").iterdir())}


def _keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(f, framework="pt") as sf:
            keys |= set(sf.keys())
    return keys


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The default GGUF served in bf16 on a CPU from a fresh cache: first from its packed blocks, then
    with ``--quantization none`` (with transformers' GGUF reader made to fail: the dense folder is made
    from the packed one)."""
    import core

    root = tmp_path_factory.mktemp("gguf-cache")
    opts = dict(dtype="bfloat16", max_total_tokens=1024, cpu_threads=1, device="cpu")
    prompt, sp = "The capital of France is", {"max_new_tokens": len(PACKED_TOKENS), "temperature": 0}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORE_CACHE_DIR", str(root))
        packed = core.Engine(**opts)
        try:
            out = {"packed": packed.generate(prompt, sp)["output_ids"], "after_packed": _listing(root),
                   "mc": packed.engine.model_config}
            mc, plugins = out["mc"], packed.engine.plugins
            out["quant"] = quant = loader.build_quant_method(plugins, None, None, mc, CPU)
            # a model as loading finds it (loaded, its qweights are repacked into other tensors)
            out["model"] = plugins.resolve("model", mc.architecture)(mc.hf_config, ModelContext(mc.dtype, CPU, quant))
            out["fed"] = dict(loader.checkpoint_weights(mc, out["model"], quant))
        finally:
            packed.shutdown()
        with pytest.MonkeyPatch.context() as no_gguf:
            for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
                no_gguf.setattr(cls, "from_pretrained", _no_gguf(cls.from_pretrained))
            dense = core.Engine(quantization="none", **opts)
        try:
            out["dense"] = dense.generate(prompt, sp)["output_ids"]
            out["dense_mc"] = dense.engine.model_config
        finally:
            dense.shutdown()
        out["after_dense"] = _listing(root)
        yield {**out, "root": root}


@pytest.mark.slow
def test_packed_serve_writes_no_dequantized_linear_weight(served):
    mc = served["mc"]
    packed = gguf_cache.gguf_cache_folder(mc.gguf_file, torch.bfloat16)
    assert mc.path == packed and packed.name.endswith("-packed")
    assert list(served["after_packed"]) == [packed.name], "a packed serve writes no dense folder"
    files = served["after_packed"][packed.name]
    assert {"config.json", "tokenizer.json", gguf_cache.GGUF_TABLE} <= set(files)
    weights = sum(n for f, n in files.items() if f.endswith(".safetensors"))
    assert weights < 0.25 * DENSE_BF16_BYTES, f"{weights} bytes of weights"  # 56.7 MB: embedding and norms
    keys = _keys(packed)
    table = loader.gguf_tensor_table(mc.gguf_file, mc.path)["tensors"]
    assert len(table) == 30 * 7 and not keys & set(table)
    assert not [k for k in keys if k.endswith("_proj.weight")] and "model.embed_tokens.weight" in keys
    assert len(keys) == 272 - 210


@pytest.mark.slow
def test_packed_serve_is_unchanged(served, tmp_path):
    """The model gets the same tensors as from the layout before (a whole dequantized folder next to
    its table), so its greedy tokens are those served before."""
    assert served["packed"] == PACKED_TOKENS
    mc = served["mc"]
    old = tmp_path / "old-layout"
    shutil.copytree(gguf_cache.gguf_dense_folder(mc.gguf_file, mc.path), old)
    want = dict(loader.checkpoint_weights(attrs.evolve(mc, path=old), served["model"], served["quant"]))
    got = served["fed"]
    assert set(got) == set(want) and any(k.endswith(".qweight") for k in got)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.slow
def test_dense_serve_gets_the_whole_dequantized_model(served):
    """``--quantization none`` reads the whole model, in its own folder, made from the packed one and
    the file without transformers (made to fail), bit-equal to transformers' conversion."""
    from transformers import AutoModelForCausalLM

    assert served["dense"] == DENSE_TOKENS
    mc = served["dense_mc"]
    packed = gguf_cache.gguf_cache_folder(mc.gguf_file, torch.bfloat16)
    dense = gguf_cache.gguf_cache_folder(mc.gguf_file, torch.bfloat16, dense=True)
    assert mc.path == packed and sorted(served["after_dense"]) == sorted([packed.name, dense.name])
    assert served["after_dense"][packed.name] == served["after_packed"][packed.name], "the packed folder is kept"
    files = served["after_dense"][dense.name]
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(files)
    assert files["model.safetensors"] == pytest.approx(DENSE_BF16_BYTES, rel=0.01)
    hf = AutoModelForCausalLM.from_pretrained(mc.gguf_file.parent, gguf_file=mc.gguf_file.name, dtype=torch.bfloat16)
    ref = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    got = dict(loader.iter_weights(dense))
    assert set(got) == set(ref) and len(got) == 272
    for k, v in ref.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k


@pytest.mark.slow
def test_second_start_reads_both_folders_as_they_are(served, monkeypatch):
    """Nothing is converted or dequantized again once both folders exist."""
    import gguf

    monkeypatch.setenv("CORE_CACHE_DIR", str(served["root"]))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _fail)
    monkeypatch.setattr(gguf.quants, "dequantize", _fail)
    mc = loader.load_model_config(None, "bfloat16", CPU, None)
    assert mc.path == served["mc"].path
    dense = gguf_cache.gguf_cache_folder(mc.gguf_file, torch.bfloat16, dense=True)
    assert gguf_cache.gguf_dense_folder(mc.gguf_file, mc.path) == dense
    assert _listing(served["root"]) == served["after_dense"]
