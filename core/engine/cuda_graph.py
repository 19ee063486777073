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

With speculative decoding, verifies are captured too (plugin API 1.9, a backend whose class says
``supports_cuda_graph_verify``): a verify graph of ``bs`` sequences holds ``T`` new tokens each
(``--speculative-num-draft-tokens``) under a tree mask, so one graph serves chains and trees of
any shape up to ``T``. A request's rows past its own draft are padding (its last token again,
writing slot 0, seeing only themselves), its real rows never see them, and the replay hands back
the real rows only. Any extend whose sequences each hold at most ``T`` new tokens can replay it
(a short prompt chunk too): the tree mask of a chain is causal.

Tensors the forward leaves on the model (an EAGLE target's ``captured`` features) are static
outputs as well: after a replay they point at the graph's buffers, cut to the batch's rows.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Any

import numpy as np
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
                      tensor_parallel: bool = False) -> str | None:
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
    return None


class CudaGraphRunner:
    """Captured decode forwards of one model over one attention backend, by batch size; with
    ``verify_tokens`` (T), captured verifies of up to ``verify_max_bs`` sequences of T tokens."""

    def __init__(self, model: torch.nn.Module, attn_backend: Any, max_bs: int, max_len: int,
                 device: torch.device, lora: Any = None, verify_tokens: int = 0, verify_max_bs: int = 0,
                 feature_dim: int = 0) -> None:
        self.model, self.backend, self.device = model, attn_backend, device
        # a model whose forward also takes [rows, feature_dim] features (an EAGLE head's draft steps):
        # a static input too; its outputs may be a tuple
        self.feature_dim = feature_dim
        self._feat = torch.zeros(max_bs, feature_dim, dtype=next(model.parameters()).dtype, device=device) \
            if feature_dim else None
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
        self._graphs: dict[tuple[int, Any], Any] = {}  # (bs, with the LoRA kernels or "verify") -> torch.cuda.CUDAGraph
        self._outputs: dict[tuple[int, Any], torch.Tensor] = {}
        self._side: dict[Any, torch.Tensor] = {}  # graph key -> the features it leaves on the model (EAGLE)
        self._pool: Any = None  # one memory pool for every captured size
        self._stream: Any = None
        # verifies: T tokens per sequence; static token rows (ids, positions, slots), per-sequence
        # KV lengths (prefix + T) and the [bs, T, T] tree mask
        self.verify_tokens = t = verify_tokens
        self.verify_sizes = capture_sizes(min(verify_max_bs, self.max_bs)) if t > 1 and verify_max_bs > 0 else []
        vmax = self.verify_sizes[-1] if self.verify_sizes else 0
        self._vtok = torch.zeros(3, vmax * t, dtype=torch.int64, device=device)
        self._vseq = torch.full((vmax,), t, dtype=torch.int64, device=device)
        self._vext = torch.full((vmax,), t, dtype=torch.int64, device=device)
        self._vmask = torch.zeros(vmax, t, t, dtype=torch.bool, device=device)
        self._veye = torch.eye(t, dtype=torch.bool, device=device).repeat(vmax, 1).view(-1) if vmax else None
        attn_backend.init_cuda_graph(self.max_bs, max_len)

    def _static_batch(self, bs: int, kv_indices: torch.Tensor, seq_lens_cpu: list[int]) -> ForwardBatch:
        ids, pos, loc, seq = self._inputs[:, :bs]
        return ForwardBatch(input_ids=ids, positions=pos, out_cache_loc=loc, seq_lens=seq, extend_lens=self._ones[:bs],
                            kv_indices=kv_indices, seq_lens_cpu=seq_lens_cpu, extend_lens_cpu=[1] * bs,
                            attn_backend=self.backend)

    def _verify_batch(self, bs: int, kv_indices: torch.Tensor, seq_lens_cpu: list[int]) -> ForwardBatch:
        t = self.verify_tokens
        ids, pos, loc = self._vtok[:, : bs * t]
        return ForwardBatch(input_ids=ids, positions=pos, out_cache_loc=loc, seq_lens=self._vseq[:bs],
                            extend_lens=self._vext[:bs], kv_indices=kv_indices, seq_lens_cpu=seq_lens_cpu,
                            extend_lens_cpu=[t] * bs, attn_backend=self.backend, tree_mask=self._vmask[:bs])

    @torch.inference_mode()
    def capture(self) -> CudaGraphRunner:
        """Capture every size, largest first (the smaller ones reuse its memory); returns self."""
        for bs in reversed(self.sizes):
            self._inputs.copy_(self._pad)
            fb = self._static_batch(bs, torch.zeros(bs, 1, dtype=torch.int64, device=self.device), [1] * bs)
            self.backend.prepare_capture(bs, fb)
            self._graphs[bs, False], self._outputs[bs, False] = self._record(fb, (bs, False))
            if self.lora is not None:  # a second graph with the LoRA kernels: batches without adapters skip them
                with self.lora.capturing(bs):
                    self._graphs[bs, True], self._outputs[bs, True] = self._record(fb, (bs, True))
        t = self.verify_tokens
        if self._veye is not None:
            self._vmask.view(-1).copy_(self._veye)
        for bs in reversed(self.verify_sizes):  # (each sequence T new tokens, no prefix, seeing themselves)
            fb = self._verify_batch(bs, torch.zeros(bs, t, dtype=torch.int64, device=self.device), [t] * bs)
            self.backend.prepare_capture(bs, fb)
            self._graphs[bs, "verify"], self._outputs[bs, "verify"] = self._record(fb, (bs, "verify"))
        log.info("cuda_graph.captured", sizes=self.sizes, verify_sizes=self.verify_sizes, verify_tokens=t)
        return self

    def _record(self, fb: ForwardBatch, key: Any) -> tuple[Any, torch.Tensor]:
        """(graph, its static output) of the model's forward over the static batch ``fb``."""
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy initialisation, kernel compiles
            for _ in range(2):
                self._forward(fb)
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            out = self._forward(fb)
            self._keep_side(key)
        torch.cuda.synchronize(self.device)
        return graph, out

    def _forward(self, fb: ForwardBatch) -> Any:
        """The model's forward over a static batch (with the static features, where it takes them)."""
        return self.model(fb) if self._feat is None else self.model(fb, self._feat[: fb.batch_size])

    def _keep_side(self, key: Any) -> None:
        """Keep the features the forward just left on the model (``LlamaModel.captured``) as this
        graph's static output."""
        inner = getattr(self.model, "model", None)
        if getattr(inner, "capture_layers", ()) and isinstance(side := inner.__dict__.get("captured"), torch.Tensor):
            self._side[key] = side

    def _put_side(self, key: Any, rows: Any) -> None:
        """Point the model's features at the graph ``key``'s, cut to ``rows`` (a count or an index)."""
        if (side := self._side.get(key)) is not None:
            self.model.model.captured = side[:rows] if isinstance(rows, int) else side.index_select(0, rows)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode batch no larger than the largest captured size, without image rows or an
        M-RoPE table (a decode's M-RoPE positions come as plain positions: core.engine.multimodal)."""
        return (0 < batch.batch_size <= self.max_bs and batch.is_decode and batch.mm_rows is None
                and batch.mrope_positions is None)

    def can_verify(self, batch: ForwardBatch) -> bool:
        """An extend (a verify, or a short chunk) a verify graph holds: at most ``verify_tokens`` new
        tokens per sequence, no more sequences than the largest verify size, no LoRA or images."""
        return (bool(self.verify_sizes) and 0 < batch.batch_size <= self.verify_sizes[-1] and not batch.lora
                and batch.mm_rows is None and batch.mrope_positions is None
                and max(batch.extend_lens_cpu) <= self.verify_tokens)

    def replay(self, batch: ForwardBatch, features: torch.Tensor | None = None) -> Any:
        """Hidden states ``[n, hidden]`` of a decode batch of ``n`` sequences, from the graph of the
        smallest captured size that holds it (or, for an extend, ``replay_verify``); with
        ``features``, the model's outputs for them (a tuple where it returns one). The result is a
        view of a static buffer: valid until the next replay."""
        if not batch.is_decode:
            return self.replay_verify(batch)
        n = batch.batch_size
        if features is not None:
            self._feat[:n].copy_(features)
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
        self._put_side(key, n)
        out = self._outputs[key]
        return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]

    def replay_verify(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of an extend's ``sum(extend_lens)`` new tokens, in order, from the verify
        graph of the smallest size that holds its sequences (a new tensor: its rows gathered)."""
        n, t, ext = batch.batch_size, self.verify_tokens, batch.extend_lens_cpu
        bs = self.verify_sizes[bisect.bisect_left(self.verify_sizes, n)]
        rows, src, keep, cells, causal = self._layout(ext)
        self._vtok[:, n * t : bs * t].zero_()  # padding sequences: token 0 at position 0, writing slot 0
        tok = torch.stack((batch.input_ids, batch.positions, batch.out_cache_loc))
        self._vtok[:, : n * t] = tok[:, src]  # a sequence's padding rows repeat its last token, writing slot 0
        self._vtok[2, : n * t] *= keep
        self._vseq[:n] = batch.seq_lens - batch.extend_lens + t
        self._vseq[n:bs] = t
        mask = self._vmask.view(-1)[: bs * t * t]
        mask.copy_(self._veye[: bs * t * t])  # every row sees itself; a sequence's real rows as it says
        mask[cells] = batch.tree_mask if batch.tree_mask is not None else causal.bool()
        kv = batch.kv_indices if bs == n else torch.nn.functional.pad(batch.kv_indices, (0, 0, 0, bs - n))
        seq_cpu = [s - e + t for s, e in zip(batch.seq_lens_cpu, ext)] + [t] * (bs - n)
        self.backend.prepare_replay(bs, self._verify_batch(bs, kv, seq_cpu))
        self._graphs[bs, "verify"].replay()
        self._put_side((bs, "verify"), rows)
        return self._outputs[bs, "verify"].index_select(0, rows)

    def _layout(self, ext: list[int]) -> tuple[torch.Tensor, ...]:
        """For sequences of ``ext`` new tokens in a verify graph (T rows each): their real rows;
        per row of the first ``len(ext)`` sequences, the token it holds (a padding row: its
        sequence's last, so that its K/V are as finite as the real rows', which see them through
        a zero weight) and whether it writes its slot; the cells of their [e, e] blocks in the
        flat [bs, T, T] mask (row-major, back to back, as ``ForwardBatch.tree_mask``) and a causal
        mask's values there. One upload."""
        t, e = self.verify_tokens, np.asarray(ext, dtype=np.int64)
        n, total, sq = len(e), int(e.sum()), e * e
        starts = np.cumsum(e) - e
        rows = np.repeat(np.arange(n) * t, e) + np.arange(total) - np.repeat(starts, e)
        j = np.tile(np.arange(t), n)
        src = np.repeat(starts, t) + np.minimum(j, np.repeat(e, t) - 1)
        keep = j < np.repeat(e, t)
        k = np.arange(int(sq.sum())) - np.repeat(np.cumsum(sq) - sq, sq)
        e_at = np.repeat(e, sq)
        a, b = k // e_at, k % e_at
        cells = np.repeat(np.arange(n) * t * t, sq) + a * t + b
        host = torch.from_numpy(np.concatenate((rows, src, keep, cells, b <= a)))
        packed = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        return tuple(packed.split([total, n * t, n * t, len(cells), len(cells)]))
