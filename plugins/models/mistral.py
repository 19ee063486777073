"""Mistral: Llama with ``sliding_window`` on every layer (read from the config by
:func:`~core_plugins.models.llama.sliding_window_of`)."""

from __future__ import annotations

from core import hookimpl
from core_plugins.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass


@hookimpl
def register_models(register) -> None:
    register("MistralForCausalLM", MistralForCausalLM)
