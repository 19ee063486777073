"""Speculative decoding: drafts verified by the target model in one forward.

A drafter plugin (``--speculative-algorithm NAME``, hook ``register_speculative_algorithms``)
proposes a chain of tokens per request. The scheduler builds a verify batch (each request's last
token and its draft, one extend per request) and the model runner samples every position as plain
decoding would, with the request's own parameters and RNG. A draft token is kept while it equals
what the target sampled at its position, and the first position where they differ keeps the
target's token, so a step yields one to ``len(draft) + 1`` tokens for one read of the weights.
Greedy decoding gives exactly plain decoding's tokens. With sampling, accepting a draft token ``d``
when the target's sample equals ``d`` is rejection sampling against a drafter that proposes
deterministically (``q = onehot(d)``: accept with probability ``p(d)``, else draw from ``p``
without ``d``), so the output distribution is the target's. The KV slots of rejected tokens stay
in the request's pages and are written over; the prefix cache never sees them.

Requests whose sampling reads their own outputs on the host between positions (a grammar,
penalties, ``min_new_tokens`` not reached) or that return logprobs are not drafted for; a batch
holding one decodes plainly. Overlap scheduling is off with speculation (as SGLang turns it off on
the CPU): each verify's results decide the next batch.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import structlog
import torch

from core.engine.request import Req
from core.engine.sampler import penalised
from core.errors import CoreError
from core.interfaces import DraftObservation, DraftRequest

log = structlog.get_logger("core.engine.speculative")

DEFAULT_NUM_DRAFT_TOKENS = 12  # SGLang's default for NGRAM: the last token and 11 drafted
DEFAULT_NUM_STEPS = 5  # model drafters' chain length (SGLang's usual choice of --speculative-num-steps)
# Tokens one verify forward may hold, the batch's last tokens included, per device kind: about where
# the forward stops being bound by reading the weights and its cost starts to grow with its tokens
# (2 Zen 4 cores: a 135M model's batch-1 decode reads ~0.1 GB in ~5 ms, a token's GEMMs take ~0.3 ms).
# A batch of more requests decodes plainly: speculation switches itself off under load.
VERIFY_TOKEN_BUDGET = {"cpu": 32, "cuda": 256}
MAX_BACKOFF = 16  # decode steps a request waits, at most, before drafting again after a verify kept nothing


@attrs.define
class Pace:
    """A request's recent acceptance, which sizes its next drafts: about twice the draft tokens
    its recent verifies kept, plus one; after a verify that kept none it waits 1, 2, 4, ... 16
    steps before drafting again, so an answer that does not repeat costs few failed verifies."""

    kept: float = 2.0  # moving average of draft tokens kept per verify
    wait: int = 0  # steps to decode plainly before the next draft
    backoff: int = 0  # the next wait after a verify that keeps nothing
    retractions: int = 0  # the request's retractions its drafter's state has seen (Speculator.fill)

    def want(self, room: int) -> int:
        if self.wait > 0:
            self.wait -= 1
            return 0
        return min(room, 1 + math.ceil(2 * self.kept))

    def update(self, n: int) -> None:
        self.kept = 0.5 * self.kept + 0.5 * n
        if n:
            self.backoff = 0
        else:
            self.wait = self.backoff = min(MAX_BACKOFF, max(1, 2 * self.backoff))


@attrs.define
class Speculator:
    """What the scheduler asks for a verify batch (``verify_batch``), the runner for a model
    drafter's drafts (``fill``), and the scheduler uses to count what a verify kept (``kept``)."""

    drafter: Any  # core.interfaces.Drafter or ModelDrafter
    num_draft_tokens: int  # tokens per verify and request, the last known one included (SGLang's meaning)
    batched: bool = attrs.field(init=False)  # a ModelDrafter: drafts come from the runner (``fill``)
    token_budget: int = VERIFY_TOKEN_BUDGET["cpu"]  # tokens per verify forward, set for the device by ``load``
    features: Any = None  # () -> the last target forward's features, where the drafter asked (``observe``)

    def __attrs_post_init__(self) -> None:
        self.batched = hasattr(self.drafter, "propose_batch")

    def load(self, ctx: Any) -> None:
        """Load a model drafter's models (``ctx``: a ``core.interfaces.DraftContext``)."""
        self.token_budget = VERIFY_TOKEN_BUDGET.get(ctx.device.type, VERIFY_TOKEN_BUDGET["cuda"])
        if self.batched:
            self.drafter.load(ctx)
            self.features = getattr(ctx, "features", None)

    def room(self, r: Req, context_len: int) -> int:
        """The draft tokens a verify of ``r`` may hold: within its ``max_new_tokens`` and the context."""
        return max(0, min(self.num_draft_tokens - 1, r.params.max_new_tokens - len(r.output_ids) - 1,
                          context_len - r.seq_len - 1))

    def verify_batch(self, scheduler: Any, reqs: list[Req]) -> Any:
        """A verify batch of ``reqs`` (each one's last token and draft as one extend), or None where
        the batch decodes plainly: some request cannot be drafted for (``multi_token_ok``), no draft
        is proposed, or the pool cannot hold the verify's pages. A model drafter's drafts are
        placeholders here, filled by the runner (``fill``) on the forward thread."""
        budget = self.token_budget - len(reqs)  # draft tokens this verify may hold
        if budget <= 0 or any(not multi_token_ok(r) for r in reqs):
            return None
        rooms = [(r.spec_pace or Pace()).want(self.room(r, scheduler.context_len)) for r in reqs]
        for i in sorted(range(len(reqs)), key=lambda i: -(reqs[i].spec_pace or Pace()).kept):  # the most kept first
            rooms[i] = min(rooms[i], budget)
            budget -= rooms[i]
        drafts = None
        if not self.batched:
            drafts = [self.drafter.propose(r.spec_state, r.fill_ids(), n)[:n] if n > 0 else [] for r, n in zip(reqs, rooms)]
            rooms = [len(d) for d in drafts]
        pages_for = scheduler.allocator.pages_for
        if not any(rooms) or not scheduler._can_alloc(sum(max(0, pages_for(r.kv_len + 1 + n) - len(r.pages))
                                                          for r, n in zip(reqs, rooms))):
            return None
        batch = scheduler._build(reqs, [1 + n for n in rooms], prefill=False)
        drafts = drafts or [[0] * n for n in rooms]
        batch.input_ids = [t for r, n, d in zip(reqs, batch.extend_lens, drafts) for t in (r.token_at(r.kv_len - n), *d)]
        batch.drafts = drafts
        batch.draft_pending = self.batched
        return batch

    def fill(self, batch: Any, kv_indices: torch.Tensor) -> None:
        """A model drafter's drafts for ``batch`` (on the forward thread, after the runner recorded
        the verify's slots in ``kv_indices``), written into its ``input_ids`` and ``drafts``."""
        reqs = []
        for i, (r, d) in enumerate(zip(batch.reqs, batch.drafts)):
            kv_len = batch.seq_lens[i] - 1 - len(d)
            reqs.append(DraftRequest(_state(r), r.fill_ids()[:kv_len + 1], kv_len, len(d), kv_indices[i, :kv_len + len(d)].clone()))
        drafts = self.drafter.propose_batch(reqs)
        pos = 0
        for r, got, d in zip(reqs, drafts, batch.drafts):
            if len(got) != r.room:
                raise RuntimeError(f"the drafter {type(self.drafter).__name__} proposed {len(got)} tokens where "
                                   f"{r.room} were asked for")
            batch.input_ids[pos + 1:pos + 1 + r.room] = d[:] = got
            pos += 1 + r.room
        batch.draft_pending = False

    def observe(self, batch: Any, sampled: list[int], kv_indices: torch.Tensor) -> None:
        """Hand the drafter the last target forward's features (``DraftContext.capture``), per
        request the positions whose results stand and the token after each (on the forward thread,
        after sampling; ``sampled``: the batch's sampled tokens, a verify's rows in order)."""
        obs, row, k, live = [], 0, 0, set(batch.live)
        for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start, ids = batch.seq_lens[i] - n, batch.input_ids[row + 1:row + n]
            if batch.drafts is not None:  # a verify: the last token and the kept drafts stand
                kept = accepted(batch.drafts[i], sampled[k:k + n])
                ids, k = ids[:kept] + [sampled[k + kept]], k + n
            elif i in live:  # the token sampled after the last position
                ids = ids + [sampled[i]]
            elif start + n < len(r.prompt_ids):  # a prompt's chunk: the next prompt token
                ids = ids + [r.prompt_ids[start + n]]
            else:
                ids = ids[:n - 1]
            if ids:
                obs.append(DraftObservation(_state(r), start, ids, row, kv_indices[i, :start + len(ids)].clone()))
            row += n
        if obs:
            self.drafter.observe(obs, self.features())

    def kept(self, req: Req, draft: list[int], sampled: list[int]) -> list[int]:
        """The tokens a verify keeps: the draft's prefix the target sampled too, then the target's
        own token at the first position where they differ (or after the whole draft)."""
        n = accepted(draft, sampled)
        if draft:
            if req.spec_pace is None:
                req.spec_pace = Pace()
            req.spec_pace.update(n)
        req.spec_verify_ct += 1
        req.spec_num_proposed_drafts += len(draft)
        req.spec_num_correct_drafts += n
        return sampled[:n + 1]


def _state(r: Req) -> dict:
    """The drafter's state of ``r``, emptied where the request was retracted since (its KV dropped)."""
    pace = r.spec_pace = r.spec_pace or Pace()
    if pace.retractions != r.num_retractions:
        pace.retractions, r.spec_state = r.num_retractions, {}
    return r.spec_state


def multi_token_ok(req: Req) -> bool:
    """Whether several of a request's tokens can come out of one forward (speculative verifies,
    continuous decode steps): nothing reads its outputs on the host between two of them."""
    p = req.params
    return (req.grammar is None and not req.return_logprob and not req.top_logprobs_num and not penalised(p)
            and len(req.output_ids) >= p.min_new_tokens)


def accepted(draft: list[int], sampled: list[int]) -> int:
    """How many draft tokens the target's samples at their positions agree with (a prefix)."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n


def build_speculator(args: Any, plugins: Any) -> Speculator | None:
    """The speculator ``--speculative-algorithm`` asks for, or None. A model drafter's chain is
    ``--speculative-num-steps`` long (``--speculative-num-draft-tokens`` is then one more, as
    SGLang sets it for chains); others draft up to ``--speculative-num-draft-tokens`` - 1."""
    name = args.speculative_algorithm
    if not name:
        for flag in ("num_draft_tokens", "num_steps", "eagle_topk", "draft_model_path"):
            if getattr(args, "speculative_" + flag) is not None:
                raise CoreError(f"--speculative-{flag.replace('_', '-')} needs --speculative-algorithm (e.g. NGRAM)")
        return None
    if (args.speculative_eagle_topk or 1) != 1:
        raise CoreError(f"--speculative-eagle-topk {args.speculative_eagle_topk}: draft trees are not supported yet; "
                        "drafts are chains (--speculative-eagle-topk 1)")
    drafter = plugins.resolve("speculative_algorithm", name)(args)
    n = args.speculative_num_draft_tokens
    if hasattr(drafter, "propose_batch"):
        steps = args.speculative_num_steps if args.speculative_num_steps is not None else DEFAULT_NUM_STEPS
        if steps < 1:
            raise CoreError(f"--speculative-num-steps must be >= 1, got {steps}")
        if n is not None and n != steps + 1:
            log.warning("speculative.num_draft_tokens_adjusted", asked=n, used=steps + 1, why="a chain of "
                        "--speculative-num-steps drafts and the last token")
        n = steps + 1
    else:
        if args.speculative_draft_model_path is not None:
            raise CoreError(f"--speculative-draft-model-path is not used by --speculative-algorithm {name}")
        n = n or DEFAULT_NUM_DRAFT_TOKENS
    if n < 2:
        raise CoreError(f"--speculative-num-draft-tokens must be >= 2 (the last token and a draft), got {n}")
    return Speculator(drafter, n)
