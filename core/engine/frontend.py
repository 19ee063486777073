"""What every engine front shares: tokenizing, validating and building requests, and
streaming their outputs. ``AsyncEngine`` (one engine in this process) and
``core.engine.data_parallel.engine.DataParallelEngine`` (replicas in other processes) both serve the
HTTP layer through these methods; each supplies ``submit``, ``abort`` and the attributes read
here (``tokenizer``, ``vocab_size``, ``grammar``, ``model_config``, ``allocator`` for the KV
pool's ``pages_for`` / ``capacity``, ``max_total_tokens``).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator

import attrs
import torch

from core.engine.deterministic import request_seed
from core.engine.grammar import AfterReasoning
from core.engine.hidden_states import check_request as check_hidden_request
from core.engine.logit_processor import check as check_processor
from core.engine.request import Req
from core.engine.sampling_params import SamplingParams
from core.errors import CoreError, InvalidRequest, Unavailable


class RequestFrontEnd:
    """Request building and output streaming over an engine's ``submit`` / ``abort``."""

    lora: Any = None  # core.engine.lora.LoRAServing with --enable-lora (one engine in this process only)
    multimodal: Any = None  # core.engine.multimodal.engine.MultimodalServing of a vision-language model

    def tokenize(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        if input_ids is not None:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
                raise InvalidRequest("input_ids must be a list of integers", param="input_ids")
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"input_ids contains token id {bad[0]} outside the vocabulary [0, {self.vocab_size})", param="input_ids")
            return list(input_ids)
        if not isinstance(prompt, str):
            raise InvalidRequest("either a text prompt or input_ids is required", param="text")
        if self.tokenizer is None:
            raise InvalidRequest("the tokenizer is disabled (--skip-tokenizer-init): send input_ids", param="text")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def make_requests(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                      return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                      priority: int | None = None, group: str | None = None, lora_path: str | None = None,
                      images: list | None = None, detokenize: bool = True, return_hidden_states: Any = False,
                      custom_logit_processor: Any = None, token_ids_logprob: Any = None,
                      routed_dp_rank: Any = None) -> list[Req]:
        """Validate and build the sequences of one prompt (n of them); raises InvalidRequest.
        ``group``: the API request they belong to (default ``rid``), which an abort by id also reaches.
        ``lora_path``: the name of a loaded LoRA adapter (SGLang's field name), None: the base model.
        ``images``: decoded images (PIL) for the prompt's image placeholders, in order.
        ``detokenize`` False: no text (a replica whose front end makes it, ``ReqSpec.detokenize``).
        ``return_hidden_states``: SGLang's (True, "last"), within the server's mode (core.engine.hidden_states).
        ``custom_logit_processor``: SGLang's serialized processor (core.engine.logit_processor).
        ``token_ids_logprob``: SGLang's, token ids whose logprobs ``return_logprob`` reports at
        every position it covers (``input_/output_token_ids_logprobs``). ``routed_dp_rank``: SGLang's,
        the data-parallel replica to run on (0 alone without ``--dp-size``)."""
        if self.args.is_embedding:
            raise InvalidRequest("this server runs an embedding or classification model (--is-embedding): it does "
                                 "not generate; use /v1/embeddings, /encode or /classify")
        params.validate(self.vocab_size)
        if (proc := check_processor(custom_logit_processor, self.args.enable_custom_logit_processor,
                                    self.args.speculative_algorithm is not None)) is not None:
            params = attrs.evolve(params, custom_logit_processor=proc)
        asked = self._token_ids(token_ids_logprob)
        dp_rank = self._dp_rank(routed_dp_rank)
        runner = getattr(self, "runner", None)  # (none here: replicas in other processes, --dp-size > 1)
        hidden = check_hidden_request(self.args, return_hidden_states, local=runner is not None)
        lora_id = self._lora_id(lora_path)
        mm = None
        if images:
            if self.multimodal is None:
                raise InvalidRequest(f"the model {self.model_config.source} is text-only (or runs without "
                                     "--enable-multimodal): image inputs are not accepted", param="image_data")
            mm = self.multimodal.prepare(prompt_ids, images)
            prompt_ids = mm.input_ids
        if (c := params.constraint()) is not None and not self.grammar.enabled:
            raise InvalidRequest(f"{c[0]} constraints need a grammar backend, but the server runs with --grammar-backend none"
                                 if self.tokenizer is not None else f"{c[0]} constraints need the tokenizer", param=c[0])
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        ctx = self.model_config.context_len
        if len(prompt_ids) >= ctx:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens, but the context length is {ctx}", param="prompt")
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
            raise InvalidRequest("top_logprobs_num must be an integer in [0, 20]", param="top_logprobs_num")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise InvalidRequest("priority must be an integer", param="priority")
        if not self.args.enable_priority_scheduling:
            if priority is not None and self.args.abort_on_priority_when_disabled:
                raise Unavailable("Using priority is disabled for this server. Please send a new request without a "
                                  "priority.")
        elif priority is None:
            priority = self.args.default_priority_value
        if not isinstance(logprob_start_len, int) or not -1 <= logprob_start_len < len(prompt_ids):
            raise InvalidRequest(f"logprob_start_len must be -1 or in [0, {len(prompt_ids)})", param="logprob_start_len")
        params = SamplingParams(**{**_asdict(params), "max_new_tokens": min(params.max_new_tokens, ctx - len(prompt_ids))})
        if self.allocator.pages_for(len(prompt_ids) + params.max_new_tokens) > self.allocator.capacity:
            raise InvalidRequest(
                f"the request needs {len(prompt_ids) + params.max_new_tokens} tokens of KV cache but the pool holds "
                f"{self.max_total_tokens}; lower max_new_tokens or raise --max-total-tokens", param="max_new_tokens")
        rid = rid or uuid.uuid4().hex
        if hidden:
            runner.hidden_states = True  # its batches are checked for them from now on
        reqs = []
        for i in range(params.n):
            seed = request_seed(params.seed, self.args.enable_deterministic_inference)
            seed = None if seed is None else seed + i
            gen = None if seed is None else torch.Generator().manual_seed(seed)
            detok = None
            if self.tokenizer is not None and detokenize:
                from core.engine.detokenizer import IncrementalDetokenizer

                detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                               spaces_between_special_tokens=params.spaces_between_special_tokens,
                                               stop=params.stop, no_stop_trim=params.no_stop_trim,
                                               stop_regex=params.stop_regex)
            reqs.append(Req(rid if params.n == 1 else f"{rid}-{i}", prompt_ids, params, return_logprob, top_logprobs_num,
                            logprob_start_len, gen, detok, priority=priority, group=group or rid, lora_id=lora_id, mm=mm,
                            return_hidden_states=hidden, token_ids_logprob=asked, routed_dp_rank=dp_rank))
        return reqs

    def _dp_rank(self, rank: Any) -> int | None:
        """A request's routed_dp_rank checked: a live replica's index (SGLang's 400 otherwise); 0
        without --dp-size is no choice at all (None)."""
        if rank is None:
            return None
        replicas = max(1, getattr(self.args, "dp_size", 1))
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < replicas:
            raise InvalidRequest(f"routed_dp_rank={rank!r} out of range [0, {replicas})", param="routed_dp_rank")
        if (router := getattr(self, "router", None)) is not None and rank not in router.live:
            raise Unavailable(f"DP rank {rank} is not active")
        return rank if replicas > 1 else None

    def _token_ids(self, ids: Any) -> list[int] | None:
        """A request's token_ids_logprob as a list of token ids (None for none); SGLang's forms: a
        list, or one id."""
        if ids is None or ids == []:
            return None
        ids = [ids] if isinstance(ids, int) and not isinstance(ids, bool) else ids
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("token_ids_logprob must be a list of token ids (integers)", param="token_ids_logprob")
        if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
            raise InvalidRequest(f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; valid range is "
                                 f"[0, {self.vocab_size})", param="token_ids_logprob")
        return ids

    def _lora_id(self, name: Any) -> int:
        """The uid of LoRA adapter ``name`` (0: none named); InvalidRequest naming the problem."""
        if name is None or name == "":
            return 0
        if not isinstance(name, str):
            raise InvalidRequest(f"lora_path must be an adapter name (a string), got {type(name).__name__}", param="lora_path")
        if self.lora is None:
            raise InvalidRequest(f"LoRA adapter {name!r} requested, but the server runs without --enable-lora",
                                 param="lora_path")
        try:
            return self.lora.resolve(name)
        except CoreError as e:
            raise InvalidRequest(str(e), param="lora_path") from e

    def offline_media_policy(self) -> Any:
        """The offline API's image policy: the engine's media flags, local paths allowed (the caller
        runs on this machine), URLs unless the process runs offline."""
        from core.engine.multimodal.images import MediaPolicy

        return attrs.evolve(MediaPolicy.from_args(self.args), allow_local=True)

    # ---- LoRA adapters at run time (SGLang's /load_lora_adapter, /unload_lora_adapter)
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapter name -> path ({} without --enable-lora)."""
        return {} if self.lora is None else self.lora.adapters()

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Load the peft adapter in folder ``path`` as ``name``; CoreError naming the problem."""
        if self.lora is None:
            raise InvalidRequest("LoRA adapters need a server started with --enable-lora", param="lora_name")
        await self.lora.load(name, path, pinned)

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests cannot name it, running ones finish with it."""
        if self.lora is None:
            raise InvalidRequest("LoRA adapters need a server started with --enable-lora", param="lora_name")
        await self.lora.unload(name)

    async def prepare_grammars(self, reqs: list[Req]) -> None:
        """Compile (off the loop, cached) and attach each constrained request's matcher;
        raises InvalidRequest with the backend's message for an invalid spec."""
        for r in reqs:
            if r.constraint is not None and r.grammar is None:
                r.grammar = await self.grammar.compile(*r.constraint, options=r.params.json_options)
                if (gate := r.params.reasoning_gate) is not None:  # (the answer after the reasoning)
                    r.grammar = AfterReasoning(r.grammar, gate)

    async def stream(self, req: Req) -> AsyncIterator[dict]:
        """Yield the request's cumulative output after each step until it finishes (steps the
        consumer fell behind on coalesce into one chunk: the newest output, the final one never
        lost); an abandoned consumer (cancelled task, closed generator) aborts the request."""
        try:
            while True:
                await req.next_update()
                done = req.finished  # read before yielding: it may finish while the consumer is away
                yield self.output(req)
                if done:
                    return
        finally:
            if not req.finished:
                self.abort(req.rid)

    @staticmethod
    def output(req: Req) -> dict:
        return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": req.meta_info()}

    async def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                       input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                       logprob_start_len: int | list[int] | None = -1, top_logprobs_num: int | list[int] = 0,
                       stream: bool = False, rid: str | list[str] | None = None,
                       lora_path: str | list[str | None] | None = None, image_data: Any = None,
                       return_hidden_states: Any = False, custom_logit_processor: Any = None,
                       token_ids_logprob: Any = None, routed_dp_rank: Any = None) -> Any:
        """SGLang's generate: one prompt -> dict (a list when n > 1); a batch -> list. ``rid``,
        ``return_logprob``, ``logprob_start_len`` and ``top_logprobs_num`` may be lists aligned with a batch
        (``per_item``: None, SGLang's default, and None entries are ours).
        With ``stream`` an async iterator of cumulative outputs (batch chunks carry ``index``).
        ``lora_path``: an adapter name for every prompt, or a list aligned with the batch.
        ``image_data``: SGLang's forms: an image (a PIL image, a path, a URL, a data URI or base64)
        or a list of them for one prompt; for a batch, a list aligned with it. ``return_hidden_states``:
        SGLang's (True, "last"; a list aligned with a batch), in ``meta_info["hidden_states"]``.
        ``custom_logit_processor``: SGLang's ``CustomLogitProcessor.to_str()`` (or a list aligned with a
        batch), with ``--enable-custom-logit-processor``; its ``custom_params`` in ``sampling_params``."""
        batch = isinstance(prompt, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
        prompts: list = (prompt if isinstance(prompt, list) else input_ids) if batch else [input_ids if input_ids is not None else prompt]
        is_ids = input_ids is not None
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(sps) != len(prompts):
            raise InvalidRequest("sampling_params list must match the number of prompts", param="sampling_params")
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequest("lora_path list must match the number of prompts", param="lora_path")
        from core.engine.multimodal.images import images_per_prompt, load_prompt_images

        images = images_per_prompt(image_data, len(prompts), batch)
        if any(images):  # (the offline Engine sends them decoded, on its caller's thread: these pass through)
            images = load_prompt_images(images, self.offline_media_policy(), batch)
        n = len(prompts)
        rids = batch_rids(rid, n, batch)
        lps = per_item(return_logprob, n, "return_logprob", False)
        starts = per_item(logprob_start_len, n, "logprob_start_len", -1)
        tops = per_item(top_logprobs_num, n, "top_logprobs_num", 0)
        hiddens = per_item(return_hidden_states, n, "return_hidden_states", False)
        procs = per_item(custom_logit_processor, n, "custom_logit_processor", None)
        asked = token_ids_per_item(token_ids_logprob, n)
        groups = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            params = sp if isinstance(sp, SamplingParams) else SamplingParams.from_dict(sp)
            ids = self.tokenize(None if is_ids else p, p if is_ids else None)
            if isinstance(sp, dict):  # an explicit max_new_tokens must fit (an omitted one is cut to what fits)
                check_total(len(ids), sp.get("max_new_tokens"), self.model_config.context_len)
            groups.append(self.make_requests(ids, params, rids[i], bool(lps[i]), starts[i], tops[i],
                                             group=rid if isinstance(rid, str) else rids[i],  # (an abort by it: all)
                                             lora_path=loras[i], images=images[i], return_hidden_states=hiddens[i],
                                             custom_logit_processor=procs[i], token_ids_logprob=asked[i],
                                             routed_dp_rank=routed_dp_rank))
        reqs = [r for g in groups for r in g]
        await self.prepare_grammars(reqs)
        self.submit(reqs)
        if stream:  # (one request: its stream itself, without the batch's layers around it)
            return self.stream(reqs[0]) if len(reqs) == 1 else self._stream_many(reqs)
        try:
            await asyncio.gather(*(self.drain(r) for r in reqs))
        finally:
            for r in reqs:
                if not r.finished:
                    self.abort(r.rid)
        outs = [self.output(r) for r in reqs]
        return outs if batch or len(outs) > 1 else outs[0]

    async def drain(self, req: Req) -> None:
        """Wait until the request finishes (aborting it if the wait is cancelled); one wake-up, at the end."""
        try:
            await req.wait_finished()
        finally:
            if not req.finished:
                self.abort(req.rid)

    async def _stream_many(self, reqs: list[Req]) -> AsyncIterator[dict]:
        async for i, out in self.stream_many(reqs):
            yield out if len(reqs) == 1 else {**out, "index": i}

    async def stream_many(self, reqs: list[Req]) -> AsyncIterator[tuple[int, dict]]:
        """(index, cumulative output) as each request advances: ``advances`` with each output."""
        if len(reqs) == 1:
            async for out in self.stream(reqs[0]):
                yield 0, out
            return
        inner = self.advances(reqs)
        try:
            async for i in inner:
                yield i, self.output(reqs[i])
        finally:
            await inner.aclose()  # (now: its abort of the unfinished must not wait for the collector)

    async def advances(self, reqs: list[Req]) -> AsyncIterator[int]:
        """Each request's index as it advances, until all finish (a request's steps the consumer
        fell behind on coalesce, as in ``stream``; its last is never lost); closing the iterator
        early aborts the unfinished ones. No output is built: a consumer that reads the requests
        itself (the native HTTP stream) pays for none. The requests' ``notify`` feeds one shared
        ready set: no task per request, one wake-up per step at most."""
        feed = _Feed()
        watch = feed.watch  # one bound method, compared by identity below
        index = {r: i for i, r in enumerate(reqs)}
        for r in reqs:
            r.watcher = watch
            if r.updated:
                feed.ready[r] = None
        left = len(reqs)
        try:
            while left:
                if not feed.ready:
                    await feed.wait()
                while feed.ready:
                    r = next(iter(feed.ready))
                    del feed.ready[r]
                    r.updated = False
                    done = r.finished  # read before yielding, as in stream
                    if done:
                        r.watcher = None
                        left -= 1
                    yield index[r]
        finally:
            for r in reqs:
                if r.watcher is watch:
                    r.watcher = None
                if not r.finished:
                    self.abort(r.rid)


class _Feed:
    """``stream_many``'s shared state: the requests notified since it last looked (in order) and
    the future its consumer waits on while there are none."""

    __slots__ = ("ready", "fut")

    def __init__(self) -> None:
        self.ready: dict[Req, None] = {}
        self.fut: asyncio.Future | None = None

    def watch(self, req: Req) -> None:
        self.ready[req] = None
        if (f := self.fut) is not None:
            self.fut = None
            if not f.done():
                f.set_result(None)

    async def wait(self) -> None:
        fut = self.fut = asyncio.get_running_loop().create_future()
        try:
            await fut
        finally:
            if self.fut is fut:
                self.fut = None


def _asdict(params: SamplingParams) -> dict:
    return attrs.asdict(params, recurse=False)


def per_item(value: Any, n: int, name: str, default: Any) -> list:
    """A generate argument per prompt, as SGLang takes it: a list aligned with a batch's prompts (a
    None entry: the default), or one value for each."""
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequest(f"{name} has {len(value)} entries but there are {n} prompts", param=name)
        return [default if v is None else v for v in value]
    return [value] * n


def token_ids_per_item(value: Any, n: int) -> list:
    """SGLang's token_ids_logprob per prompt: a list of lists aligned with a batch, else the same
    ids (a list, or one id) for every prompt."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        if len(value) != n:
            raise InvalidRequest(f"token_ids_logprob has {len(value)} lists but there are {n} prompts",
                                 param="token_ids_logprob")
        return value
    return [value] * n


def batch_rids(rid: Any, n: int, batch: bool) -> list:
    """Each prompt's request id: a list as given; a string for a batch expanded as SGLang does (``rid_i``)."""
    if isinstance(rid, list):
        if not batch:
            raise InvalidRequest("rid is a list but there is a single prompt", param="rid")
        return per_item(rid, n, "rid", None)
    return [rid] if not batch else [None if rid is None else f"{rid}_{i}" for i in range(n)]


def check_total(prompt_len: int, max_new_tokens: Any, context_len: int) -> None:
    """SGLang's rule: an explicit ``max_new_tokens`` that cannot fit beside the prompt is an error
    (an omitted one is cut to what fits); a prompt that alone is too long gets its own error."""
    if not isinstance(max_new_tokens, int) or prompt_len >= context_len or prompt_len + max_new_tokens <= context_len:
        return
    raise InvalidRequest(f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                         f"You requested a total of {prompt_len + max_new_tokens} tokens: {prompt_len} tokens from the "
                         f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
                         "tokens in the input messages or the completion to fit within the limit.", param="max_new_tokens")
