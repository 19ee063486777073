"""What the scheduler hands the model runner for one forward, and what comes back: plain Python
data, so that the scheduler never touches the device and a test can drive it without a model."""

from __future__ import annotations

from typing import Any

import attrs

from core.engine.request import Req
from core.engine.sampler import DeviceSample, SampleOutput, rewind


@attrs.define
class ScheduledBatch:
    """One forward's worth of work, as plain Python data: the model runner owns every device
    tensor and builds them from these lists (the scheduler never touches the device)."""

    reqs: list[Req]
    extend_lens: list[int]
    input_ids: list[int]  # [T] flattened new tokens
    positions: list[int]  # [T] absolute position of each new token
    out_cache_loc: list[int]  # [T] KV slot of each new token
    is_prefill: bool
    # (table rows, positions, slots) the runner records in the request -> token table before the
    # forward: the new tokens' slots plus any cached-prefix slots of these requests not yet written
    table_writes: tuple[list[int], list[int], list[int]] = ([], [], [])
    # decode steps this batch may run (--num-continuous-decode-steps): ``input_ids`` and
    # ``positions`` are the first step's, ``out_cache_loc`` holds step k's slots at [k * B, (k + 1) * B)
    steps: int = 1
    steps_run: int = 1  # those the runner ran (a stop token ends them early)
    # per request, as built (the runner reads these, never the requests' own fields, which the
    # scheduler changes while an overlapped forward runs): table row, KV length after the batch
    rows: list[int] = attrs.field(factory=list)
    seq_lens: list[int] = attrs.field(factory=list)
    live: list[int] = attrs.field(factory=list)  # the indices that sample a token (a prompt's last chunk or a decode)
    futures: bool = False  # some input id is a future_id: the previous batch's sampled token, resolved by the runner
    # speculative decoding: each request's draft (its extend is its last token and the draft; every
    # position samples), or None
    drafts: list[list[int]] | None = None
    draft_pending: bool = False  # ``drafts`` are a model drafter's, made by the runner (Speculator.fill)
    draft_parents: list[list[int] | None] | None = None  # per request, its draft tree's parents (None: a chain)
    # KV load-backs queued while this batch was built (HiCache: mem_cache.host_pool.KVLoads), which
    # the runner issues as its forward starts, after every forward before it; None: none
    kv_loads: object = None
    # each seeded request's generator state before this batch sampled (``sampler.rng_states``: overlap, verifies)
    rng_states: dict = attrs.field(factory=dict)

    def drop_token(self, req: Req) -> None:
        """``req``'s token from this batch is not kept: its draw is not spent (a seeded request)."""
        if (state := self.rng_states.get(req)) is not None:
            rewind(req.generator, state)


def future_id(index: int) -> int:
    """The input id standing for the token the in-flight batch samples at ``index`` (overlap
    scheduling: the batch is built before that token is on the host)."""
    return -1 - index


@attrs.define
class StepResult:
    sample: SampleOutput | None  # the (first) step's tokens; None while ``pending``
    # the tokens of a multi-step decode's later steps, one list per step (``ScheduledBatch.steps``)
    more_tokens: list[list[int]] = attrs.field(factory=list)
    # per request index: (logprobs of prompt tokens from logprob_start_len, their top logprobs, those of
    # its token_ids_logprob)
    input_logprobs: dict[int, tuple[list[float | None], list, list]] = attrs.field(factory=dict)
    # a verify, per request: the draft nodes kept (root to leaf) and the target's token after them
    # (``Speculator.walks``, computed once by the runner for the KV moves, the drafter and the scheduler)
    kept: list[tuple[list[int], int]] | None = None
    # the tokens still on their way from the device (``ModelRunner.defer_results``): ``resolve`` waits
    pending: DeviceSample | None = None
    # per request index: the hidden states of a request that asked (``core.engine.hidden_states.rows``), or None
    hidden: dict[int, Any] | None = None

    def resolve(self) -> StepResult:
        """Itself with ``sample`` on the host (waits for a pending copy: on the forward thread,
        after the next batch's launch)."""
        if self.pending is not None:
            self.sample, self.pending = self.pending.finish(), None
        return self
