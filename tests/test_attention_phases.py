"""Per-phase attention backends (SGLang's ``--prefill-attention-backend`` / ``--decode-attention-backend``,
``core.engine.hybrid_attention``): on the CPU ``cpu`` and ``torch_native`` are both real backends over
the one KV pool, so an engine that prefills on one and decodes on the other must give the single
backend's greedy tokens (and transformers'), while spies on both prove which batches ran where:
prefill and mixed prefill+decode batches on the prefill backend, decode steps on the decode one.
Plus the fallbacks to ``--attention-backend``, no wrapper for equal names, the dispatch of verifies
and CUDA-graph hooks, ``core serve``'s flags and clear start-up errors."""

from __future__ import annotations

import types

import pytest
import torch

from core.engine import hybrid_attention
from core.engine.hybrid_attention import PhaseAttention, attention_backend_name, build_attention_backend
from core.engine.sglang_flags import SGLANG_FLAGS_LACKING
from core.errors import CoreError
from core.interfaces import AttentionConfig, cuda_graph_capable
from core.plugins import load_plugins
from core_kernels import cpp_build
from core_kernels import cpu_decode
from core_plugins.attention.cpu import CpuBackend
from core_plugins.attention.torch_native import TorchNativeBackend
from tests.conftest import assert_greedy_matches, greedy, make_engine

CPU = torch.device("cpu")
PROMPTS = [[5 + (3 * i) % 40 for i in range(11)], [9 + (7 * i) % 50 for i in range(37)],
           [4 + (5 * i) % 60 for i in range(51)], [11 + i % 13 for i in range(23)]]
MIXED = dict(page_size=16, chunked_prefill_size=16, enable_mixed_chunk=True)  # chunks ride along with decodes


@pytest.fixture(scope="module")
def kernel():
    if problem := cpp_build.toolchain_problem():
        pytest.skip(f"the cpu attention kernel cannot be built here: {problem}")
    from core_plugins.attention import cpu as cpu_plugin

    return cpu_plugin.load_kernel()


def _spy(monkeypatch) -> list[tuple[str, tuple[int, ...], bool]]:
    """Record (backend, extend lengths, whether the batch named that backend) for every forward each
    backend runs: ``prepare`` (called once per eager forward) and the CPU decode stack (which runs the
    cpu backend's kernel without ``prepare``)."""
    calls: list[tuple[str, tuple[int, ...], bool]] = []
    for name, cls in (("torch_native", TorchNativeBackend), ("cpu", CpuBackend)):
        def prepare(self, batch, _orig=cls.prepare, _name=name):
            calls.append((_name, tuple(batch.extend_lens_cpu), batch.attn_backend is self))
            return _orig(self, batch)

        monkeypatch.setattr(cls, "prepare", prepare)
    for fn in ("decode", "decode_steps"):
        def stack(*a, _orig=getattr(cpu_decode, fn), **kw):
            calls.append(("cpu", (1,) * len(a[5]), True))  # (a[5]: seq_lens; the stack exists only for cpu)
            return _orig(*a, **kw)

        monkeypatch.setattr(cpu_decode, fn, stack)
    return calls


def _run(path, **kwargs) -> tuple[list[list[int]], object]:
    eng = make_engine(path, skip_tokenizer_init=True, **kwargs)
    try:
        out = eng.generate(input_ids=PROMPTS, sampling_params={**greedy(10), "ignore_eos": True})
        return [o["output_ids"] for o in out], eng.engine
    finally:
        eng.shutdown()


@pytest.mark.parametrize("prefill_attention_backend, decode_attention_backend",
                         [("torch_native", "cpu"), ("cpu", "torch_native")], ids=["tn_prefill-cpu_decode", "cpu_prefill-tn_decode"])
def test_each_phase_runs_on_the_backend_named(kernel, tiny_llama, monkeypatch, prefill_attention_backend,
                                              decode_attention_backend):
    path, hf = tiny_llama()
    want, _ = _run(path, attention_backend="torch_native", **MIXED)
    calls = _spy(monkeypatch)
    got, engine = _run(path, prefill_attention_backend=prefill_attention_backend,
                       decode_attention_backend=decode_attention_backend, **MIXED)
    assert engine.attention_backend_name == f"prefill={prefill_attention_backend},decode={decode_attention_backend}"
    assert isinstance(engine.attn_backend, PhaseAttention)
    assert engine.attn_backend.prefill.kv is engine.attn_backend.decode.kv is engine.kv_cache  # one pool
    assert got == want  # the single backend's tokens
    for prompt, tokens in zip(PROMPTS, got):
        assert_greedy_matches(hf, prompt, tokens)
    on_prefill = [lens for name, lens, _ in calls if name == prefill_attention_backend]
    on_decode = [lens for name, lens, _ in calls if name == decode_attention_backend]
    assert on_prefill and on_decode, calls
    assert all(set(lens) != {1} for lens in on_prefill), on_prefill  # no decode step ran on the prefill backend
    assert all(set(lens) == {1} for lens in on_decode), on_decode  # nor any prefill on the decode backend
    # a prompt's later chunk riding along with other sequences' decodes: SGLang's MIXED mode, the prefill backend's
    assert any(1 in lens and max(lens) > 1 for lens in on_prefill), on_prefill
    assert all(named for _, _, named in calls)  # the batch carried the backend that ran it (the CPU fast paths read it)


def test_equal_names_build_the_one_backend_without_a_wrapper(tiny_llama):
    path, _ = tiny_llama()
    _, engine = _run(path, prefill_attention_backend="torch_native", decode_attention_backend="torch_native")
    assert engine.attention_backend_name == "torch_native" and type(engine.attn_backend) is TorchNativeBackend


def _args(**kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{"attention_backend": None, "prefill_attention_backend": None,
                                    "decode_attention_backend": None, **kw})


def test_each_flag_falls_back_to_attention_backend_then_to_the_device_default():
    plugins = load_plugins()
    name = lambda **kw: attention_backend_name(_args(**kw), plugins, CPU, None)  # noqa: E731
    assert name(attention_backend="torch_native") == "torch_native"
    assert name(attention_backend="cpu", decode_attention_backend="torch_native") == "prefill=cpu,decode=torch_native"
    assert name(attention_backend="cpu", prefill_attention_backend="torch_native") == "prefill=torch_native,decode=cpu"
    assert name(attention_backend="cpu", prefill_attention_backend="cpu") == "cpu"
    default = plugins.choose_attention_backend(CPU)[0]  # neither --attention-backend: the device's default
    assert name(decode_attention_backend="torch_native") == hybrid_attention.hybrid_name(default, "torch_native")
    assert name(prefill_attention_backend="torch_native", decode_attention_backend="cpu") == "prefill=torch_native,decode=cpu"


class _Fake:
    def __init__(self, graphs: bool = False, tree: bool = False) -> None:
        self.supports_tree_mask, self.calls = tree, []
        if graphs:
            self.init_cuda_graph = lambda *a: self.calls.append("init")
            self.prepare_capture = lambda *a: self.calls.append("capture")
            self.prepare_replay = lambda *a: self.calls.append("replay")

    def prepare(self, batch) -> None:
        self.calls.append("prepare")

    def forward(self, q, k, v, layer, batch):
        self.calls.append("forward")
        return q


def test_dispatch_of_verifies_mixed_batches_and_cuda_graph_hooks():
    prefill, decode = _Fake(tree=True), _Fake(graphs=True)
    h = PhaseAttention(prefill, decode, "p", "d")
    assert h.select([1, 1, 1]) is decode
    assert h.select([1, 5, 1]) is prefill  # mixed: the prefill backend, as SGLang's MIXED mode
    assert h.select([4, 4], tree=True) is prefill and h.select([1], tree=True) is prefill  # verifies (mode "prefill")
    assert h.supports_tree_mask and not h.supports_cuda_graph_verify
    assert cuda_graph_capable(h)  # decode steps are what the graphs capture: the decode backend's hooks
    h.init_cuda_graph(4, 64)
    h.prepare_capture(1, None)
    h.prepare_replay(1, None)
    assert decode.calls == ["init", "capture", "replay"] and prefill.calls == []
    batch = types.SimpleNamespace(extend_lens_cpu=[1, 1], tree_mask=None)
    h.prepare(batch)
    h.forward(None, None, None, None, batch)
    assert decode.calls[-2:] == ["prepare", "forward"] and prefill.calls == []
    assert not cuda_graph_capable(PhaseAttention(_Fake(graphs=True), _Fake(), "p", "d"))  # decode side can't: eager
    assert hybrid_attention.verify_backend_name("prefill=p,decode=d") == "p"
    assert hybrid_attention.phase_backend(decode, [7]) is decode and hybrid_attention.decode_backend(h) is decode


def test_serve_parses_the_flags_into_engine_args():
    from core.cli import build_parser
    from core.engine.config import engine_args_from_namespace

    assert not SGLANG_FLAGS_LACKING & {"--prefill-attention-backend", "--decode-attention-backend"}
    ns = build_parser().parse_args(["serve", "--model-path", "m", "--prefill-attention-backend", "torch_native",
                                    "--decode-attention-backend", "cpu"])
    args = engine_args_from_namespace(ns)
    assert (args.prefill_attention_backend, args.decode_attention_backend, args.attention_backend) == (
        "torch_native", "cpu", None)


def test_a_bad_name_or_a_backend_that_cannot_run_is_a_clear_startup_error(tiny_llama, monkeypatch):
    path, _ = tiny_llama()
    with pytest.raises(CoreError, match="--prefill-attention-backend nope: unknown attention_backend 'nope'"):
        make_engine(path, attention_backend="torch_native", prefill_attention_backend="nope")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(CoreError, match="--decode-attention-backend triton cannot serve this engine's decode batches: "
                                        ".*needs a CUDA GPU"):
        make_engine(path, attention_backend="torch_native", decode_attention_backend="triton")


def test_a_kv_pool_dtype_a_backend_refuses_names_its_flag():
    """A backend's refusal at construction (here: a made-up one that reads no fp8 pool) names the flag."""
    plugins = load_plugins()

    class NoFp8(TorchNativeBackend):
        def __init__(self, config):
            if config.kv_cache.k[0].dtype == torch.float8_e4m3fn:
                raise CoreError("attention backend 'nofp8' cannot read a float8_e4m3fn KV pool")
            super().__init__(config)

    real = plugins.resolve
    plugins.resolve = lambda kind, name: NoFp8 if name == "nofp8" else real(kind, name)
    from core.engine.mem_cache.kv_cache import allocate_kv_cache

    kv = allocate_kv_cache(1, 4, 1, 1, 8, torch.float8_e4m3fn, CPU)
    cfg = AttentionConfig(1, 2, 1, 8, torch.float32, CPU, kv)
    with pytest.raises(CoreError, match="--decode-attention-backend nofp8 cannot serve this engine's decode batches: "
                                        ".*float8_e4m3fn"):
        build_attention_backend(plugins, "prefill=torch_native,decode=nofp8", cfg)
