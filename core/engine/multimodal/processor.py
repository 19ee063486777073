"""Helpers for multimodal processors (plugin kind ``multimodal_processor``): splicing each
image's tokens into a prompt in place of its placeholder."""

from __future__ import annotations

from typing import Any

from core.errors import InvalidRequest, ModelLoadError


def expand_placeholders(ids: list[int], image_token_id: int, counts: list[int],
                        param: str = "image_data") -> tuple[list[int], list[tuple[int, int]]]:
    """``ids`` with the i-th occurrence of ``image_token_id`` repeated ``counts[i]`` times, and
    each image's span (first index, token count) in the result. A prompt whose placeholders do not
    match the images one to one is an :class:`InvalidRequest` naming both counts."""
    where = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(where) != len(counts):
        raise InvalidRequest(f"the prompt has {len(where)} image placeholder{'s' if len(where) != 1 else ''} but "
                             f"{len(counts)} image{'s were' if len(counts) != 1 else ' was'} sent: each image needs "
                             "one placeholder (the chat template puts one per image part)", param=param)
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    prev = 0
    for pos, n in zip(where, counts):
        out += ids[prev:pos]
        spans.append((len(out), n))
        out += [image_token_id] * n
        prev = pos + 1
    out += ids[prev:]
    return out, spans


def image_token_id(tokenizer: Any, token: str, configured: int | None) -> int:
    """The id of the image placeholder ``token``: the tokenizer's (its ``image_token_id``, else the
    token looked up), checked against the model config's ``configured`` id, which stands in where
    there is no tokenizer. ModelLoadError when they disagree or neither names it."""
    found = getattr(tokenizer, "image_token_id", None) if tokenizer is not None else None
    if found is None and tokenizer is not None:
        found = tokenizer.convert_tokens_to_ids(token)
        found = None if found == getattr(tokenizer, "unk_token_id", None) else found
    if found is not None and configured is not None and found != configured:
        raise ModelLoadError(f"the tokenizer's {token} is token {found}, but the model's config has "
                             f"image_token_id {configured}")
    found = found if found is not None else configured
    if found is None:
        raise ModelLoadError(f"neither the tokenizer nor the model's config names the image token {token}")
    return int(found)
