"""``/v1/chat/completions``: messages through the chat template, then generation with
reasoning and tool calls read out of the output (see ``core.server.openai.tools``)."""

from __future__ import annotations

import json
import os
from typing import Any, AsyncIterator

import attrs
from msgspec import UNSET

from core.engine.hidden_states import for_response
from core.engine.grammar import ReasoningGate
from core.engine.sampling_params import ThinkingBudget
from core.errors import CoreError, InvalidRequest
from core.server.http import ApiError, sse_event, stream_due
from core.server.multimodal import chat_images, image_part_url
from core.server.openai.chat_template import (
    RESERVED_TEMPLATE_KWARGS,
    ChatTemplate,
    check_renders_messages,
    from_json_file,
)
from core.server.openai.job import (
    MAX_TOP_LOGPROBS,
    Job,
    check,
    check_min_tokens,
    common_checks,
    finish_of,
    fit_context,
    sampling_params,
    weight_version_metadata,
)
from core.server.openai.logprobs import chat_logprobs
from core.server.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from core.server.openai.tools import ChoicePost, ToolPlan, plan_tools, unforced

ALLOWED_ROLES = ("system", "user", "assistant", "tool", "developer")

# ----------------------------------------------------------------------------- chat templates

_TEMPLATES: dict[str, ChatTemplate] = {}


def loaded_chat_template(value: str) -> ChatTemplate:
    """The template named by ``--chat-template`` (loaded once): a Jinja file, a JSON file (SGLang's
    conversation template, turned into Jinja plus stop strings; see ``chat_template``), or the
    Jinja template itself when the value is not a file. A JSON file is never read as Jinja, and
    a template whose output drops the messages is refused. SGLang's built-in template names
    are not supported."""
    hit = _TEMPLATES.get(value)
    if hit is None:
        path = os.path.expanduser(value)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise CoreError(f"--chat-template {value!r}: cannot read it: {e}") from None
            is_json = path.lower().endswith(".json") or text.lstrip().startswith('{"')
            hit = from_json_file(text, value) if is_json else ChatTemplate(text)
        elif "{%" in value or "{{" in value:
            hit = ChatTemplate(value)
        else:
            raise CoreError(f"--chat-template {value!r} is neither a Jinja template file nor a template string")
        check_renders_messages(hit.jinja, value if os.path.isfile(path) else "(inline template)")
        _TEMPLATES[value] = hit
    return hit


def load_chat_template(value: str) -> str:
    """The Jinja source of ``--chat-template`` (see ``loaded_chat_template``)."""
    return loaded_chat_template(value).jinja


def joined_text(content: Any, where: str, kinds: tuple[str, ...], param: str) -> str:
    """A string, or a list of text parts of ``kinds`` (each ``{"type", "text"}``), as one string;
    anything else is a 400 naming ``where`` (the Responses and Messages APIs' content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}[{j}]: only text parts ({', '.join(kinds)}) are supported, got {kind!r}; "
                                 "the models are text-only", param=param)
        texts.append(part["text"])
    return "\n".join(texts)


def _content_text(content: list, i: int, images: list[str] | None = None) -> str | list[dict]:
    """A message's content parts as one string; with image parts (when ``images`` collects them,
    a vision-language model's request) as the list of text and ``{"type": "image"}`` parts HF
    chat templates put image placeholders for, each image's URL appended to ``images``."""
    texts = []
    parts: list[dict] = []
    for j, part in enumerate(content):
        if isinstance(part, str):  # a bare string part: lenient
            texts.append(part)
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise InvalidRequest(f"messages[{i}].content[{j}] must be an object", param=f"messages[{i}].content[{j}]")
        kind = part.get("type")
        if kind == "text" or (kind is None and "text" in part):
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"messages[{i}].content[{j}].text must be a string", param=f"messages[{i}].content[{j}].text")
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif kind == "image_url" and images is not None:
            images.append(image_part_url(part, f"messages[{i}].content[{j}]"))
            parts.append({"type": "image"})
        elif images is not None:
            raise InvalidRequest(f"messages[{i}].content[{j}] has type {kind!r}: only 'text' and 'image_url' content "
                                 "parts are supported", param=f"messages[{i}].content[{j}].type")
        else:
            raise InvalidRequest(
                f"messages[{i}].content[{j}] has type {kind!r}, but this model is text-only: only 'text' content parts "
                f"are supported", param=f"messages[{i}].content[{j}].type")
    return parts if len(parts) > len(texts) else "\n".join(texts)


def normalize_messages(messages: list[dict[str, Any]], images: list[str] | None = None) -> list[dict[str, Any]]:
    """Validate chat messages and turn them into what HF chat templates expect. ``images``: a list
    that collects the URLs of image parts (a vision-language model); None: image parts are a 400."""
    if not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"messages[{i}] is missing the 'role' field", param=f"messages[{i}].role")
        if role not in ALLOWED_ROLES:
            raise InvalidRequest(f"Invalid role {role!r} in messages[{i}]: expected one of {', '.join(ALLOWED_ROLES)}",
                                 param=f"messages[{i}].role")
        msg = dict(m)
        if role == "developer":
            msg["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            msg["content"] = _content_text(content, i, images)
        elif content is None:
            if role != "assistant":
                raise InvalidRequest(f"messages[{i}] (role {role!r}) is missing 'content'", param=f"messages[{i}].content")
            msg["content"] = ""  # an assistant turn that only calls tools
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of content parts",
                                 param=f"messages[{i}].content")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise InvalidRequest(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_template_tool_call(tc) for tc in tool_calls]
        out.append(msg)
    return out


def _template_tool_call(tc: Any) -> Any:
    """HF templates expect function.arguments as a mapping; OpenAI sends a JSON string."""
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        return tc
    fn = dict(tc["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {**tc, "function": fn}


def render_chat(state: Any, r: ChatCompletionRequest, hide_tools: bool | None = None, *,
                add_generation_prompt: bool = True, fit: bool = True, add_special_tokens: bool = False,
                images: list[str] | None = None) -> list[int]:
    """Apply the chat template (``--chat-template`` overrides the tokenizer's) and tokenize.
    ``images``: collects the image parts' URLs (the template gets ``{"type": "image"}`` parts);
    None refuses image parts.
    ``hide_tools``: give the template no tools (default: when ``tool_choice`` is "none").
    ``fit``: refuse a text that cannot fit the context before tokenizing it (a generation's
    prompt; /tokenize counts any length)."""
    tok = state.engine.tokenizer
    if tok is None:
        raise InvalidRequest("chat completions need the tokenizer, but the server runs with --skip-tokenizer-init")
    messages = normalize_messages(r.messages, images)
    kwargs = dict(r.chat_template_kwargs or {})
    cont_kwarg = kwargs.pop("continue_final_message", False)  # the request's own field, given here instead
    if kwargs.pop("add_generation_prompt", True) is not True:
        raise InvalidRequest("chat_template_kwargs.add_generation_prompt false is not supported: the prompt always ends "
                             "where the assistant's answer starts (use continue_final_message to continue a final "
                             "assistant message)", param="chat_template_kwargs.add_generation_prompt")
    if reserved := sorted(kwargs.keys() & RESERVED_TEMPLATE_KWARGS):
        raise InvalidRequest(f"chat_template_kwargs.{reserved[0]} is set by the server from the request (messages, "
                             "tools, documents, --chat-template); remove it from chat_template_kwargs",
                             param=f"chat_template_kwargs.{reserved[0]}")
    path = state.args.chat_template
    if path:
        try:
            kwargs["chat_template"] = load_chat_template(path)
        except CoreError as e:
            raise ApiError(500, str(e)) from None
    elif not getattr(tok, "chat_template", None):
        raise InvalidRequest("the model has no chat template; start the server with --chat-template FILE or use /v1/completions")
    if hide_tools is None:
        hide_tools = r.tool_choice == "none"
    cont = bool(r.continue_final_message or cont_kwarg is True) and messages[-1]["role"] == "assistant"
    try:
        text = tok.apply_chat_template(messages, tools=None if hide_tools else r.tools, documents=r.documents,
                                       add_generation_prompt=add_generation_prompt and not cont,
                                       continue_final_message=cont, tokenize=False,
                                       **kwargs)
    except Exception as e:  # jinja2 TemplateError (raise_exception in templates), TypeError on odd messages
        raise InvalidRequest(f"the chat template could not render these messages: {e}", param="messages") from None
    if not isinstance(text, str):
        raise ApiError(500, "the chat template did not produce a string")
    if fit:
        text = state.prefit_text(text, "messages")  # a prompt that cannot fit: 400 before tokenizing it
    return tok.encode(text, add_special_tokens=add_special_tokens)


# ----------------------------------------------------------------------------- the request


class ChatJob(Job):
    """A chat request: a Job plus its tool plan."""

    plan: ToolPlan

    def post(self) -> ChoicePost:
        """A fresh per-choice reasoning / tool-call post-processor."""
        return ChoicePost(self.plan, self.r)


def reasoning_tags(state: Any, r: ChatCompletionRequest) -> tuple[Any, tuple[int, ...], tuple[int, ...]] | None:
    """(the reasoning parser, its end tag tokenized, its start tag tokenized where the output may
    answer without reasoning, else ()) where the request's output reasons first: None without
    --reasoning-parser or with thinking turned off (the request's separate_reasoning false still
    reasons)."""
    name = state.args.reasoning_parser
    parser = state.engine.plugins.resolve("reasoning_parser", name) if name else None
    if parser is None or not getattr(parser, "think_end", None):
        return None
    p = parser()
    if hasattr(p, "configure"):
        p.configure(r.chat_template_kwargs or {})
    if getattr(p, "enabled", True) is False:
        return None
    tok = state.engine.tokenizer
    start = () if getattr(parser, "force_reasoning", False) else tuple(tok.encode(parser.think_start, add_special_tokens=False))
    return parser, tuple(tok.encode(parser.think_end, add_special_tokens=False)), start


def thinking_budget(state: Any, r: ChatCompletionRequest, tags: tuple | None) -> ThinkingBudget | None:
    """``thinking_token_budget`` as the engine's ``ThinkingBudget``: the reasoning parser's end tag,
    tokenized, closes a reasoning that reaches the budget. None where there is no budget, or no
    reasoning (``tags``, :func:`reasoning_tags`' None: thinking turned off, or a constraint from the
    first token)."""
    budget = r.thinking_token_budget
    if budget is None or budget == -1:
        return None
    check(isinstance(budget, int) and budget >= 0, f"thinking_token_budget must be -1 or >= 0, got {budget}",
          "thinking_token_budget")
    name = state.args.reasoning_parser
    check(bool(name) and bool(getattr(state.engine.plugins.resolve("reasoning_parser", name), "think_end", None)),
          "thinking_token_budget needs --reasoning-parser (its end tag closes the reasoning)", "thinking_token_budget")
    return None if tags is None else ThinkingBudget(budget, tags[1], tags[2])


def reasoning_gate(tags: tuple | None) -> ReasoningGate | None:
    """Where a request's output reasons first (``tags``: :func:`reasoning_tags`'), its constraint
    holds only the answer after the reasoning (SGLang's and vLLM's reasoning parsers with structured
    output do the same). Not for a parser whose answer opens with a header of its own (gpt-oss's
    final channel)."""
    if tags is None or getattr(tags[0], "content_prefix", ""):
        return None
    return ReasoningGate(tags[1], tags[2])


async def choice_deltas(job: ChatJob) -> AsyncIterator[tuple[dict, int, str, str, list[dict]]]:
    """A one-choice job's output as it grows, every stream interval (and at its end): (the cumulative
    output, how many tokens came before this step, reasoning delta, text delta, tool-call deltas),
    through the job's reasoning / tool-call post-processor. The Responses and Messages streams
    build their events from these."""
    post, sent_text, sent_toks = job.post(), "", 0
    async for _, out in job.merged():
        reason, _ = finish_of(out)
        ntok = out["meta_info"]["completion_tokens"]
        if reason is None and not stream_due(ntok, sent_toks, job.interval):
            continue
        start, delta = sent_toks, out["text"][len(sent_text):]
        sent_text, sent_toks = out["text"], ntok
        r_delta, c_delta, call_deltas = post.delta(delta, reason is not None)
        yield out, start, r_delta, c_delta, call_deltas


def prepare_chat(state: Any, r: ChatCompletionRequest, rid: str | None = None) -> ChatJob:
    """Validate, render and build the engine requests of a chat request (nothing is submitted)."""
    n, constraint = common_checks(r, state.args.default_chat_template_kwargs)
    job = ChatJob(state, "chat", r, rid)
    job.n = n
    job.select_adapters(1)
    job.logprobs = bool(r.logprobs)
    top = r.top_logprobs or 0
    check(0 <= top <= MAX_TOP_LOGPROBS, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    check(job.logprobs or top == 0, "logprobs must be true when top_logprobs is set", "top_logprobs")
    job.top = top
    job.plan = plan = plan_tools(state, r)
    if plan.constraint is not None:  # required / named: the call; strict tools under auto: the calls only
        check(not constraint, "tool_choice 'required', a named function or strict tools cannot be combined with another "
              "constraint (response_format, regex, json_schema, ebnf)", "tool_choice")
        constraint = {plan.constraint[0]: plan.constraint[1]}
    from_first_token = bool(constraint) and not plan.triggered  # (a triggered tag lets free text, thinking, through)
    tags = reasoning_tags(state, r)
    gate = reasoning_gate(tags) if from_first_token else None  # (then the answer after the reasoning)
    from_first_token = from_first_token and gate is None
    job.reasoning_ids = None if tags is None or from_first_token else tags[1:]  # (usage counts them)
    if from_first_token and plan.reasoning_parser is not None:
        job.plan = plan = attrs.evolve(plan, reasoning_parser=unforced(plan.reasoning_parser))
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    if max_tokens is not None and max_tokens < 0:
        name = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
        raise InvalidRequest(f"{name} must be >= 0, got {max_tokens}", param=name)
    check_min_tokens(r, max_tokens, "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens")
    urls: list[str] | None = [] if getattr(state.engine, "multimodal", None) is not None else None
    ids = render_chat(state, r, hide_tools=plan.hides_tools, images=urls)
    images = chat_images(state, urls or [])  # (the processor checks the template gave each its placeholder)
    ids, max_new = fit_context(state, ids, max_tokens, "messages")
    params = sampling_params(r, max_new, n, constraint, state.chat_sampling_defaults, state.args.preferred_sampling_params)
    params.thinking, params.reasoning_gate = thinking_budget(state, r, None if from_first_token else tags), gate
    if r.skip_special_tokens is None and any(getattr(p, "reads_special_tokens", False)
                                             for p in (plan.reasoning_parser, plan.tool_parser)):
        params.skip_special_tokens = False  # the parsers' markers are special tokens (gpt-oss)
    if state.args.chat_template:  # a JSON template's stop_str, as SGLang adds its conversation's
        params.stop += [s for s in loaded_chat_template(state.args.chat_template).stop if s and s not in params.stop]
    job.add_prompt(ids, params, -1, images=images)
    return job


async def chat_response(job: ChatJob) -> ChatCompletionResponse:
    outs = await job.final_outputs()
    choices = []
    for i, out in enumerate(outs):
        reason, matched = finish_of(out)
        lp = chat_logprobs(job.vocab, out["meta_info"], 0, job.top) if job.logprobs else None
        reasoning, content, calls, reason = job.post().full(out["text"], reason)
        msg = ChatMessage(role="assistant", content=content, reasoning_content=reasoning if reasoning is not None else UNSET,
                          tool_calls=calls if calls else UNSET)
        hs = for_response(out["meta_info"], job.r.return_hidden_states)
        choices.append(ChatChoice(index=i, message=msg, logprobs=lp, finish_reason=reason, matched_stop=matched,
                                  hidden_states=UNSET if hs is None else hs))
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices, usage=job.usage(outs),
                                  metadata=weight_version_metadata(job.state))


async def chat_stream(job: ChatJob) -> AsyncIterator[bytes]:
    usage_field = None if job.include_usage else UNSET
    count = len(job.reqs)
    last: list[dict | None] = [None] * count  # each choice's latest output

    def chunk(choice: ChatStreamChoice | None, usage: Any = usage_field) -> bytes:
        if job.continuous_usage and usage is usage_field:
            usage = job.usage(last)
        return sse_event(ChatCompletionChunk(id=job.id, created=job.created, model=job.model,
                                             choices=[] if choice is None else [choice], usage=usage))

    for i in range(count):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    sent_text = [""] * count
    sent_toks = [0] * count
    posts = [job.post() for _ in range(count)]
    async for i, out in job.merged():
        last[i] = out
        reason, matched = finish_of(out)
        meta = out["meta_info"]
        ntok = meta["completion_tokens"]
        if reason is None and not stream_due(ntok, sent_toks[i], job.interval):
            continue
        delta = out["text"][len(sent_text[i]):]
        lp = chat_logprobs(job.vocab, meta, sent_toks[i], job.top) if job.logprobs else None
        if reason is None and not delta and not (lp and lp.content):
            continue
        sent_text[i], sent_toks[i] = out["text"], ntok
        r_delta, delta, calls = posts[i].delta(delta, reason is not None)
        if reason == "stop" and posts[i].n_calls:
            reason = "tool_calls"
        if reason is None and not delta and not r_delta and not calls and not (lp and lp.content):
            continue
        dm = DeltaMessage(content=delta if delta else UNSET, reasoning_content=r_delta if r_delta else UNSET,
                          tool_calls=calls if calls else UNSET)
        yield chunk(ChatStreamChoice(index=i, delta=dm, logprobs=lp,
                                     finish_reason=reason, matched_stop=matched if reason else UNSET))
    for i, out in enumerate(last):  # SGLang: each choice's hidden states in a chunk of their own, after the content
        if out is not None and (hs := for_response(out["meta_info"], job.r.return_hidden_states)) is not None:
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(hidden_states=hs)))
    if job.include_usage:
        yield chunk(None, job.usage(last))
