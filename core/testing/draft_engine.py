"""The engine a model drafter meets, faked for the drafter suite (``core.testing.drafter``): a fake
draft model whose KV pool records what each slot holds, fake EAGLE heads, a fake target, a fake
``DraftContext``, and ``Engine``, which plays the engine's prefills, verifies (chains and trees),
plain decodes, observations and retractions around a drafter and records every draft-model call."""

from __future__ import annotations

import functools
import random
import zlib
from types import SimpleNamespace
from typing import Any, Sequence

import attrs
import torch

from core.engine.speculative.tree import walk
from core.errors import ModelLoadError
from core.interfaces import DraftObservation, DraftRequest, DraftSeq, DraftTree
from core.testing.suite import Skipped, fail, seed_for


# the fake draft model: vocabulary, hidden size, KV pool slots (slot 0 is padding), slots per request
MODEL_VOCAB, HIDDEN, POOL_SLOTS, ROW_SLOTS = 32, 8, 4096, 256
TARGET_LAYERS, CHUNK, PLAIN_STEP = 8, 16, 2  # the fake target's layers; a prefill chunk; the step decoding plainly
DRAFT_PATHS = ("fake", "fake-eagle", "fake-eagle3")  # the fake draft models: a plain one, EAGLE and EAGLE-3 heads


def is_model_drafter(drafter: Any) -> bool:
    """Whether the engine treats ``drafter`` as a :class:`core.interfaces.ModelDrafter`."""
    return callable(getattr(drafter, "propose_batch", None))


def fake_args(draft_model_path: str | None = "fake", topk: int | None = None) -> Any:
    """The engine's ``EngineArgs``: by default a model drafter's, with a draft model path and the
    other ``speculative_*`` flags unset (``topk``: ``speculative_eagle_topk``)."""
    from core.engine.config import EngineArgs

    return EngineArgs(speculative_draft_model_path=draft_model_path, speculative_eagle_topk=topk)


def as_draft(draft: Any, vocab: int | None = None) -> tuple[list[int], list[int] | None] | None:
    """A draft's (tokens, parents): a list of non-negative ints (below ``vocab``; parents None) or a
    ``DraftTree`` whose parents are -1 or an earlier node; None where it is neither."""
    tokens, parents = (draft.tokens, draft.parents) if isinstance(draft, DraftTree) else (draft, None)
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 and (vocab is None or t < vocab)
                                               for t in tokens):
        return None
    if parents is not None and (not isinstance(parents, list) or len(parents) != len(tokens)
                                or not all(type(p) is int and -1 <= p < j for j, p in enumerate(parents))):
        return None
    chain = parents is None or list(parents) == list(range(-1, len(tokens) - 1))
    return list(tokens), (None if chain else list(parents))  # (a chain-shaped tree: a chain, as the engine takes it)


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
    drafts: list[tuple[list[int], list[int] | None]] | None  # per request (tokens, parents: None for a chain)
    runs: list[list[RunSeq]]


@attrs.define
class Engine:
    """The kit playing the engine for a loaded model drafter: requests (their tokens, the drafter's
    state, their slots of positions 0..) that are prefilled, drafted for and verified, or decoded
    plainly. A drafter that called ``ctx.capture`` is handed after every simulated target forward
    what ``Speculator.observe`` hands it, with the fake target's features (``target_features``).
    Every call of the drafter is recorded in ``calls``."""

    s: Any
    case: str
    d: Any
    ctx: FakeDraftContext
    tokens: list[list[int]]
    slots: list[list[int]]
    states: list[dict] = attrs.field()
    rng: random.Random = attrs.field()
    calls: list[Call] = attrs.field(factory=list)
    retracted: int = 0  # calls made before the last retraction
    topk: int = 1  # the drafter's speculative_eagle_topk

    @states.default
    def _states(self) -> list[dict]:
        return [{} for _ in self.tokens]

    @rng.default
    def _rng(self) -> random.Random:
        return random.Random(seed_for("drafter", self.case, "engine"))

    @classmethod
    def load(cls, s: Any, case: str, tokens: list[list[int]], slots: list[list[int]],
             topk: int = 1) -> Engine:
        """A drafter constructed and loaded as the engine does (``topk``: its ``speculative_eagle_topk``),
        on the first of the fake draft models (a plain model, an EAGLE head, an EAGLE-3 head) that
        its ``load`` takes."""
        refused = []
        for path in DRAFT_PATHS:
            args = fake_args(path, topk if topk > 1 else None)
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
            return cls(s, case, d, ctx, [list(t) for t in tokens], [list(x) for x in slots], topk=topk)
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
        per request exactly ``room`` ints below the vocabulary size, or a DraftTree of ``room`` such nodes."""
        reqs = [DraftRequest(self.states[i], list(self.tokens[i]), len(self.tokens[i]) - 1, n,
                             torch.tensor(self.slots[i][:len(self.tokens[i]) - 1 + n], dtype=torch.int64))
                for i, n in rooms.items()]
        label = "propose_batch" + (f", speculative_eagle_topk {self.topk}" if self.topk > 1 else "")
        what = f"call {len(self.calls)} ({label})"
        drafts, runs = self._call(label, self.d.propose_batch, reqs)
        if not isinstance(drafts, (list, tuple)) or len(drafts) != len(reqs):
            raise fail(self.s, self.case, f"{what} of {len(reqs)} requests (rooms {list(rooms.values())}) returned "
                                          f"{drafts!r}: want one list per request")
        got = [as_draft(x, MODEL_VOCAB) for x in drafts]
        for i, (r, x, g) in enumerate(zip(reqs, drafts, got)):
            if g is None or len(g[0]) != r.room:
                raise fail(self.s, self.case, f"{what}: request {i} (kv_len {r.kv_len}, room {r.room}) got {x!r}: "
                                              f"want exactly {r.room} ints in [0, {MODEL_VOCAB}) (the vocabulary), or a "
                                              f"DraftTree of {r.room} such nodes whose parents are -1 or an earlier node")
        self.calls.append(Call(what, reqs, got, runs))
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
        """Drafts for requests ``rooms`` verified: the target samples, at the last token and at each
        node, one of its children's tokens (often) or another token; each request keeps the path
        ``core.engine.speculative.tree.walk`` follows (a chain's prefix, often the whole), then the
        target's token after it. The forward the drafter observes holds the last token and the kept
        path (the rows ``Speculator.observe`` selects)."""
        call = self.propose(rooms)
        kept = {}
        for i, (tokens, parents) in zip(rooms, call.drafts):
            sampled = []
            for node in range(-1, len(tokens)):
                kids = [t for j, t in enumerate(tokens) if (parents[j] if parents else j - 1) == node]
                sampled.append(self.rng.choice(kids) if kids and self.rng.random() < 0.8 else
                               self.rng.choice([x for x in range(MODEL_VOCAB) if x not in kids]))
            path, nxt = walk(tokens, parents, sampled)
            kept[i] = [tokens[j] for j in path] + [nxt]
        self.forward([(i, len(self.tokens[i]) - 1, [self.tokens[i][-1], *kept[i][:-1]], kept[i]) for i in rooms])
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
