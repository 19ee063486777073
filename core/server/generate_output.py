"""SGLang's /generate outputs: the response body of a request, and a stream's server-sent events.

A stream sends one event per step of each request (``--stream-interval`` steps apart), each with
the request's whole output so far, as SGLang does by default, or only what is new since the last
event (``--incremental-streaming-output``). A whole output re-encoded every step costs a stream's
length each step (~2.3 us for 300 ids against ~0.5 for one, per event): ``Chunks`` keeps each
request's ids and text as JSON and encodes only what a step added."""

from __future__ import annotations

from typing import AsyncIterator

import structlog

from core.engine.request import Req
from core.server.http import SSE_DONE, encoder, sse_error, sse_event, stream_due
from core.server.state import ServerState

log = structlog.get_logger("core.server.generate_output")


# meta_info's per-position lists of (logprob, token id, text): the top logprobs, and token_ids_logprob's
TOP_KEYS = ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs", "input_token_ids_logprobs")


def _fmt_token_lps(items: list, texts: dict[int, str]) -> list:
    return [[lp, tid, texts.get(tid)] for lp, tid, _ in items]


def _fmt_top_lps(items: list, texts: dict[int, str]) -> list:
    # (logprob, token_id, text) as ``Req.meta_info`` has them; a position without candidates is null
    return [None if not pos else [[lp, tid, texts.get(tid)] for lp, tid, _ in pos] for pos in items]


def meta_of(state: ServerState, req: Req, with_text: bool, since: int | None = None) -> dict:
    """SGLang's meta_info of ``req``: logprobs as [logprob, token_id, text], the text null unless
    ``return_text_in_logprobs``; ``since``: the output positions already sent, whose output
    logprobs are left out (SGLang slices these; the rest stays whole)."""
    meta = req.meta_info()
    meta["weight_version"] = state.weight_version  # SGLang's: the version serving now (--weight-version)
    if since is not None:
        for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            if key in meta:
                meta[key] = meta[key][since:]
    if req.return_logprob:
        texts: dict[int, str] = {}
        if with_text:
            tok = state.engine.tokenizer
            named: set[int] = set()  # (not ``ids``: those are the output's)
            for key in ("output_token_logprobs", "input_token_logprobs"):
                named.update(t for _, t, _ in meta.get(key, []))
            for key in TOP_KEYS:
                for pos in meta.get(key, []):
                    named.update(t for _, t, _ in (pos or []))
            order = sorted(named)
            texts = dict(zip(order, [tok.decode([t]) for t in order])) if tok is not None else {t: None for t in order}
        for key in ("output_token_logprobs", "input_token_logprobs"):
            if key in meta:
                meta[key] = _fmt_token_lps(meta[key], texts)
        for key in TOP_KEYS:
            if key in meta:
                meta[key] = _fmt_top_lps(meta[key], texts)
    return meta


def output_of(state: ServerState, req: Req, with_text: bool, index: int | None = None,
              since: tuple[int, int] | None = None) -> dict:
    """SGLang's /generate output: text, output_ids, meta_info (``meta_of``), for the caller to
    encode before the request moves on (it holds the request's own output list). ``since``
    (``--incremental-streaming-output``): (output ids, text characters) already sent; the text,
    ids and output logprobs after them only."""
    ids, text = req.output_ids, req.text
    if since is not None:
        ids, text = ids[since[0]:], text[since[1]:]
    out = {"text": text, "output_ids": ids, "meta_info": meta_of(state, req, with_text, None if since is None else since[0])}
    if index is not None:
        out["index"] = index
    return out


class Chunks:
    """One request's cumulative events: the JSON of its output ids and text grows with them (both
    only ever grow: the scheduler appends to them), so an event encodes what the step added and
    copies the rest. The bytes are those of ``sse_event(output_of(...))``."""

    __slots__ = ("ids", "n", "text", "chars")

    def __init__(self) -> None:
        self.ids, self.n, self.text, self.chars = bytearray(), 0, bytearray(), 0

    def event(self, ids: list[int], text: str, meta: dict, index: int | None) -> bytes:
        if len(ids) < self.n or len(text) < self.chars:  # (never, as they only grow: start over rather than assume)
            self.__init__()
        if len(ids) > self.n:
            if self.n:
                self.ids += b","
            self.ids += encoder.encode(ids[self.n:])[1:-1]
            self.n = len(ids)
        if len(text) > self.chars:  # (JSON escapes code point by code point: escaped pieces concatenate)
            self.text += encoder.encode(text[self.chars:])[1:-1]
            self.chars = len(text)
        tail = b"}\n\n" if index is None else b',"index":%d}\n\n' % index
        return b"".join((b'data: {"text":"', self.text, b'","output_ids":[', self.ids, b'],"meta_info":',
                         encoder.encode(meta), tail))


async def stream_body(state: ServerState, reqs: list[Req], with_text: bool, interval: int) -> AsyncIterator[bytes]:
    """The events of a streaming /generate of ``reqs`` (``index`` in each when there are several),
    at most one per ``interval`` tokens of a request and always its final one, then ``[DONE]``.
    Closing it aborts whatever has not finished (the client went away, or the task was cancelled)."""
    engine, multi = state.engine, len(reqs) > 1
    incremental = state.args.incremental_streaming_output
    sent = [(0, 0)] * len(reqs)  # (output ids, text characters) each request's events hold so far
    final_sent = [False] * len(reqs)
    chunks = [Chunks() for _ in reqs]
    updates = engine.advances(reqs)  # (each request's index after each of its steps; no outputs built)

    def event(i: int, r: Req) -> bytes:
        since, sent[i], final_sent[i] = sent[i], (len(r.output_ids), len(r.text)), r.finished
        if incremental:
            return sse_event(output_of(state, r, with_text, i if multi else None, since))
        return chunks[i].event(r.output_ids, r.text, meta_of(state, r, with_text), i if multi else None)

    try:
        async for i in updates:
            r = reqs[i]
            if final_sent[i] or (not r.finished and not stream_due(len(r.output_ids), sent[i][0], interval)):
                continue
            yield event(i, r)
        # a request can finish between two updates the consumer saw: always end with its final state
        for i, r in enumerate(reqs):
            if r.finished and not final_sent[i]:
                yield event(i, r)
    except Exception as e:  # mid-stream: the status line is gone, report in-band
        log.error("server.stream_failed", error=f"{type(e).__name__}: {e}", exc_info=e)
        yield sse_error(e)
    finally:
        await updates.aclose()  # aborts whatever has not finished (client gone, cancelled)
    yield SSE_DONE
