"""SGLang's weight-sync endpoints for RL trainers (admin endpoints, as SGLang's):
``/update_weights_from_tensor``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/begin_weight_update``, ``/end_weight_update``, and
``--enable-memory-saver``'s ``/release_memory_occupation`` and ``/resume_memory_occupation``. Each
answers ``{"success", "message"}``, 200 or 400; the work is ``core.engine.model_loader.weight_sync``'s
and ``core.engine.memory_saver``'s."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from core.server.http import json_response, read_body, read_optional_body, state_of


class UpdateWeightsFromTensorReqInput(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's: ``serialized_named_tensors`` one ``MultiprocessingSerializer`` payload (base64) per
    tensor-parallel rank; tensors travel as shared-memory / CUDA IPC handles, so the trainer runs
    on this machine."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


class UpdateWeightsFromDistributedReqInput(msgspec.Struct, forbid_unknown_fields=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


class InitWeightsUpdateGroupReqInput(msgspec.Struct, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class GroupNameReqInput(msgspec.Struct, forbid_unknown_fields=True):
    group_name: str = "weight_update_group"


class SelectorReqInput(msgspec.Struct, forbid_unknown_fields=True):
    selector: str = "all"


class EmptyReqInput(msgspec.Struct, forbid_unknown_fields=True):
    pass


class MemoryReqInput(msgspec.Struct, forbid_unknown_fields=True):
    tags: list[str] | None = None  # weights, kv_cache, cuda_graph; None: all


def _answer(result: tuple[bool, str]) -> Response:
    return json_response({"success": result[0], "message": result[1]}, status=200 if result[0] else 400)


def _sync(request: Request) -> Any:
    """The engine's ``WeightSync``, or None (data-parallel replicas: refused, as SGLang asserts)."""
    return getattr(state_of(request).engine, "weight_sync", None)


_NO_DP = (False, "weight updates from a trainer are not supported with --dp-size > 1")
_NO_DP_MEMORY = (False, "releasing memory occupation is not supported with --dp-size > 1")


async def run_update(state: Any, obj: Any, run: Callable[[], Awaitable[tuple[bool, str]]]) -> tuple[bool, str]:
    """A weight update's request fields around ``run()``: ``abort_all_requests`` first, the
    ``weight_version`` recorded on success (every update endpoint, ``/update_weights_from_disk`` too)."""
    if obj.abort_all_requests:
        state.engine.abort_all("aborted to update the weights")
    success, message = await run()
    if success and obj.weight_version is not None:
        state.weight_version = obj.weight_version
        message += f" Weight version updated to {obj.weight_version}."
    return success, message


async def update_weights_from_tensor(request: Request) -> Response:
    obj = await read_body(request, UpdateWeightsFromTensorReqInput)
    if (ws := _sync(request)) is None:
        return _answer(_NO_DP)
    return _answer(await run_update(state_of(request), obj, lambda: ws.update_from_tensor(
        obj.serialized_named_tensors, obj.load_format, obj.flush_cache, obj.torch_empty_cache, obj.selector)))


async def update_weights_from_distributed(request: Request) -> Response:
    obj = await read_body(request, UpdateWeightsFromDistributedReqInput)
    if (ws := _sync(request)) is None:
        return _answer(_NO_DP)
    return _answer(await run_update(state_of(request), obj, lambda: ws.update_from_distributed(
        obj.names, obj.dtypes, obj.shapes, obj.group_name, obj.flush_cache, obj.load_format, obj.torch_empty_cache,
        obj.selector)))


async def init_weights_update_group(request: Request) -> Response:
    obj = await read_body(request, InitWeightsUpdateGroupReqInput)
    if (ws := _sync(request)) is None:
        return _answer(_NO_DP)
    return _answer(await ws.init_group(obj.master_address, obj.master_port, obj.rank_offset, obj.world_size,
                                       obj.group_name, obj.backend))  # (waits for every rank of the group)


async def destroy_weights_update_group(request: Request) -> Response:
    obj = await read_optional_body(request, GroupNameReqInput)
    if (ws := _sync(request)) is None:
        return _answer(_NO_DP)
    return _answer(await ws.destroy_group(obj.group_name))


async def begin_weight_update(request: Request) -> Response:
    obj = await read_optional_body(request, SelectorReqInput)
    return _answer(_NO_DP if (ws := _sync(request)) is None else await ws.begin(obj.selector))


async def end_weight_update(request: Request) -> Response:
    await read_optional_body(request, EmptyReqInput)
    return _answer(_NO_DP if (ws := _sync(request)) is None else await ws.end())


async def release_memory_occupation(request: Request) -> Response:
    obj = await read_optional_body(request, MemoryReqInput)
    saver = getattr(state_of(request).engine, "memory_saver", None)
    return _answer(_NO_DP_MEMORY if saver is None else await saver.release(obj.tags))


async def resume_memory_occupation(request: Request) -> Response:
    obj = await read_optional_body(request, MemoryReqInput)
    saver = getattr(state_of(request).engine, "memory_saver", None)
    return _answer(_NO_DP_MEMORY if saver is None else await saver.resume(obj.tags))
