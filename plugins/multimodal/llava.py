"""LLaVA's (1.5-style) request processor: transformers' CLIP image processor (the PIL one: no
torchvision needed) read from the model folder's ``preprocessor_config.json`` (transformers'
defaults where there is none) resizes and crops every image to the tower's size, and each
``<image>`` placeholder is expanded to the image's ``(image_size / patch_size) ** 2`` tokens
(one more for the "full" feature strategy, which keeps the class token), as transformers'
``LlavaProcessor`` expands it."""

from __future__ import annotations

from typing import Any

from core import hookimpl
from core.engine.multimodal import ImageInputs
from core.engine.multimodal.images import image_hash
from core.engine.multimodal.processor import expand_placeholders, image_token_id

CORE_PLUGIN_API = "1"

IMAGE_TOKEN = "<image>"


@hookimpl
def register_multimodal_processors(register):
    register("LlavaForConditionalGeneration", "core_plugins.multimodal.llava:LlavaInputProcessor")


def _image_processor(model_path: str) -> Any:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    try:
        return CLIPImageProcessorPil.from_pretrained(model_path)
    except OSError:  # no preprocessor_config.json: transformers' defaults (CLIP's 224 crop)
        return CLIPImageProcessorPil()


def tokens_per_image(hf_config: Any) -> int:
    vc = hf_config.vision_config
    full = getattr(hf_config, "vision_feature_select_strategy", "default") == "full"
    return (vc.image_size // vc.patch_size) ** 2 + full


class LlavaInputProcessor:
    """Built as ``LlavaInputProcessor(model_path, hf_config, tokenizer)``; ``image_processor``
    (a transformers CLIP image processor) replaces the one read from ``model_path``."""

    max_images: int | None = None

    def __init__(self, model_path: str, hf_config: Any, tokenizer: Any, image_processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor if image_processor is not None else _image_processor(model_path)
        self.tokens_per_image = tokens_per_image(hf_config)
        configured = getattr(hf_config, "image_token_id", None)
        configured = configured if configured is not None else getattr(hf_config, "image_token_index", None)
        self.image_token_id = image_token_id(tokenizer, IMAGE_TOKEN, configured)

    def process(self, prompt: str | list[int], images: list) -> ImageInputs:
        out = self.image_processor(images=list(images), return_tensors="pt")
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        ids, spans = expand_placeholders(ids, self.image_token_id, [self.tokens_per_image] * len(images))
        return ImageInputs(input_ids=ids, pixel_values=out["pixel_values"], image_grid_thw=None, spans=spans,
                           hashes=[image_hash(img) for img in images])
