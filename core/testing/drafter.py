"""The drafter suite (speculative decoding): what the engine relies on of a drafter.

A chain drafter (``Drafter.propose``) is checked over seeded random token sequences (with
repeats, so that copying drafters find something): a draft is a list of at most ``max_tokens``
non-negative ints (``max_tokens`` 0 gives ``[]``); the per-request ``state`` only caches
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
then verify batches with rooms of 0 to 5 tokens, grown by what a simulated verify kept (a prefix
of the draft, then a token of the target's), and a plain decode step. A drafter that called
``ctx.capture(layers)`` gets ``observe`` after every such forward, as ``Speculator.observe``
makes it: per request the positions whose results stand and the token after each, with features
``len(layers) * hidden`` wide (``hidden`` for ``()``) that are seeded random values of the
tokens up to each position. The cases check: ``propose_batch`` gives exactly ``room`` ints below
the vocabulary size per request (``batch_drafts``); every ``DraftSeq`` writes and attends only to
slots the request owns, at their positions, and no position from ``kv_len + room`` on (in
``observe``: past the positions observed) (``draft_kv_slots``); along growing requests every
position attended holds KV written for it, and below ``kv_len`` the KV of the tokens and target
features now there, and the kept state drafts what a fresh drafter does after a prefill of the
same tokens (``growing_requests``); a retracted request (its state emptied, its slots changed,
prefilled again) is handled (``retracted_requests``). How much a drafter recomputes is its own
choice.

The engine verifies every draft, so no case judges a draft's quality.
"""

from __future__ import annotations

import functools
import random
import zlib
from types import SimpleNamespace
from typing import Any, Sequence

import attrs
import torch

from core.errors import ModelLoadError
from core.interfaces import DraftObservation, DraftRequest, DraftSeq
from core.testing.suite import Case, Skipped, fail, resolve_target, seed_for

KIND = "speculative_algorithm"
SEQUENCES, VOCAB = 6, 40

# the fake draft model: vocabulary, hidden size, KV pool slots (slot 0 is padding), slots per request
MODEL_VOCAB, HIDDEN, POOL_SLOTS, ROW_SLOTS = 32, 8, 4096, 256
TARGET_LAYERS, CHUNK, PLAIN_STEP = 8, 16, 2  # the fake target's layers; a prefill chunk; the step decoding plainly
DRAFT_PATHS = ("fake", "fake-eagle", "fake-eagle3")  # the fake draft models: a plain one, EAGLE and EAGLE-3 heads
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


@functools.lru_cache(maxsize=1 << 16)
def target_features(tokens: tuple[int, ...], width: int) -> torch.Tensor:
    """The fake target's features at the last of ``tokens`` (seeded random values of all of them)."""
    return _random_row(_digest("features", tokens), width)


@functools.lru_cache(maxsize=1 << 16)
def _features_digest(tokens: tuple[int, ...], width: int) -> int:
    return _digest(target_features(tokens, width).numpy().tobytes())


class FakeHead(torch.nn.Module):
    """The ``model`` of a fake EAGLE head, as a drafter reads SGLang's ``LlamaForCausalLMEagle``:
    ``share_target``, ``capture_layers`` (``()``: the target's final hidden states) and
    ``feature_size`` (the width of the target's features it reads)."""

    eagle3 = False

    def __init__(self) -> None:
        super().__init__()
        self.feature_size = HIDDEN * (3 if self.eagle3 else 1)
        self.target: torch.nn.Module | None = None

    def share_target(self, target: torch.nn.Module) -> None:
        self.target = target

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        n = num_target_layers
        return (2, n // 2, n - 3) if self.eagle3 else ()


class FakeLlamaForCausalLMEagle(FakeHead):
    pass


class FakeLlamaForCausalLMEagle3(FakeHead):
    eagle3 = True


class FakeDraftModel:
    """A ``core.interfaces.DraftModel`` without weights: a plain model, or with ``head`` an EAGLE
    head (its ``model``), whose ``run`` takes features. Its KV pool records, per slot, the
    position, token and a digest of the feature row written there; a sequence's logits are seeded
    random values over ``MODEL_VOCAB`` tokens drawn from everything it attends to (as the pool
    holds it), its hidden states likewise per token. Every ``run`` call is recorded in ``calls``."""

    def __init__(self, vocab: int = MODEL_VOCAB, hidden: int = HIDDEN, head: FakeHead | None = None) -> None:
        self.vocab, self.hidden, self.head = vocab, hidden, head
        self.model = head if head is not None else torch.nn.Linear(hidden, vocab)
        self.hf_config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=hidden,
                                         architectures=[type(self.model).__name__ if head else "FakeDraftForCausalLM"])
        self.kv: dict[int, tuple[int, int, int | None]] = {}
        self.calls: list[list[RunSeq]] = []

    def _check_features(self, features: Any, total: int) -> None:
        if self.head is None:
            if features is not None:
                raise BadRun("run: features for a draft model whose forward takes none (an EAGLE head's does)")
            return
        widths = sorted({self.head.feature_size, self.hidden})
        if features is None:
            raise BadRun(f"run: an EAGLE head needs features: [T, {self.head.feature_size}] of the target's, or "
                         f"[T, {self.hidden}] of its own hidden states")
        if self.head.target is None:
            raise BadRun("run before the head's share_target(ctx.target): it takes the target's embeddings and LM head")
        if (not isinstance(features, torch.Tensor) or features.dim() != 2 or features.shape[0] != total
                or features.shape[1] not in widths):
            raise BadRun(f"run: features of shape {tuple(getattr(features, 'shape', ()))} for {total} new tokens: want "
                         f"[{total}, F], F one of {widths} (the target's features, or the head's own hidden states)")

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
        self._check_features(features, sum(len(t) for t, _, _ in parsed))
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
        self.config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=TARGET_LAYERS)
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


@attrs.define
class FakeDraftContext:
    """A ``core.interfaces.DraftContext`` whose ``load_model`` gives a :class:`FakeDraftModel`: an
    EAGLE head at ``fake-eagle``, an EAGLE-3 head at ``fake-eagle3``, a plain model at any other path."""

    args: Any
    target: torch.nn.Module
    device: torch.device = torch.device("cpu")
    models: list[FakeDraftModel] = attrs.field(factory=list)
    paths: list[str] = attrs.field(factory=list)
    layers: tuple[int, ...] | None = None  # what ``capture`` asked for

    def load_model(self, path: str) -> FakeDraftModel:
        self.paths.append(path)
        head = {"fake-eagle": FakeLlamaForCausalLMEagle, "fake-eagle3": FakeLlamaForCausalLMEagle3}.get(path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(len(self.models))
            self.models.append(FakeDraftModel(head=head() if head else None))
        return self.models[-1]

    def capture(self, layers: Sequence[int]) -> None:
        if any(type(i) is not int or not 0 <= i <= TARGET_LAYERS for i in layers):
            raise ModelLoadError(f"the draft head reads the target's layers {list(layers)}; the target has "
                                 f"{TARGET_LAYERS}")
        self.layers = tuple(layers)

    @property
    def width(self) -> int | None:
        """The width of the features the drafter asked for: the target's hidden size per layer, or None."""
        return None if self.layers is None else HIDDEN * max(1, len(self.layers))

    def calls_since(self, marks: list[int]) -> list[list[RunSeq]]:
        return [c for i, m in enumerate(self.models) for c in m.calls[(marks[i] if i < len(marks) else 0):]]

    def marks(self) -> list[int]:
        return [len(m.calls) for m in self.models]


# --------------------------------------------------------------------------- model drafters: the kit as the engine


@attrs.define
class Call:
    """One drafter call: ``propose_batch`` (and its drafts) or ``observe`` (``drafts`` None; per
    observation a DraftRequest of the tokens then, ``kv_len`` = its ``start`` and ``room`` =
    ``len(next_ids)``: the positions it stands for), and the ``run`` calls it made."""

    what: str
    reqs: list[DraftRequest]
    drafts: list[list[int]] | None
    runs: list[list[RunSeq]]


@attrs.define
class Engine:
    """The kit playing the engine for a loaded model drafter: requests (their tokens, the drafter's
    state, their slots of positions 0..) that are prefilled, drafted for and verified, or decoded
    plainly. A drafter that called ``ctx.capture`` is handed after every simulated target forward
    what ``Speculator.observe`` hands it, with the fake target's features (``target_features``).
    Every call of the drafter is recorded in ``calls``."""

    s: DrafterSubject
    case: str
    d: Any
    ctx: FakeDraftContext
    tokens: list[list[int]]
    slots: list[list[int]]
    states: list[dict] = attrs.field()
    rng: random.Random = attrs.field()
    calls: list[Call] = attrs.field(factory=list)
    retracted: int = 0  # calls made before the last retraction

    @states.default
    def _states(self) -> list[dict]:
        return [{} for _ in self.tokens]

    @rng.default
    def _rng(self) -> random.Random:
        return random.Random(seed_for("drafter", self.case, "engine"))

    @classmethod
    def load(cls, s: DrafterSubject, case: str, tokens: list[list[int]], slots: list[list[int]]) -> Engine:
        """A drafter constructed and loaded as the engine does, on the first of the fake draft
        models (a plain model, an EAGLE head, an EAGLE-3 head) that its ``load`` takes."""
        refused = []
        for path in DRAFT_PATHS:
            args = fake_args(path)
            d = s.drafter(args)
            if not is_model_drafter(d):
                raise Skipped("a chain Drafter (propose): for model drafters only")
            if not callable(getattr(d, "load", None)):
                raise fail(s, case, "has propose_batch but no load(ctx): the engine treats it as a ModelDrafter and "
                                    "loads it")
            with torch.random.fork_rng(devices=[]):  # (its weights' initialisation leaves the caller's RNG alone)
                torch.manual_seed(0)
                ctx = FakeDraftContext(args, FakeTarget())
            try:
                d.load(ctx)
            except ModelLoadError as e:
                refused.append(f"{path!r}: {e}")
                continue
            if ctx.layers is not None and not callable(getattr(d, "observe", None)):
                raise fail(s, case, "called ctx.capture but has no observe(reqs, features): the engine hands it the "
                                    "target's features after every forward")
            return cls(s, case, d, ctx, [list(t) for t in tokens], [list(x) for x in slots])
        raise fail(s, case, "load(ctx) refused every fake draft model: " + "; ".join(refused))

    def _call(self, what: str, fn: Any, *args: Any) -> tuple[Any, list[list[RunSeq]]]:
        marks = self.ctx.marks()
        try:
            out = fn(*args)
        except BadRun as e:
            raise fail(self.s, self.case, f"call {len(self.calls)} ({what}): {e}") from None
        return out, self.ctx.calls_since(marks)

    def propose(self, rooms: dict[int, int]) -> Call:
        """``propose_batch`` for requests ``rooms`` (index: room), failing the case unless it gives
        exactly ``room`` ints below the vocabulary size per request."""
        reqs = [DraftRequest(self.states[i], list(self.tokens[i]), len(self.tokens[i]) - 1, n,
                             torch.tensor(self.slots[i][:len(self.tokens[i]) - 1 + n], dtype=torch.int64))
                for i, n in rooms.items()]
        what = f"call {len(self.calls)} (propose_batch)"
        drafts, runs = self._call("propose_batch", self.d.propose_batch, reqs)
        if not isinstance(drafts, (list, tuple)) or len(drafts) != len(reqs):
            raise fail(self.s, self.case, f"{what} of {len(reqs)} requests (rooms {list(rooms.values())}) returned "
                                          f"{drafts!r}: want one list per request")
        for i, (r, got) in enumerate(zip(reqs, drafts)):
            if (not isinstance(got, list) or len(got) != r.room
                    or not all(type(t) is int and 0 <= t < MODEL_VOCAB for t in got)):
                raise fail(self.s, self.case, f"{what}: request {i} (kv_len {r.kv_len}, room {r.room}) got {got!r}: "
                                              f"want exactly {r.room} ints in [0, {MODEL_VOCAB}) (the vocabulary)")
        self.calls.append(Call(what, reqs, [list(x) for x in drafts], runs))
        return self.calls[-1]

    def forward(self, items: list[tuple[int, int, list[int], list[int]]]) -> None:
        """A target forward over ``items``: per request (index, the first position processed, the
        tokens processed from there, the token after each position whose result stands), then
        ``observe`` as the engine calls it, where the drafter asked for features."""
        width = self.ctx.width
        if width is None:
            return
        obs, reqs, features, row = [], [], [], 0
        for i, start, processed, next_ids in items:
            seq = self.tokens[i][:start] + processed
            features += [target_features(tuple(seq[:p + 1]), width) for p in range(start, len(seq))]
            slots = torch.tensor(self.slots[i][:start + len(next_ids)], dtype=torch.int64)
            obs.append(DraftObservation(self.states[i], start, list(next_ids), row, slots.clone()))
            reqs.append(DraftRequest(self.states[i], seq, start, len(next_ids), slots))
            row += len(processed)
        _, runs = self._call("observe", self.d.observe, obs, torch.stack(features))
        self.calls.append(Call(f"call {len(self.calls)} (observe)", reqs, None, runs))

    def prefill(self, which: Sequence[int]) -> None:
        """Requests ``which`` prefilled (those longer than ``CHUNK`` tokens in two chunks), each then
        sampling a token."""
        long = [i for i in which if len(self.tokens[i]) > CHUNK]
        if long:
            self.forward([(i, 0, self.tokens[i][:CHUNK], self.tokens[i][1:CHUNK + 1]) for i in long])
        new = {i: self.rng.randrange(MODEL_VOCAB) for i in which}
        self.forward([(i, start, self.tokens[i][start:], self.tokens[i][start + 1:] + [new[i]])
                      for i in which for start in [CHUNK if i in long else 0]])
        for i in which:
            self.tokens[i].append(new[i])

    def decode(self) -> None:
        """A plain decode step of every request (the engine's when no request drafts)."""
        new = [self.rng.randrange(MODEL_VOCAB) for _ in self.tokens]
        self.forward([(i, len(t) - 1, [t[-1]], [x]) for i, (t, x) in enumerate(zip(self.tokens, new))])
        for t, x in zip(self.tokens, new):
            t.append(x)

    def verify(self, rooms: dict[int, int]) -> Call:
        """Drafts for requests ``rooms`` verified: each keeps a prefix of its draft (often the whole),
        then a token of the target's that differs from the next draft token."""
        call = self.propose(rooms)
        kept = {}
        for (i, n), draft in zip(rooms.items(), call.drafts):
            k = n if self.rng.random() < 0.4 else self.rng.randint(0, n)
            kept[i] = draft[:k] + [self.rng.choice([x for x in range(MODEL_VOCAB) if k == n or x != draft[k]])]
        self.forward([(i, len(self.tokens[i]) - 1, [self.tokens[i][-1], *draft], kept[i])
                      for i, draft in zip(rooms, call.drafts)])
        for i in rooms:
            self.tokens[i] += kept[i]
        return call

    def written(self, tokens: Sequence[int], p: int) -> tuple[int, int, int | None]:
        """The draft KV position ``p`` holds once its result stands: a model's of the token there;
        a head's of the token after it, beside the target's features at ``p``."""
        width = self.ctx.width
        if width is None:
            return (p, tokens[p], None)
        return (p, tokens[p + 1], _features_digest(tuple(tokens[:p + 1]), width))


def _rows(rng: random.Random, n: int) -> list[list[int]]:
    """Slots of positions 0.. for ``n`` requests: ``ROW_SLOTS`` each, scattered over the pool."""
    free = rng.sample(range(1, POOL_SLOTS), n * ROW_SLOTS)
    return [free[i * ROW_SLOTS:(i + 1) * ROW_SLOTS] for i in range(n)]


def _requests(rng: random.Random, lengths: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    return [[rng.randrange(MODEL_VOCAB) for _ in range(n)] for n in lengths], _rows(rng, len(lengths))


def _where(call: Call, k: int, j: int, q: RunSeq) -> str:
    return f"{call.what}, run {k}, sequence {j} (positions {q.start}..{q.end - 1})"


def _check_slots(e: Engine, call: Call) -> None:
    """Every sequence of ``call``'s runs writes and attends to its request's slots only, below
    ``kv_len + room`` (an observation: below ``start + len(next_ids)``)."""
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
            for p in range(q.end):
                if q.slots[p] != mine[p]:
                    how = "attends to" if p < q.start else "writes"
                    raise fail(s, case, f"{_where(call, k, j, q)} of request {i} {how} slot {q.slots[p]} at position "
                                        f"{p}: the request's slot there is {mine[p]}")


def _check_attended(e: Engine, call: Call) -> None:
    """Every position a sequence attends to holds draft KV written for that position, and where
    the position's result stands (below ``kv_len``), the KV of the tokens (and features) now there."""
    s, case = e.s, e.case
    owner = {sl: i for i, r in enumerate(call.reqs) for sl in r.slots.tolist()}
    for k, run in enumerate(call.runs):
        for j, q in enumerate(run):
            r = call.reqs[i] if (i := owner.get(q.slots[q.start])) is not None else None
            if r is not None and q.slots != r.slots.tolist()[:q.end]:
                r = None  # not its request's slots throughout (draft_kv_slots says so): no content to expect
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
        fresh = Engine.load(e.s, e.case, [list(r.tokens) for r in call.reqs], [r.slots.tolist() for r in call.reqs])
        fresh.forward([(i, 0, t[:-1], t[1:]) for i, t in enumerate(fresh.tokens)])
        new = fresh.propose(dict(enumerate(r.room for r in call.reqs)))
        for i, (r, kept, got) in enumerate(zip(call.reqs, call.drafts, new.drafts)):
            if kept != got:
                raise fail(e.s, e.case, f"{call.what}: request {i} ({len(r.tokens)} tokens, room {r.room}) drafted "
                                        f"{kept} with its kept state, {got} with a fresh drafter: the state must only "
                                        f"track which draft KV is valid for the tokens now there")


def _simulate(s: DrafterSubject, case: str, steps: int, retract_at: int | None = None) -> Engine:
    """A few requests prefilled, then ``steps`` verifies of rooms 0 to 5 (step ``PLAIN_STEP`` a plain
    decode instead). At step ``retract_at`` requests 0 and 2 are retracted: their state is emptied
    as the engine does it, their slots change, and they are prefilled again."""
    rng = random.Random(seed_for("drafter", case))
    tokens, slots = _requests(rng, (2, 3, 9, 24, 40))
    e = Engine.load(s, case, tokens, slots)
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
    """propose_batch gives exactly room ints below the vocabulary size per request, rooms 0, 1 and 5 in one batch."""
    rng = random.Random(seed_for("drafter", "batch_drafts"))
    e = Engine.load(s, "batch_drafts", *_requests(rng, (2, 9, 2, 40, 17, 3, 5)))
    e.prefill(range(len(e.tokens)))
    e.verify(dict(enumerate((0, 1, 5, 5, 1, 0, 5))))
    e.verify({0: 0, 3: 5})  # a second batch: a room of 0 beside one of 5


def check_draft_kv_slots(s: DrafterSubject) -> None:
    """Every run's DraftSeq writes and attends to slots its request owns, at their positions, below
    kv_len + room (in observe: below the positions observed)."""
    e = _simulate(s, "draft_kv_slots", steps=8, retract_at=5)
    for call in e.calls:
        _check_slots(e, call)


def check_growing_requests(s: DrafterSubject) -> None:
    """Along requests grown by what verifies kept, the kept state drafts what a fresh drafter does,
    attending only to draft KV of the tokens (and target features) now there."""
    e = _simulate(s, "growing_requests", steps=10)
    for call in e.calls:
        _check_attended(e, call)
    _same_as_fresh(e)


def check_retracted_requests(s: DrafterSubject) -> None:
    """A retracted request (state emptied, slots changed, prefilled again) is drafted for as a fresh one, then grows again."""
    e = _simulate(s, "retracted_requests", steps=8, retract_at=4)
    for call in e.calls:
        _check_attended(e, call)
    _same_as_fresh(e, since=e.retracted)


def drafter_cases() -> list[Case]:
    return [Case(f.__name__.removeprefix("check_"), f, f.__doc__ or "")
            for f in (check_valid_drafts, check_state_is_a_cache, check_shorter_sequences, check_batch_drafts,
                      check_draft_kv_slots, check_growing_requests, check_retracted_requests)]
