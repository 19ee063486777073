"""Shared model layers: architectures are wired from these, so a model file stays short.

Linear layers store and apply their weights through a :class:`QuantMethod`; packed
layers (fused QKV, fused gate/up) carry a ``weight_loader`` on their parameters that
copies one checkpoint shard into its slice, so loading stays model-agnostic.

Tensor parallelism lives here too: the column- / row-parallel linears, the QKV projection
(attention heads split over the ranks, KV heads replicated when there are fewer than ranks),
``Attention``, ``VocabEmbedding`` (vocab-parallel embedding and LM head) and ``FusedExperts``
read the group they are built in (:func:`core.parallel.current`) and their weight loaders
copy only this rank's slice of each checkpoint tensor. A model wired from these layers is
sharded at load with no code of its own; with one rank they are the plain layers.
"""

from __future__ import annotations

import functools
import os
from typing import AbstractSet as Set, Callable, Iterable, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from core.errors import ModelLoadError
from core.interfaces import AttentionLayerSpec, ForwardBatch, QuantMethod
from core.parallel import TensorParallel, current as current_tp


@functools.cache
def _fused_ops(device_type: str):
    """The fused-op kernels for a device type, or None: ``core_kernels.fused_ops`` (Triton: norm,
    rotary, gated activation) for CUDA, ``core_kernels.cpu_ops`` (C++ compiled once per machine:
    norm, rotary) for the CPU. ``CORE_FUSED_OPS=0`` keeps the torch ops (to
    compare); so does a machine where the kernels cannot be built. The torch ops are the reference."""
    if os.environ.get("CORE_FUSED_OPS", "1") == "0":
        return None
    try:
        if device_type == "cuda":
            from core_kernels import fused_ops

            return fused_ops
        if device_type == "cpu":
            from core_kernels import cpu_ops

            return cpu_ops if cpu_ops.available() else None
    except Exception:  # no triton, or no toolchain: the torch ops
        return None
    return None


def fused(x: torch.Tensor):
    """The fused-op kernels for ``x``'s device, or None (use the torch ops)."""
    return _fused_ops(x.device.type)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class RMSNorm(nn.Module):
    """RMS norm computed in float32, as the reference implementations do.

    ``offset`` = 1 gives Gemma's ``(1 + weight)`` scaling."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (k := fused(x)) is not None:
            return k.rms_norm(x, self.weight, self.eps, self.offset)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


class Linear(nn.Module):
    """``y = x W^T (+ b)``; ``output_sizes`` > 1 entries makes it a packed layer whose
    checkpoint shards (by index or by name in ``shard_names``) load into row slices."""

    def __init__(
        self,
        in_features: int,
        output_sizes: int | list[int],
        bias: bool,
        quant_method: QuantMethod,
        dtype: torch.dtype,
        shard_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.shard_names = shard_names
        self.in_features, self.out_features = in_features, sum(self.output_sizes)
        self.quant_method = quant_method
        quant_method.create_weights(self, in_features, self.out_features, bias, dtype)
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = self._load_shard  # type: ignore[attr-defined]

    def shard_index(self, shard: object) -> int:
        """Which part of a fused layer a checkpoint shard (a name in ``shard_names`` or an index) is;
        0 when ``shard`` is None. Quant methods' weight loaders use it too."""
        if shard is None:
            return 0
        return self.shard_names.index(shard) if isinstance(shard, str) else int(shard)

    def shard_span(self, shard: object) -> tuple[int, int]:
        """(first output row, rows) of ``shard``'s part of this layer's output."""
        idx = self.shard_index(shard)
        return sum(self.output_sizes[:idx]), self.output_sizes[idx]

    def _load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if shard is None:
            return default_weight_loader(param, loaded)
        start, size = self.shard_span(shard)
        default_weight_loader(param.data.narrow(0, start, size), loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_lora(self, x, self.quant_method.apply(self, x))


def with_lora(layer: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y``, the output of ``layer`` for ``x``, plus the current batch's LoRA deltas where a
    pool (``core.engine.lora``) attached its one object, ``layer.__dict__["lora"]``."""
    lora = layer.__dict__.get("lora")
    return y if lora is None else lora(x, y)


def _dense(layer: Linear) -> bool:
    """Whether ``layer`` is a plain ``F.linear`` over its float weight (``QuantMethod.dense``)."""
    w = getattr(layer, "weight", None)
    return (getattr(layer.quant_method, "dense", False) and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.dtype in (torch.float32, torch.bfloat16, torch.float16) and "onednn_weight" not in layer.__dict__)


def _refuse_own_loaders(layer: Linear, tp: TensorParallel) -> None:
    """A quant method that installs its own weight loaders copies whole checkpoint tensors; under
    tensor parallelism they would not be sharded, so such a method is refused by name at build time."""
    if tp.size > 1 and any(p.weight_loader != layer._load_shard for p in layer.parameters(recurse=False)):
        raise ModelLoadError(f"quantization method {type(layer.quant_method).__name__} loads its own weights and "
                             f"does not support tensor parallelism (--tp-size {tp.size}) yet")


class ColumnParallelLinear(Linear):
    """A ``Linear`` whose output features are split over the tensor-parallel ranks: each
    packed part (q/k/v, gate/up) is split on its own, so rank ``r`` holds the ``r``-th slice
    of every part and its output is this rank's slice (consumed by a :class:`RowParallelLinear`).
    A fused checkpoint tensor (shard ``None``) is cut into its parts first."""

    def __init__(self, in_features: int, output_sizes: int | list[int], bias: bool, quant_method: QuantMethod,
                 dtype: torch.dtype, shard_names: tuple[str, ...] = ()) -> None:
        tp = current_tp()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self._init_parallel(in_features, sizes, [tp.shard(n, "output features") for n in sizes], bias, quant_method,
                            dtype, shard_names, tp)

    def _init_parallel(self, in_features: int, global_sizes: list[int], local_sizes: list[int], bias: bool,
                       quant_method: QuantMethod, dtype: torch.dtype, shard_names: tuple[str, ...],
                       tp: TensorParallel) -> None:
        super().__init__(in_features, local_sizes, bias, quant_method, dtype, shard_names)
        self.tp, self.global_sizes = tp, global_sizes
        _refuse_own_loaders(self, tp)

    def source_start(self, part: int) -> int:
        """First checkpoint row of part ``part`` that this rank holds."""
        return self.tp.rank * self.output_sizes[part]

    def _load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if self.tp.size == 1:
            return super()._load_shard(param, loaded, shard)
        if shard is None and len(self.output_sizes) > 1:  # already fused in the checkpoint: split into parts
            if loaded.shape[0] != sum(self.global_sizes):
                raise ValueError(f"shape mismatch: fused checkpoint tensor {tuple(loaded.shape)} for parts {self.global_sizes}")
            for i, part in enumerate(loaded.split(self.global_sizes, dim=0)):
                self._load_shard(param, part, i)
            return
        idx = self.shard_index(shard)
        if loaded.shape[0] != self.global_sizes[idx]:
            raise ValueError(f"shape mismatch: checkpoint rows {loaded.shape[0]} vs {self.global_sizes[idx]} expected")
        n = self.output_sizes[idx]
        default_weight_loader(param.data.narrow(0, sum(self.output_sizes[:idx]), n), loaded.narrow(0, self.source_start(idx), n))


class QKVParallelLinear(ColumnParallelLinear):
    """The packed q/k/v projection, split by attention heads: each rank holds
    ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads, or, with fewer KV heads
    than ranks, a copy of the one KV head its query heads attend with (``tp`` must then be a
    multiple of ``num_kv_heads``). ``num_heads`` / ``num_kv_heads`` are this rank's."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant_method: QuantMethod, dtype: torch.dtype) -> None:
        tp = current_tp()
        q_heads, kv_heads = local_heads(num_heads, num_kv_heads, tp)
        d = head_dim
        self._init_parallel(hidden, [num_heads * d, num_kv_heads * d, num_kv_heads * d],
                            [q_heads * d, kv_heads * d, kv_heads * d], bias, quant_method, dtype, ("q", "k", "v"), tp)
        self.head_dim, self.num_heads, self.num_kv_heads, self.total_kv_heads = d, q_heads, kv_heads, num_kv_heads

    def source_start(self, part: int) -> int:
        if part == 0:
            return self.tp.rank * self.output_sizes[0]
        return (self.tp.rank * self.total_kv_heads // self.tp.size) * self.head_dim  # replicated when kv < tp


def local_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds; KV heads are replicated when fewer than the ranks."""
    heads = tp.shard(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        return heads, tp.shard(num_kv_heads, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ValueError(f"the tensor-parallel size {tp.size} is not a multiple of num_key_value_heads ({num_kv_heads})")
    return heads, 1


class RowParallelLinear(Linear):
    """A ``Linear`` whose input features are split over the ranks (its input is a column-parallel
    layer's output); the partial products are summed with one all-reduce, only when there is
    more than one rank. The bias is loaded on rank 0 alone so that the sum adds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant_method: QuantMethod,
                 dtype: torch.dtype) -> None:
        tp = current_tp()
        super().__init__(tp.shard(in_features, "input features"), out_features, bias, quant_method, dtype)
        self.tp, self.reduce = tp, tp.size > 1
        _refuse_own_loaders(self, tp)

    def _load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if self.tp.size == 1:
            return super()._load_shard(param, loaded, shard)
        if param.dim() == 1:  # the bias: rank 0's copy only
            if param.shape != loaded.shape:
                raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
            return param.data.copy_(loaded) if self.tp.rank == 0 else param.data.zero_()
        n = param.shape[1]
        if loaded.dim() != 2 or loaded.shape[1] != n * self.tp.size:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} for a row-parallel slice {tuple(param.shape)}")
        default_weight_loader(param, loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ b)``, plus ``residual`` when given. After :meth:`fuse_after_loading` decided so
        (a dense weight on a GPU, one rank, no bias), the sum is one GEMM that adds into
        ``residual`` in place: the caller hands ``residual`` over and uses only the result."""
        if residual is not None and self.__dict__.get("add_in_gemm"):
            return with_lora(self, x, residual.addmm_(x, self.weight.t()))
        y = with_lora(self, x, self.quant_method.apply(self, x))  # (a partial sum under TP, as the delta is)
        if self.reduce:
            self.tp.all_reduce(y)
        return y if residual is None else residual + y

    def fuse_after_loading(self, device_types: tuple[str, ...] = ("cuda",)) -> None:
        """On a GPU, add the residual inside the GEMM (cuBLAS's beta = 1): one launch, where the
        add was another per layer and projection. Called by the loader after the weights are in."""
        self.__dict__["add_in_gemm"] = (_dense(self) and self.weight.device.type in device_types and not self.reduce
                                        and self.bias is None)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (NeoX / HF "rotate half" layout) with a cos/sin cache.

    Frequencies come from transformers' rope-init functions for the scaled variants
    (linear, dynamic, yarn, llama3, ...), so every rope_type a config can name is
    computed the way the checkpoint was trained. ``dynamic`` uses its base frequencies
    (no per-length update)."""

    def __init__(self, config, head_dim: int, max_positions: int, rope_parameters: Mapping | None = None,
                 layer_type: str | None = None) -> None:
        """``layer_type`` selects one entry of a per-layer-type ``rope_parameters`` dict
        (Gemma 3: ``sliding_attention`` / ``full_attention`` have their own theta)."""
        super().__init__()
        if layer_type is not None and rope_parameters is None:
            rope_parameters = config.rope_parameters[layer_type]
        params = dict(rope_parameters or getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        device = torch.get_default_device()  # the device the model is being built on (``with torch.device(...)``)
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))
            scale = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
            kw = {"layer_type": layer_type} if layer_type is not None else {}
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, device, **kw)
        if (factors := params.get("freq_factors")) is not None:  # a GGUF's rope_freqs (llama.cpp's freq_factors)
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float, device=device)
        t = torch.arange(max_positions, dtype=torch.float, device=device)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = emb.shape[-1]
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]."""
        if (kern := fused(q)) is not None:
            return kern.rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _rope(q, cos, sin, self.rotary_dim), _rope(k, cos, sin, self.rotary_dim)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim < x.shape[-1]:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((_rope(rot, cos, sin, rotary_dim), rest), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Delegates to the batch's attention backend (chosen by plugin at start-up).

    ``spec`` names the model's head counts; under tensor parallelism ``self.spec`` holds this
    rank's (see :func:`local_heads`), which is what the projections around it produce."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__()
        tp = current_tp()
        if tp.size > 1:
            heads, kv_heads = local_heads(spec.num_heads, spec.num_kv_heads, tp)
            spec = attrs.evolve(spec, num_heads=heads, num_kv_heads=kv_heads)
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = self.spec
        if batch.layer_ready is not None:  # this layer's KV still landing (a HiCache load-back on a GPU)
            batch.layer_ready(s.layer_id)
        out = batch.attn_backend.forward(
            q.view(-1, s.num_heads, s.head_dim),
            k.view(-1, s.num_kv_heads, s.head_dim),
            v.view(-1, s.num_kv_heads, s.head_dim),
            s,
            batch,
        )
        return out.reshape(-1, s.num_heads * s.head_dim)


# the fused kernel's name for each activation (core_kernels.fused_ops.gated_act)
FUSED_ACT = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def gated_act(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``ACTIVATIONS[act](gate) * up``, one launch on a GPU."""
    if (k := fused(gate)) is not None and gate.dim() == 2 and hasattr(k, "gated_act"):  # CUDA: one launch
        return k.gated_act(gate, up, FUSED_ACT[act])
    return ACTIVATIONS[act](gate) * up


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``.

    gate and up stay two GEMMs: packed into one ``[2I, H]`` weight they hit a slow
    oneDNN path on CPU (SmolLM2 prefill: 35 ms vs 2 x 9 ms per layer)."""

    def __init__(self, hidden: int, intermediate: int, act: str, quant: QuantMethod, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; known: {', '.join(ACTIVATIONS)}")
        self.act = act
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, bias, quant, dtype)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias, quant, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, quant, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, plus ``residual`` when given (see :meth:`RowParallelLinear.forward`)."""
        if (w := self.__dict__.get("gate_up")) is not None:
            gate, up = F.linear(x, w, self.__dict__["gate_up_bias"]).chunk(2, dim=-1)
            gate, up = with_lora(self.gate_proj, x, gate), with_lora(self.up_proj, x, up)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gated_act(self.act, gate, up), residual)

    def fuse_after_loading(self, device_types: tuple[str, ...] = ("cuda",)) -> None:
        """On a GPU, gate and up as one GEMM over one ``[2I, H]`` weight (one launch instead of two):
        the two layers' weights become views into it, so it costs no memory and a weight reload
        writes through. On the CPU they stay two GEMMs (see the class docstring)."""
        g, u = self.gate_proj, self.up_proj
        self.__dict__.pop("gate_up", None)
        if not (_dense(g) and _dense(u) and g.weight.device.type in device_types and (g.bias is None) == (u.bias is None)):
            return
        n = g.weight.shape[0]
        w = torch.cat([g.weight.data, u.weight.data])
        g.weight.data, u.weight.data = w[:n], w[n:]
        b = None
        if g.bias is not None:
            b = torch.cat([g.bias.data, u.bias.data])
            g.bias.data, u.bias.data = b[:n], b[n:]
        self.__dict__["gate_up"], self.__dict__["gate_up_bias"] = w, b


class VocabEmbedding(nn.Module):
    """A ``[vocab, hidden]`` table: token embedding (``forward``) and LM head (``logits``), tied or not.

    A quant method that serves the LM head packed (``QuantMethod.pack_lm_head``) is installed as
    ``pack_head`` after loading; the first ``logits`` call builds the packed head from the loaded
    table, so only the table actually used as a head is packed (an untied input embedding never is).

    Vocab-parallel under tensor parallelism: rank ``r`` holds rows ``[r * n, (r + 1) * n)`` with
    ``n = ceil(vocab / tp)`` (rows past the vocab are zero padding); the embedding sums the
    ranks' lookups (each rank contributes the ids it holds) and the LM head gathers the ranks'
    logit columns."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        tp = current_tp()
        self.tp, self.vocab_size = tp, vocab_size
        rows = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype))
        if tp.size > 1:
            self.weight.weight_loader = self._load_rows  # type: ignore[attr-defined]
        self.pack_head: Callable[[nn.Module], nn.Module | None] | None = None
        self.packed_head: nn.Module | None = None

    def _load_rows(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs vocab {self.vocab_size} x {param.shape[1]}")
        n = max(0, min(param.shape[0], self.vocab_size - self.vocab_start))
        param.data.zero_()
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_start + n])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))

    def head(self) -> nn.Module | None:
        """The packed head that ``logits`` multiplies through (built on the first call), or None
        where it multiplies by the table itself."""
        if self.pack_head is not None and "head_built" not in self.__dict__:
            self.packed_head, self.__dict__["head_built"] = self.pack_head(self), True
        return self.packed_head

    def weights_updated(self) -> None:
        """The table's values changed in place (a weight update): a head built from it refreshes
        itself (its ``table_updated(embedding)``) or is built again on its next use."""
        head = self.packed_head
        if head is not None and (refresh := getattr(head, "table_updated", None)) is not None:
            refresh(self)
        elif self.__dict__.pop("head_built", None):
            self.packed_head = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden] @ weight^T`` in ``hidden.dtype`` (through the packed head when there is one)."""
        head = self.head()
        out = head(hidden) if head is not None else F.linear(hidden, self.weight)
        if self.tp.size > 1:
            out = self.tp.all_gather(out)[:, : self.vocab_size]
        return out


def checkpoint_target(name: str, packed: Mapping[str, tuple[str, object]]) -> tuple[str, object]:
    """(model parameter name, shard id or None) that checkpoint tensor ``name`` loads into, under a
    model's ``packed`` map (see :func:`load_packed_weights`)."""
    for src, (dst, shard_id) in packed.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard_id
    return name, None


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: Mapping[str, tuple[str, object]] = {},
    skip: Callable[[str], bool] = lambda name: False,
    optional: Set[str] = frozenset(),
    partial: bool = False,
) -> set[str]:
    """Copy checkpoint tensors into ``model``'s parameters by name.

    ``packed`` maps a checkpoint sub-name to (packed parameter sub-name, shard id),
    e.g. ``{"q_proj": ("qkv_proj", "q")}``. An unknown checkpoint tensor (unless
    ``skip(name)``), a shape mismatch, or a parameter (or shard of a packed one) that
    the checkpoint lacks raises ModelLoadError naming the tensor: a missing tensor
    would otherwise serve uninitialised memory. Returns the checkpoint names loaded.

    ``partial`` (a served model's update, ``core.engine.model_loader.weight_sync``): any subset, all
    or nothing: every write is tried on meta tensors (``_write(dry=True)``) before any is done."""
    params = dict(model.named_parameters())
    if partial:
        _write(params, weights := list(weights), packed, skip, dry=True)
    seen = _write(params, weights, packed, skip)
    if partial:
        return seen
    expected: set[str] = set()
    for pname in params:
        shards = [pname.replace(f".{dst}.", f".{src}.") for src, (dst, _) in packed.items() if f".{dst}." in pname]
        expected.update(shards or [pname])
    missing = sorted(expected - seen - optional)  # an ``optional`` one the caller fills itself (e.g. shared)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}{more}")
    return seen


def _write(params: dict[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]],
           packed: Mapping[str, tuple[str, object]], skip: Callable[[str], bool], dry: bool = False) -> set[str]:
    """Each tensor into its parameter (through the parameter's ``weight_loader``); the names written.
    ``dry``: into a meta tensor of its shape instead (the loaders' checks run, nothing is copied)."""
    seen: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        target, shard = checkpoint_target(name, packed)
        if target not in params:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no matching model parameter")
        param, loader = params[target], getattr(params[target], "weight_loader", None) or default_weight_loader
        try:
            if dry:
                loader(torch.empty_like(param, device="meta"), tensor.to("meta", param.dtype), shard)
            else:
                loader(param, tensor.to(param.dtype), shard)
        except ValueError as e:  # e.g. a shape mismatch: name the tensor
            raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
        seen.add(name)
    return seen


# --------------------------------------------------------------------------- mixture of experts


class ExpertsMethod:
    """How a :class:`FusedExperts` layer computes its experts. The default is a reference
    torch loop over the experts some token selected (runs anywhere, CPU included); a
    fused kernel replaces it by subclassing and overriding :meth:`apply` (and, when it
    needs another weight layout, :meth:`process_weights_after_loading`), then being
    assigned to ``layer.experts_method``."""

    def apply(self, layer: FusedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, ``topk_weights`` / ``topk_ids`` ``[T, k]``; returns
        ``sum_k w[t, k] * expert[ids[t, k]](x[t])`` as ``[T, H]`` in ``x.dtype``."""
        out = torch.zeros_like(x)
        flat_ids = topk_ids.reshape(-1)
        for e in torch.unique(flat_ids).tolist():
            token, slot = torch.where(topk_ids == e)
            gate, up = F.linear(x[token], layer.w13.weight[e]).chunk(2, dim=-1)
            y = F.linear(layer.act(gate) * up, layer.w2.weight[e])
            out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(x.dtype))
        return out

    def process_weights_after_loading(self, layer: FusedExperts) -> None:
        return None


class _ExpertWeight(nn.Module):
    """One ``[E, rows, cols]`` weight; checkpoint shard ``(expert, part)`` loads into
    rows ``part * rows_per_part`` of expert ``expert``. Under tensor parallelism each expert's
    intermediate dimension is split: ``split`` names the dimension of the per-expert checkpoint
    tensor it is (0: the rows of w13's gate and up parts, 1: the columns of w2)."""

    def __init__(self, shape: tuple[int, int, int], parts: int, dtype: torch.dtype, tp: TensorParallel,
                 split: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.rows, self.tp, self.split = shape[1] // parts, tp, split
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of ``loaded`` along ``dim`` (all of it with one rank)."""
        if self.tp.size == 1:
            return loaded
        n = loaded.shape[dim] // self.tp.size
        return loaded.narrow(dim, self.tp.rank * n, n)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if shard is None:  # an already-fused [E, rows, cols] checkpoint tensor
            if self.tp.size == 1 or self.split == 1:
                return default_weight_loader(param, self._slice(loaded, 2))
            parts = loaded.shape[1] // (self.rows * self.tp.size) if loaded.dim() == 3 else 0
            if not parts or parts * self.rows != param.shape[1]:
                raise ValueError(f"shape mismatch: fused checkpoint {tuple(loaded.shape)} for a slice {tuple(param.shape)}")
            for p, part in enumerate(loaded.chunk(parts, dim=1)):
                default_weight_loader(param.data.narrow(1, p * self.rows, self.rows), self._slice(part, 1))
            return
        e, part = shard  # type: ignore[misc]
        default_weight_loader(param.data[e].narrow(0, part * self.rows, self.rows), self._slice(loaded, self.split))


class FusedExperts(nn.Module):
    """``E`` gated-MLP experts stored as ``w13`` ``[E, 2I, H]`` (gate rows, then up) and
    ``w2`` ``[E, H, I]``; per-expert checkpoint tensors load through :meth:`packed_modules`.
    Under tensor parallelism every expert keeps ``I / tp`` of its intermediate features (as a
    column- then row-parallel MLP) and the experts' partial sums are all-reduced once."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str, dtype: torch.dtype,
                 method: ExpertsMethod | None = None) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; known: {', '.join(ACTIVATIONS)}")
        self.num_experts, self.act = num_experts, ACTIVATIONS[act]
        tp = self.tp = current_tp()
        local = tp.shard(intermediate, "the experts' intermediate size")
        self.w13 = _ExpertWeight((num_experts, 2 * local, hidden), 2, dtype, tp, split=0)
        self.w2 = _ExpertWeight((num_experts, hidden, local), 1, dtype, tp, split=1)
        self.experts_method = method or ExpertsMethod()

    @property
    def quant_method(self) -> ExpertsMethod:
        """The engine calls ``quant_method.process_weights_after_loading(layer)`` once loaded."""
        return self.experts_method

    @staticmethod
    def packed_modules(num_experts: int, prefix: str = "experts", names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                       ) -> dict[str, tuple[str, object]]:
        """``load_packed_weights`` entries mapping ``experts.{e}.gate_proj`` etc. to shards."""
        g, u, d = names
        out: dict[str, tuple[str, object]] = {}
        for e in range(num_experts):
            out[f"{prefix}.{e}.{g}"] = (f"{prefix}.w13", (e, 0))
            out[f"{prefix}.{e}.{u}"] = (f"{prefix}.w13", (e, 1))
            out[f"{prefix}.{e}.{d}"] = (f"{prefix}.w2", (e, 0))
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.experts_method.apply(self, x, topk_weights, topk_ids)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) top-k routing; ``renormalize`` makes the k weights sum to 1
    (Mixtral always, Qwen2-MoE when ``norm_topk_prob``). Returns (weights in the logits'
    dtype, ids), both ``[T, k]``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids
