"""SGLang launch flags of operation rather than output: ``--decode-log-interval`` (SGLang's
"Prefill batch" / "Decode batch" log lines, as ``scheduler.prefill_batch`` / ``.decode_batch``),
and the flags accepted because what they ask for is what the engine always does
(``--sleep-on-idle``: an idle engine uses no CPU; ``--disable-custom-all-reduce`` and
``--enable-p2p-check``: there is no custom all-reduce). ``--download-dir`` is tested with the
hub ids (tests/test_hub_ids.py)."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from core.errors import CoreError
from tests.conftest import greedy, make_engine


def test_prefill_and_decode_batches_are_logged_as_sglang_does(tiny_llama):
    path, _ = tiny_llama()
    eng = make_engine(path, decode_log_interval=3, disable_overlap_schedule=True, chunked_prefill_size=16)
    try:
        prompt = [5 + i % 40 for i in range(24)]
        with capture_logs() as logs:
            eng.generate(input_ids=prompt, sampling_params={**greedy(10), "ignore_eos": True})
            eng.generate(input_ids=prompt + [7, 8], sampling_params={**greedy(4), "ignore_eos": True})
    finally:
        eng.shutdown()
    prefills = [e for e in logs if e["event"] == "scheduler.prefill_batch"]
    decodes = [e for e in logs if e["event"] == "scheduler.decode_batch"]
    # the first prompt in two chunks (the second's start is no cache hit), the second's 24 cached tokens
    assert [(e["new_seq"], e["new_token"], e["cached_token"]) for e in prefills] == [(1, 16, 0), (1, 8, 0), (1, 2, 24)], prefills
    assert all(e["log_level"] == "info" and 0 < e["token_usage"] <= 1 and e["queue_req"] == 0 for e in prefills)
    # 9 + 3 decode steps (the first token comes from each prefill): one line every 3rd
    assert len(decodes) == 4, decodes
    assert all(e["running_req"] == 1 and e["token"] > 24 and e["gen_throughput"] > 0 for e in decodes), decodes


def test_flags_sglang_launch_commands_carry_are_accepted(tiny_llama):
    from core.cli import build_parser

    ns = build_parser().parse_args(["serve", "--model-path", "m", "--enable-p2p-check", "--disable-custom-all-reduce",
                                    "--sleep-on-idle", "--decode-log-interval", "10", "--download-dir", "/d"])
    assert (ns.enable_p2p_check, ns.disable_custom_all_reduce, ns.sleep_on_idle, ns.decode_log_interval,
            ns.download_dir) == (True, True, True, 10, "/d")
    path, _ = tiny_llama()
    with pytest.raises(CoreError, match="--decode-log-interval must be >= 1"):
        make_engine(path, decode_log_interval=0)
    eng = make_engine(path, sleep_on_idle=True, enable_p2p_check=True, disable_custom_all_reduce=True)
    try:
        assert eng.generate("ab", greedy(2))["meta_info"]["completion_tokens"] == 2
        time.sleep(0.2)
        cpu = time.process_time()
        time.sleep(1.0)  # idle: the engine's loop and threads wait, none polls
        assert time.process_time() - cpu < 0.05
    finally:
        eng.shutdown()



def test_gpu_placement_follows_sglangs_base_gpu_id_and_gpu_id_step(monkeypatch):
    """SGLang's ``--base-gpu-id`` / ``--gpu-id-step``: replica r's local rank k runs on GPU
    base + (r * ranks per node + k) * step; each data-parallel replica is handed its first GPU
    (before, every replica ran on the first GPU); a layout past the machine's GPUs, both
    ``--device cuda:N`` and ``--base-gpu-id``, or either flag on the CPU are start-up errors."""
    import torch

    from core.engine.config import EngineArgs
    from core.engine.data_parallel.engine import replica_args
    from core.engine.device import gpu_index, placed_device
    from core.engine.distributed.collectives import DistPlan, rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    args = EngineArgs(model_path="m", device="cuda", dp_size=2, tp_size=2, base_gpu_id=1, gpu_id_step=2)
    assert placed_device(args) == torch.device("cuda", 1)
    firsts = [replica_args(args, i) for i in range(2)]
    assert [(a.device, a.base_gpu_id, a.dp_size) for a in firsts] == [("cuda:1", 0, 1), ("cuda:5", 0, 1)]
    plan = DistPlan(2, 1, 0, "127.0.0.1:1", 60.0, "nccl", gpu_id_step=2)
    assert [rank_device(placed_device(a), plan, k).index for a in firsts for k in range(2)] == [1, 3, 5, 7]
    assert gpu_index(0, 1, 3, 2, 1) == 7  # (the default: GPUs in order)
    assert [replica_args(EngineArgs(model_path="m", device="cuda", dp_size=4), i).device for i in range(4)] == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(CoreError, match="reach cuda:9; this machine has 8"):
        placed_device(EngineArgs(model_path="m", device="cuda", dp_size=2, tp_size=2, base_gpu_id=3, gpu_id_step=2))
    with pytest.raises(CoreError, match="give one of them"):
        placed_device(EngineArgs(model_path="m", device="cuda:2", base_gpu_id=1))
    with pytest.raises(CoreError, match="runs on cpu"):
        placed_device(EngineArgs(model_path="m", device="cpu", base_gpu_id=1))
    assert replica_args(EngineArgs(model_path="m", device="cpu", dp_size=2), 1).device == "cpu"


def test_preferred_sampling_params_fill_what_requests_leave_unset(tiny_llama):
    """SGLang's ``--preferred-sampling-params``: under a /generate request's own keys (as SGLang
    merges them), and for what an OpenAI request leaves unset (``max_new_tokens`` caps a request
    without ``max_tokens``); /get_model_info reports them; keys that cannot be a server default
    and bad values are start-up errors."""
    import asyncio

    import httpx

    from core.cli import build_parser
    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_kwargs
    from core.server.app import create_app
    from core.server.args import ServerArgs, validate_serve_args
    from core.server.state import build_state

    path, _ = tiny_llama()
    preferred = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def go() -> dict:
        args = engine_args_from_kwargs(dict(model_path=str(path), dtype="float32", max_total_tokens=1024, cpu_threads=1,
                                            device="cpu", grammar_backend="none"))
        engine = AsyncEngine(args)
        state = build_state(engine, ServerArgs(preferred_sampling_params=preferred,
                                               chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"))
        state.ready = True
        out = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t") as c:
            gen = [(await c.post("/generate", json={"text": "hello", "sampling_params": sp})).json()
                   for sp in ({}, {"max_new_tokens": 5}, {"temperature": 1.0, "top_k": 1})]
            out["generate"] = [len(g["output_ids"]) for g in gen]
            comp = [(await c.post("/v1/completions", json={"model": "m", "prompt": "hello", **extra})).json()
                    for extra in ({}, {"max_tokens": 5})]
            out["completions"] = [c_["usage"]["completion_tokens"] for c_ in comp]
            chat = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 200, chat.text
            out["chat"] = chat.json()["usage"]["completion_tokens"]
            out["info"] = (await c.get("/get_model_info")).json()["preferred_sampling_params"]
        await engine.shutdown()
        return out

    out = asyncio.run(go())
    assert out["generate"] == [3, 5, 3] and out["completions"] == [3, 5] and out["chat"] == 3, out
    assert out["info"] == preferred
    parser = build_parser()
    for flag, match in (('{"n": 2}', "n cannot be a server default"), ('{"temperature": -1}', "temperature"),
                        ('{"json_schema": "{}"}', "json_schema cannot be a server default")):
        with pytest.raises(CoreError, match=match):
            validate_serve_args(parser.parse_args(["serve", "--model-path", "m", "--preferred-sampling-params", flag]))
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model-path", "m", "--preferred-sampling-params", "[1]"])


def test_enable_tf32_matmul_sets_cudas_float32_precision():
    """``--enable-tf32-matmul`` / ``--no-enable-tf32-matmul`` (SGLang's, unset by default) set a CUDA
    process's float32 matmul precision; off CUDA nothing changes (TF32 is a CUDA format)."""
    import torch

    from core.cli import build_parser
    from core.engine.config import engine_args_from_namespace
    from core.engine.device import use_cuda_device

    parse = lambda *f: engine_args_from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *f]))  # noqa: E731
    on, off, unset = parse("--enable-tf32-matmul"), parse("--no-enable-tf32-matmul"), parse()
    assert (on.enable_tf32_matmul, off.enable_tf32_matmul, unset.enable_tf32_matmul) == (True, False, None)
    before = torch.get_float32_matmul_precision()
    try:
        use_cuda_device(torch.device("cpu"), on)
        assert torch.get_float32_matmul_precision() == before
        use_cuda_device(torch.device("cuda"), on)  # (a CUDA process's set-up: the setting is process-wide)
        assert torch.get_float32_matmul_precision() == "high"
        use_cuda_device(torch.device("cuda"), unset)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
