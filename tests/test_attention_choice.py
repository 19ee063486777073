"""Choosing the attention backend per device (the ``choose_attention_backend`` hook) and the
optional FlashInfer backend's refusal where it cannot run."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from core import hookimpl, plugins
from core.errors import CoreError, PluginError
from core.plugins import load_plugins
from core_plugins.attention import default as builtin_choice
from core_plugins.attention import flashinfer as fi_plugin
from tests.conftest import make_engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cpu_default_is_the_cpu_kernel_where_it_builds_else_torch_native():
    from core_plugins.attention.cpu import kernel_status

    name, why, chooser = load_plugins().choose_attention_backend(CPU)
    expected = "cpu" if kernel_status(build=False)[0] else "torch_native"
    assert (name, chooser) == (expected, "attention_default") and "cpu" in why


@pytest.mark.parametrize("works", [True, False])
def test_cuda_policy_prefers_triton_then_working_flashinfer(monkeypatch, works):
    monkeypatch.setattr(fi_plugin, "flashinfer_status", lambda: (works, "ok" if works else "no nvcc"))
    name, why = builtin_choice.choose_attention_backend(CUDA, None, ["torch_native", "triton", "flashinfer"])
    assert name == "triton" and "CUDA" in why
    # without the triton backend: flashinfer where it works, else the reference, saying why
    name, why = builtin_choice.choose_attention_backend(CUDA, None, ["torch_native", "flashinfer"])
    assert name == ("flashinfer" if works else "torch_native")
    assert works or "no nvcc" in why  # the reason flashinfer was passed over is reported


def test_cuda_policy_without_gpu_backends_falls_back_to_torch_native():
    assert builtin_choice.choose_attention_backend(CUDA, None, ["torch_native"])[0] == "torch_native"


def _with_extra_plugin(monkeypatch, module: types.ModuleType) -> None:
    """The real installed plugins plus one more entry point, loaded last."""
    real = list(plugins._entry_points())

    class EP:
        name, value = module.__name__, module.__name__
        dist = types.SimpleNamespace(name="test-dist", version="1.0")

        @staticmethod
        def load():
            return module

    monkeypatch.setattr(plugins, "_entry_points", lambda: real + [EP()])


def test_a_plugin_that_answers_becomes_the_default(monkeypatch, tiny_llama):
    mod = types.ModuleType("fast_cpu_attention")

    @hookimpl
    def register_attention_backends(register):
        register("fast_cpu", "core_plugins.attention.torch_native:TorchNativeBackend")

    @hookimpl
    def choose_attention_backend(device, model_config, available):
        assert "torch_native" in available and "fast_cpu" in available
        assert model_config is None or model_config.architecture == "LlamaForCausalLM"
        return ("fast_cpu", "a faster CPU kernel") if device.type == "cpu" else None

    mod.register_attention_backends = register_attention_backends
    mod.choose_attention_backend = choose_attention_backend
    _with_extra_plugin(monkeypatch, mod)
    assert load_plugins().choose_attention_backend(CPU)[:3] == ("fast_cpu", "a faster CPU kernel", "fast_cpu_attention")
    # on another device it declines, and the built-in policy answers
    assert load_plugins().choose_attention_backend(CUDA)[0] in ("flashinfer", "triton")
    path, _ = tiny_llama()
    eng = make_engine(path)
    try:
        assert eng.engine.attention_backend_name == "fast_cpu"
        assert eng.generate("ab", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2
    finally:
        eng.shutdown()


def test_a_choice_of_an_unregistered_backend_is_an_error(monkeypatch):
    mod = types.ModuleType("bad_chooser")
    mod.choose_attention_backend = hookimpl(lambda device, model_config, available: "nope")
    _with_extra_plugin(monkeypatch, mod)
    with pytest.raises(PluginError, match="bad_chooser.*'nope'.*not registered"):
        load_plugins().choose_attention_backend(CPU)


def test_explicit_flag_wins_over_the_choice(tiny_llama):
    path, _ = tiny_llama()
    eng = make_engine(path, attention_backend="torch_native")
    try:
        assert eng.engine.attention_backend_name == "torch_native"
    finally:
        eng.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_flashinfer_on_cpu_is_a_clear_startup_error(tiny_llama):
    ok, why = fi_plugin.flashinfer_status()
    assert not ok and why
    path, _ = tiny_llama()
    with pytest.raises(CoreError, match="flashinfer cannot run here: .*(not installed|no CUDA GPU)"):
        make_engine(path, attention_backend="flashinfer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_flashinfer_on_cpu_cli_message_without_traceback(tiny_llama):
    path, _ = tiny_llama()
    proc = subprocess.run([sys.executable, "-m", "core.cli", "generate", "hi", "--model-path", str(path),
                           "--attention-backend", "flashinfer", "--device", "cpu", "--max-new-tokens", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "flashinfer cannot run here" in proc.stderr and "Traceback" not in proc.stderr


def test_core_plugins_shows_the_choice():
    proc = subprocess.run([sys.executable, "-m", "core.cli", "plugins"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"default attention backend on {device}: " in proc.stdout and "chosen by attention_default" in proc.stdout


def greedy_is_reference_best(ref, prompt: list[int], out: list[int], tol: float = 3e-2) -> None:
    """Each token of ``out`` (greedy, another backend) is the reference engine's best next token
    given the same prefix, up to ``tol`` nats: robust to bf16 near-ties, unlike equal token lists."""
    o = ref.generate(input_ids=prompt + out, sampling_params={"max_new_tokens": 1, "temperature": 0},
                     return_logprob=True, logprob_start_len=len(prompt), top_logprobs_num=1)
    got = [lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]]
    best = [top[0][0] for top in o["meta_info"]["input_top_logprobs"]]
    assert len(got) == len(out)
    assert all(g >= b - tol for g, b in zip(got, best)), list(zip(got, best))


@pytest.mark.gpu
@pytest.mark.skipif(not fi_plugin.flashinfer_status()[0], reason="needs a CUDA GPU with flashinfer installed")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_torch_native_on_gpu(tiny_llama, page_size, graphs):
    """bf16 (FlashInfer has no float32 kernels): decode, with and without CUDA graphs, and a
    prefix-hit prefill, scored token by token by the torch_native engine. Head dim 64: FlashInfer
    builds kernels for 64, 128 and 256."""
    path, _ = tiny_llama("gqa", head_dim=64)
    shared = [1] + list(range(5, 45))  # 41 tokens: two whole pages of 16 to reuse
    prompts = [shared, [1, 9, 3], shared + [50, 51, 52]]  # the third hits the first's prefix
    params = {"max_new_tokens": 12, "temperature": 0}
    fi = make_engine(path, device="cuda", dtype="bfloat16", attention_backend="flashinfer", page_size=page_size,
                     disable_cuda_graph=not graphs, skip_tokenizer_init=True)
    try:
        assert (fi.engine.runner.graphs is not None) == graphs
        outs = [o["output_ids"] for o in fi.generate(input_ids=prompts[:2], sampling_params=params)]
        third = fi.generate(input_ids=prompts[2], sampling_params=params)
        assert third["meta_info"]["cached_tokens"] >= 32
        outs.append(third["output_ids"])
    finally:
        fi.shutdown()
    ref = make_engine(path, device="cuda", dtype="bfloat16", attention_backend="torch_native", skip_tokenizer_init=True)
    try:
        for p, out in zip(prompts, outs):
            assert len(out) == 12
            greedy_is_reference_best(ref, p, out)
    finally:
        ref.shutdown()


def test_flashinfer_refuses_float32(monkeypatch):
    """FlashInfer has no float32 kernels: a clear start-up error (checked before importing it)."""
    monkeypatch.setattr(fi_plugin, "flashinfer_status", lambda: (True, "pretend"))
    cfg = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    with pytest.raises(CoreError, match="flashinfer runs in float16 or bfloat16, not float32"):
        fi_plugin.FlashInferBackend(cfg)


def test_cuda_policy_skips_flashinfer_for_float32(monkeypatch):
    monkeypatch.setattr(fi_plugin, "flashinfer_status", lambda: (True, "pretend"))
    choice = builtin_choice.choose_attention_backend(CUDA, types.SimpleNamespace(dtype=torch.float32),
                                                     ["torch_native", "flashinfer"])
    assert choice[0] == "torch_native"


def test_flashinfer_refuses_head_dims_it_has_no_kernels_for(monkeypatch):
    monkeypatch.setattr(fi_plugin, "flashinfer_status", lambda: (True, "pretend"))
    cfg = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=16)
    with pytest.raises(CoreError, match="flashinfer has kernels for head dims 64, 128, 256, not 16"):
        fi_plugin.FlashInferBackend(cfg)
