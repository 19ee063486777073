"""Qwen2-VL's and Qwen2.5-VL's request processor: transformers' Qwen2-VL image processor (the
PIL one: no torchvision needed) for the pixel patches and grids, and each ``<|image_pad|>``
placeholder expanded to its image's ``t * h * w / merge_size**2`` tokens, as transformers'
``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` expand it (both share this image processor and
rule for images)."""

from __future__ import annotations

from typing import Any

from core import hookimpl
from core.engine.multimodal import ImageInputs
from core.engine.multimodal.images import image_hash
from core.engine.multimodal.processor import expand_placeholders, image_token_id

CORE_PLUGIN_API = "1"

IMAGE_TOKEN = "<|image_pad|>"


@hookimpl
def register_multimodal_processors(register):
    target = "core_plugins.multimodal.qwen2_vl:Qwen2VLInputProcessor"
    register("Qwen2VLForConditionalGeneration", target)
    register("Qwen2_5_VLForConditionalGeneration", target)


def _image_processor(model_path: str) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        return Qwen2VLImageProcessorPil.from_pretrained(model_path)
    except OSError:  # no preprocessor_config.json: transformers' defaults (as Qwen2-VL ships them)
        return Qwen2VLImageProcessorPil()


class Qwen2VLInputProcessor:
    """Built as ``Qwen2VLInputProcessor(model_path, hf_config, tokenizer)``; ``image_processor``
    (a transformers Qwen2-VL image processor) replaces the one read from ``model_path``."""

    max_images: int | None = None

    def __init__(self, model_path: str, hf_config: Any, tokenizer: Any, image_processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor if image_processor is not None else _image_processor(model_path)
        self.merge_size = int(self.image_processor.merge_size)
        self.image_token_id = image_token_id(tokenizer, IMAGE_TOKEN, getattr(hf_config, "image_token_id", None))

    def process(self, prompt: str | list[int], images: list) -> ImageInputs:
        out = self.image_processor(images=list(images), return_tensors="pt")
        grid = out["image_grid_thw"].long()
        counts = [int(n) for n in grid.prod(-1) // (self.merge_size ** 2)]
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        ids, spans = expand_placeholders(ids, self.image_token_id, counts)
        return ImageInputs(input_ids=ids, pixel_values=out["pixel_values"], image_grid_thw=grid, spans=spans,
                           hashes=[image_hash(img) for img in images])
