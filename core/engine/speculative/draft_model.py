"""Draft models of model drafters (STANDALONE, EAGLE): loaded like the target, each with a KV pool
laid out like the target's, so that a request's draft KV lives at the target's slots.

Mirroring the target's pages means a draft needs no allocator, page table or radix cache of its
own: a verify batch allocates the slots of its draft positions before the drafter runs, and a
request's pages (its own, or a cached prefix it shares) hold its draft KV beside the target's. A
shared prefix's draft KV may have been written by another request or not at all, so a drafter
tracks per request which positions it computed itself (``DraftRequest.state``) and recomputes the
rest: the same tokens at the same positions write the same values.

On CUDA a draft model's decode steps replay CUDA graphs of their own (``CudaGraphRunner``), as the
target's do; an EAGLE head's draft steps too, its features (its own last hidden state) a static
input of theirs; what it reads after a target forward (several tokens, the target's features) runs
eagerly.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import attrs
import structlog
import torch

from core.engine.cuda_graph import DEFAULT_MAX_BS, CudaGraphRunner, why_no_cuda_graph
from core.engine.hybrid_attention import build_attention_backend, verify_backend_name
from core.engine.mem_cache.kv_cache import allocate_kv_cache
from core.engine.model_loader.loader import load_model_config
from core.engine.model_loader.model_build import build_model
from core.engine.model_runner import StepInputs, forward_batch, forward_step, step_logits
from core.errors import ModelLoadError
from core.interfaces import AttentionConfig, DraftSeq

log = structlog.get_logger("core.engine.speculative")


@attrs.define
class EngineDraftModel:
    """``core.interfaces.DraftModel``: a draft model, its KV pool and attention backend."""

    model: torch.nn.Module
    hf_config: Any
    backend: Any
    device: torch.device
    graphs: CudaGraphRunner | None = None  # its decode steps' CUDA graphs, where captured

    @torch.inference_mode()
    def run(self, seqs: Sequence[DraftSeq], features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ends = [s.start + len(s.tokens) for s in seqs]
        kv_indices = torch.zeros(len(seqs), max(ends), dtype=torch.int64)
        for i, (s, n) in enumerate(zip(seqs, ends)):
            kv_indices[i, :n] = s.slots[:n]
        last, rows = -1, []
        for s in seqs:
            last += len(s.tokens)
            rows.append(last)
        inputs = StepInputs([t for s in seqs for t in s.tokens], [p for s, n in zip(seqs, ends) for p in range(s.start, n)],
                            torch.cat([s.slots[s.start:n] for s, n in zip(seqs, ends)]).tolist(), ends,
                            [len(s.tokens) for s in seqs], kv_indices, [rows])
        if features is None:
            hidden, logits, _ = forward_step(self.model, self.backend, inputs, self.device, self.graphs)
            return hidden, logits[0]
        fb = forward_batch(inputs, self.backend, self.device)
        g = self.graphs
        if g is not None and g.feature_dim == features.shape[-1] and g.can_run(fb):  # an EAGLE head's draft step
            for_logits, for_next = g.replay(fb, features)
            for_next = for_next.clone()  # (kept by the drafter past the next replay)
        else:
            self.backend.prepare(fb)
            for_logits, for_next = self.model(fb, features)
        return for_next, step_logits(self.model, for_logits, inputs.logit_rows, self.device)[0]


def target_tables(served: torch.nn.Module, mc: Any, device: torch.device, load_format: str) -> torch.nn.Module:
    """What a draft head shares of a tensor-parallel target, whole: a stand-in with its ``config``,
    ``tied``, ``model.embed_tokens`` and (untied) ``lm_head``, read again from its checkpoint here.
    Rank 0's own tables hold a slice of the vocabulary, and the head runs on rank 0 alone, where a
    sharded table's collectives would wait for ranks that never join; the residual stream the head
    reads is whole on every rank, so only the tables differ (SGLang shards the head instead)."""
    from core.engine.model_loader.loader import checkpoint_weights
    from core.engine.model_loader.model_build import init_dummy_weights
    from core.layers import VocabEmbedding

    cfg, tied = served.config, bool(getattr(served, "tied", False))
    stand_in = torch.nn.Module()
    stand_in.config, stand_in.tied, stand_in.model = cfg, tied, torch.nn.Module()
    dtype = served.model.embed_tokens.weight.dtype
    tables = {"model.embed_tokens.weight": VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)}
    stand_in.model.embed_tokens = tables["model.embed_tokens.weight"]
    if not tied:
        stand_in.lm_head = tables["lm_head.weight"] = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
    if load_format == "dummy":  # (benchmarks: random tables, as the target's)
        init_dummy_weights(stand_in, 0)
    else:
        found = set()
        with torch.no_grad():
            for name, t in checkpoint_weights(mc, None, None, load_format, only=set(tables)):
                tables[name].weight.copy_(t)
                found.add(name)
        if found != set(tables):
            raise ModelLoadError(f"the draft head needs the target's {', '.join(sorted(set(tables) - found))}, "
                                 f"which its checkpoint {mc.path} does not hold by that name")
    return stand_in.to(device)


@attrs.define
class EngineDraftContext:
    """``core.interfaces.DraftContext``: loads draft models the way the target was loaded (its
    plugins, device, dtype and KV geometry)."""

    args: Any
    target: torch.nn.Module
    plugins: Any
    target_config: Any  # the target's ModelConfig
    device: torch.device
    num_pages: int
    page_size: int
    kv_dtype: torch.dtype
    backend_name: str
    features: Callable[[], torch.Tensor] | None = None  # set by ``capture``: the last target forward's features
    served: torch.nn.Module | None = None  # the served model (``target`` is a stand-in under --tp-size > 1)
    loaded: list[EngineDraftModel] = attrs.field(factory=list)  # the draft models ``load_model`` built

    def __attrs_post_init__(self) -> None:
        self.served = self.target
        if self.args.tp_size > 1:  # a head runs on rank 0 alone: it shares whole tables, not this rank's shard
            self.target = target_tables(self.target, self.target_config, self.device, self.args.load_format)

    @property
    def trees(self) -> bool:
        """Whether draft trees are verified whole: the backend takes tree masks and no layer of the
        target attends through a sliding window (tree positions are depths, not columns)."""
        cfg = self.target_config.hf_config
        types = getattr(cfg, "layer_types", None)
        sliding = "sliding_attention" in types if types is not None else bool(getattr(cfg, "sliding_window", None))
        backend = self.plugins.resolve("attention_backend", verify_backend_name(self.backend_name))  # (verifies: prefill's)
        return bool(getattr(backend, "supports_tree_mask", False)) and not sliding

    def capture(self, layers: Sequence[int]) -> None:
        inner = getattr(self.served, "model", None)
        if not hasattr(inner, "capture_layers"):
            raise ModelLoadError(f"the target's architecture ({self.target_config.architecture}) cannot hand a draft "
                                 "head its hidden states: EAGLE needs a Llama-family target")
        n = len(inner.layers)
        if any(not 0 <= i <= n for i in layers):
            raise ModelLoadError(f"the draft head reads the target's layers {list(layers)}; the target has {n}")
        inner.capture_layers = tuple(layers) or (n,)  # (): the stream after the last layer, normed below
        self.features = (lambda: inner.captured) if layers else (lambda: inner.norm(inner.captured))

    def load_model(self, path: str) -> EngineDraftModel:
        t = self.target_config
        try:
            mc = load_model_config(path, str(t.dtype).removeprefix("torch."), self.device, None)
        except Exception as e:
            raise ModelLoadError(f"cannot load the draft model {path!r}: {e}") from e
        cfg = mc.hf_config
        if cfg.vocab_size != t.hf_config.vocab_size:
            raise ModelLoadError(f"the draft model {path!r} has a vocabulary of {cfg.vocab_size} tokens and the target "
                                 f"{t.hf_config.vocab_size}: a draft must share the target's vocabulary")
        if mc.context_len < t.context_len:
            raise ModelLoadError(f"the draft model {path!r} takes {mc.context_len} positions, fewer than the target's "
                                 f"{t.context_len}: lower --context-length to {mc.context_len}")
        # the draft's own checkpoint decides its quantization; dummy weights when the target has them (benchmarks)
        args = attrs.evolve(self.args, quantization=None, torchao_config=None)
        model = build_model(self.plugins, args, mc, self.device, "dummy" if self.args.load_format == "dummy" else "auto")
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv = allocate_kv_cache(cfg.num_hidden_layers, self.num_pages, self.page_size, kv_heads, head_dim, self.kv_dtype,
                               self.device)
        backend = build_attention_backend(self.plugins, self.backend_name,  # (draft extends: prefill's; steps: decode's)
                                          AttentionConfig(cfg.num_hidden_layers, heads, kv_heads, head_dim, mc.dtype, self.device, kv))
        log.info("speculative.draft_model", path=path, architecture=mc.architecture, layers=cfg.num_hidden_layers,
                 kv_slots=self.num_pages * self.page_size)
        self.loaded.append(draft := EngineDraftModel(model, cfg, backend, self.device))
        return draft

    def capture_graphs(self) -> None:
        """Capture the loaded draft models' CUDA graphs, once the drafter has set them up (an EAGLE
        head shares the target's embedding: a graph captured before would read its own)."""
        for draft in self.loaded:
            draft.graphs = self._graphs(draft.model, draft.backend)

    def _graphs(self, model: torch.nn.Module, backend: Any) -> CudaGraphRunner | None:
        """Decode CUDA graphs of a draft model where the target's would be captured, or None."""
        a = self.args
        why = why_no_cuda_graph(self.device, backend, self.backend_name, a.disable_cuda_graph, a.tp_size > 1)
        if why is not None:
            log.info("speculative.draft_cuda_graph_off", reason=why)
            return None
        # an EAGLE head's draft steps read its own last hidden state (its width); its first step
        # after a target forward reads the target's features, eagerly where they are wider (EAGLE-3)
        feature_dim = model.config.hidden_size if "features" in inspect.signature(model.forward).parameters else 0
        max_bs = min(a.cuda_graph_max_bs or DEFAULT_MAX_BS, a.max_running_requests or DEFAULT_MAX_BS)
        try:
            return CudaGraphRunner(model, backend, max_bs, self.target_config.context_len, self.device,
                                   feature_dim=feature_dim).capture()
        except Exception as e:  # (as the target's: a model that syncs with the host runs eagerly)
            log.warning("speculative.draft_cuda_graph_failed", error=f"{type(e).__name__}: {e}", exc_info=True)
            return None
