"""The ``llguidance`` grammar backend: JSON schema, regex and EBNF / Lark grammars."""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from core.interfaces import apply_token_bitmask

_FORMATS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "grammar"}


class LLGuidanceGrammar:
    def __init__(self, tokenizer, grammar: str) -> None:
        self.tokenizer, self.grammar = tokenizer, grammar
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id))

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def copy(self) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self.tokenizer, self.grammar)


class LLGuidanceBackend:
    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: list[int] | None = None,
                 any_whitespace: bool = True, whitespace_pattern: str | None = None) -> None:
        """``any_whitespace`` False: compact JSON; ``whitespace_pattern``: the regex JSON's whitespace
        follows instead (SGLang's --constrained-json-* flags; llguidance's JSON options)."""
        self.vocab_size = vocab_size
        self.json_options = ({"whitespace_flexible": any_whitespace, "whitespace_pattern": whitespace_pattern}
                             if not any_whitespace or whitespace_pattern is not None else None)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids or None)
        except TypeError:
            # llguidance before 1.6 (which guidance 0.3 pins) takes one end token: the grammar may then end
            # only on the first stop token; the others still stop generation outside the grammar
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids[0] if stop_token_ids else None)

    def compile(self, kind: str, spec: str, *, any_whitespace: bool | None = None,
                whitespace_pattern: str | None = None) -> LLGuidanceGrammar:
        """``any_whitespace`` / ``whitespace_pattern``: this request's JSON whitespace (vLLM's
        ``disable_any_whitespace``, ``whitespace_pattern``), over the server's."""
        fmt = _FORMATS.get(kind)
        if fmt is None:
            raise ValueError(f"the llguidance backend does not support {kind} constraints")
        options = self.json_options
        if any_whitespace is not None or whitespace_pattern is not None:
            options = dict(options or {"whitespace_flexible": True, "whitespace_pattern": None})
            if any_whitespace is not None:
                options["whitespace_flexible"] = any_whitespace
            if whitespace_pattern is not None:
                options["whitespace_pattern"] = whitespace_pattern
        try:
            if fmt == "json_schema" and options is not None:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=options)
            else:
                grammar = llguidance.grammar_from(fmt, spec)
        except Exception as e:
            raise ValueError(str(e)) from None
        ok, err = _validate(grammar, self.tokenizer)
        if not ok:
            raise ValueError(err)
        g = LLGuidanceGrammar(self.tokenizer, grammar)
        if g.matcher.is_error():
            raise ValueError(g.matcher.get_error())
        return g

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return llguidance.torch.allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        apply_token_bitmask(logits, bitmask)


def _validate(grammar: str, tokenizer) -> tuple[bool, str]:
    res = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if isinstance(res, tuple):  # (is_error, messages) in some versions
        is_err, msgs = res
        return (not is_err), "; ".join(msgs) if isinstance(msgs, list) else str(msgs)
    return (not res), str(res or "")
