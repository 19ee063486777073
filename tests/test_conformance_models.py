"""The model suite of the conformance kit: every registered architecture matches transformers
on a tiny random config derived from its transformers class, and a model that ignores the
sliding window is caught with a message naming the case."""

from __future__ import annotations

import pytest

from core.plugins import load_plugins
from core.testing import check_plugin, model_conformance
from core.testing.models import derive_config
from core_plugins.models.mistral import MistralForCausalLM

pytest_plugins = ["core.testing.pytest_plugin"]


@pytest.fixture(params=load_plugins().names("model"))
def model_architecture(request):
    """Every installed architecture: causal LMs run prefill, chunked prefill and greedy decode;
    sequence classifiers run the classify case."""
    return request.param


@pytest.fixture
def model_config(model_architecture):
    """None (the kit derives a tiny config from the transformers class) except for a composite
    (text + vision) config, which the kit cannot shrink: Qwen2-VL's, Qwen2.5-VL's and LLaVA's are their own tests' tiny configs.
    The cases' text-only prompts check its language model; tests/test_model_qwen2_vl.py (and
    tests/test_model_llava.py) the images."""
    if model_architecture == "Qwen2VLForConditionalGeneration":
        from tests.test_model_qwen2_vl import tiny_config

        return tiny_config()
    if model_architecture == "Qwen2_5_VLForConditionalGeneration":
        from tests.test_model_qwen2_5_vl import tiny_config as tiny_config_2_5

        return tiny_config_2_5()
    if model_architecture == "LlavaForConditionalGeneration":
        from tests.test_model_llava import tiny_config as tiny_llava_config

        return tiny_llava_config()
    return None


class FullContextMistral(MistralForCausalLM):
    """Attends to the whole context although the config has a sliding window."""

    attn_options = {**MistralForCausalLM.attn_options, "sliding_window": None}


def test_a_model_ignoring_the_sliding_window_is_caught():
    config = derive_config("MistralForCausalLM")
    assert config.sliding_window == 8  # the tiny config's window; the prompts run past it
    results = {r.case: r for r in check_plugin(FullContextMistral, "model", config=config)}
    assert results["prefill"].status == "failed" and results["greedy_decode"].status == "failed"
    assert results["prefill"].message.startswith(
        "model 'FullContextMistral' case 'prefill': prompt of 23 tokens, logprobs:")
    assert results["classify"].status == "skipped"


def test_an_architecture_without_a_transformers_class_needs_a_config():
    (r, *_) = check_plugin(FullContextMistral, "model")
    assert r.status == "skipped" and "pass model_config" in r.message
