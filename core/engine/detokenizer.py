"""Incremental (streaming) detokenization with stop-string handling.

Two layers:

* token -> text: the prefix_offset / read_offset technique (as in vLLM / SGLang). Only a small
  window of recent ids is decoded each step, and text is held back while it ends in U+FFFD, so a
  character whose UTF-8 bytes span several tokens (byte-level BPE or ``<0xNN>`` byte fallback) is
  emitted once, when complete.
* text -> emitted text: stop strings. The longest suffix that could still grow into a stop string
  is held back, so a stop that later matches is never partly streamed. ``stop_regex`` patterns
  (SGLang's) are searched in the output after each step; their match stays in the text, as in
  SGLang, so nothing is held back for them.
"""

from __future__ import annotations

import re
import re._parser as re_parser
from collections.abc import Sequence
from typing import Any

# Prompt tokens used as left context, so the first generated token's leading space is decoded as it
# would be mid-sentence (SentencePiece decoders strip a leading space at the start of a decode).
_PROMPT_CONTEXT = 5


def backend_decode(tokenizer: Any) -> Any:
    """The Rust ``tokenizers`` decode behind a transformers fast tokenizer whose ``decode`` is the
    stock one (what it returns with ``clean_up_tokenization_spaces=False``: 0.8 us a call against
    2.5 us through transformers' wrapper, twice per token of every stream), else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is None or not isinstance(tokenizer, TokenizersBackend) or cls._decode is not TokenizersBackend._decode
            or cls.decode is not PreTrainedTokenizerBase.decode):
        return None
    return backend.decode


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops: the named specials plus added
    tokens flagged special (e.g. SmolLM2's ``<repo_name>`` is not in ``all_special_ids``)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of stable text deltas for one request."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        stop_regex: Sequence[str] = (),
    ) -> None:
        self._tok = tokenizer
        self._fast_decode = backend_decode(tokenizer)
        self._skip = skip_special_tokens
        self._special = special_token_ids(tokenizer)
        # Fast tokenizers ignore spaces_between_special_tokens, so emulate HF's slow behaviour by
        # decoding the text between special tokens as separate segments joined with " ".
        self._segment = not skip_special_tokens and spaces_between_special_tokens
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._no_stop_trim = no_stop_trim
        # (pattern text, compiled, the longest text it can match: a new match starts at most that
        # far before the text it was not found in)
        self._regex = [(p, re.compile(p), re_parser.parse(p).getwidth()[1]) for p in stop_regex if p]
        self._searched = 0  # output characters the patterns were last searched up to
        self._parts: list[str] = []  # emitted deltas; joined lazily so streaming stays O(delta)
        self.matched_stop: str | None = None
        self._pending = ""  # decoded text not yet emitted (could be the start of a stop string)
        self._done = False
        self._had_sub_text = False  # segment mode: a special token must be preceded by " "
        self._after_special = False  # segment mode: the next text token must be preceded by " "
        ctx = list(prompt_ids[-_PROMPT_CONTEXT:])
        if self._skip:
            ctx = [t for t in ctx if t not in self._special]
        elif self._segment:
            cut = max((i + 1 for i, t in enumerate(ctx) if t in self._special), default=0)
            ctx = ctx[cut:]
        self._reset_window(ctx)

    # ---- token -> text -------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self._skip)
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def _reset_window(self, ctx: list[int]) -> None:
        """Window = already-emitted context ids followed by ids whose text is not yet stable."""
        self._ids = ctx
        self._read = len(ctx)
        self._prefix_text = self._decode(ctx)

    def _window_delta(self, force: bool) -> str:
        """Text the not-yet-read ids add to the window, or '' while it ends in an incomplete char."""
        if self._read == len(self._ids):
            return ""
        full = self._decode(self._ids)
        if not force and (len(full) <= len(self._prefix_text) or full.endswith("\ufffd")):
            return ""
        delta = full[len(self._prefix_text) :]
        self._reset_window(self._ids[self._read :])  # the just-read ids become the next context
        return delta

    def _tokens_to_text(self, token_ids: Sequence[int]) -> str:
        out: list[str] = []
        for t in token_ids:
            if t in self._special:
                if self._skip:
                    continue  # dropped, and text on both sides joins as in a single decode
                if self._segment:
                    out.append(self._window_delta(force=True))  # close the segment, as HF does
                    out.append((" " if self._had_sub_text else "") + self._tok.convert_ids_to_tokens(t))
                    self._had_sub_text = self._after_special = True
                    self._reset_window([])
                    continue
            elif self._segment:
                if self._after_special:  # first token of a new text segment
                    out.append(" ")
                    self._after_special = False
                self._had_sub_text = True
            self._ids.append(t)
        out.append(self._window_delta(force=False))
        return "".join(out)

    # ---- text -> emitted text (stop strings) ---------------------------------------------------

    def _emit(self, new_text: str, final: bool) -> str:
        """Append text; find the stop that completes first; hold back a possible stop prefix."""
        buf = self._pending + new_text  # pending < max(len(stop)) chars, so this is a tail search
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            end, start, s = best
            out = buf[: end if self._no_stop_trim else start]
            self.matched_stop, self._pending, self._done = s, "", True
        elif self._regex and not final and (pattern := self._match_regex(buf)) is not None:
            out = buf  # the match stays in the output, as SGLang leaves it
            self.matched_stop, self._pending, self._done = pattern, "", True
        else:
            hold = 0 if final else self._stop_prefix_len(buf)
            out, self._pending = buf[: len(buf) - hold], buf[len(buf) - hold :]
        if out:
            self._parts.append(out)
        return out

    def _match_regex(self, buf: str) -> str | None:
        """The first stop_regex pattern that matches the output (emitted text + ``buf``) in text
        it had not been searched in; earlier text is kept as context for anchors and lookbehinds."""
        full = self.text + buf
        for pattern, compiled, width in self._regex:
            if compiled.search(full, max(0, self._searched - width)) is not None:
                return pattern
        self._searched = len(full)
        return None

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_stop - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    # ---- public API ----------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated token ids; return the newly *stable* text delta (may be '')."""
        if self._done:
            return ""
        return self._emit(self._tokens_to_text(token_ids), final=False)

    def flush(self) -> str:
        """Request ended without a stop string (EOS, length, abort): return all held-back text,
        including an incomplete trailing character as U+FFFD, as a full decode would."""
        if self._done:
            return ""
        out = self._emit(self._window_delta(force=True), final=True)
        self._done = True
        return out
