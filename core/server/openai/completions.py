"""``/v1/completions``: one or more raw prompts (text or token ids), ``n`` completions each,
with ``echo`` and completions-style logprobs."""

from __future__ import annotations

from typing import Any, AsyncIterator

from msgspec import UNSET

from core.engine.hidden_states import for_response
from core.errors import InvalidRequest
from core.server.http import sse_event
from core.server.openai.job import (
    MAX_SEQUENCES,
    MAX_TOP_LOGPROBS,
    Job,
    check,
    check_min_tokens,
    common_checks,
    engine_error,
    finish_of,
    fit_context,
    sampling_params,
    weight_version_metadata,
)
from core.server.openai.logprobs import Offsets, completion_logprobs
from core.server.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse

DEFAULT_MAX_TOKENS = 16  # OpenAI's default when max_tokens is omitted


class CompletionJob(Job):
    """A completions request: a Job plus the echoed prompt texts (one per prompt) when ``echo``."""

    echo_texts: list[str] | None = None


def _split_prompt(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        for j, p in enumerate(prompt):
            check(bool(p), f"prompt[{j}] is an empty list of token ids", "prompt")
        return list(prompt)
    raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists",
                         param="prompt")


def _fill_in_the_middle(state: Any, prompts: list, suffix: str | None) -> list:
    """The prompts around a ``suffix`` (the code after the cursor) in ``--completion-template``'s
    markers; unchanged without one (None or "")."""
    if not suffix:
        return prompts
    template = getattr(state, "completion_template", None)
    check(template is not None, "suffix needs a fill-in-the-middle template: start the server with "
          "--completion-template (deepseek_coder, star_coder, qwen_coder or a JSON file)", "suffix")
    check(all(isinstance(p, str) for p in prompts), "suffix needs text prompts (not token ids)", "suffix")
    return [template.prompt(p, suffix) for p in prompts]


def prepare_completion(state: Any, r: CompletionRequest, rid: str | None = None) -> CompletionJob:
    """Validate, tokenize and build the engine requests of a completions request (nothing is submitted)."""
    n, constraint = common_checks(r)
    check(r.best_of is None or r.best_of == n, "best_of is not supported by this server (unless equal to n)", "best_of")
    job = CompletionJob(state, "completion", r, rid)
    job.n = n
    if r.logprobs is not None:
        check(0 <= r.logprobs <= MAX_TOP_LOGPROBS, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {r.logprobs}",
              "logprobs")
        job.logprobs, job.top = True, r.logprobs
    preferred = state.args.preferred_sampling_params or {}  # (--preferred-sampling-params over OpenAI's default)
    max_tokens = preferred.get("max_new_tokens", DEFAULT_MAX_TOKENS) if r.max_tokens is UNSET else r.max_tokens
    check_min_tokens(r, max_tokens)
    prompts = _fill_in_the_middle(state, _split_prompt(r.prompt), r.suffix)
    check(len(prompts) * n <= MAX_SEQUENCES, f"a request may ask for at most {MAX_SEQUENCES} completions "
          f"(prompts x n), got {len(prompts) * n}", "prompt")
    job.select_adapters(len(prompts))
    echo = bool(r.echo)
    engine = state.engine
    texts = []
    for p, prompt in enumerate(prompts):
        try:
            ids = state.tokenize(prompt, None, "prompt") if isinstance(prompt, str) else engine.tokenize(None, prompt)
        except InvalidRequest as e:
            raise engine_error(e) from None
        full = len(ids)
        ids, max_new = fit_context(state, ids, max_tokens, "prompt")
        if echo:
            if isinstance(prompt, str) and len(ids) == full:
                texts.append(prompt)
            else:
                texts.append(engine.tokenizer.decode(ids, skip_special_tokens=True) if engine.tokenizer is not None else "")
        start = 0 if echo and job.logprobs else -1
        job.add_prompt(ids, sampling_params(r, max_new, n, constraint, None, state.args.preferred_sampling_params), p if len(prompts) > 1 else -1, start)
    job.echo_texts = texts if echo else None
    return job


async def completion_response(job: CompletionJob) -> CompletionResponse:
    outs = await job.final_outputs()
    choices = []
    echo = job.echo_texts is not None
    for i, out in enumerate(outs):
        reason, matched = finish_of(out)
        text = out["text"]
        lp = completion_logprobs(job.vocab, out["meta_info"], 0, job.top, Offsets(), echo) if job.logprobs else None
        if echo:
            text = job.echo_texts[i // job.n] + text
        hs = for_response(out["meta_info"], job.r.return_hidden_states)
        choices.append(CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=reason, matched_stop=matched,
                                        hidden_states=UNSET if hs is None else hs))
    return CompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices, usage=job.usage(outs),
                              metadata=weight_version_metadata(job.state))


async def completion_stream(job: CompletionJob) -> AsyncIterator[bytes]:
    usage_field = None if job.include_usage else UNSET
    count = len(job.reqs)
    last: list[dict | None] = [None] * count  # each choice's latest output
    echo = job.echo_texts is not None

    def chunk(choice: CompletionChoice | None, usage: Any = usage_field) -> bytes:
        if job.continuous_usage and usage is usage_field:
            usage = job.usage(last)
        return sse_event(CompletionResponse(id=job.id, created=job.created, model=job.model,
                                            choices=[] if choice is None else [choice], usage=usage))

    sent_text = [""] * count
    sent_toks = [0] * count
    started = [False] * count
    offsets = [Offsets() for _ in range(count)]
    async for i, out in job.merged():
        last[i] = out
        reason, matched = finish_of(out)
        meta = out["meta_info"]
        ntok = meta["completion_tokens"]
        first = not started[i]
        if reason is None and not first and ntok - sent_toks[i] < job.interval:
            continue
        delta = out["text"][len(sent_text[i]):]
        lp = completion_logprobs(job.vocab, meta, sent_toks[i], job.top, offsets[i], echo and first) if job.logprobs else None
        if first and echo:
            delta = job.echo_texts[i // job.n] + delta
        if reason is None and not delta and not (lp and lp.tokens):
            continue
        started[i] = True
        sent_text[i], sent_toks[i] = out["text"], ntok
        yield chunk(CompletionChoice(index=i, text=delta, logprobs=lp, finish_reason=reason,
                                     matched_stop=matched if reason else UNSET))
    for i, out in enumerate(last):  # SGLang: each choice's hidden states in a chunk of their own, after the text
        if out is not None and (hs := for_response(out["meta_info"], job.r.return_hidden_states)) is not None:
            yield chunk(CompletionChoice(index=i, text="", hidden_states=hs))
    if job.include_usage:
        yield chunk(None, job.usage(last))
