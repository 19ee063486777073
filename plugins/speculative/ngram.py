"""``--speculative-algorithm NGRAM``: drafts copied from the request's own context, then recent requests'.

The longest suffix of the tokens so far (up to ``MAX_MATCH`` tokens, at least ``MIN_MATCH``) that
occurred earlier in the same request is looked up, and the tokens that followed its latest
earlier occurrence are proposed: a repeating answer (copying, editing code, quoting the prompt,
JSON echoing it) drafts itself. An index of each n-gram's ``ENDS`` latest ends is kept per
request and grows by one token a step.

The draft is a tree (a trie, as SGLang's NGRAM drafter proposes): the latest occurrence's
continuation first, as a chain, then the continuations of the suffix's other occurrences (the
longest match's, most recent first, then shorter matches'), merged where they share a prefix,
until ``max_tokens`` nodes. Its first chain is the latest occurrence's continuation, so a backend
without tree masks verifies that; a draft without branches is a plain list.

Like SGLang's (``--speculative-ngram-capacity``), the drafter also keeps an index SHARED across
requests: recent requests' tokens (at most ``SHARED_TOKENS``, the least recently grown request
evicted first; a constant, as ``EngineArgs`` has no capacity flag) and the same n-gram ends in
them. A request answering what another did (the same passage, template or code) drafts the
other's continuation: after its own context's, as further branches (or the chain, where its own
context has no match). A request publishes its tokens as they grow, a bounded amount of work per
token, from its second proposal on (the tokens after its last proposal are never seen).

Own and shared must not mix, or the state would be more than a cache (a kept state must draft
what a fresh one does on the same tokens): a request never drafts from a stored sequence that is
a prefix of its tokens. That covers what it published itself (the rule is on content, so a fresh
state skips it too), and such a sequence's continuations are in the request's own context anyway.
And a state's first proposal publishes nothing, so the index a proposal sees never depends on
whether its state is fresh: a fresh state's proposal changes nothing, and a kept one publishes
before it drafts. (A retracted request starts again as a new one; what it published stays shared.)
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count
from typing import Any, Iterator, Sequence

from core import hookimpl
from core.interfaces import DraftTree

MIN_MATCH, MAX_MATCH = 2, 8  # suffix lengths looked up, longest first
ENDS = 4  # the latest ends kept per n-gram: the occurrences a tree's branches come from
SHARED_TOKENS = 1 << 15  # the shared index's bound: tokens of recent requests (some 75 MB where no n-gram repeats)


def _grams(tokens: Sequence[int], lo: int, hi: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every n-gram ending at ``lo`` to ``hi - 1`` (where its continuation starts), and that end."""
    for end in range(max(lo, 1), hi):
        for k in range(MIN_MATCH, min(MAX_MATCH, end) + 1):
            yield tuple(tokens[end - k:end]), end


def _add_end(ends: list, end: Any) -> None:
    ends.append(end)
    if len(ends) > ENDS:
        del ends[0]


class NgramDrafter:
    def __init__(self, args: Any = None) -> None:
        self.args = args
        self.ids = count()
        self.seqs: OrderedDict[int, list[int]] = OrderedDict()  # request -> its tokens published, least recent first
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> its latest (request, end)s
        self.total = 0  # tokens in ``seqs``

    def _publish(self, sid: int, tokens: Sequence[int]) -> None:
        """``tokens`` past what request ``sid`` published, into the shared index; the least
        recently grown requests out while over ``SHARED_TOKENS`` (a request evicted stops)."""
        s = self.seqs.get(sid)
        if s is None:
            return
        self.seqs.move_to_end(sid)
        for gram, end in _grams(tokens, len(s), len(tokens)):
            _add_end(self.index.setdefault(gram, []), (sid, end))
        self.total += len(tokens) - len(s)
        s.extend(tokens[len(s):])
        while self.total > SHARED_TOKENS:
            old, s = self.seqs.popitem(last=False)
            self.total -= len(s)
            for gram, end in _grams(s, 1, len(s)):
                ends = self.index.get(gram)
                if ends and (old, end) in ends:
                    ends.remove((old, end))
                    if not ends:
                        del self.index[gram]

    def propose(self, state: dict, tokens: Sequence[int], max_tokens: int) -> list[int] | DraftTree:
        n = len(tokens)
        if state.get("done", 0) > n:  # fewer tokens than indexed (a retracted request): start again
            state.clear()
        index: dict[tuple[int, ...], list[int]] = state.setdefault("index", {})
        for gram, end in _grams(tokens, state.get("done", 0), n):  # n-grams ending before the last token
            _add_end(index.setdefault(gram, []), end)
        state["done"] = n
        if "sid" not in state:
            state["sid"] = None  # the first proposal publishes nothing (see above)
        else:
            if state["sid"] is None:
                state["sid"] = next(self.ids)
                self.seqs[state["sid"]] = []
            self._publish(state["sid"], tokens)
        if max_tokens <= 0:
            return []
        out: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        leaf = None  # the first continuation's last node: nothing grows past it (the first chain stays as is)
        for seq, start in self._occurrences(state, tokens):
            cur = -1
            for t in seq[start:start + max_tokens]:
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
        if parents == list(range(-1, len(out) - 1)):
            return out
        return DraftTree(out, parents)

    def _occurrences(self, state: dict, tokens: Sequence[int]) -> Iterator[tuple[Sequence[int], int]]:
        """(sequence, where a continuation starts) of each occurrence of the suffix: the request's
        own (longest match first, most recent first), then other requests' in the same order."""
        n, index = len(tokens), state["index"]
        seen: set = set()  # (a shorter match's occurrence a longer one found already)
        for k in range(min(MAX_MATCH, n - 1), MIN_MATCH - 1, -1):
            for start in reversed(index.get(tuple(tokens[n - k:]), ())):
                if start not in seen:
                    seen.add(start)
                    yield tokens, start
        prefix = {state.get("sid"): True}  # request -> whether its tokens are a prefix of ours (ours are)
        for k in range(min(MAX_MATCH, n), MIN_MATCH - 1, -1):
            for sid, end in reversed(self.index.get(tuple(tokens[n - k:]), ())):
                s = self.seqs[sid]
                if sid not in prefix:
                    prefix[sid] = len(s) <= n and s[-1] == tokens[len(s) - 1] and s == list(tokens[:len(s)])
                if not prefix[sid] and (sid, end) not in seen:
                    seen.add((sid, end))
                    yield s, end


@hookimpl
def register_speculative_algorithms(register) -> None:
    register("NGRAM", "core_plugins.speculative.ngram:NgramDrafter")
