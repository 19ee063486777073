"""The grammar-backend suite: bitmask soundness on JSON-schema, regex and EBNF constraints.

Over a small vocabulary (single characters plus multi-character tokens such as ``{"`` and
``Paris``, with padding ids past the tokenizer's end), each case takes seeded random walks
through the constraint. At every step the filled bitmask must allow only real tokens, never
be empty before termination, allow EOS only when the text so far is a complete match (judged
by an independent oracle), and agree with the matcher: a sample of allowed tokens is
accepted (and leaves a live state), a sample of disallowed ones is rejected. A known-valid
string must be accepted to the end; a known-invalid one must be stopped by the mask.
``fill_bitmask`` writes only its row, ``apply_bitmask`` masks exactly the disallowed logits,
``copy`` is independent of the original, and an invalid spec raises ``ValueError``.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Callable

import attrs
import torch

from core.testing.suite import Case, fail, resolve_target, seed_for

KIND = "grammar_backend"
EOS = 2
MULTI = ['{"', '"}', '":', '": ', ', "', "true", "false", "null", "Paris", "Lima", "12", "-1", " because", "yes", "no",
         "[a", "a]", "ab", '"na', "me", "age"]
PADDING = 7  # model vocab ids past the tokenizer's last id: never allowed
WALKS, MAX_STEPS, PROBES = 4, 40, 3


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-printable-character map, which byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def vocabulary() -> list[bytes]:
    """Token bytes by id: <unk>, <s>, </s>, the 256 single bytes, then multi-character tokens."""
    return [b"<unk>", b"<s>", b"</s>", *(bytes([b]) for b in range(256)), *(m.encode() for m in MULTI)]


def tokenizer() -> Any:
    """A byte-level BPE Hugging Face tokenizer over :func:`vocabulary` (the kind most models ship),
    which is what grammar backends are built from."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for tok in vocabulary()[3:]:
        vocab["".join(chars[b] for b in tok)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _is_obj(text: str, check: Callable[[dict], bool]) -> bool:
    try:  # strict=False: raw control characters inside strings pass (xgrammar 0.2 admits them)
        obj = json.loads(text, strict=False)
    except ValueError:
        return False
    return isinstance(obj, dict) and check(obj)


def _person(o: dict) -> bool:
    return (set(o) == {"name", "age"} and isinstance(o["name"], str) and len(o["name"]) <= 6
            and type(o["age"]) is int and 0 <= o["age"] <= 120)


def _place(o: dict) -> bool:
    tags = o.get("tags")
    return (set(o) <= {"city", "tags"} and o.get("city") in ("Paris", "Lima") and isinstance(tags, list)
            and len(tags) <= 2 and all(type(t) is bool for t in tags))


def _nested(text: str) -> bool:
    """``list ::= "[" (item ("," item)*)? "]"``, ``item ::= "a" | list``."""
    def item(i: int) -> int:
        if text[i:i + 1] == "a":
            return i + 1
        if text[i:i + 1] != "[":
            return -1
        i += 1
        if text[i:i + 1] == "]":
            return i + 1
        while True:
            i = item(i)
            if i < 0:
                return -1
            if text[i:i + 1] == "]":
                return i + 1
            if text[i:i + 1] != ",":
                return -1
            i += 1

    return text[:1] == "[" and item(0) == len(text)


@attrs.define(frozen=True)
class GrammarCase:
    """A constraint, an oracle for complete matches, a string it accepts and one it forbids."""

    name: str
    kind: str
    spec: str
    accepts: Callable[[str], bool]
    valid: str
    invalid: str


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PLACE = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]},
                                          "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
         "required": ["city", "tags"], "additionalProperties": False}
CITY_EBNF = 'root ::= city ", " country\ncity ::= "Paris" | "Tokyo" | "Lima"\ncountry ::= "France" | "Japan" | "Peru"'
NESTED_EBNF = 'root ::= list\nlist ::= "[" (item ("," item)*)? "]"\nitem ::= "a" | list'

GRAMMAR_CASES: tuple[GrammarCase, ...] = (
    GrammarCase("json_schema_object", "json_schema", json.dumps(PERSON), lambda t: _is_obj(t, _person),
                '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 360}'),
    GrammarCase("json_schema_enum_array", "json_schema", json.dumps(PLACE), lambda t: _is_obj(t, _place),
                '{"city": "Lima", "tags": [true]}', '{"city": "Rome", "tags": []}'),
    # [0-9], not \d: engines disagree on whether \d covers non-ASCII digits
    GrammarCase("regex_digits", "regex", r"[0-9]{3}-[0-9]{4}", lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) is not None,
                "555-0199", "555-01a9"),
    GrammarCase("regex_alternation", "regex", r"(yes|no), because [a-z ]{1,12}\.",
                lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,12}\.", t) is not None,
                "no, because it rains.", "maybe, because."),
    GrammarCase("ebnf_choice", "ebnf", CITY_EBNF,
                lambda t: re.fullmatch(r"(Paris|Tokyo|Lima), (France|Japan|Peru)", t) is not None,
                "Lima, Peru", "Lima; Peru"),
    GrammarCase("ebnf_recursive", "ebnf", NESTED_EBNF, _nested, "[a,[a,[]],a]", "[a,,a]"),
)
INVALID_SPECS = (("regex", "(("), ("json_schema", "{bad"), ("ebnf", "root ::= nothing"))


@attrs.define
class GrammarSubject:
    factory: Any
    label: str
    tokenizer: Any
    vocab: list[bytes]
    kind: str = KIND
    _backend: Any = None

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None) -> GrammarSubject:
        factory, label = resolve_target(KIND, target, plugins)
        return cls(factory, label, tokenizer(), vocabulary())

    @property
    def vocab_size(self) -> int:
        return len(self.vocab) + PADDING

    def backend(self) -> Any:
        if self._backend is None:
            self._backend = self.factory(self.tokenizer, self.vocab_size, stop_token_ids=[EOS])
        return self._backend


def _allowed(s: GrammarSubject, m: Any, where: str) -> set[int]:
    """The token ids ``m`` allows, read from row 1 of a 2-row bitmask; row 0 must stay all-ones."""
    bm = s.backend().allocate_bitmask(2)
    bm.fill_(-1)
    m.fill_bitmask(bm, 1)
    if not bool((bm[0] == -1).all()):
        raise fail(s, where, "fill_bitmask(bitmask, 1) changed row 0")
    bits = ((bm[1].to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[: s.vocab_size]
    allowed = set(torch.nonzero(bits).flatten().tolist())
    if past := sorted(t for t in allowed if t >= len(s.vocab)):
        raise fail(s, where, f"the mask allows ids {past[:5]} past the tokenizer's vocabulary")
    return allowed


def _replay(s: GrammarSubject, proto: Any, ids: list[int]) -> Any:
    m = proto.copy()
    for t in ids:
        m.accept_token(t)
    return m


def _text(s: GrammarSubject, ids: list[int]) -> str:
    return b"".join(s.vocab[t] for t in ids).decode("utf-8", "replace")


def _char_id(s: GrammarSubject, ch: str) -> int:
    return s.vocab.index(ch.encode())


def _step_checks(s: GrammarSubject, c: GrammarCase, proto: Any, m: Any, ids: list[int], rng: random.Random
                 ) -> set[int]:
    text = _text(s, ids)
    where = f"{c.name}"
    allowed = _allowed(s, m, where)
    if not allowed:
        raise fail(s, where, f"dead end after {text!r}: the mask allows nothing and the matcher is not terminated")
    if EOS in allowed and not c.accepts(text):
        raise fail(s, where, f"EOS allowed after {text!r}, which is not a complete match")
    if EOS not in allowed and c.accepts(text):
        raise fail(s, where, f"EOS not allowed after the complete match {text!r}")
    for t in rng.sample(sorted(allowed - {EOS}), min(PROBES, len(allowed - {EOS}))):
        probe = _replay(s, proto, ids)
        if not probe.accept_token(t):
            raise fail(s, where, f"after {text!r} the mask allows {s.vocab[t]!r} (id {t}) but accept_token rejects it")
        if not probe.is_terminated() and not _allowed(s, probe, where):
            raise fail(s, where, f"allowed token {s.vocab[t]!r} after {text!r} leads to a dead end")
    return allowed


def check_walks(s: GrammarSubject, c: GrammarCase) -> None:
    """Seeded random walks through ``c``; see the module docstring for what each step checks."""
    proto = _compile(s, c)
    rng = random.Random(seed_for(KIND, c.name))
    for _ in range(WALKS):
        m, ids = proto.copy(), []
        for step in range(MAX_STEPS):
            allowed = _step_checks(s, c, proto, m, ids, rng)
            others = sorted(allowed - {EOS})
            if EOS in allowed and (not others or rng.random() < (0.3 if step < MAX_STEPS // 2 else 0.9)):
                if not m.accept_token(EOS) or not m.is_terminated():
                    raise fail(s, c.name, f"EOS was allowed after {_text(s, ids)!r} but accepting it did not terminate")
                break
            t = rng.choice(others)
            if not m.accept_token(t):
                raise fail(s, c.name, f"accept_token({s.vocab[t]!r}) after {_text(s, ids)!r} returned False though allowed")
            ids.append(t)
    # a known-valid string, one character token at a time, then EOS
    m, ids = proto.copy(), []
    for ch in c.valid:
        t = _char_id(s, ch)
        if t not in _allowed(s, m, c.name):
            raise fail(s, c.name, f"the valid {c.valid!r}: {ch!r} after {_text(s, ids)!r} is masked out")
        m.accept_token(t)
        ids.append(t)
    if EOS not in _allowed(s, m, c.name) or not m.accept_token(EOS) or not m.is_terminated():
        raise fail(s, c.name, f"EOS is not allowed (or does not terminate) after the valid {c.valid!r}")
    # a known-invalid string must be stopped by the mask somewhere
    m, ids = proto.copy(), []
    for ch in c.invalid:
        t = _char_id(s, ch)
        if t not in _allowed(s, m, c.name):
            break
        m.accept_token(t)
        ids.append(t)
    else:
        if EOS in _allowed(s, m, c.name):
            raise fail(s, c.name, f"the invalid {c.invalid!r} is allowed to the end, EOS included")


def _compile(s: GrammarSubject, c: GrammarCase) -> Any:
    try:
        return s.backend().compile(c.kind, c.spec)
    except Exception as e:
        raise fail(s, c.name, f"compile({c.kind!r}, {c.spec!r}) raised {type(e).__name__}: {e}") from None


def check_copy_and_apply(s: GrammarSubject) -> None:
    """``copy`` gives an independent matcher; ``apply_bitmask`` sets exactly the disallowed logits to -inf."""
    c = GRAMMAR_CASES[2]
    proto = _compile(s, c)
    a, b = proto.copy(), proto.copy()
    start = _allowed(s, a, "copy_and_apply")
    a.accept_token(_char_id(s, c.valid[0]))
    if _allowed(s, b, "copy_and_apply") != start:
        raise fail(s, "copy_and_apply", "advancing one copy changed another")
    bm = s.backend().allocate_bitmask(2)
    bm.fill_(-1)
    b.fill_bitmask(bm, 1)
    logits = torch.randn(2, s.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    s.backend().apply_bitmask(logits, bm)
    if not torch.equal(logits[0], before[0]):
        raise fail(s, "copy_and_apply", "apply_bitmask changed a row whose mask is all ones")
    keep = torch.zeros(s.vocab_size, dtype=torch.bool)
    keep[sorted(start)] = True
    if not torch.equal(logits[1][keep], before[1][keep]) or not bool(torch.isneginf(logits[1][~keep]).all()):
        raise fail(s, "copy_and_apply", "apply_bitmask did not set exactly the disallowed logits to -inf")


def check_invalid_specs(s: GrammarSubject) -> None:
    """An invalid constraint raises ValueError (core turns it into a 400 naming the problem)."""
    for kind, spec in INVALID_SPECS:
        try:
            s.backend().compile(kind, spec)
        except ValueError:
            continue
        except Exception as e:
            raise fail(s, "invalid_specs", f"compile({kind!r}, {spec!r}) raised {type(e).__name__}, not ValueError: {e}")
        raise fail(s, "invalid_specs", f"compile({kind!r}, {spec!r}) accepted an invalid spec")


def grammar_cases() -> list[Case]:
    cases = [Case(c.name, lambda s, c=c: check_walks(s, c), f"{c.kind}: {c.spec}") for c in GRAMMAR_CASES]
    cases += [Case("copy_and_apply", check_copy_and_apply, check_copy_and_apply.__doc__ or ""),
              Case("invalid_specs", check_invalid_specs, check_invalid_specs.__doc__ or "")]
    return cases
