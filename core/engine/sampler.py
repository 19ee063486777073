"""Batched next-token sampling on the logits' device: penalties, min-token EOS blocking,
temperature, top-k / top-p / min-p, per-request seeded draws and logprobs.

Everything runs as a few [B, V] tensor ops on the device the logits live on. The per-row
Python work is one pass over the rows to read their parameters (packed into one small
tensor, copied to the device once) and one uniform number drawn per seeded row on the host,
so that a seeded request's tokens never depend on what it is batched with. The sampled ids
come back to the host in one transfer: the step's only sync. An all-greedy batch with
nothing to penalise is a single argmax.

Penalties need each request's token counts. With ``num_slots`` the sampler keeps them on the
device, one row per engine slot (the request's table row): built once when a request first
needs them, then advanced by the tokens it samples, instead of being rebuilt from every
request's whole output each step.
"""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Any

import attrs
import torch

from core import layers
from core.engine import logit_processor
from core.engine.sampling_params import SAMPLING_EPS, SamplingParams


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
    slot: int = -1  # the sequence's engine slot (table row) for the kept penalty state; -1: none
    token_ids_logprob: tuple[int, ...] = ()  # tokens whose logprobs it returns at each step (SGLang's field)
    # greedy with nothing that edits the logits or reads them back: the batch's argmax is its token
    # (fixed by the params: a row is made once per table row, so ``sample`` checks one flag a row)
    plain: bool = attrs.field(init=False)

    @plain.default
    def _plain(self) -> bool:
        p = self.params
        return (p.is_greedy and not penalised(p) and not p.min_new_tokens and not p.logit_bias and p.thinking is None
                and p.custom_logit_processor is None and not self.return_logprob and not self.top_logprobs_num
                and not self.token_ids_logprob)


@attrs.define
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # chosen token's logprob per row; None if no row asked
    top_logprobs: list[list[tuple[int, float]]] | None  # desc by logprob; [] where 0 asked
    failed: dict[int, str] | None = None  # rows whose custom logit processor failed: why (their requests fail)
    # per row, the logprobs of its token_ids_logprob [(token id, logprob)]; None if no row asked
    token_ids_logprobs: list[list[tuple[int, float]]] | None = None


@attrs.define(eq=False)
class DeviceSample:
    """A step's sampled tokens (and the logprobs asked for) still on the device, their copy to the
    host started without waiting. Overlap scheduling on a GPU launches the next batch meanwhile
    (its future ids read ``tokens`` on the device) and waits for the copy only after that launch
    (``finish``): reading the tokens at once would stall the device between every two steps."""

    tokens: torch.Tensor  # [B] on the device
    copies: list[torch.Tensor]  # on the host (in flight): tokens, then chosen logprobs, then top values and ids
    top_nums: list[int] | None  # per row, the top logprobs it asked for (None: no top-k computed)
    event: Any = None  # a CUDA event recorded after the copies (None: they are done)
    failed: dict[int, str] | None = None  # as SampleOutput's
    ids: list[tuple[int, ...]] | None = None  # per row, its token_ids_logprob (their logprobs: the last copy)

    @classmethod
    def start(cls, parts: list[torch.Tensor], top_nums: list[int] | None,
              ids: list[tuple[int, ...]] | None = None) -> DeviceSample:
        if parts[0].device.type != "cuda":
            return cls(parts[0], parts, top_nums, ids=ids)
        copies = [t.to("cpu", non_blocking=True) for t in parts]  # (pinned by torch: a true async copy)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(parts[0].device))
        return cls(parts[0], copies, top_nums, event, ids=ids)

    def finish(self) -> SampleOutput:
        """The lists, once the copies have landed (waits for them, the GIL released)."""
        if self.event is not None:
            self.event.synchronize()
        lists = [t.tolist() for t in self.copies]
        out = SampleOutput(lists[0], lists[1] if len(lists) > 1 else None, None, self.failed)
        if self.top_nums is not None:
            vals, ids = lists[2], lists[3]
            out.top_logprobs = [list(zip(ids[i][:n], vals[i][:n])) for i, n in enumerate(self.top_nums)]
        if self.ids is not None:
            out.token_ids_logprobs = [list(zip(ids, vals)) for ids, vals in zip(self.ids, lists[-1])]
        return out


# The logprob written for a token the distribution rules out (-inf: a grammar-masked token,
# NaN from a broken row): a finite number, as OpenAI and vLLM report such tokens, because JSON
# has no -inf (it would go out as null) and clients compute exp(logprob).
LOGPROB_FLOOR = -9999.0


def finite_logprobs(lp: torch.Tensor) -> torch.Tensor:
    """``lp`` with -inf, NaN and anything below :data:`LOGPROB_FLOOR` raised to the floor."""
    return torch.nan_to_num(lp, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_min_(LOGPROB_FLOOR)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (first index of each row's maximum); on the CPU through a vectorised
    C++ loop where the fused ops are built (torch's: 0.9 ms for 64 x 49152, the loop's 0.07)."""
    k = layers.fused(logits)
    if k is not None and hasattr(k, "argmax") and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16):
        return k.argmax(logits)
    return logits.argmax(dim=-1)


_ARRAY_CODES = {torch.int64: "q", torch.float32: "f"}


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``values`` on ``device``; to a GPU through pinned memory without blocking.

    A flat list of int64 or float32 values goes through ``array``: torch.tensor's parsing of each
    element took 7 us where this takes 2.4 (two such uploads per decode step; a 256-stream step's
    1,280 values: 74 against 22 us, on a GPU's launch path)."""
    host = None
    code = _ARRAY_CODES.get(dtype)
    if code is not None and values:
        try:
            host = torch.frombuffer(array(code, values), dtype=dtype)
        except (TypeError, OverflowError):  # nested lists, tuples, other element types: as torch.tensor does
            pass
    if device.type == "cpu":
        return host if host is not None else torch.tensor(values, dtype=dtype)
    if host is None:
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)  # (the pinned copy's block outlives the async copy)


def _token_counts(lists: list[list[int]], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Per-row token counts [B, V] (float32) from ragged id lists, in one accumulate.

    Ids outside [0, V) are ignored rather than raising, since they cannot be sampled anyway.
    """
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    lengths = [len(x) for x in lists]
    total = sum(lengths)
    if total == 0:
        return counts
    ids = upload(list(chain.from_iterable(lists)), torch.long, device)
    rows = torch.repeat_interleave(torch.arange(len(lists), device=device), upload(lengths, torch.long, device),
                                   output_size=total)
    ok = (ids >= 0) & (ids < shape[1])
    counts.index_put_((rows, ids.clamp(0, shape[1] - 1)), ok.float(), accumulate=True)
    return counts


def _penalise(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None, params: torch.Tensor) -> None:
    """In place: repetition (where ``seen``), then frequency/presence from ``counts``; ``params``
    ``[B, 3]`` holds (repetition, frequency, presence) per row."""
    if seen is not None:
        p = params[:, 0:1]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits))
    logits.sub_(params[:, 1:2] * counts + params[:, 2:3] * (counts > 0))


MIN_REPETITION_PENALTY = 1e-6  # a smaller (valid, > 0) one acts as this: in float32 it could round to 0,
# and a masked -inf logit times 0 is NaN, which sampling would pick


def _penalty_params(rows: list[SamplingRow], device: torch.device) -> tuple[torch.Tensor, bool]:
    vals = [(max(r.params.repetition_penalty, MIN_REPETITION_PENALTY), r.params.frequency_penalty,
             r.params.presence_penalty) for r in rows]
    return upload(vals, torch.float32, device), any(v[0] != 1.0 for v in vals)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply repetition, then frequency/presence penalties in place (vLLM order); returns logits.

    Repetition (CTRL/HF) covers prompt and output tokens; frequency/presence only output tokens,
    as in OpenAI. Nothing is built when every row uses the defaults. Stateless: the counts are
    built from the rows' lists (the ``Sampler`` keeps them across steps instead).
    """
    if not any(penalised(r.params) for r in rows):
        return logits
    params, need_rep = _penalty_params(rows, logits.device)
    counts = _token_counts([r.output_ids for r in rows], logits.shape, logits.device)
    seen = None
    if need_rep:
        seen = (counts > 0) | (_token_counts([r.prompt_ids for r in rows], logits.shape, logits.device) > 0)
    _penalise(logits, counts, seen, params)
    return logits


def penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its logits in place (after penalties, as vLLM does; a
    token the grammar masked stays at -inf). The entries were checked by ``SamplingParams.validate``."""
    r_idx, c_idx, vals = [], [], []
    for i, r in enumerate(rows):
        for key, bias in (r.params.logit_bias or {}).items():
            if (tid := int(key)) < logits.shape[1]:
                r_idx.append(i)
                c_idx.append(tid)
                vals.append(float(bias))
    if r_idx:
        logits.index_put_((upload(r_idx, torch.long, logits.device), upload(c_idx, torch.long, logits.device)),
                          upload(vals, torch.float32, logits.device), accumulate=True)
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
        idx = upload([r_idx, c_idx], torch.long, logits.device)
        logits[idx[0], idx[1]] = float("-inf")
    return logits


class PenaltyState:
    """Output-token counts ``[num_slots, V]`` (and prompt-token presence for repetition) per
    engine slot, on the device. A slot's row is rebuilt from the request's lists when a new
    request takes the slot (or its output no longer matches what was counted), and otherwise
    only advanced by the token the request sampled."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, device
        self.counts: torch.Tensor | None = None  # allocated when a penalty is first used
        self.prompt: torch.Tensor | None = None
        self._owner: list[list[int] | None] = [None] * num_slots  # the output list each slot counts
        self._counted = [0] * num_slots  # output tokens counted in each slot
        self._has_prompt = [False] * num_slots

    def gather(self, rows: list[SamplingRow], need_rep: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(counts ``[P, V]``, prompt-or-output presence ``[P, V]`` or None, slot index ``[P]``) of ``rows``."""
        shape = (self.num_slots, self.vocab_size)
        if self.counts is None:
            self.counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if need_rep and self.prompt is None:
            self.prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        stale = [r for r in rows if self._owner[r.slot] is not r.output_ids or self._counted[r.slot] != len(r.output_ids)]
        if stale:
            self._rebuild(stale, self.counts, lambda r: r.output_ids)
            for r in stale:
                self._owner[r.slot], self._counted[r.slot], self._has_prompt[r.slot] = r.output_ids, len(r.output_ids), False
        if need_rep:
            missing = [r for r in rows if not self._has_prompt[r.slot] and r.params.repetition_penalty != 1.0]
            if missing:
                self._rebuild(missing, self.prompt, lambda r: r.prompt_ids)
                for r in missing:
                    self._has_prompt[r.slot] = True
        slots = upload([r.slot for r in rows], torch.long, self.device)
        counts = self.counts.index_select(0, slots)
        seen = (self.prompt.index_select(0, slots) | (counts > 0)) if need_rep else None
        return counts, seen, slots

    def _rebuild(self, rows: list[SamplingRow], dest: torch.Tensor, ids_of) -> None:
        slots = upload([r.slot for r in rows], torch.long, self.device)
        fresh = _token_counts([ids_of(r) for r in rows], (len(rows), self.vocab_size), self.device)
        dest.index_copy_(0, slots, fresh if dest.dtype == fresh.dtype else fresh > 0)

    def advance(self, rows: list[SamplingRow], slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's sampled token (on the device; the host only moves its tallies)."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        for r in rows:
            self._counted[r.slot] += 1


TOP_CANDIDATES = 256  # a filtered row first samples among its this many most likely tokens (one topk)


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether the row's top-k / top-p / min-p can drop any token."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _param_cols(rows: list[SamplingRow], vocab: int, u: list[float], device: torch.device) -> torch.Tensor:
    """Each row's temperature, top-k, top-p, min-p and uniform ``u`` as one [rows, 5] float32
    tensor: one flat list (an array, not torch.tensor's parse of nested tuples), one upload. The
    temperature is at least SAMPLING_EPS (a smaller one is greedy, never here): the kernels divide by it."""
    return upload([v for r, x in zip(rows, u)
                   for v in (max(r.params.temperature, SAMPLING_EPS), r.params.top_k if 0 < r.params.top_k < vocab
                             else vocab, r.params.top_p, r.params.min_p, x)], torch.float32, device).view(-1, 5)


def _sample_plain(logits: torch.Tensor, cols: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows without filters: the unsorted distribution at temperature ``cols[:, 0]``, sampled at
    ``cols[:, 4]``; on the CPU in one C++ loop (``core_kernels.cpu_ops.sample_rows``)."""
    if (k := layers.fused(logits)) is not None and hasattr(k, "sample_rows"):
        return k.sample_rows(logits, cols[:, 0].contiguous(), cols[:, 4].contiguous(), fallback)
    return _inverse_cdf(torch.softmax(logits / cols[:, :1], dim=-1), None, cols[:, 4], fallback)


def _pick_sorted(probs: torch.Tensor, order: torch.Tensor, cols: torch.Tensor, fallback: torch.Tensor,
                 complete: bool) -> torch.Tensor:
    """``probs`` sorted most likely first (``order``: their token ids), filtered by each row's top-k
    (``cols[:, 1]``), top-p (2) and min-p (3), then sampled at ``cols[:, 4]``. Unless ``complete``
    (``probs`` is the whole vocabulary), -1 for a row whose kept prefix may reach past these
    columns: it ends within them iff the next most likely token is dropped, by top_k, by top_p (the
    columns' mass reaches top_p) or by min_p (it is at most the last column). On the CPU one C++
    loop with the same roundings (``cpu_ops.sample_sorted``): these ~20 small ops cost ~0.5 ms there."""
    if (k := layers.fused(probs)) is not None and hasattr(k, "sample_sorted"):
        return k.sample_sorted(probs, order, cols, fallback, complete)
    drop, fits = _dropped(probs, cols)
    out = _inverse_cdf(probs.masked_fill(drop, 0.0), order, cols[:, 4], fallback)
    return out if complete else torch.where(fits, out, -1)


def _dropped(probs: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of ``probs`` sorted most likely first: the columns each row's top-k (``cols[:, 1]``), top-p (2)
    and min-p (3) drop, and per row whether its kept prefix ends within these columns (see ``_pick_sorted``)."""
    ar = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    top_k, top_p, min_p = cols[:, 1:2], cols[:, 2:3], cols[:, 3:4]
    cum = probs.cumsum(dim=-1)
    floor = probs[:, :1] * min_p
    drop = (ar >= top_k) | ((cum - probs >= top_p) & (top_p < 1.0)) | (probs < floor)
    drop[:, 0] = False  # the best token always survives
    fits = (top_k <= probs.shape[1]) | ((cum[:, -1:] >= top_p) & (top_p < 1.0)) | (probs[:, -1:] < floor)
    return drop, fits.squeeze(1)


def _inverse_cdf(probs: torch.Tensor, order: torch.Tensor | None, target: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """The first column whose cumulative mass exceeds ``target * total`` (capped at the last column
    with mass: a rounding guard), as a token id through ``order`` (None: the column is the id);
    ``fallback`` where the row's mass is not finite or zero."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    # binary searches in the (non-decreasing) cdf, B x log V: full-width comparisons cost ~0.2 ms a
    # row on a CPU with cold caches
    pos = torch.minimum(torch.searchsorted(cdf, target.unsqueeze(1) * total, right=True),
                        torch.searchsorted(cdf, total)).squeeze(1).clamp_(max=probs.shape[1] - 1)
    chosen = pos if order is None else order.gather(1, pos.unsqueeze(1)).squeeze(1)
    ok = torch.isfinite(total.squeeze(1)) & (total.squeeze(1) > 0)
    return torch.where(ok, chosen, fallback)


def rng_states(reqs: list) -> dict:
    """Each seeded request's generator state before a sampling, for ``rewind``."""
    return {r: r.generator.get_state() for r in reqs if r.generator is not None}


def rewind(generator: torch.Generator, state: torch.Tensor, draws: int = 0) -> None:
    """Take a seeded request's generator back to ``state`` and on by ``draws`` draws (as ``Sampler._uniforms``
    draws, one per row): the draws of tokens not kept (a verify's rejected positions, a token overlap
    scheduling drops) are not spent, so that the seed gives plain decoding's tokens."""
    generator.set_state(state)
    for _ in range(draws):
        torch.rand(1, generator=generator)


def draws_ahead(generator: torch.Generator, depths: list[int]) -> list[torch.Generator]:
    """A new generator per entry of ``depths``, each where ``generator`` will be after that many more
    draws (``generator`` unchanged): what a seeded request's decode that many tokens on would draw."""
    walker = torch.Generator(device=generator.device)
    walker.set_state(generator.get_state())
    states = []
    for _ in range(max(depths, default=0) + 1):
        states.append(walker.get_state())
        torch.rand(1, generator=walker)
    out = []
    for d in depths:
        g = torch.Generator(device=generator.device)
        g.set_state(states[d])
        out.append(g)
    return out


class Sampler:
    """Turns a batch of logits into next tokens; holds the RNG for unseeded requests and, with
    ``num_slots``, the per-slot penalty state."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0, num_slots: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.penalties = PenaltyState(num_slots, vocab_size, self.device) if num_slots > 0 else None

    def _uniforms(self, rows: list[SamplingRow]) -> list[float]:
        """One U[0,1) per row: from the row's own generator if it has one, else in one shared draw."""
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        u = [0.0] * len(rows)
        if shared:
            for i, x in zip(shared, torch.rand(len(shared), generator=self.generator).tolist()):
                u[i] = x
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(1, generator=r.generator).item()
        return u

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], argmax_ids: torch.Tensor | None = None,
               host: bool = True) -> SampleOutput | DeviceSample:
        """Pick one token per row; may modify ``logits`` in place, never ``rows``. ``host`` False:
        the result stays on the device, its copy to the host started (see ``DeviceSample``).

        ``argmax_ids``: each row's argmax over the first ``vocab_size`` columns of ``logits``,
        where the forward computed it with them (the CPU decode stack does); it stands in for
        this sampler's own. Columns at or beyond ``vocab_size`` (padding) are dropped, so they
        are never chosen. Logprobs are log_softmax of the *raw* logits (before penalties,
        temperature and filters): they describe the model, not the sampler, as vLLM's default and
        SGLang's with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (SGLang's default divides a sampled row's
        logits by its temperature first; docs/compatibility.md).
        A grammar's mask is applied to ``logits`` before this call, so under a constraint they
        describe the model restricted to the allowed tokens; a ruled-out token reads
        :data:`LOGPROB_FLOOR`, never -inf.
        """
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        if all(r.plain for r in rows):  # (the common greedy batch: no pass over the rows' params)
            return self._output(argmax_ids if argmax_ids is not None else argmax(logits), rows, None, host)
        greedy, want_lp, pen_rows, short, biased, forced, procs = True, False, [], False, False, {}, False
        for i, r in enumerate(rows):  # one pass: what this batch needs at all
            p = r.params
            if p.thinking is not None and (tok := p.thinking.forced(r.output_ids)) is not None:
                forced[i] = tok
            greedy = greedy and p.is_greedy
            want_lp = want_lp or r.return_logprob or r.top_logprobs_num > 0 or bool(r.token_ids_logprob)
            if penalised(p):
                pen_rows.append(i)
            short = short or len(r.output_ids) < p.min_new_tokens
            biased = biased or bool(p.logit_bias)
            procs = procs or p.custom_logit_processor is not None
        plain = not pen_rows and not short and not biased and not forced and not procs
        # before any float32 copy: a bf16 / fp16 row's argmax is that of its exact float32 values
        raw_argmax = argmax_ids if argmax_ids is not None else argmax(logits)
        if greedy and plain and not want_lp:
            return self._output(raw_argmax, rows, None, host)
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw_lp = finite_logprobs(torch.log_softmax(logits, dim=-1)) if want_lp else None
        if greedy and plain:
            return self._output(raw_argmax, rows, raw_lp, host)

        advance = self._apply_penalties(logits, rows, pen_rows) if pen_rows else None
        if biased:
            apply_logit_bias(logits, rows)
        if short:
            apply_min_tokens(logits, rows)
        failed = logit_processor.apply(logits, rows) if procs else None
        if plain:  # the logits are the model's own: their argmax is the fallback
            tokens = raw_argmax
        else:
            best, tokens = logits.max(dim=-1)
            # A row whose every token is now -inf falls back to the model's own argmax.
            tokens = torch.where(best == float("-inf"), raw_argmax, tokens)

        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if len(sampled) == len(rows):
            tokens = self._sample_rows(logits, rows, tokens)
        elif sampled:  # all-greedy batches skip the sort entirely
            idx = upload(sampled, torch.long, logits.device)
            tokens[idx] = self._sample_rows(logits[idx], [rows[i] for i in sampled], tokens[idx])
        if forced:  # a reasoning past its budget closes (the logprobs stay the model's)
            tokens[upload(list(forced), torch.long, tokens.device)] = upload(list(forced.values()), tokens.dtype,
                                                                            tokens.device)
        if advance is not None:
            advance(tokens)
        out = self._output(tokens, rows, raw_lp, host)
        out.failed = failed or None
        return out

    def target_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Each row's distribution as ``sample`` draws from it, float32 [rows, vocab_size]: logit bias,
        temperature, then top-k / top-p / min-p, renormalised (for rows without penalties,
        ``min_new_tokens`` or a forced token: a speculative verify's sampled rows). ``logits`` is not
        modified. A filtered row's kept prefix is found among its ``TOP_CANDIDATES`` most likely
        tokens where it ends there, else by sorting the whole vocabulary (as ``_sample_filtered``)."""
        logits = logits[:, : self.vocab_size].float()
        if any(r.params.logit_bias for r in rows):
            logits = apply_logit_bias(logits.clone(), rows)
        vocab = logits.shape[1]
        cols = _param_cols(rows, vocab, [0.0] * len(rows), logits.device)
        probs = torch.softmax(logits / cols[:, :1], dim=-1)
        if filtered := [i for i, r in enumerate(rows) if _filters(r.params, vocab)]:
            idx = upload(filtered, torch.long, logits.device)
            sub, sub_cols = probs[idx], cols[idx]
            cand, order = sub.topk(min(TOP_CANDIDATES, vocab), dim=-1)
            drop, fits = _dropped(cand, sub_cols)
            kept = torch.zeros_like(sub).scatter_(1, order, cand.masked_fill(drop, 0.0))
            if not bool(fits.all()):
                wide = (~fits).nonzero().squeeze(1)
                full, full_order = sub[wide].sort(dim=-1, descending=True)
                kept[wide] = torch.zeros_like(full).scatter_(1, full_order, full.masked_fill(_dropped(full, sub_cols[wide])[0], 0.0))
            probs[idx] = kept
        return probs / probs.sum(dim=-1, keepdim=True)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], which: list[int]):
        """Penalise rows ``which`` in place; returns what counts their sampled tokens afterwards
        (with the kept state), or None."""
        sub_rows = [rows[i] for i in which]
        state = self.penalties
        if state is None or any(r.slot < 0 for r in sub_rows):
            if len(which) == len(rows):
                apply_penalties(logits, rows)
            else:
                idx = upload(which, torch.long, logits.device)
                logits[idx] = apply_penalties(logits[idx], sub_rows)
            return None
        params, need_rep = _penalty_params(sub_rows, logits.device)
        counts, seen, slots = state.gather(sub_rows, need_rep)
        if len(which) == len(rows):
            _penalise(logits, counts, seen, params)
            return lambda tokens: state.advance(sub_rows, slots, tokens)
        idx = upload(which, torch.long, logits.device)
        sub = logits[idx]
        _penalise(sub, counts, seen, params)
        logits[idx] = sub
        return lambda tokens: state.advance(sub_rows, slots, tokens[idx])

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow], fallback: torch.Tensor) -> torch.Tensor:
        """Temperature, then top-k/top-p/min-p, then inverse-CDF sampling with each row's uniform.

        ``logits`` holds just these rows. Every filter keeps a prefix of the distribution sorted
        by probability, so the unnormalised cumulative sum of the kept probabilities is searched
        for ``u * total`` (same as renormalising). Sorting the whole vocabulary is the costly part
        (CPU, 49k columns: ~5 ms a row), so each row takes the cheapest exact route, decided by
        its own parameters and distribution alone (a seeded row never depends on its batch):
        a row without filters samples the unsorted distribution; a filtered row whose kept
        prefix lies within the ``TOP_CANDIDATES`` most likely tokens samples those (one
        ``topk``); only the others sort everything. Rows whose distribution is not finite
        (e.g. all -inf, or overflow at a tiny temperature) keep ``fallback``.
        """
        vocab = logits.shape[1]
        cols = _param_cols(rows, vocab, self._uniforms(rows), logits.device)
        filtered = [i for i, r in enumerate(rows) if _filters(r.params, vocab)]
        if not filtered:  # plain sampling: no order needed
            return _sample_plain(logits, cols, fallback)
        if len(filtered) == len(rows):
            return self._sample_filtered(torch.softmax(logits / cols[:, :1], dim=-1), cols, fallback)
        idx = upload(filtered, torch.long, logits.device)
        skip = set(filtered)
        plain = upload([i for i in range(len(rows)) if i not in skip], torch.long, logits.device)
        tokens = torch.empty_like(fallback)
        tokens[plain] = _sample_plain(logits[plain], cols[plain], fallback[plain])
        tokens[idx] = self._sample_filtered(torch.softmax(logits[idx] / cols[idx, :1], dim=-1), cols[idx], fallback[idx])
        return tokens

    def _sample_filtered(self, probs: torch.Tensor, cols: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        """The filtered rows: within the top ``TOP_CANDIDATES`` where every kept token lies there,
        else (those rows only) over the whole sorted vocabulary."""
        vocab = probs.shape[1]
        k = min(TOP_CANDIDATES, vocab)
        cand, order = probs.topk(k, dim=-1)  # sorted, most likely first
        out = _pick_sorted(cand, order, cols, fallback, complete=k == vocab)
        if k < vocab and bool((wide := out < 0).any()):
            rest = wide.nonzero().squeeze(1)
            full, full_order = probs[rest].sort(dim=-1, descending=True)
            out[rest] = _pick_sorted(full, full_order, cols[rest], fallback[rest], complete=True)
        return out

    def _output(self, tokens: torch.Tensor, rows: list[SamplingRow], raw_lp: torch.Tensor | None,
                host: bool = True) -> SampleOutput | DeviceSample:
        """Gather the chosen token's logprob and the requested top-k; on the host (lists, converted
        once), or with ``host`` False still on the device, their copy started (``DeviceSample``)."""
        parts, top_nums, ids = [tokens], None, None
        if raw_lp is not None:
            parts.append(raw_lp.gather(1, tokens.unsqueeze(1)).squeeze(1))
            if (k := min(max(r.top_logprobs_num for r in rows), raw_lp.shape[1])) > 0:
                parts += raw_lp.topk(k, dim=-1)
                top_nums = [r.top_logprobs_num for r in rows]
            if any(r.token_ids_logprob for r in rows):  # each row's own tokens, padded to the longest list
                ids = [r.token_ids_logprob for r in rows]
                width = max(map(len, ids))
                parts.append(raw_lp.gather(1, upload([[*t, *[0] * (width - len(t))] for t in ids], torch.long,
                                                     raw_lp.device)))
        out = DeviceSample.start(parts, top_nums, ids)
        return out.finish() if host else out
