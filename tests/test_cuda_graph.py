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
from tests.test_speculative_eagle import deep, mirror  # noqa: E402,F401  (fixtures: targets and their EAGLE heads)

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
    (its inputs and the backend's metadata are the buffers the real graph would read), and
    refills the features it leaves on the model (an EAGLE target's) as the graph's buffer."""

    def __init__(self, runner, fb, out, key) -> None:
        self.runner, self.fb, self.out, self.key = runner, fb, out, key
        self.replays = 0

    def replay(self) -> None:
        model, got = self.runner.model, self.runner._forward(self.fb)
        for out, new in zip(*((x if isinstance(x, tuple) else (x,)) for x in (self.out, got))):
            out.copy_(new)
        if (side := self.runner._side.get(self.key)) is not None:
            side.copy_(model.model.captured)
        self.replays += 1


class EagerGraphRunner(CudaGraphRunner):
    def _record(self, fb, key):
        out = self._forward(fb)
        out = tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
        self._keep_side(key)
        if key in self._side:
            self._side[key] = self._side[key].clone()  # (a buffer of its own, as the graph's)
        return EagerGraph(self, fb, out, key), out


def eager_graphs(eng, max_bs: int, verify_tokens: int = 0, verify_max_bs: int = 0) -> EagerGraphRunner:
    """Put decode (and verify) graph stand-ins into ``eng``'s runner; returns them."""
    ae = eng.engine
    runner = EagerGraphRunner(ae.model, ae.attn_backend, max_bs, ae.table.table.shape[1], ae.device,
                              verify_tokens=verify_tokens, verify_max_bs=verify_max_bs).capture()
    ae.runner.graphs = runner
    return runner


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
        runner = eager_graphs(graphed, 4)
        assert runner.sizes == [1, 2, 4]
        for t in (*ae.kv_cache.k, *ae.kv_cache.v, *eager.engine.kv_cache.k, *eager.engine.kv_cache.v):
            t.zero_()  # slots never written compare equal
        assert run(graphed) == run(eager)
        assert {bs: g.replays for (bs, _), g in runner._graphs.items()} == {4: 2, 2: 3, 1: 3}  # (no LoRA graphs)
        for a, b in zip((*ae.kv_cache.k, *ae.kv_cache.v), (*eager.engine.kv_cache.k, *eager.engine.kv_cache.v)):
            torch.testing.assert_close(a[1:], b[1:])  # the padding rows wrote slot 0 only
    finally:
        eager.shutdown()
        graphed.shutdown()


def plain_tokens(target, prompts: list[list[int]], params: list[dict], **opts) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's plain (non-speculative) greedy tokens, by prompt."""
    eng = make_engine(target, **opts)
    try:
        return {tuple(p): o["output_ids"] for p, o in zip(prompts, eng.generate(input_ids=prompts, sampling_params=params))}
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kind", ["chains", "trees", "eagle"])
def test_verify_replays_give_plain_greedy_tokens(tiny_spec, mirror, kind):  # noqa: F811
    """Speculative verifies through the verify graphs' replay path (triton, interpreted on a CPU):
    each request's draft padded to T rows under the static tree mask, the padding rows writing
    slot 0 and seeing only themselves, the real rows handed back. An oracle drafter whose drafts
    are partly wrong (chains), or whose kept path runs through second children (trees, their KV
    moved after the verify), gives plain decoding's tokens; the pool's accounting returns to zero.
    ``eagle``: the mirror target, whose token 0 embeds as NaN (a zero row normalised), with its
    EAGLE head: verifies shorter than T near ``max_new_tokens`` pad their rows with a real token,
    since a masked key still meets its value as 0 x V."""
    pytest.importorskip("triton")
    from tests.test_speculative import GREEDY, PROMPTS, OracleDrafter
    from tests.test_speculative_tree import TreeOracle

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = mirror[0] if kind == "eagle" else tiny_spec
    opts = dict(attention_backend="triton", dtype="float32", device=dev, disable_cuda_graph=True, skip_tokenizer_init=True)
    params = [{**GREEDY, "max_new_tokens": 10}] * 3
    want = plain_tokens(target, PROMPTS[:3], params, **opts)
    spec_opts = (dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_draft_model_path=str(mirror[1]))
                 if kind == "eagle" else dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=7))
    eng = make_engine(target, **spec_opts, **opts)
    try:
        spec = eng.engine.scheduler.speculator
        if kind != "eagle":
            spec.drafter, spec.trees = (TreeOracle(want), True) if kind == "trees" else (OracleDrafter(want), False)
        t = spec.num_draft_tokens
        runner = eager_graphs(eng, 4, t, 4)
        assert runner.verify_sizes == [1, 2, 4]
        if kind == "eagle":  # the head's draft steps through its own graphs, its last hidden state their input
            draft, ae = spec.drafter.draft, eng.engine
            draft.graphs = EagerGraphRunner(draft.model, draft.backend, 4, ae.table.table.shape[1], ae.device,
                                            feature_dim=draft.model.config.hidden_size).capture()
        outs = eng.generate(input_ids=PROMPTS[:3], sampling_params=params)
        assert [o["output_ids"] for o in outs] == list(want.values())
        verifies = {bs: g.replays for (bs, kind), g in runner._graphs.items() if kind == "verify"}
        assert verifies[4] > 0  # three requests' verifies replayed the graph of four (one padding sequence)
        m = [o["meta_info"] for o in outs]
        kept, proposed = sum(x["spec_num_correct_drafts"] for x in m), sum(x["spec_num_proposed_drafts"] for x in m)
        assert kept >= (0.6 if kind == "eagle" else 0.1) * proposed > 0  # (the mirror head: its argmax is the target's)
        if kind == "eagle":
            assert sum(g.replays for g in draft.graphs._graphs.values()) > 0
        eng.engine.scheduler.check_accounting()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_an_eagle_heads_draft_steps_replay_graphs(deep, algo):  # noqa: F811
    """A random EAGLE / EAGLE-3 head, whose draft steps read its own last hidden state: through its
    graphs' replay path (stand-ins, the triton kernels interpreted) it proposes exactly the drafts
    it proposes eagerly, so the static features carry each step's input (the mirror head of the
    test above ignores its features)."""
    pytest.importorskip("triton")
    from tests.test_speculative import GREEDY, PROMPTS

    target, eagle3, eagle = deep

    def drafts(graphed: bool) -> tuple[list, int]:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        eng = make_engine(target, attention_backend="triton", dtype="float32", device=dev, disable_cuda_graph=True,
                          skip_tokenizer_init=True, speculative_algorithm=algo, speculative_num_steps=3,
                          speculative_draft_model_path=str(eagle3 if algo == "EAGLE3" else eagle))
        try:
            drafter, ae = eng.engine.scheduler.speculator.drafter, eng.engine
            draft = drafter.draft
            if graphed:
                draft.graphs = EagerGraphRunner(draft.model, draft.backend, 2, ae.table.table.shape[1], ae.device,
                                                feature_dim=draft.model.config.hidden_size).capture()
            got, propose = [], drafter.propose_batch
            drafter.propose_batch = lambda reqs: got.append(out := propose(reqs)) or out
            eng.generate(input_ids=PROMPTS[:2], sampling_params=[{**GREEDY, "max_new_tokens": 10}] * 2)
            return got, sum(g.replays for g in draft.graphs._graphs.values()) if graphed else 0
        finally:
            eng.shutdown()

    (eager, _), (graphed, replays) = drafts(False), drafts(True)
    assert graphed == eager and len(eager) > 2
    assert replays >= len(eager)  # (a chain's steps after its first, which observe computed)


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory):
    from tests.conftest import build_tiny_llama

    path = tmp_path_factory.mktemp("tiny-graph-spec")
    build_tiny_llama(path, seed=3)
    return path


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



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU")
@pytest.mark.parametrize("algo", ["ngram-chain", "ngram-tree", "standalone", "eagle", "eagle-tree"])
def test_speculative_verifies_and_drafts_replay_graphs_on_a_gpu(tiny_spec, mirror, algo):  # noqa: F811
    """Real CUDA graphs: verifies replay the verify graphs (chains, trees), a STANDALONE draft's
    decode steps and an EAGLE head's draft steps their own graphs, an EAGLE target's graphs hand the
    head its features; greedy gives
    plain decoding's tokens, and a head or draft that mirrors the target has its drafts kept."""
    from tests.test_speculative import GREEDY, PROMPTS, OracleDrafter
    from tests.test_speculative_tree import TreeOracle

    eagle = algo.startswith("eagle")
    target = mirror[0] if eagle else tiny_spec
    opts = dict(attention_backend="triton", dtype="float32", device="cuda", cuda_graph_max_bs=8, skip_tokenizer_init=True)
    params = [{**GREEDY, "max_new_tokens": 16}] * 3
    want = plain_tokens(target, PROMPTS[:3], params, **opts)
    spec_opts = {"ngram-chain": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=7),
                 "ngram-tree": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=9),
                 "standalone": dict(speculative_algorithm="STANDALONE", speculative_num_steps=4,
                                    speculative_draft_model_path=str(tiny_spec)),
                 "eagle": dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_draft_model_path=str(mirror[1])),
                 "eagle-tree": dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=2,
                                    speculative_draft_model_path=str(mirror[1]))}[algo]
    eng = make_engine(target, **opts, **spec_opts)
    try:
        spec = eng.engine.scheduler.speculator
        if algo == "ngram-chain":
            spec.drafter = OracleDrafter(want)
        elif algo == "ngram-tree":
            spec.drafter = TreeOracle(want)
            assert spec.trees
        graphs = eng.engine.runner.graphs
        assert graphs is not None and graphs.verify_sizes and graphs.verify_tokens == spec.num_draft_tokens
        assert spec.max_verify_reqs == graphs.verify_sizes[-1]  # (a larger batch decodes plainly)
        counts = {"verify": 0, "draft": 0}

        def spy(replay, kind):
            def call(batch, *features):
                counts[kind] += 1
                return replay(batch, *features)
            return call

        graphs.replay_verify = spy(graphs.replay_verify, "verify")
        draft_graphs = getattr(getattr(spec.drafter, "draft", None), "graphs", None)
        assert (draft_graphs is not None) == algo.startswith(("standalone", "eagle"))
        if draft_graphs is not None:
            draft_graphs.replay = spy(draft_graphs.replay, "draft")
        outs = eng.generate(input_ids=PROMPTS[:3], sampling_params=params)
        assert [o["output_ids"] for o in outs] == list(want.values())
        assert counts["verify"] > 0 and (counts["draft"] > 0) == algo.startswith(("standalone", "eagle"))
        m = [o["meta_info"] for o in outs]
        kept, proposed = sum(x["spec_num_correct_drafts"] for x in m), sum(x["spec_num_proposed_drafts"] for x in m)
        share = {"ngram-chain": 0.1, "ngram-tree": 0.4, "standalone": 0.6, "eagle": 0.6, "eagle-tree": 0.3}[algo]
        assert kept >= share * proposed > 0  # (the oracles' wrong tokens; a tree keeps one branch of two)
        eng.engine.scheduler.check_accounting()
    finally:
        eng.shutdown()
