"""The drafter suite (speculative decoding): what the engine relies on of ``propose``.

Over seeded random token sequences (with repeats, so that copying drafters find something), each
case checks: a draft is a list of at most ``max_tokens`` non-negative ints (``max_tokens`` 0 gives
``[]``); the per-request ``state`` only caches (proposing along a growing sequence gives what a
fresh state gives on the same tokens); a sequence shorter than the last one (a retracted
request) is handled; an empty or one-token sequence is not an error. The engine verifies every
draft, so no case judges a draft's quality.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from core.testing.suite import Case, fail, resolve_target

KIND = "speculative_algorithm"
SEQUENCES, VOCAB = 6, 40


@attrs.define
class DrafterSubject:
    factory: Any
    label: str
    kind: str = KIND

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None) -> DrafterSubject:
        factory, label = resolve_target(KIND, target, plugins)
        return cls(factory, label)

    def drafter(self) -> Any:
        return self.factory(None)


def _sequences() -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(SEQUENCES):
        base = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 12))]
        seq: list[int] = []
        while len(seq) < 60:  # pieces of one phrase and noise: repeats to draft from
            seq += base[rng.randrange(len(base)):] if rng.random() < 0.6 else [rng.randrange(VOCAB)]
        out.append(seq[:60])
    return out


def _check_draft(s: DrafterSubject, case: str, draft: Any, max_tokens: int) -> None:
    if not isinstance(draft, list) or len(draft) > max_tokens or not all(type(t) is int and t >= 0 for t in draft):
        raise fail(s, case, f"propose(..., max_tokens={max_tokens}) returned {draft!r}: want a list of at most "
                            f"{max_tokens} non-negative ints")


def check_valid_drafts(s: DrafterSubject) -> None:
    """Drafts are lists of at most max_tokens non-negative ints, for every prefix and 0, 1, 5 tokens."""
    d = s.drafter()
    for seq in _sequences():
        state: dict = {}
        for n in range(0, len(seq) + 1, 7):
            for k in (0, 1, 5):
                _check_draft(s, "valid_drafts", d.propose(state, seq[:n], k), k)


def check_state_is_a_cache(s: DrafterSubject) -> None:
    """Along a growing sequence, one kept state proposes what a fresh state proposes."""
    d = s.drafter()
    for seq in _sequences():
        state: dict = {}
        for n in range(1, len(seq) + 1):
            kept, fresh = d.propose(state, seq[:n], 4), d.propose({}, seq[:n], 4)
            if kept != fresh:
                raise fail(s, "state_is_a_cache", f"after {n} tokens the kept state drafted {kept}, a fresh one {fresh}")


def check_shorter_sequences(s: DrafterSubject) -> None:
    """A request retracted and readmitted: fewer tokens than the state saw, then growing again."""
    d = s.drafter()
    seq = _sequences()[0]
    state: dict = {}
    d.propose(state, seq, 4)
    for n in (10, 11, 40):
        got = d.propose(state, seq[:n], 4)
        _check_draft(s, "shorter_sequences", got, 4)
        if got != d.propose({}, seq[:n], 4):
            raise fail(s, "shorter_sequences", f"after shrinking to {n} tokens the state drafted {got}")


def drafter_cases() -> list[Case]:
    return [Case(f.__name__.removeprefix("check_"), f, f.__doc__ or "")
            for f in (check_valid_drafts, check_state_is_a_cache, check_shorter_sequences)]
