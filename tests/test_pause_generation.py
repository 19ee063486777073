"""SGLang's /pause_generation and /continue_generation (``core.engine.pause``): in every mode no
step runs while paused and new requests wait; ``in_place`` keeps the running requests' KV,
``retract`` sends them back to the queue, ``abort`` ends them; resumed, greedy requests give
the tokens they give unpaused; a weight update runs at once while paused."""

from __future__ import annotations

import asyncio

import pytest

from core.errors import InvalidRequest
from tests.conftest import assert_pool_free
from tests.model_utils import prompt

GREEDY = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}


def _engine(path, overlap: bool):
    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_kwargs

    return AsyncEngine(engine_args_from_kwargs(dict(model_path=str(path), dtype="float32", max_total_tokens=1024,
                                                    cpu_threads=1, device="cpu", random_seed=0,
                                                    enable_overlap_schedule=overlap,
                                                    disable_overlap_schedule=not overlap)))


async def _until(pred, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_a_pause_stops_every_step_until_continue(tiny_llama, mode, overlap):
    path, _ = tiny_llama()
    p, q = prompt(9, seed=1), prompt(7, seed=2)

    async def go():
        eng = _engine(path, overlap)
        try:
            want_p = (await eng.generate(input_ids=p, sampling_params=GREEDY))["output_ids"]
            want_q = (await eng.generate(input_ids=q, sampling_params=GREEDY))["output_ids"]
            (running,) = eng.make_requests(p, eng_params(GREEDY))
            eng.submit([running])
            await _until(lambda: len(running.output_ids) >= 5)
            await eng.pause_generation(mode)
            held = len(running.output_ids)
            if mode == "in_place":
                assert running in eng.scheduler.running and running.row >= 0
            elif mode == "retract":
                assert running in eng.scheduler.waiting and running.row == -1 and not eng.scheduler.running
            else:
                assert running.finish_reason["type"] == "abort" and not eng.scheduler.has_work
            later = asyncio.ensure_future(eng.generate(input_ids=q, sampling_params=GREEDY))
            await asyncio.sleep(0.3)
            assert len(running.output_ids) == held and not later.done()  # no step ran
            await eng.continue_generation()
            assert (await later)["output_ids"] == want_q
            if mode != "abort":
                await _until(lambda: running.finished)
                assert running.output_ids == want_p and running.finish_reason["type"] == "length"
            assert_pool_free(eng)
        finally:
            await eng.shutdown()

    asyncio.run(go())


def eng_params(d: dict):
    from core.engine.sampling_params import SamplingParams

    return SamplingParams.from_dict(d)


def test_a_weight_update_runs_at_once_while_paused(tiny_llama):
    """In place, the running request keeps its KV across the update (SGLang's in_place) and goes on;
    the update did not wait for it (it was still running when the update returned)."""
    path, _ = tiny_llama()

    async def go():
        eng = _engine(path, False)
        try:
            (running,) = eng.make_requests(prompt(9, seed=1), eng_params(GREEDY))
            eng.submit([running])
            await _until(lambda: len(running.output_ids) >= 3)
            await eng.pause_generation("in_place")
            ok, msg = await asyncio.wait_for(eng.update_weights_from_disk(str(path)), 60)
            assert ok, msg
            assert not running.finished and running in eng.scheduler.running
            await eng.continue_generation()
            await _until(lambda: running.finished)
            assert len(running.output_ids) == GREEDY["max_new_tokens"]
            with pytest.raises(InvalidRequest, match="mode must be one of abort, retract, in_place"):
                await eng.pause_generation("sideways")
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_the_http_endpoints(tiny_llama):
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    path, _ = tiny_llama()

    async def calls(c):
        out = [await c.post("/pause_generation", json={"mode": "retract"}),
               await c.post("/continue_generation", json={}),
               await c.post("/pause_generation"),  # (no body: SGLang's default, abort)
               await c.post("/continue_generation"),
               await c.post("/pause_generation", json={"mode": "sideways"}),
               await c.post("/update_weights_from_disk", json={"model_path": str(path), "keep_pause": True})]
        gen = await c.post("/generate", json={"input_ids": prompt(5, seed=3), "sampling_params": {"max_new_tokens": 2}})
        return out, gen

    out, gen = serve_in_process({"model_path": str(path)}, ServerArgs(), calls)
    assert [r.status_code for r in out] == [200, 200, 200, 200, 400, 200], [r.text for r in out]
    assert out[0].json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert out[1].json() == {"message": "Generation continued successfully.", "status": "ok"}
    assert out[4].json()["error"]["param"] == "mode"
    assert gen.status_code == 200 and len(gen.json()["output_ids"]) == 2
