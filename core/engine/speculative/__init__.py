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

from typing import Any

import attrs

from core.engine.request import Req
from core.engine.sampler import penalised
from core.errors import CoreError

DEFAULT_NUM_DRAFT_TOKENS = 12  # SGLang's default for NGRAM: the last token and 11 drafted


@attrs.define
class Speculator:
    """What the scheduler asks for drafts (``drafts``) and uses to count what a verify kept."""

    drafter: Any  # core.interfaces.Drafter
    num_draft_tokens: int  # tokens per verify and request, the last known one included (SGLang's meaning)

    def drafts(self, reqs: list[Req], context_len: int) -> list[list[int]] | None:
        """A draft per request (maybe empty), or None where the batch decodes plainly: some
        request cannot be drafted for, or no draft was proposed."""
        if any(not multi_token_ok(r) for r in reqs):
            return None
        out = []
        for r in reqs:
            room = min(self.num_draft_tokens - 1, r.params.max_new_tokens - len(r.output_ids) - 1,
                       context_len - r.seq_len - 1)
            out.append(self.drafter.propose(r.spec_state, r.fill_ids(), room)[:room] if room > 0 else [])
        return out if any(out) else None


    def verify_batch(self, scheduler: Any, reqs: list[Req]) -> Any:
        """A verify batch of ``reqs`` (each one's last token and draft as one extend), or None where
        the batch decodes plainly: no drafts, or the pool cannot hold the verify's pages."""
        drafts = self.drafts(reqs, scheduler.context_len)
        pages_for = scheduler.allocator.pages_for
        if drafts is None or not scheduler._can_alloc(sum(max(0, pages_for(r.kv_len + 1 + len(d)) - len(r.pages))
                                                          for r, d in zip(reqs, drafts))):
            return None
        batch = scheduler._build(reqs, [1 + len(d) for d in drafts], prefill=False)
        batch.input_ids = [t for r, n, d in zip(reqs, batch.extend_lens, drafts) for t in (r.token_at(r.kv_len - n), *d)]
        batch.drafts = drafts
        return batch

    @staticmethod
    def kept(req: Req, draft: list[int], sampled: list[int]) -> list[int]:
        """The tokens a verify keeps: the draft's prefix the target sampled too, then the target's
        own token at the first position where they differ (or after the whole draft)."""
        n = accepted(draft, sampled)
        req.spec_verify_ct += 1
        req.spec_num_proposed_drafts += len(draft)
        req.spec_num_correct_drafts += n
        return sampled[:n + 1]


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
    """The speculator ``--speculative-algorithm`` asks for, or None."""
    name = args.speculative_algorithm
    if not name:
        if args.speculative_num_draft_tokens is not None:
            raise CoreError("--speculative-num-draft-tokens needs --speculative-algorithm (e.g. NGRAM)")
        return None
    n = args.speculative_num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS
    if n < 2:
        raise CoreError(f"--speculative-num-draft-tokens must be >= 2 (the last token and a draft), got {n}")
    return Speculator(plugins.resolve("speculative_algorithm", name)(args), n)
