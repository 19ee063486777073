"""``--enable-deterministic-inference`` (SGLang's flag): a request's tokens and logprobs are the same
whatever it is batched with, alone or beside any others, prefilled in one piece or in chunks,
from the prefix cache or recomputed. RL trainers rely on it to reproduce a rollout's logprobs, and
evaluations to rerun a sample exactly.

Kernels usually pick their algorithm by the batch's size (oneDNN and MKL block a GEMM by its row
count, a decode's attention splits its keys over the threads when there are few sequences), so
the same row sums in another order in another batch. On the CPU this mode makes every step's
arithmetic for a row depend on that row alone:

* **Linear layers.** A layer on this machine's own int4 / int8 kernels (``kernels/cpu_gemv``,
  where each row's products and sums are the same for any number of rows) drops the dense copy
  that batches of many rows would switch to; every other layer (oneDNN, MKL) runs in blocks of
  ``ROW_BLOCK`` rows, the last one padded, so that every call has one shape.
* **Attention.** The backend's ``batch_invariant`` mode (plugin API 1.10): the ``cpu`` kernel runs
  every row in the tiled tasks an extend runs and never splits a decode's keys; those tiles start
  at key 0, so a chunked prefill's rows see their keys in the same blocks as a whole one's.
* **The fused C++ layers** (``kernels/cpu_decode``: the one-op layer and the decode stack) serve
  only where every linear is on those kernels (as the GGUF default model's are), with the same
  batch-invariant attention; over dense layers the Python layers run instead.
* **Sampling.** A request without a seed samples with seed 42 (SGLang's), from its own generator.

Refused at start-up, naming the reason: CUDA (the GPU kernels are not batch-invariant here yet),
``--tp-size`` > 1, LoRA adapters, speculative decoding, ``--is-embedding``, vision-language and
mixture-of-experts models, and attention backends without the mode.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from core.errors import CoreError

ROW_BLOCK = 16  # rows per GEMM call of a layer without a row-invariant kernel
DEFAULT_SEED = 42  # an unseeded request's seed (SGLang's sampling_seed default in this mode)


def setup(args: Any, device: torch.device, model: torch.nn.Module, attn_backend: Any) -> None:
    """Under the flag, before the first forward: refuse what this mode cannot cover, else
    :func:`configure` the model and the attention backend."""
    if args.enable_deterministic_inference:
        check_args(args, device)
        configure(model, attn_backend)


def check_args(args: Any, device: torch.device) -> None:
    """Refuse the flag where this mode cannot keep its promise, naming why."""
    reason = None
    if device.type != "cpu":
        reason = f"it runs on the CPU here; on {device.type} the kernels are not batch-invariant yet"
    elif args.tp_size > 1:
        reason = "not with --tp-size > 1 (the all-reduce's order follows the tensor's size)"
    elif getattr(args, "enable_lora", False) or getattr(args, "lora_paths", None):
        reason = "not with LoRA adapters (their GEMMs are grouped by adapter, the groups by batch)"
    elif args.speculative_algorithm:
        reason = "not with speculative decoding (a verify attends over draft trees, another path)"
    elif args.is_embedding:
        reason = "not with --is-embedding yet (its forwards run over a scratch attention backend)"
    if reason:
        raise CoreError(f"--enable-deterministic-inference: {reason}")


def configure(model: torch.nn.Module, attn_backend: Any) -> None:
    """Make ``model``'s linear layers and LM heads and ``attn_backend`` batch-invariant (see the
    module's docstring)."""
    from core.layers import FusedExperts, VocabEmbedding

    backends = [attn_backend.prefill, attn_backend.decode] if hasattr(attn_backend, "decode_name") else [attn_backend]
    for b in backends:
        if not getattr(b, "supports_batch_invariant", False):
            raise CoreError(f"--enable-deterministic-inference: attention backend {type(b).__name__} has no "
                            "batch-invariant mode; use --attention-backend cpu")
        b.batch_invariant = True
    attn_backend.batch_invariant = True
    if callable(getattr(model, "encode_images", None)):
        raise CoreError("--enable-deterministic-inference: not with vision-language models yet (their image "
                        "encoders are not made batch-invariant)")
    for m in model.modules():
        if isinstance(m, FusedExperts):
            raise CoreError("--enable-deterministic-inference: not with mixture-of-experts layers (each expert's "
                            "GEMM takes the rows routed to it, a number that follows the batch)")
        if isinstance(m, VocabEmbedding):  # (the head is built on its first use: wrapped then)
            m.pack_head = functools.partial(_invariant_head, m.pack_head)
        elif getattr(m, "quant_method", None) is not None:
            if row_invariant_kernel(m):
                m.__dict__.pop("dense_weight", None)  # (the GEMM of many rows switched to it)
            else:
                m.quant_method = RowBlocked(m.quant_method)


def row_invariant_kernel(layer: torch.nn.Module) -> bool:
    """Whether the layer multiplies through ``kernels/cpu_gemv`` whatever the row count, once its
    dense copy is gone: its quant method's ``cpu_linear_args`` (what ``kernels/cpu_decode`` reads
    too) says int4 or int8 codes (kinds 0, 1)."""
    args = getattr(layer.quant_method, "cpu_linear_args", lambda _: None)(layer)
    return args is not None and args[0] in (0, 1)


def row_blocked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, block: int = ROW_BLOCK) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (``[..., K] -> [..., N]``), called on ``block`` rows at a time,
    the last block padded with zero rows: every call has one shape, so the kernel a library picks
    for it (and the order it sums in) does not follow the batch's size."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if pad := -m % block:
        x2 = torch.cat([x2, x2.new_zeros(pad, shape[-1])])
    out = torch.cat([fn(x2[i : i + block]) for i in range(0, m + pad, block)])[:m]
    return out.reshape(*shape[:-1], out.shape[-1])


class RowBlocked:
    """A layer's quant method whose GEMMs run ``ROW_BLOCK`` rows at a time (:func:`row_blocked`);
    everything else is the method's own."""

    def __init__(self, method: Any) -> None:
        self.method = method

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return row_blocked(lambda rows: self.method.apply(layer, rows), x)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)


class RowBlockedHead(torch.nn.Module):
    """An LM head (a module, or the table's plain product) run ``ROW_BLOCK`` rows at a time."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.__dict__["fn"] = fn  # (not a submodule: the head's weights stay where they are)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return row_blocked(self.__dict__["fn"], hidden)

    def table_updated(self, embedding: torch.nn.Module) -> None:
        if (refresh := getattr(self.__dict__["fn"], "table_updated", None)) is not None:  # (a packed head)
            refresh(embedding)


def _invariant_head(pack: Callable[[torch.nn.Module], torch.nn.Module | None] | None,
                    emb: torch.nn.Module) -> torch.nn.Module:
    """``emb``'s LM head (``VocabEmbedding.pack_head``): the packed one as it is where it says it is
    row-invariant (``row_invariant``: the int8-blocks head of ``kernels/cpu_gemv``), else row-blocked."""
    head = pack(emb) if pack is not None else None
    if getattr(head, "row_invariant", False):
        return head
    return RowBlockedHead(head if head is not None else (lambda h: F.linear(h, emb.weight)))


def request_seed(seed: int | None, deterministic: bool) -> int | None:
    """A request's sampling seed: its own, else ``DEFAULT_SEED`` in this mode (else None: the engine's RNG)."""
    return DEFAULT_SEED if seed is None and deterministic else seed
