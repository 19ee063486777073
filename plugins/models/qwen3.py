"""Qwen3: Llama with a per-head RMS norm on q and k before rotary."""

from __future__ import annotations

from core import hookimpl
from core_plugins.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    attn_options = {"qk_norm": True}


@hookimpl
def register_models(register) -> None:
    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
