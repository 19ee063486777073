"""SGLang's ``return_hidden_states``: the last layer's hidden states (after the model's final norm)
returned in ``meta_info["hidden_states"]``.

A request may ask for ``True`` (every token) or ``"last"`` (only the newest one), up to the server's
maximum: ``--return-hidden-states-mode last|full``, or ``--enable-return-hidden-states`` (full). With
``True`` the list holds one entry for the prompt (its tokens' states, one row each) and then one
vector per generated token that was fed back (the last generated token is never run through the
model: a request of n tokens has n entries); with ``"last"`` it is the newest vector alone.

The model runner cuts the rows from the forward's hidden states (``rows``) for the requests that
asked; the scheduler appends them where it appends the token they produced (``Req.add_hidden``),
so a dropped token (overlap, retraction) drops its state too. Batches holding such a request run
plain single steps (``speculative.host_read``): no multi-step decode, no speculative verify, no
deferred token copy.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from core.errors import CoreError, InvalidRequest

NONE, LAST, FULL = 0, 1, 2
MODE_NAMES = ("last", "full")  # --return-hidden-states-mode's choices


def request_mode(value: Any, param: str = "return_hidden_states") -> int:
    """A request's ``return_hidden_states`` (False / None, True, or "last") as a mode."""
    if value is None or value is False:
        return NONE
    if value is True:
        return FULL
    if value == "last":
        return LAST
    raise InvalidRequest("return_hidden_states must be a boolean or the string literal 'last'.", param=param)


def server_mode(args: Any) -> int:
    """The most a request may ask for: SGLang resolves --enable-return-hidden-states to full."""
    mode = getattr(args, "return_hidden_states_mode", None)
    if mode == "last":
        return LAST
    return FULL if mode == "full" or getattr(args, "enable_return_hidden_states", False) else NONE


def check_args(args: Any) -> None:
    """Refuse a --return-hidden-states-mode that is not one of SGLang's choices."""
    mode = getattr(args, "return_hidden_states_mode", None)
    if mode is not None and mode not in MODE_NAMES:
        raise CoreError(f"--return-hidden-states-mode {mode!r} is not one of {', '.join(MODE_NAMES)}")


def check_request(args: Any, value: Any, local: bool = True) -> bool | str:
    """The request's value, normalised (False, True or "last"), after SGLang's checks against the
    server's mode (its messages); ``local`` False: an engine whose replicas run elsewhere (--dp-size > 1)."""
    mode = request_mode(value)
    if mode == NONE:
        return False
    limit = server_mode(args)
    if mode > limit:
        if limit != NONE:
            raise InvalidRequest("The requested return_hidden_states mode exceeds the server maximum "
                                 f"`{getattr(args, 'return_hidden_states_mode', None)}`. Please launch with "
                                 "`--return-hidden-states-mode full` to allow return_hidden_states=True.",
                                 param="return_hidden_states")
        raise InvalidRequest("The server is not configured to return hidden states. Please set "
                             "`--return-hidden-states-mode last`, `--return-hidden-states-mode full`, or the legacy "
                             "`--enable-return-hidden-states` flag.", param="return_hidden_states")
    if not local:
        raise InvalidRequest("return_hidden_states is not supported with --dp-size > 1 by this server",
                             param="return_hidden_states")
    return True if mode == FULL else "last"


def rows(batch: Any, hidden: torch.Tensor, live: list[int]) -> dict[int, Any] | None:
    """Per batch index of a request that asked and samples a token in this forward: its states as
    ``Req.add_hidden`` takes them (the prompt's rows as a list of vectors at the prefill that ends
    the prompt in full mode, else the vector of the token just fed), or None when none asked."""
    reqs = batch.reqs
    want = [i for i in live if reqs[i].return_hidden_states]
    if not want:
        return None
    if not batch.is_prefill:  # a decode: one row per request
        got = hidden[torch.tensor(want, device=hidden.device)].float().cpu().tolist()
        return dict(zip(want, got))
    out: dict[int, Any] = {}
    ends = list(itertools.accumulate(batch.extend_lens))
    for i in want:
        r, end = reqs[i], ends[i]
        if r.return_hidden_states is True and batch.seq_lens[i] == len(r.prompt_ids):  # the prompt: every row
            out[i] = hidden[end - batch.extend_lens[i] : end].float().cpu().tolist()
        else:  # "last", a re-prefill after retraction, a decode in a mixed batch: the newest token's
            out[i] = hidden[end - 1].float().cpu().tolist()
    return out


def for_response(meta: dict, value: Any) -> Any:
    """An OpenAI choice's ``hidden_states`` (SGLang's extension) from its ``meta_info``, or None: with
    "last" the newest vector; with True the last generated token's (``[]`` when only the prompt's
    entry exists: a one-token completion)."""
    hs = meta.get("hidden_states")
    if not value or hs is None:
        return None
    if value == "last":
        return hs
    return hs[-1] if len(hs) > 1 else []
