"""A Llama decoder layer as one C++ op for few rows (``kernels/cpu_decode``): same tokens as the
Python forward it replaces, taken only where every piece has its C++ kernel."""

from __future__ import annotations

import pytest
import torch

from core_kernels import cpu_decode
from tests.conftest import greedy, make_engine

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="needs the C++ CPU kernels and AVX512-BF16 "
                                "(kernels/cpu_gemv); elsewhere layers keep their Python forward")

PROMPTS = ["a", "hello world", "abc abc abc abc", "xy"]
REAL_RUN, REAL_PLAN = cpu_decode.run, cpu_decode.plan


def generate(path, monkeypatch, fast: bool, **opts) -> tuple[list[list[int]], int]:
    """Greedy tokens of PROMPTS (batch sizes 4 down to 1 as requests finish, then one at a time),
    and how many layer forwards the C++ op ran."""
    calls = []
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(a[1].shape[0]) or REAL_RUN(*a))
    monkeypatch.setattr(cpu_decode, "plan", REAL_PLAN if fast else (lambda *a: None))
    eng = make_engine(path, dtype="bfloat16", **opts)
    try:
        together = [o["output_ids"] for o in eng.generate(PROMPTS, [greedy(n) for n in (6, 9, 12, 15)])]
        alone = [eng.generate(p, greedy(8))["output_ids"] for p in PROMPTS[:2]]
    finally:
        eng.shutdown()
    return together + alone, len(calls)


@pytest.mark.parametrize("quant,variant", [("int4wo-32", {}), ("int8wo", {}), ("int4wo-32", {"attention_bias": True})],
                         ids=["int4", "int8", "int4_with_biases"])
def test_same_tokens_as_the_python_forward(tiny_llama, monkeypatch, quant, variant):
    path, _ = tiny_llama(**variant)
    want, none = generate(path, monkeypatch, False, torchao_config=quant, attention_backend="cpu")
    got, used = generate(path, monkeypatch, True, torchao_config=quant, attention_backend="cpu")
    assert none == 0 and used > 0
    assert got == want


def test_other_backends_and_dense_layers_keep_the_python_forward(tiny_llama, monkeypatch):
    path, _ = tiny_llama()
    _, used = generate(path, monkeypatch, True, torchao_config="int4wo-32", attention_backend="torch_native")
    assert used == 0
    _, used = generate(path, monkeypatch, True, attention_backend="cpu")  # unquantized: oneDNN's GEMMs
    assert used == 0


def test_only_few_rows_take_it(tiny_llama, monkeypatch):
    """GEMMs of more rows use the layers' dense copies, so those batches keep the Python forward."""
    from core_plugins.quant import packed

    path, _ = tiny_llama()
    calls = []
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(a[1].shape[0]) or REAL_RUN(*a))
    eng = make_engine(path, dtype="bfloat16", torchao_config="int4wo-32", attention_backend="cpu")
    try:
        layer = eng.engine.model.model.layers[0]
        limit = packed._dense_from(layer.mlp.down_proj, layer.mlp.down_proj.dense_weight)
        prompts = [chr(97 + i) * (i + 1) for i in range(limit + 2)]
        eng.generate(prompts, [greedy(2 * i + 2) for i in range(len(prompts))])  # limit + 2 rows, down to 1
    finally:
        eng.shutdown()
    assert set(calls) == set(range(1, limit))
