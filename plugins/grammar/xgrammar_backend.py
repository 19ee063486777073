"""The ``xgrammar`` grammar backend: JSON schema, regex, EBNF (GBNF) and structural tags."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from core.interfaces import apply_token_bitmask


class XGrammarGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiled)


class XGrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: list[int] | None = None,
                 any_whitespace: bool = True, max_whitespace_cnt: int | None = None) -> None:
        """``any_whitespace`` False: JSON schemas compile to compact JSON (--constrained-json-disable-any-whitespace);
        ``max_whitespace_cnt``: at most that many whitespace characters in a row (--constrained-json-max-whitespace-cnt)."""
        self.vocab_size, self.any_whitespace, self.max_whitespace_cnt = vocab_size, any_whitespace, max_whitespace_cnt
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, kind: str, spec: str, *, any_whitespace: bool | None = None) -> XGrammarGrammar:
        """``any_whitespace``: this request's (vLLM's ``disable_any_whitespace``), else the server's."""
        try:
            if kind == "json_schema":
                ws = self.any_whitespace if any_whitespace is None else any_whitespace
                compiled = self.compiler.compile_json_schema(spec, any_whitespace=ws,
                                                          max_whitespace_cnt=self.max_whitespace_cnt)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(spec)
            elif kind == "ebnf":
                compiled = self.compiler.compile_grammar(spec)
            elif kind == "structural_tag":
                compiled = self._structural_tag(spec)
            else:
                raise ValueError(f"unknown constraint kind {kind!r}")
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / its own errors for bad specs
            raise ValueError(_clean(str(e)) or type(e).__name__) from None
        return XGrammarGrammar(compiled)

    def _structural_tag(self, spec: str) -> xgr.CompiledGrammar:
        obj = json.loads(spec)
        if isinstance(obj, dict) and "structures" in obj:  # SGLang's / OpenAI-style legacy format
            tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                    for s in obj["structures"]]
            return self.compiler.compile_structural_tag(tags, obj.get("triggers") or [s["begin"] for s in obj["structures"]])
        return self.compiler.compile_structural_tag(spec)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        if logits.device.type == "cpu":
            apply_token_bitmask(logits, bitmask)
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(msg: str) -> str:
    """Drop xgrammar's C++ log prefix ("[12:00:00] /project/cpp/x.cc:83: ")."""
    return _LOG_PREFIX.sub("", msg.strip())
