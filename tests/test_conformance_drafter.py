"""The drafter suite of the conformance kit: the built-in NGRAM drafter passes it, and drafters
that break the engine's contract are caught by case."""

from __future__ import annotations

import pytest

from core.testing import check_plugin, drafter_conformance  # noqa: F401  (collected as a test class)
from core_plugins.speculative.ngram import NgramDrafter

pytest_plugins = ["core.testing.pytest_plugin"]


@pytest.fixture
def speculative_algorithm():
    return "NGRAM"


class TooLong(NgramDrafter):
    def propose(self, state, tokens, max_tokens):
        return list(tokens[-max_tokens - 1:]) if tokens else []


class Stateful(NgramDrafter):
    """Drafts depend on how many calls the state has seen, not only on the tokens."""

    def propose(self, state, tokens, max_tokens):
        state["calls"] = state.get("calls", 0) + 1
        return [state["calls"] % 7][:max_tokens]


class NoShrink(NgramDrafter):
    """Keeps an index built for a longer sequence after the request shrinks."""

    def propose(self, state, tokens, max_tokens):
        if len(tokens) < state.get("done", 0):
            state["done"] = len(tokens)  # skips clearing the index: stale n-grams
            return [1][:max_tokens]
        return super().propose(state, tokens, max_tokens)


@pytest.mark.parametrize("bad,case", [(TooLong, "valid_drafts"), (Stateful, "state_is_a_cache"),
                                      (NoShrink, "shorter_sequences")])
def test_a_drafter_breaking_the_contract_fails_its_case(bad, case):
    results = {r.case: r for r in check_plugin(bad, "speculative_algorithm")}
    assert results[case].status == "failed" and case in results[case].message
    assert results[case].message.startswith("speculative_algorithm '")
