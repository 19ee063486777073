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

Like SGLang's, the drafter also keeps an index SHARED across requests: recent requests' tokens
(at most ``SHARED_TOKENS``, the least recently grown request evicted first) and the same n-gram
ends in them. A request answering what another did (the same passage, template or code) drafts the
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

SGLang's flags, where given, shape the same drafts (SGLang keeps one trie; the meanings carry over):
``--speculative-ngram-max-trie-depth D``: suffixes of up to D - 1 tokens are matched, and a match of
k tokens drafts at most D - k deep; ``--speculative-ngram-min-bfs-breadth`` / ``-max-bfs-breadth``:
a node holds at most ``b`` children, ``b`` = (longest suffix - k) * s + min at the root of a k-token
match, shrinking by s = (max - min) / (suffix lengths) a level, at least 1 (SGLang's recency fill:
a long match branches little; max 1 drafts chains); ``--speculative-ngram-match-type BFS`` (recency
order, ours; PROB, its frequency fill, is refused); ``--speculative-ngram-capacity C``: the shared
index holds at most C n-gram ends (SGLang: trie nodes), C / (suffix lengths) tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count
from typing import Any, Iterator, Sequence

from core import hookimpl
from core.errors import CoreError
from core.interfaces import DraftTree

MIN_MATCH, MAX_MATCH = 2, 8  # suffix lengths looked up, longest first
ENDS = 4  # the latest ends kept per n-gram: the occurrences a tree's branches come from
SHARED_TOKENS = 1 << 15  # the shared index's bound: tokens of recent requests (some 75 MB where no n-gram repeats)


def _grams(tokens: Sequence[int], lo: int, hi: int, longest: int = MAX_MATCH) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every n-gram ending at ``lo`` to ``hi - 1`` (where its continuation starts), and that end."""
    for end in range(max(lo, 1), hi):
        for k in range(MIN_MATCH, min(longest, end) + 1):
            yield tuple(tokens[end - k:end]), end


def _add_end(ends: list, end: Any) -> None:
    ends.append(end)
    if len(ends) > ENDS:
        del ends[0]


def _flag(args: Any, name: str) -> Any:
    return getattr(args, "speculative_ngram_" + name, None)


class NgramDrafter:
    def __init__(self, args: Any = None) -> None:
        self.args = args
        depth, lo, hi = _flag(args, "max_trie_depth"), _flag(args, "min_bfs_breadth"), _flag(args, "max_bfs_breadth")
        kind, capacity = _flag(args, "match_type"), _flag(args, "capacity")
        if depth is not None and depth <= MIN_MATCH:
            raise CoreError(f"--speculative-ngram-max-trie-depth {depth}: matches take at least {MIN_MATCH} tokens "
                            f"and drafts one more: use at least {MIN_MATCH + 1}")
        low, high = (1 if lo is None else lo), (10 if hi is None else hi)  # (SGLang's defaults)
        if not 1 <= low <= high:
            raise CoreError(f"--speculative-ngram-min-bfs-breadth {low} / --speculative-ngram-max-bfs-breadth {high}: "
                            "need 1 <= min <= max")
        if kind is not None and str(kind).upper() != "BFS":
            raise CoreError(f"--speculative-ngram-match-type {kind}: NGRAM fills its drafts in recency order (BFS); "
                            "SGLang's frequency fill (PROB) is not supported")
        if capacity is not None and capacity < 1:
            raise CoreError(f"--speculative-ngram-capacity must be >= 1, got {capacity}")
        self.depth = depth  # None: drafts as deep as asked
        self.longest = MAX_MATCH if depth is None else depth - 1  # the longest suffix matched
        windows = self.longest - MIN_MATCH + 1
        # (min, the step a level: (max - min) / suffix lengths), where either breadth flag is given
        self.breadth = None if lo is None and hi is None else (low, (high - low) / windows)
        self.shared_tokens = SHARED_TOKENS if capacity is None else max(1, capacity // windows)
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
        for gram, end in _grams(tokens, len(s), len(tokens), self.longest):
            _add_end(self.index.setdefault(gram, []), (sid, end))
        self.total += len(tokens) - len(s)
        s.extend(tokens[len(s):])
        while self.total > self.shared_tokens:
            old, s = self.seqs.popitem(last=False)
            self.total -= len(s)
            for gram, end in _grams(s, 1, len(s), self.longest):
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
        for gram, end in _grams(tokens, state.get("done", 0), n, self.longest):  # n-grams ending before the last token
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
        kids: dict[int, int] = {}  # node -> its children (--speculative-ngram-*-bfs-breadth)
        for seq, start, k in self._occurrences(state, tokens):
            cur, level = -1, 0
            deep = max_tokens if self.depth is None else min(max_tokens, self.depth - k)
            for t in seq[start:start + deep]:
                nxt = child.get((cur, t))
                if nxt is None:
                    if cur == leaf or len(out) >= max_tokens or (
                            self.breadth is not None and kids.get(cur, 0) >= self._breadth(k, level)):
                        break
                    nxt = child[(cur, t)] = len(out)
                    kids[cur] = kids.get(cur, 0) + 1
                    out.append(t)
                    parents.append(cur)
                cur, level = nxt, level + 1
            if leaf is None:
                leaf = cur
            if len(out) >= max_tokens:
                break
        if parents == list(range(-1, len(out) - 1)):
            return out
        return DraftTree(out, parents)

    def _breadth(self, k: int, level: int) -> int:
        """Children a node ``level`` deep under a ``k``-token match may hold (SGLang's BFS breadth)."""
        low, step = self.breadth
        return max(1, int((self.longest - k) * step + low - level * step))

    def _occurrences(self, state: dict, tokens: Sequence[int]) -> Iterator[tuple[Sequence[int], int, int]]:
        """(sequence, where a continuation starts, the match's length) of each occurrence of the
        suffix: the request's own (longest match first, most recent first), then other requests'
        in the same order."""
        n, index = len(tokens), state["index"]
        seen: set = set()  # (a shorter match's occurrence a longer one found already)
        for k in range(min(self.longest, n - 1), MIN_MATCH - 1, -1):
            for start in reversed(index.get(tuple(tokens[n - k:]), ())):
                if start not in seen:
                    seen.add(start)
                    yield tokens, start, k
        prefix = {state.get("sid"): True}  # request -> whether its tokens are a prefix of ours (ours are)
        for k in range(min(self.longest, n), MIN_MATCH - 1, -1):
            for sid, end in reversed(self.index.get(tuple(tokens[n - k:]), ())):
                s = self.seqs[sid]
                if sid not in prefix:
                    prefix[sid] = len(s) <= n and s[-1] == tokens[len(s) - 1] and s == list(tokens[:len(s)])
                if not prefix[sid] and (sid, end) not in seen:
                    seen.add((sid, end))
                    yield s, end, k


@hookimpl
def register_speculative_algorithms(register) -> None:
    register("NGRAM", "core_plugins.speculative.ngram:NgramDrafter")
