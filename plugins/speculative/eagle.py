"""``--speculative-algorithm EAGLE`` / ``EAGLE3``: a draft head that reads the target's hidden states
(SGLang's EAGLE / EAGLE-3 checkpoints, ``--speculative-draft-model-path``), greedy chains.

After every target forward the head extends over the positions whose results stand (``observe``):
at position p it reads the token at p + 1 beside the target's features at p (EAGLE: the final
normed hidden states; EAGLE-3: three layers' inputs), writing its KV at the target's slots. Its
output at the last position gives the first draft tokens, and its hidden state there stands in
for the target's features on the draft's later levels (``propose_batch``): chains, or trees of
the top ``--speculative-eagle-topk`` tokens per level. A request's head KV is as current as the
target's, except where a prefix another request cached ends: there the head read that request's
next token (costing acceptance, never correctness).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from core import hookimpl
from core.errors import ModelLoadError
from core.interfaces import DraftContext, DraftModel, DraftObservation, DraftRequest, DraftSeq, DraftTree


class EagleDrafter:
    name, eagle3, trees = "EAGLE", False, True

    def __init__(self, args: Any) -> None:
        self.args = args
        self.topk = args.speculative_eagle_topk or 1
        self.draft: DraftModel | None = None

    def load(self, ctx: DraftContext) -> None:
        path = ctx.args.speculative_draft_model_path
        if not path:
            raise ModelLoadError(f"--speculative-algorithm {self.name} needs --speculative-draft-model-path: "
                                 f"an {self.name} draft head trained for the target")
        self.draft = ctx.load_model(path)
        head = self.draft.model
        arch = type(head).__name__
        if not hasattr(head, "share_target") or arch.endswith("Eagle3") != self.eagle3:
            want = "LlamaForCausalLMEagle3" if self.eagle3 else "LlamaForCausalLMEagle"
            raise ModelLoadError(f"--speculative-algorithm {self.name} needs a {want} draft head; {path!r} is {arch}")
        head.share_target(ctx.target)
        target_cfg = ctx.target.config
        layers = head.capture_layers(target_cfg.num_hidden_layers)
        width = target_cfg.hidden_size * max(1, len(layers))
        if head.feature_size != width:
            raise ModelLoadError(f"the draft head {path!r} reads features {head.feature_size} wide; the target gives "
                                 f"{width}: a head trained for another model?")
        ctx.capture(layers)

    def observe(self, reqs: Sequence[DraftObservation], features: torch.Tensor) -> None:
        feats = torch.cat([features[o.row:o.row + len(o.next_ids)] for o in reqs])
        hidden, logits = self.draft.run([DraftSeq(o.next_ids, o.start, o.slots) for o in reqs], feats)
        ends = torch.tensor([len(o.next_ids) for o in reqs]).cumsum(0) - 1
        top = torch.log_softmax(logits.float(), -1).topk(self.topk, -1)
        for o, h, lp, ids in zip(reqs, hidden[ends.to(hidden.device)], top.values.tolist(), top.indices.tolist()):
            o.state.update(pos=o.start + len(o.next_ids), hidden=h, top=(lp, ids))

    def propose_batch(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        """Per request a tree grown level by level: the top-k tokens after the last one, then at
        each level the k best children (by the path's summed log-probability) of the last level's
        nodes, until ``room`` nodes (a chain where k is 1). A node's draft KV sits at its own slot
        of the verify (column ``kv_len + 1 + node``), so branches never share one."""
        trees = [_Tree(r, self.topk) for r in reqs]
        frontier = {i: nodes for i, t in enumerate(trees) if t.live and (nodes := t.first())}
        while frontier:
            owners = [(i, node) for i, nodes in frontier.items() for node in nodes]
            seqs = [trees[i].seq(node) for i, node in owners]
            out, logits = self.draft.run(seqs, torch.stack([trees[i].feature[node] for i, node in owners]))
            top = torch.log_softmax(logits.float(), -1).topk(self.topk, -1)
            grown: dict[int, list[tuple[float, int, int, torch.Tensor]]] = {}
            for n, ((i, node), lps, ids) in enumerate(zip(owners, top.values.tolist(), top.indices.tolist())):
                score = trees[i].score[node]
                grown.setdefault(i, []).extend((score + lp, t, node, out[n]) for lp, t in zip(lps, ids))
            frontier = {i: nodes for i, cands in grown.items() if (nodes := trees[i].grow(cands))}
        return [t.result() for t in trees]


class _Tree:
    """One request's draft tree as it grows (``EagleDrafter.propose_batch``)."""

    def __init__(self, r: DraftRequest, k: int) -> None:
        self.r, self.k = r, k
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.score: list[float] = []
        self.feature: dict[int, torch.Tensor] = {}  # node -> the hidden state its expansion reads
        self.depth: list[int] = []
        # its last forward was not observed (nothing to draft from): a draft the verify rejects
        self.stale = bool(r.room) and r.state.get("pos") != r.kv_len
        self.live = bool(r.room) and not self.stale

    def first(self) -> list[int]:
        lps, ids = self.r.state["top"]
        cands = [(lp, t, -1, self.r.state["hidden"]) for lp, t in zip(lps, ids)]
        return self.grow(cands)

    def grow(self, cands: list[tuple[float, int, int, torch.Tensor]]) -> list[int]:
        """Add the best candidates (score, token, parent, the hidden their expansion reads) as a
        level; return the new nodes worth expanding (those with room left for children)."""
        take = min(self.k, self.r.room - len(self.tokens))
        new = []
        for score, t, parent, h in sorted(cands, key=lambda c: -c[0])[:take]:
            new.append(len(self.tokens))
            self.feature[new[-1]] = h
            self.tokens.append(t)
            self.parents.append(parent)
            self.score.append(score)
            self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        return new if len(self.tokens) < self.r.room else []

    def seq(self, node: int) -> DraftSeq:
        """The draft's input at ``node``: its token at the position before its own, seeing the
        prefix and its ancestors' KV."""
        r, path = self.r, []
        j = node
        while j >= 0:
            path.append(j)
            j = self.parents[j]
        slots = torch.cat([r.slots[:r.kv_len], r.slots[[r.kv_len + 1 + a for a in reversed(path)]]])
        return DraftSeq([self.tokens[node]], r.kv_len + self.depth[node] - 1, slots)

    def result(self) -> list[int] | DraftTree:
        if self.stale:
            return [self.r.tokens[-1]] * self.r.room
        if self.k == 1 or not self.tokens:
            return self.tokens
        return DraftTree(self.tokens, self.parents)


class Eagle3Drafter(EagleDrafter):
    name, eagle3 = "EAGLE3", True


@hookimpl
def register_speculative_algorithms(register) -> None:
    register("EAGLE", "core_plugins.speculative.eagle:EagleDrafter")
    register("EAGLE3", "core_plugins.speculative.eagle:Eagle3Drafter")
