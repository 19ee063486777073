"""Vision-language models: images in requests, encoded once per request, spliced into the prompt's
embeddings, and keyed by content in the prefix cache.

The pieces, and who provides them:

- A **multimodal processor** (plugin kind ``multimodal_processor``, hook
  ``register_multimodal_processors``, registered under the model's architecture name) turns a
  prompt and its images into :class:`ImageInputs`: the token ids with every image's placeholder
  expanded to its tokens, the pixel tensors the vision tower takes, and where each image's tokens
  sit. Built in: Qwen2-VL / Qwen2.5-VL and LLaVA (transformers' image processors).
- The **model plugin** of a vision-language architecture encodes images
  (``encode_images(pixel_values, image_grid_thw) -> [image tokens, hidden]``), computes M-RoPE
  positions where it uses them (``mrope_positions(input_ids, image_grid_thw) -> ([3, L], delta)``),
  and in its forward replaces the embeddings of the rows ``ForwardBatch.mm_rows`` with
  ``ForwardBatch.mm_embeds`` (and rotates by ``ForwardBatch.mrope_positions`` when set).
- The engine (``core.engine.multimodal.engine``) runs the processor when a request is made, the
  vision tower once per request (batched over a step's new requests, kept while the request's
  prompt is prefilled in chunks), and keys the image tokens in the prefix cache by the image's
  content hash (``ImageInputs.cache_ids``).
"""

from __future__ import annotations

import attrs
import torch

# image token ids in the prefix cache: (IMAGE_KEY_BASE | 40 bits of the image's hash) + the token's
# index in the image, far above any vocabulary and LoRA's uid tags (uid << 32): two images never
# share a key, the same image at the same place always does
IMAGE_KEY_BASE = 1 << 62
ADAPTER_KEY_BIT = 1 << 61  # set in an image key under a LoRA adapter (``Req.cache_ids``; a text key has its uid)


def is_adapter_key(key: int) -> bool:
    """Whether a prefix-cache key was made under a LoRA adapter (``Req.cache_ids``): a text token's
    (its uid above bit 32) or an image token's (``ADAPTER_KEY_BIT``)."""
    return key >= 1 << 32 and (key < IMAGE_KEY_BASE or bool(key & ADAPTER_KEY_BIT))


@attrs.define(eq=False)
class ImageInputs:
    """One request's images after its processor. ``spans[i]`` is image ``i``'s (first token index
    in ``input_ids``, token count); ``hashes[i]`` a 64-bit hash of its content (the decoded
    image's pixels and size); ``pixel_values`` / ``image_grid_thw`` what the model's
    ``encode_images`` takes for all of them (``image_grid_thw`` ``[N, 3]`` int64, or None for
    towers of one fixed size). ``mrope_positions`` ``[3, len(input_ids)]`` and ``mrope_delta``
    (what a decode position adds) are set by the engine for M-RoPE models."""

    input_ids: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None
    spans: list[tuple[int, int]]
    hashes: list[int]
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    embeds: torch.Tensor | None = None  # the vision tower's output for every image token, once encoded

    def cache_ids(self, ids: list[int]) -> list[int]:
        """``ids`` (a prefix of ``input_ids`` and beyond) with each image token replaced by its
        content key (``IMAGE_KEY_BASE``)."""
        out = list(ids)
        for (start, n), h in zip(self.spans, self.hashes):
            base = IMAGE_KEY_BASE | (h & ((1 << 40) - 1)) << 20
            for j in range(start, min(start + n, len(out))):
                out[j] = base + (j - start)
        return out
