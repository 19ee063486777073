"""The attention-backend suite of the conformance kit: the built-in backends pass it, its
reference (torch_native) agrees with attention written from the definition, and broken
backends are caught with a message naming the case."""

from __future__ import annotations

import os

import attrs
import pytest
import torch

if not torch.cuda.is_available():  # the triton backend runs its kernels in triton's interpreter here
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (read when a kernel module is first imported)

from core.interfaces import AttentionConfig, AttentionLayerSpec
from core.plugins import load_plugins
from core.testing import ATTENTION_CASES, attention_backend_conformance, check_plugin
from core.testing.paged import PagedPool, Seq, make_batch
from core_plugins.attention.torch_native import TorchNativeBackend

pytest_plugins = ["core.testing.pytest_plugin", "pytester"]  # the first: a no-op where its pytest11 entry point loaded it


@pytest.fixture(params=load_plugins().names("attention_backend"))
def attention_backend(request):
    """Every installed backend. Without a GPU, triton runs in its interpreter; flashinfer refuses the
    CPU with a CoreError at construction, so its cases are skipped with that reason."""
    return request.param


# --------------------------------------------------------------------------- the reference itself


def naive_attention(q, pool, seq, new, layer):
    """Attention of ``new`` tokens of ``seq`` over its cached keys, straight from the definition."""
    kc, vc = pool.k[layer.layer_id], pool.v[layer.layer_id]
    group = layer.num_heads // layer.num_kv_heads
    out = torch.zeros_like(q)
    for t in range(new):
        pos = seq.length - new + t
        for h in range(layer.num_heads):
            keys = [j for j in range(pos + 1) if not layer.sliding_window or j > pos - layer.sliding_window]
            k = kc[[seq.slots[j] for j in keys], h // group]
            v = vc[[seq.slots[j] for j in keys], h // group]
            s = (k @ q[t, h]) * layer.scaling
            if layer.logit_cap:
                s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
            out[t, h] = torch.softmax(s, 0) @ v
    return out


@pytest.mark.parametrize("name", ["mixed", "sliding_window_decode", "soft_cap", "mqa", "page_size_1"])
def test_reference_matches_the_definition(name):
    """The kit's reference is only as good as torch_native: check it against the definition."""
    c = next(c for c in ATTENTION_CASES if c.name == name)
    gen = torch.Generator().manual_seed(0)
    pool = PagedPool(1, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"), c.page_size, 128)
    backend = TorchNativeBackend(AttentionConfig(1, c.num_heads, c.num_kv_heads, c.head_dim, torch.float32,
                                                 torch.device("cpu"), pool.kv))
    layer = AttentionLayerSpec(0, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim**-0.5, c.sliding_window, c.logit_cap)
    seqs = [Seq() for _ in c.cached]
    for seq, n in zip(seqs, c.cached):
        slots = pool.grow(seq, n)
        pool.kv.k[0][slots] = torch.randn(n, c.num_kv_heads, c.head_dim, generator=gen)
        pool.kv.v[0][slots] = torch.randn(n, c.num_kv_heads, c.head_dim, generator=gen)
    for step in c.steps:
        live = [i for i, n in enumerate(step) if n]
        for i in live:
            pool.grow(seqs[i], step[i])
        batch = make_batch([seqs[i] for i in live], [step[i] for i in live], backend, torch.device("cpu"))
        t = sum(step)
        q = torch.randn(t, c.num_heads, c.head_dim, generator=gen) * (6 if c.logit_cap else 1)
        k = torch.randn(t, c.num_kv_heads, c.head_dim, generator=gen)
        v = torch.randn(t, c.num_kv_heads, c.head_dim, generator=gen)
        backend.prepare(batch)
        out = backend.forward(q, k, v, layer, batch)
        start = 0
        for i in live:
            want = naive_attention(q[start:start + step[i]], pool.kv, seqs[i], step[i], layer)
            torch.testing.assert_close(out[start:start + step[i]], want, atol=1e-5, rtol=1e-5)
            start += step[i]


# --------------------------------------------------------------------------- broken backends


class IgnoresSlidingWindow(TorchNativeBackend):
    def forward(self, q, k, v, layer, batch):
        return super().forward(q, k, v, attrs.evolve(layer, sliding_window=None), batch)


class WritesTheWrongSlots(TorchNativeBackend):
    """Stores new K/V one slot too far (so later steps read garbage)."""

    def forward(self, q, k, v, layer, batch):
        batch = attrs.evolve(batch, out_cache_loc=batch.out_cache_loc + 1)
        return super().forward(q, k, v, layer, batch)


def test_a_backend_ignoring_the_sliding_window_is_caught():
    results = {r.case: r for r in check_plugin(IgnoresSlidingWindow, "attention_backend")}
    failed = sorted(c for c, r in results.items() if r.status == "failed")
    assert failed == ["sliding_window_decode", "sliding_window_prefill"]
    msg = results["sliding_window_decode"].message
    assert msg.startswith("attention_backend 'IgnoresSlidingWindow' case 'sliding_window_decode': step 1 of 2")
    assert "layer 0 output" in msg and "atol=0.0002" in msg
    assert results["decode"].status == "passed" and results["cuda_graph"].status == "skipped"


def test_a_backend_writing_the_wrong_slots_is_caught():
    results = check_plugin(WritesTheWrongSlots, "attention_backend", cases=["decode", "prefill"])
    assert [r.status for r in results] == ["failed", "failed"]
    assert results[0].message.startswith("attention_backend 'WritesTheWrongSlots' case 'decode': step 1 of 3")
    assert "case 'prefill'" in results[1].message


def test_cuda_graph_case_needs_the_capture_hooks_and_a_gpu():
    (r,) = check_plugin("torch_native", "attention_backend", cases=["cuda_graph"])
    assert r.status == "skipped" and "does not define the CUDA-graph capture hooks" in r.message

    class WithHooks(TorchNativeBackend):
        def init_cuda_graph(self, max_bs, max_len): ...
        def prepare_capture(self, bs, batch): ...
        def prepare_replay(self, bs, batch): ...

    (r,) = check_plugin(WithHooks, "attention_backend", cases=["cuda_graph"], device="cpu")
    assert r.status == "skipped" and r.message == "CUDA-graph capture needs a CUDA device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_case_catches_a_backend_whose_replay_reads_stale_metadata():
    """On a GPU: a backend that ignores prepare_replay replays the captured (length-1) metadata."""
    from core_plugins.attention.triton import TritonBackend

    class StaleReplay(TritonBackend):
        def prepare_replay(self, bs, batch):
            return None

    results = {r.case: r for r in check_plugin(TritonBackend, "attention_backend", cases=["cuda_graph"])}
    assert results["cuda_graph"].status == "passed", results["cuda_graph"].message
    (r,) = check_plugin(StaleReplay, "attention_backend", cases=["cuda_graph"])
    assert r.status == "failed" and "case 'cuda_graph': replay 1 layer 0 output" in r.message


def test_failure_message_in_pytest_names_the_case(pytester):
    """What a plugin author sees: one short test file, a failing case reported by name."""
    pytester.makepyfile(test_mine="""
        import attrs, pytest
        from core.testing import attention_backend_conformance
        from core_plugins.attention.torch_native import TorchNativeBackend

        class NoWindow(TorchNativeBackend):
            def forward(self, q, k, v, layer, batch):
                return super().forward(q, k, v, attrs.evolve(layer, sliding_window=None), batch)

        @pytest.fixture
        def attention_backend():
            return NoWindow
    """)
    result = pytester.runpytest_inprocess("-p", "core.testing.pytest_plugin", "-q", "-k", "window or decode")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*attention_backend 'NoWindow' case 'sliding_window_prefill': step 1 of 1*"])
    result.stdout.fnmatch_lines(["FAILED*test_attention_backend?sliding_window_decode?*"])
