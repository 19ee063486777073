"""Draft trees: a verify's new tokens are the request's last token (the root) and draft nodes,
each following its parent (``parents[j]``: an earlier node, or -1 for the root). A chain is the
tree whose node j follows node j - 1. The target samples every node's distribution in one
forward under a tree mask (each token sees the cached prefix, its ancestors and itself); walking
from the root, a node is kept while it is the child whose token the target sampled at its
parent, so the kept tokens are always the target's own samples along one path."""

from __future__ import annotations

from typing import Any

import torch

from core.interfaces import DraftTree


def as_tree(draft: Any) -> tuple[list[int], list[int] | None]:
    """(tokens, parents) of a drafter's chain (a list: parents None) or ``DraftTree``."""
    if isinstance(draft, DraftTree):
        tokens, parents = list(draft.tokens), list(draft.parents)
        if len(parents) != len(tokens) or any(not -1 <= p < j for j, p in enumerate(parents)):
            raise ValueError(f"a draft tree's parents must precede their nodes (-1: the root), got {parents}")
        return tokens, (None if parents == list(range(-1, len(tokens) - 1)) else parents)
    return list(draft), None


def first_chain(tokens: list[int], parents: list[int]) -> list[int]:
    """The tree's chain through each node's first child: what a backend without tree masks verifies."""
    chain, cur = [], -1
    for j, p in enumerate(parents):
        if p == cur:
            chain.append(tokens[j])
            cur = j
    return chain


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (the root's children: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def mask_rows(parents: list[int] | None, n: int) -> list[bool]:
    """The row-major [n, n] attention mask of a verify's ``n`` new tokens (root and nodes):
    ancestors and self (causal where ``parents`` is None: a chain)."""
    if parents is None:
        return [j <= i for i in range(n) for j in range(n)]
    anc: list[set[int]] = [{0}]
    for j, p in enumerate(parents):
        anc.append(anc[p + 1] | {j + 1})
    return [j in a for a in anc for j in range(n)]


def walk(tokens: list[int], parents: list[int] | None, sampled: list[int]) -> tuple[list[int], int]:
    """(the kept nodes, root to leaf, and the target's token after them). ``sampled[0]`` is the
    target's sample at the root, ``sampled[1 + j]`` at node j."""
    path, cur, t = [], -1, sampled[0]
    while True:
        nxt = next((j for j in range(cur + 1, len(tokens)) if (parents[j] if parents is not None else j - 1) == cur
                    and tokens[j] == t), None)
        if nxt is None:
            return path, t
        path.append(nxt)
        cur, t = nxt, sampled[1 + nxt]


def kv_moves(kv_len: int, path: list[int], slots: torch.Tensor) -> tuple[list[int], list[int]]:
    """(source, destination) KV slots that bring the kept nodes' entries to their positions: node j
    was written at column kv_len + 1 + j, and the d-th kept node belongs at column kv_len + d.
    Sources lie at or after their destinations, and after every earlier destination."""
    src, dst = [], []
    for d, j in enumerate(path, start=1):
        if j != d - 1:
            src.append(int(slots[kv_len + 1 + j]))
            dst.append(int(slots[kv_len + d]))
    return src, dst
