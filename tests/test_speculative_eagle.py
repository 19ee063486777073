"""EAGLE and EAGLE-3 speculative decoding through the engine (issue 43): the head reads the target's
features after every forward (prefill chunks, decodes, verifies), writes its KV at the target's
slots, and drafts chains. Checked: the features and next tokens a head is handed equal
transformers' hidden states over the final sequences; a head built to reproduce a one-layer
target has its drafts accepted; any head gives plain greedy tokens with the pool's accounting
back at zero; bad heads are start-up errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (the -graphs cases) before any kernel module is imported

from core.errors import CoreError, ModelLoadError  # noqa: E402
from tests.conftest import TINY_BASE, build_tiny_llama, make_engine  # noqa: E402

PROMPTS = [[5 + (i * 7 + j) % 13 for j in range(30 + 5 * i)] for i in range(4)]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
H = TINY_BASE["hidden_size"]


def write_head(path: Path, arch: str, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY_BASE, "model_type": "llama", "architectures": [arch], "num_hidden_layers": 1,
           "torch_dtype": "float32", **config}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def layer_weights(state: dict[str, torch.Tensor], src: str, dst: str, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    return {dst + k[len(src):]: v for k, v in state.items() if k.startswith(src) and not k.endswith(skip)}


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> tuple[Path, Path]:
    """A one-layer target whose norms are no-ops on its inputs (unit norm weights, embeddings of
    RMS 1) and an EAGLE head that is that layer fed the next token's embedding (fc = [I, 0]): the
    head's argmax is the target's, but for the first token the head never sees."""
    root = tmp_path_factory.mktemp("eagle-mirror")
    model = build_tiny_llama(root / "target", seed=5, num_hidden_layers=1)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(root / "target")
    state = model.state_dict()
    head = layer_weights(state, "model.layers.0.", "layers.0.", skip=("input_layernorm.weight",))
    head["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
    head["fc.bias"] = torch.zeros(H)
    return root / "target", write_head(root / "head", "LlamaForCausalLMEagle", head)


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A four-layer target, a random EAGLE-3 head reading its layers 1..3 (a reduced draft
    vocabulary with its d2t map) and a random EAGLE head."""
    root = tmp_path_factory.mktemp("eagle-deep")
    build_tiny_llama(root / "target", seed=6, num_hidden_layers=4)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    kv = TINY_BASE["num_key_value_heads"] * H // TINY_BASE["num_attention_heads"]
    inter, draft_vocab = TINY_BASE["intermediate_size"], 128
    e3 = {"midlayer.self_attn.q_proj.weight": rnd(H, 2 * H), "midlayer.self_attn.k_proj.weight": rnd(kv, 2 * H),
          "midlayer.self_attn.v_proj.weight": rnd(kv, 2 * H), "midlayer.self_attn.o_proj.weight": rnd(H, H),
          "midlayer.mlp.gate_proj.weight": rnd(inter, H), "midlayer.mlp.up_proj.weight": rnd(inter, H),
          "midlayer.mlp.down_proj.weight": rnd(H, inter), "midlayer.input_layernorm.weight": torch.ones(H),
          "midlayer.hidden_norm.weight": torch.ones(H), "midlayer.post_attention_layernorm.weight": torch.ones(H),
          "fc.weight": rnd(H, 3 * H), "norm.weight": torch.ones(H), "lm_head.weight": rnd(draft_vocab, H),
          "d2t": torch.arange(draft_vocab) * 2 - torch.arange(draft_vocab)}  # draft id i -> target id 2i
    eagle3 = write_head(root / "eagle3", "LlamaForCausalLMEagle3", e3, draft_vocab_size=draft_vocab,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    e1 = {k.replace("midlayer.", "layers.0."): v for k, v in e3.items() if k.startswith("midlayer.") and "hidden_norm" not in k}
    for name in ("q_proj", "k_proj", "v_proj"):
        e1[f"layers.0.self_attn.{name}.weight"] = e1[f"layers.0.self_attn.{name}.weight"][:, :H]
    e1["fc.weight"], e1["fc.bias"] = rnd(H, 2 * H), rnd(H)
    eagle = write_head(root / "eagle", "LlamaForCausalLMEagle", e1)
    return root / "target", eagle3, eagle


def generate(path: Path, params: Any = GREEDY, prompts: list[list[int]] = PROMPTS, **kwargs: Any) -> tuple[list[dict], Any]:
    eng = make_engine(path, dtype="float32", device="cpu", **kwargs)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=[params] * len(prompts) if isinstance(params, dict) else params)
        if hasattr(eng.engine, "scheduler"):  # (a --dp-size engine's replicas keep theirs)
            eng.engine.scheduler.check_accounting()
        return outs, eng.engine
    finally:
        eng.shutdown()


@pytest.mark.parametrize("topk, tp, algo", [(1, 1, "EAGLE"), (2, 1, "EAGLE"), (1, 2, "EAGLE"), (1, 1, "NEXTN")],
                         ids=["chain", "tree", "chain-tp2", "nextn"])
def test_a_head_mirroring_the_target_has_its_drafts_accepted(mirror, topk, tp, algo):
    """Chains, and trees of two branches per level (whose kept paths move their KV); under
    --tp-size 2 the head's whole copies of the target's tables draft as well as at one rank;
    NEXTN with a head runs as EAGLE, as in SGLang."""
    target, head = mirror
    plain, _ = generate(target)
    spec, engine = generate(target, speculative_algorithm=algo, speculative_draft_model_path=str(head),
                            speculative_num_steps=3, speculative_eagle_topk=topk, tp_size=tp)
    assert engine.scheduler.speculator.features is not None and engine.model.model.capture_layers == (1,)
    assert engine.scheduler.speculator.num_draft_tokens == 3 * topk + 1
    table = engine.scheduler.speculator.drafter.draft.model.model.embed_tokens
    assert table.tp.size == 1 and table.weight.shape[0] == table.vocab_size  # whole, at any --tp-size
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    m = [o["meta_info"] for o in spec]
    kept = sum(x["spec_num_correct_drafts"] for x in m)
    assert kept >= 0.6 * sum(x["spec_num_proposed_drafts"] for x in m) / topk > 0
    assert all(x["spec_verify_ct"] < len(o["output_ids"]) / 2 for x, o in zip(m, spec))


@pytest.mark.parametrize("algo", ["EAGLE3", "EAGLE", "EAGLE3-tree"])
@pytest.mark.parametrize("variant", [
    {},
    {"chunked_prefill_size": 16},
    {"max_total_tokens": 160, "chunked_prefill_size": 32, "schedule_conservativeness": 0.1},  # retraction
    {"page_size": 4},
], ids=["plain", "chunked", "retraction", "page_size_4"])
def test_random_heads_give_plain_greedy_tokens(deep, algo, variant):
    target, eagle3, eagle = deep
    plain, _ = generate(target, **variant)
    tree = algo.endswith("-tree")
    algo = algo.removesuffix("-tree")
    spec, engine = generate(target, speculative_algorithm=algo, speculative_num_steps=3, speculative_eagle_topk=3 if tree else 1,
                            speculative_draft_model_path=str(eagle3 if algo == "EAGLE3" else eagle), **variant)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert all(o["meta_info"]["spec_num_proposed_drafts"] > 0 for o in spec)
    assert engine.model.model.capture_layers == ((1, 2, 3) if algo == "EAGLE3" else (4,))
    if "schedule_conservativeness" in variant:
        assert engine.scheduler.num_retracted > 0


@pytest.mark.parametrize("algo", ["EAGLE3", "EAGLE", "EAGLE3-tree", "EAGLE3-graphs", "EAGLE-tree-graphs"])
def test_the_head_is_handed_the_targets_features_and_the_next_tokens(deep, algo):
    """Every observation's features are transformers' hidden states of the final sequence at its
    positions (EAGLE-3: the inputs of layers 1, 2, 3 side by side; EAGLE: the final normed ones), and
    its next ids are that sequence's tokens one position on: across chunked prefills, verifies that
    keep some drafts, and plain decodes. ``-graphs``: the target's decodes and verifies replay CUDA
    graphs (their stand-ins on a CPU, the triton kernels interpreted), whose features are the
    graphs' static buffers, cut to the batch's rows."""
    from transformers import AutoModelForCausalLM

    target, eagle3, eagle = deep
    seen: list[tuple[int, list[int], torch.Tensor]] = []
    graphs = algo.endswith("-graphs")
    tree = "-tree" in algo
    algo = algo.split("-")[0]
    opts = dict(attention_backend="triton", disable_cuda_graph=True) if graphs else {}
    eng = make_engine(target, dtype="float32", device="cpu", chunked_prefill_size=16, speculative_algorithm=algo,
                      speculative_num_steps=3, speculative_eagle_topk=3 if tree else 1,
                      speculative_draft_model_path=str(eagle3 if algo == "EAGLE3" else eagle), **opts)
    try:
        if graphs:
            from tests.test_cuda_graph import eager_graphs

            t = eng.engine.scheduler.speculator.num_draft_tokens
            runner = eager_graphs(eng, 2, t, 2)
        drafter = eng.engine.scheduler.speculator.drafter
        observe = drafter.observe

        def spy(reqs, features):
            seen.extend((o.start, list(o.next_ids), features[o.row:o.row + len(o.next_ids)].clone()) for o in reqs)
            observe(reqs, features)

        drafter.observe = spy
        outs = eng.generate(input_ids=PROMPTS[:2], sampling_params=[{**GREEDY, "max_new_tokens": 12}] * 2)
        if graphs:  # decodes and verifies both replayed
            assert {kind for (_, kind), g in runner._graphs.items() if g.replays} == {False, "verify"}
    finally:
        eng.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs, feats = [], []
    for p, o in zip(PROMPTS[:2], outs):
        seq = p + o["output_ids"]
        with torch.no_grad():
            hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
        seqs.append(seq)
        feats.append(torch.cat([hs[1], hs[2], hs[3]], -1)[0] if algo == "EAGLE3" else hs[-1][0])
    covered = [set(), set()]
    for start, ids, rows in seen:
        match = [i for i, s in enumerate(seqs) if s[start + 1:start + 1 + len(ids)] == ids
                 and torch.allclose(rows, feats[i][start:start + len(ids)], atol=1e-4)]
        assert match, (start, ids)
        covered[match[0]].update(range(start, start + len(ids)))
    assert all(c == set(range(len(s) - 1)) for c, s in zip(covered, seqs))  # every position but the last


def test_bad_heads_are_clear_errors(deep, mirror):
    target, eagle3, eagle = deep
    with pytest.raises(ModelLoadError, match="needs a LlamaForCausalLMEagle3 draft head"):
        make_engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(eagle))
    with pytest.raises(ModelLoadError, match="needs a LlamaForCausalLMEagle draft head.*LlamaForCausalLM\\b"):
        make_engine(target, speculative_algorithm="EAGLE", speculative_draft_model_path=str(mirror[0]))
    with pytest.raises(ModelLoadError, match="needs --speculative-draft-model-path"):
        make_engine(target, speculative_algorithm="EAGLE")
    with pytest.raises(CoreError, match="NEXTN drafts with a model's own multi-token-prediction.*--speculative-draft-model-path"):
        make_engine(target, speculative_algorithm="NEXTN")
    with pytest.raises(ModelLoadError, match=r"target layers to capture, of 0\.\.1; got \[1, 2, 3\]"):  # a one-layer target
        make_engine(mirror[0], speculative_algorithm="EAGLE3", speculative_draft_model_path=str(eagle3))


@pytest.mark.parametrize("parallel", [{"tp_size": 2}, {"dp_size": 2}], ids=["tp2", "dp2"])
def test_tensor_and_data_parallel_engines_speculate(deep, parallel):
    """--tp-size 2: a draft model runs whole on rank 0 beside its shard of the target, and a head
    shares whole copies of the target's tables there (rank 0's own are a slice of the vocabulary);
    --dp-size 2: each replica speculates (here with an EAGLE-3 head) and SGLang's meta_info counts
    come back."""
    target, eagle3, eagle = deep
    plain, _ = generate(target, prompts=PROMPTS[:2], max_total_tokens=512)
    drafts = [{"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(eagle3)}]
    if "tp_size" in parallel:
        drafts += [{"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(target)},
                   {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(eagle)}]
    for draft in drafts:
        spec, _ = generate(target, prompts=PROMPTS[:2], max_total_tokens=512, speculative_num_steps=3, **draft, **parallel)
        assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain], draft
        assert all(o["meta_info"]["spec_num_proposed_drafts"] > 0 and o["meta_info"]["spec_verify_ct"] > 0 for o in spec)
