"""Temperatures too small to divide by (issue 41): every valid one (> 0, down to float64's
smallest subnormal) samples the greedy token, as SGLang does below its ``_SAMPLING_EPS``.

Before the fix such a temperature passed validation and then reached the sampling kernels:
in float32 ``1 / t`` is inf below ~3e-39 and 5e-324 rounds to 0, so the CPU's C++ loop refused
the batch (``sample_rows: temperatures must be > 0``, a 500) or picked from NaN mass.
Both CPU paths are covered: the C++ loops (``core_kernels.cpu_ops``) and the torch ops a GPU
would run (``core.layers.fused`` off).
"""

from __future__ import annotations

import pytest
import torch

from core.engine.sampler import Sampler, SamplingRow
from core.engine.sampling_params import SAMPLING_EPS, SamplingParams
from tests.conftest import make_engine

TINY = [1e-6, 1e-30, 1e-40, 5e-324]  # 1e-40 and 5e-324 are subnormal (float32, float64)
PATHS = ["cpu_loop", "torch_ops"]


@pytest.fixture(params=PATHS)
def cpu_path(request, monkeypatch) -> str:
    """The C++ loops where they are built, or (``torch_ops``) the plain torch ops."""
    import core.layers

    if request.param == "torch_ops":
        monkeypatch.setattr(core.layers, "fused", lambda x: None)
    elif not hasattr(core.layers.fused(torch.zeros(1, 2)), "sample_rows"):
        pytest.skip("the CPU's C++ sampling loop is not built here")
    return request.param


def _row(seed: int | None = None, **kw) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**kw), [5, 6], [], generator=gen)


@pytest.mark.parametrize("t", TINY)
def test_tiny_temperature_is_valid_and_greedy(t: float) -> None:
    p = SamplingParams(temperature=t)
    p.validate()
    assert p.is_greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).is_greedy


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 50, "min_p": 0.01}], ids=["plain", "top_p", "top_k"])
@pytest.mark.parametrize("t", TINY)
def test_sampler_gives_the_greedy_token(cpu_path: str, t: float, filters: dict) -> None:
    """A tiny-temperature row beside sampled ones (so the batch goes through the sampling
    kernels), with and without filters: the row's argmax, never an error."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(7))
    want = logits.argmax(-1).tolist()
    rows = [_row(temperature=t, **filters), _row(seed=1, temperature=1.0), _row(temperature=t, **filters),
            _row(seed=2, temperature=0.7, **filters)]
    out = Sampler(300, seed=3).sample(logits.clone(), rows)
    assert out.token_ids[0] == want[0] and out.token_ids[2] == want[2]
    alone = Sampler(300).sample(logits[:1].clone(), [_row(temperature=t, **filters)])  # an all-tiny batch
    assert alone.token_ids == want[:1]


def test_a_temperature_at_the_threshold_still_samples_without_error(cpu_path: str) -> None:
    """Just at SAMPLING_EPS the row samples (not greedy): the kernels take 1 / 1e-5 fine."""
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(8))
    rows = [_row(seed=4, temperature=SAMPLING_EPS), _row(seed=5, temperature=SAMPLING_EPS, top_p=0.5)]
    assert Sampler(300).sample(logits.clone(), rows).token_ids == logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    path, _ = tiny_llama()
    eng = make_engine(path, max_running_requests=8)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("t", TINY)
def test_engine_output_equals_temperature_zero(engine, cpu_path: str, t: float) -> None:
    """Through the engine (prefill, decode, the CPU's greedy fast path) the tokens are those of
    temperature 0, batched beside a sampled request too."""
    prompts = ["The capital of France is", "hello there"]
    base = {"max_new_tokens": 8, "ignore_eos": True}
    want = [o["output_ids"] for o in engine.generate(prompts, {**base, "temperature": 0.0})]
    got = engine.generate(prompts, {**base, "temperature": t})
    assert [o["output_ids"] for o in got] == want
    mixed = engine.generate(prompts, [{**base, "temperature": t, "top_p": 0.9}, {**base, "temperature": 1.0, "seed": 1}])
    assert mixed[0]["output_ids"] == want[0]
