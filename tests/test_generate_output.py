"""A streaming /generate's cumulative events (core/server/generate_output.py): ``Chunks`` keeps each
request's ids and text as JSON as they grow; its events are the bytes the whole output encoded
afresh gives (``sse_event(output_of(...))``), escapes and non-ASCII text included."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from core.engine.request import Req
from core.engine.sampling_params import SamplingParams
from core.server.generate_output import Chunks, meta_of, output_of
from core.server.http import sse_event

# text pieces a step may add: JSON escapes, control characters, non-ASCII, astral code points
STATE = SimpleNamespace(weight_version="v7")  # what meta_of reads of the server state here
PIECES = ["Hello", ' "quoted"', " back\\slash", "\nnew line\t", "\u0001", " caf\u00e9", " \U0001F600", "\u2028", "</s>", ""]


@pytest.mark.parametrize("index", [None, 3])
def test_events_equal_the_whole_output_encoded_afresh(index):
    r = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=64))
    chunks = Chunks()
    for step, piece in enumerate(PIECES):
        r.output_ids.extend(range(100 * step, 100 * step + 1 + step % 3))  # one to three tokens a step
        r.text += piece
        if step == len(PIECES) - 1:
            r.finish_reason = {"type": "length"}
        meta = meta_of(STATE, r, False)
        assert meta["weight_version"] == "v7"  # SGLang's: the version serving the request
        want = {"text": r.text, "output_ids": r.output_ids, "meta_info": meta}
        if index is not None:
            want["index"] = index
        got = chunks.event(r.output_ids, r.text, meta, index)
        assert got == sse_event(want)
        assert json.loads(got[len(b"data: "):]) == json.loads(json.dumps(want))


def test_a_shorter_output_starts_over():
    """Outputs only grow; were one ever shorter, the event still holds exactly what it holds."""
    chunks = Chunks()
    chunks.event([1, 2, 3], "abc", {}, None)
    assert chunks.event([1, 2], "ab", {}, None) == sse_event({"text": "ab", "output_ids": [1, 2], "meta_info": {}})
    assert chunks.event([1, 2, 9], "abz", {}, None) == sse_event({"text": "abz", "output_ids": [1, 2, 9], "meta_info": {}})


def test_output_of_slices_what_was_sent():
    r = Req("r", [1], SamplingParams(max_new_tokens=8), return_logprob=True)
    r.output_ids, r.text, r.output_logprobs = [5, 6, 7], "xyz", [-0.1, -0.2, -0.3]
    out = output_of(STATE, r, False, since=(2, 1))
    assert out["output_ids"] == [7] and out["text"] == "yz"
    assert out["meta_info"]["output_token_logprobs"] == [[-0.3, 7, None]]
    assert out["meta_info"]["completion_tokens"] == 3  # whole, as in SGLang
