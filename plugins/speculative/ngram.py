"""``--speculative-algorithm NGRAM``: drafts copied from the request's own context.

The longest suffix of the tokens so far (up to ``MAX_MATCH`` tokens, at least ``MIN_MATCH``) that
occurred earlier in the same request is looked up, and the tokens that followed its latest
earlier occurrence are proposed: a repeating answer (copying, editing code, quoting the prompt,
JSON echoing it) drafts itself. An index of every n-gram's latest end is kept per request and
grows by one token a step. SGLang's NGRAM drafter also shares a trie of recent outputs across
requests and proposes trees; this one proposes chains from the request alone.
"""

from __future__ import annotations

from typing import Any, Sequence

from core import hookimpl

MIN_MATCH, MAX_MATCH = 2, 8  # suffix lengths looked up, longest first


class NgramDrafter:
    def __init__(self, args: Any = None) -> None:
        self.args = args

    def propose(self, state: dict, tokens: Sequence[int], max_tokens: int) -> list[int]:
        n = len(tokens)
        index: dict[tuple[int, ...], int] = state.setdefault("index", {})
        done = state.get("done", 0)
        if done > n:  # fewer tokens than indexed (a retracted request): start again
            index.clear()
            done = 0
        # every n-gram ending before the last token: where it ended (its continuation starts there)
        for end in range(max(done, 1), n):
            for k in range(MIN_MATCH, min(MAX_MATCH, end) + 1):
                index[tuple(tokens[end - k:end])] = end
        state["done"] = n
        if max_tokens <= 0:
            return []
        for k in range(min(MAX_MATCH, n - 1), MIN_MATCH - 1, -1):
            start = index.get(tuple(tokens[n - k:]))
            if start is not None and start < n:
                return list(tokens[start:start + max_tokens])
        return []


@hookimpl
def register_speculative_algorithms(register) -> None:
    register("NGRAM", "core_plugins.speculative.ngram:NgramDrafter")
