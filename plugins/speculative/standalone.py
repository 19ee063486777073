"""``--speculative-algorithm STANDALONE``: drafts from a smaller model with the target's vocabulary
(``--speculative-draft-model-path``), greedy chains of ``--speculative-num-steps`` tokens.

The draft's KV sits at the target's slots (``core.engine.speculative.draft_model``). Per request
the state keeps how many leading positions hold draft KV this drafter wrote (``kv``) and the chain
it last proposed: positions past ``kv`` stay valid as far as the target kept that chain. Each call
first extends the draft over the positions it has not computed (the whole prompt the first time,
then the last verify's tokens) up to the last token, whose logits give the first draft token;
the rest come one decode step at a time for the whole batch.
"""

from __future__ import annotations

from typing import Any, Sequence

from core import hookimpl
from core.errors import ModelLoadError
from core.interfaces import DraftContext, DraftModel, DraftRequest, DraftSeq

CATCH_UP_CHUNK = 2048  # tokens of one request per catch-up forward (the engine's CPU prefill chunk)


class StandaloneDrafter:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.draft: DraftModel | None = None

    def load(self, ctx: DraftContext) -> None:
        path = ctx.args.speculative_draft_model_path
        if not path:
            raise ModelLoadError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path: a smaller "
                                 "model with the target's vocabulary")
        self.draft = ctx.load_model(path)

    def propose_batch(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        live = [i for i, r in enumerate(reqs) if r.room > 0]
        seqs = [DraftSeq(list(reqs[i].tokens[done:reqs[i].kv_len + 1]), done, reqs[i].slots)
                for i in live for done in [_valid(reqs[i])]]
        while any(len(s.tokens) > CATCH_UP_CHUNK for s in seqs):  # a long prompt's catch-up: in chunks
            self.draft.run([DraftSeq(s.tokens[:CATCH_UP_CHUNK], s.start, s.slots) for s in seqs
                            if len(s.tokens) > CATCH_UP_CHUNK])
            seqs = [DraftSeq(s.tokens[CATCH_UP_CHUNK:], s.start + CATCH_UP_CHUNK, s.slots)
                    if len(s.tokens) > CATCH_UP_CHUNK else s for s in seqs]
        for j in range(max((r.room for r in reqs), default=0)):
            if j:
                live = [i for i in live if reqs[i].room > j]
                seqs = [DraftSeq([drafts[i][-1]], reqs[i].kv_len + j, reqs[i].slots) for i in live]
            _, logits = self.draft.run(seqs)
            for i, t in zip(live, logits.argmax(-1).tolist()):
                drafts[i].append(t)
        for r, d in zip(reqs, drafts):
            if d:  # (the last draft token's KV is not written)
                r.state["kv"], r.state["chain"] = r.kv_len + 1, d[:-1]
        return drafts


def _valid(r: DraftRequest) -> int:
    """Leading positions of ``r`` whose draft KV this drafter wrote for the tokens now there."""
    done, chain = r.state.get("kv", 0), r.state.get("chain", ())
    for t in chain:
        if done >= r.kv_len or r.tokens[done] != t:
            break
        done += 1
    return min(done, r.kv_len)


@hookimpl
def register_speculative_algorithms(register) -> None:
    register("STANDALONE", "core_plugins.speculative.standalone:StandaloneDrafter")
