"""SGLang's /start_profile and /stop_profile: a torch profiler trace of the engine's steps
(``core.engine.profiler``)."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest
from core.server.http import decode_body, json_response, read_limited, state_of
from core.server.state import ServerState


class ProfileReqInput(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's ProfileReqInput (the fields this engine serves; the others must stay unset)."""

    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_prefix: str | None = None
    start_step: int | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False


def _profiler(state: ServerState) -> Any:
    profiler = getattr(state.engine, "profiler", None)  # (replicas in other processes: their calls)
    if profiler is None:
        raise InvalidRequest("this engine does not support profiling")
    return profiler


async def start_profile(request: Request) -> Response:
    """SGLang's /start_profile: a torch profiler trace of the next forward steps (all of them until
    /stop_profile, or ``num_steps``). The body is optional."""
    state = state_of(request)
    raw = await read_limited(request)
    obj = decode_body(raw, ProfileReqInput) if raw.strip() else ProfileReqInput()
    for name in ("start_step", "profile_by_stage", "merge_profiles"):
        if getattr(obj, name) not in (None, False):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    path = await _profiler(state).start(obj.output_dir, obj.num_steps, obj.activities, bool(obj.with_stack),
                                        bool(obj.record_shapes), obj.profile_prefix)
    return json_response({"message": "Start profiling.", "trace": path})


async def stop_profile(request: Request) -> Response:
    """SGLang's /stop_profile: stop the trace and write it; answers with its file."""
    path = await _profiler(state_of(request)).stop()
    return json_response({"message": "Stop profiling.", "trace": path})
