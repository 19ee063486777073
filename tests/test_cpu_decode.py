"""A Llama decoder layer as one C++ op (``kernels/cpu_decode``): same tokens as the Python forward
it replaces, at every batch size, taken only where every piece has its C++ kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from core_kernels import cpu_decode, cpu_gemv
from tests.conftest import greedy, make_engine

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="needs the C++ CPU kernels (a C++ compiler); "
                                "elsewhere layers keep their Python forward")
needs_gemv = pytest.mark.skipif(not cpu_gemv.available(), reason="int4/int8 layers take the op through kernels/cpu_gemv, "
                                "which needs AVX512-BF16")

PROMPTS = ["a", "hello world", "abc abc abc abc", "xy"]
REAL_RUN, REAL_PLAN = cpu_decode.run, cpu_decode.plan


def generate(path, monkeypatch, fast: bool, prompts: list[str] = PROMPTS, dtype: str = "bfloat16",
             **opts) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of ``prompts`` (all together, batch sizes shrinking as requests finish, then
    the first two alone), and the row counts of the layer forwards the C++ op ran."""
    calls = []
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(a[1].shape[0]) or REAL_RUN(*a))
    monkeypatch.setattr(cpu_decode, "plan", REAL_PLAN if fast else (lambda *a: None))
    eng = make_engine(path, dtype=dtype, **opts)
    try:
        together = [o["output_ids"] for o in eng.generate(prompts, [greedy(6 + 3 * (i % 4)) for i in range(len(prompts))])]
        alone = [eng.generate(p, greedy(8))["output_ids"] for p in prompts[:2]]
    finally:
        eng.shutdown()
    return together + alone, calls


@pytest.mark.parametrize("quant,variant", [
    pytest.param("int4wo-32", {}, marks=needs_gemv), pytest.param("int8wo", {}, marks=needs_gemv),
    pytest.param("int4wo-32", {"attention_bias": True}, marks=needs_gemv), (None, {}), (None, {"attention_bias": True})],
                         ids=["int4", "int8", "int4_with_biases", "unquantized", "unquantized_with_biases"])
def test_same_tokens_as_the_python_forward(tiny_llama, monkeypatch, quant, variant):
    path, _ = tiny_llama(**variant)
    opts = {"torchao_config": quant} if quant else {}
    want, none = generate(path, monkeypatch, False, attention_backend="cpu", **opts)
    got, used = generate(path, monkeypatch, True, attention_backend="cpu", **opts)
    assert not none and used
    assert got == want


@needs_gemv
def test_many_rows_use_the_dense_gemm_inside_the_op(tiny_llama, monkeypatch):
    """Batches past the gemv kernels' row limit (and prefills) run the layers' dense GEMMs from the
    op; the tokens stay those of the Python forward."""
    from core_plugins.quant import packed

    path, _ = tiny_llama()
    probe = make_engine(path, dtype="bfloat16", torchao_config="int4wo-32", attention_backend="cpu")
    try:
        down = probe.engine.model.model.layers[0].mlp.down_proj
        limit = packed._dense_from(down, down.dense_weight)
    finally:
        probe.shutdown()
    prompts = [chr(97 + i) * (i + 1) for i in range(limit + 3)]
    want, _ = generate(path, monkeypatch, False, prompts, torchao_config="int4wo-32", attention_backend="cpu")
    got, rows = generate(path, monkeypatch, True, prompts, torchao_config="int4wo-32", attention_backend="cpu")
    assert got == want
    assert max(rows) > limit and min(rows) < limit  # both sides of the gemv limit ran in the op


def test_float32_layers_take_it_too(tiny_llama, monkeypatch):
    path, _ = tiny_llama()
    want, _ = generate(path, monkeypatch, False, dtype="float32", attention_backend="cpu")
    got, used = generate(path, monkeypatch, True, dtype="float32", attention_backend="cpu")
    assert used and got == want


@needs_gemv
def test_other_backends_keep_the_python_forward(tiny_llama, monkeypatch):
    path, _ = tiny_llama()
    _, used = generate(path, monkeypatch, True, torchao_config="int4wo-32", attention_backend="torch_native")
    assert not used


def test_an_avx2_only_build_takes_it_in_float32(tiny_llama):
    """What an AVX2-only CPU runs by default (fp32): every C++ library built for -march=haswell (no
    AVX-512 paths, no gemv), the one-op layers taken, the same tokens as the Python forward."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    path, _ = tiny_llama()
    script = textwrap.dedent("""
        import sys
        from core_kernels import cpp_build
        cpp_build.flags = lambda: ["-O3", "-fopenmp", "-march=haswell"]
        from core_kernels import cpu_decode
        from tests.conftest import greedy, make_engine

        runs, real_run = [], cpu_decode.run
        cpu_decode.run = lambda *a: runs.append(1) or real_run(*a)

        def tokens():
            eng = make_engine(sys.argv[1], attention_backend="cpu", cpu_threads=2)
            try:
                return [o["output_ids"] for o in eng.generate(["a", "hello world", "abc abc"], [greedy(8)] * 3)]
            finally:
                eng.shutdown()

        fast, used = tokens(), len(runs)
        cpu_decode.plan = lambda *a: None
        slow = tokens()
        assert used and fast == slow, (used, fast, slow)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
