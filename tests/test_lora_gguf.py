"""A LoRA adapter on top of the GGUF default model (issue 44): the base keeps its packed int4
blocks (the adapter's deltas add to their output), and the served model agrees with peft over
transformers' dequantization of the same file, as closely as the base alone does."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital "
        "of Germany. Water boils at one hundred degrees Celsius at sea level, and it freezes at zero degrees.")
MIN_AGREEMENT = 0.9  # the base model alone: tests/test_quant_models.MIN_AGREEMENT


def test_adapter_on_the_packed_gguf_base_agrees_with_peft_on_the_dequantized_model(tmp_path):
    from transformers import AutoModelForCausalLM

    import core
    from core.engine.model_loader.gguf_cache import gguf_dense_folder
    from core.testing.lora import write_random_adapter

    eng = core.Engine(dtype="bfloat16", max_total_tokens=2048, cpu_threads=1, device="cpu")  # (the embedded GGUF)
    try:
        mc = eng.engine.model_config
        # deltas large enough to move the model's argmax; alpha = rank: scaling 1
        write_random_adapter(tmp_path / "a", mc.hf_config, rank=8, b_scale=0.15, alpha=8)
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
            return torch.tensor([tops[0][1] for tops in out["meta_info"]["input_top_logprobs"][1:]])  # (logprob, token id, text)

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
