"""Speculative decoding (issue 43, first part): the drafter plugin kind, the NGRAM drafter (chains
and trees from the request's own context and from recent requests' shared index), and
verification by the target model. Greedy decoding gives exactly plain decoding's tokens whatever
the drafts are; a verify keeps the drafted prefix the target agrees with plus the target's own
next token; the KV of rejected tokens never reaches the prefix cache; SGLang's meta_info counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.engine.speculative.tree import walk
from core_plugins.speculative.ngram import NgramDrafter
from tests.conftest import build_tiny_llama, make_engine

PROMPTS = [[5 + (i * 7 + j) % 13 for j in range(30 + 5 * i)] for i in range(4)]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-spec")
    build_tiny_llama(path, seed=3)
    return path


class OracleDrafter:
    """Drafts the reference continuation with every third token wrong: some accepted, some not."""

    def __init__(self, want: dict[tuple[int, ...], list[int]]) -> None:
        self.want, self.calls = want, 0

    def propose(self, state: dict, tokens, max_tokens: int) -> list[int]:
        self.calls += 1
        prompt = next(p for p in self.want if tuple(tokens[:len(p)]) == p)
        done = len(tokens) - len(prompt)
        draft = list(self.want[prompt][done:done + max_tokens])
        return [t + 1 if (done + j) % 3 == 2 else t for j, t in enumerate(draft)]


def generate(path: Path, drafter: Any = None, params: list[dict] | None = None, **kwargs: Any) -> tuple[list[dict], Any]:
    eng = make_engine(path, dtype="float32", device="cpu", **kwargs)
    try:
        if drafter is not None:
            eng.engine.scheduler.speculator.drafter = drafter
        outs = eng.generate(input_ids=PROMPTS, sampling_params=params or [GREEDY] * len(PROMPTS))
        eng.engine.scheduler.check_accounting()
        return outs, eng.engine
    finally:
        eng.shutdown()


def test_greedy_tokens_are_plain_decodings_and_drafts_are_partly_kept(tiny):
    plain, _ = generate(tiny)
    want = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain)}
    oracle = OracleDrafter(want)
    spec, engine = generate(tiny, oracle, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert oracle.calls > 0
    for o in spec:
        m = o["meta_info"]
        assert 0 < m["spec_num_correct_drafts"] < m["spec_num_proposed_drafts"]
        assert m["spec_verify_ct"] < len(o["output_ids"])  # fewer target forwards than tokens
        assert m["spec_accept_length"] == pytest.approx(len(o["output_ids"]) / m["spec_verify_ct"])
        assert m["spec_accept_rate"] == pytest.approx(m["spec_num_correct_drafts"] / m["spec_num_proposed_drafts"])
    # the prefix cache holds the prompts and kept tokens only: a second round reuses them and still
    # gives the plain tokens (a rejected draft's KV in the cache would change them)
    again, _ = generate(tiny, OracleDrafter(want), speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in plain]


def test_a_seed_gives_plain_decodings_samples(tiny):
    """A seeded request spends one draw per token kept, as plain decoding does (a verify's rejected
    positions drew too): its samples do not depend on its drafts."""
    seeded = [{"max_new_tokens": 24, "temperature": 0.7, "seed": 100 + i, "ignore_eos": True} for i in range(len(PROMPTS))]
    plain, _ = generate(tiny, params=seeded)
    want = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain)}
    spec, _ = generate(tiny, OracleDrafter(want), seeded, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert all(0 < o["meta_info"]["spec_num_correct_drafts"] < o["meta_info"]["spec_num_proposed_drafts"] for o in spec)


def test_the_ngram_drafter_copies_the_requests_own_context():
    d, state = NgramDrafter(), {}
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert d.propose(state, tokens, 4) == [4, 5, 9, 1]  # "1 2 3" seen before: what followed it
    assert d.propose(state, tokens + [4], 2) == [5, 9]  # the index grows with the tokens
    assert d.propose({}, [7, 8, 9], 3) == []  # nothing repeats
    assert d.propose({}, [1, 2, 1, 2], 0) == []
    assert d.propose(state, [1, 2, 3, 1, 2], 3) == [3, 1, 2]  # fewer tokens than indexed (retracted): starts again
    assert state["done"] == 5 and (3, 1) in state["index"] and (9, 1) not in state["index"]


def test_the_ngram_drafter_proposes_a_tree_of_earlier_occurrences():
    """Several earlier occurrences of the context's suffix, followed by different tokens: a trie of
    their continuations whose first chain is the latest occurrence's (today's chain), the older
    ones branching off where they differ, the longest match's before shorter ones'."""
    from core.engine.speculative.tree import first_chain
    from core.interfaces import DraftTree

    d = NgramDrafter()
    tokens = [1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2]  # "1 2" followed by "3 4 .." then, later, by "5 6 .."
    tree = d.propose({}, tokens, 8)
    assert isinstance(tree, DraftTree)
    assert first_chain(tree.tokens, tree.parents) == [5, 6, 1, 2]  # the latest occurrence's continuation, as is
    assert tree == DraftTree([5, 6, 1, 2, 3, 4, 9, 1], [-1, 0, 1, 2, -1, 4, 5, 6])  # the older one: a root branch
    # the node cap: at most max_tokens nodes, the latest continuation first, parents before children
    assert d.propose({}, tokens, 6) == DraftTree([5, 6, 1, 2, 3, 4], [-1, 0, 1, 2, -1, 4])
    assert d.propose({}, tokens, 4) == [5, 6, 1, 2]  # the chain fills the cap: a plain list
    # shared prefixes merge: "7 1 2" twice, followed by "3 5 .." (the latest) and "3 8 .."
    tree = d.propose({}, [1, 2, 3, 4, 0, 7, 1, 2, 3, 8, 0, 7, 1, 2, 3, 5, 7, 1, 2], 8)
    assert tree == DraftTree([3, 5, 7, 1, 2, 8, 0, 7], [-1, 0, 1, 2, 3, 0, 5, 6])
    # the longest match first ("7 1 2": "5 0 .."), though a shorter one ("1 2": "3 7 ..") occurred later
    tree = d.propose({}, [7, 1, 2, 5, 0, 1, 2, 3, 7, 1, 2], 12)
    assert tree == DraftTree([5, 0, 1, 2, 3, 7, 1, 2, 3, 7, 1, 2], [-1, 0, 1, 2, 3, 4, 5, 6, -1, 8, 9, 10])
    # one occurrence, or occurrences that agree: a chain, as a list
    assert d.propose({}, [1, 2, 3, 4, 5, 9, 1, 2, 3], 4) == [4, 5, 9, 1]
    assert d.propose({}, [1, 2, 3, 1, 2, 3, 1, 2], 8) == [3, 1, 2]  # the latest continuation is never extended
    # the index keeps the latest ``ENDS`` ends per n-gram, and a kept state drafts what a fresh one does
    state: dict = {}
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2, 7, 1, 2]
    for n in range(1, len(seq) + 1):
        assert d.propose(state, seq[:n], 8) == d.propose({}, seq[:n], 8)
    assert state["index"][(1, 2)] == [5, 8, 11, 14]  # (the one ending at 2 dropped)
    tree = d.propose(state, seq, 40)
    assert [tree.tokens[j] for j, p in enumerate(tree.parents) if p == -1] == [7, 6, 5, 4]  # most recent first


def test_the_ngram_drafter_drafts_other_requests_continuations():
    """The shared index: a request whose own context has no match drafts what followed its suffix
    in an earlier request, as the chain; where its own context matches, the other's continuation
    is a branch after its own. A request publishes from its second proposal on."""
    from core.interfaces import DraftTree

    d, first = NgramDrafter(), {}
    answer = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    d.propose(first, answer[:5], 4)
    assert d.propose({}, [90, 91, 12, 13], 4) == []  # a state's first proposal publishes nothing
    d.propose(first, answer, 4)
    assert d.propose({}, [90, 91, 12, 13], 4) == [14, 15, 16, 17]  # nothing of its own: the other's answer
    assert d.propose({}, [90, 91, 12, 13], 9) == [14, 15, 16, 17, 18]  # (as far as it was published)
    # its own context first (the first chain unchanged), then the other's continuation as a root branch
    assert d.propose({}, [12, 13, 50, 12, 13], 6) == DraftTree([50, 12, 13, 14, 15, 16], [-1, 0, 1, -1, 3, 4])
    assert d.propose({}, [12, 13, 50, 12, 13], 3) == [50, 12, 13]
    # the longest match first: "11 12 13" in the other request beats "12 13" elsewhere
    other = {}
    d.propose(other, [7, 12, 13, 99], 4)
    d.propose(other, [7, 12, 13, 99, 98], 4)
    assert d.propose({}, [0, 11, 12, 13], 2) == [14, 15]
    assert d.propose({}, [0, 5, 12, 13], 8) == DraftTree([99, 98, 14, 15, 16, 17, 18], [-1, 0, -1, 2, 3, 4, 5])


def test_the_shared_index_is_bounded(monkeypatch):
    """At most ``SHARED_TOKENS`` tokens of recent requests: the least recently grown request
    leaves first, with its n-grams; a request that keeps growing stays."""
    from core_plugins.speculative import ngram

    monkeypatch.setattr(ngram, "SHARED_TOKENS", 20)
    d = NgramDrafter()
    a, b, c = ({}, [10 + i for i in range(8)]), ({}, [40 + i for i in range(8)]), ({}, [70 + i for i in range(8)])
    for state, tokens in (a, b, a, b):  # a then b published: 16 tokens
        d.propose(state, tokens, 4)
    assert d.propose({}, [0, 10, 11], 2) == [12, 13] and d.propose({}, [0, 40, 41], 2) == [42, 43]
    d.propose(a[0], a[1] + [18, 19], 4)  # a grows (18 tokens): b is now the least recent
    for _ in range(2):
        d.propose(c[0], c[1], 4)  # c published: 26 tokens, b out
    assert d.total <= 20 and len(d.seqs) == 2
    assert d.propose({}, [0, 40, 41], 2) == [] and d.propose({}, [0, 10, 11], 2) == [12, 13]
    assert not any(sid == 1 for ends in d.index.values() for sid, _ in ends)  # b's n-grams left with it
    d.propose(c[0], c[1] + list(range(100, 120)), 4)  # c alone over the bound: out too, and stops publishing
    assert d.total <= 20 and d.propose({}, [0, 70, 71], 2) == []


def test_sglangs_ngram_flags_shape_the_drafts():
    """--speculative-ngram-*: max breadth 1 drafts chains; SGLang's breadth (wide at a short match's
    root, narrowing a level down, narrow under a long match); the trie depth bounds the suffix
    matched and how deep a match drafts; the capacity bounds the shared index; PROB is refused."""
    from types import SimpleNamespace

    from core.errors import CoreError
    from core.interfaces import DraftTree

    def drafter(**flags: Any) -> NgramDrafter:
        return NgramDrafter(SimpleNamespace(**{f"speculative_ngram_{k}": v for k, v in flags.items()}))

    tokens = [1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2]  # "1 2" followed by "3 4 .." then, later, by "5 6 .."
    assert isinstance(NgramDrafter().propose({}, tokens, 8), DraftTree)
    assert drafter(max_bfs_breadth=1).propose({}, tokens, 8) == [5, 6, 1, 2]  # chains only
    # "0 1 2" followed by 5, 6, 7 and "1 2" by 3 too. Breadth at the root of a k-token match with
    # max 4: (8 - k) * 3 / 7 + 1, 3.14 -> 3 for k = 3 (7, 6, 5), and the 2-token match's 3 finds it full
    wide = [1, 2, 3, 4, 0, 1, 2, 5, 0, 1, 2, 6, 0, 1, 2, 7, 0, 1, 2]
    roots = lambda t: [t.tokens[j] for j, p in enumerate(t.parents) if p == -1]  # noqa: E731
    assert roots(drafter(max_bfs_breadth=4).propose({}, wide, 60)) == [7, 6, 5]
    assert roots(drafter(max_bfs_breadth=4, min_bfs_breadth=4).propose({}, wide, 60)) == [7, 6, 5, 3]
    assert roots(NgramDrafter().propose({}, wide, 60)) == [7, 6, 5, 3]  # (no flag: no breadth limit)
    assert drafter(max_bfs_breadth=2).propose({}, wide, 60) == [7, 0, 1, 2]  # (1.71 -> 1: a chain)
    # trie depth 4: suffixes of up to 3 tokens, and a 3-token match drafts at most 1 deep
    seq = [8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    assert NgramDrafter().propose({}, seq, 5) == [4, 5, 6, 7, 8]
    assert drafter(max_trie_depth=4).propose({}, seq, 5) == [4]
    assert drafter(max_trie_depth=6).propose({}, seq, 5) == [4, 5]  # ("8 1 2 3", 4 tokens: 2 deep)
    assert drafter(max_trie_depth=7).propose({}, seq, 5) == [4, 5, 6]
    # the capacity, in n-gram ends: 70 over 7 suffix lengths holds 10 tokens of recent requests
    d = drafter(capacity=70)
    assert d.shared_tokens == 10
    a, b = ({}, [10 + i for i in range(8)]), ({}, [40 + i for i in range(8)])
    for state, toks in (a, b, a, b):
        d.propose(state, toks, 4)
    assert d.total <= 10 and d.propose({}, [0, 10, 11], 2) == [] and d.propose({}, [0, 40, 41], 2) == [42, 43]
    for bad, match in [({"match_type": "PROB"}, "PROB"), ({"min_bfs_breadth": 3, "max_bfs_breadth": 2}, "min <= max"),
                       ({"max_trie_depth": 2}, "at least 3"), ({"capacity": 0}, ">= 1")]:
        with pytest.raises(CoreError, match=match):
            drafter(**bad)
    assert drafter(match_type="bfs").propose({}, tokens, 4) == [5, 6, 1, 2]


def test_a_request_never_drafts_from_what_it_published():
    """A stored sequence that is a prefix of the request's tokens (its own, however its state was
    kept) never drafts: a kept state drafts what a fresh one does, and what a drafter that never
    saw the request does. Along requests sharing phrases, with evictions and a retraction, kept
    states draft what fresh ones do (the conformance kit's state_is_a_cache, across requests)."""
    import random

    from core.testing.drafter import _sequences
    from core_plugins.speculative import ngram

    d, state = NgramDrafter(), {}
    seq = _sequences()[0]
    for n in range(1, len(seq) + 1):
        kept = d.propose(state, seq[:n], 6)
        assert kept == d.propose({}, seq[:n], 6) == NgramDrafter().propose({}, seq[:n], 6)
    assert d.seqs[state["sid"]] == seq  # (published, and never drafted from)
    # retracted (fewer tokens): it starts again as a new request, and what it published before is
    # another's now, drafted from (its likely future), by the kept state as by a fresh one
    answer = list(range(10, 30))
    d.propose(state, answer[:5], 4)
    d.propose(state, answer, 4)
    assert d.propose(state, answer[:8], 4) == d.propose({}, answer[:8], 4) == [18, 19, 20, 21]
    for bound in (40, 150, ngram.SHARED_TOKENS):
        ngram.SHARED_TOKENS, old = bound, ngram.SHARED_TOKENS
        try:
            d, rng = NgramDrafter(), random.Random(bound)
            seqs = _sequences() * 2
            states, lens = [{} for _ in seqs], [1] * len(seqs)
            for _ in range(500):
                i = rng.randrange(len(seqs))
                if rng.random() < 0.05:
                    lens[i] = rng.randrange(1, lens[i] + 1)  # retracted, state kept
                tokens = seqs[i][:lens[i]]
                assert d.propose(states[i], tokens, 6) == d.propose({}, tokens, 6)
                assert d.total <= bound
                lens[i] = min(len(seqs[i]), lens[i] + rng.randrange(1, 4))
        finally:
            ngram.SHARED_TOKENS = old


def test_a_repeated_prompt_drafts_the_earlier_answer(tiny):
    """Two identical prompts one after the other, through the engine: the second drafts the
    first's answer from the shared index (its prompt repeats nothing of its own), so more of its
    drafts are kept; both give plain decoding's tokens."""
    prompt = [3 + (j * 37) % 250 for j in range(40)]  # no n-gram twice
    eng = make_engine(tiny, dtype="float32", device="cpu")
    try:
        want = eng.generate(input_ids=[prompt], sampling_params=[GREEDY])[0]["output_ids"]
    finally:
        eng.shutdown()
    eng = make_engine(tiny, dtype="float32", device="cpu", speculative_algorithm="NGRAM")
    try:
        first, second = (eng.generate(input_ids=[prompt], sampling_params=[GREEDY])[0] for _ in range(2))
        eng.engine.scheduler.check_accounting()
    finally:
        eng.shutdown()
    assert first["output_ids"] == second["output_ids"] == want
    kept = [o["meta_info"]["spec_num_correct_drafts"] for o in (first, second)]
    assert kept[1] > kept[0] and kept[1] >= len(want) // 2, kept
    assert second["meta_info"]["spec_verify_ct"] < first["meta_info"]["spec_verify_ct"]


@pytest.fixture(scope="module")
def bigram(tmp_path_factory) -> Path:
    """A tiny model whose attention output is zeroed: its next token depends on the last token
    only, so its greedy answers cycle and follow whatever a prompt says comes next."""
    import torch

    path = tmp_path_factory.mktemp("tiny-bigram")
    model = build_tiny_llama(path, seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(path)
    return path


def test_ngram_trees_keep_plain_tokens_and_at_least_the_chains_drafts(bigram):
    """Prompts where the suffix's latest occurrence is followed by the wrong tokens and an older
    one by the answer: the chain drafts the wrong ones, the tree also the older continuation as a
    branch. Greedy tokens are plain decoding's either way, and trees keep at least as many drafts."""
    from core.interfaces import DraftTree

    plain = make_engine(bigram)
    try:
        starts = [[c] for c in (5, 17, 40, 99)]
        outs = plain.generate(input_ids=starts, sampling_params=[GREEDY] * 4)
        runs = [s + o["output_ids"] for s, o in zip(starts, outs)]  # greedy runs t0 t1 t2 ...
        # "t0 t1" followed by the answer, then later by wrong tokens; the prompt ends with t0, whose
        # next token t1 makes "t0 t1" the suffix the first draft looks up
        prompts = [t[:8] + [3] + t[:2] + [t[5] + 1, t[6] + 1] + t[:1] for t in runs]
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=[GREEDY] * 4)]
    finally:
        plain.shutdown()
    assert [w[:6] for w in want] == [t[1:7] for t in runs]  # the answer: the older occurrence's continuation

    def run(trees: bool) -> tuple[int, int]:
        eng = make_engine(bigram, speculative_algorithm="NGRAM")
        try:
            spec = eng.engine.scheduler.speculator
            assert not spec.trees  # the CPU verifies a chain drafter's trees as their first chain (faster there)
            spec.trees = trees  # ... though its attention backends take tree masks: whole trees, for this test
            propose, proposed = spec.drafter.propose, []
            spec.drafter.propose = lambda state, tokens, k: proposed.append(propose(state, tokens, k)) or proposed[-1]
            outs = eng.generate(input_ids=prompts, sampling_params=[GREEDY] * 4)
            eng.engine.scheduler.check_accounting()
        finally:
            eng.shutdown()
        assert [o["output_ids"] for o in outs] == want
        kept = sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs)
        return kept, sum(isinstance(t, DraftTree) for t in proposed)

    (tree_kept, tree_drafts), (chain_kept, _) = run(True), run(False)
    assert tree_drafts > 0 and tree_kept >= chain_kept > 0, (tree_kept, chain_kept)


def test_the_builtin_ngram_drafter_keeps_plain_tokens(tiny):
    """Through the plugin registry (``--speculative-algorithm NGRAM``): the tiny random model's
    answers hardly repeat, so few drafts; its tokens stay plain decoding's (bench/bench_speculative.py
    measures a copying answer of the default model)."""
    plain, _ = generate(tiny)
    spec, _ = generate(tiny, speculative_algorithm="NGRAM")
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in spec)


def test_accepted_counts_the_agreeing_prefix():
    assert walk([4, 5, 6], None, [4, 5, 7, 8]) == ([0, 1], 7)
    assert walk([4, 5, 6], None, [4, 5, 6, 8]) == ([0, 1, 2], 8)
    assert walk([4], None, [3, 4]) == ([], 3)
    assert walk([], None, [3]) == ([], 3)


def test_sampled_requests_and_constrained_ones_around_drafts(tiny):
    """A batch with a sampled request is drafted for (its positions sample as decodes would); one
    with a grammar or logprobs decodes plainly; all finish with their lengths."""
    eng = make_engine(tiny, dtype="float32", device="cpu", speculative_algorithm="NGRAM")
    try:
        outs = eng.generate(input_ids=PROMPTS[:3], sampling_params=[
            {"max_new_tokens": 12, "temperature": 0.8, "sampling_seed": 5, "ignore_eos": True},
            {"max_new_tokens": 10, "temperature": 0, "regex": "[0-9]{4,9}"},
            {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}], return_logprob=True)
        assert [len(o["output_ids"]) for o in outs][0::2] == [12, 9]
        eng.engine.scheduler.check_accounting()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kwargs,match", [
    ({"speculative_algorithm": "EAGLE9"}, "EAGLE9"),
    ({"speculative_num_draft_tokens": 4}, "needs --speculative-algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "must be >= 2"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 40}, "holds at most 32 tokens"),
    ({"speculative_ngram_max_bfs_breadth": 1}, "needs --speculative-algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_match_type": "PROB"}, "PROB"),
])
def test_bad_speculative_flags_are_clear_errors(tiny, kwargs, match):
    from core.errors import CoreError

    with pytest.raises(CoreError, match=match):
        make_engine(tiny, dtype="float32", device="cpu", **kwargs)


def test_http_meta_info_metrics_and_bench_serving_report_the_accept_length(tiny):
    """Through the server: /generate's meta_info carries SGLang's spec_* fields, /metrics SGLang's
    accept-length and accept-rate gauges, and ``core bench serving`` reports the accept length."""
    import argparse
    import asyncio

    import httpx

    from core.bench_serving import RequestResult, format_report, summarize
    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_kwargs
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    async def go():
        args = engine_args_from_kwargs(dict(model_path=str(tiny), dtype="float32", max_total_tokens=1024, cpu_threads=1,
                                            device="cpu", grammar_backend="none", speculative_algorithm="NGRAM"))
        engine = AsyncEngine(args)
        state = build_state(engine, ServerArgs(enable_metrics=True))
        state.ready = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t") as c:
            engine.scheduler.speculator.drafter = OracleDrafter({})  # no drafts: plain decoding's tokens
            engine.scheduler.speculator.drafter.propose = lambda state, tokens, k: []
            r = await c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
            want = r.json()["output_ids"]
            engine.scheduler.speculator.drafter = OracleDrafter({tuple(PROMPTS[0]): want})
            r = await c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
            assert r.status_code == 200 and r.json()["output_ids"] == want, r.text
            meta = r.json()["meta_info"]
            metrics = (await c.get("/metrics")).text
        await engine.shutdown()
        return meta, metrics

    meta, metrics = asyncio.run(go())
    assert meta["spec_verify_ct"] < 24 and meta["spec_num_correct_drafts"] > 0  # fewer forwards than tokens
    assert meta["spec_accept_length"] > 1
    assert "sglang:spec_accept_length{" in metrics and "sglang:spec_accept_rate{" in metrics
    ns = argparse.Namespace(backend="sglang", request_rate=float("inf"), max_concurrency=None)
    results = [RequestResult(10, 24, True, ttft=0.1, latency=1.0, spec_verify_ct=8),
               RequestResult(10, 12, True, ttft=0.1, latency=1.0, spec_verify_ct=4)]
    report = summarize(results, 2.0, ns)
    assert report["accept_length"] == 3.0 and "Accept length" in format_report(report)


def check_sampled_distribution(path: Path, drafter_for: Any, max_new_tokens: int = 3, accept: Any = None,
                               **engine: Any) -> None:
    """1,500 sampled outputs (temperature 1, top-k 4) of the speculating engine, its drafter
    ``drafter_for(prompt, greedy continuation)`` (``accept``: its ``Speculator.accept``), against the
    plain engine's: position by position the total variation distance stays within what the draws
    allow (noise ~0.03-0.05 for these few categories), and the drafted greedy pair is not
    over-represented (as an always-accepting verify would make it)."""
    from collections import Counter

    n, prompt = 1500, PROMPTS[1]
    sampled = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_k": 4, "ignore_eos": True}
    plain_eng = make_engine(path, dtype="float32", device="cpu", max_running_requests=256, random_seed=1)
    try:
        greedy = plain_eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": max_new_tokens})["output_ids"]
        plain = [o["output_ids"] for o in plain_eng.generate(input_ids=[prompt] * n, sampling_params=sampled)]
    finally:
        plain_eng.shutdown()
    eng = make_engine(path, dtype="float32", device="cpu", max_running_requests=256, random_seed=2,
                      speculative_algorithm="NGRAM", **engine)
    try:
        eng.engine.scheduler.speculator.token_budget = 100_000  # (1,500 requests: past any device's budget)
        eng.engine.scheduler.speculator.min_draft_share = 0  # (a verify however few drafts: sampled ones stand)
        eng.engine.scheduler.speculator.drafter = drafter_for(prompt, greedy)
        eng.engine.scheduler.speculator.accept = accept
        outs = eng.generate(input_ids=[prompt] * n, sampling_params=sampled)
        spec = [o["output_ids"] for o in outs]
        assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs) > n // 10  # drafts were verified and kept
    finally:
        eng.shutdown()

    def tv(a: list, b: list) -> float:
        ca, cb = Counter(a), Counter(b)
        return sum(abs(ca[k] - cb[k]) for k in ca.keys() | cb.keys()) / (2 * len(a))

    assert tv([o[0] for o in plain], [o[0] for o in spec]) < 0.07
    assert tv([o[1] for o in plain], [o[1] for o in spec]) < 0.08
    assert tv([tuple(o[:2]) for o in plain], [tuple(o[:2]) for o in spec]) < 0.1
    both = [o[:2] == greedy[:2] for o in plain].count(True), [o[:2] == greedy[:2] for o in spec].count(True)
    assert abs(both[0] - both[1]) < 0.05 * n, both


def test_sampled_verification_keeps_the_target_distribution(tiny):
    """Rejection sampling against a deterministic draft: with drafts of the greedy continuation as
    is, sampled outputs keep the plain engine's distribution (the first token from the prefill, the
    second from a verify where the first matched the draft)."""

    def drafter_for(prompt: list[int], greedy: list[int]) -> Any:
        d = OracleDrafter({tuple(prompt): greedy})
        d.propose = lambda state, tokens, k: greedy[len(tokens) - len(prompt):][:k]  # the greedy continuation, as is
        return d

    check_sampled_distribution(tiny, drafter_for)


def test_drafts_shrink_back_off_and_stop_under_load(tiny):
    """A request's drafts follow what its verifies kept (about twice that, plus one); after a verify
    keeping nothing it decodes plainly for 1, 2, 4, ... 16 steps; a batch with more requests than
    the verify token budget decodes plainly (speculation switches itself off under load)."""
    from core.engine.speculative import Pace

    pace = Pace()
    assert pace.want(11) == 5  # a new request: 1 + 2 * 2
    waits = []
    for _ in range(6):  # verifies keeping nothing: the plain steps before each next draft double
        pace.update(0)
        waits.append(0)
        while pace.want(11) == 0:
            waits[-1] += 1
    assert waits == [1, 2, 4, 8, 16, 16] and pace.want(11) == 2  # drafts of 1 + ceil(2 * ~0)
    pace.update(3)
    assert pace.backoff == 0 and pace.want(11) == 5 and pace.want(2) == 2

    plain, _ = generate(tiny)
    want = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain)}
    oracle = OracleDrafter(want)
    eng = make_engine(tiny, dtype="float32", device="cpu", speculative_algorithm="NGRAM")
    try:
        eng.engine.scheduler.speculator.drafter = oracle
        eng.engine.scheduler.speculator.token_budget = len(PROMPTS)  # no room for a draft beside the batch's tokens
        outs = eng.generate(input_ids=PROMPTS, sampling_params=[GREEDY] * len(PROMPTS))
        assert oracle.calls == 0 and [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        eng.engine.scheduler.speculator.token_budget = len(PROMPTS) + 6  # six draft tokens a verify, the most kept first
        outs = eng.generate(input_ids=PROMPTS, sampling_params=[GREEDY] * len(PROMPTS))
        assert oracle.calls > 0 and [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        assert sum(o["meta_info"]["spec_num_proposed_drafts"] for o in outs) <= 6 * max(o["meta_info"]["spec_verify_ct"] for o in outs)
    finally:
        eng.shutdown()


def test_spec_verify_ct_counts_the_decodes_of_mixed_batches(tiny):
    """--enable-mixed-chunk: a decode inside a mixed (prefill) batch produced a token from its own
    forward, as a verify does; it was not counted, so spec_accept_length came out too high."""
    short, long = [5 + j % 11 for j in range(10)], [7 + (j * 5) % 200 for j in range(200)]
    params = [{"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
              {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}]
    eng = make_engine(tiny, dtype="float32", device="cpu", speculative_algorithm="NGRAM", enable_mixed_chunk=True,
                      chunked_prefill_size=16)
    try:
        eng.engine.scheduler.speculator.drafter.propose = lambda state, tokens, k: []  # plain decodes only
        outs = eng.generate(input_ids=[short, long], sampling_params=params)
    finally:
        eng.shutdown()
    m = outs[0]["meta_info"]
    assert m["spec_verify_ct"] == m["completion_tokens"] - 1  # every token after the prefill's: its own decode


def test_a_step_waits_for_the_one_in_flight_only_where_it_may_verify():
    """Overlap scheduling with speculation (``Speculator.may_verify``): a verify in flight, or a
    small batch with a request due to draft, waits for the step in flight; a large batch waits
    only where its due requests want enough draft tokens to pass ``min_draft_share``, as
    ``verify_batch`` would ask; requests whose sampling reads their outputs never draft; a batch
    larger than the largest verify graph decodes plainly."""
    from types import SimpleNamespace

    from core.engine.speculative import Pace, Speculator

    def req(wait: int | None, kept: float = 0.0, kv_ahead: int = 0, grammar: Any = None):
        pace = None if wait is None else Pace(kept=kept, wait=wait)
        return SimpleNamespace(kv_len=10 + kv_ahead, seq_len=10, spec_pace=pace, grammar=grammar, return_logprob=False,
                               top_logprobs_num=0, return_hidden_states=False, may_read_outputs=False)

    spec = Speculator(NgramDrafter(None), 12, token_budget=256)  # (CUDA's budget)
    assert not spec.may_verify([req(3), req(1)])  # nobody due
    assert spec.may_verify([req(3), req(0)]) and spec.may_verify([req(None)])  # one due (a new request: due)
    assert spec.may_verify([req(3)] * 7 + [req(2, kv_ahead=3)])  # a verify in flight
    assert not spec.may_verify([req(0, grammar=object()), req(0)])  # (a grammar: the batch decodes plainly)
    big = [req(5) for _ in range(60)]
    assert not spec.may_verify(big + [req(0)] * 4)  # 4 due wanting 1 each: < half a draft per request
    assert spec.may_verify(big + [req(0, kept=5.0)] * 4)  # 4 due wanting 11 each: 44 >= 32
    spec.max_verify_reqs = 21  # (the largest verify graph: a larger verify would run eagerly)
    assert not spec.may_verify(big + [req(0, kept=5.0)] * 4) and spec.may_verify([req(0)] * 21)
    assert spec.verify_batch(None, [req(0)] * 22) is None
    spec.token_budget, spec.max_verify_reqs = 32, 0
    assert not spec.may_verify(big + [req(0, kept=5.0)] * 4)  # more requests than a verify holds tokens
