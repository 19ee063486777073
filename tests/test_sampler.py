"""Behavioural tests for core.engine.sampler: filters, penalties, seeding, logprobs, edge cases."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from core.engine.sampler import SampleOutput, Sampler, SamplingRow, apply_min_tokens, apply_penalties
from core.engine.sampling_params import SamplingParams


def row(prompt: list[int] | None = None, output: list[int] | None = None, *, seed: int | None = None, **kw) -> SamplingRow:
    """A row with SamplingParams built from keyword arguments that name its fields."""
    extra = {k: kw.pop(k) for k in ("eos_ids", "return_logprob", "top_logprobs_num") if k in kw}
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**kw), list(prompt or []), list(output or []), generator=gen, **extra)


def probs_logits(probs: list[float], n: int = 1) -> torch.Tensor:
    """[n, V] logits whose softmax is exactly ``probs``."""
    return torch.tensor(probs).log().repeat(n, 1)


def draw(probs: list[float], n: int = 2000, seed: int = 0, **kw) -> torch.Tensor:
    """Sample ``n`` identical rows in one call and return the chosen ids."""
    logits = probs_logits(probs, n)
    out = Sampler(len(probs), seed=seed).sample(logits, [row(**kw) for _ in range(n)])
    return torch.tensor(out.token_ids)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


P = [0.5, 0.3, 0.15, 0.05]


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_picks_argmax_for_temperature_zero_and_top_k_one() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(-1).tolist()
    rows = [row(temperature=0.0) for _ in range(3)] + [row(top_k=1, temperature=1.5) for _ in range(3)]
    out = Sampler(100).sample(logits.clone(), rows)
    assert out.token_ids == expected
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_bf16_logits_pick_what_float32_logits_pick() -> None:
    """A greedy batch of bf16 logits takes their argmax as is (no float32 copy), ties to the first
    index; with logprobs asked, it goes through float32 as before. Same tokens either way."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)).bfloat16()
    logits[1, 7] = logits[1, 200] = 40.0  # a tie: the first
    want = logits.float().argmax(-1).tolist()
    out = Sampler(300).sample(logits.clone(), [row(temperature=0.0) for _ in range(5)])
    assert out.token_ids == want and out.token_ids[1] == 7 and out.logprobs is None
    with_lp = Sampler(300).sample(logits.clone(), [row(temperature=0.0, return_logprob=True) for _ in range(5)])
    assert with_lp.token_ids == want
    assert with_lp.logprobs == pytest.approx(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(want)[:, None])
                                             .squeeze(1).tolist())


def test_a_forward_computed_argmax_stands_in_for_the_samplers_own() -> None:
    """argmax_ids (the CPU decode stack's, computed with the logits) are the tokens of a plain
    greedy batch, with or without logprobs (which still come from the logits); a batch that
    penalises or samples picks from the logits, the given ids only its all-masked rows' fallback."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    known = torch.tensor([7, 8, 9])  # not the logits' argmax: proves which one was taken
    assert logits.argmax(-1).tolist() != known.tolist()
    assert Sampler(50).sample(logits.clone(), [row(temperature=0.0)] * 3, known).token_ids == [7, 8, 9]
    with_lp = Sampler(50).sample(logits.clone(), [row(temperature=0.0, return_logprob=True)] * 3, known)
    assert with_lp.token_ids == [7, 8, 9]
    assert with_lp.logprobs == pytest.approx(torch.log_softmax(logits, -1)[[0, 1, 2], [7, 8, 9]].tolist())
    penalised = Sampler(50).sample(logits.clone(), [row([1], temperature=0.0, frequency_penalty=0.5)] * 3, known)
    assert penalised.token_ids != [7, 8, 9]
    masked = logits.clone()
    masked[1] = float("-inf")  # nothing left after the bias either: the given argmax is the fallback
    biased = Sampler(50).sample(masked, [row(temperature=0.0, logit_bias={"3": 1.0})] * 3, known)
    assert biased.token_ids[1] == 8 and biased.token_ids[0] == (logits[0] + torch.eye(50)[3]).argmax().item()


def test_greedy_consumes_no_randomness() -> None:
    s = Sampler(10, seed=3)
    before = s.generator.get_state()
    s.sample(torch.randn(4, 10), [row(temperature=0.0) for _ in range(4)])
    assert torch.equal(before, s.generator.get_state())


# --- filters ----------------------------------------------------------------------------------


def test_plain_sampling_follows_the_distribution() -> None:
    freq = frequencies(draw(P, n=4000), 4)
    assert torch.allclose(freq, torch.tensor(P), atol=0.03)


def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(7))
    best5 = set(logits[0].topk(5).indices.tolist())
    n = 2000
    out = Sampler(50).sample(logits.repeat(n, 1), [row(top_k=5) for _ in range(n)])
    assert set(out.token_ids) == best5  # all five are reachable, nothing else is


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_disables(top_k: int) -> None:
    assert set(draw(P, top_k=top_k).tolist()) == {0, 1, 2, 3}


def test_top_p_excludes_the_tail() -> None:
    assert set(draw(P, top_p=0.7).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    tokens = draw(P, top_p=0.9)  # 0.8 < 0.9 <= 0.95
    assert set(tokens.tolist()) == {0, 1, 2}
    # Renormalised over the kept set.
    assert torch.allclose(frequencies(tokens, 4)[:3], torch.tensor(P[:3]) / 0.95, atol=0.04)


def test_top_p_always_keeps_the_best_token() -> None:
    assert set(draw(P, n=200, top_p=1e-6).tolist()) == {0}
    assert set(draw(P, n=200, top_p=0.0).tolist()) == {0}  # unvalidated params must not empty the set


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    # threshold 0.25 * 0.5 = 0.125: keeps 0.5, 0.3, 0.15; drops 0.05
    assert set(draw(P, min_p=0.25).tolist()) == {0, 1, 2}
    assert set(draw(P, min_p=0.7).tolist()) == {0}


def test_filters_combine_per_row_in_one_batch() -> None:
    n = 1500
    kinds = [dict(top_k=1), dict(top_k=2), dict(top_p=0.9), dict(min_p=0.5), dict()]
    rows = [row(**kinds[i % len(kinds)]) for i in range(n)]
    toks = torch.tensor(Sampler(4).sample(probs_logits(P, n), rows).token_ids)
    allowed = [{0}, {0, 1}, {0, 1, 2}, {0, 1}, {0, 1, 2, 3}]
    for j, ok in enumerate(allowed):
        assert set(toks[j :: len(kinds)].tolist()) == ok


def _full_sort_reference(logits: torch.Tensor, params: list[dict], uniforms: list[float]) -> tuple[list[int], list[int]]:
    """Row by row, what the sampler promises: unfiltered rows sample the unsorted distribution;
    filtered rows sort the whole vocabulary, keep the prefix their filters keep, and sample it.
    Returns the tokens and each row's kept prefix length."""
    out, kept = [], []
    for x, p, u in zip(logits, params, uniforms):
        probs = torch.softmax(x / p.get("temperature", 1.0), dim=-1)
        top_k, top_p, min_p = p.get("top_k", -1), p.get("top_p", 1.0), p.get("min_p", 0.0)
        if not (0 < top_k < len(x) or top_p < 1.0 or min_p > 0.0):
            order = torch.arange(len(x))
        else:
            probs, order = probs.sort(descending=True)
            keep = torch.ones(len(x), dtype=torch.bool)
            if 0 < top_k < len(x):
                keep[top_k:] = False
            if top_p < 1.0:
                keep &= (probs.cumsum(0) - probs) < top_p
            keep &= probs >= probs[0] * min_p
            keep[0] = True
            probs = probs.masked_fill(~keep, 0.0)
        kept.append(int(probs.count_nonzero()))
        cdf = probs.cumsum(0)
        pos = min(int((cdf <= u * cdf[-1]).sum()), int((cdf < cdf[-1]).sum()))
        out.append(int(order[pos]))
    return out, kept


ROUTES = [dict(), dict(temperature=0.8), dict(top_k=10), dict(top_k=300), dict(top_p=0.5), dict(top_p=0.97, temperature=3.0),
          dict(min_p=0.05), dict(min_p=0.001, temperature=4.0), dict(top_k=400, top_p=0.9, temperature=2.0)]


@pytest.mark.parametrize("plain_rows", ["cpu_loop", "torch_ops"])
def test_every_route_samples_what_a_full_sort_samples(monkeypatch, plain_rows) -> None:
    """Unsorted (no filter: the CPU's C++ loop, or the torch ops a GPU runs), the top-256
    candidates (the kept prefix lies there) and the full sort (a flat distribution whose nucleus
    is wider) give the reference's exact tokens; only the rows that need it sort the whole vocabulary."""
    if plain_rows == "torch_ops":
        import core.layers

        monkeypatch.setattr(core.layers, "fused", lambda x: None)
    vocab, n = 1000, len(ROUTES) * 6
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=g) * 4  # peaked enough that top_p=0.5 fits the candidates
    params = [ROUTES[i % len(ROUTES)] for i in range(n)]
    rows = [row(seed=500 + i, **p) for i, p in enumerate(params)]
    uniforms = [torch.rand(1, generator=torch.Generator().manual_seed(500 + i)).item() for i in range(n)]
    sorted_rows = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda t, *a, **k: sorted_rows.append(t.shape[0]) or real_sort(t, *a, **k))
    out = Sampler(vocab).sample(logits.clone(), rows)
    monkeypatch.setattr(torch.Tensor, "sort", real_sort)
    tokens, kept = _full_sort_reference(logits, params, uniforms)
    assert out.token_ids == tokens
    # exactly the filtered rows whose kept prefix is wider than the candidates sort everything
    wide = sum(1 for p, n_kept in zip(params, kept) if p and set(p) != {"temperature"} and n_kept > 256)
    assert 6 <= wide < n // 2 and sorted_rows == [wide]


def test_a_batch_without_filters_never_sorts(monkeypatch) -> None:
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: pytest.fail("sorted an unfiltered batch"))
    monkeypatch.setattr(torch.Tensor, "topk", lambda *a, **k: pytest.fail("topk on an unfiltered batch"))
    out = Sampler(4, seed=1).sample(probs_logits(P, 3000), [row(temperature=1.0) for _ in range(3000)])
    assert torch.allclose(frequencies(torch.tensor(out.token_ids), 4), torch.tensor(P), atol=0.03)


def test_temperature_sharpens_and_flattens() -> None:
    cold = frequencies(draw(P, temperature=0.1), 4)
    assert cold[0] > 0.99
    hot = frequencies(draw(P, n=4000, temperature=100.0), 4)
    assert torch.allclose(hot, torch.full((4,), 0.25), atol=0.04)


def test_tiny_temperature_overflow_falls_back_to_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0e5, 2.0]])
    out = Sampler(3).sample(logits, [row(temperature=1e-40)])
    assert out.token_ids == [1]


# --- penalties --------------------------------------------------------------------------------


def test_repetition_penalty_exact_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(logits, [row(prompt=[0], output=[1, 1], repetition_penalty=2.0)])
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, 0.5]]))


def test_frequency_and_presence_penalty_exact_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    r = row(prompt=[3, 3], output=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [r])
    # prompt tokens are not counted; token 1 appeared twice, token 2 once
    assert torch.allclose(out, torch.tensor([[2.0, -2.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25, 0.5]]))


def test_penalties_combine_repetition_first_and_are_per_row() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]]).repeat(2, 1)
    rows = [
        row(prompt=[0], output=[2, 2], repetition_penalty=2.0, frequency_penalty=1.0),
        row(prompt=[0], output=[2, 2]),  # defaults: untouched
    ]
    out = apply_penalties(logits, rows)
    assert torch.allclose(out[0], torch.tensor([1.0, -2.0, 0.5 - 2.0, 0.5]))
    assert torch.equal(out[1], torch.tensor([2.0, -2.0, 1.0, 0.5]))


def test_penalties_noop_with_defaults_and_ignore_out_of_range_ids() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    assert torch.equal(apply_penalties(logits.clone(), [row(output=[0, 1])]), logits)
    out = apply_penalties(logits.clone(), [row(output=[5, -1, 0], presence_penalty=1.0)])
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 1.0]]))


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    s = Sampler(3)
    assert s.sample(logits.clone(), [row(output=[0], temperature=0.0)]).token_ids == [0]
    assert s.sample(logits.clone(), [row(output=[0], temperature=0.0, repetition_penalty=2.0)]).token_ids == [1]


def test_a_denormal_repetition_penalty_never_picks_a_masked_token() -> None:
    """5e-324 is a valid (> 0) penalty but 0.0 in float32, and a masked (-inf) logit times 0 is NaN,
    which argmax and sampling would pick: a grammar's mask was once broken this way."""
    logits = torch.tensor([[-math.inf, 1.0, -math.inf, 0.5]])  # tokens 0 and 2 masked out
    for temperature in (0.0, 1.0):
        r = row(prompt=[0, 2], output=[1], repetition_penalty=5e-324, temperature=temperature)
        out = Sampler(4).sample(logits.clone(), [r])
        assert out.token_ids[0] in (1, 3)
    penalised = apply_penalties(logits.clone(), [row(prompt=[0, 2], output=[1], repetition_penalty=5e-324)])
    assert not penalised.isnan().any() and penalised[0, 0] == -math.inf


# --- logit_bias -------------------------------------------------------------------------------


def test_logit_bias_moves_greedy_and_sampled_choices_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, 1.0]]).repeat(3, 1)
    rows = [row(temperature=0.0, logit_bias={"2": 5.0}),  # 0 + 5 beats 3
            row(temperature=0.0, logit_bias={"0": -100}),  # the best is banned: the runner-up wins
            row(temperature=0.0)]  # untouched in the same batch
    assert Sampler(4).sample(logits.clone(), rows).token_ids == [2, 1, 0]
    banned = [row(temperature=1.0, seed=s, logit_bias={"0": -100, "1": -100}) for s in range(200)]
    tokens = Sampler(4).sample(torch.tensor([[3.0, 2.9, 0.0, 0.1]]).repeat(200, 1), banned).token_ids
    assert set(tokens) <= {2, 3} and len(set(tokens)) == 2


def test_logit_bias_adds_after_penalties_and_keeps_masked_tokens_out() -> None:
    logits = torch.tensor([[2.0, -math.inf, 1.0]])
    out = Sampler(3).sample(logits.clone(), [row(temperature=0.0, logit_bias={"1": 100, "2": 0.5},
                                                 output=[0], repetition_penalty=2.0)])
    assert out.token_ids == [2]  # 0: 2/2 = 1; 1: masked stays -inf; 2: 1 + 0.5


@pytest.mark.parametrize("bias", [{"x": 1}, {"-1": 1}, {"4": 1}, {"1": 101}, {"1": "5"}, {"1": True}, [1]])
def test_bad_logit_bias_is_an_invalid_request(bias) -> None:
    from core.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as e:
        SamplingParams(logit_bias=bias).validate(vocab_size=4)
    assert e.value.param == "logit_bias"


# --- min_new_tokens ---------------------------------------------------------------------------


def test_min_new_tokens_blocks_eos_and_stop_ids_then_releases() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])  # eos=0, stop=1
    kw = dict(temperature=0.0, min_new_tokens=2, stop_token_ids=[1], eos_ids=(0,))
    s = Sampler(4)
    assert s.sample(logits.clone(), [row(output=[3], **kw)]).token_ids == [2]
    assert s.sample(logits.clone(), [row(output=[3, 3], **kw)]).token_ids == [0]
    # ignore_eos is the scheduler's business: EOS is still blocked before min_new_tokens.
    assert s.sample(logits.clone(), [row(output=[], ignore_eos=True, **kw)]).token_ids == [2]


def test_min_new_tokens_blocks_in_sampled_rows() -> None:
    n = 1000
    rows = [row(output=[], min_new_tokens=1, eos_ids=(0,), stop_token_ids=[1]) for _ in range(n)]
    toks = Sampler(4).sample(probs_logits(P, n), rows).token_ids
    assert set(toks) == {2, 3}


def test_apply_min_tokens_marks_only_short_rows() -> None:
    logits = torch.zeros(2, 3)
    apply_min_tokens(logits, [row(output=[], min_new_tokens=1, eos_ids=(2,)), row(output=[1], min_new_tokens=1, eos_ids=(2,))])
    assert logits[0].tolist() == [0.0, 0.0, -math.inf] and logits[1].tolist() == [0.0, 0.0, 0.0]


def test_all_blocked_row_falls_back_to_raw_argmax() -> None:
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    rows = [row(output=[], min_new_tokens=1, eos_ids=(0, 1), temperature=t) for t in (0.0, 1.0)]
    assert Sampler(2).sample(logits, rows).token_ids == [1, 1]


# --- seeding ----------------------------------------------------------------------------------


def _generate(seed: int, index: int, others: int, sampler_seed: int, steps: int = 15) -> list[int]:
    """Sample ``steps`` tokens for a seeded row placed at ``index`` among noisy neighbours."""
    vocab = 500
    logits_gen = torch.Generator().manual_seed(99)
    target = torch.randn(steps, vocab, generator=logits_gen)
    sampler = Sampler(vocab, seed=sampler_seed)
    noise = torch.Generator().manual_seed(sampler_seed)
    out: list[int] = []
    for t in range(steps):
        rows = [row(output=list(out), seed=None if i % 2 else 1000 + i, temperature=0.7 + 0.1 * i) for i in range(others)]
        me = row(output=list(out), temperature=1.3, top_p=0.95)
        me.generator = torch.Generator().manual_seed(seed)
        for _ in range(t):  # advance to step t as a persistent per-request generator would be
            torch.rand(1, generator=me.generator)
        rows.insert(index, me)
        logits = torch.randn(len(rows), vocab, generator=noise)
        logits[index] = target[t]
        out.append(sampler.sample(logits, rows).token_ids[index])
    return out


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    alone = _generate(seed=42, index=0, others=0, sampler_seed=0)
    batched = _generate(seed=42, index=3, others=5, sampler_seed=123)
    assert alone == batched
    assert len(set(alone)) > 5  # actually sampled, not degenerate


def test_different_seeds_differ() -> None:
    a = _generate(seed=1, index=0, others=0, sampler_seed=0)
    b = _generate(seed=2, index=0, others=0, sampler_seed=0)
    assert sum(x != y for x, y in zip(a, b)) > len(a) // 2


def test_unseeded_rows_follow_sampler_seed() -> None:
    logits = torch.zeros(64, 1000)
    rows = [row() for _ in range(64)]
    a = Sampler(1000, seed=5).sample(logits.clone(), rows).token_ids
    b = Sampler(1000, seed=5).sample(logits.clone(), rows).token_ids
    c = Sampler(1000, seed=6).sample(logits.clone(), rows).token_ids
    assert a == b and a != c


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_of_chosen_token() -> None:
    raw = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    rows = [
        row(output=[0, 1], return_logprob=True, temperature=0.5, repetition_penalty=1.5, top_k=3),
        row(return_logprob=True, temperature=0.0, frequency_penalty=1.0, output=[2]),
        row(top_logprobs_num=5, top_p=0.5),
        row(),
    ]
    out = Sampler(30).sample(raw.clone(), rows)
    expected = torch.log_softmax(raw, -1)
    assert out.logprobs is not None and len(out.logprobs) == 4
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(expected[i, tok].item(), abs=1e-5)
    assert out.top_logprobs is not None
    assert out.top_logprobs[0] == [] and out.top_logprobs[1] == [] and out.top_logprobs[3] == []
    top = out.top_logprobs[2]
    assert [t for t, _ in top] == expected[2].topk(5).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert top[0][1] == pytest.approx(expected[2].max().item(), abs=1e-5)


def test_top_logprobs_capped_at_vocab() -> None:
    out = Sampler(3).sample(torch.randn(1, 3), [row(top_logprobs_num=10, temperature=0.0)])
    assert out.top_logprobs is not None and len(out.top_logprobs[0]) == 3


# --- vocab padding, dtypes, purity ------------------------------------------------------------


def test_padded_vocab_columns_never_sampled() -> None:
    n, vocab = 1000, 8
    logits = torch.zeros(n, 12)
    logits[:, vocab:] = 100.0  # garbage in padded columns must not win
    rows = [row(temperature=0.0)] + [row(temperature=2.0, return_logprob=True) for _ in range(n - 1)]
    out = Sampler(vocab).sample(logits, rows)
    assert max(out.token_ids) < vocab and len(set(out.token_ids)) == vocab
    assert out.logprobs is not None and out.logprobs[1] == pytest.approx(-math.log(vocab), abs=1e-5)


def test_mixed_greedy_and_sampled_batch() -> None:
    n = 1000
    rows = [row(temperature=0.0) if i % 2 == 0 else row() for i in range(n)]
    toks = torch.tensor(Sampler(4).sample(probs_logits([0.3, 0.4, 0.2, 0.1], n), rows).token_ids)
    assert set(toks[0::2].tolist()) == {1}
    assert set(toks[1::2].tolist()) == {0, 1, 2, 3}


def test_bfloat16_logits_accepted() -> None:
    out = Sampler(5).sample(torch.arange(10, dtype=torch.bfloat16).view(2, 5), [row(temperature=0.0), row()])
    assert out.token_ids[0] == 4 and 0 <= out.token_ids[1] < 5


def test_rows_are_not_mutated() -> None:
    rows = [row(prompt=[1, 2], output=[3], repetition_penalty=1.3, min_new_tokens=5, eos_ids=(0,), seed=1, top_logprobs_num=2)]
    snapshot = copy.deepcopy((rows[0].params, rows[0].prompt_ids, rows[0].output_ids, rows[0].eos_ids))
    out = Sampler(10).sample(torch.randn(1, 10), rows)
    assert isinstance(out, SampleOutput)
    assert (rows[0].params, rows[0].prompt_ids, rows[0].output_ids, rows[0].eos_ids) == snapshot


# --- penalty state kept across steps ----------------------------------------------------------


def test_kept_penalty_state_matches_rebuilding_it_every_step() -> None:
    """A sampler with per-slot state penalises exactly as one that rebuilds the counts from the
    rows' lists each step, while requests come and go: a slot reused by a new request, a request
    that comes back in another slot with its output (as after a retraction), unpenalised rows
    in between (so only some rows are penalised)."""
    vocab, steps = 40, 14
    gen = torch.Generator().manual_seed(5)
    kept, fresh = Sampler(vocab, num_slots=4), Sampler(vocab)
    kinds = {"a": dict(repetition_penalty=1.5), "b": dict(frequency_penalty=0.7), "c": dict(presence_penalty=0.9),
             "d": dict(), "e": dict(repetition_penalty=0.8, frequency_penalty=0.2)}
    prompts = {k: torch.randint(0, vocab, (6,), generator=gen).tolist() for k in kinds}
    outputs: dict[str, list[int]] = {k: [] for k in kinds}  # one list per request, kept like Req.output_ids
    slots = {"a": 0, "b": 1, "c": 2, "d": 3}
    for t in range(steps):
        if t == 5:  # c finishes; e takes its slot
            del slots["c"]
            slots["e"] = 2
        if t == 9:  # a is retracted and comes back in d's slot, d having finished
            del slots["d"]
            slots["a"] = 3
        names = sorted(slots)
        mk = lambda name, slot: SamplingRow(SamplingParams(temperature=0.0, **kinds[name]), prompts[name],  # noqa: E731
                                            outputs[name], slot=slot)
        logits = torch.randn(len(names), vocab, generator=gen)
        a, b = logits.clone(), logits.clone()
        got = kept.sample(a, [mk(n, slots[n]) for n in names]).token_ids
        want = fresh.sample(b, [mk(n, -1) for n in names]).token_ids
        assert got == want, t
        assert torch.equal(a, b), t  # the penalised logits themselves agree
        for n, tok in zip(names, got):
            outputs[n].append(tok)
    assert kept.penalties.counts is not None and kept.penalties.prompt is not None


def test_kept_state_rebuilds_when_the_output_is_not_what_it_counted() -> None:
    s = Sampler(10, num_slots=2)
    out: list[int] = [3, 3]
    r = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=1.0), [], out, slot=1)
    logits = torch.zeros(1, 10)
    logits[0, 3] = 2.5  # 2.5 - 2 * 1.0 = 0.5 still wins over 0
    assert s.sample(logits.clone(), [r]).token_ids == [3]
    out.extend([4, 4])  # not the token it sampled (counted 3 threes): rebuilt from the list
    assert s.sample(logits.clone(), [r]).token_ids == [3]  # 2.5 - 2 * 1.0 > 0 again, not 2.5 - 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_on_the_gpu_matches_the_cpu_and_seeds_hold() -> None:
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2))
    rows = lambda: [row(output=[1, 2], temperature=0.0, repetition_penalty=1.4),  # noqa: E731
                    row(output=[5], temperature=0.0, min_new_tokens=3, eos_ids=(int(logits[1].argmax()),)),
                    row(temperature=0.0, frequency_penalty=0.5, output=[7, 7]),
                    row(temperature=0.0), row(top_k=1), row(temperature=0.0, presence_penalty=2.0, output=[9])]
    cpu = Sampler(vocab).sample(logits.clone(), rows()).token_ids
    gpu = Sampler(vocab, "cuda").sample(logits.clone().cuda(), rows()).token_ids
    assert cpu == gpu
    seeded = lambda: row(seed=7, temperature=0.8, top_p=0.9)  # noqa: E731
    alone = Sampler(vocab, "cuda").sample(logits[:1].clone().cuda(), [seeded()]).token_ids
    mixed = Sampler(vocab, "cuda", seed=3).sample(logits[[1, 0]].clone().cuda(), [row(), seeded()]).token_ids
    assert alone[0] == mixed[1]
    # the GPU's Triton sampling kernels (fused_ops) decide as the CPU's C++ loops do
    for params in (dict(temperature=0.8, top_p=0.9), dict(temperature=1.3), dict(top_k=20, min_p=0.05)):
        seeded_rows = lambda: [row(seed=s, **params) for s in range(6)]  # noqa: E731
        on_cpu = Sampler(vocab).sample(logits.clone(), seeded_rows()).token_ids
        assert Sampler(vocab, "cuda").sample(logits.clone().cuda(), seeded_rows()).token_ids == on_cpu


@pytest.mark.parametrize("values,dtype", [
    ([3, -1, 2**40], torch.int64), ([0.5, -2.0, float("inf")], torch.float32), ([1, 2], torch.float32),
    ([True, False], torch.int64), ([], torch.int64),
    ([[1, 2], [3, 4]], torch.int64), ([(1.0, 2.0, 0.5)], torch.float32), ([1.5, 2.5], torch.int64), ([1, 2], torch.bool),
], ids=["ints", "floats", "ints_as_floats", "bools", "empty", "nested", "tuples", "floats_as_ints", "bool_dtype"])
def test_upload_gives_what_torch_tensor_gives(values, dtype):
    """On the CPU flat int64 / float32 lists go through array and frombuffer; every list, flat or
    not, gives the tensor torch.tensor gives (dtype, shape, values)."""
    from core.engine.sampler import upload

    got, want = upload(values, dtype, torch.device("cpu")), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_upload_refuses_what_torch_tensor_refuses():
    from core.engine.sampler import upload

    for bad in ([2**70], ["a"]):  # torch.tensor's own error, not array's
        with pytest.raises(ValueError):
            upload(bad, torch.int64, torch.device("cpu"))


# --- the CPU loop for rows without filters (kernels/cpu_ops.cpp: sample_rows) ------------------


def _cpu_ops():
    from core_kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the C++ CPU ops cannot be built here")
    return cpu_ops


def test_cpu_sample_rows_picks_what_the_torch_route_picks() -> None:
    from core.engine.sampler import _inverse_cdf

    ops = _cpu_ops()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, 5000, generator=g) * 3
    temp = torch.rand(300, generator=g) * 2 + 0.05
    u = torch.rand(300, generator=g)
    fb = torch.full((300,), -1, dtype=torch.long)
    got = ops.sample_rows(x, temp, u, fb)
    want = _inverse_cdf(torch.softmax(x / temp[:, None], dim=-1), None, u, fb)
    assert (got != want).sum() <= 1  # the same search; only a rounding tie at a boundary may differ


def test_cpu_sample_rows_falls_back_where_there_is_no_distribution() -> None:
    ops = _cpu_ops()
    inf = float("inf")
    x = torch.tensor([[0.0, float("nan"), 1.0], [0.0, inf, 1.0], [-inf, -inf, -inf], [1.0, 3e5, 2.0], [-inf, 2.0, -inf]])
    temp = torch.tensor([1.0, 1.0, 1.0, 1e-40, 1.0])
    out = ops.sample_rows(x, temp, torch.full((5,), 0.999), torch.tensor([7, 8, 9, 10, 11]))
    assert out.tolist() == [7, 8, 9, 10, 1]  # a -inf entry is never chosen, even at u -> 1


def test_cpu_sample_rows_refuses_bad_arguments() -> None:
    ops = _cpu_ops()
    x, t, u, fb = torch.zeros(2, 4), torch.ones(2), torch.zeros(2), torch.zeros(2, dtype=torch.long)
    for args, what in [((x.double(), t, u, fb), "float32"), ((x, t[:1], u, fb), "temperature and u"),
                       ((x, t, u, fb.int()), "fallback"), ((x, torch.zeros(2), u, fb), "> 0")]:
        with pytest.raises(RuntimeError, match=what):
            ops.sample_rows(*args)


def filtered_rows(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` filtered rows' ``k`` most likely candidates of 1000 (probs, ids), their ``cols``
    (temperature, top_k, top_p, min_p, u: a third without top_k, a quarter without top_p) and
    fallbacks: sample_sorted's arguments."""
    g = torch.Generator().manual_seed(21)
    probs = torch.softmax(torch.randn(n, 1000, generator=g) * torch.rand(n, 1, generator=g) * 6, dim=-1)
    cand, order = probs.topk(k, dim=-1)
    cols = torch.stack([torch.ones(n), torch.randint(1, 100, (n,), generator=g).float(),
                        torch.rand(n, generator=g), torch.rand(n, generator=g) * 0.2, torch.rand(n, generator=g)], 1)
    cols[::3, 1] = 1000.0
    cols[1::4, 2] = 1.0
    return cand, order, cols, torch.arange(n) + 5000


@pytest.mark.parametrize("complete", [False, True])
def test_cpu_sample_sorted_is_the_torch_ops_exactly(monkeypatch, complete) -> None:
    """The C++ loop for filtered rows keeps the torch ops' float32 roundings: the same tokens, and
    the same rows marked -1 (kept prefix possibly past the candidates)."""
    import core.layers
    from core.engine.sampler import _pick_sorted

    ops = _cpu_ops()
    n = 400
    cand, order, cols, fb = filtered_rows(n, 64)
    got = ops.sample_sorted(cand, order, cols, fb, complete)
    monkeypatch.setattr(core.layers, "fused", lambda x: None)
    want = _pick_sorted(cand, order, cols, fb, complete)
    assert torch.equal(got, want)
    assert complete or 0 < (got < 0).sum() < n  # both kinds of rows are there


def test_cpu_sample_sorted_refuses_bad_arguments() -> None:
    ops = _cpu_ops()
    p, o, c, fb = torch.ones(2, 4) / 4, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 5), torch.zeros(2, dtype=torch.long)
    for args, what in [((p.double(), o, c, fb), "float32 probs"), ((p, o[:, :3], c, fb), "same shape"),
                       ((p, o, c[:, :4], fb), "cols"), ((p, o, c, fb[:1]), "fallback")]:
        with pytest.raises(RuntimeError, match=what):
            ops.sample_sorted(*args, False)
