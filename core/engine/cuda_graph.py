"""CUDA graphs for decode steps: capture the model's forward once per batch size, replay it.

A decode step of a small model is launch-bound: hundreds of small kernels whose launch cost
exceeds their work. Captured once at start-up per batch size (1, 2, 4, 8, then every 16 up to
``--cuda-graph-max-bs``, as SGLang does), a step becomes a handful of copies into static
buffers and one graph replay. A batch of ``n`` sequences replays the smallest captured size
``bs >= n``: rows ``n..bs`` are padding (token 0 at position 0, KV length 1, writing their K/V
into slot 0, the pool's padding slot), and their outputs are dropped.

The attention backend takes part through the capture hooks of plugin API 1.1
(``core.interfaces.CudaGraphBackend``): ``init_cuda_graph`` sizes its static metadata,
``prepare_capture`` points a captured batch at it, ``prepare_replay`` refills it in place before
each replay. A backend without them (plugin API 1.0) runs eagerly, as does everything on a CPU,
prefill and mixed batches, and batches above the largest captured size.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Any

import structlog
import torch

from core.interfaces import ForwardBatch, cuda_graph_capable

log = structlog.get_logger("core.engine.cuda_graph")

SMALL_SIZES = (1, 2, 4, 8)
STEP = 16
DEFAULT_MAX_BS = 256


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 16 up to ``max_bs`` (``max_bs`` itself
    last when it is not on that grid, so every batch up to it has a graph)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    sizes = [s for s in SMALL_SIZES if s <= max_bs] + list(range(STEP, max_bs + 1, STEP))
    return sizes if sizes[-1] == max_bs else sizes + [max_bs]


def why_no_cuda_graph(device: torch.device, backend: Any, backend_name: str, disabled: bool,
                      tensor_parallel: bool = False, draft_features: bool = False) -> str | None:
    """Why decode steps run without CUDA graphs here, or None when they can be captured."""
    if disabled:
        return "--disable-cuda-graph"
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the engine runs on {device.type}"
    if not cuda_graph_capable(backend):
        return (f"attention backend {backend_name!r} does not implement the capture hooks of plugin API 1.1 "
                "(init_cuda_graph, prepare_capture, prepare_replay)")
    if tensor_parallel:
        return "tensor parallelism runs every rank eagerly"
    if draft_features:
        return "an EAGLE draft head reads the target's hidden states of every step, which replayed graphs do not keep"
    return None


class CudaGraphRunner:
    """Captured decode forwards of one model over one attention backend, by batch size."""

    def __init__(self, model: torch.nn.Module, attn_backend: Any, max_bs: int, max_len: int,
                 device: torch.device, lora: Any = None) -> None:
        self.model, self.backend, self.device = model, attn_backend, device
        self.sizes = capture_sizes(max_bs)
        # with LoRA (core.engine.lora.LoRAServing), the pool whose kernels the graphs hold (triton backend):
        # every replay runs them, over the rows' adapter slots (-1: none); None: batches with adapters run eagerly
        self.lora = lora.graph_pool(self.sizes[-1]) if lora is not None else None
        self.max_bs = self.sizes[-1]
        # static inputs, rows: input ids, positions, KV slots, KV lengths; padding values in `_pad`
        self._inputs = torch.zeros(4, self.max_bs, dtype=torch.int64, device=device)
        self._pad = torch.zeros(4, self.max_bs, dtype=torch.int64, device=device)
        self._pad[3] = 1  # a padding row holds one key (slot 0)
        self._ones = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, bool], Any] = {}  # (bs, with the LoRA kernels) -> torch.cuda.CUDAGraph
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self._pool: Any = None  # one memory pool for every captured size
        self._stream: Any = None
        attn_backend.init_cuda_graph(self.max_bs, max_len)

    def _static_batch(self, bs: int, kv_indices: torch.Tensor, seq_lens_cpu: list[int]) -> ForwardBatch:
        ids, pos, loc, seq = self._inputs[:, :bs]
        return ForwardBatch(input_ids=ids, positions=pos, out_cache_loc=loc, seq_lens=seq, extend_lens=self._ones[:bs],
                            kv_indices=kv_indices, seq_lens_cpu=seq_lens_cpu, extend_lens_cpu=[1] * bs,
                            attn_backend=self.backend)

    @torch.inference_mode()
    def capture(self) -> CudaGraphRunner:
        """Capture every size, largest first (the smaller ones reuse its memory); returns self."""
        for bs in reversed(self.sizes):
            self._inputs.copy_(self._pad)
            fb = self._static_batch(bs, torch.zeros(bs, 1, dtype=torch.int64, device=self.device), [1] * bs)
            self.backend.prepare_capture(bs, fb)
            self._graphs[bs, False], self._outputs[bs, False] = self._record(fb)
            if self.lora is not None:  # a second graph with the LoRA kernels: batches without adapters skip them
                with self.lora.capturing(bs):
                    self._graphs[bs, True], self._outputs[bs, True] = self._record(fb)
        log.info("cuda_graph.captured", sizes=self.sizes)
        return self

    def _record(self, fb: ForwardBatch) -> tuple[Any, torch.Tensor]:
        """(graph, its static output) of the model's forward over the static batch ``fb``."""
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy initialisation, kernel compiles
            for _ in range(2):
                self.model(fb)
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            out = self.model(fb)
        torch.cuda.synchronize(self.device)
        return graph, out

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode batch no larger than the largest captured size, without image rows or an
        M-RoPE table (a decode's M-RoPE positions come as plain positions: core.engine.multimodal)."""
        return (0 < batch.batch_size <= self.max_bs and batch.is_decode and batch.mm_rows is None
                and batch.mrope_positions is None)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode batch of ``n`` sequences, from the graph of the
        smallest captured size that holds it. The result is a view of a static buffer: valid
        until the next replay."""
        n = batch.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self._inputs[:, :n].copy_(torch.stack((batch.input_ids, batch.positions, batch.out_cache_loc, batch.seq_lens)))
        if bs > n:
            self._inputs[:, n:bs].copy_(self._pad[:, : bs - n])
        kv = batch.kv_indices if bs == n else torch.nn.functional.pad(batch.kv_indices, (0, 0, 0, bs - n))
        padded = self._static_batch(bs, kv, batch.seq_lens_cpu + [1] * (bs - n))
        self.backend.prepare_replay(bs, padded)
        key = (bs, self.lora is not None and batch.lora)
        if key[1]:
            self.lora.graph_segments(n, bs)
        self._graphs[key].replay()
        return self._outputs[key][:n]
