"""Helpers for multimodal processors (plugin kind ``multimodal_processor``): splicing each
image's tokens into a prompt in place of its placeholder."""

from __future__ import annotations

from core.errors import InvalidRequest


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
