"""Wire types of the OpenAI-compatible API (msgspec Structs), requests and responses.

Unknown-field policy of /v1/chat/completions and /v1/completions (batch lines included): no
field is dropped silently. A top-level key that is not a field of the request Struct is, per
``core.server.openai.job.check_fields``:

* in :data:`IGNORED_FIELDS` (other servers' and clients' hints that change nothing in the
  output: OpenAI's ``store``, ``metadata``, ``service_tier``, ``prompt_cache_key``...): ignored,
  with one warning per field name per process;
* in :data:`NOOP_FIELDS` (other servers' features this engine lacks, such as vLLM's
  ``use_beam_search`` or OpenAI's ``modalities``): accepted only at the value that turns the
  feature off (``null`` included), else a 400 naming the field;
* anything else: a 400 naming the field (``param``), so a typo or a feature this server lacks
  is never answered with a 200 that quietly did something else.

Fields that are known but whose feature this engine lacks (``best_of`` != ``n``; ``suffix``
without ``--completion-template``) are declared here and rejected with a 400 by the chat and completions modules. vLLM's
structured output (``structured_outputs`` and the older ``guided_*`` fields) and its names for
SGLang's options (``include_stop_str_in_output``, ``request_id``) are fields too, mapped in
``core.server.openai.job``. Nested objects are lenient except ``structured_outputs``.

Types are checked strictly by msgspec (an int field rejects ``1.0``, ``"1"`` and
``true``; a float field accepts ints). Optional numeric fields also accept ``null``,
which means "use the default", because several client libraries send explicit nulls.
Range checks live in ``core.server.openai.job`` / ``SamplingParams.validate`` so that every
error names the field.

Responses are encoded with ``msgspec.json`` (``core.server.http.json_response``); a field
whose value is ``UNSET`` is left out of the JSON (used for fields that OpenAI only sends in
some cases, e.g. the chunk ``usage`` without ``stream_options.include_usage``). The error
object is ``core.server.http.ErrorBody``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

# ----------------------------------------------------------------------------- requests


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` (vLLM >= 0.10): one constraint, plus options. Unknown keys
    are a 400; options this server cannot honour are a 400 unless off (``core.server.openai.job``)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None  # honoured by construction: there is no other backend to fall back to
    backend: str | None = None  # the server's --grammar-backend decides: ignored with a warning


class _GenerationRequest(Struct, kw_only=True):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's, plus SGLang's and vLLM's extra_body)."""

    model: str | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang extensions (sent through the OpenAI client's extra_body)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None  # None (unset): --preferred-sampling-params, else false
    skip_special_tokens: bool | None = None  # None: true, unless the request's parsers read special tokens
    spaces_between_special_tokens: bool | None = None  # None: --preferred-sampling-params, else true
    no_stop_trim: bool | None = None  # None: --preferred-sampling-params, else false
    rid: str | None = None  # SGLang: the request id (for /abort_request); also the response id
    priority: int | None = None  # SGLang: scheduling priority (with --enable-priority-scheduling)
    lora_path: str | list[str | None] | None = None  # SGLang: the LoRA adapter(s); ``model`` wins (core.server.lora)
    # SGLang: true or "last": the last layer's hidden states in each choice (core.engine.hidden_states)
    return_hidden_states: bool | str | None = False
    # SGLang: CustomLogitProcessor.to_str() (with --enable-custom-logit-processor) and what it reads
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None
    # SGLang: the data-parallel replica to run on (its X-Data-Parallel-Rank header wins)
    routed_dp_rank: int | None = None
    # structured output (at most one; compiled by the grammar backend)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's structured output (mapped onto the above; also at most one, identical duplicates aside)
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    guided_whitespace_pattern: str | None = None  # not supported: a 400 unless null
    # vLLM's names for SGLang's options above
    include_stop_str_in_output: bool | None = None  # no_stop_trim
    request_id: str | None = None  # rid


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    # Messages stay plain dicts: core.server.openai.chat validates them with errors naming the
    # message, and passes unknown keys (name, tool_call_id, reasoning_content...) to the template.
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # SGLang / HF template extensions
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    continue_final_message: bool | None = False
    separate_reasoning: bool | None = True  # with --reasoning-parser: reasoning_content apart from content
    thinking_token_budget: int | None = None  # vLLM's: at most this many reasoning tokens (-1: no limit)
    reasoning_effort: str | None = None  # OpenAI / vLLM: reaches the chat template, as in the Responses API


class CompletionRequest(_GenerationRequest, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str | int | list[int]]
    # absent: OpenAI's default of 16; explicit null: up to the context length
    max_tokens: int | None | UnsetType = UNSET
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


# ----------------------------------------------------------------------------- other servers' fields
# (the unknown-field policy in the module docstring)

IGNORED_FIELDS = frozenset({
    # OpenAI: storage, billing, prompt-cache routing, abuse tracking, predicted outputs (a latency
    # hint: the output is the same) and a style hint
    "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
    "prediction", "verbosity",
    # vLLM: the server's --grammar-backend decides; a routing key; a streaming chunk size
    "guided_decoding_backend", "session_id", "stream_interval",
})

# field -> the values that leave the feature off (equality, so ``1`` matches ``1.0``)
_NOOP_COMMON: dict[str, tuple[Any, ...]] = {
    # vLLM
    "use_beam_search": (None, False), "length_penalty": (None, 1.0), "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,), "allowed_token_ids": (None,), "bad_words": (None, []), "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False), "cache_salt": (None,),
    "kv_transfer_params": (None,), "ec_transfer_params": (None,), "vllm_xargs": (None, {}),
    "repetition_detection": (None,), "logprob_token_ids": (None,),
    "watermarking": (None, False),
}
_NOOP_CHAT: dict[str, tuple[Any, ...]] = {
    # vLLM
    "echo": (None, False), "add_generation_prompt": (None, True), "add_special_tokens": (None, False),
    "chat_template": (None,), "mm_processor_kwargs": (None, {}), "media_io_kwargs": (None, {}),
    "include_reasoning": (None, True), "best_of": (None, 1),
    # SGLang
    "stream_reasoning": (None, True),
    # OpenAI: audio, the deprecated functions, web search
    "modalities": (None, ["text"]), "audio": (None,), "functions": (None, []), "function_call": (None, "none", "auto"),
    "web_search_options": (None,),
}
NOOP_FIELDS: dict[type, dict[str, tuple[Any, ...]]] = {
    ChatCompletionRequest: {**_NOOP_COMMON, **_NOOP_CHAT},
    CompletionRequest: {**_NOOP_COMMON, "add_special_tokens": (None, True), "prompt_embeds": (None,),
                        "thinking_token_budget": (None, -1)},
}


class BatchRequest(Struct, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(Struct):
    reasoning_tokens: int = 0


class UsageInfo(Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET
    reasoning_tokens: int = 0  # SGLang's; also OpenAI's completion_tokens_details.reasoning_tokens where any
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


# chat logprobs: choices[i].logprobs.content[{token, logprob, bytes, top_logprobs}]
class TopLogprob(Struct):
    token: str
    logprob: float | None
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float | None
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


# completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}
class CompletionLogprobs(Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float | None] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class ChatMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    reasoning_content: str | None | UnsetType = UNSET
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # SGLang extension: the stop string / token that ended the choice
    hidden_states: Any | UnsetType = UNSET  # SGLang extension (return_hidden_states)


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    metadata: dict[str, Any] | None | UnsetType = UNSET  # SGLang's {"weight_version": ...} (non-streaming responses)


class DeltaMessage(Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | None | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET
    hidden_states: Any | UnsetType = UNSET  # SGLang extension: a chunk of its own after the content


class ChatStreamChoice(Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None | UnsetType = UNSET


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None | UnsetType = UNSET


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None | UnsetType = UNSET
    hidden_states: Any | UnsetType = UNSET  # SGLang extension (return_hidden_states)


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | UnsetType = UNSET
    system_fingerprint: str | None = None
    metadata: dict[str, Any] | None | UnsetType = UNSET  # SGLang's {"weight_version": ...} (non-streaming responses)


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "core"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FileObject(Struct, kw_only=True):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileDeleted(Struct, kw_only=True):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class RequestCounts(Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchObject(Struct, kw_only=True):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: str = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None


class ListObject(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
