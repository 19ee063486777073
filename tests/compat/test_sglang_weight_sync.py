"""SGLang's own trainer-side code for its weight-sync endpoints, against a real ``core serve`` (a
tiny bf16 Llama: in-place updates need unquantized weights): ``MultiprocessingSerializer`` payloads
(the tensors shared between the processes, only handles in the body), ``FlattenedTensorBucket``,
per-rank ``LocalSerializedTensor`` values, and ``init_custom_process_group`` for the trainer's side
of the broadcast group. After each update the server answers as the trainer's model does."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import sys
import types

import httpx
import pytest
from safetensors.torch import load_file

from tests.compat.conftest import sglang_frontend
from tests.conftest import TINY_VARIANTS, build_tiny_llama
from tests.server_utils import free_port, start_server

PROMPT = {"input_ids": [[5, 6, 7, 8, 9, 10], [40, 41, 42]], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


def _sglang():
    sglang_frontend()
    from sglang.srt.utils import common
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return common, FlattenedTensorBucket


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(served url, trainer tensors, the trainer model's answers, the served model's own)."""
    _sglang()  # (fail or skip first, as the compat suite does, where SGLang is missing)
    a, b = tmp_path_factory.mktemp("served"), tmp_path_factory.mktemp("trained")
    build_tiny_llama(a, seed=0, **TINY_VARIANTS["gqa"])
    build_tiny_llama(b, seed=7, **TINY_VARIANTS["gqa"])
    flags = ("--dtype", "bfloat16", "--max-total-tokens", "2048", "--skip-tokenizer-init")
    with start_server("--model-path", str(b), *flags) as url:
        want = [o["output_ids"] for o in httpx.post(url + "/generate", json=PROMPT, timeout=60).json()]
    with start_server("--model-path", str(a), *flags) as url:
        own = [o["output_ids"] for o in httpx.post(url + "/generate", json=PROMPT, timeout=60).json()]
        assert own != want
        yield url, load_file(str(b / "model.safetensors")), want, own, load_file(str(a / "model.safetensors"))


def answers(url: str) -> list[list[int]]:
    return [o["output_ids"] for o in httpx.post(url + "/generate", json=PROMPT, timeout=60).json()]


@contextlib.contextmanager
def file_system_sharing():
    import torch.multiprocessing

    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True, r.text
    return r.json()


def test_update_weights_from_tensor_payloads(setup):
    """As SGLang's ``HttpServerEngineAdapter.update_weights_from_tensor`` sends them: one base64
    ``MultiprocessingSerializer`` payload per rank; then a flattened bucket; then per-rank values."""
    common, FlattenedTensorBucket = _sglang()
    # CPU tensors go to an unrelated process by shared-memory file name (by file descriptor only to
    # the sender's children); a GPU trainer's CUDA tensors travel as IPC handles either way
    with file_system_sharing():
        _payloads(common, FlattenedTensorBucket, *setup)


def _payloads(common, FlattenedTensorBucket, url, tensors, want, own, original) -> None:
    ser = common.MultiprocessingSerializer.serialize
    post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [ser(list(tensors.items()), output_str=True)],
                                              "load_format": None, "flush_cache": True})
    assert answers(url) == want
    post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [ser(list(original.items()), output_str=True)]})
    assert answers(url) == own

    bucket = FlattenedTensorBucket(named_tensors=list(tensors.items()))
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [ser(payload, output_str=True)],
                                              "load_format": "flattened_bucket"})
    assert answers(url) == want

    # verl's form: each tensor as SGLang's LocalSerializedTensor (a payload per rank); the class is
    # defined here under SGLang's module path (its module imports the GPU server)
    mod = "sglang.srt.model_executor.model_runner_components.weight_updater"
    local = dataclasses.make_dataclass("LocalSerializedTensor", [("values", list)])
    local.__module__ = mod
    sys.modules.setdefault(mod, types.ModuleType(mod)).LocalSerializedTensor = local
    pairs = [(n, local(values=[ser(t)])) for n, t in original.items()]
    post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [ser(pairs, output_str=True)]})
    assert answers(url) == own


def _trainer(port: int, tensors: dict, group: str, done) -> None:
    """The trainer process: SGLang's ``init_custom_process_group`` as its RL examples call it (rank 0)."""
    import torch

    sglang_frontend()
    from sglang.srt.utils.common import init_custom_process_group

    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                   group_name=group)
    for t in tensors.values():
        torch.distributed.broadcast(t.contiguous(), src=0, group=pg)
    done.wait(120)  # (until the server left the group)
    torch.distributed.destroy_process_group(pg)


def test_update_weights_from_distributed_with_sglang_trainer_code(setup):
    url, tensors, want, own, original = setup
    port, group = free_port(), "weight_update_group"
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    trainer = ctx.Process(target=_trainer, args=(port, tensors, group, done))
    trainer.start()
    try:
        post(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                                 "world_size": 2, "group_name": group, "backend": "gloo"})
        post(url, "/update_weights_from_distributed", {"names": list(tensors), "dtypes": [str(t.dtype).split(".")[1]
                                                       for t in tensors.values()],
                                                       "shapes": [list(t.shape) for t in tensors.values()],
                                                       "group_name": group, "weight_version": "step-1"})
        assert answers(url) == want
        assert httpx.get(url + "/get_model_info", timeout=10).json()["weight_version"] == "step-1"
        post(url, "/destroy_weights_update_group", {"group_name": group})
        done.set()
        trainer.join(timeout=60)
        assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()
        with file_system_sharing():
            serialized = _sglang()[0].MultiprocessingSerializer.serialize(list(original.items()), output_str=True)
            post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [serialized]})
    assert answers(url) == own
