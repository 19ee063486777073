"""``--speculative-algorithm NGRAM``: drafts copied from the request's own context.

The longest suffix of the tokens so far (up to ``MAX_MATCH`` tokens, at least ``MIN_MATCH``) that
occurred earlier in the same request is looked up, and the tokens that followed its latest
earlier occurrence are proposed: a repeating answer (copying, editing code, quoting the prompt,
JSON echoing it) drafts itself. An index of each n-gram's ``ENDS`` latest ends is kept per
request and grows by one token a step.

The draft is a tree (a trie, as SGLang's NGRAM drafter proposes): the latest occurrence's
continuation first, as a chain, then the continuations of the suffix's other occurrences (the
longest match's, most recent first, then shorter matches'), merged where they share a prefix,
until ``max_tokens`` nodes. Its first chain is the latest occurrence's continuation, so a backend
without tree masks verifies that; a draft without branches is a plain list. SGLang's drafter also
shares its trie across requests; this one drafts from the request alone.
"""

from __future__ import annotations

from typing import Any, Sequence

from core import hookimpl
from core.interfaces import DraftTree

MIN_MATCH, MAX_MATCH = 2, 8  # suffix lengths looked up, longest first
ENDS = 4  # the latest ends kept per n-gram: the occurrences a tree's branches come from


class NgramDrafter:
    def __init__(self, args: Any = None) -> None:
        self.args = args

    def propose(self, state: dict, tokens: Sequence[int], max_tokens: int) -> list[int] | DraftTree:
        n = len(tokens)
        index: dict[tuple[int, ...], list[int]] = state.setdefault("index", {})
        done = state.get("done", 0)
        if done > n:  # fewer tokens than indexed (a retracted request): start again
            index.clear()
            done = 0
        # every n-gram ending before the last token: where it ended (its continuation starts there)
        for end in range(max(done, 1), n):
            for k in range(MIN_MATCH, min(MAX_MATCH, end) + 1):
                ends = index.setdefault(tuple(tokens[end - k:end]), [])
                ends.append(end)
                if len(ends) > ENDS:
                    del ends[0]
        state["done"] = n
        if max_tokens <= 0:
            return []
        out: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        seen: set[int] = set()
        leaf = None  # the first continuation's last node: nothing grows past it (the first chain stays as is)
        for k in range(min(MAX_MATCH, n - 1), MIN_MATCH - 1, -1):
            for start in reversed(index.get(tuple(tokens[n - k:]), ())):
                if start in seen:  # (a shorter match's occurrence the longer one found already)
                    continue
                seen.add(start)
                cur = -1
                for t in tokens[start:start + max_tokens]:
                    nxt = child.get((cur, t))
                    if nxt is None:
                        if cur == leaf or len(out) >= max_tokens:
                            break
                        nxt = child[(cur, t)] = len(out)
                        out.append(t)
                        parents.append(cur)
                    cur = nxt
                if leaf is None:
                    leaf = cur
                if len(out) >= max_tokens:
                    break
            if len(out) >= max_tokens:
                break
        if parents == list(range(-1, len(out) - 1)):
            return out
        return DraftTree(out, parents)


@hookimpl
def register_speculative_algorithms(register) -> None:
    register("NGRAM", "core_plugins.speculative.ngram:NgramDrafter")
