"""The engine's side of images: the processor at request time, and per forward the vision tower's
rows and the M-RoPE positions.

``prepare`` runs the architecture's processor (plugin kind ``multimodal_processor``) and, for a
model with M-RoPE, its position table. ``forward_inputs`` runs on the forward thread before each
forward: requests whose new tokens reach an image not yet encoded are encoded together (one
``encode_images`` call for the step), and each image token of the batch takes its row of its
request's embeddings (kept on the request, so a prompt prefilled in chunks is encoded once).
Tokens after the prompt rotate at ``position + mrope_delta`` in all three M-RoPE rows, which is
plain rotary at that position: a decode batch needs no ``[3, T]`` table, so its CUDA graph serves it.
"""

from __future__ import annotations

from typing import Any, Sequence

import structlog
import torch

from core.engine.multimodal import ImageInputs
from core.errors import InvalidRequest, ModelLoadError

log = structlog.get_logger("core.engine.multimodal")

PROCESSOR_KIND = "multimodal_processor"  # the plugin kind (hook register_multimodal_processors)


class MultimodalServing:
    """One engine's images: its processor, and its model's ``encode_images`` / ``mrope_positions``."""

    def __init__(self, processor: Any, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.processor, self.model, self.device, self.dtype = processor, model, device, dtype
        self.mrope = hasattr(model, "mrope_positions")
        self.max_images = getattr(processor, "max_images", None)

    def prepare(self, prompt: str | list[int], images: list) -> ImageInputs:
        """The request's token ids and images as the model takes them; InvalidRequest for too many."""
        if self.max_images is not None and len(images) > self.max_images:
            raise InvalidRequest(f"the request has {len(images)} images; at most {self.max_images} per request",
                                 param="image_data")
        inputs = self.processor.process(prompt, images)
        if self.mrope:
            inputs.mrope_positions, inputs.mrope_delta = self.model.mrope_positions(inputs.input_ids,
                                                                                    inputs.image_grid_thw)
        return inputs

    def forward_inputs(self, reqs: Sequence[Any], starts: Sequence[int], extend_lens: Sequence[int],
                       positions: list[int]) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None,
                                                      torch.Tensor | None]:
        """(rotary positions, mm_rows, mm_embeds, mrope_positions) of a forward whose request ``i``
        adds ``extend_lens[i]`` tokens from sequence position ``starts[i]``; ``positions`` are the
        batch's (plain) positions, returned shifted by each image request's delta past its prompt."""
        # (the n > 1 copies of a request share one ImageInputs: each is encoded once)
        todo = {id(r.mm): r.mm for r, s, n in zip(reqs, starts, extend_lens)
                if r.mm is not None and r.mm.embeds is None and _touches_image(r.mm, s, n)}
        if todo:
            self._encode(list(todo.values()))
        rows: list[int] = []
        picks: list[torch.Tensor] = []
        prompt_cols: list[tuple[int, int, int, ImageInputs]] = []  # (batch column, from, to, inputs)
        out_pos = positions
        offset = 0
        for r, s, n in zip(reqs, starts, extend_lens):
            mm = r.mm
            if mm is not None:
                for (a, length), first in zip(mm.spans, _span_starts(mm)):
                    lo, hi = max(a, s), min(a + length, s + n)
                    if lo < hi:
                        rows.extend(range(offset + lo - s, offset + hi - s))
                        picks.append(mm.embeds[first + lo - a : first + hi - a])
                if self.mrope:
                    L = len(mm.input_ids)
                    if s < L:  # prompt tokens: the model's [3, L] table
                        prompt_cols.append((offset, s, min(s + n, L), mm))
                    if mm.mrope_delta and s + n > L:  # past the prompt: position + delta in every row
                        if out_pos is positions:
                            out_pos = list(positions)
                        for j in range(max(0, L - s), n):
                            out_pos[offset + j] = positions[offset + j] + mm.mrope_delta  # (a tree node: its depth)
            offset += n
        table = None
        if prompt_cols:
            table = torch.tensor(out_pos, dtype=torch.int64).expand(3, -1).clone()
            for col, a, b, mm in prompt_cols:
                table[:, col : col + b - a] = mm.mrope_positions[:, a:b]
            table = table.to(self.device)
        if not rows:
            return out_pos, None, None, table
        mm_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return out_pos, mm_rows, torch.cat(picks).to(self.device), table

    def _encode(self, batch: list[ImageInputs]) -> None:
        """One ``encode_images`` call for these requests' images; each keeps its rows."""
        pixels = torch.cat([mm.pixel_values for mm in batch]).to(self.device, self.dtype)
        grids = None if batch[0].image_grid_thw is None else torch.cat([mm.image_grid_thw for mm in batch])
        with torch.inference_mode():
            out = self.model.encode_images(pixels, None if grids is None else grids.to(self.device))
        sizes = [sum(n for _, n in mm.spans) for mm in batch]
        if out.shape[0] != sum(sizes):
            raise RuntimeError(f"the vision tower gave {out.shape[0]} image tokens for {sum(sizes)} placeholders")
        for mm, part in zip(batch, out.split(sizes)):
            mm.embeds = part


def _touches_image(mm: ImageInputs, start: int, n: int) -> bool:
    return any(a < start + n and start < a + length for a, length in mm.spans)


def _span_starts(mm: ImageInputs) -> list[int]:
    """Each image's first row in ``mm.embeds`` (images in span order)."""
    out, acc = [], 0
    for _, n in mm.spans:
        out.append(acc)
        acc += n
    return out


def attach_multimodal(engine: Any) -> MultimodalServing | None:
    """The engine's images, when its architecture has a registered multimodal processor and
    ``--enable-multimodal`` is not false (SGLang: on by default for such models; for a text-only
    model the flag does nothing, logged once)."""
    args, mc = engine.args, engine.model_config
    arch = mc.architecture
    known = arch in engine.plugins.names(PROCESSOR_KIND)
    if not known or args.enable_multimodal is False:
        if args.enable_multimodal and not known:
            log.info("multimodal.text_only", architecture=arch, note="--enable-multimodal has no effect")
        return None
    from core.engine.multimodal.images import MediaPolicy

    try:
        MediaPolicy.from_args(args)  # (the media flags, checked at start-up rather than in every request)
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"--limit-mm-data-per-request must be JSON such as '{{\"image\": 4}}': {e}") from e
    if not hasattr(engine.model, "encode_images"):
        raise ModelLoadError(f"the model plugin of {arch} has no encode_images: it cannot take images")
    factory = engine.plugins.resolve(PROCESSOR_KIND, arch)
    mm = MultimodalServing(factory(str(mc.path), mc.hf_config, engine.tokenizer), engine.model, engine.device, mc.dtype)
    engine.runner.mm = mm
    log.info("multimodal.ready", architecture=arch, mrope=mm.mrope, max_images=mm.max_images)
    return mm
