"""Speculative decoding: drafts verified by the target model in one forward.

A drafter plugin (``--speculative-algorithm NAME``, hook ``register_speculative_algorithms``)
proposes per request a chain of tokens or a tree (``core.engine.speculative.tree``): NGRAM from
the request's own context on the scheduler's thread, a model drafter (STANDALONE, EAGLE, EAGLE3;
``draft_model``) on the forward thread just before the verify. The verify batch holds each
request's last token and its draft as one extend; the model runner samples every position as
plain decoding would, with the request's own parameters and RNG. Walking from the last token, a
draft token is kept while it is what the target sampled at its parent, and the target's own next
sample follows the kept path, so a step yields one to depth + 1 tokens for one read of the weights.
In float32, greedy decoding gives plain decoding's tokens; in bf16, or with the CPU's int8 LM head,
a verify's rows take the extend path, whose rounding differs from the decode kernels', so a
near-tie may resolve the other way. With sampling, keeping a draft token ``d`` when the target's
sample equals ``d`` is rejection sampling against a drafter that proposes deterministically
(``q = onehot(d)``), so the output distribution is the target's; a seeded request's generator
spends a draw per kept token only (``sampler.rewind``), so its samples are plain decoding's. The
KV of rejected tokens stays in the request's pages and is written over; a tree's kept nodes have
their KV moved to their positions right after the verify (``ModelRunner``); the prefix cache
never sees rejected KV.

Drafts are paced per request (``Pace``) and a verify holds at most ``VERIFY_TOKEN_BUDGET`` tokens,
so a large batch decodes plainly. Requests whose sampling reads their own outputs on the host
between positions (a grammar, penalties, ``min_new_tokens`` not reached) or that return logprobs
are not drafted for; a batch holding one decodes plainly. Under overlap scheduling a step that
may verify waits for the one in flight (``may_verify``: a draft follows the last token), as does
every step after a verify; the steps of requests that are not drafting (``Pace.wait``) overlap,
and with overlap a request the drafter has nothing for waits 1, 2, 4 then 8 steps before asking
again (``Pace.none``), so that text that does not repeat keeps most steps overlapped.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import structlog
import torch

from core.engine.request import Req
from core.engine.sampler import draws_ahead, penalised
from core.errors import CoreError
from core.engine.speculative.accept import TargetRows, Thresholds, relaxed_walks
from core.engine.speculative.tree import as_tree, depths, first_chain, kv_moves, walk
from core.interfaces import DraftObservation, DraftRequest

log = structlog.get_logger("core.engine.speculative")

# how many tokens before a thinking budget closes a request stops taking several tokens a step
# (speculative verifies, continuous decode steps), so that none of them passes the forced end tag
THINKING_LOOKAHEAD = 256
DEFAULT_NUM_DRAFT_TOKENS = 12  # SGLang's default for NGRAM: the last token and 11 drafted
DEFAULT_NUM_STEPS = 5  # model drafters' chain length (SGLang's usual choice of --speculative-num-steps)
# Tokens one verify forward may hold, the batch's last tokens included, per device kind: about where
# the forward stops being bound by reading the weights and its cost starts to grow with its tokens
# (2 Zen 4 cores: a 135M model's batch-1 decode reads ~0.1 GB in ~5 ms, a token's GEMMs take ~0.3 ms).
# A batch of more requests decodes plainly: speculation switches itself off under load.
VERIFY_TOKEN_BUDGET = {"cpu": 32, "cuda": 256}
MAX_BACKOFF = 16  # decode steps a request waits, at most, before drafting again after a verify kept too few
MAX_IDLE = 8  # with overlap, decode steps a request waits, at most, after the drafter had nothing for it
# Draft tokens a verify must keep to have paid for itself, per device kind: on the CPU a verify
# runs the extend path, which costs two to three fused decode steps even for a few tokens; on a
# GPU a short verify costs about one decode step.
MIN_KEPT = {"cpu": 2, "cuda": 1}
# SGLang's --speculative-ngram-* flags that shape NGRAM's drafts (EngineArgs.speculative_ngram_*)
NGRAM_FLAGS = ("max_trie_depth", "min_bfs_breadth", "max_bfs_breadth", "match_type", "capacity")
SMALL_BATCH = 4  # a larger batch verifies only with at least ``min_draft_share`` draft tokens per request


@attrs.define
class Pace:
    """A request's recent acceptance, which sizes its next drafts: about twice the draft tokens
    its recent verifies kept, plus one (times the last draft's nodes per level, for a tree); after
    a verify that kept fewer than ``min_kept`` it waits 1, 2, 4, ... 16 steps before drafting
    again, so an answer that does not repeat costs few verifies that do not pay."""

    kept: float = 2.0  # moving average of draft tokens kept per verify
    width: float = 1.0  # the last draft's nodes per level (1: a chain)
    wait: int = 0  # steps to decode plainly before the next draft
    backoff: int = 0  # the next wait after a verify that keeps nothing
    retractions: int = 0  # the request's retractions its drafter's state has seen (Speculator.fill)
    idle: int = 0  # the last wait after the drafter had nothing (``none``)

    def want(self, room: int) -> int:
        if self.wait > 0:
            self.wait -= 1
            return 0
        return min(room, math.ceil((1 + 2 * self.kept) * self.width))

    def none(self) -> None:
        """The drafter had nothing: wait 1, 2, 4 then 8 steps (steps that overlap) before asking again."""
        self.wait = self.idle = min(MAX_IDLE, max(1, 2 * self.idle))

    def update(self, n: int, nodes: int = 1, depth: int = 1, min_kept: int = 1) -> None:
        self.kept, self.width = 0.5 * self.kept + 0.5 * n, nodes / max(depth, 1)
        if n >= min_kept:
            self.backoff = 0
        else:
            self.wait = self.backoff = min(MAX_BACKOFF, max(1, 2 * self.backoff))


@attrs.define
class Speculator:
    """What the scheduler asks for a verify batch (``verify_batch``), the runner for a model
    drafter's drafts (``fill``), and the scheduler uses to count what a verify kept (``kept``)."""

    drafter: Any  # core.interfaces.Drafter or ModelDrafter
    num_draft_tokens: int  # tokens per verify and request, the last known one included (SGLang's meaning)
    batched: bool = attrs.field(init=False)  # a ModelDrafter: drafts come from the runner (``fill``)
    token_budget: int = VERIFY_TOKEN_BUDGET["cpu"]  # tokens per verify forward, set for the device by ``load``
    min_kept: int = MIN_KEPT["cpu"]  # a verify keeping fewer backs its request off (``Pace``), set by ``load``
    min_draft_share: float = 0.5  # draft tokens per request a verify of more than SMALL_BATCH requests needs
    features: Any = None  # () -> the last target forward's features, where the drafter asked (``observe``)
    trees: bool = False  # draft trees are verified whole (``load``: the backend takes tree masks, and they pay)
    overlap: bool = False  # overlap scheduling (set by the engine): an empty proposal waits (``Pace.none``)
    # requests a verify may hold (0: the token budget's bound only); with CUDA graphs of verifies, the
    # largest captured size: a larger verify would run eagerly, slower than the plain decode's graph
    # (H200, 8B shapes, 64 streams: 3,586 against 8,905 tok/s), so such a batch decodes plainly
    max_verify_reqs: int = 0
    # SGLang's --speculative-accept-threshold-single/-acc below 1: sampled drafts kept more readily
    # (``accept``); None: the exact walk, the target's distribution
    accept: Thresholds | None = None

    def __attrs_post_init__(self) -> None:
        self.batched = hasattr(self.drafter, "propose_batch")

    def load(self, ctx: Any) -> None:
        """Load a model drafter's models (``ctx``: a ``core.interfaces.DraftContext``)."""
        self.token_budget = VERIFY_TOKEN_BUDGET.get(ctx.device.type, VERIFY_TOKEN_BUDGET["cuda"])
        if self.num_draft_tokens > self.token_budget:  # (a draft no verify could hold, nor its CUDA graphs)
            raise CoreError(f"--speculative-num-draft-tokens {self.num_draft_tokens} (with --speculative-num-steps and "
                            f"--speculative-eagle-topk): a verify on {ctx.device.type} holds at most "
                            f"{self.token_budget} tokens, its CUDA graphs are captured up to that; use at most "
                            f"{self.token_budget}")
        self.min_kept = MIN_KEPT.get(ctx.device.type, MIN_KEPT["cuda"])
        topk = ctx.args.speculative_eagle_topk or 1
        # On the CPU a tree verify leaves the fused C++ layers for the Python ones (their attention is
        # causal): a chain drafter's trees (NGRAM's) are cut to their first chain there, as without
        # tree masks; trees asked for with --speculative-eagle-topk are verified whole.
        self.trees = bool(getattr(ctx, "trees", False)) and (ctx.device.type != "cpu" or topk > 1)
        if topk > 1 and not self.trees:
            raise CoreError(f"--speculative-eagle-topk {ctx.args.speculative_eagle_topk}: draft trees need an attention "
                            "backend that takes tree masks (cpu, torch_native, triton) and no sliding-window layers; "
                            "use --speculative-eagle-topk 1")
        if self.batched:
            self.drafter.load(ctx)
            self.features = getattr(ctx, "features", None)
            if (capture := getattr(ctx, "capture_graphs", None)) is not None:  # (once the drafter set its models up)
                capture()

    def may_verify(self, running: list[Req]) -> bool:
        """Whether the next step may verify drafts, or a verify is in flight (a request's KV runs
        past its tokens): under overlap scheduling it then waits for the step in flight. The
        draft tokens the requests due to draft want bound what ``verify_batch`` could draft: a
        large batch that could not pass its ``min_draft_share`` keeps overlapping."""
        if any(r.kv_len > r.seq_len for r in running):
            return True
        n = len(running)
        if not self._holds(n):  # (verify_batch drafts for none of them)
            return False
        wanted = sum(math.ceil((1 + 2 * p.kept) * p.width) for r in running if (p := r.spec_pace or _FRESH).wait == 0)
        return (wanted > 0 and (n <= SMALL_BATCH or wanted >= self.min_draft_share * n)
                and all(map(multi_token_ok, running)))

    def _holds(self, n: int) -> bool:
        """Whether a verify may hold ``n`` requests: their last tokens leave room for drafts in the
        token budget, and (with verify graphs) the largest graph holds them."""
        return n < self.token_budget and n <= (self.max_verify_reqs or n)

    def room(self, r: Req, context_len: int) -> int:
        """The draft tokens a verify of ``r`` may hold: within its ``max_new_tokens`` and the context."""
        return max(0, min(self.num_draft_tokens - 1, r.params.max_new_tokens - len(r.output_ids) - 1,
                          context_len - r.seq_len - 1))

    def verify_batch(self, scheduler: Any, reqs: list[Req]) -> Any:
        """A verify batch of ``reqs`` (each one's last token and draft as one extend), or None where
        the batch decodes plainly: some request cannot be drafted for (``multi_token_ok``), no draft
        is proposed, or the pool cannot hold the verify's pages. A model drafter's drafts are
        placeholders here, filled by the runner (``fill``) on the forward thread."""
        if not self._holds(len(reqs)) or any(not multi_token_ok(r) for r in reqs):
            return None
        if any(r.kv_len == r.seq_len for r in reqs):  # a token in flight (overlap): no drafting, the waits tick
            for r in reqs:
                if r.spec_pace is not None:
                    r.spec_pace.want(0)  # (a step of its wait, if it waits; nothing else)
            return None
        budget = self.token_budget - len(reqs)  # draft tokens this verify may hold
        rooms = [(r.spec_pace or _FRESH).want(self.room(r, scheduler.context_len)) for r in reqs]
        for i in sorted(range(len(reqs)), key=lambda i: -(reqs[i].spec_pace or _FRESH).kept):  # the most kept first
            rooms[i] = min(rooms[i], budget)
            budget -= rooms[i]
        drafts, parents = None, None
        if not self.batched:
            trees = [self._tree(self.drafter.propose(r.spec_state, r.fill_ids(), n), n) if n > 0 else ([], None)
                     for r, n in zip(reqs, rooms)]
            drafts, parents = [t for t, _ in trees], [p for _, p in trees]
            if self.overlap:
                for r, n, d in zip(reqs, rooms, drafts):
                    if n and not d:
                        _pace(r).none()
                    elif d:
                        _pace(r).idle = 0
            rooms = [len(d) for d in drafts]
        pages_for = scheduler.allocator.pages_for
        # a large batch with few drafts: its verify (the extend path for every row) would cost more
        # than the plain, fused decode it replaces, for too little to keep
        if (not any(rooms) or (len(reqs) > SMALL_BATCH and sum(rooms) < self.min_draft_share * len(reqs))
                or not scheduler._can_alloc(sum(max(0, pages_for(r.kv_len + 1 + n) - len(r.pages))
                                                for r, n in zip(reqs, rooms)))):
            return None
        batch = scheduler._build(reqs, [1 + n for n in rooms], prefill=False)
        drafts = drafts or [[0] * n for n in rooms]
        batch.input_ids = [t for r, n, d in zip(reqs, batch.extend_lens, drafts) for t in (r.token_at(r.kv_len - n), *d)]
        batch.drafts = drafts
        batch.draft_pending = self.batched
        if parents is not None and any(p is not None for p in parents):  # (chains alone: causal, the fused layers)
            _set_trees(batch, parents)
        return batch

    def _tree(self, draft: Any, room: int) -> tuple[list[int], list[int] | None]:
        """A proposal's (tokens, parents), cut to ``room`` nodes, and to its first chain where the
        attention backend takes no tree masks."""
        tokens, parents = as_tree(draft)
        if parents is not None and not self.trees:
            tokens, parents = first_chain(tokens, parents), None
        if len(tokens) > room:  # (a tree cut after ``room`` nodes stays a tree: parents precede children)
            tokens, parents = tokens[:room], parents[:room] if parents is not None else None
        return tokens, parents

    def fill(self, batch: Any, kv_indices: torch.Tensor) -> None:
        """A model drafter's drafts for ``batch`` (on the forward thread, after the runner recorded
        the verify's slots in ``kv_indices``), written into its ``input_ids`` and ``drafts``."""
        reqs = []
        for i, (r, d) in enumerate(zip(batch.reqs, batch.drafts)):
            kv_len = batch.seq_lens[i] - 1 - len(d)
            reqs.append(DraftRequest(_state(r), r.fill_ids()[:kv_len + 1], kv_len, len(d), kv_indices[i, :kv_len + len(d)].clone()))
        pos, parents = 0, []
        for r, got, d in zip(reqs, self.drafter.propose_batch(reqs), batch.drafts):
            tokens, tree = as_tree(got)
            if len(tokens) != r.room or (tree is not None and not self.trees):
                raise RuntimeError(f"the drafter {type(self.drafter).__name__} proposed {len(tokens)} tokens "
                                   f"{'as a tree ' if tree else ''}where a {'chain' if not self.trees else 'draft'} "
                                   f"of {r.room} was asked for")
            batch.input_ids[pos + 1:pos + 1 + r.room] = d[:] = tokens
            parents.append(tree)
            pos += 1 + r.room
        batch.draft_pending = False
        if any(p is not None for p in parents):
            _set_trees(batch, parents)

    def walks(self, batch: Any, sampled: list[int], target: TargetRows | None = None,
              generator: torch.Generator | None = None) -> list[tuple[list[int], int]]:
        """Per request of a verify: the draft nodes the target's samples keep (root to leaf) and its
        token after them (``tree.walk``; ``sampled``: every row's sample, in order); with ``accept``,
        the sampled requests' (``target``: their distributions, ``target_rows``) by the thresholds."""
        out, row = [], 0
        for i, d in enumerate(batch.drafts):
            out.append(walk(d, batch.draft_parents[i] if batch.draft_parents else None, sampled[row:row + 1 + len(d)]))
            row += 1 + len(d)
        if target is not None and self.accept is not None:
            relaxed_walks(batch, sampled, target, self.accept, generator, out)
        return out

    def observe(self, batch: Any, sampled: list[int], kept: list[tuple[list[int], int]] | None,
                kv_indices: torch.Tensor) -> None:
        """Hand the drafter the last target forward's features (``DraftContext.capture``), per
        request the positions whose results stand and the token after each (on the forward thread,
        after sampling; ``sampled``: the batch's sampled tokens; ``kept``: a verify's ``walks``)."""
        obs, rows, row, live = [], [], 0, set(batch.live)
        for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start, ids, at = batch.seq_lens[i] - n, batch.input_ids[row + 1:row + n], list(range(row, row + n))
            if kept is not None:  # a verify: the last token and the kept nodes stand, at their rows
                path, nxt = kept[i]
                ids, at = [batch.drafts[i][j] for j in path] + [nxt], [row] + [row + 1 + j for j in path]
            elif i in live:  # the token sampled after the last position
                ids = ids + [sampled[i]]
            elif start + n < len(r.prompt_ids):  # a prompt's chunk: the next prompt token
                ids = ids + [r.prompt_ids[start + n]]
            else:
                ids = ids[:n - 1]
            if ids:
                obs.append(DraftObservation(_state(r), start, ids, len(rows), kv_indices[i, :start + len(ids)].clone()))
                rows += at[:len(ids)]
            row += n
        if obs:
            features = self.features()
            self.drafter.observe(obs, features if rows == list(range(len(features))) else
                                 features.index_select(0, torch.tensor(rows, device=features.device)))

    def verified(self, batch: Any, kept: list[tuple[list[int], int]], kv_indices: torch.Tensor
                 ) -> tuple[list[int], list[int]] | None:
        """The KV moves (source, destination slots) that bring a tree verify's kept nodes
        (``walks``) to their positions, or None (every kept path a prefix of the layout)."""
        src, dst = [], []
        for i, (d, p) in enumerate(zip(batch.drafts, batch.draft_parents)):
            if p is not None:
                s, t = kv_moves(batch.seq_lens[i] - 1 - len(d), kept[i][0], kv_indices[i])
                src, dst = src + s, dst + t
        return (src, dst) if src else None

    def kept(self, req: Req, draft: list[int], path: list[int], nxt: int, parents: list[int] | None = None) -> list[int]:
        """The tokens a verify keeps (``path`` and ``nxt``: its ``walks``): the drafted path the target
        sampled too (a chain's prefix, a tree's path from the root), then the target's own token."""
        n = len(path)
        if draft:
            _pace(req).update(n, len(draft), max(depths(parents)) if parents else len(draft), min(self.min_kept, len(draft)))
        req.spec_verify_ct += 1
        req.spec_num_proposed_drafts += len(draft)
        req.spec_num_correct_drafts += n
        return [draft[j] for j in path] + [nxt]


def verify_rows(batch: Any, rows: list[Any]) -> list[Any]:
    """Each request's sampling row (``SamplingRow``) for each of its verify rows (its last token's,
    then each draft token's), as its decodes would sample them there. Rows draw one number each, in
    order, from a seeded request's generator, which is a chain's decodes' order; a seeded tree's
    node at depth d instead draws what a decode d tokens on would (``draws_ahead``), whichever
    row it has and however many siblings it has. The runner then rewinds the generator to just
    past the kept tokens."""
    out: list[Any] = []
    for sr, d, p in zip(rows, batch.drafts, batch.draft_parents or [None] * len(rows)):
        if p is None or sr.generator is None:
            out += [sr] * (1 + len(d))
            continue
        out += [attrs.evolve(sr, generator=g) for g in draws_ahead(sr.generator, [0, *depths(p)])]
    return out


def _set_trees(batch: Any, parents: list[list[int] | None]) -> None:
    """Mark ``batch``'s trees (``draft_parents``) and give their nodes their depths as positions
    (a new list: the batch's table writes share the old one, whose columns are the layout's)."""
    batch.draft_parents, batch.positions, row = parents, list(batch.positions), 0
    for i, (d, p) in enumerate(zip(batch.drafts, parents)):
        if p is not None:
            base = batch.positions[row]
            batch.positions[row + 1:row + 1 + len(d)] = [base + k for k in depths(p)]
        row += 1 + len(d)


_FRESH = Pace()  # a request's pace before its first verify (read only)


def _pace(r: Req) -> Pace:
    pace = r.spec_pace = r.spec_pace or Pace()
    return pace


def _state(r: Req) -> dict:
    """The drafter's state of ``r``, emptied where the request was retracted since (its KV dropped)."""
    pace = _pace(r)
    if pace.retractions != r.num_retractions:
        pace.retractions, r.spec_state = r.num_retractions, {}
    return r.spec_state


def multi_token_ok(req: Req) -> bool:
    """Whether several of a request's tokens can come out of one forward (speculative verifies,
    continuous decode steps): nothing reads its outputs on the host between two of them."""
    return not host_read(req)


def host_read(req: Req, overlap: bool = False) -> str:
    """What reads the request's outputs on the host between two of its tokens ("" when nothing).
    ``overlap``: only what the next token's sampling reads (a step's logprobs come with its own
    token, so overlap scheduling need not wait for them; a multi-token step computes none).
    Penalties, ``min_new_tokens`` and a thinking budget are fixed by the params:
    ``Req.may_read_outputs`` says whether one can apply, so that the scheduler's check before every
    step is cheap for the others."""
    if req.grammar is not None:
        return "a grammar"
    if not overlap and (req.return_logprob or req.top_logprobs_num):
        return "logprobs"
    if not overlap and req.return_hidden_states:  # one forward's state per token (core.engine.hidden_states)
        return "hidden states"
    if not req.may_read_outputs:
        return ""
    p = req.params
    if p.custom_logit_processor is not None:  # (it may read the outputs: SGLang's custom_params["__req__"])
        return "a custom logit processor"
    if penalised(p):
        return "penalties"
    if len(req.output_ids) < p.min_new_tokens:
        return "min_new_tokens"
    if (t := p.thinking) is not None:  # near where the end tag may be forced: overlap's one token, others' drafts
        n, at = len(req.output_ids), t.closes_at
        if at - (1 if overlap else THINKING_LOOKAHEAD) <= n < at + len(t.end_ids):
            return "a thinking budget"
    return ""


def build_speculator(args: Any, plugins: Any) -> Speculator | None:
    """The speculator ``--speculative-algorithm`` asks for, or None. A model drafter's chain is
    ``--speculative-num-steps`` long (``--speculative-num-draft-tokens`` is then one more, as
    SGLang sets it for chains); a tree (``--speculative-eagle-topk`` k > 1, for a drafter whose
    ``trees`` is true) has ``--speculative-num-draft-tokens`` - 1 nodes, by default k per level;
    other drafters draft up to ``--speculative-num-draft-tokens`` - 1 tokens."""
    name = args.speculative_algorithm
    accept = Thresholds(args.speculative_accept_threshold_single, args.speculative_accept_threshold_acc)
    for flag, v in (("single", accept.single), ("acc", accept.acc)):
        if not 0.0 <= v <= 1.0:
            raise CoreError(f"--speculative-accept-threshold-{flag} must be within [0, 1], got {v}")
    if not name:
        for flag in ("num_draft_tokens", "num_steps", "eagle_topk", "draft_model_path", *(f"ngram_{f}" for f in NGRAM_FLAGS)):
            if getattr(args, "speculative_" + flag) is not None:
                raise CoreError(f"--speculative-{flag.replace('_', '-')} needs --speculative-algorithm (e.g. NGRAM)")
        if accept != Thresholds():
            raise CoreError("--speculative-accept-threshold-* needs --speculative-algorithm (e.g. NGRAM)")
        return None
    if name.upper() == "NEXTN":  # SGLang runs NEXTN (a model's multi-token-prediction layers) as EAGLE
        if not args.speculative_draft_model_path:
            raise CoreError("--speculative-algorithm NEXTN drafts with a model's own multi-token-prediction (MTP) "
                            "layers, which no architecture served here has: pass --speculative-draft-model-path "
                            "with an EAGLE head (NEXTN then runs as EAGLE, as in SGLang)")
        name = "EAGLE"
    ngram = [f for f in NGRAM_FLAGS if getattr(args, "speculative_ngram_" + f, None) is not None]
    if ngram and name.upper() != "NGRAM":
        raise CoreError(f"--speculative-ngram-{ngram[0].replace('_', '-')} shapes NGRAM's drafts; "
                        f"--speculative-algorithm {name} does not use it")
    drafter = plugins.resolve("speculative_algorithm", name)(args)
    n, topk = args.speculative_num_draft_tokens, args.speculative_eagle_topk or 1
    if topk < 1 or (topk > 1 and not getattr(drafter, "trees", False)):
        raise CoreError(f"--speculative-eagle-topk {topk}: --speculative-algorithm {args.speculative_algorithm} drafts chains "
                        "(--speculative-eagle-topk 1); EAGLE and EAGLE3 draft trees")
    if hasattr(drafter, "propose_batch"):
        steps = args.speculative_num_steps if args.speculative_num_steps is not None else DEFAULT_NUM_STEPS
        if steps < 1:
            raise CoreError(f"--speculative-num-steps must be >= 1, got {steps}")
        if topk > 1:
            n = min(n or topk * steps + 1, topk * steps + 1)
        else:
            if n is not None and n != steps + 1:
                log.warning("speculative.num_draft_tokens_adjusted", asked=n, used=steps + 1, why="a chain of "
                            "--speculative-num-steps drafts and the last token")
            n = steps + 1
    else:
        if args.speculative_draft_model_path is not None:
            raise CoreError(f"--speculative-draft-model-path is not used by --speculative-algorithm {name}")
        n = n or DEFAULT_NUM_DRAFT_TOKENS
    if n < 2:
        raise CoreError(f"--speculative-num-draft-tokens must be >= 2 (the last token and a draft), got {n}")
    return Speculator(drafter, n, accept=None if accept == Thresholds() else accept)
