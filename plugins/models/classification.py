"""Sequence-classification / reward heads (``XxxForSequenceClassification``): the
decoder of the matching causal LM plus a ``score`` linear on the last token; served with
``--is-embedding`` on /classify (and /encode, /v1/embeddings return the same scores)."""

from __future__ import annotations

import torch

from core import hookimpl
from core.interfaces import ModelContext
from core.layers import Linear
from core_plugins.models.llama import LlamaForCausalLM
from core_plugins.models.mistral import MistralForCausalLM
from core_plugins.models.qwen2 import Qwen2ForCausalLM
from core_plugins.models.qwen3 import Qwen3ForCausalLM


class SequenceClassificationMixin:
    """Mixed in before a ``LlamaForCausalLM``-style class: drops the LM head, adds ``score``."""

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__(config, ctx)  # type: ignore[call-arg]
        if hasattr(self, "lm_head"):
            del self.lm_head
        self.tied = True  # no lm_head to load (a checkpoint's would be skipped)
        self.score = Linear(config.hidden_size, config.num_labels, False, ctx.quant_method, ctx.dtype)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled.to(self.score.weight.dtype)).float()


def _make(name: str, base: type) -> type:
    return type(name, (SequenceClassificationMixin, base), {})


CLASSES = {name: _make(name, base) for name, base in {
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "MistralForSequenceClassification": MistralForCausalLM,
    "Qwen2ForSequenceClassification": Qwen2ForCausalLM,
    "Qwen3ForSequenceClassification": Qwen3ForCausalLM,
}.items()}


@hookimpl
def register_models(register) -> None:
    for name, cls in CLASSES.items():
        register(name, cls)
