"""SGLang's relaxed acceptance (``--speculative-accept-threshold-single`` / ``-acc``, issue 43):
the walk follows SGLang's rule (a child kept where the node's uniform is at most the summed
probability of the siblings tried / acc, or its own probability reaches single; never a child the
filters drop); the target distributions it reads are the sampler's; at 1 and 1 the machinery
keeps the target's distribution through chains and trees, and below 1 it keeps drafts exactly as
often as the rule says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core.engine.sampler import Sampler, SamplingRow
from core.engine.sampling_params import SamplingParams
from core.engine.speculative.accept import Thresholds, relaxed_walk
from tests.conftest import build_tiny_llama, make_engine
from tests.test_speculative import GREEDY, PROMPTS, OracleDrafter, check_sampled_distribution


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-accept")
    build_tiny_llama(path, seed=3)
    return path


def test_the_walk_follows_sglangs_rule():
    chain, sampled = [10, 11], [7, 8, 9]
    # thresholds 1: u 0.5 above p 0.3: the root's child is rejected, the target's own sample stands
    assert relaxed_walk(chain, None, sampled, [0.3, 0.6], [0.5, 0.5, 0.0], Thresholds()) == ([], 7, [10])
    # acc 0.5: kept while u <= p / 0.5 (0.5 <= 0.6, then 0.5 <= 1.2), then the last node's sample
    assert relaxed_walk(chain, None, sampled, [0.3, 0.6], [0.5, 0.5, 0.0], Thresholds(acc=0.5)) == ([0, 1], 9, [])
    assert relaxed_walk(chain, None, sampled, [0.3, 0.6], [0.61, 0.5, 0.0], Thresholds(acc=0.5)) == ([], 7, [10])
    # single 0.25: a child at least that likely is kept whatever the coin; a less likely one is not
    assert relaxed_walk(chain, None, sampled, [0.3, 0.2], [0.9, 0.9, 0.0], Thresholds(single=0.25)) == ([0], 8, [11])
    # a child the filters drop (p 0) is never kept, even at single 0 and acc 0
    assert relaxed_walk(chain, None, sampled, [0.0, 0.5], [0.0, 0.0, 0.0], Thresholds(0.0, 0.0)) == ([], 7, [10])
    # siblings: their probabilities sum as they are tried (0.2, then 0.5 >= u 0.45: the second kept)
    tree, parents = [20, 21, 22], [-1, -1, 0]
    assert relaxed_walk(tree, parents, [1, 2, 3, 4], [0.2, 0.3, 0.9], [0.45, 0.0, 0.99, 0.0], Thresholds()) == ([1], 3, [])
    # all siblings rejected and the target sampled one of them: drawn again (None), without them
    assert relaxed_walk(tree, parents, [21, 2, 3, 4], [0.2, 0.3, 0.9], [0.6, 0.0, 0.0, 0.0], Thresholds()) == ([], None, [20, 21])


def test_target_probs_are_what_the_sampler_draws_from():
    """``Sampler.target_probs`` against a direct computation (logit bias, temperature, top-k,
    top-p, min-p; the kept prefix within the top 256 and past it), and against the sampler's
    own draws over a small vocabulary."""
    torch.manual_seed(0)
    vocab = 600
    logits = torch.randn(4, vocab) * 3
    logits[3] = torch.randn(vocab) * 0.01  # nearly flat: top-p 0.9 keeps ~540 tokens, past the top 256
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.8, logit_bias={"3": 4.0}),
              SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0, top_p=0.9)]
    rows = [SamplingRow(p, [], []) for p in params]
    got = Sampler(vocab).target_probs(logits.clone(), rows)
    for i, p in enumerate(params):
        x = logits[i].clone()
        for k, b in (p.logit_bias or {}).items():
            x[int(k)] += b
        probs = torch.softmax(x / p.temperature, dim=-1)
        s, order = probs.sort(descending=True)
        keep = torch.ones(vocab, dtype=torch.bool)
        if p.top_k > 0:
            keep &= torch.arange(vocab) < p.top_k
        keep &= (s.cumsum(0) - s) < p.top_p
        keep &= s >= s[0] * p.min_p
        want = torch.zeros(vocab).scatter(0, order, s * keep)
        assert torch.allclose(got[i], want / want.sum(), atol=1e-6), i
    assert 400 < int((got[3] > 0).sum()) < vocab
    # the sampler's own draws over 6 tokens follow them
    small = torch.randn(1, 6)
    row = SamplingRow(SamplingParams(temperature=0.8, top_p=0.85), [], [])
    sampler = Sampler(6, seed=1)
    draws = torch.tensor(sampler.sample(small.repeat(20000, 1), [row] * 20000).token_ids)
    freq = torch.bincount(draws, minlength=6).float() / 20000
    assert torch.allclose(freq, sampler.target_probs(small, [row])[0], atol=0.015)


def greedy_oracle(prompt: list[int], greedy: list[int]) -> Any:
    d = OracleDrafter({tuple(prompt): greedy})
    d.propose = lambda state, tokens, k: greedy[len(tokens) - len(prompt):][:k]  # the greedy continuation, as is
    return d


def test_thresholds_at_one_keep_the_target_distribution(tiny):
    """The relaxed walk at single 1 and acc 1 (the engine would take its exact walk there) is
    inverse-CDF sampling of the target: sampled outputs keep the plain engine's distribution."""
    check_sampled_distribution(tiny, greedy_oracle, accept=Thresholds())


def test_thresholds_at_one_keep_the_target_distribution_through_trees(tiny, monkeypatch):
    """As above through trees of a wrong first child and the greedy token per level: siblings'
    summed probabilities, and a fresh draw where the target's sample was a rejected child."""
    from tests.test_speculative_tree import TreeOracle, verify_trees_on_the_cpu

    verify_trees_on_the_cpu(monkeypatch)
    check_sampled_distribution(tiny, lambda prompt, greedy: TreeOracle({tuple(prompt): greedy}), max_new_tokens=4,
                               accept=Thresholds(), speculative_num_draft_tokens=5)


def first_two(path: Path, n: int, **engine: Any) -> tuple[list[int], list[list[int]]]:
    """The greedy continuation of ``PROMPTS[1]`` and ``n`` sampled outputs (temperature 1, top-k 4,
    3 tokens) of an engine whose NGRAM drafter drafts that greedy continuation, with ``engine``'s flags."""
    prompt = PROMPTS[1]
    sampled = {"max_new_tokens": 3, "temperature": 1.0, "top_k": 4, "ignore_eos": True}
    eng = make_engine(path, dtype="float32", device="cpu", max_running_requests=256, random_seed=2,
                      speculative_algorithm="NGRAM", **engine)
    try:
        greedy = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3})["output_ids"]
        eng.engine.scheduler.speculator.token_budget = 100_000  # (n requests: past any device's budget)
        eng.engine.scheduler.speculator.min_draft_share = 0
        eng.engine.scheduler.speculator.drafter = greedy_oracle(prompt, greedy)
        outs = [o["output_ids"] for o in eng.generate(input_ids=[prompt] * n, sampling_params=sampled)]
        seeded = [eng.generate(input_ids=prompt, sampling_params={**sampled, "seed": 7})["output_ids"] for _ in range(2)]
        assert seeded[0] == seeded[1]  # a seed still fixes the output
        eng.engine.scheduler.check_accounting()
    finally:
        eng.shutdown()
    return greedy, outs


def test_below_one_drafts_are_kept_as_the_rule_says(tiny):
    """After the greedy first token the draft is the greedy second token, of target probability p
    (temperature 1, top-k 4; from transformers): at acc 0.5 it comes out with probability
    min(1, 2p) (p without speculation), at single 0 always; at acc 1 and single just above p, p."""
    from transformers import AutoModelForCausalLM

    n = 1500
    greedy, outs = first_two(tiny, n, speculative_accept_threshold_acc=0.5)
    model = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1] + greedy[:1]])).logits[0, -1]
    top = torch.softmax(logits.topk(4).values, dim=-1)
    p = float(top[0])
    assert 0.2 < p < 0.6, p  # (room for the rule to show: 2p differs from p by far more than the noise)
    after = [o for o in outs if o[0] == greedy[0]]
    assert len(after) > 200
    rate = sum(o[1] == greedy[1] for o in after) / len(after)
    assert abs(rate - min(1.0, 2 * p)) < 0.07, (rate, p)
    _, outs = first_two(tiny, 400, speculative_accept_threshold_single=0.0)
    after = [o for o in outs if o[0] == greedy[0]]
    assert after and all(o[1] == greedy[1] for o in after)
    _, outs = first_two(tiny, n, speculative_accept_threshold_single=p + 0.01)
    after = [o for o in outs if o[0] == greedy[0]]
    assert abs(sum(o[1] == greedy[1] for o in after) / len(after) - p) < 0.07


@pytest.mark.parametrize("kwargs,match", [
    ({"speculative_algorithm": "NGRAM", "speculative_accept_threshold_acc": 1.5}, r"threshold-acc must be within \[0, 1\]"),
    ({"speculative_algorithm": "NGRAM", "speculative_accept_threshold_single": -0.1}, "threshold-single"),
    ({"speculative_accept_threshold_acc": 0.5}, "needs --speculative-algorithm"),
])
def test_bad_thresholds_are_clear_errors(tiny, kwargs, match):
    from core.errors import CoreError

    with pytest.raises(CoreError, match=match):
        make_engine(tiny, dtype="float32", device="cpu", **kwargs)
