"""Finding and reading checkpoints: path resolution, the GGUF conversion cache, safetensors
and .bin folders, config-derived settings and dtype selection."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from core.engine.model_loader import gguf_cache, loader
from core.errors import ModelLoadError
from core.engine.device import cpu_native_bf16
from core.engine.model_loader.loader import iter_weights, load_model_config, pick_dtype, resolve_model_path
from tests.conftest import TINY_BASE, assert_greedy_matches, assert_pool_free, char_tokenizer, greedy, hf_logprobs, make_engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AUTO_CPU_DTYPE = torch.bfloat16 if cpu_native_bf16()[0] else torch.float32  # what --dtype auto means on this CPU


# --------------------------------------------------------------------------- dtype


@pytest.mark.parametrize("name,expected", [
    ("float32", torch.float32), ("float", torch.float32), ("bfloat16", torch.bfloat16),
    ("float16", torch.float16), ("half", torch.float16),
])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_pick_dtype_explicit_names_win(name, expected, device):
    for cfg in (None, torch.float32, torch.bfloat16):
        assert pick_dtype(name, cfg, device) == expected


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),  # e.g. Zen 4/5, Cooper Lake
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16),  # Sapphire Rapids
    ({"avx2", "fma"}, torch.float32),  # AVX2-only EPYC: bf16 would be emulated
    ({"avx2", "avx512f"}, torch.float32),  # AVX-512 without the bf16 extension
])
@pytest.mark.parametrize("cfg", [None, torch.float32, torch.bfloat16])
def test_pick_dtype_auto_on_cpu_follows_native_bf16(monkeypatch, flags, expected, cfg):
    from core.engine import device

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    assert pick_dtype("auto", cfg, CPU) == expected
    native, why = device.cpu_native_bf16()
    assert native == (expected == torch.bfloat16) and why


def test_auto_dtype_on_this_machine_matches_its_flags():
    from core.engine.device import cpu_flags

    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    assert pick_dtype("auto", None, CPU) == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("cfg,expected", [
    (None, torch.float16), (torch.float32, torch.float16), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
])
def test_pick_dtype_auto_on_gpu_follows_the_checkpoint(cfg, expected):
    assert pick_dtype("auto", cfg, CUDA) == expected


def test_pick_dtype_unknown_name():
    with pytest.raises(ModelLoadError, match="fp8"):
        pick_dtype("fp8", None, CPU)


# --------------------------------------------------------------------------- paths


def test_missing_path_and_hub_id(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        resolve_model_path(tmp_path / "missing")
    assert "model-hub id" not in str(e.value)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache, and no download
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model_path("meta-llama/Llama-3.2-1B")


def test_folder_and_file_shapes(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json and 0 .gguf"):
        resolve_model_path(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"y")
    with pytest.raises(ModelLoadError, match="2 .gguf"):
        resolve_model_path(tmp_path)
    other = tmp_path / "weights.pt"
    other.write_bytes(b"z")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model_path(other)


def test_hf_folder_resolves_to_itself(tiny_llama):
    path, _ = tiny_llama("gqa")
    assert resolve_model_path(path) == (path, path.name)
    assert resolve_model_path(str(path)) == (path, path.name)


def test_unreadable_gguf_is_a_load_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        resolve_model_path(bad)
    assert not (tmp_path / "cache" / "gguf").exists() or not list((tmp_path / "cache" / "gguf").iterdir())


# --------------------------------------------------------------------------- GGUF cache


@pytest.fixture
def fake_gguf_reader(monkeypatch, tmp_path):
    """Stand-ins for transformers' GGUF reading that return a tiny Llama and count calls."""
    from transformers import LlamaConfig, LlamaForCausalLM

    calls = {"model": 0, "tokenizer": 0}

    def model(*args, **kwargs):
        assert kwargs.get("gguf_file", "").endswith(".gguf")
        calls["model"] += 1
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**TINY_BASE)).eval()

    def tokenizer(*args, **kwargs):
        calls["tokenizer"] += 1
        return char_tokenizer()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def test_gguf_conversion_is_cached_by_content(tmp_path, fake_gguf_reader, monkeypatch):
    src = tmp_path / "models" / "tiny.Q4.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF-one")
    folder, source = resolve_model_path(src)
    assert source == "tiny.Q4"
    assert folder.parent == tmp_path / "cache" / "gguf" and (folder / "config.json").is_file()
    assert list(folder.glob("*.safetensors")) and (folder / "tokenizer.json").is_file()
    assert fake_gguf_reader == {"model": 1, "tokenizer": 1}
    assert not [p for p in folder.parent.iterdir() if p != folder], "no temporary folder is left behind"

    # second resolve: the converter must not run again
    def fail(*a, **k):
        raise AssertionError("GGUF converted twice")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    assert resolve_model_path(src) == (folder, "tiny.Q4")
    assert resolve_model_path(src.parent) == (folder, "tiny.Q4"), "a folder holding one .gguf resolves to it"
    # a different file (content) gets its own cache entry
    other = tmp_path / "models2" / "tiny.Q4.gguf"
    other.parent.mkdir()
    other.write_bytes(b"GGUF-two")
    with pytest.raises(ModelLoadError, match="converted twice"):  # it tries to convert: the hash differs
        resolve_model_path(other)


def test_converted_gguf_serves(tmp_path, fake_gguf_reader):
    src = tmp_path / "tiny.gguf"
    src.write_bytes(b"GGUF-serve")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY_BASE)).eval()
    eng = make_engine(src, max_total_tokens=256)
    try:
        assert eng.engine.model_config.source == str(src)
        out = eng.generate(input_ids=[1, 50, 60, 70], sampling_params=greedy(6))
        assert_greedy_matches(hf, [1, 50, 60, 70], out["output_ids"], 6)
        assert out["text"] == eng.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        assert_pool_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_default_gguf_conversion_is_reused(monkeypatch):
    """The shipped SmolLM2 GGUF: converted at most once per serving dtype (here or by an earlier
    run), into the folder of the dtype ``--dtype auto`` picks on this CPU, then reused."""
    mc = load_model_config(None, "auto", CPU, None)
    folder = mc.path
    assert folder.parent == gguf_cache.cache_dir() / "gguf"
    assert folder == gguf_cache.gguf_cache_folder(loader.default_model_path(), AUTO_CPU_DTYPE)
    assert folder.name.startswith(gguf_cache._file_hash(loader.default_model_path()))
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (folder / name).is_file(), name
    assert mc.architecture == "LlamaForCausalLM" and mc.dtype == AUTO_CPU_DTYPE
    assert mc.served_name == "SmolLM2-135M-Instruct" and mc.context_len == 8192 and 2 in mc.eos_ids

    def fail(*a, **k):
        raise AssertionError("GGUF converted twice")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    assert load_model_config(None, "auto", CPU, None).path == folder
    if AUTO_CPU_DTYPE == gguf_cache.GGUF_CACHE_DTYPE:  # the dtype-less lookup finds the same folder
        assert resolve_model_path(None) == (folder, "SmolLM2-135M-Instruct.Q4_1")


# --------------------------------------------------------------------------- weights and config


def test_safetensors_and_bin_folders_hold_the_same_weights(tiny_llama):
    st_path, hf = tiny_llama("gqa")
    bin_path, hf_bin = tiny_llama("gqa", safe_serialization=False)
    assert list(st_path.glob("*.safetensors")) and not list(st_path.glob("*.bin"))
    assert (bin_path / "pytorch_model.bin").is_file() and not list(bin_path.glob("*.safetensors"))
    st = dict(iter_weights(st_path))
    bn = dict(iter_weights(bin_path))
    assert st.keys() == bn.keys() and st
    for k in st:
        assert torch.equal(st[k], bn[k]), k
    for k, v in hf.state_dict().items():
        assert torch.equal(st[k], v), k


@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_bin_folder_serves_like_transformers(tiny_llama, engine_factory, variant):
    path, hf = tiny_llama(variant, safe_serialization=False)
    eng = engine_factory(path, skip_tokenizer_init=True)
    p = [1, 9, 8, 7, 6, 5]
    out = eng.generate(input_ids=p, sampling_params=greedy(5), return_logprob=True, logprob_start_len=0)
    assert_greedy_matches(hf, p, out["output_ids"], 5)
    ref = hf_logprobs(hf, p)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    torch.testing.assert_close(got, ref[torch.arange(5), torch.tensor(p[1:])], atol=1e-4, rtol=0)


def test_context_length_cannot_exceed_the_model(tiny_llama):
    src, _ = tiny_llama("gqa")
    max_pos = TINY_BASE["max_position_embeddings"]
    assert load_model_config(str(src), "float32", CPU, max_pos).context_len == max_pos
    for bad in (max_pos + 1, 4 * max_pos, -5):
        with pytest.raises(ModelLoadError, match=f"context-length {bad}"):
            load_model_config(str(src), "float32", CPU, bad)
    # through the engine: rejected at start-up, not as a failed forward at position max_pos
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        make_engine(src, skip_tokenizer_init=True, context_length=max_pos * 2)


def test_no_weights(tmp_path, tiny_llama):
    src, _ = tiny_llama("gqa")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors or \\*.bin"):
        list(iter_weights(tmp_path))


def test_model_config_fields(tiny_llama, tmp_path):
    src, _ = tiny_llama("gqa")
    mc = load_model_config(str(src), "float32", CPU, None)
    assert mc.path == src and mc.architecture == "LlamaForCausalLM" and mc.dtype == torch.float32
    assert mc.context_len == TINY_BASE["max_position_embeddings"] and mc.eos_ids == (2,)
    assert mc.served_name == str(src) and mc.source == str(src)
    mc = load_model_config(str(src), "auto", CPU, 64, served_model_name="tiny",
                           json_overrides=json.dumps({"rms_norm_eps": 1e-5}))
    assert mc.context_len == 64 and mc.served_name == "tiny" and mc.dtype == AUTO_CPU_DTYPE
    assert mc.hf_config.rms_norm_eps == 1e-5
    # eos ids from config.json and generation_config.json are merged without duplicates
    dst = tmp_path / "eos"
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (dst / "generation_config.json").write_text(json.dumps(gen))
    assert load_model_config(str(dst), "float32", CPU, None).eos_ids == (2, 7)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = []
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="names no architectures"):
        load_model_config(str(dst), "float32", CPU, None)
    (dst / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read config.json"):
        load_model_config(str(dst), "float32", CPU, None)


# --------------------------------------------------------------------------- --load-format
def test_load_format_reads_only_the_named_format(tmp_path):
    """safetensors / pt read that format only (a folder with both serves the one named); a
    folder without it, or a model of the other kind, is refused before anything loads."""
    from tests.conftest import build_tiny_llama

    st = build_tiny_llama(tmp_path / "st", seed=0)
    pt = build_tiny_llama(tmp_path / "pt", seed=1, safe_serialization=False)
    both = tmp_path / "both"
    shutil.copytree(tmp_path / "st", both)
    shutil.copy(tmp_path / "pt" / "pytorch_model.bin", both / "pytorch_model.bin")
    for fmt, want in (("safetensors", st), ("pt", pt), ("auto", st)):
        got = dict(iter_weights(both, fmt))
        name = "model.layers.0.mlp.down_proj.weight"
        assert torch.equal(got[name], want.state_dict()[name]), fmt
    with pytest.raises(ModelLoadError, match=r"no \*\.bin or \*\.pt weights .*--load-format pt"):
        make_engine(tmp_path / "st", load_format="pt")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights .*--load-format safetensors"):
        make_engine(tmp_path / "pt", load_format="safetensors")
    with pytest.raises(ModelLoadError, match="--load-format gguf needs a .gguf model"):
        make_engine(tmp_path / "st", load_format="gguf")
    with pytest.raises(ModelLoadError, match="is a GGUF file"):
        make_engine(loader.default_model_path(), load_format="safetensors")


def test_weight_loader_disable_mmap_reads_files_whole(tiny_llama, monkeypatch):
    """``--weight-loader-disable-mmap``: the safetensors files are read whole, never mapped (a
    mapping here fails), and the engine serves transformers' tokens as with the mapping."""
    import safetensors

    path, hf = tiny_llama("gqa")
    read: list[str] = []
    real_read = type(path).read_bytes

    def record(self):
        if self.suffix == ".safetensors":
            read.append(self.name)
        return real_read(self)

    def no_map(*a, **kw):
        raise AssertionError("safe_open (a memory map) under --weight-loader-disable-mmap")

    monkeypatch.setattr(safetensors, "safe_open", no_map)
    monkeypatch.setattr(type(path), "read_bytes", record)
    eng = make_engine(path, skip_tokenizer_init=True, weight_loader_disable_mmap=True)
    try:
        p = [1, 9, 8, 7, 6, 5]
        out = eng.generate(input_ids=p, sampling_params=greedy(5))
        assert_greedy_matches(hf, p, out["output_ids"], 5)
        assert read == [f.name for f in sorted(path.glob("*.safetensors"))]
    finally:
        eng.shutdown()
    with pytest.raises(AssertionError, match="a memory map"):  # (the default maps them)
        make_engine(path, skip_tokenizer_init=True)
