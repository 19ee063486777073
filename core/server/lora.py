"""Multi-LoRA serving over HTTP: SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter``,
and which adapter a request runs under.

* ``/generate`` (and the OpenAI endpoints' ``lora_path`` extension): an adapter name for every
  prompt, or a list aligned with a batch's prompts; ``null`` or ``""`` is the base model.
* OpenAI ``model``, as SGLang reads it: ``"<base>:<adapter>"`` picks the adapter (SGLang's
  split: the served name and a colon, else the first colon), as does a loaded adapter's own name;
  the served name, or any other name without a colon, is the base model. The adapter from
  ``model`` wins over ``lora_path``.
* An adapter that is not loaded, or any adapter without ``--enable-lora``, is a 400 naming it.
* ``/load_lora_adapter`` / ``/unload_lora_adapter`` answer SGLang's ``LoRAUpdateOutput``
  (``success``, ``error_message``, ``loaded_adapters``: name -> path) with 200; a refusal is a
  400 whose body is that object (``success: false``) plus the OpenAI-shaped ``error`` object
  every other endpoint answers with.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response

from core.engine.config import lora_requested
from core.errors import CoreError, InvalidRequest
from core.server.http import api_error, json_response, read_body, state_of

log = structlog.get_logger("core.server.lora")


# ---------------------------------------------------------------------------- which adapter
def lora_enabled(engine: Any) -> bool:
    return lora_requested(getattr(engine, "args", None))


def loaded_adapters(engine: Any) -> dict[str, str]:
    """Loaded adapter name -> path (empty without ``--enable-lora``)."""
    if not lora_enabled(engine):
        return {}
    listing = getattr(engine, "lora_adapters", None)
    return dict(listing()) if listing is not None else {}


def check_adapter(engine: Any, name: str, param: str) -> None:
    """A 400 naming ``name`` unless it is a loaded adapter."""
    if not lora_enabled(engine):
        raise InvalidRequest(f"LoRA adapter {name!r} was requested, but LoRA is not enabled: start the server with "
                             "--enable-lora and load adapters with --lora-paths or POST /load_lora_adapter", param=param)
    loaded = loaded_adapters(engine)
    if name not in loaded:
        raise InvalidRequest(f"LoRA adapter {name!r} is not loaded; loaded adapters: "
                             f"{', '.join(sorted(loaded)) or 'none'}", param=param)


def adapters_per_item(engine: Any, value: Any, n: int, param: str = "lora_path") -> list[str | None]:
    """``lora_path`` for each of ``n`` prompts: one name for all, or a list aligned with them."""
    if value is None:
        return [None] * n
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequest(f"{param} has {len(value)} entries but there are {n} prompts", param=param)
        items = value
    else:
        items = [value] * n
    for v in items:
        if v is not None and not isinstance(v, str):
            raise InvalidRequest(f"{param} must be an adapter name, null, or a list of them", param=param)
    names = [v or None for v in items]
    for name in dict.fromkeys(v for v in names if v):
        check_adapter(engine, name, param)
    return names


def split_model(model: str, served: str) -> tuple[str, str | None]:
    """SGLang's ``_parse_model_parameter``: ``"base:adapter"`` -> (base, adapter). The served
    name itself (colons and all) has no adapter; a name starting with it and a colon splits there,
    any other name at its first colon."""
    if ":" not in model or model == served:
        return model, None
    if model.startswith(f"{served}:"):
        base, adapter = served, model[len(served) + 1:]
    else:
        base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


def request_adapters(state: Any, model: str | None, lora_path: Any, n: int) -> list[str | None]:
    """The adapter of each of an OpenAI request's ``n`` prompts: from ``model`` (an adapter's
    name, or ``base:adapter``), else from ``lora_path``. Without ``--enable-lora`` a colon in a
    name other than ``<served name>:...`` is not read as an adapter (any model name is accepted)."""
    engine, served = state.engine, state.served_model_name
    if model and model != served:
        if model in loaded_adapters(engine):
            return [model] * n
        base, adapter = split_model(model, served)
        if adapter is not None and (lora_enabled(engine) or base == served):
            check_adapter(engine, adapter, "model")
            return [adapter] * n
    return adapters_per_item(engine, lora_path, n)


def lora_kwargs(name: str | None) -> dict[str, str]:
    """``make_requests`` keyword arguments for an adapter (none for the base model)."""
    return {"lora_path": name} if name else {}


# ---------------------------------------------------------------------------- load / unload
class LoadLoRAAdapterReqInput(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's LoadLoRAAdapterReqInput. ``lora_id`` is SGLang's internal id: accepted only unset."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: Any = None


class UnloadLoRAAdapterReqInput(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's UnloadLoRAAdapterReqInput (``lora_id`` as above)."""

    lora_name: str
    lora_id: Any = None


def _check_names(obj: Any) -> None:
    if obj.lora_id is not None:
        raise InvalidRequest("lora_id is assigned by the server; leave it unset", param="lora_id")
    if not obj.lora_name.strip():
        raise InvalidRequest("lora_name is empty", param="lora_name")
    if isinstance(obj, LoadLoRAAdapterReqInput) and not obj.lora_path.strip():
        raise InvalidRequest("lora_path is empty", param="lora_path")


def _lora_method(engine: Any, name: str) -> Any:
    if not lora_enabled(engine):
        raise InvalidRequest("LoRA is not enabled: start the server with --enable-lora")
    method = getattr(engine, name, None)
    if method is None:
        raise InvalidRequest("this server's engine cannot load or unload LoRA adapters")
    return method


async def _answer(engine: Any, obj: Any, update: Callable[[], Awaitable[None]], event: str) -> Response:
    """Run ``update`` (a load or unload) and answer SGLang's LoRAUpdateOutput; a refusal is a 400
    with the error object beside it."""
    try:
        _check_names(obj)
        await update()
    except CoreError as e:
        err = api_error(e)
        log.warning(f"{event}_refused", lora_name=obj.lora_name, reason=err.message)
        return json_response({"success": False, "error_message": err.message,
                              "loaded_adapters": loaded_adapters(engine), **err.to_dict()}, status=err.status)
    log.info(event, lora_name=obj.lora_name, lora_path=getattr(obj, "lora_path", None))
    return json_response({"success": True, "error_message": "", "loaded_adapters": loaded_adapters(engine)})


async def load_lora_adapter(request: Request) -> Response:
    """SGLang's POST /load_lora_adapter {lora_name, lora_path, pinned}."""
    engine = state_of(request).engine
    obj = await read_body(request, LoadLoRAAdapterReqInput)  # a malformed body: the plain error object
    return await _answer(engine, obj, lambda: _lora_method(engine, "load_lora_adapter")(
        obj.lora_name, obj.lora_path, pinned=obj.pinned), "lora.load")


async def unload_lora_adapter(request: Request) -> Response:
    """SGLang's POST /unload_lora_adapter {lora_name}: requests already running under the adapter finish first."""
    engine = state_of(request).engine
    obj = await read_body(request, UnloadLoRAAdapterReqInput)
    return await _answer(engine, obj, lambda: _lora_method(engine, "unload_lora_adapter")(obj.lora_name), "lora.unload")
