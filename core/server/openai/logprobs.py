"""Logprobs in OpenAI's shapes: chat's ``content[{token, logprob, bytes, top_logprobs}]`` and
completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``.

Token text comes from the vocabulary, not from decoding each token alone: byte-level BPE pieces
(GPT-2's byte table) and SentencePiece ``<0xNN>`` byte tokens map back to their exact bytes, so
``bytes`` is right even for a token that is part of a multi-byte character. ``text_offset``
counts characters of the decoded bytes so far.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from typing import Any

from core.server.openai.protocol import ChatTokenLogprob, ChoiceLogprobs, CompletionLogprobs, TopLogprob


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character table used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")
    except Exception:
        return False
    return "ByteLevel" in json.dumps(spec)


class Vocab:
    """token id -> (display string, UTF-8 bytes), cached, for logprob entries."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.byte_level = tokenizer is not None and _is_byte_level(tokenizer)
        self.cache: dict[int, tuple[str, bytes]] = {}

    def get(self, tid: int) -> tuple[str, bytes]:
        hit = self.cache.get(tid)
        if hit is not None:
            return hit
        if self.tok is None:
            res = (f"token_id:{tid}", b"")
        else:
            piece = self.tok.convert_ids_to_tokens(tid)
            raw: bytes | None = None
            if isinstance(piece, str) and piece:
                if self.byte_level and all(c in _BYTE_DECODER for c in piece):
                    raw = bytes(_BYTE_DECODER[c] for c in piece)
                elif (m := _HEX_BYTE.match(piece)) is not None:
                    raw = bytes([int(m.group(1), 16)])
            if raw is None:
                text = self.tok.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                if isinstance(piece, str) and piece.startswith("\u2581") and text == piece.replace("\u2581", " ")[1:]:
                    text = " " + text  # a SentencePiece word start: decoding it alone strips its space
                res = (text, text.encode("utf-8"))
            else:
                res = (raw.decode("utf-8", errors="replace"), raw)
        self.cache[tid] = res
        return res


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocab_of(engine: Any) -> Vocab:
    """The engine's Vocab (one per engine, built on first use)."""
    v = _VOCABS.get(engine)
    if v is None:
        v = _VOCABS[engine] = Vocab(engine.tokenizer)
    return v


class Offsets:
    """Character offsets of tokens in the decoded text (completions' ``text_offset``)."""

    def __init__(self) -> None:
        self.pos = 0
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, raw: bytes) -> int:
        at = self.pos
        self.pos += len(self.dec.decode(raw))
        return at


def chat_logprobs(vocab: Vocab, meta: dict, start: int, top: int) -> ChoiceLogprobs:
    """Chat logprobs of output tokens ``start:`` with ``top`` alternatives each."""
    toks = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    content = []
    for k in range(start, len(toks)):
        lp, tid, _ = toks[k]
        s, raw = vocab.get(tid)
        alts = []
        if top and k < len(tops):
            for alp, atid, _ in (tops[k] or [])[:top]:
                a, araw = vocab.get(atid)
                alts.append(TopLogprob(a, alp, list(araw)))
        content.append(ChatTokenLogprob(s, lp, list(raw), alts))
    return ChoiceLogprobs(content=content)


def add_completion_logprobs(vocab: Vocab, pairs: list, tops: list | None, top: int, offsets: Offsets,
                            into: CompletionLogprobs) -> None:
    """Append (logprob, token id, text) ``pairs`` (with their ``tops``, as ``Req.meta_info`` has them) to
    completions' logprobs ``into``."""
    for k, (lp, tid, _) in enumerate(pairs):
        s, raw = vocab.get(tid)
        into.tokens.append(s)
        into.token_logprobs.append(lp)
        into.text_offset.append(offsets.add(raw))
        entry = tops[k] if tops is not None and k < len(tops) else None
        if lp is None:  # the first prompt token has no logprob
            into.top_logprobs.append(None)
        else:
            d: dict[str, float | None] = {}
            for alp, atid, _ in (entry or [])[:top]:
                d.setdefault(vocab.get(atid)[0], alp)
            into.top_logprobs.append(d)


def completion_logprobs(vocab: Vocab, meta: dict, start: int, top: int, offsets: Offsets,
                        with_prompt: bool) -> CompletionLogprobs:
    """Completions logprobs of output tokens ``start:``, preceded by the prompt's (``echo``) when asked."""
    lp = CompletionLogprobs()
    if with_prompt:
        add_completion_logprobs(vocab, meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs"), top,
                                offsets, lp)
    toks = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs")
    add_completion_logprobs(vocab, toks[start:], None if tops is None else tops[start:], top, offsets, lp)
    return lp
