"""The grammar-backend suite of the conformance kit: xgrammar and llguidance pass it (bitmask
soundness on JSON schema, regex and EBNF), and a backend whose mask lies is caught by case."""

from __future__ import annotations

import pytest

from core.testing import check_plugin, grammar_backend_conformance
from core_plugins.grammar.xgrammar_backend import XGrammarBackend, XGrammarGrammar

pytest_plugins = ["core.testing.pytest_plugin"]


@pytest.fixture(params=["xgrammar", "llguidance"])
def grammar_backend(request):
    return request.param


class _EosAlways(XGrammarGrammar):
    """Allows EOS at every step: a constrained output could stop half-way."""

    def fill_bitmask(self, bitmask, index):
        super().fill_bitmask(bitmask, index)
        bitmask[index, 0] |= 1 << 2  # EOS is id 2 in the kit's vocabulary

    def accept_token(self, token_id):
        if token_id == 2:
            self.stopped = True
            return True
        return super().accept_token(token_id)

    def is_terminated(self):
        return getattr(self, "stopped", False) or super().is_terminated()

    def copy(self):
        return _EosAlways(self.compiled)


class EosAlwaysBackend(XGrammarBackend):
    def compile(self, kind, spec):
        return _EosAlways(super().compile(kind, spec).compiled)


class AcceptsEverything(XGrammarBackend):
    """Raises nothing on a bad spec: the error would surface mid-request instead of as a 400."""

    def compile(self, kind, spec):
        try:
            return super().compile(kind, spec)
        except ValueError:
            return super().compile("regex", ".*")


def test_a_mask_allowing_eos_too_early_is_caught():
    results = {r.case: r for r in check_plugin(EosAlwaysBackend, "grammar_backend")}
    walks = [c for c in results if c.startswith(("json", "regex", "ebnf"))]
    assert all(results[c].status == "failed" for c in walks), {c: results[c].status for c in walks}
    msg = results["regex_digits"].message
    assert msg.startswith("grammar_backend 'EosAlwaysBackend' case 'regex_digits': EOS allowed after ''")
    assert "which is not a complete match" in msg


def test_an_invalid_spec_must_raise_value_error():
    (r,) = check_plugin(AcceptsEverything, "grammar_backend", cases=["invalid_specs"])
    assert r.status == "failed"
    assert r.message == ("grammar_backend 'AcceptsEverything' case 'invalid_specs': compile('regex', '((') "
                         "accepted an invalid spec")
