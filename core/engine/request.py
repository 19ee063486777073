"""A request's state as it moves through the engine (one sequence; n>1 becomes n of these)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import attrs
import torch

from core.engine.multimodal import ADAPTER_KEY_BIT, IMAGE_KEY_BASE
from core.engine.sampler import penalised
from core.engine.sampling_params import SamplingParams


@attrs.define(eq=False)
class Req:
    """Built by ``AsyncEngine.make_requests``; the scheduler owns its KV fields, the engine loop
    its outputs. Compared by identity (``eq=False``): two requests are never equal."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: also return logprobs of prompt tokens from this index
    generator: torch.Generator | None = None
    detokenizer: Any = None  # IncrementalDetokenizer, or None without a tokenizer
    priority: int | None = None  # with --enable-priority-scheduling (higher first unless --schedule-low-priority-values-first)
    grammar: Any = None  # core.interfaces.Grammar matcher of a constrained request (core.engine.grammar)
    # the API request this sequence belongs to (its n > 1 copies and batch items share it): what an
    # abort by id reaches besides the exact rid; "" for none
    group: str = ""
    lora_id: int = 0  # the LoRA adapter's uid (core.engine.lora), 0: the base model
    mm: Any = None  # core.engine.multimodal.ImageInputs of a request with images (prompt_ids are its input_ids)
    log_metrics: bool = True  # SGLang's log_metrics: False keeps the request out of the /metrics counters
    # SGLang's return_hidden_states (core.engine.hidden_states): False, True (every token) or "last"
    return_hidden_states: bool | str = False
    # SGLang's token_ids_logprob: with return_logprob, these tokens' logprobs at every position asked for
    token_ids_logprob: list[int] | None = None
    routed_dp_rank: int | None = None  # SGLang's: the data-parallel replica it must run on (None: the router's choice)
    # (kind, spec) the sampling params constrain the output to, or None; derived once, here
    constraint: tuple[str, str] | None = attrs.field(init=False)
    # whether sampling may read its outputs on the host between two of its tokens for a reason its
    # sampling params fix (penalties, min_new_tokens): ``speculative.host_read`` looks no further
    # than its grammar and logprobs when this is False
    may_read_outputs: bool = attrs.field(init=False)

    output_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    output_logprobs: list[float] = attrs.field(factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = attrs.field(factory=list)
    input_logprobs: list[float | None] = attrs.field(factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = attrs.field(factory=list)
    output_token_ids_logprobs: list[list[tuple[int, float]]] = attrs.field(factory=list)
    input_token_ids_logprobs: list[list[tuple[int, float]]] = attrs.field(factory=list)
    hidden_states: list = attrs.field(factory=list)  # the prompt's rows, then one vector per token fed back

    # KV state, owned by the scheduler
    row: int = -1
    pages: list[int] = attrs.field(factory=list)
    kv_len: int = 0
    # KV positions whose forward has been processed (the rest of kv_len is in flight under overlap
    # scheduling): what may enter the prefix cache
    kv_done: int = 0
    # this request's index in the last batch built with it: a batch built while that one is in
    # flight refers to its sampled token by this index (core.engine.scheduler.future_id)
    future_index: int = -1
    sampling_row: Any = None  # the model runner's SamplingRow for this request (made once per table row)
    # speculative decoding: the drafter's own state, and SGLang's counts (meta_info spec_*)
    spec_state: dict = attrs.field(factory=dict)
    spec_pace: Any = None  # core.engine.speculative.Pace: how long its drafts should be, kept by the engine
    spec_verify_ct: int = 0  # decode forwards (verifies) that produced this request's tokens
    spec_num_proposed_drafts: int = 0
    spec_num_correct_drafts: int = 0
    cached_tokens: int = 0
    tree_pages: int = 0  # leading entries of ``pages`` owned by the radix cache (locked through last_node)
    last_node: Any = None  # radix node locked by this request, or None
    prefix_len: int = 0  # scheduler scratch: cached prefix found when last matched while waiting
    num_retractions: int = 0

    finish_reason: dict | None = None
    aborted: bool = False
    abort_message: str = "request aborted"  # the finish message once an abort is reaped
    arrival: float = attrs.field(factory=time.perf_counter)
    first_token_time: float | None = None
    forward_entry_time: float | None = None  # its first admission into a batch (the end of its queueing)
    finish_time: float | None = None

    # update delivery (``notify``): what the consumers (core.engine.frontend, data_parallel.replica) wait on
    updated: bool = attrs.field(default=False, init=False, repr=False)  # notified since a consumer last looked
    watcher: Callable[[Req], None] | None = attrs.field(default=None, init=False, repr=False)  # stream_many's feed
    _next: asyncio.Future | None = attrs.field(default=None, init=False, repr=False)  # a stream's: the next notify
    _done: asyncio.Future | None = attrs.field(default=None, init=False, repr=False)  # a drain's: the finish

    def notify(self) -> None:
        """The engine's signal after each step the request took and when it finished: O(1), and
        wakes nobody unless a consumer waits on it (a stream's next update, a drain's finish)."""
        self.updated = True
        if (f := self._next) is not None:
            self._next = None
            if not f.done():
                f.set_result(None)
        if self.watcher is not None:
            self.watcher(self)
        if self.finish_reason is not None and (f := self._done) is not None:
            self._done = None
            if not f.done():
                f.set_result(None)

    async def next_update(self) -> None:
        """Return once notified since the last call (at once if already): notifies that came while
        the consumer was away coalesce into one. One such consumer per request."""
        if not self.updated:
            fut = self._next = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                if self._next is fut:
                    self._next = None
        self.updated = False

    async def wait_finished(self) -> None:
        """Return once the request has finished (its finishing ``notify``); no wake-up before."""
        if self.finish_reason is not None:
            return
        fut = self._done
        if fut is None or fut.done():
            fut = self._done = asyncio.get_running_loop().create_future()
        await asyncio.shield(fut)  # several waiters may share it; a cancelled one leaves it to the others

    def answers_to(self, rid: str) -> bool:
        """Whether an abort or a duplicate check for ``rid`` concerns this sequence."""
        return self.rid == rid or self.group == rid

    @constraint.default
    def _constraint(self) -> tuple[str, str] | None:
        return self.params.constraint()

    @may_read_outputs.default
    def _may_read_outputs(self) -> bool:
        p = self.params
        return p.min_new_tokens > 0 or penalised(p) or p.thinking is not None or p.custom_logit_processor is not None

    def add_logprobs(self, sample: Any, i: int) -> None:
        """Row ``i`` of a step's ``SampleOutput``: the chosen token's logprob, and the top ones and
        those of ``token_ids_logprob`` where asked for."""
        self.output_logprobs.append(sample.logprobs[i])
        if self.top_logprobs_num and sample.top_logprobs is not None:
            self.output_top_logprobs.append(sample.top_logprobs[i])
        if self.token_ids_logprob and sample.token_ids_logprobs is not None:
            self.output_token_ids_logprobs.append(sample.token_ids_logprobs[i])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs (and every prompt token's hidden state) need the whole prompt computed in
        one prefill: no cached prefix, no chunks."""
        return (self.return_logprob and self.logprob_start_len >= 0) or self.return_hidden_states is True

    def add_hidden(self, states: list) -> None:
        """The hidden states of the forward that produced this request's newest token (``hidden_states.rows``)."""
        if self.return_hidden_states == "last":
            self.hidden_states[:] = [states]
        else:
            self.hidden_states.append(states)

    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cache_ids(self) -> list[int]:
        """``fill_ids`` as the prefix cache keys them: an image's tokens by its content, and an
        adapter's tokens with its uid in the bits above 32 (token ids are below 2**32), so a prefix
        computed under one adapter is never matched by a request of another or of the base model,
        nor one with another image, in any cache tier. An image's keys (bit 62 set, its hash in bits
        20-59) take the adapter by remixing their hash bits instead (an OR could turn them into
        another image's keys under the base model) and by ``ADAPTER_KEY_BIT``, so that the storage
        tier, which outlives the process and its uids, can tell them apart (``is_adapter_key``)."""
        ids = self.prompt_ids + self.output_ids
        if self.mm is not None:  # image tokens keyed by the image's content (core.engine.multimodal)
            ids = self.mm.cache_ids(ids)
        if not self.lora_id:
            return ids
        tag, mix = self.lora_id << 32, ((self.lora_id * 0x9E3779B97F4A7C15) & ((1 << 40) - 1)) << 20
        return [(t ^ mix) | ADAPTER_KEY_BIT if t >= IMAGE_KEY_BASE else tag | t for t in ids]

    def tokens(self, start: int, end: int) -> list[int]:
        """``fill_ids()[start:end]`` without building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def meta_info(self) -> dict:
        """SGLang's meta_info fields."""
        info: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "e2e_latency": (self.finish_time or time.perf_counter()) - self.arrival,
        }
        if self.spec_verify_ct:  # SGLang's speculative decoding fields
            info["spec_verify_ct"] = self.spec_verify_ct
            info["spec_accept_length"] = len(self.output_ids) / self.spec_verify_ct
            info["spec_num_correct_drafts"] = self.spec_num_correct_drafts
            info["spec_num_proposed_drafts"] = self.spec_num_proposed_drafts
            if self.spec_num_proposed_drafts:
                info["spec_accept_rate"] = self.spec_num_correct_drafts / self.spec_num_proposed_drafts
        if self.return_logprob:  # SGLang's shape: (logprob, token id, text), the text None (the server fills it)
            info["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(self.output_logprobs, self.output_ids)]
            if self.top_logprobs_num:
                info["output_top_logprobs"] = _tops(self.output_top_logprobs)
            # always present, as in SGLang: empty unless logprob_start_len asked for prompt positions
            toks = self.prompt_ids[self.logprob_start_len :] if self.logprob_start_len >= 0 else []
            info["input_token_logprobs"] = [(lp, t, None) for lp, t in zip(self.input_logprobs, toks)]
            if self.top_logprobs_num:
                info["input_top_logprobs"] = _tops(self.input_top_logprobs)
            if self.token_ids_logprob:
                info["output_token_ids_logprobs"] = _tops(self.output_token_ids_logprobs)
                info["input_token_ids_logprobs"] = _tops(self.input_token_ids_logprobs)
        if self.return_hidden_states is True:  # SGLang's: every entry so far
            info["hidden_states"] = list(self.hidden_states)
        elif self.return_hidden_states and self.hidden_states:  # "last": the newest vector
            info["hidden_states"] = self.hidden_states[-1]
        return info


def _tops(positions: list[list[tuple[int, float]]]) -> list:
    """Top logprobs as SGLang returns them: per position (logprob, token id, text) entries, or None
    for a position without any (the prompt's first token)."""
    return [[(lp, t, None) for t, lp in pos] if pos else None for pos in positions]
