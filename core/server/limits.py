"""What one request may ask for: the bounds that keep a hostile or broken client from costing
the server more than a real request would. Every refusal is a 400 naming the field (a body
over ``--max-request-body-bytes`` is a 413, see ``core.server.http.read_body``).

* JSON nesting: at most :data:`MAX_JSON_DEPTH` levels (a real request needs about 10; a JSON
  Schema of tool parameters rarely 20). Deeper bodies would reach recursion limits in the JSON
  encoder, the chat template or a grammar compiler.
* ``n``: 1..:data:`MAX_N` on every endpoint; one request holds at most :data:`MAX_SEQUENCES`
  sequences (prompts x n).
* ``stop`` and ``stop_regex``: each at most :data:`MAX_STOP_STRINGS` entries of at most
  :data:`MAX_STOP_CHARS` characters (they are matched against the output after every token);
  ``stop_token_ids``: at most :data:`MAX_STOP_TOKEN_IDS`.
* ``seed``: an integer in [0, 2**63) (torch's generator seed range).
* Text prompts: a text that cannot fit the context whatever it tokenizes to is refused
  before it is tokenized (:func:`text_token_floor`), so a megabyte prompt costs a length check,
  not a tokenization.

* ``logit_bias``: at most :data:`MAX_LOGIT_BIAS` entries (it is applied to the logits every step).
"""

from __future__ import annotations

from typing import Any

import msgspec

from core.engine.sampling_params import SamplingParams
from core.errors import InvalidRequest

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # --max-request-body-bytes
MAX_JSON_DEPTH = 64
MAX_N = 128
MAX_SEQUENCES = 4096
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_SEED = 2**63
# How many characters of text one token may stand for, at most, is the longest vocabulary entry
# times this: Unicode normalizers (NFC, NFKC) can compose up to 3 characters into one.
NORMALIZATION_SLACK = 4


# ---------------------------------------------------------------------------- JSON nesting
def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise InvalidRequest (naming the top-level field) when the JSON ``body`` nests deeper
    than ``limit``. Costs two byte counts unless the body has more than ``limit`` brackets."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        raise InvalidRequest(f"the request body nests deeper than {limit} levels") from None
    except msgspec.DecodeError:
        return  # not JSON: the typed decode reports it
    field = _deepest_field(value, limit)
    if field is not None:
        where = f" under {field!r}" if field else ""
        raise InvalidRequest(f"the request body nests deeper than {limit} levels{where}", param=field or None)


def _deepest_field(value: Any, limit: int) -> str | None:
    """The top-level key (or "" for the root) under which ``value`` nests deeper than ``limit``."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        v, depth, top = stack.pop()
        if depth > limit:
            return top
        if isinstance(v, dict):
            for k, item in v.items():
                if isinstance(item, (dict, list)):
                    stack.append((item, depth + 1, str(k) if depth == 1 else top))
        elif isinstance(v, list):
            for item in v:
                if isinstance(item, (dict, list)):
                    stack.append((item, depth + 1, top))
    return None


# ---------------------------------------------------------------------------- sampling
def check_n(n: Any, param: str = "n") -> None:
    if isinstance(n, int) and not isinstance(n, bool) and not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}, got {n}", param=param)


def check_sampling_limits(params: SamplingParams) -> None:
    """The bounds above on one request's sampling parameters (types are checked later by
    ``SamplingParams.validate``; only sizes here)."""
    check_n(params.n)
    for name in ("stop", "stop_regex"):
        stop = getattr(params, name)
        stop = stop if isinstance(stop, list) else []  # another type: validate's 400
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"{name} has {len(stop)} entries; at most {MAX_STOP_STRINGS} are allowed", param=name)
        for s in stop:
            if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
                raise InvalidRequest(f"a {name} entry has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed",
                                     param=name)
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids has {len(params.stop_token_ids)} entries; at most {MAX_STOP_TOKEN_IDS} "
                             "are allowed", param="stop_token_ids")
    bias = params.logit_bias
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                             param="logit_bias")
    seed = params.seed
    if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < MAX_SEED:
        raise InvalidRequest(f"seed must be in [0, 2**63), got {seed}", param="seed")


def check_sequences(count: int, param: str) -> None:
    if count > MAX_SEQUENCES:
        raise InvalidRequest(f"a request may hold at most {MAX_SEQUENCES} sequences (prompts x n), got {count}",
                             param=param)


# ---------------------------------------------------------------------------- prompt length
def max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters: no token stands for more text than that
    (byte-level BPE entries have one character per byte; SentencePiece's are the text itself;
    added special tokens are included)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no bound
        return 0
    return max((len(t) for t in vocab), default=0)


def text_token_floor(num_chars: int, token_chars: int) -> int:
    """The fewest tokens a text of ``num_chars`` characters can tokenize to (0: unknown)."""
    if token_chars <= 0:
        return 0
    return num_chars // (token_chars * NORMALIZATION_SLACK)
