"""The attention-backend suite: a backend against ``torch_native`` on the same paged KV pool.

Each case builds sequences whose earlier tokens are already in the pool (a prefix hit, or
what previous steps wrote), then runs one or more steps through both backends: ``prepare``
once per step, ``forward`` for two layers (so per-layer pool indexing is exercised). After
every layer the outputs must agree within :data:`TOLERANCES` for the backend's dtype (the
reference computes in float32 from the same rounded inputs), and after every step the K/V
the backend wrote must equal the reference's, slot for slot, with nothing else in the pool
changed. Later steps read what the backend itself wrote earlier.

CUDA-graph capture and replay run only on a GPU, and only for a backend with the capture hooks
of plugin API 1.1 (``init_cuda_graph``, ``prepare_capture``, ``prepare_replay``), driven as
core's graph runner drives them; otherwise that case is skipped with the reason.

The ``tree_mask`` case runs only for a backend declaring ``supports_tree_mask`` (plugin API 1.4):
a verify batch of draft trees (random trees, a chain and a one-token sequence over cached
prefixes) against attention computed here from the definition, then tree masks that are the
causal lower triangle against the backend's own causal forward.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from core.errors import CoreError
from core.interfaces import AttentionConfig, AttentionLayerSpec, ForwardBatch
from core.testing.paged import (
    PagedPool, Seq, ancestor_mask, batch_tensors, chain_parents, make_batch, make_tree_batch, random_parents,
)
from core.testing.suite import (
    Case, Skipped, assert_close, default_device, fail, reference, resolve_target, seed_for,
)

KIND = "attention_backend"

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # dtype -> (atol, rtol) of the backend's output against the float32 reference
    torch.float32: (2e-4, 2e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@attrs.define(frozen=True)
class AttentionCase:
    """``cached[i]`` tokens of sequence ``i`` are in the pool before the first step; each step
    adds ``steps[k][i]`` new tokens to sequence ``i`` (0: not in that batch)."""

    name: str
    cached: tuple[int, ...]
    steps: tuple[tuple[int, ...], ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 4
    sliding_window: int | None = None
    logit_cap: float = 0.0
    doc: str = ""


ATTENTION_CASES: tuple[AttentionCase, ...] = (
    AttentionCase("decode", (5, 17, 33), ((1, 1, 1),) * 3, doc="three decode steps over cached prefixes"),
    AttentionCase("decode_long", (300, 2), ((1, 1),) * 2, doc="a long cached sequence beside a short one"),
    AttentionCase("prefill", (0, 0), ((7, 19),), doc="fresh prompts of different lengths"),
    AttentionCase("prefill_one_token", (0,), ((1,),), doc="a one-token prompt"),
    AttentionCase("prefix_hit", (8, 20), ((5, 3),), doc="extends after a cached prefix (a radix hit)"),
    AttentionCase("chunked_prefill", (0,), ((6,), (6,), (5,), (1,)), doc="one prompt in chunks, then a decode"),
    AttentionCase("mixed", (12, 0, 6), ((1, 9, 4), (1, 1, 1), (0, 2, 1)),
                  doc="decode, prefill and extend in one batch; then a batch without one sequence"),
    AttentionCase("sliding_window_prefill", (0, 10), ((13, 6),), sliding_window=4, doc="window 4, prompts past it"),
    AttentionCase("sliding_window_decode", (9, 23), ((1, 1),) * 2, sliding_window=4, doc="window 4 while decoding"),
    AttentionCase("soft_cap", (7, 0), ((1, 11), (1, 1)), logit_cap=2.0, doc="tanh soft-capping of large scores"),
    AttentionCase("mha", (6, 0), ((1, 7),), num_heads=4, num_kv_heads=4, doc="as many KV heads as query heads"),
    AttentionCase("gqa_4", (6, 0), ((1, 7), (1, 1)), num_heads=8, num_kv_heads=2, doc="4 query heads per KV head"),
    AttentionCase("mqa", (6, 0), ((1, 7), (1, 1)), num_heads=4, num_kv_heads=1, doc="one KV head"),
    AttentionCase("head_dim_128", (6, 0), ((1, 7),), head_dim=128),
    AttentionCase("page_size_1", (6, 0, 3), ((1, 7, 2), (1, 1, 1)), page_size=1),
    AttentionCase("page_size_16", (20, 0, 3), ((1, 18, 14), (1, 1, 1)), page_size=16),
)


@attrs.define
class AttentionSubject:
    """A backend under test: its factory, and the device and dtype the suite runs in."""

    factory: Any
    label: str
    device: torch.device
    dtype: torch.dtype
    kind: str = KIND

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None, device: Any = None, dtype: Any = None) -> AttentionSubject:
        factory, label = resolve_target(KIND, target, plugins)
        device = torch.device(device) if device is not None else default_device()
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        return cls(factory, label, device, dtype)


def _reference(config: AttentionConfig) -> Any:
    return reference("attention_backend", "torch_native")(config)


def _construct(s: AttentionSubject, config: AttentionConfig) -> Any:
    """The backend for ``config``; a CoreError here is the backend refusing this device or dtype."""
    try:
        return s.factory(config)
    except CoreError as e:
        raise Skipped(f"the backend refuses {config.device} / {config.dtype}: {e}") from None


def _layers(c: AttentionCase, scaling: float) -> list[AttentionLayerSpec]:
    return [AttentionLayerSpec(i, c.num_heads, c.num_kv_heads, c.head_dim, scaling, c.sliding_window, c.logit_cap)
            for i in range(2)]


def _setup(s: AttentionSubject, c: AttentionCase) -> tuple[PagedPool, list[Seq], torch.Generator]:
    gen = torch.Generator().manual_seed(seed_for(KIND, c.name))
    total = [n + sum(step[i] for step in c.steps) for i, n in enumerate(c.cached)]
    pages = sum(-(-t // c.page_size) for t in total) + 4
    pool = PagedPool(2, c.num_kv_heads, c.head_dim, s.dtype, s.device, c.page_size, pages, seed_for(c.name))
    seqs = [Seq() for _ in c.cached]
    for seq, n in zip(seqs, c.cached):  # the cached prefix: K/V written straight into the pool
        slots = torch.tensor(pool.grow(seq, n), dtype=torch.int64)
        for buf in (*pool.kv.k, *pool.kv.v):
            buf[slots.to(s.device)] = _randn((n, c.num_kv_heads, c.head_dim), gen).to(s.device, s.dtype)
    return pool, seqs, gen


def _randn(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def check_case(s: AttentionSubject, c: AttentionCase) -> None:
    """Run ``c`` through the backend and the reference; raise naming the case on a disagreement."""
    if s.device.type == "cuda" and not torch.cuda.is_available():
        raise Skipped("no CUDA device")
    atol, rtol = TOLERANCES.get(s.dtype, TOLERANCES[torch.bfloat16])
    pool, seqs, gen = _setup(s, c)
    ref_kv = pool.clone(torch.float32)
    cfg = lambda kv, dt: AttentionConfig(2, c.num_heads, c.num_kv_heads, c.head_dim, dt, s.device, kv)  # noqa: E731
    backend = _construct(s, cfg(pool.kv, s.dtype))
    ref = _reference(cfg(ref_kv, torch.float32))
    # large q makes soft-capping bite (scores well past the cap) and softmax peaked
    q_scale = 6.0 if c.logit_cap else 1.0
    layers = _layers(c, c.head_dim ** -0.5)
    for k, step in enumerate(c.steps):
        where = f"step {k + 1} of {len(c.steps)} (new tokens {list(step)})"
        live = [i for i, n in enumerate(step) if n]
        for i in live:
            pool.grow(seqs[i], step[i])
        batch_seqs, new = [seqs[i] for i in live], [step[i] for i in live]
        mine, theirs = make_batch(batch_seqs, new, backend, s.device), make_batch(batch_seqs, new, ref, s.device)
        before = batch_tensors(mine)
        backend.prepare(mine)
        ref.prepare(theirs)
        for name, t in before.items():
            if not torch.equal(getattr(mine, name), t):
                raise fail(s, c.name, f"{where}: prepare() changed batch.{name}")
        t = sum(new)
        for layer in layers:
            q = _randn((t, c.num_heads, c.head_dim), gen, q_scale).to(s.device, s.dtype)
            kk = _randn((t, c.num_kv_heads, c.head_dim), gen).to(s.device, s.dtype)
            v = _randn((t, c.num_kv_heads, c.head_dim), gen).to(s.device, s.dtype)
            out = backend.forward(q, kk, v, layer, mine)
            want = ref.forward(q.float(), kk.float(), v.float(), layer, theirs)
            if out.dtype != q.dtype:
                raise fail(s, c.name, f"{where} layer {layer.layer_id}: output dtype {out.dtype}, expected {q.dtype}")
            assert_close(s, c.name, f"{where} layer {layer.layer_id} output", out, want, atol, rtol)
        for l in range(2):
            for part, got, exp in (("K", pool.kv.k[l], ref_kv.k[l]), ("V", pool.kv.v[l], ref_kv.v[l])):
                if not torch.equal(got.float(), exp):
                    bad = torch.nonzero((got.float() != exp).flatten(1).any(1)).flatten()[:5].tolist()
                    raise fail(s, c.name, f"{where}: the {part} pool of layer {l} differs from the reference at "
                                          f"slots {bad} (new tokens go to batch.out_cache_loc, nothing else changes)")


GRAPH_HOOKS = ("init_cuda_graph", "prepare_capture", "prepare_replay")  # core.interfaces.CudaGraphBackend


def _padded(batch: ForwardBatch, bs: int) -> ForwardBatch:
    """``batch`` plus padding rows up to ``bs``, as core replays a graph: token 0 at position 0,
    KV length 1, reading and writing slot 0 (the padding slot)."""
    n, dev = batch.batch_size, batch.input_ids.device
    pad = lambda t, value=0: torch.cat([t, torch.full((bs - n,), value, dtype=t.dtype, device=dev)])  # noqa: E731
    return ForwardBatch(input_ids=pad(batch.input_ids), positions=pad(batch.positions),
                        out_cache_loc=pad(batch.out_cache_loc), seq_lens=pad(batch.seq_lens, 1),
                        extend_lens=pad(batch.extend_lens, 1),
                        kv_indices=torch.nn.functional.pad(batch.kv_indices, (0, 0, 0, bs - n)),
                        seq_lens_cpu=batch.seq_lens_cpu + [1] * (bs - n), extend_lens_cpu=[1] * bs,
                        attn_backend=batch.attn_backend)


def check_cuda_graph(s: AttentionSubject) -> None:
    """The capture hooks of plugin API 1.1, driven as core's CUDA-graph runner drives them: a
    graph of batch size 4 captured over static buffers, replayed for 3 real sequences and one
    padding row over two decode steps; the real rows and their K/V equal the eager reference."""
    if not all(callable(getattr(s.factory, h, None)) for h in GRAPH_HOOKS):
        raise Skipped(f"the backend does not define the CUDA-graph capture hooks ({', '.join(GRAPH_HOOKS)})")
    if s.device.type != "cuda" or not torch.cuda.is_available():
        raise Skipped("CUDA-graph capture needs a CUDA device")
    c, bs = AttentionCase("cuda_graph", (5, 17, 33), ((1, 1, 1),) * 2), 4
    pool, seqs, gen = _setup(s, c)
    ref_kv = pool.clone(torch.float32)
    cfg = lambda kv, dt: AttentionConfig(2, c.num_heads, c.num_kv_heads, c.head_dim, dt, s.device, kv)  # noqa: E731
    backend, ref = _construct(s, cfg(pool.kv, s.dtype)), _reference(cfg(ref_kv, torch.float32))
    layers = _layers(c, c.head_dim ** -0.5)
    backend.init_cuda_graph(bs, 64)
    zeros = lambda: torch.zeros(bs, dtype=torch.int64, device=s.device)  # noqa: E731
    static = ForwardBatch(input_ids=zeros(), positions=zeros(), out_cache_loc=zeros(), seq_lens=zeros() + 1,
                          extend_lens=zeros() + 1, kv_indices=torch.zeros(bs, 1, dtype=torch.int64, device=s.device),
                          seq_lens_cpu=[1] * bs, extend_lens_cpu=[1] * bs, attn_backend=backend)
    backend.prepare_capture(bs, static)
    qkv = [[torch.zeros(bs, h, c.head_dim, device=s.device, dtype=s.dtype) for h in (c.num_heads, c.num_kv_heads,
                                                                                    c.num_kv_heads)] for _ in layers]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as capture requires
        for (q, k, v), layer in zip(qkv, layers):
            backend.forward(q, k, v, layer, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.forward(q, k, v, layer, static) for (q, k, v), layer in zip(qkv, layers)]
    atol, rtol = TOLERANCES.get(s.dtype, TOLERANCES[torch.bfloat16])
    for k, step in enumerate(c.steps):
        for seq in seqs:
            pool.grow(seq, 1)
        real = make_batch(seqs, list(step), backend, s.device)
        padded = _padded(real, bs)
        for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "extend_lens"):
            getattr(static, name).copy_(getattr(padded, name))
        backend.prepare_replay(bs, padded)
        values = [[_randn(tuple(t.shape), gen).to(s.device, s.dtype) for t in bufs] for bufs in qkv]
        for bufs, vals in zip(qkv, values):
            for buf, val in zip(bufs, vals):
                buf.copy_(val)
        graph.replay()
        torch.cuda.synchronize()
        theirs = make_batch(seqs, list(step), ref, s.device)
        ref.prepare(theirs)
        for out, (q, kk, v), layer in zip(outs, values, layers):
            want = ref.forward(q[:3].float(), kk[:3].float(), v[:3].float(), layer, theirs)
            assert_close(s, "cuda_graph", f"replay {k + 1} layer {layer.layer_id} output", out[:3], want, atol, rtol)
        for l in range(2):  # slot 0 excepted: the padding row writes there
            for part, got, exp in (("K", pool.kv.k[l], ref_kv.k[l]), ("V", pool.kv.v[l], ref_kv.v[l])):
                if not torch.equal(got[1:].float(), exp[1:]):
                    raise fail(s, "cuda_graph", f"replay {k + 1}: the {part} pool of layer {l} differs from the reference")


def _tree_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: Any, layer: AttentionLayerSpec,
                    seqs: list[Seq], parents: list[list[int]]) -> torch.Tensor:
    """float32 attention from the definition: node i of a sequence (``n`` new tokens after ``P``
    cached ones, the cached K/V in ``kv``) sees all ``P`` cached keys and the new keys of itself
    and its ancestors."""
    group = layer.num_heads // layer.num_kv_heads
    out, start = [], 0
    for seq, par in zip(seqs, parents):
        n = len(par)
        prefix = torch.tensor(seq.slots[: seq.length - n], dtype=torch.int64, device=q.device)
        keys = torch.cat([kv.k[layer.layer_id][prefix].float(), k[start:start + n].float()])  # [P + n, Hkv, D]
        vals = torch.cat([kv.v[layer.layer_id][prefix].float(), v[start:start + n].float()])
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", q[start:start + n].float(), keys) * layer.scaling
        if layer.logit_cap:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        sees = torch.cat([torch.ones(n, len(prefix), dtype=torch.bool), ancestor_mask(par)], 1).to(q.device)
        scores = scores.masked_fill(~sees[None], float("-inf"))
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vals))
        start += n
    return torch.cat(out)


def check_tree_mask(s: AttentionSubject) -> None:
    """Plugin API 1.4: a verify of draft trees (``ForwardBatch.tree_mask``). One batch mixes two
    random trees (each node's parent drawn among the nodes before it, so positions, the depths,
    repeat and are no guide to who sees whom), a chain and a one-token sequence over cached
    prefixes of different lengths, GQA, one layer soft-capped; its outputs must equal attention
    computed from the definition and its K/V land at ``out_cache_loc``. Then causal lower
    triangles as tree masks (mixed lengths, and one token per sequence) must give the backend's
    own causal forward."""
    if not getattr(s.factory, "supports_tree_mask", False):
        raise Skipped("the backend does not declare supports_tree_mask (plugin API 1.4): core never hands it a tree")
    if s.device.type == "cuda" and not torch.cuda.is_available():
        raise Skipped("no CUDA device")
    name = "tree_mask"
    atol, rtol = TOLERANCES.get(s.dtype, TOLERANCES[torch.bfloat16])
    # steps: the tree verify, then two causal-equivalence steps (chains of mixed lengths; one token each)
    c = AttentionCase(name, (9, 14, 5, 2), ((7, 4, 1, 5), (3, 1, 6, 2), (1, 1, 1, 1)), num_heads=8, num_kv_heads=2)
    pool, seqs, gen = _setup(s, c)
    ref_kv = pool.clone(torch.float32)
    cfg = lambda kv, dt: AttentionConfig(2, c.num_heads, c.num_kv_heads, c.head_dim, dt, s.device, kv)  # noqa: E731
    backend = _construct(s, cfg(pool.kv, s.dtype))
    layers = [AttentionLayerSpec(0, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5),
              AttentionLayerSpec(1, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5, logit_cap=5.0)]
    qkv = lambda t, layer: (  # noqa: E731
        _randn((t, c.num_heads, c.head_dim), gen, 4.0 if layer.logit_cap else 1.0).to(s.device, s.dtype),
        _randn((t, c.num_kv_heads, c.head_dim), gen).to(s.device, s.dtype),
        _randn((t, c.num_kv_heads, c.head_dim), gen).to(s.device, s.dtype))

    # 1) trees against the definition
    parents = [random_parents(7, gen), chain_parents(4), [-1], random_parents(5, gen)]
    for seq, par in zip(seqs, parents):
        pool.grow(seq, len(par))
    batch = make_tree_batch(seqs, parents, backend, s.device)
    before = {**batch_tensors(batch), "tree_mask": batch.tree_mask.clone()}
    backend.prepare(batch)
    for field, t in before.items():
        if not torch.equal(getattr(batch, field), t):
            raise fail(s, name, f"tree verify: prepare() changed batch.{field}")
    t = sum(len(p) for p in parents)
    for layer in layers:
        q, kk, v = qkv(t, layer)
        out = backend.forward(q, kk, v, layer, batch)
        want = _tree_reference(q, kk, v, ref_kv, layer, seqs, parents)
        if out.dtype != q.dtype:
            raise fail(s, name, f"tree verify layer {layer.layer_id}: output dtype {out.dtype}, expected {q.dtype}")
        assert_close(s, name, f"tree verify (parents {parents}) layer {layer.layer_id} output", out, want, atol, rtol)
        for buf, x in ((ref_kv.k[layer.layer_id], kk), (ref_kv.v[layer.layer_id], v)):
            buf[batch.out_cache_loc] = x.float()
    for l in range(2):
        for part, got, exp in (("K", pool.kv.k[l], ref_kv.k[l]), ("V", pool.kv.v[l], ref_kv.v[l])):
            if not torch.equal(got.float(), exp):
                raise fail(s, name, f"tree verify: the {part} pool of layer {l} differs from the reference "
                                    "(new tokens go to batch.out_cache_loc, nothing else changes)")

    # 2) causal lower triangles as tree masks: the backend's own causal forward
    for step in c.steps[1:]:
        chains = [chain_parents(n) for n in step]
        for seq, n in zip(seqs, step):
            pool.grow(seq, n)
        tree, causal = make_tree_batch(seqs, chains, backend, s.device), make_batch(seqs, list(step), backend, s.device)
        if not torch.equal(tree.positions, causal.positions):
            raise fail(s, name, "the suite's chain positions differ from a causal batch's")  # (the suite's own check)
        backend.prepare(causal)
        backend.prepare(tree)
        for layer in layers:
            q, kk, v = qkv(sum(step), layer)
            want = backend.forward(q, kk, v, layer, causal)
            got = backend.forward(q, kk, v, layer, tree)
            assert_close(s, name, f"lower-triangle tree masks (new tokens {list(step)}) layer {layer.layer_id}: "
                                  "against the causal forward", got, want, atol, rtol)


def attention_cases() -> list[Case]:
    """Every case of the suite, in order; ``run(subject)`` takes an :class:`AttentionSubject`."""
    cases = [Case(c.name, lambda s, c=c: check_case(s, c), c.doc) for c in ATTENTION_CASES]
    cases.append(Case("cuda_graph", check_cuda_graph, "capture/replay through the plugin API 1.1 hooks, on a GPU"))
    cases.append(Case("tree_mask", check_tree_mask, "draft-tree verify batches (plugin API 1.4 supports_tree_mask)"))
    return cases
