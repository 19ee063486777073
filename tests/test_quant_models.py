"""Quantized models served by the engine against the same model unquantized.

The model is a tiny Llama trained for a few seconds on a rule (token t is a fixed permutation of
token t - 2, so it needs its attention layers), because 4-bit noise on *random* weights (~8 % per
layer) flips most argmaxes of a random model, whose top-two logits are close, while a trained
model's margins are what quantization has to preserve. Each method serves it in bf16 (the packed
kernels' activation dtype); under teacher forcing (rule sequences: a prefill, then one decode step
per token) its greedy token agrees with the unquantized engine's at >= 90 % of positions and the
mean KL divergence of the next-token distributions stays under the bound each test states.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from core.engine.mem_cache.kv_cache import allocate_kv_cache, kv_bytes_per_token
from core.errors import CoreError
from core.interfaces import AttentionConfig, ForwardBatch
from core.layers import Linear
from core_kernels import cpu_gemv
from core_plugins.attention.torch_native import TorchNativeBackend
from tests.conftest import make_engine
from tests.test_quant_kernels import pack_awq, pack_gptq_cols, pack_gptq_rows, quantize_zero_point


@pytest.fixture(autouse=True)
def _packed_kernels_only(monkeypatch):
    """These tests check the packed kernels: no dense copy for GEMMs of many rows (see packed.DENSE_MIN_ROWS)."""
    from core_plugins.quant import packed

    monkeypatch.setattr(packed, "DENSE_MIN_ROWS", None)


MIN_AGREEMENT = 0.9
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rule_sequences(n: int = 2, length: int = 32, seed: int = 1, vocab: int = 256) -> list[list[int]]:
    """Sequences of the training rule: two random tokens, then ``x[t] = PERM[x[t - 2]]``."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    x = torch.empty(n, length, dtype=torch.long)
    x[:, :2] = torch.randint(3, vocab, (n, 2), generator=g)
    for t in range(2, length):
        x[:, t] = perm[x[:, t - 2]]
    return x.tolist()


def train_tiny_llama(path: Path, steps: int = 300) -> None:
    """A tiny Llama (conftest's TINY_BASE) trained on the rule until it predicts it (~99 %), saved with
    the char tokenizer. About 5 s on one core."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_BASE, char_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_BASE, "initializer_range": 0.02})).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds barrier waits (and on a busy machine, a lot)
    try:
        for step in range(steps):
            x = torch.tensor(rule_sequences(32, 32, seed=100 + step))
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.eval().save_pretrained(path)
    char_tokenizer().save_pretrained(path)


@torch.inference_mode()
def teacher_forced_logits(eng, ids: list[int], prefill: int = 16) -> torch.Tensor:
    """float32 ``[len(ids), V]`` next-token logits: the first ``prefill`` tokens in one forward, then
    one decode forward per token, over a private pool of the engine's KV dtype (so an fp8 pool is
    written and read back by both the prefill and the decode path)."""
    ae = eng.engine
    cfg, pool = ae.model_config.hf_config, ae.kv_cache
    hkv, d = pool.k[0].shape[1:]
    kv = allocate_kv_cache(len(pool.k), len(ids) + 1, 1, hkv, d, pool.k[0].dtype, ae.device)
    backend = TorchNativeBackend(AttentionConfig(len(pool.k), cfg.num_attention_heads, hkv, d, ae.model_config.dtype,
                                                 ae.device, kv))
    out = []
    for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, len(ids))]:
        dev = ae.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids[start:end], device=dev), positions=torch.arange(start, end, device=dev),
            out_cache_loc=torch.arange(start + 1, end + 1, device=dev), seq_lens=torch.tensor([end], device=dev),
            extend_lens=torch.tensor([end - start], device=dev), kv_indices=torch.arange(1, end + 1, device=dev)[None],
            seq_lens_cpu=[end], extend_lens_cpu=[end - start], attn_backend=backend)
        backend.prepare(fb)
        out.append(ae.model.compute_logits(ae.model(fb)).float().cpu())
    return torch.cat(out)


def agreement_and_kl(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(fraction of positions with the same argmax, mean KL(ref || got) in nats)."""
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return agree, (lp.exp() * (lp - lq)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-trained")
    train_tiny_llama(path)
    return path


def forced(eng) -> torch.Tensor:
    return torch.cat([teacher_forced_logits(eng, ids) for ids in rule_sequences()])


@pytest.fixture(scope="module")
def reference(tiny, engine_factory):
    """The unquantized engine's teacher-forced logits over the rule sequences, bf16."""
    logits = forced(engine_factory(tiny, dtype="bfloat16", skip_tokenizer_init=True))
    ids = torch.tensor([t for seq in rule_sequences() for t in seq[1:]])
    assert (logits.reshape(2, 32, -1)[:, :-1].argmax(-1).flatten() == ids).float().mean() > 0.9, "the rule was learned"
    return rule_sequences()[0], logits


def assert_follows_rule(eng, ids: list[int]) -> None:
    """Through the engine's own scheduler and decode path: greedy continues the rule sequence."""
    out = eng.generate(input_ids=ids[:10], sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    assert out["output_ids"] == ids[10:18]


def check_close(ref: torch.Tensor, got: torch.Tensor, max_kl: float) -> None:
    agree, kl = agreement_and_kl(ref, got)
    assert agree >= MIN_AGREEMENT and kl < max_kl, f"agreement {agree:.3f} (>= {MIN_AGREEMENT}), mean KL {kl:.4f} (< {max_kl})"


@pytest.mark.parametrize("method,max_kl", [("int8wo", 0.001), ("int4wo-32", 0.02), ("int4wo-64", 0.02)])
def test_weight_only_methods_track_the_dense_model(tiny, reference, engine_factory, method, max_kl):
    ids, ref = reference
    eng = engine_factory(tiny, dtype="bfloat16", skip_tokenizer_init=True, quantization=method)
    kinds = {m.quant_format for m in eng.engine.model.modules() if isinstance(m, Linear)}
    assert kinds == {"int8" if method == "int8wo" else "int4"}, kinds
    check_close(ref, forced(eng), max_kl)
    on_gemv = eng.engine.device.type == "cpu" and cpu_gemv.available_for(torch.bfloat16)
    head_format = "int8_blocks" if on_gemv else "int8"  # (kernels/cpu_gemv, a CPU engine's: float32 logits)
    assert eng.engine.model.lm_head.packed_head.quant_format == head_format, "the LM head is packed"
    assert_follows_rule(eng, ids)


def test_fp8_kv_cache_tracks_the_bf16_pool(tiny, reference, engine_factory):
    """Weights unquantized, K/V stored as float8_e4m3fn (scale 1.0) and dequantized by torch_native."""
    ids, ref = reference
    eng = engine_factory(tiny, dtype="bfloat16", skip_tokenizer_init=True, kv_cache_dtype="fp8_e4m3", max_total_tokens=512)
    pool = eng.engine.kv_cache
    assert pool.k[0].dtype == torch.float8_e4m3fn and pool.v[-1].dtype == torch.float8_e4m3fn
    assert (pool.k_scale, pool.v_scale) == (1.0, 1.0)
    check_close(ref, forced(eng), 0.005)
    assert_follows_rule(eng, ids)
    # slots never written hold whatever the allocation held (possibly fp8 NaN bytes): look for a written value
    assert (pool.k[0][1:20].float().abs() > 0).any(), "the engine wrote K into the fp8 pool"


def test_fp8_pool_holds_twice_the_tokens_of_bf16_at_the_same_memory():
    layers, heads, dim = 30, 3, 64  # SmolLM2-135M
    per_bf16 = kv_bytes_per_token(layers, heads, dim, torch.bfloat16)
    per_fp8 = kv_bytes_per_token(layers, heads, dim, torch.float8_e4m3fn)
    budget = 1 << 30
    assert per_bf16 == 2 * per_fp8 == 2 * layers * heads * dim * 2
    assert (budget // per_fp8) / (budget // per_bf16) >= 1.9
    pools = {dt: allocate_kv_cache(2, 64, 1, heads, dim, dt, torch.device("cpu")) for dt in (torch.bfloat16, torch.float8_e4m3fn)}
    nbytes = {dt: sum(t.nbytes for t in p.k + p.v) for dt, p in pools.items()}
    assert nbytes[torch.bfloat16] == 2 * nbytes[torch.float8_e4m3fn]


def test_fp8_store_saturates_and_scales():
    from core_plugins.attention.torch_native import _gather, _store

    pool = torch.zeros(4, 1, 2, dtype=torch.float8_e4m3fn)
    _store(pool, torch.tensor([1, 2]), torch.tensor([[[1000.0, -3.0]], [[0.5, -1000.0]]]).bfloat16(), 1.0)
    assert _gather(pool, torch.tensor([1, 2]), torch.float32, 1.0).flatten().tolist() == [448.0, -3.0, 0.5, -448.0]
    _store(pool, torch.tensor([3]), torch.tensor([[[1536.0, -3.0]]]), 4.0)  # past 448 only unscaled
    assert _gather(pool, torch.tensor([3]), torch.float32, 4.0).flatten().tolist() == [1536.0, -3.0]


# --------------------------------------------------------------------------- AWQ / GPTQ checkpoints


def write_quantized_checkpoint(src: Path, dst: Path, method: str, group: int = 32) -> None:
    """``src``'s tiny Llama with every linear weight replaced by ``method``'s packed tensors, and the
    quantization_config its quantizer writes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEAR]:
        base = name.removesuffix(".weight")
        q, z, s = quantize_zero_point(state.pop(name).float(), group)
        if method == "awq":
            state.update({f"{base}.qweight": pack_awq(q.T), f"{base}.qzeros": pack_awq(z.T), f"{base}.scales": s.T.half()})
        else:
            state.update({f"{base}.qweight": pack_gptq_rows(q.T), f"{base}.qzeros": pack_gptq_cols((z - 1).T & 0xF),
                          f"{base}.scales": s.T.half(), f"{base}.g_idx": (torch.arange(q.shape[1]) // group).int()})
    save_file({k: v.contiguous() for k, v in state.items()}, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"} if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False})
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_gptq_checkpoints_are_detected_and_track_the_dense_model(tiny, reference, engine_factory, tmp_path, method):
    ids, ref = reference
    write_quantized_checkpoint(tiny, tmp_path / method, method)
    eng = engine_factory(tmp_path / method, dtype="bfloat16", skip_tokenizer_init=True)  # no flag: config.json says
    assert type(eng.engine.model.model.layers[0].mlp.down_proj.quant_method).__name__ == method.upper()
    check_close(ref, forced(eng), 0.02)


# --------------------------------------------------------------------------- refusals


def test_fp8_on_cpu_stops_start_up_naming_method_and_device(tiny):
    with pytest.raises(CoreError, match=r"quantization method 'fp8' cannot run on device 'cpu': fp8 GEMMs "
                                        r"\(torch._scaled_mm\) need a CUDA GPU with compute capability >= 8.9"):
        make_engine(tiny, quantization="fp8", skip_tokenizer_init=True)


def test_awq_config_without_its_tensors_is_refused(tiny, tmp_path):
    bad = tmp_path / "awq-without-tensors"
    shutil.copytree(tiny, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CoreError, match=r"declares awq quantization, but the checkpoint has no awq tensors"):
        make_engine(bad, skip_tokenizer_init=True)
    with pytest.raises(CoreError, match=r"--quantization gptq cannot apply"):
        make_engine(bad, quantization="gptq", skip_tokenizer_init=True)


@pytest.mark.parametrize("kwargs,message", [
    ({"quantization": "awq"}, r"--quantization awq needs a awq checkpoint"),
    ({"quantization": "gguf"}, r"--quantization gguf serves a .gguf file's own weights"),
    ({"torchao_config": "int3wo"}, r"unknown --torchao-config 'int3wo'; choose one of int8wo, int4wo-32"),
    ({"torchao_config": "int8wo", "quantization": "int4wo-32"}, r"pass one of them"),
    ({"quantization": "int5"}, r"unknown quant_method 'int5'"),
    ({"kv_cache_dtype": "fp4"}, r"unknown --kv-cache-dtype 'fp4'; choose auto, fp8_e4m3"),
])
def test_bad_quantization_choices_stop_start_up(tiny, kwargs, message):
    with pytest.raises(CoreError, match=message):
        make_engine(tiny, skip_tokenizer_init=True, **kwargs)


def test_torchao_config_selects_the_method(tiny, engine_factory):
    eng = engine_factory(tiny, dtype="bfloat16", skip_tokenizer_init=True, torchao_config="int4wo-32")
    assert eng.engine.model.model.layers[1].self_attn.qkv_proj.quant_format == "int4"
