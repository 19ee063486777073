"""Batched next-token sampling: penalties, min-token EOS blocking, temperature,
top-k / top-p / min-p, per-request seeded draws and logprobs.

Everything runs as a few [B, V] tensor ops; the only per-row Python work is
turning request lists into tensors and drawing one uniform number per seeded
row, so that a seeded request's tokens never depend on what it is batched with.
"""

from __future__ import annotations

from itertools import chain

import attrs
import torch

from core.engine.sampling_params import SamplingParams


@attrs.define
class SamplingRow:
    """What the sampler needs to know about one sequence in the batch."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated before this step
    generator: torch.Generator | None = None  # per-request RNG; None = sampler's own
    eos_ids: tuple[int, ...] = ()  # blocked while len(output_ids) < min_new_tokens
    return_logprob: bool = False
    top_logprobs_num: int = 0


@attrs.define
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # chosen token's logprob per row; None if no row asked
    top_logprobs: list[list[tuple[int, float]]] | None  # desc by logprob; [] where 0 asked


def _token_counts(lists: list[list[int]], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Per-row token counts [B, V] (float32) from ragged id lists, in one accumulate.

    Ids outside [0, V) are ignored rather than raising, since they cannot be sampled anyway.
    """
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(x) for x in lists], device=device)
    if int(lengths.sum()) == 0:
        return counts
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lists), device=device), lengths)
    ok = (ids >= 0) & (ids < shape[1])
    counts.index_put_((rows[ok], ids[ok]), torch.ones_like(ids[ok], dtype=torch.float32), accumulate=True)
    return counts


def _col(values: list[float], logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply repetition, then frequency/presence penalties in place (vLLM order); returns logits.

    Repetition (CTRL/HF) covers prompt and output tokens; frequency/presence only output tokens,
    as in OpenAI. Nothing is built when every row uses the defaults.
    """
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    need_rep = any(p != 1.0 for p in rep)
    if not need_rep and not any(freq) and not any(pres):
        return logits
    counts = _token_counts([r.output_ids for r in rows], logits.shape, logits.device)
    if need_rep:
        seen = (counts > 0) | (_token_counts([r.prompt_ids for r in rows], logits.shape, logits.device) > 0)
        p = _col(rep, logits)
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(_col(freq, logits) * counts + _col(pres, logits) * (counts > 0))
    return logits


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Set EOS and stop-token logits to -inf for rows still short of min_new_tokens."""
    r_idx: list[int] = []
    c_idx: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_ids) < r.params.min_new_tokens:
            for t in (*r.eos_ids, *r.params.stop_token_ids):
                if 0 <= t < logits.shape[1]:
                    r_idx.append(i)
                    c_idx.append(t)
    if r_idx:
        logits[torch.tensor(r_idx, device=logits.device), torch.tensor(c_idx, device=logits.device)] = float("-inf")
    return logits


class Sampler:
    """Turns a batch of logits into next tokens; holds the RNG for unseeded requests."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One U[0,1) per row: from the row's own generator if it has one, else in one shared call."""
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        u = torch.empty(len(rows), dtype=torch.float32)
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(1, generator=r.generator)[0]
        return u.to(device)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
        """Pick one token per row; may modify ``logits`` in place, never ``rows``.

        Columns at or beyond ``vocab_size`` (padding) are dropped, so they are never chosen.
        Logprobs are log_softmax of the *raw* logits (before penalties, temperature and
        filters), matching SGLang's default: they describe the model, not the sampler.
        """
        logits = logits[:, : self.vocab_size]
        if logits.dtype != torch.float32:
            logits = logits.float()
        want_lp = any(r.return_logprob or r.top_logprobs_num > 0 for r in rows)
        raw_lp = torch.log_softmax(logits, dim=-1) if want_lp else None
        raw_argmax = logits.argmax(dim=-1)

        apply_penalties(logits, rows)
        apply_min_tokens(logits, rows)
        best, tokens = logits.max(dim=-1)
        # A row whose every token is now -inf falls back to the model's own argmax.
        tokens = torch.where(best == float("-inf"), raw_argmax, tokens)

        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled:  # all-greedy batches skip the sort entirely
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = self._sample_rows(logits[idx], [rows[i] for i in sampled], tokens[idx])
        return self._output(tokens, rows, raw_lp)

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow], fallback: torch.Tensor) -> torch.Tensor:
        """Temperature, then top-k/top-p/min-p on one sorted copy, then inverse-CDF sampling.

        ``logits`` holds just these rows. Every filter keeps a prefix of the sorted
        distribution, so the unnormalised cumulative sum of the kept probabilities is
        searched for ``u * total`` (same as renormalising). Rows whose distribution is
        not finite (e.g. all -inf, or overflow at a tiny temperature) keep ``fallback``.
        """
        vocab = logits.shape[1]
        ar = torch.arange(vocab, device=logits.device).unsqueeze(0)
        temp = _col([r.params.temperature for r in rows], logits)
        top_k = _col([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], logits)
        top_p = _col([r.params.top_p for r in rows], logits)
        min_p = _col([r.params.min_p for r in rows], logits)

        probs = torch.softmax(logits / temp, dim=-1)
        probs, order = probs.sort(dim=-1, descending=True)
        exclusive = probs.cumsum(dim=-1) - probs
        drop = (ar >= top_k) | ((exclusive >= top_p) & (top_p < 1.0)) | (probs < probs[:, :1] * min_p)
        drop[:, 0] = False  # the best token always survives
        probs = probs.masked_fill(drop, 0.0)

        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        target = self._uniforms(rows, logits.device).unsqueeze(1) * total
        # First index whose cdf exceeds u*total, capped at the last token with mass (rounding guard).
        pos = torch.minimum((cdf <= target).sum(-1), (cdf < total).sum(-1)).clamp_(max=vocab - 1)
        chosen = order.gather(1, pos.unsqueeze(1)).squeeze(1)
        ok = torch.isfinite(total.squeeze(1)) & (total.squeeze(1) > 0)
        return torch.where(ok, chosen, fallback)

    def _output(self, tokens: torch.Tensor, rows: list[SamplingRow], raw_lp: torch.Tensor | None) -> SampleOutput:
        """Gather the chosen token's logprob and the requested top-k, converting to lists once."""
        token_ids = tokens.tolist()
        if raw_lp is None:
            return SampleOutput(token_ids, None, None)
        logprobs = raw_lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        k = min(max(r.top_logprobs_num for r in rows), raw_lp.shape[1])
        if k <= 0:
            return SampleOutput(token_ids, logprobs, None)
        vals, ids = raw_lp.topk(k, dim=-1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        top = [list(zip(ids_l[i][: r.top_logprobs_num], vals_l[i][: r.top_logprobs_num])) for i, r in enumerate(rows)]
        return SampleOutput(token_ids, logprobs, top)
