"""SGLang's custom logit processors (``--enable-custom-logit-processor``): a request carries a
Python callable, serialized by its client, that edits its rows' logits before sampling.

SGLang's clients make the string with ``MyProcessor.to_str()`` on a subclass of
``sglang.srt.sampling.custom_logit_processor.CustomLogitProcessor``: JSON
``{"callable": <hex of a dill pickle of the class>}``. A class the client defined itself travels by
value (its code is in the pickle); its base, and SGLang's own processors, travel by name. This
module stands in for SGLang's: the unpickler resolves that module's names here, so a client's
string works unchanged with no SGLang on the server.

A processor is arbitrary code from the client, run in the server: which is why the flag is off by
default, as in SGLang. It runs on the forward thread, over the batch's rows that use it (one call
per distinct processor), after penalties, ``logit_bias``, ``min_new_tokens`` and a grammar's mask
and before temperature and the filters, as SGLang's sampler calls it. Logprobs stay the model's.
A processor that raises (or returns the wrong shape) fails its own requests, not the batch.
"""

from __future__ import annotations

import abc
import functools
import io
import json
from typing import Any

import attrs
import torch

from core.errors import InvalidRequest

SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"


class CustomLogitProcessor(abc.ABC):
    """SGLang's base class: ``processor(logits [rows, vocab], custom_param_list)`` returns the rows'
    logits (edited in place or new, the same shape). ``custom_param_list[i]`` is row ``i``'s
    ``custom_params`` with ``"__req__"`` added (a :class:`RequestView`), or None where the request
    sent none."""

    @abc.abstractmethod
    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any] | None] | None = None) -> torch.Tensor:
        ...

    @classmethod
    def to_str(cls) -> str:
        """The class as a request's ``custom_logit_processor`` string (needs ``dill``)."""
        import dill

        return json.dumps({"callable": dill.dumps(cls).hex()})

    @classmethod
    def from_str(cls, text: str) -> CustomLogitProcessor:
        return load(text)


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """Rules out each row's ``custom_params["token_ids"]``."""

    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list or []):
            if params and params.get("token_ids"):
                logits[i, params["token_ids"]] = float("-inf")
        return logits


class ThinkingBudgetLogitProcessor(CustomLogitProcessor):
    """Ends a reasoning block once it holds ``custom_params["thinking_budget"]`` tokens: a newline
    first (unless the last token is one), then the end tag. Subclasses name the model's tokens."""

    THINKING_START_TOKEN_ID: int
    THINKING_END_TOKEN_ID: int
    NEW_LINE_TOKEN_ID: int

    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list or []):
            budget = (params or {}).get("thinking_budget")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                continue
            req = params["__req__"]
            ids = [*req.origin_input_ids, *req.output_ids]
            opened = next((j for j in range(len(ids) - 1, -1, -1)
                           if ids[j] in (self.THINKING_START_TOKEN_ID, self.THINKING_END_TOKEN_ID)), -1)
            if opened < 0 or ids[opened] != self.THINKING_START_TOKEN_ID or len(ids) - opened - 1 < budget:
                continue
            newline = bool(req.output_ids) and req.output_ids[-1] == self.NEW_LINE_TOKEN_ID
            logits[i, :] = float("-inf")
            logits[i, self.THINKING_END_TOKEN_ID if newline else self.NEW_LINE_TOKEN_ID] = 0.0
        return logits


class Qwen3ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 151667, 151668, 198


class Glm4MoeThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 151350, 151351, 198


class DeepSeekR1ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 128798, 128799, 201


# the names of SGLang's module that a pickle may refer to, resolved here
STAND_INS = {c.__name__: c for c in (CustomLogitProcessor, DisallowedTokensLogitsProcessor, ThinkingBudgetLogitProcessor,
                                     Qwen3ThinkingBudgetLogitProcessor, Glm4MoeThinkingBudgetLogitProcessor,
                                     DeepSeekR1ThinkingBudgetLogitProcessor)}


@attrs.frozen
class RequestView:
    """``custom_params["__req__"]``: what SGLang's processors read from its ``Req`` (the lists are
    the request's own: the prompt, and the tokens generated before this step)."""

    origin_input_ids: list[int]
    output_ids: list[int]


@functools.lru_cache(maxsize=256)
def load(text: str) -> CustomLogitProcessor:
    """The processor a request's string names (one instance per distinct string); an
    :class:`InvalidRequest` saying why where it cannot be loaded."""
    try:
        import dill
    except ImportError:
        raise InvalidRequest("custom_logit_processor needs the dill package on the server (pip install dill)",
                             param="custom_logit_processor") from None

    class Unpickler(dill.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module in (SGLANG_MODULE, __name__):
                if name not in STAND_INS:
                    raise InvalidRequest(f"custom_logit_processor refers to SGLang's {name}, which this server does "
                                         f"not have; send your own subclass instead", param="custom_logit_processor")
                return STAND_INS[name]
            return super().find_class(module, name)

    try:
        data = json.loads(text)
        blob = bytes.fromhex(data["callable"])
        cls = Unpickler(io.BytesIO(blob)).load()
    except InvalidRequest:
        raise
    except Exception as e:  # (whatever a malformed string or pickle raises)
        raise InvalidRequest("custom_logit_processor is not a serialized processor (CustomLogitProcessor.to_str()): "
                             f"{type(e).__name__}: {e}", param="custom_logit_processor") from None
    if not (isinstance(cls, type) and issubclass(cls, CustomLogitProcessor)) or getattr(cls, "__abstractmethods__", None):
        raise InvalidRequest(f"custom_logit_processor must be a CustomLogitProcessor subclass with __call__, got {cls!r}",
                             param="custom_logit_processor")
    try:
        return cls()
    except Exception as e:
        raise InvalidRequest(f"custom_logit_processor {cls.__name__}() failed: {type(e).__name__}: {e}",
                             param="custom_logit_processor") from None


def check(text: Any, enabled: bool, speculative: bool) -> str | None:
    """A request's ``custom_logit_processor`` checked (and loaded once, so that a bad one is a 400
    now, not a failure mid-generation); None or "" for none."""
    if text in (None, ""):
        return None
    if not enabled:
        raise InvalidRequest("The server is not configured to enable custom logit processor: restart it with "
                             "--enable-custom-logit-processor", param="custom_logit_processor")
    if speculative:
        raise InvalidRequest("custom_logit_processor is not supported with speculative decoding on this server",
                             param="custom_logit_processor")
    if not isinstance(text, str):
        raise InvalidRequest("custom_logit_processor must be a string (CustomLogitProcessor.to_str())",
                             param="custom_logit_processor")
    load(text)
    return text


def apply(logits: torch.Tensor, rows: list) -> dict[int, str]:
    """Run the processors of ``rows`` (``SamplingRow``s) over their rows of ``logits``, in place:
    one call per distinct processor, its rows in batch order. Returns {row: why} for the rows whose
    processor raised or returned something else than their logits (left as they were)."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if (text := r.params.custom_logit_processor) is not None:
            groups.setdefault(text, []).append(i)
    failed: dict[int, str] = {}
    for text, idx in groups.items():
        proc = load(text)
        params = [None if (cp := rows[i].params.custom_params) is None else
                  {**cp, "__req__": RequestView(rows[i].prompt_ids, rows[i].output_ids)}
                  for i in idx]
        sel = torch.tensor(idx, device=logits.device)
        try:
            out = proc(logits.index_select(0, sel), params)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(idx), logits.shape[1]):
                raise TypeError(f"returned {type(out).__name__} {tuple(getattr(out, 'shape', ()))}, "
                                f"not the rows' logits {(len(idx), logits.shape[1])}")
            logits.index_copy_(0, sel, out.to(logits.dtype))
        except Exception as e:
            failed.update(dict.fromkeys(idx, f"custom logit processor {type(proc).__name__} failed: "
                                             f"{type(e).__name__}: {e}"))
    return failed
