"""The drafter suite of the conformance kit: the built-in NGRAM (a chain drafter, drafting trees
too), STANDALONE (a model drafter) and EAGLE / EAGLE3 (model drafters whose heads read the target's
features through ``observe``, drafting trees with ``speculative_eagle_topk`` 2) pass it, and
drafters that break the engine's contract are caught by case."""

from __future__ import annotations

import attrs
import pytest
import torch

from core.interfaces import DraftSeq, DraftTree
from core.testing import check_plugin, drafter_conformance  # noqa: F401  (collected as a test class)
from core.testing.drafter import CHAIN_CASES, MODEL_CASES, DrafterSubject, _check_slots, _simulate
from core_plugins.speculative import eagle
from core_plugins.speculative.eagle import Eagle3Drafter, EagleDrafter
from core_plugins.speculative.ngram import NgramDrafter
from core_plugins.speculative.standalone import StandaloneDrafter

pytest_plugins = ["core.testing.pytest_plugin"]


@pytest.fixture
def speculative_algorithm():
    return "NGRAM"


class TestStandaloneConformance(drafter_conformance):
    """The same suite against the model drafter (its own cases pass, the chain ones are skipped)."""

    @pytest.fixture
    def speculative_algorithm(self):
        return "STANDALONE"


class TestEagleConformance(drafter_conformance):
    """The same suite against a head drafter: loaded on the kit's fake EAGLE head, handed the fake
    target's features after every simulated forward."""

    @pytest.fixture
    def speculative_algorithm(self):
        return "EAGLE"


@pytest.mark.parametrize("name,runs,skips", [("NGRAM", CHAIN_CASES, MODEL_CASES),
                                             ("STANDALONE", MODEL_CASES, CHAIN_CASES),
                                             ("EAGLE", MODEL_CASES, CHAIN_CASES),
                                             ("EAGLE3", MODEL_CASES, CHAIN_CASES)])
def test_each_interface_gets_its_own_cases(name, runs, skips):
    results = {r.case: r for r in check_plugin(name, "speculative_algorithm")}
    assert set(results) == set(runs) | set(skips)
    assert all(results[c].status == "passed" for c in runs), [results[c].message for c in runs]
    assert all(results[c].status == "skipped" for c in skips)


def test_eagle_trees_are_checked_with_topk_2():
    """The kit runs a drafter whose ``trees`` is true with ``speculative_eagle_topk`` 2 too: EAGLE's
    trees (room nodes, branching) pass the slot checks, each node's KV in its own verify slot."""
    e = _simulate(DrafterSubject.build("EAGLE"), "draft_kv_slots", steps=8, retract_at=5, topk=2)
    trees = [(t, p) for c in e.calls if c.drafts is not None for t, p in c.drafts if p is not None]
    assert len(trees) > 5 and any(len(set(p)) < len(p) for _, p in trees)  # siblings: real trees
    for call in e.calls:
        _check_slots(e, call)


def test_eagle_trees_in_a_chains_slot_layout_fail(monkeypatch):
    """EAGLE with every tree node's KV at its position's own slot (siblings share it, a child sees
    whichever sibling wrote last) fails draft_kv_slots, on the topk 2 run."""

    def seq(self, node):
        r, d = self.r, self.depth[node]
        return DraftSeq([self.tokens[node]], r.kv_len + d - 1, r.slots[:r.kv_len + d])

    monkeypatch.setattr(eagle._Tree, "seq", seq)
    results = {r.case: r for r in check_plugin("EAGLE", "speculative_algorithm")}
    assert results["draft_kv_slots"].status == "failed"
    assert "speculative_eagle_topk 2" in results["draft_kv_slots"].message
    assert results["batch_drafts"].status == "passed"


# --------------------------------------------------------------------------- chain drafters breaking the contract


class TooLong(NgramDrafter):
    def propose(self, state, tokens, max_tokens):
        return list(tokens[-max_tokens - 1:]) if tokens else []


class Stateful(NgramDrafter):
    """Drafts depend on how many calls the state has seen, not only on the tokens."""

    def propose(self, state, tokens, max_tokens):
        state["calls"] = state.get("calls", 0) + 1
        return [state["calls"] % 7][:max_tokens]


class ParentAfterNode(NgramDrafter):
    """A tree whose first node's parent is a later node."""

    def propose(self, state, tokens, max_tokens):
        draft = super().propose(state, tokens, max_tokens)
        tokens = draft.tokens if isinstance(draft, DraftTree) else draft
        return DraftTree(tokens, [len(tokens) - 1] + list(range(len(tokens) - 1))) if len(tokens) > 1 else draft


class TreeTooBig(NgramDrafter):
    """A valid tree of one node more than max_tokens."""

    def propose(self, state, tokens, max_tokens):
        return DraftTree([1] * (max_tokens + 1), [-1] * (max_tokens + 1)) if max_tokens else []


class NoShrink(NgramDrafter):
    """Keeps an index built for a longer sequence after the request shrinks."""

    def propose(self, state, tokens, max_tokens):
        if len(tokens) < state.get("done", 0):
            state["done"] = len(tokens)  # skips clearing the index: stale n-grams
            return [1][:max_tokens]
        return super().propose(state, tokens, max_tokens)


# --------------------------------------------------------------------------- model drafters breaking the contract


class OneTooMany(StandaloneDrafter):
    """One token more than the room (the engine refuses the verify)."""

    def propose_batch(self, reqs):
        return [d + [0] for d in super().propose_batch(reqs)]


class PastItsRoom(StandaloneDrafter):
    """Also writes the last draft token's KV, at the slot after the request's last one (another request's)."""

    def propose_batch(self, reqs):
        drafts = super().propose_batch(reqs)
        seqs = [DraftSeq([d[-1]], r.kv_len + r.room, torch.cat([r.slots, r.slots[-1:] + 1]))
                for r, d in zip(reqs, drafts) if d]
        if seqs:
            self.draft.run(seqs)
        return drafts


class TrustsItsKV(StandaloneDrafter):
    """Once it drafted for a request, takes all its draft KV as valid: rejected drafts' KV included."""

    def propose_batch(self, reqs):
        for r in reqs:
            if "kv" in r.state:
                r.state["kv"], r.state["chain"] = r.kv_len, []
        return super().propose_batch(reqs)


class KeepsStateItself(StandaloneDrafter):
    """Keeps its bookkeeping per prompt in the drafter, not in ``state``: a retraction goes unseen."""

    def __init__(self, args):
        super().__init__(args)
        self.mine: dict = {}

    def propose_batch(self, reqs):
        real = [r.state for r in reqs]
        for r in reqs:
            r.state = self.mine.setdefault(tuple(r.tokens[:2]), {})
        try:
            return super().propose_batch(reqs)
        finally:
            for r, st in zip(reqs, real):
                r.state = st


class StaleHeadState(EagleDrafter):
    """Observes a request's first forward only, then drafts from that state as if it were current:
    its head's KV and hidden state lag the target's."""

    def observe(self, reqs, features):
        if new := [o for o in reqs if "pos" not in o.state]:
            super().observe(new, features)

    def propose_batch(self, reqs):
        for r in reqs:
            if "pos" in r.state:
                r.state["pos"] = r.kv_len
        return super().propose_batch(reqs)


class IgnoresRow(Eagle3Drafter):
    """Reads every observation's features from the forward's first row instead of its ``row``."""

    def observe(self, reqs, features):
        super().observe([attrs.evolve(o, row=0) for o in reqs], features)


class CapturesWithoutObserve(StandaloneDrafter):
    """Asks for the target's features but has no ``observe`` to take them (the engine would crash)."""

    def load(self, ctx):
        super().load(ctx)
        ctx.capture(())


class TreeOfTooFewNodes(EagleDrafter):
    """Drops a tree's last node (the engine wants exactly room nodes)."""

    def propose_batch(self, reqs):
        return [DraftTree(d.tokens[:-1], d.parents[:-1]) if isinstance(d, DraftTree) else d
                for d in super().propose_batch(reqs)]


class NoLoad:
    """propose_batch without load: the engine treats it as a model drafter and calls load."""

    def __init__(self, args):
        pass

    def propose_batch(self, reqs):
        return [[0] * r.room for r in reqs]


@pytest.mark.parametrize("bad,case", [(TooLong, "valid_drafts"), (ParentAfterNode, "valid_drafts"),
                                      (TreeTooBig, "valid_drafts"), (TreeOfTooFewNodes, "batch_drafts"),
                                      (Stateful, "state_is_a_cache"),
                                      (NoShrink, "shorter_sequences"), (OneTooMany, "batch_drafts"),
                                      (PastItsRoom, "draft_kv_slots"), (TrustsItsKV, "growing_requests"),
                                      (KeepsStateItself, "retracted_requests"), (NoLoad, "batch_drafts"),
                                      (StaleHeadState, "growing_requests"), (IgnoresRow, "growing_requests"),
                                      (CapturesWithoutObserve, "batch_drafts")])
def test_a_drafter_breaking_the_contract_fails_its_case(bad, case):
    results = {r.case: r for r in check_plugin(bad, "speculative_algorithm")}
    assert results[case].status == "failed" and case in results[case].message
    assert results[case].message.startswith("speculative_algorithm '")
