"""A GGUF's rope scaling (``{arch}.rope.scaling.*`` metadata, Llama 3.x's ``rope_freqs.weight``)
is applied as llama.cpp applies it. transformers' GGUF reader maps none of it for llama, so these
files loaded and ran with plain positions (each test failed before the fix)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

H, NH, NKV, HD, V = 128, 2, 1, 64, 256


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (a byte-level BPE vocabulary's tokens)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b), cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTES = _byte_chars()


def _write(path: Path, extra_kv: dict | None = None, extra_tensors: dict | None = None) -> None:
    """A tiny one-layer llama GGUF (Q8_0 weights, a byte-level vocabulary)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1), w.add_context_length(256), w.add_embedding_length(H), w.add_feed_forward_length(H)
    w.add_head_count(NH), w.add_head_count_kv(NKV), w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HD), w.add_vocab_size(V), w.add_tokenizer_model("gpt2")
    w.add_token_list([_BYTES[i] for i in range(V - 4)] + ["ab", "<s>", "</s>", "<unk>"])  # byte-level, one merge
    w.add_token_types([1] * (V - 3) + [3, 3, 3]), w.add_token_merges(["a b"])
    w.add_bos_token_id(V - 3), w.add_eos_token_id(V - 2)
    for key, value in (extra_kv or {}).items():
        getattr(w, key)(value)

    def add(name: str, shape: tuple[int, ...], scale: float = 0.08) -> None:
        arr = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, 1 + arr)
            return
        q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    add("token_embd.weight", (V, H), 0.5)
    add("blk.0.attn_norm.weight", (H,)), add("blk.0.ffn_norm.weight", (H,)), add("output_norm.weight", (H,))
    add("blk.0.attn_q.weight", (NH * HD, H)), add("blk.0.attn_k.weight", (NKV * HD, H))
    add("blk.0.attn_v.weight", (NKV * HD, H)), add("blk.0.attn_output.weight", (H, NH * HD))
    add("blk.0.ffn_gate.weight", (H, H)), add("blk.0.ffn_up.weight", (H, H)), add("blk.0.ffn_down.weight", (H, H))
    add("output.weight", (V, H), 0.1)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _cos(path: Path, monkeypatch, tmp_path: Path) -> torch.Tensor:
    import core

    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    eng = core.Engine(model_path=str(path), dtype="float32", max_total_tokens=256, cpu_threads=1, device="cpu",
                      skip_tokenizer_init=True)
    try:
        return eng.engine.model.model.layers[0].self_attn.rotary.cos[:16, : HD // 2].float().clone()
    finally:
        eng.shutdown()


BASE = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
POS = torch.arange(16).float()


def test_linear_rope_scaling_divides_the_positions(tmp_path, monkeypatch):
    f = tmp_path / "linear.gguf"
    _write(f, {"add_rope_scaling_type": gguf.RopeScalingType.LINEAR, "add_rope_scaling_factor": 8.0})
    torch.testing.assert_close(_cos(f, monkeypatch, tmp_path), torch.cos(torch.outer(POS, BASE / 8)), atol=1e-4, rtol=0)


def test_rope_freqs_divide_each_frequency(tmp_path, monkeypatch):
    factors = np.ones(HD // 2, dtype=np.float32)
    factors[HD // 4:] = 8.0  # the low frequencies slowed 8x, as Llama 3.1's rope_freqs does
    f = tmp_path / "freqs.gguf"
    _write(f, extra_tensors={"rope_freqs.weight": factors})
    want = torch.cos(torch.outer(POS, BASE / torch.from_numpy(factors)))
    torch.testing.assert_close(_cos(f, monkeypatch, tmp_path), want, atol=1e-4, rtol=0)


def test_per_layer_type_rope_scales_the_global_layers_only(tmp_path):
    """Gemma 3 keys its rope by layer type; llama.cpp's scaling applies to the global (full) layers."""
    from types import SimpleNamespace

    from core.engine.model_loader.loader import gguf_rope_scaling

    f = tmp_path / "linear.gguf"
    _write(f, {"add_rope_scaling_type": gguf.RopeScalingType.LINEAR, "add_rope_scaling_factor": 8.0})
    local = {"rope_type": "default", "rope_theta": 10000.0}
    config = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                              "sliding_attention": dict(local)})
    gguf_rope_scaling(config, f)
    assert config.rope_parameters == {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                                      "sliding_attention": local}
