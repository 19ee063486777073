"""Per-request sampling parameters, with SGLang's names and defaults."""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from core.errors import InvalidRequest

CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# Temperatures below this sample greedily (SGLang's _SAMPLING_EPS): dividing logits by a smaller
# one overflows float32 (1/t is inf below ~3e-39, and a float64 subnormal rounds to 0), which
# the sampling kernels cannot take, while the distribution it stands for is already the argmax.
SAMPLING_EPS = 1e-5


def _str_list(s: object) -> object:
    """``stop`` / ``stop_regex`` as a list (one string becomes a list of it); another type is kept
    as it is, for ``validate``'s 400."""
    return [s] if isinstance(s, str) else list(s) if isinstance(s, (list, tuple)) else s or []


def seed_named(d: dict) -> dict:
    """``d`` with SGLang's newer name of the seed, ``sampling_seed``, as ``seed`` (where ``seed``
    itself is not given): a copy."""
    return {("seed" if k == "sampling_seed" and "seed" not in d else k): v for k, v in d.items()}


# the parameters SGLang's preferred_sampling_params may set here (a constraint or n as a default is refused)
PREFERRED_SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                           "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
                           "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "seed",
                           "sampling_seed")


def check_preferred(preferred: dict | None, name: str = "--preferred-sampling-params") -> None:
    """SGLang's ``preferred_sampling_params`` (server-wide values for what a request leaves unset):
    keys among ``PREFERRED_SAMPLING_KEYS``, values sampling parameters accept; else a CoreError
    naming ``name`` (the flag, or the offline Engine's argument)."""
    from core.errors import CoreError

    if not preferred:
        return
    if not isinstance(preferred, dict):
        raise CoreError(f"{name}: a JSON object (dict) of sampling parameters is needed, got {preferred!r}")
    if bad := sorted(set(preferred) - set(PREFERRED_SAMPLING_KEYS)):
        raise CoreError(f"{name}: {', '.join(bad)} cannot be a server default; it may set "
                        f"{', '.join(PREFERRED_SAMPLING_KEYS)}")
    try:
        SamplingParams.from_dict(preferred).validate()
    except InvalidRequest as e:
        raise CoreError(f"{name}: {e}") from None


def under_preferred(preferred: dict | None, d: dict | None) -> dict:
    """A request's sampling dict over ``preferred`` (SGLang's merge: the request's keys win; its
    None values count as unset). Either name of the seed in the request overrides the preferred one."""
    d = {k: v for k, v in (d or {}).items() if v is not None}
    return {**seed_named(preferred), **seed_named(d)} if preferred else d


@attrs.frozen
class ThinkingBudget:
    """At most ``budget`` tokens of reasoning (vLLM's ``thinking_token_budget``, Anthropic's
    ``thinking.budget_tokens``): an output still reasoning after that many tokens is made to
    close it with ``end_ids`` (the reasoning parser's end tag, tokenized). The server sets it
    from the reasoning parser; ``start_ids``: the tag that must open the output for it to be
    reasoning at all (a model that may answer without thinking, e.g. Qwen3; the budget counts the
    tokens after it, as vLLM's), empty where the prompt opened the block."""

    budget: int
    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()

    @property
    def closes_at(self) -> int:
        """The output length at which the end tag is forced (if the reasoning is still open)."""
        return len(self.start_ids) + self.budget

    def forced(self, out: list[int]) -> int | None:
        """The token the next position must take (``out``: the output so far), or None."""
        n, b, end = len(out), self.closes_at, self.end_ids
        if not b <= n < b + len(end) or tuple(out[: len(self.start_ids)]) != self.start_ids:
            return None
        if any(tuple(out[i : i + len(end)]) == end for i in range(b - len(end) + 1)):
            return None  # the reasoning ended within the budget
        return end[n - b] if tuple(out[b:]) == end[: n - b] else None


@attrs.define
class SamplingParams:
    """One request's sampling options; ``from_dict`` for JSON input, ``validate`` before use."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = attrs.field(factory=list, converter=_str_list)
    stop_token_ids: list[int] = attrs.field(factory=list, converter=lambda s: list(s or []))
    # SGLang's stop_regex: generation stops once a pattern matches in the output's tail; the
    # matched text stays in the output (SGLang trims only literal stop strings)
    stop_regex: list[str] = attrs.field(factory=list, converter=_str_list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # token id (a string, as JSON keys are) -> a value in [-100, 100] added to its logit (OpenAI's logit_bias)
    logit_bias: dict[str, float] | None = None
    # constrained decoding (at most one, see constraint(); compiled by core.engine.grammar)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # set by the OpenAI server from vLLM's per-request JSON whitespace options, never from from_dict: the
    # grammar backend's keywords for this request's json_schema (core.engine.grammar.GrammarManager.compile)
    json_options: dict | None = None
    # set by the server from its reasoning parser, never from a request's sampling_params (from_dict)
    thinking: ThinkingBudget | None = None
    # SGLang's custom_params: what the request's custom logit processor reads (core.engine.logit_processor)
    custom_params: dict | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.instance_of(dict)))
    # the request's custom_logit_processor (a top-level field, checked by the front end), never from from_dict
    custom_logit_processor: str | None = None
    # set by the server from its reasoning parser (core.engine.grammar.ReasoningGate), never from from_dict:
    # the constraint holds only the answer after the reasoning
    reasoning_gate: Any = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """Build from a JSON-style dict; unknown keys are an error naming them."""
        d = seed_named(d or {})
        known = {f.name for f in attrs.fields(cls)} - {"thinking", "custom_logit_processor", "reasoning_gate",
                                                       "json_options"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"invalid sampling parameters: {e}") from None

    def bias_items(self, vocab_size: int | None = None) -> list[tuple[int, float]]:
        """``logit_bias`` as (token id, bias) pairs; a bad key or value is an InvalidRequest."""
        bias = self.logit_bias
        if bias is None:
            return []
        if not isinstance(bias, dict):
            raise InvalidRequest(f"logit_bias must be an object of token id -> bias, got {bias!r}", param="logit_bias")
        out = []
        for key, value in bias.items():
            tid = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else None
            if tid is None or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                raise InvalidRequest(f"logit_bias key {key!r} is not a token id" + (
                    f" in [0, {vocab_size})" if vocab_size is not None else ""), param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise InvalidRequest(f"logit_bias values must be numbers in [-100, 100], got {value!r}", param="logit_bias")
            out.append((tid, float(value)))
        return out

    @property
    def is_greedy(self) -> bool:
        """Whether the row takes the argmax: temperature below SAMPLING_EPS (0 included) or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def constraint(self) -> tuple[str, str] | None:
        """The (kind, spec) these params constrain the output to, or None; a dict spec becomes
        its JSON text. More than one constraint is an InvalidRequest naming the second."""
        found = [(k, getattr(self, k)) for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if not found:
            return None
        if len(found) > 1:
            raise InvalidRequest(f"only one constraint per request is allowed, got {', '.join(k for k, _ in found)}",
                                 param=found[1][0])
        kind, spec = found[0]
        return kind, spec if isinstance(spec, str) else json.dumps(spec)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the first bad field."""

        def num(name: str, kinds: tuple[type, ...]) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise InvalidRequest(f"{name} must be a number, got {v!r}", param=name)
            return v

        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise InvalidRequest(f"{name} {why}, got {getattr(self, name)!r}", param=name)

        check(num("max_new_tokens", (int,)) >= 0, "max_new_tokens", "must be >= 0")
        check(num("min_new_tokens", (int,)) >= 0, "min_new_tokens", "must be >= 0")
        check(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be <= max_new_tokens")
        check(num("temperature", (int, float)) >= 0, "temperature", "must be >= 0")
        check(0 < num("top_p", (int, float)) <= 1, "top_p", "must be in (0, 1]")
        check(num("top_k", (int,)) >= -1, "top_k", "must be -1 (disabled) or >= 1")
        check(0 <= num("min_p", (int, float)) <= 1, "min_p", "must be in [0, 1]")
        check(-2 <= num("frequency_penalty", (int, float)) <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(-2 <= num("presence_penalty", (int, float)) <= 2, "presence_penalty", "must be in [-2, 2]")
        check(0 < num("repetition_penalty", (int, float)) <= 2, "repetition_penalty", "must be in (0, 2]")
        check(num("n", (int,)) >= 1, "n", "must be >= 1")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed", "must be an integer")
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be a non-empty string or a list of them")
        check(isinstance(self.stop_regex, list) and all(isinstance(s, str) and s for s in self.stop_regex), "stop_regex",
              "must be a non-empty string or a list of them")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except (re.error, RecursionError) as e:
                raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: {e}",
                                     param="stop_regex") from None
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            check(isinstance(getattr(self, name), bool), name, "must be true or false")
        for name in CONSTRAINT_KINDS:
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, dict)):
                raise InvalidRequest(f"{name} must be a string, got {type(v).__name__}", param=name)
        self.constraint()  # more than one constraint: error
        if self.logit_bias is not None:
            self.bias_items(vocab_size)  # raises on a bad entry
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise InvalidRequest(f"stop_token_ids contains an invalid token id {t!r}", param="stop_token_ids")
