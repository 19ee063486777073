"""One batched forward over the paged KV cache, then sampling.

Runs on the engine's worker thread. Logits are computed only for the positions
that need them: each sequence's last token, plus prompt positions when a request
asked for prompt logprobs.
"""

from __future__ import annotations

import torch

from core.interfaces import ForwardBatch
from core.kv_cache import ReqToTokenTable
from core.sampler import Sampler, SamplingRow
from core.scheduler import ScheduledBatch, StepResult


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend, table: ReqToTokenTable, sampler: Sampler,
                 eos_ids: tuple[int, ...], device: torch.device) -> None:
        self.model, self.attn_backend, self.table = model, attn_backend, table
        self.sampler, self.eos_ids, self.device = sampler, eos_ids, device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        dev = self.device
        reqs = batch.reqs
        seq_lens_cpu = [r.kv_len for r in reqs]
        seq_lens = torch.tensor(seq_lens_cpu, device=dev)
        rows = torch.tensor([r.row for r in reqs], device=dev)
        fb = ForwardBatch(
            input_ids=torch.tensor(batch.input_ids, dtype=torch.int64, device=dev),
            positions=batch.positions.to(dev),
            out_cache_loc=batch.out_cache_loc.to(dev),
            seq_lens=seq_lens,
            extend_lens=torch.tensor(batch.extend_lens, device=dev),
            kv_indices=self.table.table[rows, : max(seq_lens_cpu)],
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=batch.extend_lens,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.prepare(fb)
        hidden = self.model(fb)
        ends = torch.cumsum(fb.extend_lens, 0) - 1
        logits = self.model.compute_logits(hidden[ends])
        rows_ = [
            SamplingRow(r.params, r.prompt_ids, r.output_ids, r.generator, self.eos_ids, r.return_logprob, r.top_logprobs_num)
            for r in reqs
        ]
        result = StepResult(self.sampler.sample(logits, rows_))
        if batch.is_prefill:
            starts = (ends - fb.extend_lens + 1).tolist()
            for i, r in enumerate(reqs):
                if r.return_logprob and r.logprob_start_len >= 0:
                    result.input_logprobs[i] = self._prompt_logprobs(hidden, starts[i], r)
        return result

    def _prompt_logprobs(self, hidden: torch.Tensor, start: int, req) -> tuple[list, list]:
        """Logprob of each prompt token from ``logprob_start_len`` given its prefix;
        the first prompt token has none (None), as in SGLang."""
        n = len(req.prompt_ids)
        first = max(req.logprob_start_len, 1)
        vals: list[float | None] = [None] if req.logprob_start_len == 0 else []
        tops: list[list[tuple[int, float]]] = [[]] if req.logprob_start_len == 0 else []
        if first < n:
            lp = torch.log_softmax(self.model.compute_logits(hidden[start + first - 1 : start + n - 1]), -1)
            targets = torch.tensor(req.prompt_ids[first:n], device=lp.device)
            vals += lp.gather(1, targets[:, None]).squeeze(1).tolist()
            if req.top_logprobs_num:
                tv, ti = lp.topk(req.top_logprobs_num, dim=-1)
                tops += [list(zip(i, v)) for i, v in zip(ti.tolist(), tv.tolist())]
        return vals, tops
