"""The multimodal processor suite: what the engine relies on of a processor's ``ImageInputs``.

A processor is built for one model (its folder, config and tokenizer), so the subject is a built
processor (the ``multimodal_processor`` fixture returns it, or a zero-argument factory); from the
command line, where no model is at hand, the cases are skipped. Prompts are token ids with the
processor's ``image_token_id`` as each image's placeholder, and seeded random images of different
sizes. The cases check: each image's placeholder becomes its span and every other token stays, in
order; spans, hashes and images agree in number and spans lie inside the ids without overlapping
(``expansion``); the pixel tensors match the images (``pixels``: one row per patch of
``image_grid_thw``, else one entry per image); the same image hashes the same and one changed
pixel changes its hash (``hashes``); a prompt whose placeholders do not match the images one to
one is an ``InvalidRequest`` (``count_mismatch``); processing is deterministic (``deterministic``).
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import torch

from core.errors import InvalidRequest
from core.testing.suite import Case, Skipped, fail, seed_for

KIND = "multimodal_processor"
SIZES = ((40, 30), (70, 45), (28, 90))


@attrs.define
class ProcessorSubject:
    processor: Any
    label: str
    kind: str = KIND

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None) -> ProcessorSubject:
        """``target``: a built processor, or a zero-argument factory of one. A registered name alone
        cannot be built (a processor needs its model's folder, config and tokenizer)."""
        if isinstance(target, str):
            raise Skipped(f"{KIND} {target!r}: a processor is built for a model; run the pytest suite with a "
                          "`multimodal_processor` fixture that builds it")
        proc = target() if callable(target) and not hasattr(target, "process") else target
        return cls(proc, type(proc).__name__)


def _image(size: tuple[int, int], rng: random.Random) -> Any:
    from PIL import Image

    w, h = size
    return Image.frombytes("RGB", (w, h), rng.randbytes(w * h * 3))


def _prompt(s: ProcessorSubject, images: int, rng: random.Random) -> list[int]:
    """Token ids: a few text tokens around each placeholder (ids below 100: plain tokens in any vocabulary)."""
    ids = [rng.randrange(3, 100) for _ in range(3)]
    for _ in range(images):
        ids += [s.processor.image_token_id] + [rng.randrange(3, 100) for _ in range(2)]
    return ids


def _expansion(s: ProcessorSubject, rng: random.Random) -> None:
    images = [_image(size, rng) for size in SIZES[:2]]
    ids = _prompt(s, 2, rng)
    out = s.processor.process(ids, images)
    if not (len(out.spans) == len(out.hashes) == len(images)):
        raise fail(s, "expansion", f"{len(images)} images gave {len(out.spans)} spans and {len(out.hashes)} hashes")
    end = 0
    for a, n in out.spans:
        if a < end or n <= 0 or a + n > len(out.input_ids):
            raise fail(s, "expansion", f"spans {out.spans} overlap, are empty or run past the {len(out.input_ids)} ids")
        end = a + n
    covered = {j for a, n in out.spans for j in range(a, a + n)}
    rest = [t for j, t in enumerate(out.input_ids) if j not in covered]
    want = [t for t in ids if t != s.processor.image_token_id]
    if rest != want:
        raise fail(s, "expansion", f"outside the spans the ids are {rest}, not the prompt's other tokens {want}")


def _pixels(s: ProcessorSubject, rng: random.Random) -> None:
    images = [_image(size, rng) for size in SIZES]
    out = s.processor.process(_prompt(s, 3, rng), images)
    if not isinstance(out.pixel_values, torch.Tensor):
        raise fail(s, "pixels", f"pixel_values is a {type(out.pixel_values).__name__}, not a tensor")
    grid = out.image_grid_thw
    if grid is not None:
        if tuple(grid.shape) != (len(images), 3):
            raise fail(s, "pixels", f"image_grid_thw has shape {tuple(grid.shape)}, not ({len(images)}, 3)")
        if int(grid.prod(-1).sum()) != out.pixel_values.shape[0]:
            raise fail(s, "pixels", f"image_grid_thw counts {int(grid.prod(-1).sum())} patches, pixel_values has "
                                    f"{out.pixel_values.shape[0]} rows")
    elif out.pixel_values.shape[0] != len(images):
        raise fail(s, "pixels", f"{len(images)} images gave pixel_values of {out.pixel_values.shape[0]} entries")


def _hashes(s: ProcessorSubject, rng: random.Random) -> None:
    img = _image(SIZES[0], rng)
    other = img.copy()
    other.putpixel((0, 0), tuple((c + 1) % 256 for c in img.getpixel((0, 0))))
    out = s.processor.process(_prompt(s, 3, rng), [img, img.copy(), other])
    if out.hashes[0] != out.hashes[1]:
        raise fail(s, "hashes", "two copies of one image hash differently (a repeated image would miss the cache)")
    if out.hashes[0] == out.hashes[2]:
        raise fail(s, "hashes", "images differing in one pixel hash the same (they would share cached KV)")


def _count_mismatch(s: ProcessorSubject, rng: random.Random) -> None:
    for placeholders, count in ((1, 2), (2, 1)):
        try:
            s.processor.process(_prompt(s, placeholders, rng), [_image(SIZES[0], rng) for _ in range(count)])
        except InvalidRequest:
            continue
        except Exception as e:  # noqa: BLE001
            raise fail(s, "count_mismatch", f"{placeholders} placeholders and {count} images raised "
                                            f"{type(e).__name__}: {e}, not InvalidRequest") from e
        raise fail(s, "count_mismatch", f"{placeholders} placeholders and {count} images were accepted")


def _deterministic(s: ProcessorSubject, rng: random.Random) -> None:
    ids, images = _prompt(s, 2, rng), [_image(size, rng) for size in SIZES[:2]]
    a, b = s.processor.process(ids, images), s.processor.process(list(ids), [im.copy() for im in images])
    if a.input_ids != b.input_ids or a.spans != b.spans or a.hashes != b.hashes or not torch.equal(a.pixel_values,
                                                                                                   b.pixel_values):
        raise fail(s, "deterministic", "the same prompt and images gave different outputs")


def _seeded(name: str, fn: Any) -> Any:
    return lambda s: fn(s, random.Random(seed_for(KIND, s.label, name)))


def multimodal_processor_cases() -> list[Case]:
    return [Case(name, _seeded(name, fn), fn.__doc__ or "") for name, fn in (
        ("expansion", _expansion), ("pixels", _pixels), ("hashes", _hashes), ("count_mismatch", _count_mismatch),
        ("deterministic", _deterministic))]
