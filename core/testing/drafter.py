"""The drafter suite (speculative decoding): what the engine relies on of a drafter.

A chain drafter (``Drafter.propose``) is checked over seeded random token sequences (with
repeats, so that copying drafters find something): a draft is a list of at most ``max_tokens``
non-negative ints (``max_tokens`` 0 gives ``[]``), or a ``DraftTree`` of at most ``max_tokens``
such nodes whose parents are -1 or an earlier node; the per-request ``state`` only caches
(proposing along a growing sequence gives what a fresh state gives on the same tokens); a
sequence shorter than the last one (a retracted request) is handled; an empty or one-token
sequence is not an error.

A model drafter (``ModelDrafter``: it has ``propose_batch``, which is how the engine tells) is
loaded through a fake ``DraftContext`` on the first fake draft model its ``load`` takes: a plain
model, an EAGLE head or an EAGLE-3 head (a ``model`` with ``share_target``, ``capture_layers``
and ``feature_size``; its ``run`` wants features [T, F] of the target's or [T, hidden] of its
own). A fake draft model's KV pool records what each slot was written with (position, token,
feature row), and its logits are seeded random values over a small vocabulary that depend on the
KV a sequence attends to, so that a drafter whose KV bookkeeping is right drafts the same tokens
whatever it recomputes. The kit plays the engine: requests prefilled (long ones in two chunks),
then verify batches with rooms of 0 to 5 tokens, grown by what a simulated verify kept (the path
of the draft ``core.engine.speculative.tree.walk`` follows, then a token of the target's), and a
plain decode step. A drafter whose ``trees`` is true (EAGLE) runs every model case twice: with
``speculative_eagle_topk`` 1 and 2 (trees). A drafter that called
``ctx.capture(layers)`` gets ``observe`` after every such forward, as ``Speculator.observe``
makes it: per request the positions whose results stand and the token after each, with features
``len(layers) * hidden`` wide (``hidden`` for ``()``) that are seeded random values of the
tokens up to each position (for a verify: the last token's and the kept path's). The cases check:
``propose_batch`` gives exactly ``room`` ints below the vocabulary size per request, or a
``DraftTree`` of ``room`` such nodes (``batch_drafts``); every ``DraftSeq`` writes and attends only
to slots the request owns, below ``kv_len`` at their positions, from there in a chain's layout (the
positions' own slots) or a tree's (node j's KV, at position ``kv_len + depth(j) - 1``, in its own
verify slot, column ``kv_len + 1 + j``, seeing its ancestors' slots), and no position from
``kv_len + room`` on (in ``observe``: past the positions observed) (``draft_kv_slots``); along
growing requests every position attended holds KV written for it, and below ``kv_len`` the KV of
the tokens and target features now there, and the kept state drafts what a fresh drafter does
after a prefill of the same tokens (``growing_requests``); a retracted request (its state emptied, its slots changed,
prefilled again) is handled (``retracted_requests``). How much a drafter recomputes is its own
choice.

The engine verifies every draft, so no case judges a draft's quality.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import attrs

from core.engine.speculative.tree import depths
from core.interfaces import DraftRequest
from core.testing.draft_engine import (MODEL_VOCAB, PLAIN_STEP, POOL_SLOTS, ROW_SLOTS, Call, Engine, RunSeq, as_draft,
                                       fake_args, is_model_drafter)
from core.testing.suite import Case, Skipped, fail, resolve_target, seed_for

KIND = "speculative_algorithm"
SEQUENCES, VOCAB = 6, 40

MODEL_CASES = ("batch_drafts", "draft_kv_slots", "growing_requests", "retracted_requests")
CHAIN_CASES = ("valid_drafts", "state_is_a_cache", "shorter_sequences")


@attrs.define
class DrafterSubject:
    factory: Any
    label: str
    kind: str = KIND

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None) -> DrafterSubject:
        factory, label = resolve_target(KIND, target, plugins)
        return cls(factory, label)

    def drafter(self, args: Any = None) -> Any:
        """A drafter constructed as the engine does: ``drafter(args)`` (default: ``EngineArgs()``)."""
        return self.factory(fake_args(None) if args is None else args)


# --------------------------------------------------------------------------- chain drafters


def _chain_drafter(s: DrafterSubject) -> Any:
    d = s.drafter()
    if is_model_drafter(d):
        raise Skipped("a ModelDrafter (propose_batch): for chain drafters only")
    return d


def _sequences() -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(SEQUENCES):
        base = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 12))]
        seq: list[int] = []
        while len(seq) < 60:  # pieces of one phrase and noise: repeats to draft from
            seq += base[rng.randrange(len(base)):] if rng.random() < 0.6 else [rng.randrange(VOCAB)]
        out.append(seq[:60])
    return out


def _check_draft(s: DrafterSubject, case: str, draft: Any, max_tokens: int) -> None:
    got = as_draft(draft)
    if got is None or len(got[0]) > max_tokens:
        raise fail(s, case, f"propose(..., max_tokens={max_tokens}) returned {draft!r}: want a list of at most "
                            f"{max_tokens} non-negative ints, or a DraftTree of at most {max_tokens} such nodes whose "
                            f"parents are -1 or an earlier node")


def check_valid_drafts(s: DrafterSubject) -> None:
    """Drafts are lists (or DraftTrees) of at most max_tokens non-negative ints, for every prefix and 0, 1, 5 tokens."""
    d = _chain_drafter(s)
    for seq in _sequences():
        state: dict = {}
        for n in range(0, len(seq) + 1, 7):
            for k in (0, 1, 5):
                _check_draft(s, "valid_drafts", d.propose(state, seq[:n], k), k)


def check_state_is_a_cache(s: DrafterSubject) -> None:
    """Along a growing sequence, one kept state proposes what a fresh state proposes."""
    d = _chain_drafter(s)
    for seq in _sequences():
        state: dict = {}
        for n in range(1, len(seq) + 1):
            kept, fresh = d.propose(state, seq[:n], 4), d.propose({}, seq[:n], 4)
            if kept != fresh:
                raise fail(s, "state_is_a_cache", f"after {n} tokens the kept state drafted {kept}, a fresh one {fresh}")


def check_shorter_sequences(s: DrafterSubject) -> None:
    """A request retracted and readmitted: fewer tokens than the state saw, then growing again."""
    d = _chain_drafter(s)
    seq = _sequences()[0]
    state: dict = {}
    d.propose(state, seq, 4)
    for n in (10, 11, 40):
        got = d.propose(state, seq[:n], 4)
        _check_draft(s, "shorter_sequences", got, 4)
        if got != d.propose({}, seq[:n], 4):
            raise fail(s, "shorter_sequences", f"after shrinking to {n} tokens the state drafted {got}")


# --------------------------------------------------------------------------- model drafters: the fakes


def _rows(rng: random.Random, n: int) -> list[list[int]]:
    """Slots of positions 0.. for ``n`` requests: ``ROW_SLOTS`` each, scattered over the pool."""
    free = rng.sample(range(1, POOL_SLOTS), n * ROW_SLOTS)
    return [free[i * ROW_SLOTS:(i + 1) * ROW_SLOTS] for i in range(n)]


def _requests(rng: random.Random, lengths: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    return [[rng.randrange(MODEL_VOCAB) for _ in range(n)] for n in lengths], _rows(rng, len(lengths))


def _where(call: Call, k: int, j: int, q: RunSeq) -> str:
    return f"{call.what}, run {k}, sequence {j} (positions {q.start}..{q.end - 1})"


def _layouts(r: DraftRequest, draft: tuple[list[int], list[int] | None] | None, end: int) -> list[list[int]]:
    """The slots a sequence of ``r`` ending before position ``end`` may hold at positions ``kv_len``
    to ``end - 1`` (the draft's): the request's own slots there (a chain's layout); or, for a path
    of the draft from the root to a node at depth ``end - kv_len``, each node's own verify slot
    (column ``kv_len + 1 + node``: a tree's layout, EAGLE's)."""
    mine, k = r.slots.tolist(), r.kv_len
    if draft is None or end <= k:
        return [mine[k:end]]
    tokens, parents = draft
    parents = parents if parents is not None else list(range(-1, len(tokens) - 1))
    out = [] if draft[1] is not None else [mine[k:end]]
    for j, d in enumerate(depths(parents)):
        if d == end - k and k + 1 + j < len(mine):
            path = [j]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            out.append([mine[k + 1 + a] for a in reversed(path)])
    return out


def _check_slots(e: Engine, call: Call) -> None:
    """Every sequence of ``call``'s runs writes and attends to its request's slots only, below
    ``kv_len + room`` (an observation: below ``start + len(next_ids)``): below ``kv_len`` the slots
    of those positions, from there on a chain's (the positions' own slots, or each node's verify
    slot) or a tree's (each node's verify slot, along a path of the tree)."""
    s, case = e.s, e.case
    owner = {sl: i for i, r in enumerate(call.reqs) for sl in r.slots.tolist()}
    for k, run in enumerate(call.runs):
        for j, q in enumerate(run):
            i = owner.get(q.slots[q.start])
            if i is None:
                raise fail(s, case, f"{_where(call, k, j, q)} writes slot {q.slots[q.start]} at position {q.start}: no "
                                    f"request of the call owns it (their slots are those of positions < kv_len + room;"
                                    f" an observation's, < start + len(next_ids))")
            r = call.reqs[i]
            limit = r.kv_len + r.room
            if q.end > limit:
                why = ("the last draft token's KV is never needed" if call.drafts is not None
                       else "the positions observed")
                raise fail(s, case, f"{_where(call, k, j, q)} of request {i} reaches position {q.end - 1}: its draft "
                                    f"KV goes only at positions < {limit} ({why})")
            mine = r.slots.tolist()
            for p in range(min(q.end, r.kv_len)):
                if q.slots[p] != mine[p]:
                    how = "attends to" if p < q.start else "writes"
                    raise fail(s, case, f"{_where(call, k, j, q)} of request {i} {how} slot {q.slots[p]} at position "
                                        f"{p}: the request's slot there is {mine[p]}")
            ok = _layouts(r, call.drafts[i] if call.drafts is not None else None, q.end)
            if q.slots[r.kv_len:q.end] not in ok:
                raise fail(s, case, f"{_where(call, k, j, q)} of request {i} writes and attends to slots "
                                    f"{q.slots[r.kv_len:q.end]} at positions {r.kv_len}..{q.end - 1}: want one of {ok} "
                                    f"(the positions' own slots for a chain, or each node's verify slot, column "
                                    f"kv_len + 1 + node, along a path of the draft)")


def _check_attended(e: Engine, call: Call) -> None:
    """Every position a sequence attends to holds draft KV written for that position, and where
    the position's result stands (below ``kv_len``), the KV of the tokens (and features) now there."""
    s, case = e.s, e.case
    owner = {sl: i for i, r in enumerate(call.reqs) for sl in r.slots.tolist()}
    for k, run in enumerate(call.runs):
        for j, q in enumerate(run):
            r = call.reqs[i] if (i := owner.get(q.slots[q.start])) is not None else None
            if r is not None and q.slots[:r.kv_len] != r.slots.tolist()[:min(q.end, r.kv_len)]:
                r = None  # not its request's slots below kv_len (draft_kv_slots says so): no content to expect
            for p, entry in enumerate(q.attended):
                where = f"{_where(call, k, j, q)} attends to position {p} (slot {q.slots[p]})"
                if entry is None:
                    raise fail(s, case, f"{where} where no draft KV was written")
                if entry[0] != p:
                    raise fail(s, case, f"{where}, which holds draft KV written for position {entry[0]}: another "
                                        f"sequence wrote over it, or the request's slots changed since (a retraction "
                                        f"empties its state)")
                if r is None or p >= r.kv_len or entry == (want := e.written(r.tokens, p)):
                    continue
                if entry[1] != want[1]:
                    raise fail(s, case, f"{where}, which holds the draft KV of token {entry[1]} where the request has "
                                        f"{want[1]}: stale (a rejected draft's, or another request's)")
                raise fail(s, case, f"{where}, which holds draft KV of features other than the target's at that "
                                    f"position: another row's, or a rejected draft's")


def _same_as_fresh(e: Engine, since: int = 0) -> None:
    """Each ``propose_batch`` call's drafts (from ``e.calls[since]`` on) are what a fresh drafter
    (new model, empty states, a prefill of each request's tokens but the last observed where it
    asked for features) drafts on the same requests."""
    for call in [c for c in e.calls[since:] if c.drafts is not None]:
        fresh = Engine.load(e.s, e.case, [list(r.tokens) for r in call.reqs], [r.slots.tolist() for r in call.reqs],
                            topk=e.topk)
        fresh.forward([(i, 0, t[:-1], t[1:]) for i, t in enumerate(fresh.tokens)])
        new = fresh.propose(dict(enumerate(r.room for r in call.reqs)))
        for i, (r, kept, got) in enumerate(zip(call.reqs, call.drafts, new.drafts)):
            if kept != got:
                raise fail(e.s, e.case, f"{call.what}: request {i} ({len(r.tokens)} tokens, room {r.room}) drafted "
                                        f"{kept} with its kept state, {got} with a fresh drafter: the state must only "
                                        f"track which draft KV is valid for the tokens now there")


def _topks(s: DrafterSubject) -> tuple[int, ...]:
    """The ``speculative_eagle_topk`` each model case runs the drafter with: 1, and 2 (trees) where
    its ``trees`` is true, as ``--speculative-eagle-topk`` allows."""
    return (1, 2) if getattr(s.drafter(), "trees", False) else (1,)


def _simulate(s: DrafterSubject, case: str, steps: int, retract_at: int | None = None, topk: int = 1) -> Engine:
    """A few requests prefilled, then ``steps`` verifies of rooms 0 to 5 (step ``PLAIN_STEP`` a plain
    decode instead). At step ``retract_at`` requests 0 and 2 are retracted: their state is emptied
    as the engine does it, their slots change, and they are prefilled again."""
    rng = random.Random(seed_for("drafter", case))
    tokens, slots = _requests(rng, (2, 3, 9, 24, 40))
    e = Engine.load(s, case, tokens, slots, topk)
    e.prefill(range(len(tokens)))
    for step in range(steps):
        if step == retract_at:
            for i in (0, 2):
                e.states[i] = {}  # (core.engine.speculative._state)
                rng.shuffle(e.slots[i])
            e.retracted = len(e.calls)
            e.prefill((0, 2))
        rooms = [rng.choice((0, 1, 2, 5, 5)) for _ in tokens]
        if step == PLAIN_STEP or not any(rooms):
            e.decode()
        else:
            e.verify(dict(enumerate(rooms)))
    return e


def check_batch_drafts(s: DrafterSubject) -> None:
    """propose_batch gives exactly room ints below the vocabulary size per request (or a DraftTree of
    room such nodes), rooms 0, 1 and 5 in one batch."""
    for topk in _topks(s):
        rng = random.Random(seed_for("drafter", "batch_drafts"))
        e = Engine.load(s, "batch_drafts", *_requests(rng, (2, 9, 2, 40, 17, 3, 5)), topk)
        e.prefill(range(len(e.tokens)))
        e.verify(dict(enumerate((0, 1, 5, 5, 1, 0, 5))))
        e.verify({0: 0, 3: 5})  # a second batch: a room of 0 beside one of 5


def check_draft_kv_slots(s: DrafterSubject) -> None:
    """Every run's DraftSeq writes and attends to slots its request owns, at their positions (a
    draft's: a chain's or a tree's layout), below kv_len + room (in observe: below the positions observed)."""
    for topk in _topks(s):
        e = _simulate(s, "draft_kv_slots", steps=8, retract_at=5, topk=topk)
        for call in e.calls:
            _check_slots(e, call)


def check_growing_requests(s: DrafterSubject) -> None:
    """Along requests grown by what verifies kept, the kept state drafts what a fresh drafter does,
    attending only to draft KV of the tokens (and target features) now there."""
    for topk in _topks(s):
        e = _simulate(s, "growing_requests", steps=10, topk=topk)
        for call in e.calls:
            _check_attended(e, call)
        _same_as_fresh(e)


def check_retracted_requests(s: DrafterSubject) -> None:
    """A retracted request (state emptied, slots changed, prefilled again) is drafted for as a fresh one, then grows again."""
    for topk in _topks(s):
        e = _simulate(s, "retracted_requests", steps=8, retract_at=4, topk=topk)
        for call in e.calls:
            _check_attended(e, call)
        _same_as_fresh(e, since=e.retracted)


def drafter_cases() -> list[Case]:
    return [Case(f.__name__.removeprefix("check_"), f, f.__doc__ or "")
            for f in (check_valid_drafts, check_state_is_a_cache, check_shorter_sequences, check_batch_drafts,
                      check_draft_kv_slots, check_growing_requests, check_retracted_requests)]
