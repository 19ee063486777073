"""Device-side adapter slots, and the per-layer hook that adds their deltas to a batch.

The pool owns, per targeted :class:`core.layers.Linear`, one A and one B buffer holding every
slot's matrices zero-padded to ``max_rank``, so one batch can mix adapters (and the base
model) with no per-adapter shapes. A layer learns about adapters through one object only,
``layer.__dict__["lora"]`` (a :class:`LayerLoRA`), which ``core.layers`` calls on the layer's
output: ``lora(x, y) -> y``. When the current batch uses no adapter that call returns ``y`` at
once, so serving without adapters costs one attribute check per projection.

Packed layers: ``qkv_proj`` has parts q, k, v, each adapted on its own (peft adapts the
checkpoint's ``q_proj`` etc.). Part ``p``'s A rows sit at ``[p * max_rank, (p + 1) * max_rank)``
of the layer's A buffer (one shrink for all parts), its B rows at the part's output span (one
expand for all parts, on the triton backend).
"""

from __future__ import annotations

import contextlib
from typing import Collection, Mapping

import torch
import torch.nn.functional as F

from core.engine.lora.adapter import LoRAAdapter, LoRAError, packed_modules_of
from core.layers import Linear, RowParallelLinear

BACKENDS = ("torch", "triton")
# the torch backend computes a batch of at most this many tokens against every slot at once (one
# GEMM of [T, in] x [in, slots * parts * R], a mask, one GEMM back: the FLOPs are T x slots x a
# rank-R product, negligible for a decode step, while a loop over the batch's adapters costs ops
# per adapter); a larger batch (a prefill) loops over the adapters it uses
DENSE_MAX_TOKENS = 64
# peft's names for the projections of a decoder layer; a fused name stands for its parts and back
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
KNOWN_TARGETS = (*DEFAULT_TARGETS, *FUSED, "all")

Part = tuple[str, object]  # (last component of a layer's name, shard or None)


def resolve_targets(names: Collection[str] | None, layer_names: Collection[str],
                    packed: Mapping[str, tuple[str, object]]) -> set[Part]:
    """The (layer name, shard) parts that user target names (peft's / SGLang's, or None for
    all) select in a model whose Linear layers are called ``layer_names`` (last components).
    A name the model packs maps to its part; a fused name to its parts; a part name in a
    model that has only the fused layer (Phi-3's ``qkv_proj``) to that whole layer."""
    explicit = names is not None and "all" not in names
    wanted = list(names) if explicit else list(DEFAULT_TARGETS)
    for n in wanted:
        if n not in KNOWN_TARGETS:
            raise LoRAError(f"LoRA target module {n!r} is unknown; choose from {', '.join(KNOWN_TARGETS)}")
    out: set[Part] = set()
    for n in wanted:
        parts = _parts_of(n, layer_names, packed)
        if not parts and explicit:
            raise LoRAError(f"LoRA target module {n!r}: this model has no such projection; "
                            f"its linear layers are {', '.join(sorted(layer_names))}")
        out |= parts
    return out


def _parts_of(name: str, layer_names: Collection[str], packed: Mapping[str, tuple[str, object]]) -> set[Part]:
    if name in packed:
        return {packed[name]}
    if name in layer_names:
        shards = {(dst, s) for dst, s in packed.values() if dst == name}
        return shards or {(name, None)}
    if name in FUSED:  # a fused name in a model with separate layers
        return set().union(*(_parts_of(p, layer_names, packed) for p in FUSED[name]))
    fused = [f for f, members in FUSED.items() if name in members and f in layer_names]
    return {(fused[0], None)} if fused else set()


class LayerLoRA:
    """What one layer knows about adapters: its slice of the pool's buffers and how to add the
    current batch's deltas to its output. ``A`` ``[slots, parts * R, in]``, ``B`` ``[slots, out, R]``;
    ``spans[p]`` is part ``p``'s (first output column, width)."""

    def __init__(self, pool: LoRAPool, layer: Linear, shards: list[object], slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.pool, self.layer, self.shards, self.rank = pool, layer, shards, rank
        self.spans = [(0, layer.out_features) if s is None else layer.shard_span(s) for s in shards]
        self.A = torch.zeros(slots, len(shards) * rank, layer.in_features, dtype=dtype, device=device)
        self.B = torch.zeros(slots, layer.out_features, rank, dtype=dtype, device=device)
        # the torch backend's small batches: every slot's B side by side, [out, slots * parts * R], part p
        # of slot s in columns s * parts * R + p * R (its output span's rows only; zeros elsewhere)
        self.B_all = (torch.zeros(layer.out_features, slots * len(shards) * rank, dtype=dtype, device=device)
                      if pool.backend == "torch" else None)
        # the CPU's fused decode ops (kernels/cpu_decode): B by 16-output blocks, [out / 16, slots, R, 16],
        # so that the slots' deltas for one block of their GEMMs are contiguous (a copy of B, kept in step)
        blocks = pool.backend == "torch" and device.type == "cpu" and layer.out_features % 16 == 0
        # over int4 / int8-packed weights (the GGUF default model) those ops read the adapters as int8
        # codes, a power-of-two scale per A row and per B column (A_q8, B_blocks, scales: [A's, B's]);
        # A, B and B_all then hold the codes' exact values, so every path computes with the same adapter
        self.q8 = (blocks and dtype in (torch.bfloat16, torch.float32) and _packed(layer)
                   and all(start % 16 == 0 and size % 16 == 0 for start, size in self.spans))
        self.B_blocks = (torch.zeros(layer.out_features // 16, slots, rank, 16, dtype=torch.int8 if self.q8 else dtype,
                                     device=device) if blocks else None)
        self.A_q8 = torch.zeros(self.A.shape, dtype=torch.int8, device=device) if self.q8 else None
        self.scales = torch.zeros(2, slots, len(shards) * rank, device=device) if self.q8 else None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the layer's ``[T, out]`` output for input ``x`` ``[T, in]``) plus each token's
        adapter delta, added in place; untouched when the batch uses no adapter."""
        pool = self.pool
        if not pool._active:
            return y
        if pool.backend == "triton":
            return self._sgmv(x, y)
        r = self.rank
        if x.shape[0] <= DENSE_MAX_TOKENS:  # every slot at once: three ops, however many adapters the batch mixes
            h = F.linear(x, self.A.view(-1, self.A.shape[2]))  # [T, slots * parts * R]
            h *= pool.token_mask(h.shape[1] // pool.slots, x.shape[0])  # each token keeps its own slot's block
            return y.addmm_(h, self.B_all.t())
        for slot, rows in pool._groups:
            h = F.linear(x[rows], self.A[slot])
            for p, (start, size) in enumerate(self.spans):
                y[rows, start : start + size] += F.linear(h[:, p * r : (p + 1) * r], self.B[slot, start : start + size])
        return y

    def _sgmv(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Two launches whatever the part count: every part's shrink (split over K for a decode),
        then every part's expand (summing the shrink's K chunks)."""
        from core_kernels.lora import sgmv_expand_parts, sgmv_shrink_split

        pool = self.pool
        n, msl, tok = pool._num_segments, pool._max_seg_len, pool._tok_index
        seg_start, seg_slot = pool._seg_start[: n + 1], pool._seg_slot[:n]
        h = sgmv_shrink_split(x, self.A, seg_start, seg_slot, msl, tok_index=tok)
        sgmv_expand_parts(h, self.B, seg_start, seg_slot, msl, y, self.spans, tok_index=tok)
        return y

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()
        if self.B_all is not None:
            w = self.A.shape[1]
            self.B_all[:, slot * w : (slot + 1) * w].zero_()
        if self.B_blocks is not None:
            self.B_blocks[:, slot].zero_()
        if self.q8:
            self.A_q8[slot].zero_()
            self.scales[:, slot].zero_()

    def copy(self, slot: int, shard: object, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write one part's (this rank's slice of) ``a`` ``[r, in]`` and scaled ``b`` ``[out, r]``."""
        p, r = self.shards.index(shard), a.shape[0]
        start, size = self.spans[p]
        if self.q8:
            qa, sa = q8_rows(a)
            qb, sb = q8_rows(b.t())  # (per column of b)
            rows = slice(p * self.rank, p * self.rank + r)
            self.A_q8[slot, rows].copy_(qa)
            self.scales[0, slot, rows].copy_(sa)
            self.scales[1, slot, rows].copy_(sb)
            if self.B_blocks is not None:
                self.B_blocks[start // 16 : (start + size) // 16, slot, :r].copy_(qb.view(r, size // 16, 16).transpose(0, 1))
            a, b = qa * sa[:, None], (qb * sb[:, None]).t()
        self.A[slot, p * self.rank : p * self.rank + r].copy_(a)
        self.B[slot, start : start + size, :r].copy_(b)
        if self.B_all is not None:
            col = slot * self.A.shape[1] + p * self.rank
            self.B_all[start : start + size, col : col + r].copy_(b)
        if self.B_blocks is not None and not self.q8:
            self.B_blocks[:, slot].copy_(self.B[slot].view(-1, 16, self.rank).transpose(1, 2))


def _packed(layer: Linear) -> bool:
    """Whether ``layer``'s weights are int4 / int8 codes for the CPU's kernels (its quant method's
    ``cpu_linear_args`` kinds 0 and 1)."""
    args = getattr(getattr(layer, "quant_method", None), "cpu_linear_args", lambda _: None)(layer)
    return args is not None and args[0] in (0, 1)


def q8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` ``[n, k]`` as int8 codes ``[n, k]`` and a float32 scale per row, a power of two, so that
    code x scale is exact in bf16 and float32 (at most 127 in magnitude: 7 bits): every path that
    multiplies by the dequantized values computes with the same numbers as the codes' kernels."""
    t = t.float()
    amax = t.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny * 127)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 127)))
    return torch.round(t / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def _expected(layer: Linear, shard: object) -> tuple[int, int]:
    """(in, out) features of ``shard``'s part of ``layer`` in the checkpoint, before any
    tensor-parallel split."""
    tp = getattr(layer, "tp", None)
    ranks = tp.size if tp is not None and isinstance(layer, RowParallelLinear) else 1
    sizes = getattr(layer, "global_sizes", layer.output_sizes)
    out = sum(sizes) if shard is None else sizes[layer.shard_index(shard)]
    return layer.in_features * ranks, out


def _local(layer: Linear, shard: object, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a part's (A, B): a row-parallel layer's input columns of A, a
    column-parallel layer's output rows of B (each packed part split on its own)."""
    tp = getattr(layer, "tp", None)
    if tp is None or tp.size == 1:
        return a, b
    if isinstance(layer, RowParallelLinear):
        n = layer.in_features
        return a.narrow(1, tp.rank * n, n), b
    if shard is None and len(layer.output_sizes) > 1:
        parts = b.split(layer.global_sizes, dim=0)
        return a, torch.cat([p.narrow(0, layer.source_start(i), layer.output_sizes[i]) for i, p in enumerate(parts)])
    i = layer.shard_index(shard)
    return a, b.narrow(0, layer.source_start(i), layer.output_sizes[i])


class LoRAPool:
    """``slots`` device-resident adapters for ``model``'s targeted layers, and the current
    batch's segment -> slot assignment that the layers read.

    ``target_modules``: peft / SGLang names (``q_proj`` ... ``down_proj``, ``qkv_proj``,
    ``gate_up_proj``, ``all``; None: all). ``backend``: ``torch`` (any device; loops over the
    distinct slots of a batch) or ``triton`` (``core_kernels.lora``'s SGMV kernels; the segment
    tensors are persistent device buffers updated in place, so a CUDA graph can capture them)."""

    def __init__(self, model: torch.nn.Module, *, slots: int, max_rank: int, target_modules: Collection[str] | None,
                 dtype: torch.dtype, device: torch.device, backend: str = "torch") -> None:
        if backend not in BACKENDS:
            raise LoRAError(f"LoRA backend {backend!r} is unknown; choose from {', '.join(BACKENDS)}")
        if slots < 1 or max_rank < 1:
            raise LoRAError(f"LoRA pool needs at least one slot and a positive max rank (got {slots}, {max_rank})")
        self.slots, self.max_rank, self.backend, self.device = slots, max_rank, backend, torch.device(device)
        packed = packed_modules_of(model)
        linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
        self.target_names = sorted(target_modules) if target_modules is not None else ["all"]
        self.targets = resolve_targets(target_modules, {n.rsplit(".", 1)[-1] for n in linears}, packed)
        self._linears = linears
        self.layers: dict[str, LayerLoRA] = {}
        for name, layer in linears.items():
            layer.__dict__.pop("lora", None)  # a previous pool's
            last = name.rsplit(".", 1)[-1]
            shards = sorted((s for m, s in self.targets if m == last), key=lambda s: -1 if s is None else layer.shard_index(s))
            if shards:
                self.layers[name] = layer.__dict__["lora"] = LayerLoRA(self, layer, shards, slots, max_rank, dtype,
                                                                       self.device)
        self._names: list[str | None] = [None] * slots
        self._active = False
        self._dtype = dtype
        self._masks: dict[int, torch.Tensor] = {}  # token_mask's, per block width, for the current batch
        self._token_slots: torch.Tensor | None = None  # token_slots', for the current batch
        self._groups: list[tuple[int, slice | torch.Tensor]] = []  # torch backend: (slot, token rows)
        self._num_segments, self._max_seg_len = 0, 0
        # triton backend: one int32 device buffer holding the segment starts [capacity + 1], their slots
        # [capacity] and a decode's token rows by slot [capacity] (see _write_decode); views into it
        self._seg_buf = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._seg_start, self._seg_slot, self._tok = self._seg_buf, self._seg_buf[:0], self._seg_buf[:0]
        self._tok_index: torch.Tensor | None = None  # the current batch's positions -> token rows (None: identity)
        self._row_slots: list[int] | None = None

    @property
    def active(self) -> bool:
        """Whether the current batch uses any adapter (layers that bypass ``Linear.forward``,
        such as the CPU's fused decoder-layer ops, must step aside while it does)."""
        return self._active

    def check(self, adapter: LoRAAdapter) -> None:
        """Raise :class:`LoRAError` unless ``adapter`` fits this pool: rank, target modules, shapes."""
        name = adapter.name
        if adapter.rank > self.max_rank:
            raise LoRAError(f"LoRA adapter {name!r} has rank {adapter.rank}, above the server's max LoRA rank "
                            f"{self.max_rank}; restart with --max-lora-rank {adapter.rank} or more")
        for (module, shard), (a, b) in adapter.weights.items():
            layer = self._linears.get(module)
            if layer is None:
                raise LoRAError(f"LoRA adapter {name!r} adapts {module!r}, which this model does not have; "
                                f"was it trained for another base model ({adapter.base_model})?")
            state = self.layers.get(module)
            if state is None or shard not in state.shards:
                what = module if shard is None else f"{module} (part {shard})"
                raise LoRAError(f"LoRA adapter {name!r} adapts {what}, which is not among the server's LoRA "
                                f"target modules ({', '.join(self.target_names)}); restart with --lora-target-modules all")
            want_in, want_out = _expected(layer, shard)
            if a.shape[1] != want_in or b.shape[0] != want_out:
                raise LoRAError(f"LoRA adapter {name!r}: {module} expects lora_A [r, {want_in}] and lora_B "
                                f"[{want_out}, r], got {tuple(a.shape)} and {tuple(b.shape)}; was it trained for "
                                f"another base model ({adapter.base_model})?")

    def slot_of(self, name: str) -> int | None:
        """The slot holding adapter ``name``, or None."""
        return self._names.index(name) if name in self._names else None

    def name_in(self, slot: int) -> str | None:
        """The adapter ``slot`` holds, or None when it is empty."""
        return self._names[slot]

    def load(self, adapter: LoRAAdapter, slot: int) -> None:
        """Copy ``adapter`` into ``slot`` (replacing what it held): ranks zero-padded to the max,
        ``scaling`` folded into B, the layers it does not adapt zeroed."""
        if not 0 <= slot < self.slots:
            raise LoRAError(f"LoRA slot {slot} is out of range (the pool has {self.slots})")
        self.check(adapter)
        self._names[slot] = None
        for state in self.layers.values():
            state.clear(slot)
        for (module, shard), (a, b) in adapter.weights.items():
            state = self.layers[module]
            a, b = _local(state.layer, shard, a, b * adapter.scaling)
            state.copy(slot, shard, a, b)
        self._names[slot] = adapter.name

    def free(self, slot: int) -> None:
        """Forget what ``slot`` holds (its adapter was removed): ``slot_of`` no longer finds it."""
        self._names[slot] = None

    def set_batch(self, seg_lens: list[int], seg_slots: list[int]) -> None:
        """The next forward's tokens: consecutive segments of ``seg_lens[i]`` tokens, each using
        slot ``seg_slots[i]`` (-1: the base model). Tokens past the segments are left alone."""
        if len(seg_lens) != len(seg_slots):
            raise ValueError(f"set_batch: {len(seg_lens)} segment lengths for {len(seg_slots)} slots")
        if any(not -1 <= s < self.slots for s in seg_slots):
            raise ValueError(f"set_batch: slots {seg_slots} out of range [-1, {self.slots})")
        if all(s < 0 for s in seg_slots):
            return self.clear_batch()
        if self.backend == "triton":
            self._set_segments(seg_lens, seg_slots)
        else:
            self._groups = self._token_groups(seg_lens, seg_slots)
            self._masks = {}
            self._token_slots = None
        self._active = True

    def clear_batch(self) -> None:
        """The next forward uses no adapter: every layer skips LoRA."""
        self._active = False
        self._groups = []
        self._masks = {}
        self._token_slots = None

    def token_mask(self, width: int, tokens: int) -> torch.Tensor:
        """``[T, slots * width]``: 1 in each token's own slot's ``width`` columns, else 0 (base
        tokens all 0); made once per forward and block width (LayerLoRA's small-batch path)."""
        mask = self._masks.get(width)
        if mask is None:
            slot_of = self.token_slots(tokens)
            cols = torch.arange(self.slots * width, dtype=torch.int32) // width
            mask = self._masks[width] = (cols[None, :] == slot_of[:, None]).to(self._dtype).to(self.device)
        return mask

    def token_slots(self, tokens: int) -> torch.Tensor:
        """int32 ``[T]`` on the host: each token's slot (-1: the base model), what the CPU's fused
        decode ops (``kernels/cpu_decode``) read instead of masks; made once per forward (torch backend)."""
        slots = self._token_slots
        if slots is None or slots.shape[0] != tokens:
            rows = [-1] * tokens
            for s, r in self._groups:
                for t in range(tokens)[r] if isinstance(r, slice) else r.tolist():
                    rows[t] = s
            slots = self._token_slots = torch.tensor(rows, dtype=torch.int32)
        return slots

    def _token_groups(self, seg_lens: list[int], seg_slots: list[int]) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, token rows) per distinct slot in use: a slice where its tokens are one run."""
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for n, s in zip(seg_lens, seg_slots):
            if s >= 0 and n > 0:
                spans = runs.setdefault(s, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for s, spans in runs.items():
            if len(spans) == 1:
                groups.append((s, slice(*spans[0])))
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.device)
                groups.append((s, rows))
        return groups

    def _set_segments(self, seg_lens: list[int], seg_slots: list[int]) -> None:
        """Write the segments into the persistent device buffers (grown, rarely, when too small).
        A decode (one token per request) is grouped by slot, as a graph replay is."""
        n = len(seg_lens)
        if self._seg_slot.shape[0] < n:  # (never once graphs are captured: reserve_segments sized them)
            self.reserve_segments(max(256, 2 * n))
        self._row_slots = seg_slots if all(ln == 1 for ln in seg_lens) else None  # (graph_segments: a decode's rows)
        if self._row_slots is not None:
            self._num_segments, self._max_seg_len = self._write_decode(seg_slots, None)
            return
        self._max_seg_len = max(seg_lens, default=0)
        starts = [0]
        for length in seg_lens:
            starts.append(starts[-1] + length)
        cap = self._seg_slot.shape[0]
        self._seg_buf[: cap + 1 + n].copy_(self._host(starts + [0] * (cap - n) + seg_slots), non_blocking=True)
        self._num_segments, self._tok_index = n, None

    # ---- decodes grouped by slot: the rows of one adapter make one segment (chunks of at most GROUP
    # rows, one 16-row kernel tile), gathered through a token index, so the kernels read each adapter's
    # matrices once per layer instead of once per request; rows without an adapter are in no segment
    GROUP = 16

    def graph_capacity(self, bs: int) -> int:
        """Segments a ``bs``-row decode graph holds: the slot groups of any ``bs`` rows fit (each slot
        in use adds at most one chunk beyond ``bs // GROUP`` full ones)."""
        return min(bs, self.slots + bs // self.GROUP)

    def _write_decode(self, row_slots: list[int], capacity: int | None) -> tuple[int, int]:
        """Write a decode's slot groups (``capacity`` segments, the last ones empty; None: as
        many as there are) in one copy; returns (segment count, longest segment)."""
        order = sorted((s, t) for t, s in enumerate(row_slots) if s >= 0)
        starts: list[int] = []
        slots: list[int] = []
        for i, (s, _) in enumerate(order):
            if not slots or slots[-1] != s or i - starts[-1] == self.GROUP:
                starts.append(i)
                slots.append(s)
        m = len(slots) if capacity is None else capacity
        if len(slots) > m:  # (graph_capacity's bound makes this impossible)
            raise RuntimeError(f"LoRA decode: {len(slots)} slot groups for a graph of {m} segments")
        starts += [len(order)] * (m + 1 - len(slots))
        cap = self._seg_slot.shape[0]
        host = starts + [0] * (cap - m) + slots + [-1] * (m - len(slots)) + [0] * (cap - m) + [t for _, t in order]
        self._seg_buf[: len(host)].copy_(self._host(host), non_blocking=True)
        self._tok_index = self._tok
        return m, min(self.GROUP, len(row_slots))

    def _host(self, values: list[int]) -> torch.Tensor:
        """``values`` as int32 on the host; pinned on a GPU, so that the copy does not wait for the
        stream (a pageable source may synchronise with it, stalling an overlapped launch)."""
        return torch.tensor(values, dtype=torch.int32, pin_memory=self.device.type == "cuda")

    # ---- CUDA graphs (triton backend): a decode graph of ``bs`` rows has ``graph_capacity(bs)``
    # segments of up to GROUP rows baked in; ``capturing`` records it with every segment empty (the
    # kernels then exit at once), ``graph_segments`` writes the real rows' groups into the same buffers
    def reserve_segments(self, n: int) -> None:
        """Size the segment buffers for up to ``n`` segments now: a captured graph keeps their
        addresses, so they must never be reallocated afterwards."""
        if self._seg_slot.shape[0] < n:
            self._seg_buf = torch.zeros(3 * n + 1, dtype=torch.int32, device=self.device)
            self._seg_start, self._seg_slot, self._tok = self._seg_buf[: n + 1], self._seg_buf[n + 1 : 2 * n + 1], \
                self._seg_buf[2 * n + 1 :]

    @contextlib.contextmanager
    def capturing(self, bs: int):
        """While a decode graph of ``bs`` rows is recorded: the layers launch the kernels over the
        graph's ``graph_capacity(bs)`` segments, all empty."""
        self.graph_segments(0, bs)
        self._active, self._num_segments, self._max_seg_len = True, self.graph_capacity(bs), min(self.GROUP, bs)
        try:
            yield
        finally:
            self.clear_batch()

    def graph_segments(self, n: int, bs: int) -> None:
        """Before replaying a ``bs``-row decode graph for ``n`` real rows: the rows' slot groups as
        the last ``set_batch`` gave them (none when it cleared); padding rows are in no segment."""
        slots = (self._row_slots if self._active and self._row_slots is not None else [])[:n]
        self._write_decode(slots, self.graph_capacity(bs))
