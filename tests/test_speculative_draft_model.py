"""Speculative decoding with a draft model (issue 43, STANDALONE): the model-drafter plugin kind,
the draft's KV pool at the target's slots, and the drafter's bookkeeping of which draft KV it
wrote. Greedy gives plain decoding's tokens whatever the draft; a draft that is the target itself
has its chains accepted; the pool's accounting returns to zero; bad set-ups are start-up errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.errors import CoreError, ModelLoadError
from tests.conftest import build_tiny_llama, make_engine

PROMPTS = [[5 + (i * 7 + j) % 13 for j in range(30 + 5 * i)] for i in range(4)]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    paths = {name: tmp_path_factory.mktemp(f"spec-{name}") for name in ("target", "small", "vocab")}
    build_tiny_llama(paths["target"], seed=3)
    build_tiny_llama(paths["small"], seed=4, num_hidden_layers=1)  # another model, the same vocabulary
    build_tiny_llama(paths["vocab"], seed=4, num_hidden_layers=1, vocab_size=300)
    return paths


def generate(path: Path, prompts: list[list[int]] = PROMPTS, params: Any = GREEDY, **kwargs: Any) -> tuple[list[dict], Any]:
    eng = make_engine(path, dtype="float32", device="cpu", **kwargs)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=[params] * len(prompts) if isinstance(params, dict) else params)
        eng.engine.scheduler.check_accounting()
        return outs, eng.engine
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def plain(models) -> list[list[int]]:
    return [o["output_ids"] for o in generate(models["target"])[0]]


def test_the_target_as_its_own_draft_has_its_chains_accepted(models, plain):
    spec, engine = generate(models["target"], speculative_algorithm="STANDALONE", speculative_num_steps=4,
                            speculative_draft_model_path=str(models["target"]))
    assert engine.scheduler.speculator.num_draft_tokens == 5
    assert [o["output_ids"] for o in spec] == plain
    for o in spec:
        m = o["meta_info"]
        # float32, the same weights: the draft's argmax is the target's (ties aside)
        assert m["spec_num_correct_drafts"] >= 0.9 * m["spec_num_proposed_drafts"] > 0
        assert m["spec_verify_ct"] <= len(o["output_ids"]) // 4 + 2


@pytest.mark.parametrize("variant", [
    {},
    {"chunked_prefill_size": 16},  # the draft catches up over a prompt the target prefilled in chunks
    {"max_total_tokens": 160, "chunked_prefill_size": 32, "schedule_conservativeness": 0.1},  # retraction
    {"page_size": 4},
    {"disable_radix_cache": True},
], ids=["plain", "chunked", "retraction", "page_size_4", "no_radix_cache"])
def test_another_draft_gives_plain_greedy_tokens(models, plain, variant):
    spec, engine = generate(models["target"], speculative_algorithm="STANDALONE", speculative_num_steps=3,
                            speculative_draft_model_path=str(models["small"]), **variant)
    assert [o["output_ids"] for o in spec] == plain
    assert all(o["meta_info"]["spec_num_proposed_drafts"] > 0 for o in spec)
    if "schedule_conservativeness" in variant:
        assert engine.scheduler.num_retracted > 0


def test_a_shared_prefix_and_mixed_requests(models):
    """Requests sharing a cached prefix (whose draft KV another request wrote, or nobody), a
    request that is never drafted for (penalties) in the same batches, and n > 1."""
    prompts = [PROMPTS[0], PROMPTS[0] + [7, 8], PROMPTS[1], PROMPTS[2]]
    params = [GREEDY, GREEDY, {**GREEDY, "frequency_penalty": 0.5}, {**GREEDY, "n": 2}]
    want, _ = generate(models["target"], prompts, params)
    for _ in range(2):  # the second round starts from the first's cached prefixes
        got, _ = generate(models["target"], prompts, params, speculative_algorithm="STANDALONE",
                          speculative_draft_model_path=str(models["target"]))
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def test_a_draft_fed_wrong_kv_would_show():
    """The bookkeeping test: ``_valid`` keeps the positions whose draft KV matches the tokens now there."""
    from core.interfaces import DraftRequest
    from core_plugins.speculative.standalone import _valid

    import torch

    def req(state: dict, tokens: list[int]) -> DraftRequest:
        return DraftRequest(state, tokens, len(tokens) - 1, 3, torch.arange(len(tokens) + 2))

    assert _valid(req({}, [1, 2, 3])) == 0
    # last call: KV up to position 4 (the last token then) and the chain 7, 8 at positions 5 and 6
    state = {"kv": 5, "chain": [7, 8]}
    assert _valid(req(state, [0, 1, 2, 3, 4, 7, 8, 9, 5])) == 7  # both kept
    assert _valid(req(state, [0, 1, 2, 3, 4, 7, 6])) == 6  # the second rejected
    assert _valid(req(state, [0, 1, 2, 3, 4, 7, 8])) == 6  # kept, but position 6 holds the new last token


def test_bad_draft_set_ups_are_clear_errors(models):
    with pytest.raises(ModelLoadError, match="needs --speculative-draft-model-path"):
        make_engine(models["target"], speculative_algorithm="STANDALONE")
    with pytest.raises(ModelLoadError, match="vocabulary of 300 tokens"):
        make_engine(models["target"], speculative_algorithm="STANDALONE", speculative_draft_model_path=str(models["vocab"]))
    with pytest.raises(ModelLoadError, match="cannot load the draft model"):
        make_engine(models["target"], speculative_algorithm="STANDALONE", speculative_draft_model_path="/nonexistent/draft")
    with pytest.raises(CoreError, match="STANDALONE drafts chains"):
        make_engine(models["target"], speculative_algorithm="STANDALONE", speculative_eagle_topk=4,
                    speculative_draft_model_path=str(models["small"]))
    with pytest.raises(CoreError, match="not used by --speculative-algorithm NGRAM"):
        make_engine(models["target"], speculative_algorithm="NGRAM", speculative_draft_model_path=str(models["small"]))
    with pytest.raises(CoreError, match="--speculative-num-steps needs --speculative-algorithm"):
        make_engine(models["target"], speculative_num_steps=3)
    with pytest.raises(CoreError, match="--speculative-num-steps must be >= 1"):
        make_engine(models["target"], speculative_algorithm="STANDALONE", speculative_num_steps=0,
                    speculative_draft_model_path=str(models["small"]))


def test_a_long_catch_up_runs_in_chunks(models, plain, monkeypatch):
    """A prompt longer than the catch-up chunk reaches the draft model in pieces, and the drafts
    (the target as its own draft: all accepted) show the pieces' KV is whole."""
    import core_plugins.speculative.standalone as standalone

    monkeypatch.setattr(standalone, "CATCH_UP_CHUNK", 8)
    spec, _ = generate(models["target"], speculative_algorithm="STANDALONE", speculative_num_steps=4,
                       speculative_draft_model_path=str(models["target"]))
    assert [o["output_ids"] for o in spec] == plain
    assert all(o["meta_info"]["spec_num_correct_drafts"] >= 0.9 * o["meta_info"]["spec_num_proposed_drafts"] for o in spec)
