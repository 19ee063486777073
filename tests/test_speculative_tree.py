"""Draft trees (issue 43): a drafter may return a ``DraftTree``; the engine verifies it in one
forward under a tree mask (positions are depths), keeps the path the target's samples follow, and
moves the kept nodes' KV to their positions right after the verify. An oracle tree
whose right branch is never the first child makes every kept node move: greedy output equals
plain decoding's, also from a second round that reads the moved KV from the prefix cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.engine.speculative.tree import depths, first_chain, kv_moves, mask_rows, walk
from core.interfaces import DraftTree
from tests.conftest import make_engine
from tests.test_speculative import GREEDY, PROMPTS, tiny  # noqa: F401  (tiny: the fixture, shared)


class TreeOracle:
    """Per depth a wrong sibling first, then the reference token, each under the previous
    reference node: the kept path runs through second children only."""

    def __init__(self, want: dict[tuple[int, ...], list[int]]) -> None:
        self.want, self.calls = want, 0

    def propose(self, state: dict, tokens, max_tokens: int) -> DraftTree:
        self.calls += 1
        prompt = next(p for p in self.want if tuple(tokens[:len(p)]) == p)
        done = len(tokens) - len(prompt)
        toks, parents, last = [], [], -1
        for t in self.want[prompt][done:done + max_tokens // 2]:
            toks += [(t + 1) % 256, t]
            parents += [last, last]
            last = len(toks) - 1
        return DraftTree(toks, parents)


def generate(path: Path, drafter: Any = None, trees: bool | None = None, prompts: list[list[int]] = PROMPTS,
             **kwargs: Any) -> tuple[list[dict], Any]:
    eng = make_engine(path, dtype="float32", device="cpu", **kwargs)
    try:
        if drafter is not None:
            eng.engine.scheduler.speculator.drafter = drafter
        if trees is not None:
            eng.engine.scheduler.speculator.trees = trees
        outs = eng.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts))
        eng.engine.scheduler.check_accounting()
        return outs, eng.engine
    finally:
        eng.shutdown()


def test_tree_helpers():
    parents = [-1, -1, 1, 1, 3]  # node 0 and 1 under the root; 2 and 3 under 1; 4 under 3
    assert depths(parents) == [1, 1, 2, 2, 3]
    m = mask_rows(parents, 6)
    rows = [[j for j in range(6) if m[i * 6 + j]] for i in range(6)]
    assert rows == [[0], [0, 1], [0, 2], [0, 2, 3], [0, 2, 4], [0, 2, 4, 5]]
    assert mask_rows(None, 3) == [True, False, False, True, True, False, True, True, True]
    tokens = [10, 11, 12, 13, 14]
    assert walk(tokens, parents, [11, 0, 13, 0, 14, 99]) == ([1, 3, 4], 99)  # root -> 11 -> 13 -> 14, then 99
    assert walk(tokens, parents, [10, 7, 0, 0, 0, 0]) == ([0], 7)
    assert walk(tokens, parents, [42, 0, 0, 0, 0, 0]) == ([], 42)
    assert walk([10, 11], None, [10, 11, 5]) == ([0, 1], 5)  # a chain
    assert first_chain(tokens, parents) == [10]
    assert first_chain([1, 2, 3, 4], [-1, 0, 0, 1]) == [1, 2, 4]
    import torch

    slots = torch.arange(100, 120)
    # kv_len 4: the root at column 4, node j at 5 + j; kept nodes 1, 3, 4 belong at columns 5, 6, 7
    assert kv_moves(4, [1, 3, 4], slots) == ([106, 108, 109], [105, 106, 107])
    assert kv_moves(4, [0, 1], slots) == ([], [])


@pytest.mark.parametrize("variant", [{}, {"page_size": 4}, {"chunked_prefill_size": 16}, {"attention_backend": "torch_native"}],
                         ids=["cpu", "page_size_4", "chunked", "torch_native"])
def test_trees_verify_in_one_forward_and_keep_the_targets_path(tiny, variant):
    plain, _ = generate(tiny, **variant)
    want = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain)}
    oracle = TreeOracle(want)
    assert not generate(tiny, None, prompts=PROMPTS[:1], speculative_algorithm="NGRAM")[1].scheduler.speculator.trees
    # (a chain drafter's trees are cut to chains on the CPU, where they cost the fused layers; verified whole here)
    spec, engine = generate(tiny, oracle, True, speculative_algorithm="NGRAM", speculative_num_draft_tokens=9, **variant)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert oracle.calls > 0
    for o in spec:
        m = o["meta_info"]
        assert m["spec_num_correct_drafts"] * 2 >= m["spec_num_proposed_drafts"] - 2  # every right node kept
        assert m["spec_verify_ct"] <= len(o["output_ids"]) // 4 + 2
    # the kept nodes' moved KV went to the prefix cache: a second round over it gives plain tokens
    again, _ = generate(tiny, TreeOracle(want), True, speculative_algorithm="NGRAM", speculative_num_draft_tokens=9, **variant)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in plain]


def test_without_tree_masks_the_first_chain_is_verified(tiny):
    plain, _ = generate(tiny)
    want = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain)}
    spec, _ = generate(tiny, TreeOracle(want), trees=False, speculative_algorithm="NGRAM", speculative_num_draft_tokens=9)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    # the first chain is the wrong first child alone: nothing is kept
    assert all(o["meta_info"]["spec_num_correct_drafts"] == 0 < o["meta_info"]["spec_num_proposed_drafts"] for o in spec)


def verify_trees_on_the_cpu(monkeypatch) -> None:
    """Trees verified whole on the CPU too (it cuts a chain drafter's trees to their first chain by default)."""
    from core.engine.speculative import Speculator

    load = Speculator.load

    def load_with_trees(self: Speculator, ctx: Any) -> None:
        load(self, ctx)
        self.trees = True

    monkeypatch.setattr(Speculator, "load", load_with_trees)


def test_sampled_tree_verification_keeps_the_target_distribution(tiny, monkeypatch):
    """Sampling through trees: per level a wrong first child and the greedy token; the kept path
    follows the target's own samples, so the sampled outputs keep the plain engine's distribution
    (and a verify that kept the first child regardless fails this)."""
    from tests.test_speculative import check_sampled_distribution

    verify_trees_on_the_cpu(monkeypatch)
    check_sampled_distribution(tiny, lambda prompt, greedy: TreeOracle({tuple(prompt): greedy}), max_new_tokens=4,
                               speculative_num_draft_tokens=5)


def test_a_batch_of_chains_is_verified_causally(tiny):
    """Chains alone never build a tree mask: the verify keeps the causal path (the CPU's fused
    layers), as a batch holding a tree does not."""
    import core.engine.model_runner as runner

    seen: list[bool] = []
    forward = runner.forward_batch

    def spy(inputs, backend, device):
        seen.append(inputs.tree_mask is not None)
        return forward(inputs, backend, device)

    runner.forward_batch = spy
    try:
        plain, _ = generate(tiny)
        want = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain)}
        seen.clear()
        from tests.test_speculative import OracleDrafter

        spec, _ = generate(tiny, OracleDrafter(want), speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
        assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
        assert seen and not any(seen)
        seen.clear()
        generate(tiny, TreeOracle(want), True, speculative_algorithm="NGRAM", speculative_num_draft_tokens=9)
        assert any(seen)
    finally:
        runner.forward_batch = forward


def test_a_large_batch_with_few_drafts_decodes_plainly(tiny):
    """More than SMALL_BATCH requests and under ``min_draft_share`` draft tokens per request: the
    batch decodes plainly (a verify would run every row through the extend path for little)."""
    from core.engine.speculative import SMALL_BATCH

    prompts = [[5 + (i * 7 + j) % 13 for j in range(20 + i)] for i in range(SMALL_BATCH + 2)]

    class OneRequest:  # drafts one (right or wrong) token for the first prompt only
        def propose(self, state, tokens, max_tokens):
            return [7] if tokens[:len(prompts[0])] == prompts[0] and len(tokens) >= len(prompts[0]) else []

    for share, drafted in ((0.5, False), (0.0, True)):
        eng = make_engine(tiny, dtype="float32", device="cpu", speculative_algorithm="NGRAM")
        try:
            eng.engine.scheduler.speculator.drafter = OneRequest()
            eng.engine.scheduler.speculator.min_draft_share = share
            outs = eng.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts))
            assert (outs[0]["meta_info"].get("spec_num_proposed_drafts", 0) > 0) is drafted
        finally:
            eng.shutdown()


def test_a_seeded_tree_gives_plain_decodings_samples(tiny):
    """A tree node at depth d samples with the draw a plain decode d tokens on would take, whatever
    its row and however many siblings share its depth (each drew the next number before)."""
    seeded = [{"max_new_tokens": 16, "temperature": 0.7, "sampling_seed": 100 + i, "ignore_eos": True}
              for i in range(len(PROMPTS))]

    def run(**kw: Any) -> list[dict]:
        eng = make_engine(tiny, dtype="float32", device="cpu", **kw)
        try:
            if kw:
                eng.engine.scheduler.speculator.drafter, eng.engine.scheduler.speculator.trees = TreeOracle(want), True
            outs = eng.generate(input_ids=PROMPTS, sampling_params=seeded)
            eng.engine.scheduler.check_accounting()
            return outs
        finally:
            eng.shutdown()

    want: dict = {}
    plain = run()
    want.update({tuple(p): o["output_ids"] for p, o in zip(PROMPTS, plain)})
    spec = run(speculative_algorithm="NGRAM", speculative_num_draft_tokens=9)
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in spec) > 0
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_host_copy_of_a_tree_verified_answer_holds_the_moved_kv(tiny, policy, monkeypatch):
    """A request that finishes in a tree verify whose kept nodes moved: its pages enter the prefix
    cache (write_through: copied to the host at once); loaded back from the host later, they give
    plain decoding's tokens, so the moves were made before the copy."""
    prompt = PROMPTS[0]
    plain = make_engine(tiny, dtype="float32", device="cpu", disable_radix_cache=True)
    try:
        g = plain.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        q = prompt + g[:20]
        ref = plain.generate(input_ids=q, sampling_params=GREEDY)["output_ids"]
    finally:
        plain.shutdown()
    for m in [k for k in range(6, 22) if g[k] not in g[:k]]:
        eng = make_engine(tiny, dtype="float32", device="cpu", speculative_algorithm="NGRAM", speculative_num_draft_tokens=9,
                          enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy=policy)
        try:
            spec = eng.engine.scheduler.speculator
            spec.trees, spec.drafter = True, TreeOracle({tuple(prompt): g})
            moved: list = []
            verified = type(spec).verified
            monkeypatch.setattr(type(spec), "verified", lambda *a: moved.append(verified(*a)) or moved[-1])
            out = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "stop_token_ids": [g[m]]})
            assert out["output_ids"] == g[:m + 1]
            if moved[-1] is None:
                continue  # the last verify moved nothing: another length
            spec.drafter.propose = lambda state, tokens, k: []
            tree = eng.engine.tree_cache
            tree.settle()
            eng.engine.scheduler.allocator.free(tree.evict(10_000))  # every unused prefix leaves the device
            assert tree.host_used_pages > 0
            again = eng.generate(input_ids=q, sampling_params=GREEDY)
            assert again["meta_info"]["cached_tokens"] >= len(prompt) + m - 1  # loaded back from the host
            assert again["output_ids"] == ref
            return
        finally:
            eng.shutdown()
    raise AssertionError("no answer length ended in a verify that moved KV")
