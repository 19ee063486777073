"""SGLang's offline API: ``Engine`` runs an ``AsyncEngine`` on a private loop thread and
offers blocking and async ``generate``, ``encode``, LoRA adapter loading and ``shutdown``."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, AsyncIterator, Iterator

from core.log import configure_default_logging

configure_default_logging()  # before the engine modules load: their logs go to stderr, not the user's stdout

from core.engine.config import engine_args_from_kwargs  # noqa: E402
from core.engine.data_parallel.engine import create_engine  # noqa: E402
from core.engine.model_loader.weights_by_name import weights_by_name  # noqa: E402
from core.engine.sampling_params import check_preferred, under_preferred  # noqa: E402
from core.errors import CoreError  # noqa: E402


@dataclasses.dataclass
class LoRAUpdateOutput:
    """SGLang's answer to a LoRA load or unload: the adapters loaded now (name -> path). A
    refusal raises instead of answering ``success=False``."""

    success: bool = True
    error_message: str = ""
    loaded_adapters: dict[str, str] = dataclasses.field(default_factory=dict)


def _lora(lora_path: Any) -> dict[str, Any]:
    """``AsyncEngine.generate`` keyword arguments for ``lora_path`` (none when unset)."""
    return {} if lora_path is None else {"lora_path": lora_path}


def _images(engine: Any, image_data: Any, prompt: Any, input_ids: Any) -> dict[str, Any]:
    """``AsyncEngine.generate`` keyword arguments for ``image_data`` (none when unset): SGLang's
    forms (see ``images_per_prompt``), decoded here (``engine.offline_media_policy``: its media flags,
    local files allowed, URLs fetched unless the process runs offline), on the caller's thread, so
    that no URL fetch or decoding runs on the engine loop. Decoded: a list of RGB images for one
    prompt, a list of such lists for a batch."""
    if image_data is None:
        return {}
    from core.engine.multimodal.images import images_per_prompt, load_prompt_images

    batch = isinstance(prompt, list) or (isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list))
    n = len(prompt if isinstance(prompt, list) else input_ids) if batch else 1
    per_prompt = load_prompt_images(images_per_prompt(image_data, n, batch), engine.offline_media_policy(), batch)
    return {"image_data": per_prompt if batch else per_prompt[0]}


async def _lora_update(engine: Any, update: Any) -> LoRAUpdateOutput:
    """Run a load or unload on the engine loop; answer with the adapters loaded after it."""
    await update
    return LoRAUpdateOutput(loaded_adapters=dict(engine.lora_adapters()))


class Engine:
    """SGLang's offline engine: ``Engine(model_path=...)``, ``generate``, ``async_generate``,
    ``load_lora_adapter`` / ``unload_lora_adapter``, the weight updates an RL trainer drives, ``shutdown``."""

    _preferred: dict[str, Any] | None = None  # SGLang's preferred_sampling_params: what requests leave unset

    def __init__(self, **kwargs: Any) -> None:
        self._preferred = kwargs.pop("preferred_sampling_params", None) or None
        check_preferred(self._preferred, "preferred_sampling_params")
        args = engine_args_from_kwargs(kwargs)
        configure_default_logging(args.log_level)  # unless the application configured structlog itself
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="core-engine-loop", daemon=True)
        self._thread.start()
        try:
            self.engine = create_engine(args)  # an AsyncEngine, or replicas with dp_size > 1
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self.tokenizer = self.engine.tokenizer

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data: Any = None, *,
                 return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] | None = -1,
                 top_logprobs_num: int | list[int] = 0, stream: bool = False, rid: str | list[str] | None = None,
                 lora_path: str | list[str | None] | None = None, return_hidden_states: Any = False,
                 custom_logit_processor: str | list[str | None] | None = None, token_ids_logprob: Any = None,
                 routed_dp_rank: int | None = None, data_parallel_rank: int | None = None) -> Any:
        """SGLang's ``Engine.generate``: its first four parameters in its order, the rest by name
        (``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``return_hidden_states`` and ``rid``
        may be lists aligned with a batch). ``lora_path``: a loaded LoRA adapter's name for every prompt, or a list aligned with a
        batch of prompts (None or "" = the base model). ``image_data`` (a vision-language model):
        one prompt's image or list of images, or a list aligned with the batch, each a PIL image,
        a path, a data URI, base64, bytes or an http(s) URL; the prompt holds the images'
        placeholders (as the model's chat template writes them). ``custom_logit_processor``: SGLang's
        ``CustomLogitProcessor.to_str()`` (``enable_custom_logit_processor=True``), its
        ``custom_params`` in ``sampling_params``. ``token_ids_logprob``: token ids whose logprobs
        ``return_logprob`` reports at each position (a list of lists for a batch). ``routed_dp_rank``
        (or SGLang's old name ``data_parallel_rank``): the data-parallel replica to run on."""
        images = _images(self.engine, image_data, prompt, input_ids)
        sampling_params = self._with_preferred(sampling_params)
        result = self._call(self.engine.generate(prompt, sampling_params, input_ids, return_logprob,
                                                 logprob_start_len, top_logprobs_num, stream, rid,
                                                 **_lora(lora_path), **images, return_hidden_states=return_hidden_states,
                                                 custom_logit_processor=custom_logit_processor,
                                                 token_ids_logprob=token_ids_logprob,
                                                 routed_dp_rank=_dp_rank(routed_dp_rank, data_parallel_rank)))
        return self._iter_sync(result) if stream else result

    def _with_preferred(self, sampling_params: Any) -> Any:
        """``sampling_params`` (a dict, None or a list of them) over ``preferred_sampling_params``,
        as SGLang merges them: the request's keys win."""
        if self._preferred is None:
            return sampling_params
        if isinstance(sampling_params, list):
            return [under_preferred(self._preferred, sp) if sp is None or isinstance(sp, dict) else sp
                    for sp in sampling_params]
        if sampling_params is None or isinstance(sampling_params, dict):
            return under_preferred(self._preferred, sampling_params)
        return sampling_params

    def _iter_sync(self, agen) -> Iterator[dict]:
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data: Any = None, *,
                             return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] | None = -1,
                             top_logprobs_num: int | list[int] = 0, stream: bool = False,
                             rid: str | list[str] | None = None, lora_path: str | list[str | None] | None = None,
                             return_hidden_states: Any = False,
                             custom_logit_processor: str | list[str | None] | None = None,
                             token_ids_logprob: Any = None, routed_dp_rank: int | None = None,
                             data_parallel_rank: int | None = None) -> Any:
        images = await asyncio.to_thread(_images, self.engine, image_data, prompt, input_ids) if image_data is not None else {}
        fut = asyncio.run_coroutine_threadsafe(
            self.engine.generate(prompt, self._with_preferred(sampling_params), input_ids, return_logprob, logprob_start_len,
                                 top_logprobs_num, stream, rid, **_lora(lora_path), **images,
                                 return_hidden_states=return_hidden_states, custom_logit_processor=custom_logit_processor,
                                 token_ids_logprob=token_ids_logprob,
                                 routed_dp_rank=_dp_rank(routed_dp_rank, data_parallel_rank)),
            self._loop)
        result = await asyncio.wrap_future(fut)
        return self._iter_async(result) if stream else result

    async def _iter_async(self, agen) -> AsyncIterator[dict]:
        """The engine loop's stream, re-yielded on the caller's loop. A pump task on the engine
        loop hands the chunks over in batches: those yielded in one turn of the engine loop (a
        step's worth, at most one per request) go over with one ``call_soon_threadsafe`` (one
        cross-thread wake-up per step, not per chunk: at 256 streams, a wake-up per chunk cost
        more than the forward of a small model); chunks that pile up while the caller is busy are
        coalesced to the newest per request (they are cumulative). Leaving early cancels the pump,
        which closes the stream and aborts what is unfinished."""
        caller, engine_loop = asyncio.get_running_loop(), self._loop
        inbox: asyncio.Queue = asyncio.Queue()  # lists of chunks; a list ends with `done` or an error at the end
        done = object()

        async def pump() -> None:
            batch: list = []

            def send() -> None:  # on the engine loop, once the chunks of this turn are in
                if batch:
                    items = batch[:]
                    batch.clear()
                    caller.call_soon_threadsafe(inbox.put_nowait, items)

            try:
                async for chunk in agen:
                    if not batch:
                        engine_loop.call_soon(send)
                    batch.append(chunk)
            except BaseException as e:  # an engine error reaches the caller; a cancel ends the pump
                if not isinstance(e, asyncio.CancelledError):
                    batch.append(e)
                    send()
                raise
            finally:
                await agen.aclose()  # an unfinished request is aborted
            batch.append(done)
            send()

        fut = asyncio.run_coroutine_threadsafe(pump(), engine_loop)
        try:
            while True:
                pending = {}  # request index -> newest chunk, in arrival order
                end = None
                items = await inbox.get()
                while True:
                    for item in items:
                        if item is done or isinstance(item, BaseException):
                            end = item
                            break
                        pending[item.get("index")] = item
                    if end is not None or inbox.empty():
                        break
                    items = inbox.get_nowait()
                for chunk in pending.values():
                    yield chunk
                if end is done:
                    return
                if end is not None:
                    raise end
        finally:
            if not fut.done():
                fut.cancel()
                try:
                    await asyncio.wrap_future(fut)
                except BaseException:  # noqa: S110 - the pump's cancel (or its error, already raised)
                    pass

    def encode(self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None) -> Any:
        """SGLang's ``Engine.encode``: ``{"embedding": [...], "meta_info": ...}`` per prompt
        (a list for a batch); a classification model's ``embedding`` holds its scores."""
        batch = isinstance(prompt, list) or bool(input_ids and isinstance(input_ids[0], list))
        items = (prompt if isinstance(prompt, list) else input_ids) if batch else [input_ids if input_ids is not None else prompt]
        ids = [self.engine.tokenize(None if input_ids is not None else p, p if input_ids is not None else None) for p in items]
        embs = self._call(self.engine.encode(ids))
        outs = [{"embedding": e, "meta_info": {"prompt_tokens": len(i)}} for e, i in zip(embs, ids)]
        return outs if batch else outs[0]

    # ---- LoRA adapters (``--enable-lora``), SGLang's offline methods; a refusal raises CoreError
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoRAUpdateOutput:
        """Load a peft adapter folder as ``lora_name`` (``pinned``: never evicted)."""
        return self._call(_lora_update(self.engine, self.engine.load_lora_adapter(lora_name, lora_path, pinned)))

    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        """Unload an adapter; requests already running under it finish first."""
        return self._call(_lora_update(self.engine, self.engine.unload_lora_adapter(lora_name)))

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoRAUpdateOutput:
        coro = _lora_update(self.engine, self.engine.load_lora_adapter(lora_name, lora_path, pinned))
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def async_unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        coro = _lora_update(self.engine, self.engine.unload_lora_adapter(lora_name))
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # ---- weights from a trainer (SGLang's RL interface: core.engine.model_loader.weight_sync); (success, message)
    def _sync(self) -> Any:
        ws = getattr(self.engine, "weight_sync", None)
        if ws is None:
            raise CoreError("weight updates from a trainer are not supported with --dp-size > 1")
        return ws

    def _saver(self) -> Any:
        if (saver := getattr(self.engine, "memory_saver", None)) is None:
            raise CoreError("releasing memory occupation is not supported with --dp-size > 1")
        return saver

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        """``named_tensors``: ``[(name, tensor)]`` (Hugging Face names; ``load_format="direct"``: the
        server's parameter names), SGLang's per-rank ``LocalSerializedTensor`` values, or with
        ``load_format="flattened_bucket"`` a bucket (or its serialized payloads). Waits for the
        running requests; ``flush_cache=False`` keeps the prefix cache (more updates to come)."""
        return self._call(self._sync().update_from_tensor(named_tensors, load_format, flush_cache))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> tuple[bool, str]:
        """Join the trainer's process group (rank 0 is the trainer); blocks until every rank joined."""
        return self._call(self._sync().init_group(master_address, master_port, rank_offset, world_size, group_name,
                                                  backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: str | None = None) -> tuple[bool, str]:
        """Receive ``names`` from the trainer's broadcasts (in this order) and load them."""
        return self._call(self._sync().update_from_distributed(names, dtypes, shapes, group_name, flush_cache, load_format))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        return self._call(self._sync().destroy_group(group_name))

    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        return self._call(self._sync().begin(selector))

    def end_weight_update(self) -> tuple[bool, str]:
        return self._call(self._sync().end())

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """``--enable-memory-saver``: free ``tags`` (``weights``, ``kv_cache``, ``cuda_graph``; None: all)
        for a colocated trainer, after the running requests; requests wait until they are back."""
        ok, message = self._call(self._saver().release(tags))
        if not ok:
            raise CoreError(message)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        ok, message = self._call(self._saver().resume(tags))
        if not ok:
            raise CoreError(message)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        """Reload the weights from ``model_path`` (same architecture), after the running requests."""
        ok, message = self._call(self.engine.update_weights_from_disk(model_path, load_format=load_format or "auto"))
        return ok, message, 0

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows of a parameter by its checkpoint name (float32 lists)."""
        if not hasattr(self.engine, "model"):
            return self._call(self.engine.weights_by_name(name, truncate_size))[0]
        return self._call(_run(weights_by_name, self.engine.model, name, truncate_size))

    def flush_cache(self) -> bool:
        """Empty the prefix cache (False, as SGLang's, while requests are running)."""
        return self._call(_run(self.engine.flush_cache))

    def freeze_gc(self) -> None:
        """SGLang's ``Engine.freeze_gc``: what the engine holds now (its model, modules, warm-up)
        leaves later garbage-collector passes, whose full scans otherwise stall every stream
        (``core.engine.gc_watch``). Call it after a warm-up; ``core serve`` does so itself."""
        self._call(self.engine.freeze_gc())

    def abort_request(self, rid: str) -> bool:
        return self._call(_run(self.engine.abort, rid))

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self.engine.shutdown())
        self._call(_settle())  # let blocked generate() callers observe their aborted requests
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


async def _settle(timeout: float = 10.0) -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if others:
        await asyncio.wait(others, timeout=timeout)


async def _run(fn, *a):
    return fn(*a)


def _dp_rank(routed_dp_rank: int | None, data_parallel_rank: int | None) -> int | None:
    """SGLang's routed_dp_rank, or its deprecated name data_parallel_rank."""
    return data_parallel_rank if routed_dp_rank is None else routed_dp_rank
