"""Weights from a trainer, in place (SGLang's RL interface, ``core.engine.model_loader.weight_sync``):
after an update the served model answers exactly as a fresh engine loaded with those weights, an
update that fails changes nothing, the prefix cache is flushed unless told not to, and the forms
the trainers send (pairs, buckets, parameter names, serialized payloads over HTTP, broadcasts over
a gloo group) all land. SGLang's own client code for these calls is exercised in
tests/compat/test_sglang_weight_sync.py."""

from __future__ import annotations

import asyncio
import base64
import io
import multiprocessing as mp
import socket
import types

import httpx
import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions ForkingPickler uses)
from safetensors.torch import load_file
from multiprocessing.reduction import ForkingPickler

from tests.conftest import TINY_VARIANTS, build_tiny_llama, make_engine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [30, 31, 32]]
GREEDY = {"max_new_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny Llamas of one shape and different weights: the served one and the trainer's."""
    a, b = tmp_path_factory.mktemp("served"), tmp_path_factory.mktemp("trained")
    build_tiny_llama(a, seed=0, **TINY_VARIANTS["gqa"])
    build_tiny_llama(b, seed=7, **TINY_VARIANTS["gqa"])
    return a, b, load_file(str(b / "model.safetensors"))


def outputs(eng, prompts=PROMPTS) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request, two_models):
    """(served engine, its answers before any update, the trainer's answers, the trainer's tensors);
    bf16 on the CPU serves oneDNN-packed copies, the one-op decode layers and a packed head: all remade."""
    a, b, tensors = two_models
    ref = make_engine(b, dtype=request.param, skip_tokenizer_init=True)
    want = outputs(ref)
    ref.shutdown()
    eng = make_engine(a, dtype=request.param, skip_tokenizer_init=True)
    before = outputs(eng)
    assert before != want, "the two models must answer differently for these tests to mean anything"
    yield eng, before, want, tensors
    eng.shutdown()


def reset(eng, two_models) -> None:
    ok, _ = eng.update_weights_from_tensor(list(load_file(str(two_models[0] / "model.safetensors")).items()))
    assert ok


def test_update_from_tensors_answers_as_the_trainer_model(engines, two_models):
    eng, before, want, tensors = engines
    try:
        ok, message = eng.update_weights_from_tensor(list(tensors.items()))
        assert ok, message
        # (the same prompts ran before: their prefixes were cached under the old weights, then flushed)
        assert outputs(eng) == want
    finally:
        reset(eng, two_models)
    assert outputs(eng) == before


def test_updates_in_buckets_and_the_kept_cache(engines, two_models):
    """Several calls (``flush_cache=False`` but the last), as trainers send a big model: the sum is
    the new model. A cache kept on purpose is reused (its caller knows better)."""
    eng, before, want, tensors = engines
    items = list(tensors.items())
    try:
        for k in range(0, len(items), 7):
            last = k + 7 >= len(items)
            ok, message = eng.update_weights_from_tensor(items[k:k + 7], flush_cache=last)
            assert ok, message
        assert outputs(eng) == want
        ok, _ = eng.update_weights_from_tensor(items[:1], flush_cache=False)  # (the same values again)
        out = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert out["meta_info"]["cached_tokens"] > 0, "flush_cache=False keeps the prefix cache"
    finally:
        reset(eng, two_models)


def test_a_failed_update_changes_nothing(engines):
    eng, before, _, tensors = engines
    items = list(tensors.items())
    name = "model.layers.0.self_attn.k_proj.weight"
    bad_shape = items[:5] + [(name, torch.zeros(3, 3))]
    ok, message = eng.update_weights_from_tensor(bad_shape)
    assert not ok and name in message and "unchanged" in message
    ok, message = eng.update_weights_from_tensor(items[:5] + [("model.layers.9.mlp.up_proj.weight", torch.zeros(2))])
    assert not ok and "model.layers.9.mlp.up_proj.weight" in message and "no matching" in message
    ok, message = eng.update_weights_from_tensor(items, load_format="bogus")
    assert not ok and "bogus" in message
    assert outputs(eng) == before


def test_direct_parameter_names_and_a_flattened_bucket(engines, two_models):
    """``load_format="direct"``: the server's own parameter names (fused ``qkv_proj``);
    ``"flattened_bucket"``: one uint8 tensor and each tensor's span, as SGLang's bucket."""
    eng, before, want, tensors = engines
    ref = make_engine(two_models[1], dtype=str(eng.engine.model_config.dtype).removeprefix("torch."),
                      skip_tokenizer_init=True)
    try:
        direct = [(n, p.detach().clone()) for n, p in ref.engine.model.named_parameters()]
        ok, message = eng.update_weights_from_tensor(direct, load_format="direct")
        assert ok, message
        assert outputs(eng) == want
        reset(eng, two_models)
        flat, meta, at = [], [], 0
        for name, t in tensors.items():
            b = t.contiguous().view(-1).view(torch.uint8)
            meta.append(types.SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=at, end_idx=at + b.numel()))
            flat.append(b)
            at += b.numel()
        bucket = {"flattened_tensor": torch.cat(flat), "metadata": meta}
        ok, message = eng.update_weights_from_tensor(bucket, load_format="flattened_bucket")
        assert ok, message
        assert outputs(eng) == want
    finally:
        ref.shutdown()
        reset(eng, two_models)


def test_a_quantized_model_is_refused_naming_the_way_that_works(two_models):
    eng = make_engine(two_models[0], torchao_config="int8wo", skip_tokenizer_init=True)
    try:
        before = outputs(eng)
        ok, message = eng.update_weights_from_tensor(list(two_models[2].items()))
        assert not ok and "served quantized" in message and "update_weights_from_disk" in message
        assert outputs(eng) == before
    finally:
        eng.shutdown()


def test_sessions_pair_up(engines):
    eng = engines[0]
    assert eng.end_weight_update()[0] is False
    assert eng.begin_weight_update() == (True, "Weight-update session opened.")
    assert eng.begin_weight_update()[0] is False
    assert eng.end_weight_update()[0] is True
    ok, message = eng.begin_weight_update(selector="draft")
    assert not ok and "draft" in message


def _serialize(obj) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


class _Evil:
    def __reduce__(self):
        import os

        return (os.getpid, ())


def test_http_endpoints(engines, two_models):
    """``/update_weights_from_tensor`` with SGLang's payload (a ``ForkingPickler`` dump, base64; the
    tensors shared, not copied); a pickle that calls anything else is refused before it runs."""
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    eng, before, want, tensors = engines
    state = build_state(eng.engine, ServerArgs(weight_version="v0"))
    state.ready = True

    async def go() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t",
                                     timeout=120) as c:
            body = {"serialized_named_tensors": [_serialize(list(tensors.items()))], "weight_version": "v1",
                    "abort_all_requests": True}
            running = asyncio.create_task(c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {
                "max_new_tokens": 200, "ignore_eos": True}}))
            while not eng.engine.scheduler.running and not running.done():
                await asyncio.sleep(0.001)
            good = await c.post("/update_weights_from_tensor", json=body)
            aborted = (await running).json()["meta_info"]["finish_reason"]
            evil = await c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_serialize(_Evil())]})
            unknown = await c.post("/update_weights_from_tensor", json={**body, "bogus": 1})
            nogroup = await c.post("/update_weights_from_distributed",
                                   json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
            nccl = await c.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                                     "rank_offset": 1, "world_size": 2})
            session = [(await c.post(p)).status_code for p in ("/begin_weight_update", "/end_weight_update",
                                                                "/end_weight_update")]
            return [good, aborted, evil, unknown, nogroup, nccl, session]

    try:
        good, aborted, evil, unknown, nogroup, nccl, session = asyncio.run_coroutine_threadsafe(go(), eng._loop).result()
        assert aborted["type"] == "abort", "abort_all_requests ends the running requests before the update"
        assert good.status_code == 200 and good.json()["success"] is True, good.text
        assert "Weight version updated to v1" in good.json()["message"] and state.weight_version == "v1"
        assert outputs(eng) == want
        assert evil.status_code == 400 and "posix.getpid is not allowed" in evil.json()["error"]["message"]
        assert unknown.status_code == 400 and "bogus" in unknown.text
        assert nogroup.status_code == 400 and "init_weights_update_group" in nogroup.json()["message"]
        assert nccl.status_code == 400 and "use backend 'gloo'" in nccl.json()["message"]
        assert session == [200, 200, 400]
    finally:
        reset(eng, two_models)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(port: int, tensors: dict, group: str, bucket: bool, world: int, done) -> None:
    """A trainer process: rank 0 of the group (SGLang's store layout: the group's prefix),
    broadcasting; it leaves the group once the test says the server left (``done``)."""
    from torch.distributed import distributed_c10d as c10d

    store, rank, size = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 0, world))
    pg, _ = c10d._new_process_group_helper(size, rank, [], c10d.Backend("gloo"), c10d.PrefixStore(group, store),
                                           group_name=group, backend_options=None, timeout=c10d.default_pg_timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    if bucket:
        torch.distributed.broadcast(torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()]),
                                    src=0, group=pg)
    else:
        for t in tensors.values():
            torch.distributed.broadcast(t.contiguous(), src=0, group=pg)
    done.wait(120)
    torch.distributed.destroy_process_group(pg)


def start_trainer(port: int, tensors: dict, group: str, bucket: bool = False, world: int = 2):
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    trainer = ctx.Process(target=_trainer, args=(port, tensors, group, bucket, world, done))
    trainer.start()
    return trainer, done


def stop_trainer(trainer, done) -> int | None:
    done.set()
    trainer.join(timeout=60)
    if trainer.is_alive():
        trainer.kill()
    return trainer.exitcode


@pytest.mark.parametrize("bucket", [False, True], ids=["each", "flattened_bucket"])
def test_update_from_distributed_over_gloo(engines, two_models, bucket):
    eng, before, want, tensors = engines
    port, group = _free_port(), f"wg-{int(bucket)}"
    trainer, done = start_trainer(port, tensors, group, bucket)
    try:
        ok, message = eng.init_weights_update_group("127.0.0.1", port, 1, 2, group, backend="gloo")
        assert ok, message
        assert eng.init_weights_update_group("127.0.0.1", port, 1, 2, group, backend="gloo")[0] is False  # (twice)
        ok, message = eng.update_weights_from_distributed(list(tensors), [str(t.dtype) for t in tensors.values()],
                                                          [list(t.shape) for t in tensors.values()], group,
                                                          load_format="flattened_bucket" if bucket else None)
        assert ok, message
        assert outputs(eng) == want
        assert eng.destroy_weights_update_group(group)[0] is True
        assert eng.destroy_weights_update_group(group)[0] is False
    finally:
        exitcode = stop_trainer(trainer, done)
        reset(eng, two_models)
    assert exitcode == 0


def test_tensor_parallel_ranks_update_their_shards(two_models):
    """``--tp-size 2``: rank 1 (another process) loads its shard of each tensor rank 0 was handed,
    and joins the trainer's group as ``rank_offset + 1``: the answers are the trainer model's."""
    a, b, tensors = two_models
    ref = make_engine(b, skip_tokenizer_init=True)
    want = outputs(ref)
    ref.shutdown()
    eng = make_engine(a, skip_tokenizer_init=True, tp_size=2)
    try:
        before = outputs(eng)
        ok, message = eng.update_weights_from_tensor(list(tensors.items()))
        assert ok, message
        assert outputs(eng) == want
        ok, message = eng.update_weights_from_tensor([("model.layers.0.mlp.up_proj.weight", torch.zeros(5, 5))])
        assert not ok and "up_proj" in message and outputs(eng) == want
        direct = [(n, p.detach().clone()) for n, p in eng.engine.model.named_parameters()]
        ok, message = eng.update_weights_from_tensor(direct, load_format="direct")
        assert not ok and "--tp-size" in message
        original = load_file(str(a / "model.safetensors"))
        assert eng.update_weights_from_tensor(list(original.items()))[0]
        assert outputs(eng) == before
        # SGLang's HTTP form: one payload per rank, each rank reading its own (shared memory by file name:
        # rank 1 is no child of this process)
        strategy = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            payloads = [_serialize(list(tensors.items())) for _ in range(2)]
            ok, message = asyncio.run_coroutine_threadsafe(eng.engine.weight_sync.update_from_tensor(payloads),
                                                           eng._loop).result(timeout=120)
            assert ok, message
            assert outputs(eng) == want
            payloads = [_serialize(list(original.items())) for _ in range(2)]
            assert asyncio.run_coroutine_threadsafe(eng.engine.weight_sync.update_from_tensor(payloads),
                                                    eng._loop).result(timeout=120)[0]
            assert outputs(eng) == before
        finally:
            torch.multiprocessing.set_sharing_strategy(strategy)
        port, group = _free_port(), "wg-tp"
        trainer, done = start_trainer(port, tensors, group, world=3)
        try:
            assert eng.init_weights_update_group("127.0.0.1", port, 1, 2, group, backend="gloo")[0] is False  # (too few)
            ok, message = eng.init_weights_update_group("127.0.0.1", port, 1, 3, group, backend="gloo")
            assert ok, message
            ok, message = eng.update_weights_from_distributed(list(tensors), [str(t.dtype) for t in tensors.values()],
                                                              [list(t.shape) for t in tensors.values()], group)
            assert ok, message
            assert outputs(eng) == want
            assert eng.destroy_weights_update_group(group)[0] is True
        finally:
            assert stop_trainer(trainer, done) == 0
    finally:
        eng.shutdown()


FAMILIES = {  # (config, model, overrides): experts stacked from per-expert tensors, fused checkpoint tensors, tied heads
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                               num_experts=4, num_experts_per_tok=2)),
    "phi3_fused_checkpoint": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                                     "hidden_activation": "gelu_pytorch_tanh"}),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_update_in_place(family, tmp_path):
    import transformers

    from tests.model_utils import build_tiny

    cfg, cls, overrides = FAMILIES[family]
    served, trained = tmp_path / "served", tmp_path / "trained"
    for path, seed in ((served, 0), (trained, 7)):
        build_tiny(path, getattr(transformers, cfg), getattr(transformers, cls), seed=seed, **overrides)
    ref = make_engine(trained, skip_tokenizer_init=True)
    want = outputs(ref)
    ref.shutdown()
    eng = make_engine(served, skip_tokenizer_init=True)
    try:
        assert outputs(eng) != want
        ok, message = eng.update_weights_from_tensor(list(load_file(str(trained / "model.safetensors")).items()))
        assert ok, message
        assert outputs(eng) == want
    finally:
        eng.shutdown()


def test_offline_engine_disk_reload_weights_by_name_and_flush(engines, two_models):
    """The offline Engine's other weight calls, as SGLang's: ``update_weights_from_disk`` (success,
    message, paused requests), ``get_weights_by_name`` (the first rows), ``flush_cache``."""
    eng, before, want, tensors = engines
    try:
        ok, message, paused = eng.update_weights_from_disk(str(two_models[1]))
        assert ok and paused == 0, message
        assert outputs(eng) == want
        rows = eng.get_weights_by_name("model.layers.1.self_attn.k_proj.weight", truncate_size=2)
        torch.testing.assert_close(torch.tensor(rows), tensors["model.layers.1.self_attn.k_proj.weight"][:2].float(),
                                   atol=1e-2, rtol=0)
        assert eng.flush_cache() is True
        assert eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0
    finally:
        assert eng.update_weights_from_disk(str(two_models[0]))[0]
    assert outputs(eng) == before


def test_sglang_patched_cuda_payloads_map_the_gpu_uuid_back(monkeypatch):
    """A trainer under SGLang's ``monkey_patch_torch_reductions`` pickles CUDA tensors through
    ``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`` with the GPU's UUID as argument
    6: read as ``rebuild_cuda_tensor_by_uuid``, which hands torch's rebuild the local index (the
    rebuild itself needs a GPU; here it is observed, the UUID table stood in for)."""
    from torch.multiprocessing import reductions

    from core.engine.model_loader import tensor_payload

    seen = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: seen.append(a) or "tensor")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=f"GPU-{i}"))
    fn = tensor_payload._Unpickler(io.BytesIO(b"")).find_class("sglang.srt.utils.patch_torch",
                                                              "_rebuild_cuda_tensor_modified")
    assert fn is tensor_payload.rebuild_cuda_tensor_by_uuid
    assert fn(*range(6), "GPU-1", "x") == "tensor" and seen[-1] == (0, 1, 2, 3, 4, 5, 1, "x")
    assert fn(*range(6), 0, "y") == "tensor" and seen[-1] == (0, 1, 2, 3, 4, 5, 0, "y")
    with pytest.raises(ValueError, match="GPU-7"):
        fn(*range(6), "GPU-7")


def test_an_engine_in_its_own_process_takes_updates(two_models):
    """``--enable-frontend-multiprocessing`` (the CUDA default): the HTTP front end forwards the
    trainer's payload and the memory calls to the engine's process, which reads the tensors."""
    import torch.multiprocessing

    from tests.server_utils import start_server

    a, b, tensors = two_models
    body = {"input_ids": PROMPTS, "sampling_params": GREEDY}
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # (the engine's process is not this one's child)
    try:
        with start_server("--model-path", str(b), "--dtype", "float32", "--skip-tokenizer-init") as url:
            want = [o["output_ids"] for o in httpx.post(url + "/generate", json=body, timeout=60).json()]
        with start_server("--model-path", str(a), "--dtype", "float32", "--skip-tokenizer-init",
                          "--enable-frontend-multiprocessing", "--enable-weights-cpu-backup") as url:
            before = [o["output_ids"] for o in httpx.post(url + "/generate", json=body, timeout=60).json()]
            r = httpx.post(url + "/update_weights_from_tensor",
                           json={"serialized_named_tensors": [_serialize(list(tensors.items()))]}, timeout=120)
            assert r.status_code == 200 and r.json()["success"], r.text
            assert [o["output_ids"] for o in httpx.post(url + "/generate", json=body, timeout=60).json()] == want != before
            assert httpx.post(url + "/release_memory_occupation", timeout=60).json()["success"] is True
            assert httpx.post(url + "/resume_memory_occupation", timeout=60).json()["success"] is True
            assert [o["output_ids"] for o in httpx.post(url + "/generate", json=body, timeout=60).json()] == want
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
