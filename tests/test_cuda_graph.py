"""Decode CUDA graphs (core/engine/cuda_graph.py) and the capture hooks of plugin API 1.1.

Without a GPU: the captured sizes, why graphs are off on a CPU, a 1.0 attention backend (no
hooks) accepted and run eagerly, and the whole replay path (static buffers, padding rows,
the triton backend's ``prepare_capture`` / ``prepare_replay``) with an eager stand-in for the
CUDA graph, the kernels under triton's interpreter. On a GPU: greedy tokens equal with graphs
on and off."""

from __future__ import annotations

import os
import types

import pytest
import torch
from structlog.testing import capture_logs

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from core import PLUGIN_API_VERSION, hookimpl, plugins  # noqa: E402
from core.engine.cuda_graph import CudaGraphRunner, capture_sizes, why_no_cuda_graph  # noqa: E402
from core.interfaces import cuda_graph_capable  # noqa: E402
from core.plugins import api_compatible  # noqa: E402
from core_plugins.attention.torch_native import TorchNativeBackend  # noqa: E402
from tests.conftest import greedy, make_engine  # noqa: E402

PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 3, 4, 20, 30, 40, 50], [1, 11, 12]]
LENGTHS = [9, 3, 6, 2]  # decode steps of 4, 3, 2, 2, 2, 1, 1, 1 sequences as requests finish


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama("gqa")


def run(eng) -> list[list[int]]:
    outs = eng.generate(input_ids=PROMPTS, sampling_params=[greedy(n) for n in LENGTHS])
    return [o["output_ids"] for o in outs]


# --------------------------------------------------------------------------- sizes and policy


def test_capture_sizes_follow_sglang():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]  # every batch up to the maximum has a graph
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        capture_sizes(0)


class LegacyBackend:
    """A plugin API 1.0 attention backend: prepare and forward, no capture hooks."""

    def __init__(self, config) -> None:
        self.inner = TorchNativeBackend(config)

    def prepare(self, batch) -> None:
        self.inner.prepare(batch)

    def forward(self, q, k, v, layer, batch):
        return self.inner.forward(q, k, v, layer, batch)


def test_reasons_for_running_without_graphs():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    legacy = LegacyBackend.__new__(LegacyBackend)
    assert not cuda_graph_capable(legacy)
    assert "cpu" in why_no_cuda_graph(cpu, legacy, "legacy", disabled=False)
    assert why_no_cuda_graph(cuda, legacy, "legacy", disabled=True) == "--disable-cuda-graph"
    assert "'legacy' does not implement the capture hooks" in why_no_cuda_graph(cuda, legacy, "legacy", disabled=False)
    triton = pytest.importorskip("core_plugins.attention.triton").TritonBackend.__new__(
        pytest.importorskip("core_plugins.attention.triton").TritonBackend)
    assert cuda_graph_capable(triton)
    assert why_no_cuda_graph(cuda, triton, "triton", disabled=False) is None
    assert "tensor parallel" in why_no_cuda_graph(cuda, triton, "triton", disabled=False, tensor_parallel=True)


def test_a_1_0_backend_is_accepted_and_runs_without_graphs(monkeypatch, tiny):
    major, minor = map(int, PLUGIN_API_VERSION.split("."))
    assert (major, minor) >= (1, 1)  # (1.1 brought the capture hooks: a 1.0 backend has none)
    assert api_compatible("1.0") and api_compatible(">=1.0,<2") and not api_compatible(f">={major}.{minor + 1}")
    mod = types.ModuleType("legacy_attention")
    mod.CORE_PLUGIN_API = "1.0"

    @hookimpl
    def register_attention_backends(register):
        register("legacy", LegacyBackend)

    mod.register_attention_backends = register_attention_backends
    real = list(plugins._entry_points())

    class EP:
        name = value = "legacy_attention"
        dist = types.SimpleNamespace(name="legacy-dist", version="0.1")

        @staticmethod
        def load():
            return mod

    monkeypatch.setattr(plugins, "_entry_points", lambda: real + [EP()])
    path, _ = tiny
    with capture_logs() as logs:
        eng = make_engine(path, attention_backend="legacy", skip_tokenizer_init=True)
    try:
        assert eng.engine.runner.graphs is None
        off = [e for e in logs if e["event"] == "cuda_graph.off"]
        assert off and "cpu" in off[0]["reason"]  # why graphs are off is logged
        ref = make_engine(path, attention_backend="torch_native", skip_tokenizer_init=True)
        try:
            assert run(eng) == run(ref)
        finally:
            ref.shutdown()
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------- replay path without a GPU


class EagerGraph:
    """Stands in for a captured CUDA graph: replay reruns the forward on the same static batch
    (its inputs and the backend's metadata are the buffers the real graph would read)."""

    def __init__(self, model, fb, out) -> None:
        self.model, self.fb, self.out = model, fb, out
        self.replays = 0

    def replay(self) -> None:
        self.out.copy_(self.model(self.fb))
        self.replays += 1


class EagerGraphRunner(CudaGraphRunner):
    def _record(self, fb):
        out = self.model(fb).clone()
        return EagerGraph(self.model, fb, out), out


def test_replay_path_with_padding_matches_eager_decoding(tiny):
    """The triton backend (interpreted on a CPU) behind the graph runner: static buffers,
    padding rows up to the captured size, ``prepare_replay`` refilling the captured metadata.
    Batch sizes 4, 3, 2, 1 replay the graphs of sizes 4, 4, 2, 1."""
    pytest.importorskip("triton")
    path, _ = tiny
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eager = make_engine(path, attention_backend="triton", skip_tokenizer_init=True, device=dev, disable_cuda_graph=True)
    graphed = make_engine(path, attention_backend="triton", skip_tokenizer_init=True, device=dev, disable_cuda_graph=True)
    try:
        ae = graphed.engine
        runner = EagerGraphRunner(ae.model, ae.attn_backend, 4, ae.table.table.shape[1], ae.device).capture()
        assert runner.sizes == [1, 2, 4]
        ae.runner.graphs = runner
        for t in (*ae.kv_cache.k, *ae.kv_cache.v, *eager.engine.kv_cache.k, *eager.engine.kv_cache.v):
            t.zero_()  # slots never written compare equal
        assert run(graphed) == run(eager)
        assert {bs: g.replays for (bs, _), g in runner._graphs.items()} == {4: 2, 2: 3, 1: 3}  # (no LoRA graphs)
        for a, b in zip((*ae.kv_cache.k, *ae.kv_cache.v), (*eager.engine.kv_cache.k, *eager.engine.kv_cache.v)):
            torch.testing.assert_close(a[1:], b[1:])  # the padding rows wrote slot 0 only
    finally:
        eager.shutdown()
        graphed.shutdown()


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton"])
def test_greedy_tokens_equal_with_graphs_on_and_off(tiny, backend):
    path, _ = tiny
    on = make_engine(path, attention_backend=backend, skip_tokenizer_init=True, device="cuda", cuda_graph_max_bs=8)
    off = make_engine(path, attention_backend=backend, skip_tokenizer_init=True, device="cuda", disable_cuda_graph=True)
    try:
        graphs = on.engine.runner.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8] and off.engine.runner.graphs is None
        used = []
        replay = graphs.replay
        graphs.replay = lambda batch: used.append(batch.batch_size) or replay(batch)
        assert run(on) == run(off)
        assert sorted(set(used)) == [1, 2, 3, 4]
    finally:
        on.shutdown()
        off.shutdown()
