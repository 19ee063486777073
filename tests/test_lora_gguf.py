"""A LoRA adapter on top of the GGUF default model (issue 44): the base keeps its packed int4
blocks (the adapter's deltas add to their output), and the served model agrees with peft over
transformers' dequantization of the same file, as closely as the base alone does."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital "
        "of Germany. Water boils at one hundred degrees Celsius at sea level, and it freezes at zero degrees.")
MIN_AGREEMENT = 0.9  # the base model alone: tests/test_quant_models.MIN_AGREEMENT


def write_adapter(folder, cfg, rank: int = 8, seed: int = 0) -> None:
    """A peft checkpoint over every projection of the model, large enough deltas to move its argmax."""
    from safetensors.torch import save_file

    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * d
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for m, (fin, fout) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) / fin**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.15
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none", "task_type": "CAUSAL_LM",
        "target_modules": [m.split(".")[1] for m in shapes]}))


def test_adapter_on_the_packed_gguf_base_agrees_with_peft_on_the_dequantized_model(tmp_path):
    from transformers import AutoModelForCausalLM

    import core
    from core.engine.gguf_cache import gguf_dense_folder

    eng = core.Engine(dtype="bfloat16", max_total_tokens=2048, cpu_threads=1, device="cpu")  # (the embedded GGUF)
    try:
        mc = eng.engine.model_config
        write_adapter(tmp_path / "a", mc.hf_config)
        dense = gguf_dense_folder(mc.gguf_file, mc.path)
        ids = eng.tokenizer.encode(TEXT)
    finally:
        eng.shutdown()
    eng = core.Engine(dtype="bfloat16", max_total_tokens=2048, cpu_threads=1, device="cpu",
                      lora_paths=[f"a={tmp_path / 'a'}"])
    try:
        layer = eng.engine.model.model.layers[0].mlp.down_proj
        assert type(layer.quant_method).__name__ == "GGUFQuant" and layer.__dict__.get("lora") is not None

        def top1(lora):
            out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                               return_logprob=True, logprob_start_len=0, top_logprobs_num=1, lora_path=lora)
            return torch.tensor([tops[0][0] for tops in out["meta_info"]["input_top_logprobs"][1:]])  # (token id, logprob)

        served, served_base = top1("a"), top1(None)
    finally:
        eng.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref_base = hf(torch.tensor([ids])).logits[0, :-1].argmax(-1)
        ref = peft.PeftModel.from_pretrained(hf, str(tmp_path / "a")).eval()(torch.tensor([ids])).logits[0, :-1].argmax(-1)
    moved = (ref != ref_base).float().mean().item()
    assert moved > 0.2, f"the adapter changes only {moved:.0%} of the reference's next-token choices"
    agree = (served == ref).float().mean().item()
    base_agree = (served_base == ref_base).float().mean().item()
    assert agree >= MIN_AGREEMENT and agree >= base_agree - 0.05, (agree, base_agree, moved)
