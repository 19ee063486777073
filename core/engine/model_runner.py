"""One batched forward over the paged KV cache, then sampling.

Runs on the engine's worker thread. Logits are computed only for the positions
that need them: each sequence's last token, plus prompt positions when a request
asked for prompt logprobs.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import torch

from core.interfaces import ForwardBatch, KVCache
from core.layers import fused
from core.engine.mem_cache.kv_cache import ReqToTokenTable, copy_rows
from core.engine.cuda_graph import CudaGraphRunner
from core.engine.hybrid_attention import decode_backend, phase_backend
from core.engine.hidden_states import rows as hidden_rows
from core.engine.sampler import SampleOutput, Sampler, SamplingRow, finite_logprobs, rewind, rng_states, upload
from core.engine.scheduler import ScheduledBatch, StepResult
from core.engine.speculative import verify_rows
from core.engine.speculative.accept import target_rows
from core.engine.speculative.tree import mask_rows


@attrs.define
class StepInputs:
    """What one forward needs beyond the weights and the KV pool, as plain data: what rank 0
    broadcasts to the other tensor-parallel ranks each step (``core.engine.distributed.tensor_parallel``), so
    that every rank runs the same forward and the same ``compute_logits`` calls."""

    input_ids: list[int]
    positions: list[int] | torch.Tensor  # [T]
    out_cache_loc: list[int] | torch.Tensor  # [T]
    seq_lens: list[int]
    extend_lens: list[int]
    kv_indices: torch.Tensor  # [B, max(seq_lens)]
    logit_rows: list[Any]  # per compute_logits call, in order: a list of hidden-state rows or a (start, stop) range
    tree_mask: torch.Tensor | None = None  # a verify of draft trees: ForwardBatch.tree_mask, on the host
    kv_moves: tuple[list[int], list[int]] | None = None  # (source, destination) KV slots to copy first (a tree's kept path)
    lora: bool = False  # some token runs through a LoRA adapter (ForwardBatch.lora): the runner set the pool's segments
    # images (core.engine.multimodal): ForwardBatch.mm_rows / mm_embeds / mrope_positions, on the device
    mm_rows: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    # the previous batch's sampled tokens still on the device (``ModelRunner.defer_results``): a
    # negative input id (``schedule_batch.future_id``) reads its token here, on the device
    future_tokens: torch.Tensor | None = None
    kv_loads: Any = None  # mem_cache.host_pool.KVLoads issued for this forward (HiCache load-backs), or None
    lora_sync: Any = None  # core.engine.lora.tp.LoRASync: the adapters' state the other tensor-parallel ranks take


def _ints(x: list[int] | torch.Tensor) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else x


def forward_step(model: torch.nn.Module, attn_backend, inputs: StepInputs, device: torch.device,
                 graphs: CudaGraphRunner | None = None, kv: KVCache | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """The model forward over ``inputs`` and one ``compute_logits`` per entry of ``logit_rows``:
    (hidden states, logits, each sampling row's argmax where the model computed it with the logits,
    else None). The same on every tensor-parallel rank (their collectives pair up).

    A CPU model's ``decode_step`` (``CausalLM``) may take the whole step from the lists. Otherwise
    the model runs on ``forward_batch(inputs)``, or a decode step (or verify) that ``graphs``
    captured replays its CUDA graph instead of the eager forward. ``inputs.kv_moves`` are copied in ``kv`` first."""
    if inputs.kv_moves is not None and kv is not None:
        move_kv(kv, *inputs.kv_moves)
    # per-phase backends (core.engine.hybrid_attention): this batch's own; the decode fast path only with the
    # decode backend (a prefill batch never takes it: its plans, keyed by backend, stay put)
    phase = phase_backend(attn_backend, inputs.extend_lens, inputs.tree_mask is not None)
    decoding, attn_backend = phase is decode_backend(attn_backend), phase
    if (device.type == "cpu" and decoding and inputs.future_tokens is None and (not inputs.lora or getattr(model, "decode_lora", False))  # (adapters: where it adds them)
            and (fast := getattr(model, "decode_step", None)) is not None):
        if (out := fast(inputs, attn_backend)) is not None:
            return out[0], [out[1]], out[2]
    fb = forward_batch(inputs, attn_backend, device)
    if graphs is not None and (((not inputs.lora or graphs.lora is not None) and graphs.can_run(fb))
                               or graphs.can_verify(fb)):
        if inputs.kv_loads is not None:
            inputs.kv_loads.wait_all()
        hidden = graphs.replay(fb)
    else:
        if inputs.kv_loads is not None:  # per layer where the shared Attention layers read the pool, else all first
            if _attention_layers(model) == len(inputs.kv_loads.events):
                fb.layer_ready = inputs.kv_loads.wait_layer
            else:
                inputs.kv_loads.wait_all()
        attn_backend.prepare(fb)
        hidden = model(fb)
    return hidden, step_logits(model, hidden, inputs.logit_rows, device), None


def _attention_layers(model: torch.nn.Module) -> int:
    """How many ``core.layers.Attention`` the model holds (they call ``ForwardBatch.layer_ready``)."""
    if (n := model.__dict__.get("_core_attention_layers")) is None:
        from core.layers import Attention

        n = model.__dict__["_core_attention_layers"] = sum(isinstance(m, Attention) for m in model.modules())
    return n


def forward_batch(inputs: StepInputs, attn_backend, device: torch.device) -> ForwardBatch:
    """The ``ForwardBatch`` of ``inputs``: the per-token and per-sequence lists reach the device in
    one copy (pinned, non-blocking on a GPU)."""
    t, b = len(inputs.input_ids), len(inputs.seq_lens)
    packed = upload(inputs.input_ids + _ints(inputs.positions) + _ints(inputs.out_cache_loc) + inputs.seq_lens
                    + inputs.extend_lens, torch.int64, device)
    input_ids, positions, out_cache_loc, seq_lens, extend_lens = packed.split([t, t, t, b, b])
    if (future := inputs.future_tokens) is not None:  # future ids -1 - i: the previous batch's i-th token
        input_ids = torch.where(input_ids < 0, future[(-1 - input_ids).clamp_(min=0)], input_ids)
    # ForwardBatch's promise: columns past a sequence's length hold the zeroed padding slot 0. The
    # table's rows keep an earlier occupant's slots there, and a multi-step decode's later steps'
    # slots are not written yet (fresh pool memory may be NaN, and a padded gather's 0 x NaN is NaN).
    n = max(inputs.seq_lens)
    kv_indices = inputs.kv_indices[:, :n].to(device)
    if (k := fused(kv_indices)) is not None and hasattr(k, "zero_past") and kv_indices.stride(1) == 1:
        kv_indices = k.zero_past(kv_indices, seq_lens)  # (one copy on the CPU, where the torch form took ~70 us)
    else:
        kv_indices = kv_indices.masked_fill(torch.arange(n, device=device)[None, :] >= seq_lens[:, None], 0)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, seq_lens=seq_lens,
        extend_lens=extend_lens, kv_indices=kv_indices, seq_lens_cpu=inputs.seq_lens,
        extend_lens_cpu=inputs.extend_lens,
        attn_backend=phase_backend(attn_backend, inputs.extend_lens, inputs.tree_mask is not None),
        tree_mask=None if inputs.tree_mask is None else inputs.tree_mask.to(device, non_blocking=True), lora=inputs.lora,
        mm_rows=inputs.mm_rows, mm_embeds=inputs.mm_embeds, mrope_positions=inputs.mrope_positions,
    )


def move_kv(kv: KVCache, src: list[int], dst: list[int]) -> None:
    """Copy every layer's K and V rows at slots ``src`` to ``dst`` (gathered before written)."""
    s, d = (torch.tensor(x, dtype=torch.int64, device=kv.k[0].device) for x in (src, dst))
    copy_rows([*kv.k, *kv.v], s, [*kv.k, *kv.v], d)


def step_logits(model: torch.nn.Module, hidden: torch.Tensor, logit_rows: list[Any], device: torch.device) -> list[torch.Tensor]:
    """One ``compute_logits`` per entry of ``logit_rows`` (a list of rows or a (start, stop) range)."""
    logits = []
    for rows in logit_rows:
        if isinstance(rows, tuple):  # all of hidden (a decode step) passes as itself: see LlamaModel.step_logits
            sel = hidden if rows == (0, hidden.shape[0]) else hidden[rows[0] : rows[1]]
        elif len(rows) == hidden.shape[0] and rows[0] == 0 and rows[-1] == len(rows) - 1:
            sel = hidden  # every token samples: no gather
        else:
            sel = hidden.index_select(0, upload(rows, torch.int64, device))
        logits.append(model.compute_logits(sel))
    return logits


class ModelRunner:
    """Owns every device tensor of a step: it writes the scheduler's table entries, builds the
    forward's inputs from the batch's lists, runs the forward (or its CUDA graph) and samples.
    The one host sync of a step is the sampled token ids coming back."""

    grammar = None  # core.engine.grammar.GrammarManager, set by the engine
    speculator = None  # core.engine.speculative.Speculator with --speculative-algorithm, set by the engine
    kv_cache: KVCache | None = None  # the pool, for a tree verify's KV moves; set by the engine
    _kv_moves: tuple[list[int], list[int]] | None = None  # a verify's moves the other tensor-parallel ranks make next
    tp = None  # core.engine.distributed.tensor_parallel.TensorParallelGroup on rank 0 of a --tp-size > 1 engine, set by the engine
    graphs: CudaGraphRunner | None = None  # decode CUDA graphs, set by the engine when captured
    lora = None  # core.engine.lora.LoRAServing with --enable-lora, set by the engine
    mm = None  # core.engine.multimodal.engine.MultimodalServing of a vision-language model, set by the engine
    _last_tokens: list[int] | torch.Tensor | None = None  # the last batch's sampled tokens (what future ids stand for)
    # a plain decode's sampled tokens stay on the device, their copy to the host started, and the
    # batch's result is ``pending`` until resolved (``StepResult.resolve``): overlap scheduling on a
    # GPU, set by the engine. The next batch's future ids read them on the device, so its launch
    # never waits for the copy (SGLang's future token map).
    defer_results = False
    overlap = False  # overlap scheduling (set by the engine): a batch's token may be dropped (``ScheduledBatch.drop_token``)
    # some request asked for its hidden states (set by the front end, for good): each batch is checked
    # for them (``core.engine.hidden_states.rows``); until then, never
    hidden_states = False

    def __init__(self, model: torch.nn.Module, attn_backend, table: ReqToTokenTable, sampler: Sampler,
                 eos_ids: tuple[int, ...], device: torch.device) -> None:
        self.model, self.attn_backend, self.table = model, attn_backend, table
        self.sampler, self.eos_ids, self.device = sampler, eos_ids, device

    def step_inputs(self, batch: ScheduledBatch) -> tuple[StepInputs, list[int], dict[int, int]]:
        """(the forward's inputs, the batch indices that sample a token, batch index -> position
        in ``logit_rows`` of its prompt-logprob rows, -1 when it has none to compute).

        Records the batch's slots in the request -> token table first (one copy of the
        entries and the batch's rows, then a scatter on the table's device)."""
        reqs, table, rows = batch.reqs, self.table.table, batch.rows
        w_rows, w_cols, w_slots = batch.table_writes
        w, b = len(w_rows), len(reqs)
        seq_lens = batch.seq_lens  # as built: the requests' own fields may have moved on (overlap)
        n = max(seq_lens)  # the columns in use
        if (view := self.table.host) is not None:  # through numpy: ~3 us, where 5 torch indexing ops took ~50
            if w > 8:
                view[w_rows, w_cols] = w_slots
            else:  # a few decodes' entries one by one: numpy's list indexing took ~45 us with cold caches
                for r, c, slot in zip(w_rows, w_cols, w_slots):
                    view[r, c] = slot
            # one sequence's row is a slice (numpy's list indexing: another ~40 us with cold caches);
            # several, a contiguous copy of their columns in use
            row = rows[0]
            kv_indices = torch.from_numpy(view[row : row + 1, :n] if b == 1 else view[rows, :n])
        else:
            packed = upload(w_rows + w_cols + w_slots + rows, torch.int64, table.device)
            if w:
                table[packed[:w], packed[w : 2 * w]] = packed[2 * w : 3 * w]
            kv_indices = table[packed[3 * w :], :n]
        if not batch.is_prefill:  # decode (or a speculative verify: every row): every request samples, no prompt logprobs
            return StepInputs(batch.input_ids, batch.positions, batch.out_cache_loc, seq_lens, batch.extend_lens,
                              kv_indices, [(0, len(batch.input_ids))], tree_masks(batch)), list(range(b)), {}
        ends = [n - 1 for n in itertools.accumulate(batch.extend_lens)]
        live = batch.live  # a non-final prefill chunk samples nothing
        logit_rows: list[Any] = [[ends[i] for i in live]] if live else []
        prompt_rows: dict[int, int] = {}
        for i, r in enumerate(reqs):
            # only a prefill from position 0 (prompt-logprob requests never use a cached prefix or chunks)
            if r.return_logprob and r.logprob_start_len >= 0 and seq_lens[i] == batch.extend_lens[i]:
                start, first, n = ends[i] - batch.extend_lens[i] + 1, max(r.logprob_start_len, 1), len(r.prompt_ids)
                prompt_rows[i] = len(logit_rows) if first < n else -1
                if first < n:
                    logit_rows.append((start + first - 1, start + n - 1))
        inputs = StepInputs(batch.input_ids, batch.positions, batch.out_cache_loc, seq_lens, batch.extend_lens,
                            kv_indices, logit_rows)
        return inputs, live, prompt_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        """One batch: the forward, sampling, prompt logprobs. Batches run in the order they were
        built, so a batch built while another was in flight (overlap scheduling) finds that one's
        sampled tokens here, for its future ids."""
        loads = batch.kv_loads.issue() if batch.kv_loads is not None else None  # (first: see AsyncEngine._complete)
        last, self._last_tokens = self._last_tokens, None  # (a failed batch leaves none to resolve)
        future = None
        if batch.futures and isinstance(last, torch.Tensor) and batch.steps == 1:  # on the device: resolved there (forward_batch)
            future = last
        elif batch.futures:
            last = last.tolist() if isinstance(last, torch.Tensor) else last
            batch.input_ids = [t if t >= 0 else (last[-1 - t] if last is not None else 0) for t in batch.input_ids]
        if batch.steps > 1:
            if loads is not None:
                loads.wait_all()
            return self._run_steps(batch)
        result = self._run_one(batch, future, loads)
        self._last_tokens = result.pending.tokens if result.pending is not None else result.sample.token_ids
        return result

    def _run_one(self, batch: ScheduledBatch, future: torch.Tensor | None = None, loads: Any = None) -> StepResult:
        inputs, live, prompt_rows = self.step_inputs(batch)
        inputs.future_tokens, inputs.kv_loads = future, loads
        if batch.draft_pending:  # a model drafter's drafts, into the verify's input ids
            self.speculator.fill(batch, inputs.kv_indices)
            inputs.input_ids, inputs.positions, inputs.tree_mask = batch.input_ids, batch.positions, tree_masks(batch)
        hidden, all_logits, argmax_ids = self._forward(inputs, batch.reqs)
        states = hidden_rows(batch, hidden, live) if self.hidden_states else None  # (requests that asked)
        reqs = all_reqs = batch.reqs
        target = None  # a verify's sampled target distributions, for relaxed acceptance
        if len(live) < len(reqs):
            reqs = [reqs[i] for i in live]
        if reqs:
            logits = all_logits[0]
            eos = self.eos_ids
            rows = batch.rows if len(live) == len(all_reqs) else [batch.rows[i] for i in live]
            rows_ = [sr if (sr := r.sampling_row) is not None and sr.slot == row else _new_sampling_row(r, row, eos)
                     for r, row in zip(reqs, rows)]  # (made once per table row it holds, not once a step)
            if batch.drafts is not None:  # a verify: each request's rows sample as its decodes would
                rows_ = verify_rows(batch, rows_)
            grammar = self.grammar if self.grammar is not None and any(r.grammar is not None for r in reqs) else None
            if grammar is not None:  # one [B, V/32] bitmask for the batch, applied before sampling
                grammar.apply(logits, reqs)
                argmax_ids = None  # the masked logits' argmax may differ
            if self.overlap or batch.drafts is not None:  # (a token overlap drops, a verify's rejected rows)
                batch.rng_states = rng_states(reqs)
            if batch.drafts is not None and self.speculator.accept is not None:  # (before sampling edits the logits)
                target = target_rows(batch, self.sampler, logits, rows_)
            if (self.defer_results and grammar is None and states is None and not batch.is_prefill and batch.drafts is None
                    and (self.speculator is None or self.speculator.features is None)):  # a plain decode: every
                # row live, nothing read on the host here (an EAGLE head's observe reads the tokens)
                return StepResult(None, pending=self.sampler.sample(logits, rows_, argmax_ids, host=False))
            result = StepResult(self.sampler.sample(logits, rows_, argmax_ids))
            if grammar is not None:
                grammar.accept(reqs, result.sample.token_ids)
        else:
            result = StepResult(SampleOutput([], None, None))
        if reqs is not all_reqs:
            result.sample = _scatter(result.sample, live, len(all_reqs))
        if batch.drafts is not None:  # a verify: the kept paths; a tree's kept KV to its positions, now
            result.kept = self.speculator.walks(batch, result.sample.token_ids, target, self.sampler.generator)
            for r, (path, _) in zip(batch.reqs, result.kept):  # a seed spends a draw per token kept, as decoding does
                if r in batch.rng_states:
                    rewind(r.generator, batch.rng_states[r], len(path) + 1)
            if batch.draft_parents and (moves := self.speculator.verified(batch, result.kept, inputs.kv_indices)):
                move_kv(self.kv_cache, *moves)  # now: the results put these pages into the prefix cache (and its host copies)
                self._kv_moves = moves if self.tp is not None else None  # the other ranks: before their next forward
        if self.speculator is not None and self.speculator.features is not None:  # an EAGLE head reads the target's features
            self.speculator.observe(batch, result.sample.token_ids, result.kept, inputs.kv_indices)
        for i, k in prompt_rows.items():
            result.input_logprobs[i] = self._prompt_logprobs(all_logits[k] if k >= 0 else None, all_reqs[i])
        result.hidden = states
        return result

    def _forward(self, inputs: StepInputs, reqs: list) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """``forward_step`` over ``inputs`` (each request's tokens through its LoRA adapter; the other
        tensor-parallel ranks first make the last tree verify's KV moves, which this rank made at the
        verify); with tensor parallelism on every rank (their collectives pair up), else with this
        runner's CUDA graphs."""
        if self._kv_moves is not None:
            inputs, self._kv_moves = attrs.evolve(inputs, kv_moves=self._kv_moves), None
        if self.lora is not None:  # each request's tokens through its adapter (the pool's segments for this forward)
            inputs.lora = self.lora.prepare([r.lora_id for r in reqs], inputs.extend_lens)
            inputs.lora_sync = self.lora.ranks.take() if self.lora.ranks is not None else None
        if self.mm is not None and any(r.mm is not None for r in reqs):  # images: their rows, M-RoPE positions
            starts = [n - e for n, e in zip(inputs.seq_lens, inputs.extend_lens)]
            inputs.positions, inputs.mm_rows, inputs.mm_embeds, inputs.mrope_positions = self.mm.forward_inputs(
                reqs, starts, inputs.extend_lens, _ints(inputs.positions))
        if self.tp is not None:  # (this rank made the moves at the verify)
            here = attrs.evolve(inputs, kv_moves=None) if inputs.kv_moves is not None else inputs
            return self.tp.forward(inputs, lambda: forward_step(self.model, self.attn_backend, here, self.device,
                                                                kv=self.kv_cache))
        return forward_step(self.model, self.attn_backend, inputs, self.device, self.graphs, self.kv_cache)

    def _run_steps(self, batch: ScheduledBatch) -> StepResult:
        """A decode batch of ``batch.steps`` steps (``--num-continuous-decode-steps``), each step's
        tokens the next step's inputs, ending early after a step that produced a stop token of
        any request (EOS unless ignored, ``stop_token_ids``). An all-greedy batch on the CPU runs
        them as one call of the model's ``decode_steps`` where it has one; otherwise one forward
        and one sampling a step, without the scheduler and the result processing between them.
        ``batch.steps_run`` becomes the steps run."""
        k, reqs, b = batch.steps, batch.reqs, len(batch.reqs)
        seq0 = [n - k + 1 for n in batch.seq_lens]
        step = StepInputs(batch.input_ids, batch.positions, batch.out_cache_loc[:b], seq0, batch.extend_lens,
                          self.step_inputs(batch)[0].kv_indices, [(0, b)])
        stop = batch_stop_ids(reqs, self.eos_ids)
        lora = self.lora is not None and self.lora.prepare([r.lora_id for r in reqs], batch.extend_lens)
        if (self.tp is None and self.device.type == "cpu" and all(r.params.is_greedy and not r.params.logit_bias for r in reqs)
                and (not lora or getattr(self.model, "decode_lora", False))  # (adapters: where the model adds them)
                and (fast := getattr(self.model, "decode_steps", None)) is not None):
            whole = attrs.evolve(step, out_cache_loc=batch.out_cache_loc, lora=lora)
            if (tokens := fast(whole, decode_backend(self.attn_backend), k, stop)) is not None:
                batch.steps_run = len(tokens)
                return StepResult(SampleOutput(tokens[0], None, None), tokens[1:])
        rows = [SamplingRow(r.params, r.prompt_ids, r.output_ids, r.generator, self.eos_ids, False, 0, row)
                for r, row in zip(reqs, batch.rows)]
        stops = set(stop)
        tokens: list[list[int]] = []
        for j in range(k):
            if j:
                step = StepInputs(tokens[-1], [p + j for p in batch.positions], batch.out_cache_loc[j * b : (j + 1) * b],
                                  [n + j for n in seq0], batch.extend_lens, step.kv_indices, [(0, b)])
            _, logits, argmax_ids = self._forward(step, reqs)
            tokens.append(self.sampler.sample(logits[0], rows, argmax_ids).token_ids)
            if not stops.isdisjoint(tokens[-1]):
                break
        batch.steps_run = len(tokens)
        return StepResult(SampleOutput(tokens[0], None, None), tokens[1:])

    def _prompt_logprobs(self, logits: torch.Tensor | None, req) -> tuple[list, list, list]:
        """Logprob of each prompt token from ``logprob_start_len`` given its prefix (``logits``:
        of the positions before them; None when there are none); the first prompt token has
        none (None), as in SGLang. (SGLang also returns None for the token at a
        ``logprob_start_len`` > 0; its own frontend's unconditional-likelihood ``select`` fails
        on that None, so that token keeps its logprob here.) Then the top logprobs and those of
        ``token_ids_logprob`` where asked for, per position."""
        n = len(req.prompt_ids)
        first = max(req.logprob_start_len, 1)
        vals: list[float | None] = [None] if req.logprob_start_len == 0 else []
        tops: list[list[tuple[int, float]]] = [[]] if req.logprob_start_len == 0 else []
        asked: list[list[tuple[int, float]]] = [[]] if req.logprob_start_len == 0 and req.token_ids_logprob else []
        if first < n:
            lp = finite_logprobs(torch.log_softmax(logits.float(), -1))
            targets = torch.tensor(req.prompt_ids[first:n], device=lp.device)
            vals += lp.gather(1, targets[:, None]).squeeze(1).tolist()
            if req.top_logprobs_num:
                tv, ti = lp.topk(req.top_logprobs_num, dim=-1)
                tops += [list(zip(i, v)) for i, v in zip(ti.tolist(), tv.tolist())]
            if ids := req.token_ids_logprob:
                asked += [list(zip(ids, v)) for v in lp[:, ids].tolist()]
        return vals, tops, asked

    @torch.inference_mode()
    def encode(self, prompts: list[list[int]], make_backend, pooling: str = "last", normalize: bool = True,
               head=None) -> list[list[float]]:
        """Prefill-only forward of ``prompts`` and their pooled final hidden states
        (``pooling``: last, mean or cls; L2-normalised when ``normalize``), or ``head(pooled)``
        (a classification head) when given. It writes into a private scratch KV cache from
        ``make_backend(num_slots)`` (slot 0 padding), so it never touches the scheduler's pool."""
        dev, lens = self.device, [len(p) for p in prompts]
        total = sum(lens)
        backend = phase_backend(make_backend(total + 1), lens)  # (per-phase backends: this batch's)
        starts = torch.tensor([0] + lens[:-1], device=dev).cumsum(0)
        kmax = max(lens)
        j = torch.arange(kmax, device=dev)
        lens_t = torch.tensor(lens, device=dev)
        fb = ForwardBatch(
            input_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(n, device=dev) for n in lens]),
            out_cache_loc=torch.arange(1, total + 1, device=dev),
            seq_lens=lens_t, extend_lens=lens_t.clone(),
            kv_indices=torch.where(j[None, :] < lens_t[:, None], starts[:, None] + j[None, :] + 1, 0),
            seq_lens_cpu=lens, extend_lens_cpu=list(lens), attn_backend=backend,
        )
        backend.prepare(fb)
        if self.lora is not None:  # the base model's states: not the last forward's adapters
            self.lora.pool.clear_batch()
        hidden = self.model(fb).float()
        if pooling == "mean":
            seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t)
            pooled = torch.zeros(len(lens), hidden.shape[1], device=dev).index_add_(0, seg, hidden) / lens_t[:, None]
        elif pooling == "cls":
            pooled = hidden[starts]
        else:
            pooled = hidden[starts + lens_t - 1]
        if head is not None:
            return head(pooled).float().tolist()
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.tolist()


def tree_masks(batch: ScheduledBatch) -> torch.Tensor | None:
    """A verify of draft trees' ForwardBatch.tree_mask (chains among them causal), else None."""
    if not batch.draft_parents:
        return None
    return torch.tensor([m for d, p in zip(batch.drafts, batch.draft_parents) for m in mask_rows(p, 1 + len(d))],
                        dtype=torch.bool)


def batch_stop_ids(reqs: list, eos_ids: tuple[int, ...]) -> list[int]:
    """Every token that stops some request of ``reqs`` (EOS unless it ignores it, its
    ``stop_token_ids``): where a multi-step decode stops, for the scheduler to finish the request."""
    ids = {t for r in reqs for t in r.params.stop_token_ids}
    if not all(r.params.ignore_eos for r in reqs):
        ids.update(eos_ids)
    return sorted(ids)


def _new_sampling_row(req, row: int, eos: tuple[int, ...]) -> SamplingRow:
    """The request's ``SamplingRow`` for table row ``row``, kept on it: its fields do not change
    while it holds the row (``output_ids`` is the request's own list)."""
    sr = req.sampling_row = SamplingRow(req.params, req.prompt_ids, req.output_ids, req.generator, eos,
                                        req.return_logprob, req.top_logprobs_num, row,
                                        tuple(req.token_ids_logprob or ()) if req.return_logprob else ())
    return sr


def _scatter(sample: SampleOutput, live: list[int], n: int) -> SampleOutput:
    """Spread the samples of the ``live`` rows back over all ``n`` requests of the batch (0 / None elsewhere)."""
    toks, lps = [0] * n, None if sample.logprobs is None else [0.0] * n
    tops = None if sample.top_logprobs is None else [[] for _ in range(n)]
    asked = None if sample.token_ids_logprobs is None else [[] for _ in range(n)]
    for j, i in enumerate(live):
        toks[i] = sample.token_ids[j]
        if lps is not None:
            lps[i] = sample.logprobs[j]
        if tops is not None:
            tops[i] = sample.top_logprobs[j]
        if asked is not None:
            asked[i] = sample.token_ids_logprobs[j]
    return SampleOutput(toks, lps, tops, sample.failed and {live[j]: why for j, why in sample.failed.items()}, asked)
