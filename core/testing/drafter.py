"""The drafter suite (speculative decoding): what the engine relies on of a drafter.

A chain drafter (``Drafter.propose``) is checked over seeded random token sequences (with
repeats, so that copying drafters find something): a draft is a list of at most ``max_tokens``
non-negative ints (``max_tokens`` 0 gives ``[]``); the per-request ``state`` only caches
(proposing along a growing sequence gives what a fresh state gives on the same tokens); a
sequence shorter than the last one (a retracted request) is handled; an empty or one-token
sequence is not an error.

A model drafter (``ModelDrafter``: it has ``propose_batch``, which is how the engine tells) is
loaded through a fake ``DraftContext`` whose ``load_model`` gives a fake ``DraftModel``: a KV
pool that records what each slot was written with, and seeded random logits over a small
vocabulary that depend on the KV a sequence attends to, so that a drafter whose KV bookkeeping
is right drafts the same tokens whatever it recomputes. The kit plays the engine: verify
batches of requests with rooms of 0 to 5 tokens, grown by what a simulated verify kept (a
prefix of the draft, then a token of the target's). The cases check: ``propose_batch`` gives
exactly ``room`` ints below the vocabulary size per request (``batch_drafts``); every
``DraftSeq`` writes and attends only to slots the request owns, at their positions, and no
position from ``kv_len + room`` on (``draft_kv_slots``); along growing requests the kept state
drafts what a fresh drafter does and never attends to KV it did not write
(``growing_requests``); a retracted request (its state emptied, its slots changed) is handled
(``retracted_requests``). How much a drafter recomputes is its own choice.

The engine verifies every draft, so no case judges a draft's quality.
"""

from __future__ import annotations

import random
import zlib
from types import SimpleNamespace
from typing import Any, Sequence

import attrs
import torch

from core.interfaces import DraftRequest, DraftSeq
from core.testing.suite import Case, Skipped, fail, resolve_target, seed_for

KIND = "speculative_algorithm"
SEQUENCES, VOCAB = 6, 40

# the fake draft model: vocabulary, hidden size, KV pool slots (slot 0 is padding), slots per request
MODEL_VOCAB, HIDDEN, POOL_SLOTS, ROW_SLOTS = 32, 8, 4096, 256
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


def is_model_drafter(drafter: Any) -> bool:
    """Whether the engine treats ``drafter`` as a :class:`core.interfaces.ModelDrafter`."""
    return callable(getattr(drafter, "propose_batch", None))


def fake_args(draft_model_path: str | None = "fake") -> Any:
    """The engine's ``EngineArgs``: by default a model drafter's, with a draft model path and the
    other ``speculative_*`` flags unset."""
    from core.engine.config import EngineArgs

    return EngineArgs(speculative_draft_model_path=draft_model_path)


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
    if not isinstance(draft, list) or len(draft) > max_tokens or not all(type(t) is int and t >= 0 for t in draft):
        raise fail(s, case, f"propose(..., max_tokens={max_tokens}) returned {draft!r}: want a list of at most "
                            f"{max_tokens} non-negative ints")


def check_valid_drafts(s: DrafterSubject) -> None:
    """Drafts are lists of at most max_tokens non-negative ints, for every prefix and 0, 1, 5 tokens."""
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


class BadRun(Exception):
    """A ``DraftModel.run`` call the engine's draft model could not run; the message says why."""


@attrs.define
class RunSeq:
    """One ``DraftSeq`` of a recorded ``run`` call, and the KV it attended to before its own tokens."""

    tokens: list[int]
    start: int
    slots: list[int]  # its slots of positions 0 .. start + len(tokens) - 1
    attended: list[Any]  # per position < start: the pool's (position, token, features) at that slot, or None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _digest(*parts: Any, value: int = 0) -> int:
    return zlib.crc32(repr(parts).encode(), value)


def _random_row(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


class FakeDraftModel:
    """A ``core.interfaces.DraftModel`` without weights. Its KV pool records, per slot, the
    position, token and feature row written there; a sequence's logits are seeded random values
    over ``MODEL_VOCAB`` tokens drawn from everything it attends to (as the pool holds it), its
    hidden states likewise per token. Every ``run`` call is recorded in ``calls``."""

    def __init__(self, vocab: int = MODEL_VOCAB, hidden: int = HIDDEN) -> None:
        self.vocab, self.hidden = vocab, hidden
        self.model = torch.nn.Linear(hidden, vocab)
        self.hf_config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=hidden,
                                         architectures=["FakeDraftForCausalLM"])
        self.kv: dict[int, tuple[int, int, int]] = {}
        self.calls: list[list[RunSeq]] = []

    def run(self, seqs: Sequence[DraftSeq], features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = list(seqs)
        if not seqs:
            raise BadRun("DraftModel.run was called with no sequences (the engine's draft forward needs one or more)")
        parsed = []
        for j, q in enumerate(seqs):
            tokens, start = q.tokens, q.start
            if (not isinstance(tokens, (list, tuple)) or not tokens
                    or not all(type(t) is int and 0 <= t < self.vocab for t in tokens)):
                raise BadRun(f"run: sequence {j} has tokens {tokens!r}: want a non-empty list of ints below "
                             f"the vocabulary size {self.vocab}")
            if type(start) is not int or start < 0:
                raise BadRun(f"run: sequence {j} starts at {start!r}: want a position >= 0")
            slots = torch.as_tensor(q.slots).tolist()
            end = start + len(tokens)
            if len(slots) < end:
                raise BadRun(f"run: sequence {j} (positions {start}..{end - 1}) has {len(slots)} slots: it needs one "
                             f"per position up to its last token")
            parsed.append((list(tokens), start, [int(x) for x in slots[:end]]))
        total = sum(len(t) for t, _, _ in parsed)
        if features is not None and (not isinstance(features, torch.Tensor) or features.dim() != 2
                                     or features.shape[0] != total):
            raise BadRun(f"run: features of shape {tuple(getattr(features, 'shape', ()))} for {total} new tokens: "
                         f"want [{total}, F]")
        rows = features.detach().float().cpu() if features is not None else None
        record: list[RunSeq] = []
        row = 0
        for tokens, start, slots in parsed:  # the attended KV as it was before this call's writes
            record.append(RunSeq(tokens, start, slots, [self.kv.get(slots[p]) for p in range(start)]))
        for tokens, start, slots in parsed:  # write every new token's KV
            for i, t in enumerate(tokens):
                feat = _digest(rows[row].numpy().tobytes()) if rows is not None else None
                self.kv[slots[start + i]] = (start + i, t, feat)
                row += 1
        hidden, logits = [], []
        for q in record:
            h = 0
            for p in range(q.end):
                h = _digest(self.kv.get(q.slots[p]), value=h)
                if p >= q.start:
                    hidden.append(_random_row(h, self.hidden))
            logits.append(_random_row(h ^ 0x5EED, self.vocab))
        self.calls.append(record)
        return torch.stack(hidden), torch.stack(logits).float()


class FakeTarget(torch.nn.Module):
    """A small stand-in target model (a draft head may share its embeddings and LM head)."""

    def __init__(self, vocab: int = MODEL_VOCAB, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


@attrs.define
class FakeDraftContext:
    """A ``core.interfaces.DraftContext`` whose ``load_model`` gives a :class:`FakeDraftModel` (any path)."""

    args: Any
    target: torch.nn.Module
    models: list[FakeDraftModel] = attrs.field(factory=list)
    paths: list[str] = attrs.field(factory=list)

    def load_model(self, path: str) -> FakeDraftModel:
        self.paths.append(path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(len(self.models))
            self.models.append(FakeDraftModel())
        return self.models[-1]

    def calls_since(self, marks: list[int]) -> list[list[RunSeq]]:
        return [c for i, m in enumerate(self.models) for c in m.calls[(marks[i] if i < len(marks) else 0):]]

    def marks(self) -> list[int]:
        return [len(m.calls) for m in self.models]


# --------------------------------------------------------------------------- model drafters: the kit as the engine


def _loaded(s: DrafterSubject, case: str) -> tuple[Any, FakeDraftContext]:
    args = fake_args()
    d = s.drafter(args)
    if not is_model_drafter(d):
        raise Skipped("a chain Drafter (propose): for model drafters only")
    if not callable(getattr(d, "load", None)):
        raise fail(s, case, "has propose_batch but no load(ctx): the engine treats it as a ModelDrafter and loads it")
    with torch.random.fork_rng(devices=[]):  # (its weights' initialisation leaves the caller's RNG alone)
        torch.manual_seed(0)
        ctx = FakeDraftContext(args, FakeTarget())
    d.load(ctx)
    return d, ctx


@attrs.define
class Call:
    """One ``propose_batch`` call: its requests, the drafts and the ``run`` calls it made."""

    reqs: list[DraftRequest]
    drafts: list[list[int]]
    runs: list[list[RunSeq]]


def _request(state: dict, tokens: list[int], room: int, row: list[int]) -> DraftRequest:
    kv_len = len(tokens) - 1
    return DraftRequest(state, list(tokens), kv_len, room, torch.tensor(row[:kv_len + room], dtype=torch.int64))


def _propose(s: DrafterSubject, case: str, d: Any, ctx: FakeDraftContext, reqs: list[DraftRequest]) -> Call:
    """``propose_batch(reqs)``, failing ``case`` unless it gives exactly ``room`` ints below the
    vocabulary size per request and every ``run`` call was one the engine's draft model runs."""
    marks = ctx.marks()
    try:
        drafts = d.propose_batch(reqs)
    except BadRun as e:
        raise fail(s, case, str(e)) from None
    rooms = [r.room for r in reqs]
    if not isinstance(drafts, (list, tuple)) or len(drafts) != len(reqs):
        raise fail(s, case, f"propose_batch of {len(reqs)} requests (rooms {rooms}) returned {drafts!r}: want one "
                            f"list per request")
    for i, (r, got) in enumerate(zip(reqs, drafts)):
        if (not isinstance(got, list) or len(got) != r.room
                or not all(type(t) is int and 0 <= t < MODEL_VOCAB for t in got)):
            raise fail(s, case, f"propose_batch: request {i} (kv_len {r.kv_len}, room {r.room}) got {got!r}: want "
                                f"exactly {r.room} ints in [0, {MODEL_VOCAB}) (the vocabulary)")
    return Call(reqs, [list(x) for x in drafts], ctx.calls_since(marks))


def _check_slots(s: DrafterSubject, case: str, n: int, call: Call) -> None:
    """Every sequence of ``call``'s runs writes and attends to its request's slots only, below ``kv_len + room``."""
    owner = {sl: i for i, r in enumerate(call.reqs) for sl in r.slots.tolist()}
    for k, run in enumerate(call.runs):
        for j, q in enumerate(run):
            where = f"propose_batch call {n}, run {k}, sequence {j} (positions {q.start}..{q.end - 1})"
            i = owner.get(q.slots[q.start])
            if i is None:
                raise fail(s, case, f"{where} writes slot {q.slots[q.start]} at position {q.start}: no request of the "
                                    f"batch owns it (their slots are those of positions < kv_len + room)")
            r = call.reqs[i]
            limit = r.kv_len + r.room
            if q.end > limit:
                raise fail(s, case, f"{where} of request {i} (kv_len {r.kv_len}, room {r.room}) reaches position "
                                    f"{q.end - 1}: a request's draft KV goes only at positions < kv_len + room = "
                                    f"{limit} (the last draft token's KV is never needed)")
            mine = r.slots.tolist()
            for p in range(q.end):
                if q.slots[p] != mine[p]:
                    how = "attends to" if p < q.start else "writes"
                    raise fail(s, case, f"{where} of request {i} {how} slot {q.slots[p]} at position {p}: the "
                                        f"request's slot there is {mine[p]}")


def _check_attended(s: DrafterSubject, case: str, n: int, call: Call) -> None:
    """Every position a sequence attends to holds draft KV written for that position."""
    for k, run in enumerate(call.runs):
        for j, q in enumerate(run):
            for p, entry in enumerate(q.attended):
                where = f"propose_batch call {n}, run {k}, sequence {j} (positions {q.start}..{q.end - 1})"
                if entry is None:
                    raise fail(s, case, f"{where} attends to position {p} (slot {q.slots[p]}) where no draft KV was "
                                        f"written")
                if entry[0] != p:
                    raise fail(s, case, f"{where} attends to position {p} (slot {q.slots[p]}), which holds draft KV "
                                        f"written for position {entry[0]}: another sequence wrote over it, or the "
                                        f"request's slots changed since (a retraction empties its state)")


def _simulate(s: DrafterSubject, case: str, steps: int, retract_at: int | None = None) -> list[Call]:
    """A few requests drafted for over ``steps`` verifies, each growing by what a simulated verify
    kept: a prefix of its draft (often the whole), then a token of the target's that differs from
    the next draft token. At step ``retract_at`` requests 0 and 2 are retracted: their state is
    emptied as the engine does it and their slots change."""
    rng = random.Random(seed_for("drafter", case))
    d, ctx = _loaded(s, case)
    lengths = (2, 3, 9, 24, 40)
    free = rng.sample(range(1, POOL_SLOTS), len(lengths) * ROW_SLOTS)
    rows = [free[i * ROW_SLOTS:(i + 1) * ROW_SLOTS] for i in range(len(lengths))]
    tokens = [[rng.randrange(MODEL_VOCAB) for _ in range(n)] for n in lengths]
    states: list[dict] = [{} for _ in lengths]
    calls = []
    for step in range(steps):
        if step == retract_at:
            for i in (0, 2):
                states[i] = {"retractions": 1}  # (core.engine.speculative.Speculator.fill)
                rng.shuffle(rows[i])
        rooms = [rng.choice((0, 1, 2, 5, 5)) for _ in lengths]
        if not any(rooms):
            rooms[0] = 1  # (the engine verifies a batch only when some request drafts)
        call = _propose(s, case, d, ctx, [_request(st, t, n, row) for st, t, n, row in zip(states, tokens, rooms, rows)])
        calls.append(call)
        for t, n, draft in zip(tokens, rooms, call.drafts):
            kept = n if rng.random() < 0.4 else rng.randint(0, n)
            t += draft[:kept]
            t.append(rng.choice([x for x in range(MODEL_VOCAB) if kept == n or x != draft[kept]]))
    return calls


def _same_as_fresh(s: DrafterSubject, case: str, calls: list[Call], first: int = 0) -> None:
    """Each call's drafts (from ``calls[first]`` on) are what a fresh drafter (new model, empty
    states) drafts on the same requests."""
    for n, call in enumerate(calls[first:], first):
        d, ctx = _loaded(s, case)
        fresh = _propose(s, case, d, ctx, [attrs.evolve(r, state={}) for r in call.reqs])
        for i, (r, kept, new) in enumerate(zip(call.reqs, call.drafts, fresh.drafts)):
            if kept != new:
                raise fail(s, case, f"propose_batch call {n}: request {i} ({len(r.tokens)} tokens, room {r.room}) "
                                    f"drafted {kept} with its kept state, {new} with a fresh drafter: the state must "
                                    f"only track which draft KV is valid for the tokens now there")


def check_batch_drafts(s: DrafterSubject) -> None:
    """propose_batch gives exactly room ints below the vocabulary size per request, rooms 0, 1 and 5 in one batch."""
    d, ctx = _loaded(s, "batch_drafts")
    rng = random.Random(seed_for("drafter", "batch_drafts"))
    lengths, rooms = (2, 9, 2, 40, 17, 3, 5), (0, 1, 5, 5, 1, 0, 5)
    free = rng.sample(range(1, POOL_SLOTS), len(lengths) * ROW_SLOTS)
    reqs = [_request({}, [rng.randrange(MODEL_VOCAB) for _ in range(n)], room, free[i * ROW_SLOTS:(i + 1) * ROW_SLOTS])
            for i, (n, room) in enumerate(zip(lengths, rooms))]
    _propose(s, "batch_drafts", d, ctx, reqs)
    _propose(s, "batch_drafts", d, ctx, reqs[:1] + reqs[3:4])  # a second batch: a room of 0 beside one of 5


def check_draft_kv_slots(s: DrafterSubject) -> None:
    """Every run's DraftSeq writes and attends to slots its request owns, at their positions, below kv_len + room."""
    calls = _simulate(s, "draft_kv_slots", steps=8, retract_at=5)
    for n, call in enumerate(calls):
        _check_slots(s, "draft_kv_slots", n, call)


def check_growing_requests(s: DrafterSubject) -> None:
    """Along requests grown by what verifies kept, the kept state drafts what a fresh drafter does,
    attending only to draft KV it wrote."""
    calls = _simulate(s, "growing_requests", steps=10)
    for n, call in enumerate(calls):
        _check_attended(s, "growing_requests", n, call)
    _same_as_fresh(s, "growing_requests", calls)


def check_retracted_requests(s: DrafterSubject) -> None:
    """A retracted request (state emptied, slots changed) is drafted for as a fresh one, then grows again."""
    calls = _simulate(s, "retracted_requests", steps=8, retract_at=4)
    for n, call in enumerate(calls):
        _check_attended(s, "retracted_requests", n, call)
    _same_as_fresh(s, "retracted_requests", calls, first=4)


def drafter_cases() -> list[Case]:
    return [Case(f.__name__.removeprefix("check_"), f, f.__doc__ or "")
            for f in (check_valid_drafts, check_state_is_a_cache, check_shorter_sequences, check_batch_drafts,
                      check_draft_kv_slots, check_growing_requests, check_retracted_requests)]
