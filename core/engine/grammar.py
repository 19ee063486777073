"""Constrained decoding: compile cache, per-request matchers, the batch token bitmask.

The grammar backend itself is a plugin (``--grammar-backend``, default ``xgrammar``;
``none`` disables constrained decoding). This module owns what is backend-independent:

* ``GrammarManager.compile(kind, spec)`` compiles on a small thread pool (never on the
  event loop) and caches the compiled prototype by ``(backend, kind, spec)``; concurrent
  requests for the same spec share one compilation. Every request gets its own matcher
  (``prototype.copy()``), so n > 1 and identical specs never share state.
* ``GrammarManager.apply(logits, reqs)`` runs on the forward thread: it fills one
  ``[B, ceil(V/32)]`` int32 bitmask for the whole batch (all-ones for unconstrained rows)
  and applies it to the logits in one vectorised op before sampling.
* ``GrammarManager.accept(reqs, tokens)`` advances each constrained request's matcher with
  its sampled token; the scheduler finishes a request whose grammar terminated, and aborts one
  whose grammar rejected the token (a dead end: the mask allowed nothing).
* A request whose output reasons first (``SamplingParams.reasoning_gate``, set by the chat
  server from its reasoning parser) gets its matcher wrapped in :class:`AfterReasoning`: the
  reasoning runs free and the grammar holds what follows its end tag, as SGLang's and vLLM's
  reasoning parsers do with structured output.

SGLang's JSON whitespace flags reach the backend as constructor keywords, passed only when set:
a backend honours a flag by taking its keyword, and one that does not is refused at start-up
(``check_json_whitespace``) rather than left to ignore it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import re
import threading
from typing import Any

import attrs
import structlog
import torch

from core.errors import CoreError, InvalidRequest
from core.interfaces import apply_token_bitmask

__all__ = ["GrammarManager", "apply_token_bitmask", "DEFAULT_GRAMMAR_BACKEND", "ReasoningGate", "AfterReasoning"]

log = structlog.get_logger("core.engine.grammar")

DEFAULT_GRAMMAR_BACKEND = "xgrammar"
CACHE_SIZE = 512
# the JSON whitespace flags: EngineArgs field -> (backend keyword, the built-in backends that take it)
JSON_WHITESPACE_FLAGS = {"constrained_json_disable_any_whitespace": ("any_whitespace", "xgrammar or llguidance"),
                         "constrained_json_whitespace_pattern": ("whitespace_pattern", "llguidance"),
                         "constrained_json_max_whitespace_cnt": ("max_whitespace_cnt", "xgrammar")}


# The per-request JSON keywords a backend's compile may take -> the built-in backends that take them
JSON_REQUEST_OPTIONS = {"any_whitespace": "xgrammar or llguidance", "whitespace_pattern": "llguidance"}


def json_whitespace_options(args: Any) -> dict[str, Any]:
    """The backend keywords the JSON whitespace flags ask for; empty when they are unset."""
    opts: dict[str, Any] = {}
    if getattr(args, "constrained_json_disable_any_whitespace", False):
        opts["any_whitespace"] = False
    if (pattern := getattr(args, "constrained_json_whitespace_pattern", None)) is not None:
        opts["whitespace_pattern"] = pattern
    if (most := getattr(args, "constrained_json_max_whitespace_cnt", None)) is not None:
        opts["max_whitespace_cnt"] = most
    return opts


def check_json_whitespace(plugins: Any, name: str | None, opts: dict[str, Any]) -> None:
    """Refuse a JSON whitespace flag the grammar backend ``name`` cannot honour (it does not take
    the flag's keyword, or there is no backend), naming the flag and the backends that can."""
    name = name or DEFAULT_GRAMMAR_BACKEND
    if not opts:
        return
    params = {} if name == "none" else inspect.signature(plugins.resolve("grammar_backend", name)).parameters
    for field, (keyword, able) in JSON_WHITESPACE_FLAGS.items():
        if keyword in opts and keyword not in params:
            raise CoreError(f"--{field.replace('_', '-')} is not supported by --grammar-backend {name}; "
                            f"use --grammar-backend {able}")
    if (most := opts.get("max_whitespace_cnt")) is not None and most < 1:
        raise CoreError(f"--constrained-json-max-whitespace-cnt must be >= 1, got {most} (to allow no whitespace, "
                        "pass --constrained-json-disable-any-whitespace)")
    if (pattern := opts.get("whitespace_pattern")) is not None:
        try:
            re.compile(pattern)
        except re.error as e:
            raise CoreError(f"--constrained-json-whitespace-pattern {pattern!r} is not a regular expression: {e}") from None


class GrammarManager:
    """The engine's side of constrained decoding over one grammar backend plugin (or none)."""

    def __init__(self, plugins: Any, name: str | None, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...],
                 json_whitespace: dict[str, Any] | None = None) -> None:
        """``json_whitespace``: ``json_whitespace_options`` of the engine's args (refused here when
        the backend cannot honour them)."""
        self.name = name or DEFAULT_GRAMMAR_BACKEND
        self.vocab_size = vocab_size
        self.backend = None
        check_json_whitespace(plugins, self.name, json_whitespace or {})
        if self.name != "none" and tokenizer is not None:
            factory = plugins.resolve("grammar_backend", self.name)
            self.backend = factory(tokenizer, vocab_size, stop_token_ids=list(eos_ids), **(json_whitespace or {}))
        self._cache: collections.OrderedDict[tuple[str, str, str, tuple], concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="core-grammar")

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    def _future(self, kind: str, spec: str, options: tuple = ()) -> concurrent.futures.Future:
        key = (self.name, kind, spec, options)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile_checked, kind, spec, dict(options))
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _compile_checked(self, kind: str, spec: str, options: dict[str, Any]) -> Any:
        """Compile, and refuse a grammar whose start allows no token at all (``root ::= root``):
        decoding it could only emit tokens the grammar rejects."""
        proto = self.backend.compile(kind, spec, **options)
        probe = proto.copy()
        if not probe.is_terminated():
            bitmask = self.backend.allocate_bitmask(1)
            bitmask.zero_()
            probe.fill_bitmask(bitmask, 0)
            if not bool(bitmask.any()):
                raise ValueError("the grammar accepts no output (no token can start it)")
        return proto

    async def compile(self, kind: str, spec: str, options: dict[str, Any] | None = None) -> Any:
        """A fresh matcher for (kind, spec); compilation runs off the loop and is cached.
        An invalid spec raises InvalidRequest carrying the backend's message. ``options``: a JSON
        schema's whitespace keywords for this request (``any_whitespace``, ``whitespace_pattern``:
        vLLM's per-request options), passed to the backend's ``compile`` where it takes them."""
        if self.backend is None:
            raise InvalidRequest(f"{kind} constraints need a grammar backend, but the server runs with "
                                 f"--grammar-backend none", param=kind)
        options = options if kind == "json_schema" else None  # (vLLM's options shape JSON only)
        if options:
            takes = inspect.signature(self.backend.compile).parameters
            for keyword in options:
                if keyword not in takes:
                    raise InvalidRequest(f"a per-request {keyword} is not supported by --grammar-backend {self.name}"
                                         f"; use --grammar-backend {JSON_REQUEST_OPTIONS[keyword]}", param=keyword)
        try:
            proto = await asyncio.wrap_future(self._future(kind, spec, tuple(sorted((options or {}).items()))))
        except (ValueError, RuntimeError, TypeError) as e:
            raise InvalidRequest(f"invalid {kind}: {e}", param=kind) from None
        return proto.copy()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- forward thread
    def apply(self, logits: torch.Tensor, reqs: list[Any]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.grammar.is_terminated()]
        if not rows or self.backend is None:
            return
        bitmask = self.backend.allocate_bitmask(len(reqs))
        bitmask.fill_(-1)
        for i in rows:
            reqs[i].grammar.fill_bitmask(bitmask, i)
        self.backend.apply_bitmask(logits, bitmask)

    def accept(self, reqs: list[Any], tokens: list[int]) -> None:
        for r, tok in zip(reqs, tokens):
            g = r.grammar
            if g is None or g.is_terminated() or r.finished or r.params.max_new_tokens == 0:
                continue
            if not g.accept_token(tok):  # the mask left nothing the grammar takes: end the request, say why
                log.warning("grammar.token_rejected", rid=r.rid, token=tok)
                r.aborted, r.abort_message = True, "the grammar allows no further token"


@attrs.frozen
class ReasoningGate:
    """Where a constraint starts in an output that reasons first: after ``end_ids`` (the reasoning
    parser's end tag, tokenized). ``start_ids``: its start tag where the output may also answer at
    once (Qwen3's ``<think>``): while the output so far can still open the tag and still be the
    answer's start, both go on (the mask allows the tag's next token and the grammar's); the tag
    complete, the reasoning runs; the output leaving the tag, the grammar holds all of it. Empty
    where the output starts inside the reasoning (the prompt opened it)."""

    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()


class AfterReasoning:
    """A matcher (``core.interfaces.Grammar``) over ``inner`` that lets the reasoning through
    unconstrained and holds the answer after it to ``inner``."""

    def __init__(self, inner: Any, gate: ReasoningGate) -> None:
        self.inner, self.gate = inner, gate
        self.state = "open" if gate.start_ids else "think"  # open -> think -> answer, or open -> answer
        self.opened = 0  # tokens of the output so far, while it may still be the start tag
        self.answer_alive = True  # while opening: ``inner`` has taken every token so far
        self.pristine = inner.copy() if gate.start_ids else None  # the grammar's start, for after the tag
        self.tail: tuple[int, ...] = ()  # the reasoning's last tokens, for the end tag

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.state == "answer":
            self.inner.fill_bitmask(bitmask, index)
        elif self.state == "open":  # the start tag's next token, and the grammar's while it holds
            if self.answer_alive:
                self.inner.fill_bitmask(bitmask, index)
            else:
                bitmask[index].zero_()
            tok = self.gate.start_ids[self.opened]
            word = int(bitmask[index, tok // 32]) | (1 << tok % 32)
            bitmask[index, tok // 32] = word - (1 << 32) if word >= 1 << 31 else word
        # (thinking: the row stays all allowed)

    def accept_token(self, token_id: int) -> bool:
        if self.state == "answer":
            return self.inner.accept_token(token_id)
        if self.state == "open":
            self.answer_alive = self.answer_alive and self.inner.accept_token(token_id)
            if token_id == self.gate.start_ids[self.opened]:
                self.opened += 1
                if self.opened == len(self.gate.start_ids):  # the tag: reasoning, the grammar from the start after it
                    self.state, self.inner = "think", self.pristine
                return True
            self.state = "answer"
            return self.answer_alive
        end = self.gate.end_ids
        self.tail = (self.tail + (token_id,))[-len(end):]
        if self.tail == end:
            self.state = "answer"
        return True

    def is_terminated(self) -> bool:
        return self.state == "answer" and self.inner.is_terminated()

    def copy(self) -> AfterReasoning:
        return AfterReasoning(self.inner.copy(), self.gate)
