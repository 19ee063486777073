"""Qwen2 / Qwen2.5: Llama with biases on the q/k/v projections (not on o_proj);
sliding-window layers where the config's ``layer_types`` say so."""

from __future__ import annotations

from core import hookimpl
from core_plugins.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attn_options = {"qkv_bias": True, "o_bias": False}


@hookimpl
def register_models(register) -> None:
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
