"""The interfaces plugins implement: the public, versioned contract of core.

``PLUGIN_API_VERSION`` follows semantic versioning: a plugin module may declare
``CORE_PLUGIN_API = "1"`` (the major version it was written for); core refuses a
plugin whose declared major version differs from its own, naming both.

Tensor conventions: ``T`` is the number of tokens in a forward (all sequences'
new tokens, flattened in batch order), ``B`` the number of sequences, ``H``/``Hkv``
query/key-value heads, ``D`` the head dimension.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

import attrs
import torch

PLUGIN_API_VERSION = "1.11"  # 1.1: the optional CUDA-graph capture hooks of attention backends; 1.2: drafters;
# 1.3: model drafters; 1.4: tree masks (ForwardBatch.tree_mask, AttentionBackend.supports_tree_mask), draft trees;
# 1.5: HiCache storage backends (HiCacheStorage); 1.6: ForwardBatch.lora (LoRA adapters in the batch);
# 1.7: multimodal processors, ForwardBatch.mm_rows / mm_embeds / mrope_positions; 1.8: ForwardBatch.layer_ready;
# 1.9: CUDA graphs of speculative verifies (AttentionBackend.supports_cuda_graph_verify);
# 1.10: batch-invariant attention (AttentionBackend.supports_batch_invariant, --enable-deterministic-inference),
# GrammarBackend.compile's per-request JSON keywords (any_whitespace, whitespace_pattern);
# 1.11: in-place weight updates (CausalLM.load_weights(..., partial=True), modules' weights_updated())


# --------------------------------------------------------------------------- batches


@attrs.define
class ForwardBatch:
    """Everything a model and its attention backend need for one batched forward.

    Built by the model runner; read-only for models. The attention backend may set
    ``attn_metadata`` in :meth:`AttentionBackend.prepare` and read it in every layer.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, KV-pool slot where each new token's K/V goes
    seq_lens: torch.Tensor  # [B] int64, KV length of each sequence after this forward
    extend_lens: torch.Tensor  # [B] int64, new tokens of each sequence in this forward
    kv_indices: torch.Tensor  # [B, max(seq_lens)] int64, slots of each sequence's KV, padded with 0
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    attn_backend: AttentionBackend
    attn_metadata: Any = None
    # A speculative verify of draft trees: per sequence in batch order, an [n, n] bool matrix (n its
    # extend length, row-major, flattened and concatenated) saying which of its new tokens each new
    # token attends to, besides every cached token before them; None: causal. A tree's new tokens
    # sit in kv_indices in batch order, while ``positions`` are their depths in the tree. Only for
    # backends with ``supports_tree_mask``.
    tree_mask: torch.Tensor | None = None
    # Some token of the batch runs through a LoRA adapter (``core.engine.lora``): the adapters act
    # inside ``core.layers.Linear``'s forward, so a model path that bypasses it (a fused CPU layer
    # op) must not serve this batch unless it adds the adapters' deltas itself (Llama's decode
    # stack does: ``kernels/cpu_decode``, ``LlamaForCausalLM.decode_lora``).
    lora: bool = False
    # Images (``core.engine.multimodal``, since 1.7): the rows of the flattened batch whose input
    # embeddings a vision-language model replaces (int64 [n]) by ``mm_embeds`` ([n, hidden], its
    # vision tower's output), and M-RoPE positions ([3, T] int64: temporal, height, width) where the
    # model rotates by three position rows; None: none in this batch (``positions`` for all rows).
    mm_rows: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    # KV still landing in the pool for this forward (HiCache load-backs on a GPU, layer by layer):
    # ``layer_ready(layer_id)`` must be called before a layer's attention reads the pool.
    # ``core.layers.Attention`` calls it; for a model whose attention layers are not all that one
    # the engine waits for every layer's load before the forward. None: nothing landing (always
    # on the CPU, which copies a batch's loads before its forward).
    layer_ready: Callable[[int], None] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token (a pure decode step)."""
        return all(n == 1 for n in self.extend_lens_cpu)


@attrs.define(frozen=True)
class AttentionLayerSpec:
    """Static description of one attention layer, owned by the model."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None  # attend to at most this many most recent keys
    logit_cap: float = 0.0  # tanh soft-capping of scores; 0 disables


# --------------------------------------------------------------------------- attention


@attrs.define
class KVCache:
    """The paged KV pool: one K and one V buffer per layer, ``[num_slots, Hkv, D]``.

    Slot 0 is the padding slot, never handed out: padded gathers read it and the padding rows
    of a CUDA-graph batch write it, so it holds finite values (zeros until a graph runs). A
    page is ``page_size`` consecutive slots.

    The buffers' dtype may be narrower than the model's (``--kv-cache-dtype fp8_e4m3``):
    a backend then stores ``k / k_scale`` (clamped to the dtype's range) and reads
    ``stored * k_scale`` (likewise ``v``). The scales are per tensor and 1.0 unless set
    (SGLang's default when a checkpoint ships none).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]


@attrs.define(frozen=True)
class AttentionConfig:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kv_cache: KVCache


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes attention over the paged KV cache.

    Constructed once as ``backend(config: AttentionConfig)``. Per forward, core calls
    ``prepare(batch)`` once, then the model calls ``forward`` once per layer.

    Optional since plugin API 1.1 (not protocol members, so a 1.0 backend still satisfies
    this protocol; it then runs without CUDA graphs): the capture hooks of
    :class:`CudaGraphBackend`. Core captures decode steps in CUDA graphs only with a backend
    that defines all three.

    Optional since plugin API 1.4: a class attribute ``supports_tree_mask = True`` says the
    backend honours ``ForwardBatch.tree_mask`` (speculative draft trees); without it, core never
    hands it a tree.

    Optional since plugin API 1.10: a class (or instance) attribute ``supports_batch_invariant =
    True`` says that when core sets ``batch_invariant = True`` on the instance (before the first
    forward, under ``--enable-deterministic-inference``), each query row's output depends on its
    own sequence alone, bit for bit: not on the batch's other sequences or size, nor on whether
    the row came in a prefill, a prefill chunk or a decode. Without it, the flag is refused.
    """

    def prepare(self, batch: ForwardBatch) -> None:
        """Precompute per-forward metadata shared by all layers (store it in
        ``batch.attn_metadata``). Must not mutate anything else."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """Write ``k``/``v`` (``[T, Hkv, D]``) into the pool at ``batch.out_cache_loc``,
        then attend ``q`` (``[T, H, D]``) causally over each sequence's cached keys
        (honouring ``layer.sliding_window`` and ``layer.logit_cap``).
        Returns ``[T, H, D]`` in ``q.dtype``."""


@runtime_checkable
class CudaGraphBackend(Protocol):
    """The capture hooks of an attention backend whose decode steps can be captured in CUDA
    graphs (plugin API 1.1). Core captures one graph per batch size ``bs`` (1, 2, 4, 8, then
    every 16 up to ``--cuda-graph-max-bs``) and replays it for batches of up to ``bs``
    sequences, the rest padding rows: token 0 at position 0, KV length 1, ``kv_indices`` row
    all slot 0 and ``out_cache_loc`` slot 0 (the padding slot, so they write nowhere real).

    In a captured forward, ``input_ids``, ``positions``, ``out_cache_loc``, ``seq_lens`` and
    ``extend_lens`` are static buffers core refills before each replay; ``forward`` must read
    everything else from ``batch.attn_metadata`` as set by ``prepare_capture`` (static buffers
    of the backend, at fixed addresses), never keep per-step state beyond the call, and never
    sync with the host. ``prepare`` is not called for a replayed step.

    Optional since plugin API 1.9: a class attribute ``supports_cuda_graph_verify = True`` (on a
    backend with ``supports_tree_mask``) says ``prepare_capture`` and ``prepare_replay`` also take
    verify batches (``batch.is_decode`` false): ``bs`` sequences of ``T`` new tokens each, under
    ``batch.tree_mask`` (a static ``[bs, T, T]`` buffer core refills), each sequence's prefix
    ``seq_lens - extend_lens`` long (0 at capture). A sequence's rows past its own tokens are
    padding that writes slot 0 and sees only itself."""

    def init_cuda_graph(self, max_bs: int, max_len: int) -> None:
        """Once, before any capture: allocate the static metadata for batches of up to ``max_bs``
        sequences of up to ``max_len`` tokens each."""

    def prepare_capture(self, bs: int, batch: ForwardBatch) -> None:
        """Before capturing size ``bs``: set ``batch.attn_metadata`` to views of the static
        buffers (any valid content, e.g. every sequence of length 1). Launch parameters fixed here
        (grid sizes, KV splits) hold for every replay of this size."""

    def prepare_replay(self, bs: int, batch: ForwardBatch) -> None:
        """Before each replay of size ``bs``: refill the static buffers in place from ``batch``
        (``bs`` rows, padding included; ``kv_indices``, ``seq_lens``, ``seq_lens_cpu`` are this
        step's). Runs outside the graph: it may allocate, but must not move the buffers."""


def cuda_graph_capable(backend: object) -> bool:
    """Whether ``backend`` defines all three capture hooks of :class:`CudaGraphBackend`."""
    return all(callable(getattr(backend, name, None)) for name in ("init_cuda_graph", "prepare_capture", "prepare_replay"))


# --------------------------------------------------------------------------- quantization


@runtime_checkable
class QuantMethod(Protocol):
    """How a linear layer stores and applies its weight.

    Core's ``Linear`` calls ``create_weights`` in its constructor, ``apply`` in forward
    and ``process_weights_after_loading`` once after the checkpoint is loaded.

    Optional method (not a protocol member; the conformance kit, ``core.testing``, looks it up
    with ``getattr``):

    ``dequantize(layer) -> torch.Tensor``
        The float ``[out, in]`` weight ``apply`` multiplies by, after loading. The kit checks
        that it is the loaded weight within the quantization error, and that ``apply(x)``
        equals ``x @ dequantize(layer).T (+ bias)``; without it, the kit compares ``apply(x)``
        with the loaded float weight only.

    ``checkpoint_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]``
        For a method that loads pre-quantized checkpoints (no float ``weight`` parameter): the
        tensors, by parameter name, a checkpoint in its format holds for the float ``[out, in]``
        ``weight`` (one shard of a packed layer). The kit loads them through the parameters'
        ``weight_loader``s, as the engine loads a checkpoint, and compares with ``weight``.

    Optional members the engine uses (looked up with ``getattr`` at start-up, never per token):

    ``devices: tuple[str, ...]`` and ``check_device(device) -> str | None``
        The device types the method runs on (``core plugins`` lists them) and, for finer
        conditions, the reason it cannot run on ``device`` (None when it can; e.g. fp8 needs
        compute capability >= 8.9). A refusal stops start-up naming the method and the device.
    ``from_config(config: dict) -> QuantMethod`` (classmethod)
        Built from the checkpoint's ``quantization_config`` (config.json; AWQ's group size,
        GPTQ's format, fp8's block size) instead of ``cls()``.
    ``gguf_raw: bool``
        The loader feeds a GGUF model's linear weights as raw blocks: ``<layer>.qweight``
        (uint8 rows) and ``<layer>.qweight_type`` (the GGML type), see ``core.engine.model_loader.loader``.
    ``pack_lm_head(embedding) -> torch.nn.Module | None``
        A packed LM head built from the loaded ``VocabEmbedding`` on its first ``logits`` call
        (None keeps it dense).
    ``dense: bool``
        ``apply`` is exactly ``F.linear(x, layer.weight, layer.bias)`` over a plain ``[out, in]``
        float weight, so core's shared layers may fuse such layers on a GPU after loading (gate
        and up as one GEMM, the residual added inside the output projection's GEMM).
    """

    def create_weights(
        self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        """Register the layer's parameters (``layer.weight`` ``[out, in]`` for dense)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` is ``[T, in]``; return ``[T, out]`` in ``x.dtype``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack / quantize loaded weights in place (may be a no-op)."""


# --------------------------------------------------------------------------- models


@attrs.define(frozen=True)
class ModelContext:
    """What a model factory receives besides the Hugging Face config."""

    dtype: torch.dtype
    device: torch.device
    quant_method: QuantMethod


@runtime_checkable
class CausalLM(Protocol):
    """A model built as ``factory(hf_config, ctx: ModelContext)`` (an ``nn.Module``).

    Optionally, on the CPU, ``decode_step(inputs, attn_backend)`` takes a whole decode step (every
    sequence one token, every one sampling) from the scheduler's plain lists
    (``core.engine.model_runner.StepInputs``): it returns ``(hidden [B, hidden], logits [B, >= vocab],
    argmax [B] over the first vocab columns)``, or None where it does not serve that batch and
    ``forward`` / ``compute_logits`` run as usual. Llama-style models use it to run the step as
    one C++ call::

        def decode_step(self, inputs, attn_backend):
            if not my_fast_path_applies(inputs):
                return None
            return my_op(inputs.input_ids, inputs.positions, inputs.out_cache_loc, inputs.kv_indices, inputs.seq_lens)

    With ``--num-continuous-decode-steps N > 1``, ``decode_steps(inputs, attn_backend, steps,
    stop_ids)`` may run up to ``steps`` greedy decode steps in one call (each step's argmax the next
    step's input): ``inputs.out_cache_loc`` then holds step k's slots at ``[k * B, (k + 1) * B)`` and
    ``inputs.kv_indices`` the columns of every step. It returns the tokens as one list per step run,
    stopping after a step that produced any of ``stop_ids``; or None, and the engine runs the steps
    one forward at a time.
    """

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Return final hidden states ``[T, hidden]`` for every new token."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Map selected hidden states ``[N, hidden]`` to float32 logits ``[N, vocab]``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume checkpoint tensors by their Hugging Face names.

        Optional since 1.11: a ``partial=False`` keyword. With ``partial=True`` (a trainer's weight
        update of the served model) any subset arrives, written all or nothing
        (``core.layers.load_packed_weights(..., partial=True)`` does both); a model without the keyword
        refuses such updates. After one, every module's ``weights_updated()`` (where defined) drops
        what it derived from the weights (cached plans, packed copies)."""


# --------------------------------------------------------------------------- parsers


@attrs.define
class ToolCall:
    name: str
    arguments: str  # JSON text
    index: int = 0


@runtime_checkable
class ToolParser(Protocol):
    """Extracts tool calls from model output. One instance per request (it may keep
    streaming state).

    Optional methods (not protocol members, so ``isinstance`` does not require them; core looks
    them up with ``getattr``):

    ``chat_view() -> None``
        Called once, before any parsing, when the output is a chat reply (not for
        ``/parse_function_call``): from then on whitespace touching a call block is not normal
        text, and an output that ends inside calls already announced by ``parse_streaming``
        (cut off by ``max_tokens``) keeps them as calls with their arguments so far, in ``parse``
        and ``flush`` alike, so a call is never also sent as text. Without it, such a cut-off
        block is resolved as ``parse`` reads it.

    ``structural_tag(tools: list[dict], name: str | None = None, parallel: bool = True) -> dict | None``
        The model's native call format as an xgrammar structural tag
        (``{"type": "structural_tag", "format": ...}``): one or more calls (at most one when
        ``parallel`` is false; only function ``name`` when given), each call's arguments
        constrained by its tool's parameter schema; None when the format cannot be described.
        With the xgrammar backend, ``tool_choice`` required / named constrains the output to this
        tag and the same parser reads the calls back (``parse`` / ``parse_streaming``), so the
        tag must only admit text the parser parses. Without it core falls back to SGLang's JSON
        constraint. The tag's calls must each begin with the class attribute ``start`` (the text
        that opens a call) for ``strict`` tools under ``tool_choice: auto``.

    ``reads_special_tokens: bool`` (class attribute, default false)
        The format's markers are special tokens (gpt-oss's harmony channels): a request that does
        not set ``skip_special_tokens`` keeps them in its text for this parser."""

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCall]]:
        """Return (normal text, calls) for a complete output."""

    def parse_streaming(self, delta: str, tools: list[dict]) -> tuple[str, list[ToolCall]]:
        """Feed the next text fragment; return (normal-text delta, call deltas).

        A call delta carries its ``index``; the name is sent once (first delta), and
        ``arguments`` fragments concatenate to the call's JSON arguments."""

    def flush(self, tools: list[dict]) -> tuple[str, list[ToolCall]]:
        """End of the stream: return what was held back (same shape as parse_streaming); an
        unfinished call block is resolved as ``parse`` would (calls, or normal text)."""


@runtime_checkable
class ReasoningParser(Protocol):
    """Separates reasoning from the answer. One instance per request.

    Optional method (not a protocol member; core calls it when present, via ``hasattr``):

    ``configure(chat_template_kwargs: dict) -> None``
        Called once, before any ``parse`` / ``parse_streaming``, with the request's
        ``chat_template_kwargs`` (``{}`` when absent), e.g. ``qwen3`` with
        ``enable_thinking: false`` stops separating (everything is content), as in SGLang.

    ``force_reasoning: bool`` (class attribute, default false)
        The prompt opened the think block, so the output starts inside it (deepseek-r1). For an
        output constrained from its first token, core builds a subclass with it false.

    ``reads_special_tokens: bool`` (class attribute, default false): as for ``ToolParser``."""

    def parse(self, text: str) -> tuple[str, str]:
        """Return (reasoning_content, content) for a complete output."""

    def parse_streaming(self, delta: str) -> tuple[str, str]:
        """Feed the next fragment; return (reasoning delta, content delta)."""

    def flush(self) -> tuple[str, str]:
        """End of the stream: return what was held back (a partial tag), so that the streamed
        deltas plus ``flush()`` equal ``parse`` of the whole text."""


# --------------------------------------------------------------------------- grammar


@runtime_checkable
class Grammar(Protocol):
    """A compiled constraint's matcher state for one sequence."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed-token mask for the next token into row ``index``."""

    def accept_token(self, token_id: int) -> bool:
        """Advance the matcher; False if the token is not allowed."""

    def is_terminated(self) -> bool:
        """Whether the constraint is complete (the output ends here)."""

    def copy(self) -> Grammar:
        """A new matcher for the same grammar, at its start (each request gets its own)."""


@runtime_checkable
class GrammarBackend(Protocol):
    """Compiles constraints, constructed as ``backend(tokenizer, vocab_size, *, stop_token_ids)``
    plus, only when set, ``any_whitespace=False`` / ``whitespace_pattern=REGEX`` for JSON schemas
    (SGLang's ``--constrained-json-*``; a backend without the keyword is refused them at start-up).
    Core caches what ``compile`` returns by (backend, kind, spec), compiles on a thread pool, and
    gives each request ``compiled.copy()`` (a fresh matcher)."""

    def compile(self, kind: str, spec: str) -> Grammar:
        """``kind`` is one of ``json_schema``, ``regex``, ``ebnf``, ``structural_tag``.
        Raises ``ValueError`` with the backend's message on an invalid spec. Optional keywords
        (plugin API 1.10), passed only for a ``json_schema`` whose request set them:
        ``any_whitespace=False``, ``whitespace_pattern=REGEX`` (vLLM's per-request options);
        a request asking for one the method does not take is refused, naming it."""

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor: ...

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set disallowed logits to -inf in place."""


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[b, t]`` to -inf where bit ``t % 32`` of ``bitmask[b, t // 32]`` is 0, in place
    (``logits`` ``[B, V]``, ``bitmask`` ``[B, ceil(V/32)]`` int32; tokens past the mask are
    disallowed). A portable ``GrammarBackend.apply_bitmask`` for backends without a kernel; the
    mask reaches a GPU through pinned memory without blocking, and is expanded there."""
    if bitmask.device != logits.device:
        if logits.device.type == "cuda" and not bitmask.is_pinned():
            bitmask = bitmask.pin_memory()
        bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    v = logits.shape[1]
    n = min(v, allowed.shape[1])
    logits[:, :n].masked_fill_(~allowed[:, :n], float("-inf"))
    if v > n:
        logits[:, n:] = float("-inf")


class Drafter(Protocol):
    """Proposes draft tokens for speculative decoding, constructed as ``drafter(args)`` (the
    engine's ``EngineArgs``). The engine verifies a draft in one forward of the target model and
    keeps the longest prefix the target agrees with (sampling it as plain decoding would), so a
    drafter only changes speed, never outputs; it owns no KV and never sees rejected tokens.
    A drafter that runs a model of its own implements :class:`ModelDrafter` instead."""

    def propose(self, state: dict, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens likely to follow ``tokens`` (the request's prompt and output
        so far), as a chain, or a :class:`DraftTree` of up to ``max_tokens`` nodes; ``[]`` for none. ``state`` is a dict the engine keeps per request for
        the drafter's own bookkeeping (empty at the first call; ``tokens`` only grows between
        calls, except that a retracted request's may be shorter than before: start again)."""


@attrs.define
class DraftTree:
    """A draft tree (plugin API 1.4): ``tokens[j]`` follows ``tokens[parents[j]]``, or the request's
    last token where ``parents[j]`` is -1; a parent precedes its children. A drafter may return one
    wherever it returns a chain (a list of tokens); its size counts against the same budget. The
    engine verifies the whole tree in one forward where the attention backend takes tree masks,
    else the chain through each node's first child."""

    tokens: list[int]
    parents: list[int]


@attrs.define
class DraftSeq:
    """One sequence of a draft model's forward: ``tokens`` at positions ``start`` onwards, their
    KV written to ``slots[start:start + len(tokens)]`` and attending to ``slots[:start + len(tokens)]``."""

    tokens: list[int]
    start: int
    slots: torch.Tensor  # [>= start + len(tokens)] int64 KV slots of positions 0.. (CPU)


@attrs.define
class DraftRequest:
    """What a :class:`ModelDrafter` sees of one request of a verify batch."""

    state: dict  # the drafter's own, kept per request; emptied when the request's KV is dropped (retraction)
    tokens: Sequence[int]  # prompt and output so far; the last one is not in the target's KV yet
    kv_len: int  # tokens whose target KV is written (= len(tokens) - 1: the last token's position)
    room: int  # the draft tokens wanted: exactly this many
    slots: torch.Tensor  # [kv_len + room] int64 KV slots of positions 0.. (a copy of the target's page table row)


@attrs.define
class DraftObservation:
    """What a :class:`ModelDrafter` that asked for the target's features (``DraftContext.capture``)
    sees of one request after a target forward, once its tokens are sampled: the positions whose
    results stand (a verify's: the last token and the drafts the target kept) and the token that
    follows each, which is what an EAGLE head reads at a position beside the target's features."""

    state: dict  # as in DraftRequest
    start: int  # the first position the target processed
    next_ids: list[int]  # the token at position p + 1 for each p of start, start + 1, ...
    row: int  # the features of those positions: ``features[row:row + len(next_ids)]``
    slots: torch.Tensor  # [start + len(next_ids)] int64 KV slots of positions 0.. (a copy)


class DraftModel(Protocol):
    """A draft model the engine loaded for a :class:`ModelDrafter` (``DraftContext.load_model``):
    same device and dtype as the target, and a KV pool of its own laid out like the target's, so
    a request's draft KV lives at the target's slots. Which of those slots hold valid draft KV
    is the drafter's to track (``DraftRequest.state``)."""

    model: torch.nn.Module
    hf_config: Any

    def run(self, seqs: Sequence[DraftSeq], features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``seqs`` (at least one, each with at least one token): (hidden states
        [T, hidden] of every new token, float32 logits [B, vocab] of each sequence's last token).
        ``features`` [T, F] go to a model whose forward takes them (``model(batch, features)``
        returning the hidden states for the logits and those for the next step, as EAGLE heads
        do); its second hidden states are returned."""


class DraftContext(Protocol):
    """What the engine gives a :class:`ModelDrafter` once its own model and KV pool are built."""

    args: Any  # the engine's EngineArgs
    # the target model (a head may share its embeddings and LM head); under --tp-size > 1 a stand-in
    # with its config and those tables whole (rank 0's own hold a slice of the vocabulary)
    target: torch.nn.Module
    device: torch.device

    def load_model(self, path: str) -> DraftModel:
        """The model at ``path`` (a checkpoint folder, as ``--model-path`` takes), with its KV pool."""

    def capture(self, layers: Sequence[int]) -> None:
        """Hand ``ModelDrafter.observe`` the target's features after every forward: its residual
        stream at the input of ``layers``, concatenated (``()``: its final, normed hidden states).
        Raises ``core.errors.ModelLoadError`` where the target's architecture cannot."""


class ModelDrafter(Protocol):
    """A drafter running a model of its own (SGLang's STANDALONE, EAGLE): constructed as
    ``drafter(args)``, loaded with :meth:`load` when the target is ready, then asked for a batch's
    drafts at once on the engine's forward thread, just before the target verifies them.

    One that called ``ctx.capture`` also implements ``observe(reqs: Sequence[DraftObservation],
    features: Tensor)``, called on the forward thread after every target forward (prefill chunks,
    plain decodes and verifies) with that forward's features: ``features[o.row:o.row +
    len(o.next_ids)]`` are those of observation ``o``'s positions."""

    def load(self, ctx: DraftContext) -> None:
        """Load the draft model(s) through ``ctx``; raise ``core.errors.ModelLoadError`` naming what is wrong."""

    def propose_batch(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        """Exactly ``req.room`` draft tokens per request, as chains (or :class:`DraftTree` of that
        many nodes). A request's draft KV may be
        written at its ``slots`` (positions past ``kv_len`` are rejected or rewritten later: the
        drafter learns what the target kept from the next call's ``tokens``)."""


@attrs.define(frozen=True)
class HiCacheStorageConfig:
    """What a :class:`HiCacheStorage` backend is built with (plugin API 1.5)."""

    namespace: str  # the model/dtype/page-size/KV-layout/TP-rank identity every key of this engine starts with
    path: str | None = None  # folder or URI; None: the backend's default (``file``: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR)
    page_bytes: int = 0  # the size of one value (a page's K and V, every layer)


class HiCacheStorage(Protocol):
    """HiCache's storage tier under the host pool (SGLang's ``HiCacheStorage``, ``--hicache-storage-backend``):
    a key-value store of KV pages, constructed as ``backend(config)`` (a :class:`HiCacheStorageConfig`).

    A key is an opaque string of ``[0-9A-Za-z._-]`` (at most 200 characters), ``<namespace>_<hash>``
    (``config.namespace``, an underscore, then a hash chain over the token ids up to and including the page: a key
    names the whole prefix). A value is a page's bytes. Called from the engine's thread (reads, at
    admission) and from one background writer thread; a backend must never raise into the engine:
    a failed write returns False, a missing or damaged value reads as None."""

    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None when it is missing or fails the backend's integrity check."""

    def set(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` (replacing any); False when it could not be stored."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value (a cheap check: ``get`` may still find it damaged)."""

    def clear(self) -> None:
        """Drop every value of this backend's namespace."""


class MultimodalProcessor(Protocol):
    """A vision-language architecture's request processor (plugin API 1.7, kind
    ``multimodal_processor``, registered under the model's architecture name): built once as
    ``factory(model_path: str, hf_config, tokenizer)``, then called for every request with images
    (from the request's thread, never the forward's).

    ``image_token_id`` is the placeholder token the model's chat template puts once per image
    (Qwen2-VL's ``<|image_pad|>``), and the token every image token carries in ``input_ids``;
    ``max_images`` the most images one prompt may hold (None: no limit of the model's own)."""

    image_token_id: int
    max_images: int | None

    def process(self, prompt: str | list[int], images: list[Any]) -> Any:
        """A :class:`core.engine.multimodal.ImageInputs` for ``prompt`` (a text, or token ids)
        with ``images`` (decoded RGB ``PIL.Image.Image`` objects, in prompt order): ``input_ids`` with
        each placeholder expanded to its image's tokens, ``pixel_values`` / ``image_grid_thw``
        for the model's ``encode_images``, ``spans`` and ``hashes``; the M-RoPE fields are left
        to the engine. A prompt whose placeholders do not match the images one to one raises
        :class:`core.errors.InvalidRequest` naming both counts."""


EXTENSION_KINDS: dict[str, str] = {
    # kind -> hook name
    "attention_backend": "register_attention_backends",
    "quant_method": "register_quant_methods",
    "model": "register_models",
    "tool_parser": "register_tool_parsers",
    "reasoning_parser": "register_reasoning_parsers",
    "grammar_backend": "register_grammar_backends",
    "speculative_algorithm": "register_speculative_algorithms",
    "hicache_storage_backend": "register_hicache_storage_backends",
    "multimodal_processor": "register_multimodal_processors",
}
