"""Relaxed acceptance of sampled drafts: SGLang's ``--speculative-accept-threshold-single`` and
``--speculative-accept-threshold-acc`` (both 1.0 by default, where the engine keeps its exact walk,
``tree.walk``, and the output distribution is the target's).

At each kept node, the root first, with one uniform ``u`` of its own, the node's children are tried
in draft order, summing their target probabilities (the request's temperature and top-k / top-p /
min-p applied) as they go: child ``c`` is kept where ``u <= sum / acc`` or ``p(c) >= single``.
At 1 and 1 this is inverse-CDF sampling of the target with the children first, which is why the
machinery is exact there (a test runs it so); below 1 more drafts are kept and the output leaves
the target's distribution, the trade SGLang offers. Where no child is kept, the next token is the
target's own sample at that node unless it is one of the rejected children, else a draw from the
target without them (the target's distribution restricted to the other tokens, as SGLang samples
there). Two deliberate limits: a child the request's filters drop (probability 0) is never kept,
whatever the thresholds (SGLang's ``single`` 0 would keep it and break the request's ``top_k``);
greedy requests keep the exact walk (SGLang verifies them greedily too).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen
class Thresholds:
    single: float = 1.0  # a child whose target probability reaches this is kept
    acc: float = 1.0  # a child is kept where the node's uniform is at most the children's summed probability / this


@attrs.define
class TargetRows:
    """A verify's sampled requests (batch indices ``which``) and their rows' target distributions
    (``probs``, request after request, each one's root row first), taken before sampling edits the logits."""

    which: list[int]
    probs: torch.Tensor
    starts: list[int]  # each one's first row in ``probs``
    batch_rows: list[int]  # each one's first row in the verify (its root's)


def target_rows(batch: Any, sampler: Any, logits: torch.Tensor, rows: list[Any]) -> TargetRows | None:
    """The target distributions of a verify's sampled requests that have drafts (``rows``: every
    verify row's ``SamplingRow``), or None where it has none."""
    which, sel, starts, batch_rows, row = [], [], [], [], 0
    for i, d in enumerate(batch.drafts):
        if d and not rows[row].params.is_greedy:
            which.append(i)
            starts.append(len(sel))
            batch_rows.append(row)
            sel += range(row, row + 1 + len(d))
        row += 1 + len(d)
    if not which:
        return None
    idx = torch.tensor(sel, device=logits.device)
    return TargetRows(which, sampler.target_probs(logits.index_select(0, idx), [rows[k] for k in sel]), starts,
                      batch_rows)


def relaxed_walk(tokens: list[int], parents: list[int] | None, sampled: list[int], child_p: list[float],
                 coins: list[float], th: Thresholds) -> tuple[list[int], int | None, list[int]]:
    """(kept nodes root to leaf, the token after them, the rejected children's tokens at the last
    kept node). The token is None where the target's sample there is a rejected child: it is then
    drawn again without them. ``child_p[j]``: node j's target probability at its parent's row;
    ``coins[r]``: row r's uniform (row 0 the root, row 1 + j node j)."""
    path, cur = [], -1
    acc = max(th.acc, 1e-9)
    while True:
        kids = [j for j in range(cur + 1, len(tokens)) if (parents[j] if parents is not None else j - 1) == cur]
        u, mass, chosen = coins[cur + 1], 0.0, None
        for j in kids:
            mass += child_p[j]
            if child_p[j] > 0.0 and (u <= mass / acc or child_p[j] >= th.single):
                chosen = j
                break
        if chosen is None:
            t, rejected = sampled[cur + 1], [tokens[j] for j in kids]
            return path, (None if t in rejected else t), rejected
        path.append(chosen)
        cur = chosen


def _coins(req: Any, n: int, generator: torch.Generator) -> list[float]:
    """``n`` uniforms for a request's relaxed walk: a seeded request's from a generator of its seed
    and length (its samples' generator is rewound to plain decoding's draws, so its coins must not
    be those draws), the others' from the sampler's."""
    if req.generator is not None and (seed := req.params.seed) is not None:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + len(req.output_ids) + 1) % (1 << 62))
    return torch.rand(n, generator=generator).tolist()


def relaxed_walks(batch: Any, sampled: list[int], target: TargetRows, th: Thresholds, generator: torch.Generator,
                  walks: list[tuple[list[int], int]]) -> None:
    """Replace ``walks`` (``Speculator.walks``) of ``target.which`` by their relaxed walks."""
    rows, cols = [], []  # each drafted node's parent row in ``target.probs`` and its token
    for i, start in zip(target.which, target.starts):
        parents = batch.draft_parents[i] if batch.draft_parents else None
        for j, t in enumerate(batch.drafts[i]):
            rows.append(start + 1 + (parents[j] if parents is not None else j - 1))
            cols.append(t)
    dev = target.probs.device
    child_p = target.probs[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)].tolist()
    at = 0
    for i, start, row0 in zip(target.which, target.starts, target.batch_rows):
        d, r = batch.drafts[i], batch.reqs[i]
        parents = batch.draft_parents[i] if batch.draft_parents else None
        coins = _coins(r, len(d) + 2, generator)
        path, nxt, rejected = relaxed_walk(d, parents, sampled[row0:row0 + 1 + len(d)], child_p[at:at + len(d)], coins, th)
        at += len(d)
        if nxt is None:  # the target without the rejected children, at the last kept node's row
            row = 1 + path[-1] if path else 0
            p = target.probs[start + row].clone()
            p[torch.tensor(rejected, device=dev)] = 0.0
            cdf = p.cumsum(0)
            # (no mass left: the rejected children held it all, rounding kept u above it; the sample stands)
            nxt = (int(torch.searchsorted(cdf, cdf[-1:] * coins[-1], right=True).clamp_(max=p.numel() - 1))
                   if float(cdf[-1]) > 0.0 else sampled[row0 + row])
        walks[i] = (path, nxt)
