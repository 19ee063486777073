"""Draft-tree masks (plugin API 1.4, ``ForwardBatch.tree_mask``): torch_native against attention
written out from the definition, the cpu and triton backends (triton's interpreter without a GPU)
through the kit's ``tree_mask`` case and beyond it (trees across several tiles of the Triton
kernel), broken backends caught by the kit, the Llama model's CPU one-op paths stepping aside for
a tree, and the property the engine relies on: a tree verify's logits at each node are those of a
causal forward of the node's root-to-node path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from core.interfaces import AttentionConfig, AttentionLayerSpec  # noqa: E402
from core.testing import check_plugin  # noqa: E402
from core.testing.paged import (  # noqa: E402
    PagedPool, Seq, ancestor_mask, chain_parents, make_batch, make_tree_batch, random_parents,
)
from core_kernels import cpp_build, cpu_decode  # noqa: E402
from core_plugins.attention.torch_native import TorchNativeBackend  # noqa: E402

CPU = torch.device("cpu")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
try:
    import triton as _triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="needs the triton package")
needs_cpu_kernel = pytest.mark.skipif(bool(cpp_build.toolchain_problem()), reason="the cpu attention kernel cannot be built here")
needs_cpu_ops = pytest.mark.skipif(not cpu_decode.available(), reason="needs the C++ CPU kernels (one-op layers)")


def cpu_backend(config: AttentionConfig) -> Any:
    from core_plugins.attention.cpu import CpuBackend

    return CpuBackend(config)


def triton_backend(config: AttentionConfig) -> Any:
    from core_plugins.attention.triton import TritonBackend

    return TritonBackend(config)


# --------------------------------------------------------------------------- torch_native: the definition


def naive_tree_attention(q, k, v, pool, seqs, parents, layer):
    """Node by node, head by head: softmax over the cached keys and the node's own and its
    ancestors' keys (read from the pool, where the forward wrote them)."""
    kc, vc = pool.k[layer.layer_id], pool.v[layer.layer_id]
    group = layer.num_heads // layer.num_kv_heads
    out = torch.zeros_like(q)
    start = 0
    for seq, par in zip(seqs, parents):
        n = len(par)
        cached = seq.length - n
        for i in range(n):
            seen = list(range(cached))
            node = i
            while node != -1:  # the node, then up its ancestors
                seen.append(cached + node)
                node = par[node]
            slots = [seq.slots[j] for j in sorted(seen)]
            for h in range(layer.num_heads):
                s = (kc[slots, h // group] @ q[start + i, h]) * layer.scaling
                if layer.logit_cap:
                    s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
                out[start + i, h] = torch.softmax(s, 0) @ vc[slots, h // group]
        start += n
    return out


@pytest.mark.parametrize("cap", [0.0, 3.0], ids=["plain", "soft_cap"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_torch_native_matches_the_definition(cap, page_size):
    gen = torch.Generator().manual_seed(1)
    h, hkv, d = 6, 2, 16
    cached = [5, 0, 12, 3]
    parents = [random_parents(9, gen), chain_parents(3), [-1], [-1, 0, 0, 1, -1, 4]]  # the last: a forest
    pool = PagedPool(1, hkv, d, torch.float32, CPU, page_size, 80 // page_size + 4, seed=3)
    backend = TorchNativeBackend(AttentionConfig(1, h, hkv, d, torch.float32, CPU, pool.kv))
    layer = AttentionLayerSpec(0, h, hkv, d, d**-0.5, logit_cap=cap)
    seqs = [Seq() for _ in cached]
    for seq, n in zip(seqs, cached):
        slots = pool.grow(seq, n)
        pool.kv.k[0][slots] = torch.randn(n, hkv, d, generator=gen)
        pool.kv.v[0][slots] = torch.randn(n, hkv, d, generator=gen)
    for seq, par in zip(seqs, parents):
        pool.grow(seq, len(par))
    batch = make_tree_batch(seqs, parents, backend, CPU)
    t = sum(len(p) for p in parents)
    q = torch.randn(t, h, d, generator=gen) * (4 if cap else 1)
    k, v = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    backend.prepare(batch)
    out = backend.forward(q, k, v, layer, batch)
    torch.testing.assert_close(out, naive_tree_attention(q, k, v, pool.kv, seqs, parents, layer), atol=1e-5, rtol=1e-5)
    # positions are depths: a tree's nodes share them, so nothing may be read from them
    assert len(set(batch.positions[:9].tolist())) < 9


def test_the_suite_helpers_build_ancestor_masks():
    assert ancestor_mask(chain_parents(4)).equal(torch.ones(4, 4, dtype=torch.bool).tril())
    m = ancestor_mask([-1, 0, 0, 1, 2])
    assert m.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    with pytest.raises(ValueError, match="precede"):
        ancestor_mask([-1, 2, 0])


# --------------------------------------------------------------------------- the kit's case, per backend


def _tree_case(target, dtype):
    (r,) = check_plugin(target, "attention_backend", cases=["tree_mask"], device="cpu", dtype=dtype)
    return r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_native_passes_the_tree_case(dtype):
    r = _tree_case("torch_native", dtype)
    assert r.status == "passed", r.message


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_passes_the_tree_case(dtype):
    r = _tree_case("cpu", dtype)
    assert r.status == "passed", r.message


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_passes_the_tree_case(dtype):
    (r,) = check_plugin("triton", "attention_backend", cases=["tree_mask"], device=DEV.type, dtype=dtype)
    assert r.status == "passed", r.message


class IgnoresTheTree(TorchNativeBackend):
    """Declares tree masks but attends causally by batch order."""

    def prepare(self, batch):
        tree, batch.tree_mask = batch.tree_mask, None
        try:
            super().prepare(batch)
        finally:
            batch.tree_mask = tree


class NoTrees(TorchNativeBackend):
    supports_tree_mask = False


def test_the_tree_case_catches_a_backend_ignoring_the_mask_and_skips_one_without_trees():
    r = _tree_case(IgnoresTheTree, torch.float32)
    assert r.status == "failed" and "case 'tree_mask': tree verify" in r.message and "layer 0 output" in r.message
    r = _tree_case(NoTrees, torch.float32)
    assert r.status == "skipped" and "supports_tree_mask" in r.message


def test_flashinfer_declares_no_tree_support():
    """Not yet: core never hands it a tree (its prefill plans are causal)."""
    from core_plugins.attention.flashinfer import FlashInferBackend

    assert not getattr(FlashInferBackend, "supports_tree_mask", False)


# --------------------------------------------------------------------------- cpu and triton against torch_native


def _both(make, h, hkv, d, page_size, cached, parents, dtype, cap=0.0, seed=0):
    """Run one tree verify (two layers) through ``make``'s backend and torch_native on equal pools;
    returns (outputs, reference outputs) per layer."""
    gen = torch.Generator().manual_seed(seed)
    total = [c + len(p) for c, p in zip(cached, parents)]
    pages = sum(-(-n // page_size) for n in total) + 2
    pools = [PagedPool(2, hkv, d, dt, DEV, page_size, pages, seed=5) for dt in (dtype, torch.float32)]
    seqs = [[Seq() for _ in cached] for _ in pools]
    for i, n in enumerate(cached):
        vals = [torch.randn(n, hkv, d, generator=gen) for _ in range(4)]
        for pool, ss in zip(pools, seqs):
            slots = torch.tensor(pool.grow(ss[i], n), dtype=torch.int64)
            for buf, x in zip((*pool.kv.k, *pool.kv.v), vals):
                buf[slots.to(DEV)] = x.to(dtype).to(DEV, buf.dtype)  # the same rounded values in both
    cfg = lambda pool, dt: AttentionConfig(2, h, hkv, d, dt, DEV, pool.kv)  # noqa: E731
    mine, ref = make(cfg(pools[0], dtype)), TorchNativeBackend(cfg(pools[1], torch.float32))
    batches = []
    for backend, pool, ss in zip((mine, ref), pools, seqs):
        for seq, par in zip(ss, parents):
            pool.grow(seq, len(par))
        batches.append(make_tree_batch(ss, parents, backend, DEV))
        backend.prepare(batches[-1])
    t = sum(len(p) for p in parents)
    got, want = [], []
    for layer in range(2):
        spec = AttentionLayerSpec(layer, h, hkv, d, d**-0.5, logit_cap=cap)
        q = (torch.randn(t, h, d, generator=gen) * (4 if cap else 1)).to(DEV, dtype)
        k, v = (torch.randn(t, hkv, d, generator=gen).to(DEV, dtype) for _ in range(2))
        got.append(mine.forward(q, k, v, spec, batches[0]))
        want.append(ref.forward(q.float(), k.float(), v.float(), spec, batches[1]))
    for layer in range(2):
        assert torch.equal(pools[0].kv.k[layer].float(), pools[1].kv.k[layer])
    return got, want


TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_trees_equal_torch_native(dtype):
    gen = torch.Generator().manual_seed(4)
    parents = [random_parents(12, gen), [-1], chain_parents(5), random_parents(4, gen)]
    got, want = _both(cpu_backend, 9, 3, 64, 16, [40, 7, 0, 19], parents, dtype, cap=5.0)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w, atol=TOL[dtype], rtol=TOL[dtype])


@needs_cpu_kernel
def test_cpu_without_a_tree_keeps_its_kernel(monkeypatch):
    """Only a tree batch takes torch_native's path: causal batches never build it."""
    pool = PagedPool(1, 2, 64, torch.float32, CPU, 4, 8)
    backend = cpu_backend(AttentionConfig(1, 4, 2, 64, torch.float32, CPU, pool.kv))
    seq = Seq()
    pool.grow(seq, 5)
    backend.prepare(make_batch([seq], [5], backend, CPU))
    assert backend._tree is None
    pool.grow(seq, 3)
    backend.prepare(make_tree_batch([seq], [[-1, 0, 0]], backend, CPU))
    assert isinstance(backend._tree, TorchNativeBackend) and backend._tree.kv is pool.kv


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_trees_equal_torch_native(dtype):
    gen = torch.Generator().manual_seed(6)
    parents = [random_parents(10, gen), [-1], chain_parents(4), random_parents(6, gen)]
    got, want = _both(triton_backend, 4, 1, 64, 1, [13, 6, 0, 21], parents, dtype, cap=5.0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
def test_triton_tree_kernel_across_tiles():
    """Trees wider than a tile of queries and of keys (16 each here), mask bits read across tile
    borders, against the definition; a tree with a sliding window is refused."""
    from core_kernels.extend_attention import extend_attention

    gen = torch.Generator().manual_seed(7)
    h, hkv, d = 4, 2, 32
    cached, parents = [20, 3], [random_parents(40, gen), random_parents(23, gen)]
    n = [len(p) for p in parents]
    k_pool, v_pool = (torch.randn(64, hkv, d, generator=gen).to(DEV) for _ in range(2))
    prefix_slots = [list(range(1, 21)), [40, 50, 60]]
    q = torch.randn(sum(n), h, d, generator=gen).to(DEV)
    k, v = (torch.randn(sum(n), hkv, d, generator=gen).to(DEV) for _ in range(2))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    qo, pre = i32([0, n[0], sum(n)]), i32([0, cached[0], sum(cached)])
    indices = i32(prefix_slots[0] + prefix_slots[1])
    masks = [ancestor_mask(p) for p in parents]
    tree = torch.cat([m.flatten() for m in masks]).to(DEV)
    offsets = i32([0, n[0] ** 2])
    out = extend_attention(q, k, v, k_pool, v_pool, qo, pre, indices, max(n), scale=d**-0.5, logit_cap=4.0,
                           block_m=16, block_n=16, tree_mask=tree, tree_offsets=offsets)
    start = 0
    for b in range(2):
        keys = torch.cat([k_pool[prefix_slots[b]], k[start:start + n[b]]]).double().repeat_interleave(h // hkv, 1)
        vals = torch.cat([v_pool[prefix_slots[b]], v[start:start + n[b]]]).double().repeat_interleave(h // hkv, 1)
        s = torch.einsum("nhd,lhd->hnl", q[start:start + n[b]].double(), keys) * d**-0.5
        s = 4.0 * torch.tanh(s / 4.0)
        sees = torch.cat([torch.ones(n[b], cached[b], dtype=torch.bool), masks[b]], 1).to(DEV)
        want = torch.einsum("hnl,lhd->nhd", s.masked_fill(~sees[None], float("-inf")).softmax(-1), vals)
        torch.testing.assert_close(out[start:start + n[b]].double(), want, atol=1e-4, rtol=1e-4)
        start += n[b]
    with pytest.raises(ValueError, match="tree mask"):
        extend_attention(q, k, v, k_pool, v_pool, qo, pre, indices, max(n), scale=1.0, sliding_window=8,
                         tree_mask=tree, tree_offsets=offsets)


def compile_tree_kernel_for_sm90() -> None:
    """The tree kernel (bf16 with a cap; float32 with IEEE dots) compiled to an sm_90 cubin, as
    ``tests/test_triton_kernels.compile_for_sm90`` does for the others. Run with TRITON_INTERPRET=0."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from core_kernels import extend_attention as ea
    from core_kernels.common import block_d, tile_n

    jit = ea._extend_tree_kernel
    for dt, d, cap in (("bf16", 128, True), ("fp32", 64, False)):
        consts = dict(GROUP=4, D=d, BLOCK_D=block_d(d), BLOCK_M=tile_n(d), BLOCK_N=tile_n(d), CAP=cap, F32=dt == "fp32")
        ptrs = {"Q": f"*{dt}", "KNew": f"*{dt}", "VNew": f"*{dt}", "KPool": f"*{dt}", "VPool": f"*{dt}", "Out": f"*{dt}",
                "QoIndptr": "*i32", "PrefixIndptr": "*i32", "PrefixIndices": "*i32", "TreeMask": "*u8",
                "TreeOffsets": "*i32"}
        sig = {p.name: "constexpr" if p.name in consts else ptrs.get(p.name, "fp32" if p.name in ("scale", "logit_cap") else "i32")
               for p in jit.params}
        cex = {(i,): consts[p.name] for i, p in enumerate(jit.params) if p.name in consts}
        triton.compile(ASTSource(fn=jit, signature=sig, constexprs=cex), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4 if d <= 64 else 8, num_stages=1))


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests compile and run the kernel")
def test_tree_kernel_compiles_for_an_h100_without_one():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = "from tests.test_tree_attention import compile_tree_kernel_for_sm90; compile_tree_kernel_for_sm90()"
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


# --------------------------------------------------------------------------- the Llama model


def tiny_model(tmp_path: Path):
    from tests.test_eagle_models import tiny_target

    model, _ = tiny_target(tmp_path)
    return model


def _backend(name: str, config: AttentionConfig) -> Any:
    return {"torch_native": TorchNativeBackend, "cpu": cpu_backend, "triton": triton_backend}[name](config)


class Runner:
    """A model over its own paged pool and attention backend, one forward at a time."""

    def __init__(self, model, backend: str, device: torch.device = CPU) -> None:
        cfg = model.config
        d = cfg.hidden_size // cfg.num_attention_heads
        self.pool = PagedPool(cfg.num_hidden_layers, cfg.num_key_value_heads, d, torch.float32, device, 4, 96, seed=2)
        acfg = AttentionConfig(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, d,
                               torch.float32, device, self.pool.kv)
        self.model, self.device, self.backend = model, device, _backend(backend, acfg)

    @torch.inference_mode()
    def prefill(self, seqs: list[Seq], prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        for seq, p in zip(seqs, prompts):
            self.pool.grow(seq, len(p))
        batch = make_batch(seqs, [len(p) for p in prompts], self.backend, self.device,
                           input_ids=[t for p in prompts for t in p])
        return self._run(batch)

    @torch.inference_mode()
    def verify(self, seqs: list[Seq], tokens: list[list[int]], parents: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        for seq, p in zip(seqs, parents):
            self.pool.grow(seq, len(p))
        batch = make_tree_batch(seqs, parents, self.backend, self.device, input_ids=[t for toks in tokens for t in toks])
        return self._run(batch)

    def _run(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.backend.prepare(batch)
        hidden = self.model(batch)
        return hidden.clone(), self.model.compute_logits(hidden)


PROMPTS = [[1, 5, 9, 40, 7, 33], [1, 77, 3, 12, 90, 4, 18, 100, 6, 2, 50]]
# per request: the verify's tokens and their tree (a parent precedes its children; -1: the root)
TREE = ([60, 61, 62, 63, 64, 65, 66], [-1, 0, 0, 1, 2, 3, 1])
CHAIN = ([70, 71, 72], [-1, 0, 1])
ONE = ([80], [-1])


@needs_cpu_ops
@pytest.mark.parametrize("capture", [False, True], ids=["forward", "capturing"])
def test_llama_cpu_paths_take_the_python_layers_for_a_tree(tmp_path, monkeypatch, capture):
    """Through the cpu backend the one-op layers serve the prompt, not the tree (their attention
    is causal); the tree's hidden states equal torch_native's per-layer forward. The whole-stack
    paths (a stand-in plan: a float32 model has no real stack) are not taken for a tree either."""
    model = tiny_model(tmp_path)
    if capture:
        model.model.capture_layers = (1, 3)
    ran: list[int] = []
    real_run = cpu_decode.run
    monkeypatch.setattr(cpu_decode, "run", lambda *a: ran.append(a[1].shape[0]) or real_run(*a))
    runs = {}
    for name in ("torch_native", "cpu"):
        r = Runner(model, name)
        seqs = [Seq(), Seq(), Seq()]
        r.prefill(seqs, PROMPTS + [[1, 2, 3]])
        prefill_runs = len(ran)
        runs[name] = (r.verify(seqs, [TREE[0], CHAIN[0], ONE[0]], [TREE[1], CHAIN[1], ONE[1]]),
                      model.model.__dict__.pop("captured", None))
        if name == "cpu":
            assert prefill_runs == len(model.model.layers) and len(ran) == prefill_runs, ran
        else:
            assert not ran
    (hidden, logits), captured = runs["cpu"]
    (want_hidden, want_logits), want_captured = runs["torch_native"]
    torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    if capture:
        torch.testing.assert_close(captured, want_captured, atol=1e-4, rtol=1e-4)  # (the prompt KV: C++ against torch)

    if capture:
        return

    def boom(*a: Any) -> None:
        raise AssertionError("a C++ stack op ran")

    r = Runner(model, "cpu")
    seqs = [Seq(), Seq(), Seq()]
    r.prefill(seqs, PROMPTS + [[1, 2, 3]])
    monkeypatch.setattr(cpu_decode, "run_stack", boom)
    monkeypatch.setattr(cpu_decode, "run_stack_head", boom)
    monkeypatch.setattr(model.model, "_cpu_stack", lambda backend, head: {"max_rows": 64, "head_rows": 64})
    got, _ = r.verify(seqs, [TREE[0], CHAIN[0], ONE[0]], [TREE[1], CHAIN[1], ONE[1]])
    torch.testing.assert_close(got, want_hidden, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="stack op ran"):  # the stand-in does serve a causal batch
        r.prefill([Seq()], [[1, 2]])


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.parametrize("backend", ["torch_native", pytest.param("cpu", marks=needs_cpu_kernel),
                                     pytest.param("triton", marks=needs_triton)])
def test_tree_verify_logits_are_those_of_each_path(tmp_path, backend):
    """What speculative verification relies on: in one verify of a 7-node tree, a chain and a
    lone token (each after its own cached prompt), node j's logits equal the last logits of a
    causal forward of the prompt followed by the tokens on the path from the root to j."""
    device = DEV if backend == "triton" else CPU
    model = tiny_model(tmp_path).to(device)
    r = Runner(model, backend, device)
    seqs = [Seq() for _ in range(3)]
    prompts = PROMPTS + [[1, 9]]
    r.prefill(seqs, prompts)
    requests = [TREE, CHAIN, ONE]
    _, logits = r.verify(seqs, [t for t, _ in requests], [p for _, p in requests])
    # every root-to-node path as its own sequence, all in one causal forward
    paths = [(b, j, prompts[b] + [requests[b][0][i] for i in _path(requests[b][1], j)])
             for b in range(3) for j in range(len(requests[b][1]))]
    fresh = Runner(model, backend, device)
    _, want = fresh.prefill([Seq() for _ in paths], [p for _, _, p in paths])
    ends = torch.tensor([len(p) for _, _, p in paths]).cumsum(0) - 1
    torch.testing.assert_close(logits, want[ends.to(want.device)], atol=1e-4, rtol=1e-4)
