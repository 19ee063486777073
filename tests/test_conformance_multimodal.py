"""The multimodal processor suite (core.testing) run against the built-in processors, each built
for a tiny model of its own tests: Qwen2-VL's (image grids, M-RoPE) and LLaVA's (fixed-size images)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core.testing import multimodal_processor_conformance
from core.testing.check import check_plugin
from tests.test_multimodal_inputs import _image_processor, _tokenizer

_ = multimodal_processor_conformance  # (collected: its cases run for each processor below)


@pytest.fixture(params=["qwen2_vl", "llava"])
def multimodal_processor(request):
    if request.param == "qwen2_vl":
        from core_plugins.multimodal.qwen2_vl import Qwen2VLInputProcessor

        tok = _tokenizer()
        pad = tok.convert_tokens_to_ids("<|image_pad|>")
        return Qwen2VLInputProcessor("/nonexistent", SimpleNamespace(image_token_id=pad), tok,
                                     image_processor=_image_processor())
    from core_plugins.multimodal.llava import LlavaInputProcessor
    from tests.test_model_llava import image_processor, tiny_config, tokenizer

    return LlavaInputProcessor("/nonexistent", tiny_config(), tokenizer(), image_processor=image_processor())


def test_from_the_command_line_a_processor_is_skipped_not_failed():
    results = check_plugin("Qwen2VLForConditionalGeneration", "multimodal_processor")
    assert results and all(r.status == "skipped" and "pytest suite" in r.message for r in results)
