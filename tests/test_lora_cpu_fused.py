"""LoRA adapters inside the CPU's fused decode stack (``kernels/cpu_decode``, issue 44): a decode
batch mixing adapters and the base model runs as one C++ call and gives the tokens of the Python
layers (``LayerLoRA``'s masked GEMMs), in bf16 and float32; batches the stack cannot serve keep
the Python path."""

from __future__ import annotations

import pytest
import torch

from core.testing.lora import PROJECTIONS, write_random_adapter
from core_kernels import cpu_decode, cpu_gemv
from tests.conftest import assert_pool_free, make_engine
from tests.model_utils import prompt

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="needs the C++ CPU kernels (a C++ compiler)")
DTYPES = [
    pytest.param("bfloat16", marks=pytest.mark.skipif(not cpu_gemv.available(), reason="bf16 gemv needs AVX512-BF16"),
                 id="bf16"),
    pytest.param("float32", marks=pytest.mark.skipif(not cpu_gemv.available_f32(), reason="needs AVX2 and FMA"), id="f32"),
]
# (name, rank, targets, seed): different ranks (zero-padded in the pool) and target sets
ADAPTERS = [("all16", 16, PROJECTIONS, 1), ("qv8", 8, ("q_proj", "v_proj"), 2), ("mlp4", 4, ("gate_proj", "down_proj", "o_proj"), 3)]
# adapters and the base model in one batch: 9 decode rows (from 8 the stack shares the row loops
# out between its threads), fewer as requests finish
NAMES = [None, "all16", "qv8", "mlp4", "all16", None, "qv8", "mlp4", None]


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    path, hf = tiny_llama()
    root = tmp_path_factory.mktemp("lora-fused")
    for name, rank, targets, seed in ADAPTERS:
        write_random_adapter(root / name, hf.config, rank, targets, seed, b_scale=0.5)  # (large: tokens change)
    return path, [f"{name}={root / name}" for name, *_ in ADAPTERS]


def run(setup, monkeypatch, fused: bool, dtype: str, names: list[str | None] = NAMES,
        **opts) -> tuple[list[list[int]], dict[str, list[bool]]]:
    """Greedy tokens of one batch of prompts, each through its adapter of ``names``, then one prompt
    alone through two adapters and the base; and, per call of each fused entry (the stack's decode
    from lists, its multi-step decode, its forward with and without the head), whether the call
    had adapters. ``fused=False``: the stack never serves adapters (batches with them run the
    Python layers' LoRA: the reference)."""
    path, paths = setup
    calls: dict[str, list[bool]] = {"decode": [], "steps": [], "stack": []}
    decode, steps, stack, head = cpu_decode.decode, cpu_decode.decode_steps, cpu_decode.run_stack, cpu_decode.run_stack_head
    with monkeypatch.context() as m:  # (their lora argument: the last, after 6 / 8 positional ones)
        m.setattr(cpu_decode, "decode", lambda p, ids, *a: calls["decode"].append(len(a) > 5 and a[5]) or decode(p, ids, *a))
        m.setattr(cpu_decode, "decode_steps", lambda p, ids, *a: calls["steps"].append(len(a) > 7 and a[7]) or steps(p, ids, *a))
        m.setattr(cpu_decode, "run_stack", lambda p, x, b: calls["stack"].append(b.lora) or stack(p, x, b))
        m.setattr(cpu_decode, "run_stack_head", lambda p, x, b: calls["stack"].append(b.lora) or head(p, x, b))
        if not fused:
            m.setattr(cpu_decode, "serves_lora", lambda p: False)
        eng = make_engine(path, dtype=dtype, torchao_config="int8wo", attention_backend="cpu", cpu_threads=2,
                          enable_lora=True, lora_paths=paths, **{"max_loras_per_batch": 3, **opts})
        try:
            prompts = [prompt(6 + 3 * i, seed=i) for i in range(len(names))]
            # (no min_new_tokens: --num-continuous-decode-steps runs only where nothing reads each token)
            params = [{"temperature": 0.0, "max_new_tokens": 5 + i % 4, "ignore_eos": True} for i in range(len(names))]
            outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params, lora_path=names)]
            outs += [eng.generate(input_ids=prompts[1], sampling_params=params[1], lora_path=n)["output_ids"]
                     for n in ("mlp4", "qv8", None)]
            assert_pool_free(eng)
        finally:
            eng.shutdown()
    return outs, calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step", ["decode", "forward"])
def test_mixed_adapter_decodes_run_in_the_stack_with_the_python_tokens(setup, monkeypatch, dtype, step):
    """Decodes from the scheduler's lists (the model's decode_step), or, without that, through the
    model's forward (run_stack_head; short prefills: run_stack)."""
    from core_plugins.models.llama import LlamaForCausalLM

    if step == "forward":
        monkeypatch.setattr(LlamaForCausalLM, "decode_step", lambda *a: None)
    want, python_calls = run(setup, monkeypatch, False, dtype)
    got, calls = run(setup, monkeypatch, True, dtype)
    assert not any(python_calls["decode"] + python_calls["stack"])  # the reference kept adapters out of the stack
    route = calls["decode"] if step == "decode" else calls["stack"]
    assert route[0] and sum(route) >= 8  # the fused run did not: the mixed batch's decodes, the single ones
    assert got == want
    base, _ = run(setup, monkeypatch, True, dtype, names=[None] * len(NAMES))
    assert all(b != g for b, g, n in zip(base, got, NAMES) if n)  # the adapters change the tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_step_decodes_add_the_adapters_too(setup, monkeypatch, dtype):
    """``--num-continuous-decode-steps``: the stack's multi-step greedy call serves adapters too."""
    want, _ = run(setup, monkeypatch, False, dtype)
    got, calls = run(setup, monkeypatch, True, dtype, num_continuous_decode_steps=3)
    assert calls["steps"] and calls["steps"][0] and got == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_adapters_copied_into_slots_later_are_read_in_place(setup, monkeypatch, dtype):
    """Two slots for three adapters: the scheduler splits the batch and the pool copies adapters
    into slots (over others) after the stack bound its buffers; the stack reads them as they are."""
    want, _ = run(setup, monkeypatch, False, dtype, max_loras_per_batch=2)
    got, calls = run(setup, monkeypatch, True, dtype, max_loras_per_batch=2)
    assert sum(calls["decode"]) >= 8 and got == want


def test_a_stack_without_adapter_buffers_leaves_lora_batches_to_the_python_layers(setup, monkeypatch):
    """Where the stack cannot bind the pool (here: the pool keeps no B by blocks), batches with
    adapters run the Python layers, with the same tokens, and the stack still serves the base model."""
    from core.engine.lora.pool import LayerLoRA

    want, _ = run(setup, monkeypatch, False, "float32")
    real_init = LayerLoRA.__init__

    def no_blocks(self, *a, **k):
        real_init(self, *a, **k)
        self.B_blocks = None

    monkeypatch.setattr(LayerLoRA, "__init__", no_blocks)
    got, calls = run(setup, monkeypatch, True, "float32")
    assert got == want and calls["decode"] and not any(calls["decode"] + calls["stack"])  # base-only steps: the stack


def test_adapters_over_packed_weights_are_int8_codes_of_the_values_every_path_uses(setup):
    """Over int8 (or int4) weights the pool keeps each adapter as int8 codes, a power-of-two scale
    per A row and per B column: the Python layers' A and B hold the codes' exact values, within
    half a step of the checkpoint's (scaling folded into B), and the stack reads the same codes."""
    path, paths = setup
    eng = make_engine(path, dtype="bfloat16", torchao_config="int8wo", attention_backend="cpu", cpu_threads=2,
                      enable_lora=True, lora_paths=paths, max_loras_per_batch=3)
    try:
        eng.generate(input_ids=prompt(6, seed=0), sampling_params={"max_new_tokens": 1}, lora_path="all16")  # (into a slot)
        lora = eng.engine.runner.lora
        pool, ad = lora.pool, lora.manager.adapter("all16")
        slot = pool.slot_of("all16")
        assert pool.layers and all(st.q8 for st in pool.layers.values())
        for (module, shard), (a, b) in ad.weights.items():
            st = pool.layers[module]
            p, r = st.shards.index(shard), a.shape[0]
            rows = slice(p * pool.max_rank, p * pool.max_rank + r)
            start, size = st.spans[p]
            sa, sb = st.scales[0, slot, rows], st.scales[1, slot, rows]
            A, B = st.A[slot, rows].float(), st.B[slot, start : start + size, :r].float()
            assert torch.equal(A, st.A_q8[slot, rows].float() * sa[:, None])
            assert ((A - a).abs() <= sa[:, None] / 2).all()
            codes = st.B_blocks[start // 16 : (start + size) // 16, slot, :r].transpose(0, 1).reshape(r, size)
            assert st.B_blocks.dtype == torch.int8 and torch.equal(B, (codes.float() * sb[:, None]).t())
            assert ((B - b * ad.scaling).abs() <= sb / 2).all()
    finally:
        eng.shutdown()
