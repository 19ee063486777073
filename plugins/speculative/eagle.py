"""``--speculative-algorithm EAGLE`` / ``EAGLE3``: a draft head that reads the target's hidden states
(SGLang's EAGLE / EAGLE-3 checkpoints, ``--speculative-draft-model-path``), greedy chains.

After every target forward the head extends over the positions whose results stand (``observe``):
at position p it reads the token at p + 1 beside the target's features at p (EAGLE: the final
normed hidden states; EAGLE-3: three layers' inputs), writing its KV at the target's slots. Its
output at the last position gives the first draft token, and its hidden state there stands in for
the target's features on the chain's later steps (``propose_batch``), one decode step each. A
request's KV is thus always as current as the target's, also for prefixes other requests cached.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from core import hookimpl
from core.errors import ModelLoadError
from core.interfaces import DraftContext, DraftModel, DraftObservation, DraftRequest, DraftSeq


class EagleDrafter:
    name, eagle3 = "EAGLE", False

    def __init__(self, args: Any) -> None:
        self.args = args
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
        for o, h, t in zip(reqs, hidden[ends.to(hidden.device)], logits.argmax(-1).tolist()):
            o.state.update(pos=o.start + len(o.next_ids), hidden=h, next=t)

    def propose_batch(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        hidden: dict[int, torch.Tensor] = {}
        for i, r in enumerate(reqs):
            if r.room and r.state.get("pos") != r.kv_len:  # its last forward was not observed: nothing to draft from
                drafts[i] = [r.tokens[-1]] * r.room  # (verified and rejected; the engine's pacing backs off)
            elif r.room:
                drafts[i], hidden[i] = [r.state["next"]], r.state["hidden"]
        live = list(hidden)
        for j in range(1, max((r.room for r in reqs), default=0)):
            if not (live := [i for i in live if reqs[i].room > j]):
                break
            seqs = [DraftSeq([drafts[i][-1]], reqs[i].kv_len + j - 1, reqs[i].slots) for i in live]
            out, logits = self.draft.run(seqs, torch.stack([hidden[i] for i in live]))
            for n, (i, t) in enumerate(zip(live, logits.argmax(-1).tolist())):
                drafts[i].append(t)
                hidden[i] = out[n]
        return drafts


class Eagle3Drafter(EagleDrafter):
    name, eagle3 = "EAGLE3", True


@hookimpl
def register_speculative_algorithms(register) -> None:
    register("EAGLE", "core_plugins.speculative.eagle:EagleDrafter")
    register("EAGLE3", "core_plugins.speculative.eagle:Eagle3Drafter")
