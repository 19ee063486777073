"""A Llama-style decoder layer as one C++ op (``cpu_decode.cpp``).

At batch 1 most of a CPU decode step was the ~20 torch calls per layer between the kernels, not
the kernels; at 64 rows they were still ~5 % of it. :func:`plan` looks at a layer once: where
everything it calls has a C++ kernel here (the ``cpu`` attention backend's; for every linear,
``kernels/cpu_gemv`` and/or a dense GEMM, as the quant method describes through
``cpu_linear_args``), it returns the layer's static arguments; the model then sends its forwards
through :func:`run`, which calls the same kernels in the same order, so the result is the same.
Anything else (other backends, fp16 or fp8 pools, q/k norms, soft caps, tensor parallelism)
keeps the Python path. ``CORE_FUSED_OPS=0`` turns it off too.

Where every layer has a plan and every linear runs the gemv kernels (a few rows, int4 / int8
weights), :func:`plan_stack` joins the plans and :func:`run_stack` runs the whole stack as one op:
same kernels, same order, same bits, without a call, dispatches and thread wake-ups per layer.
Given the model's final norm and a packed LM head, :func:`run_stack_head` runs those too, for the
steps whose every row samples (decodes).

The stack also adds LoRA adapters (``core/engine/lora``'s pool, torch backend) to its linears'
outputs, each row through its own adapter: :func:`serves_lora` binds the pool's buffers once
(again after a new pool replaced them), and the calls pass the rows' slots. The one-op layers do
not: batches with adapters that the stack does not serve keep the Python layers.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import Any

import structlog
import torch

from core_kernels import cpp_build, cpu_gemv

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
PREFIX = "core_cpu_decode"
_EMPTY = torch.empty(0)  # what the op receives for a tensor a layer does not have
# The stack serves batches of at most this many rows. Each thread computes the row loops between
# the GEMMs (norms, adds, activation) for every row itself, and one thread the rotary embedding:
# a few microseconds at decode sizes, but a prefill chunk of thousands of rows runs the one-op
# layers instead, which share those loops. (bf16 layers on AMX or with a dense copy for 65+ rows
# stop below this anyway; float32 layers keep no dense copy.)
STACK_MAX_ROWS = 64
HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_MADV_HUGEPAGE = 14  # Linux's madvise advice


@functools.cache
def available() -> bool:
    """The op and the kernels it always calls are loaded (built the first time on this machine);
    the gemv kernels are only called for layers whose quant method holds them."""
    from core_kernels import cpu_ops

    if os.environ.get("CORE_FUSED_OPS", "1") == "0" or not cpu_ops.available():
        return False
    return cpp_build.try_load(PREFIX, SOURCE, "cpu_decode", fallback="the layer's Python forward")


def _linear(layer: torch.nn.Module) -> tuple[int, int, list[torch.Tensor]] | None:
    """(kind, max_rows, [a, b, bias, dense]) from the quant method's ``cpu_linear_args``."""
    args = getattr(layer.quant_method, "cpu_linear_args", lambda _: None)(layer)
    if args is None or getattr(layer, "tp", None) is not None and layer.tp.size > 1:
        return None
    kind, a, b, max_rows, dense = args
    return kind, max_rows, [_EMPTY if t is None else t for t in (a, b, layer.bias, dense)]


def plan(layer: torch.nn.Module, backend: Any) -> dict[str, Any] | None:
    """The static arguments of ``layer`` (a ``LlamaDecoderLayer``) for :func:`run`, or None. Under a
    ``batch_invariant`` backend (``--enable-deterministic-inference``) only for gemv linears (int4 /
    int8: the same per row for any row count), the attention planned batch-invariant."""
    invariant = getattr(backend, "batch_invariant", False)
    attn, mlp = layer.self_attn, layer.mlp
    spec = attn.attn.spec
    caches = getattr(backend, "decode_caches", lambda _: None)(spec.layer_id)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (caches is None or caches[0].dtype not in (torch.bfloat16, torch.float32) or attn.qk_norm or spec.logit_cap
            or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
            or getattr(mlp, "act", None) != "silu" or any(n.offset or n.eps != norms[0].eps for n in norms)
            or not hasattr(attn.rotary, "cos") or not available()):
        return None
    linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    if any(lin is None or lin[2][3].numel() and lin[2][3].dtype != caches[0].dtype for lin in linears):
        return None
    if invariant and any(lin[0] not in (0, 1) or lin[2][3].numel() for lin in linears):
        return None  # (oneDNN's dense GEMMs choose by the row count)
    return {
        "norms": [n.weight.detach().to(caches[0].dtype).contiguous() for n in norms],
        "eps": norms[0].eps,
        "lin": [t for lin in linears for t in lin[2]],
        "kinds": [lin[0] for lin in linears],
        "max_rows": [lin[1] for lin in linears],
        "rotary": (attn.rotary.cos, attn.rotary.sin, attn.rotary.rotary_dim),
        "heads": (spec.num_heads, spec.num_kv_heads, spec.head_dim),
        "caches": caches,
        "attn": (spec.scaling, spec.sliding_window or 0, 0.0),
        "linears": (attn.qkv_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj),  # (their LoRA: serves_lora)
        "batch_invariant": invariant,
    }


def run(p: dict[str, Any], x: torch.Tensor, batch: Any,
        residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer on ``x + residual`` (``x [rows, hidden]``; no residual: ``x``) as ``(h, mlp_out)``,
    whose sum is the layer's output: the caller adds it, or passes ``mlp_out`` on as the next
    layer's ``residual``, which that layer adds in the pass of its first norm."""
    cos, sin, rot = p["rotary"]
    scale, window, cap = p["attn"]
    return torch.ops.core_cpu_decode.decode_layer(
        x.contiguous(), residual, p["norms"][0], p["norms"][1], p["eps"], p["lin"], p["kinds"], p["max_rows"],
        batch.positions, cos, sin, rot, *p["heads"], *p["caches"], batch.out_cache_loc, batch.kv_indices,
        batch.seq_lens, batch.extend_lens, scale, window, cap, p["batch_invariant"])


def plan_stack(plans: list[dict[str, Any] | None], norm: torch.nn.Module | None = None,
               head: torch.nn.Module | None = None, embedding: torch.Tensor | None = None) -> dict[str, Any] | None:
    """The layers' plans joined into one ``DecodeStack`` (checked once, here) for :func:`run_stack`,
    or None where some layer has none, some linear is not int4 / int8 (kinds 0, 1), the pool is
    not bf16 or float32 (the norms in the same dtype), or the layers differ in shape.

    ``norm`` (the model's final ``RMSNorm``) and ``head`` (the module computing the logits, with
    ``cpu_linear_args()`` as a quant method's; None: no head) join the stack for
    :func:`run_stack_head` where the head is int4 / int8 / int8-blocks gemv for few rows (int8
    blocks: float32 logits) and the norm plain;
    with those and ``embedding`` (the token table ``[vocab, hidden]`` the model looks ids up in
    plainly, in the stack's dtype), :func:`decode` runs a whole decode step from token ids."""
    if not plans or any(p is None for p in plans):
        return None
    first = plans[0]
    dtype = first["caches"][0].dtype
    same = ("eps", "heads", "attn", "batch_invariant")
    if (dtype not in (torch.bfloat16, torch.float32) or any(k not in (0, 1) for p in plans for k in p["kinds"])
            or any(p[k] != first[k] for p in plans for k in same)
            or any(p["rotary"][0] is not first["rotary"][0] for p in plans)  # one rotary table (one module)
            or any(t.dtype != dtype for p in plans for t in p["norms"])):
        return None
    cos, sin, rot = first["rotary"]
    scale, window, _ = first["attn"]
    tail, head_kind, head_rows = _head(norm, head, dtype)
    # the packed weights, in the order a step reads them: what the stack streams at every step
    into_arena([p["lin"][4 * i + j] for p in plans for i in range(5) for j in (0, 1)] + tail[1:])
    try:
        stack = torch.classes.core_cpu_decode.DecodeStack(
            [t for p in plans for t in (*p["norms"], *(p["lin"][4 * i + j] for i in range(5) for j in range(3)))],
            [k for p in plans for k in p["kinds"]], first["eps"], cos, sin, rot, *first["heads"],
            [p["caches"][0] for p in plans], [p["caches"][1] for p in plans], scale, window,
            tail, head_kind, norm.eps if tail else 0.0)
    except RuntimeError as e:  # a layout the checks above let through: the one-op layers still serve
        structlog.get_logger(__name__).warning("cpu_decode.stack_unavailable", reason=str(e).splitlines()[0],
                                               fallback="one op per layer")
        return None
    stack.set_batch_invariant(first["batch_invariant"])
    max_rows = min([STACK_MAX_ROWS + 1] + [r for p in plans for r in p["max_rows"]])
    embeds = bool(tail) and embedding is not None and embedding.dtype == dtype and embedding.device.type == "cpu"
    if embeds:
        stack.set_embedding(embedding.detach().contiguous())
    return {"stack": stack, "layers": len(plans), "max_rows": max_rows, "head_rows": head_rows, "embeds": embeds,
            "linears": [m for p in plans for m in p["linears"]], "dtype": dtype}


def serves_lora(p: dict[str, Any]) -> bool:
    """Whether the stack of ``p`` adds the LoRA adapters of its linears' current pool (a
    ``LayerLoRA`` at ``layer.__dict__["lora"]``): the pool's buffers are bound to the stack the first
    time and again when a new pool replaced them (a check of one layer's, per call)."""
    bound = p.get("lora")
    if bound is None or bound[0].__dict__.get("lora") is not bound[1]:
        bound = p["lora"] = _bind_lora(p)
    return bound[2] is not None


def _bind_lora(p: dict[str, Any]) -> tuple[torch.nn.Module, Any, Any]:
    """(a linear, its LayerLoRA, their pool or None where the stack cannot add its adapters): the
    pool's A and B-by-blocks buffers handed to the stack (``DecodeStack.set_lora``), read in place."""
    mods = p["linears"]
    loras = [m.__dict__.get("lora") for m in mods]
    i = next((i for i, lora in enumerate(loras) if lora is not None), 0)
    pool = loras[i].pool if loras[i] is not None else None
    if pool is not None and (pool.backend != "torch" or any(
            lora is not None and (lora.pool is not pool or lora.B_blocks is None or lora.A.dtype != p["dtype"]
                                  or lora.A.device.type != "cpu") for lora in loras)):
        pool = None
    if pool is None:
        p["stack"].set_lora([], [], [], [], [], 0, 0)
        return mods[i], loras[i], None
    spans = [v for lora in loras for v in _part_spans(lora)]
    # A as the stack reads it: int8 codes with their scales (LayerLoRA.q8), else the pool's own A
    a = [(lora.A_q8 if lora.q8 else lora.A) if lora else _EMPTY for lora in loras]
    q8 = any(lora is not None and lora.q8 for lora in loras)
    sa, sb = ([lora.scales[k] if lora is not None and lora.q8 else _EMPTY for lora in loras] if q8 else []
              for k in (0, 1))
    # (on huge pages, in the order a step reads them: the adapters are as many bytes as the weights)
    into_arena([t for lora, at in zip(loras, a) if lora is not None for t in (at, lora.B_blocks)])
    try:
        p["stack"].set_lora(a, [lora.B_blocks if lora else _EMPTY for lora in loras], sa, sb, spans, pool.slots,
                            pool.max_rank)
    except RuntimeError as e:  # a layout the checks above let through: those batches keep the Python layers
        structlog.get_logger(__name__).warning("cpu_decode.lora_unavailable", reason=str(e).splitlines()[0],
                                               fallback="the Python layers for batches with adapters")
        p["stack"].set_lora([], [], [], [], [], 0, 0)
        pool = None
    return mods[i], loras[i], pool


def _part_spans(lora: Any) -> list[int]:
    """A linear's parts as (first output column, width) x 3 for ``set_lora``; width 0: no such part."""
    flat = [v for span in lora.spans for v in span] if lora is not None else []
    return (flat + [0] * 6)[:6]


def _slots(p: dict[str, Any], lora: bool, rows: int) -> torch.Tensor | None:
    """The rows' adapter slots for a stack call with adapters (``serves_lora`` bound them), else None."""
    return p["lora"][2].token_slots(rows) if lora else None


def into_arena(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Move ``tensors`` (CPU, contiguous; each in place, ``set_``: every holder sees the move) into
    one buffer, back to back in the order given, starting on a 2 MiB boundary and advised for
    transparent huge pages (Linux; elsewhere, or where THP is off, the buffer is plain); returns it,
    or None where they share one buffer already (moved before: planning again copies nothing).
    A ``DecodeStack`` built before a move keeps what it points into alive (it holds the storages).

    The stack reads all of its weights once per step, each GEMM's only 0.2-1.3 MB for SmolLM2: in
    one run the hardware prefetchers carry on from one weight into the next, and 2 MiB pages spare
    the ~26,000 TLB misses of 4 KiB pages (costly under a hypervisor). Batch-1 stack ~6 % faster on
    the 2-vCPU EPYC (interleaved, same process; one run without huge pages: ~2 %)."""
    todo = list({id(t): t for t in tensors if t.numel() and t.device.type == "cpu" and t.is_contiguous()}.values())
    if len({t.untyped_storage().data_ptr() for t in todo}) <= 1:
        return None  # nothing to move, or in one buffer already (a stack planned again: another backend, say)
    sizes = [(t.numel() * t.element_size() + 63) // 64 * 64 for t in todo]  # each on a cache line
    pages = -(-sum(sizes) // HUGE_PAGE) * HUGE_PAGE  # whole huge pages, all inside the buffer
    with torch.inference_mode(False):  # a normal tensor, whatever mode the first forward runs in
        buf = torch.empty(pages + HUGE_PAGE, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE_PAGE
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(buf.data_ptr() + start), ctypes.c_size_t(pages),
                                                      _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc symbol: the buffer stays on small pages
            pass
    with torch.inference_mode():  # set_ on inference tensors (weights loaded in inference mode) too
        for t, size in zip(todo, sizes):
            view = buf[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.set_(view)
            start += size
    return buf


def _head(norm: torch.nn.Module | None, head: torch.nn.Module | None,
          dtype: torch.dtype) -> tuple[list[torch.Tensor], int, int]:
    """(final norm weight, head codes, head scales), the head's kind and the rows below which it
    runs its gemv kernels; ``([], 0, 0)`` where they cannot join the stack."""
    args = getattr(head, "cpu_linear_args", lambda: None)() if norm is not None else None
    if args is None or args[0] not in (0, 1, 3) or norm.offset or getattr(head, "bias", None) is not None:
        return [], 0, 0
    kind, a, b, max_rows, _ = args
    # int4's scales and minimums: see cpu_gemv; int8 blocks (kind 3, float32 logits): fp16 scales
    scales = cpu_gemv.SZ_DTYPES.get(dtype) if kind == 0 else torch.float16 if kind == 3 else dtype
    if b.dtype != scales or norm.weight.numel() != a.shape[1] * (8 if kind == 0 else 4):  # K of the packed codes
        return [], 0, 0
    return [norm.weight.detach().to(dtype).contiguous(), a, b], kind, max_rows


def run_stack_head(p: dict[str, Any], x: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer, the final norm and the head on ``x`` (fewer rows than ``p["max_rows"]`` and
    ``p["head_rows"]``): ``(hidden, logits)``, as the model's norm and ``compute_logits`` give them."""
    return p["stack"].run_head(x.contiguous(), batch.positions, batch.out_cache_loc, batch.kv_indices, batch.seq_lens,
                               batch.extend_lens, _slots(p, batch.lora, x.shape[0]))


def decode(p: dict[str, Any], ids: list[int], positions: list[int], out_cache_loc: list[int], kv_indices: torch.Tensor,
           seq_lens: list[int], vocab: int, lora: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step of ``len(ids)`` sequences (fewer than ``p["max_rows"]`` and ``p["head_rows"]``;
    planned with an embedding) from the scheduler's lists: ``(hidden, logits, argmax)``, as the
    model's forward, ``compute_logits`` and ``argmax(logits[:, :vocab])`` give them. One call, so
    the ~8 torch ops a step otherwise makes before and after the stack are not made. ``lora``: the
    rows go through the pool's adapters as its last ``set_batch`` assigned them (``serves_lora``)."""
    return p["stack"].decode(ids, positions, out_cache_loc, kv_indices, seq_lens, vocab, _slots(p, lora, len(ids)))


def decode_steps(p: dict[str, Any], ids: list[int], positions: list[int], out_cache_loc: list[int],
                 kv_indices: torch.Tensor, seq_lens: list[int], vocab: int, steps: int,
                 stop_ids: list[int], lora: bool = False) -> list[list[int]]:
    """Up to ``steps`` greedy decode steps in one call (``DecodeStack.decode_steps``): each step's
    tokens (a list per step, one per sequence), ending early after a step that produced any of
    ``stop_ids``. ``out_cache_loc`` holds step k's slots at ``[k * len(ids), (k + 1) * len(ids))``;
    ``kv_indices`` has the columns of every step's slots; ``lora`` as :func:`decode`'s, every step."""
    return p["stack"].decode_steps(ids, positions, out_cache_loc, kv_indices, seq_lens, vocab, steps, stop_ids,
                                   _slots(p, lora, len(ids))).tolist()


def run_stack(p: dict[str, Any], x: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer on ``x [rows, hidden]`` (fewer rows than ``p["max_rows"]``) as ``(h, mlp_out)`` of
    the last layer, as a chain of :func:`run` calls returns them."""
    return p["stack"].run(x.contiguous(), batch.positions, batch.out_cache_loc, batch.kv_indices, batch.seq_lens,
                          batch.extend_lens, _slots(p, batch.lora, x.shape[0]))
