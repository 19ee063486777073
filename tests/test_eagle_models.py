"""SGLang's EAGLE / EAGLE-3 draft models (``core_plugins.models.llama_eagle``) against references
built from transformers' own Llama pieces with SGLang's semantics, and the target's hidden-state
capture (``LlamaModel.capture_layers``) against transformers' ``output_hidden_states``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from core.engine.model_loader.loader import iter_weights
from core.errors import ModelLoadError
from core.interfaces import AttentionConfig, ModelContext
from core.testing.paged import PagedPool, Seq, make_batch
from core.testing.suite import reference
from core_kernels import cpu_decode
from core_plugins.models.llama import LlamaForCausalLM
from core_plugins.models.llama_eagle import LlamaForCausalLMEagle, LlamaForCausalLMEagle3

CPU = torch.device("cpu")
H, VOCAB, DRAFT_VOCAB = 64, 128, 64
BASE = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def hf_config(**kw: Any):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**BASE, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def ctx() -> ModelContext:
    return ModelContext(torch.float32, CPU, reference("quant_method", "none")())


def randomize(module: nn.Module, gen: torch.Generator) -> nn.Module:
    """Every parameter drawn at a scale where attention and norms matter (norm weights near 1)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
    return module.eval()


def causal(n: int) -> torch.Tensor:
    return torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]


def rope(cfg, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(cfg)(x, torch.arange(x.shape[1])[None])


def run_draft(model: nn.Module, cfg, prompts: list[list[int]], features: list[torch.Tensor], backend: str = "torch_native",
              steps: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The draft over a paged pool: ``prompts[i]`` split into ``steps`` forwards (the last one
    token long when ``steps`` is 2), all sequences batched per step; per step, its outputs."""
    d = cfg.hidden_size // cfg.num_attention_heads
    pool = PagedPool(cfg.num_hidden_layers, cfg.num_key_value_heads, d, torch.float32, CPU, 4, 64, seed=1)
    acfg = AttentionConfig(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, d, torch.float32,
                           CPU, pool.kv)
    backend_obj = reference("attention_backend", "torch_native")(acfg) if backend == "torch_native" else _cpu_backend(acfg)
    seqs = [Seq() for _ in prompts]
    cuts = [[0, len(p)] if steps == 1 else [0, len(p) - 1, len(p)] for p in prompts]
    outs = []
    for s in range(steps):
        spans = [(c[s], c[s + 1]) for c in cuts]
        for seq, (a, b) in zip(seqs, spans):
            pool.grow(seq, b - a)
        batch = make_batch(seqs, [b - a for a, b in spans], backend_obj, CPU,
                           input_ids=[t for p, (a, b) in zip(prompts, spans) for t in p[a:b]])
        backend_obj.prepare(batch)
        feats = torch.cat([f[a:b] for f, (a, b) in zip(features, spans)])
        with torch.inference_mode():
            outs.append(model(batch, feats))
    return outs


def _cpu_backend(acfg: AttentionConfig):
    from core_plugins.attention.cpu import CpuBackend

    return CpuBackend(acfg)


# --------------------------------------------------------------------------- targets


def tiny_target(tmp_path: Path, layers: int = 3, seed: int = 0) -> tuple[LlamaForCausalLM, Any]:
    """(engine LlamaForCausalLM, transformers LlamaForCausalLM) with the same random weights."""
    from transformers import LlamaForCausalLM as HFLlama

    cfg = hf_config(num_hidden_layers=layers)
    torch.manual_seed(seed)
    hf = randomize(HFLlama(cfg).float(), torch.Generator().manual_seed(seed))
    hf.save_pretrained(tmp_path)
    model = LlamaForCausalLM(cfg, ctx())
    model.load_weights(iter_weights(tmp_path))
    return model.eval(), hf


# --------------------------------------------------------------------------- EAGLE


class EagleRef(nn.Module):
    """SGLang's EAGLE draft from transformers' LlamaDecoderLayer: fc(cat(embed, features)), layer 0
    without input norm, no final norm; logits through the target's head."""

    def __init__(self, cfg, gen: torch.Generator) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, H)
        self.fc = nn.Linear(2 * H, H)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        randomize(self, gen)
        self.layers[0].input_layernorm = nn.Identity()

    def checkpoint(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """SGLang's EAGLE checkpoint names (no ``model.`` prefix unless given)."""
        out = {f"{prefix}embed_tokens.weight": self.embed.weight, f"{prefix}fc.weight": self.fc.weight,
               f"{prefix}fc.bias": self.fc.bias}
        for i, layer in enumerate(self.layers):
            out.update({f"{prefix}layers.{i}.{k}": v for k, v in layer.state_dict().items()})
        return {k: v.detach().clone() for k, v in out.items()}

    @torch.no_grad()
    def forward(self, ids: list[int], feats: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(torch.tensor([ids])), feats[None]], -1))
        pe, mask = rope(self.cfg, x), causal(len(ids))
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=pe)
        return x[0]


def build_eagle(cfg, ref: EagleRef, **ck_kw: Any) -> LlamaForCausalLMEagle:
    model = LlamaForCausalLMEagle(cfg, ctx())
    model.load_weights(ref.checkpoint(**ck_kw).items())
    return model.eval()


@pytest.fixture
def eagle_case(tmp_path):
    cfg = hf_config(num_hidden_layers=2, architectures=["LlamaForCausalLMEagle"])
    target, hf = tiny_target(tmp_path)
    ref = EagleRef(cfg, torch.Generator().manual_seed(1))
    ref.embed.weight.data.copy_(hf.model.embed_tokens.weight)  # EAGLE checkpoints carry the target's table
    return cfg, target, hf, ref


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("prompt_lens", [[9], [5, 13]], ids=["one", "two"])
def test_eagle_matches_reference(eagle_case, prompt_lens, backend):
    if backend == "cpu" and not cpu_decode.available():
        pytest.skip("needs the C++ CPU kernels")
    cfg, target, hf, ref = eagle_case
    model = build_eagle(cfg, ref)
    model.share_target(target)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    feats = [torch.randn(n, H, generator=gen) for n in prompt_lens]
    (got_logit_h, got_next), = run_draft(model, cfg, prompts, feats, backend)
    want = torch.cat([ref(p, f) for p, f in zip(prompts, feats)])
    torch.testing.assert_close(got_logit_h, want, atol=ATOL, rtol=0)
    assert got_next is got_logit_h  # EAGLE feeds its output on unchanged
    logits = model.compute_logits(got_logit_h)
    assert logits.dtype == torch.float32 and logits.shape == (sum(prompt_lens), VOCAB)
    torch.testing.assert_close(logits, want @ hf.lm_head.weight.T.detach(), atol=1e-3, rtol=0)


def test_eagle_interface_and_sharing(eagle_case):
    cfg, target, _, ref = eagle_case
    model = build_eagle(cfg, ref, prefix="model.")  # also with the prefix
    assert model.feature_size == H and model.capture_layers(32) == ()
    assert not hasattr(model.model.layers[0].input_layernorm, "weight")
    with pytest.raises(RuntimeError, match="share_target"):
        model.compute_logits(torch.zeros(1, H))
    model.share_target(target)
    assert model.model.embed_tokens is target.model.embed_tokens and model.lm_head is target.lm_head


def test_eagle_without_embedding_or_bias_takes_the_targets(eagle_case):
    cfg, target, hf, ref = eagle_case
    ck = ref.checkpoint()
    del ck["embed_tokens.weight"], ck["fc.bias"]
    ck["lm_head.weight"] = torch.zeros(VOCAB, H)  # SGLang never reads a draft's lm_head
    ck["layers.0.input_layernorm.weight"] = torch.zeros(H)  # nor layer 0's input norm
    model = LlamaForCausalLMEagle(cfg, ctx())
    model.load_weights(ck.items())
    assert model.missing == {"model.embed_tokens.weight", "model.fc.bias"}
    with pytest.raises(RuntimeError, match="share_target"):
        run_draft(model, cfg, [[3, 4]], [torch.zeros(2, H)])
    model.share_target(target)
    ref.fc.bias.data.zero_()
    gen = torch.Generator().manual_seed(3)
    prompt, feats = torch.randint(3, VOCAB, (6,), generator=gen).tolist(), torch.randn(6, H, generator=gen)
    (got, _), = run_draft(model, cfg, [prompt], [feats])
    torch.testing.assert_close(got, ref(prompt, feats), atol=ATOL, rtol=0)


def test_eagle_bad_checkpoints(eagle_case):
    cfg, _, _, ref = eagle_case
    ck = ref.checkpoint()
    with pytest.raises(ModelLoadError, match="fc.weight"):
        LlamaForCausalLMEagle(cfg, ctx()).load_weights({**ck, "fc.weight": torch.zeros(H, 3 * H)}.items())
    missing = {k: v for k, v in ck.items() if k != "layers.1.mlp.down_proj.weight"}
    with pytest.raises(ModelLoadError, match="down_proj"):
        LlamaForCausalLMEagle(cfg, ctx()).load_weights(missing.items())
    with pytest.raises(ModelLoadError, match="no matching model parameter"):
        LlamaForCausalLMEagle(cfg, ctx()).load_weights({**ck, "layers.5.mlp.up_proj.weight": torch.zeros(1)}.items())


# --------------------------------------------------------------------------- EAGLE-3


class Eagle3Ref(nn.Module):
    """SGLang's EAGLE-3 draft from transformers' pieces: fc only on features not H wide; one layer
    whose attention (q/k/v over 2H inputs) reads cat(input_layernorm(embeds), hidden_norm(hidden)),
    residual hidden; norm for the logits, the pre-norm sum for the next step."""

    def __init__(self, cfg, gen: torch.Generator, target_hidden: int = H) -> None:
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        super().__init__()
        self.cfg = cfg
        d = H // cfg.num_attention_heads
        self.embed = nn.Embedding(VOCAB, H)
        self.fc = nn.Linear(3 * target_hidden, H, bias=False)
        self.attn = LlamaAttention(cfg, 0)
        self.attn.q_proj = nn.Linear(2 * H, cfg.num_attention_heads * d, bias=False)
        self.attn.k_proj = nn.Linear(2 * H, cfg.num_key_value_heads * d, bias=False)
        self.attn.v_proj = nn.Linear(2 * H, cfg.num_key_value_heads * d, bias=False)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm, self.norm = (
            LlamaRMSNorm(H, cfg.rms_norm_eps) for _ in range(4))
        self.lm_head = nn.Linear(H, DRAFT_VOCAB, bias=False)
        randomize(self, gen)
        self.hot = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values  # target id of each draft id

    def checkpoint(self, embed: bool = True) -> dict[str, torch.Tensor]:
        """SGLang's EAGLE-3 names: midlayer.*, fc, norm, lm_head, d2t, t2d (embed_tokens optional)."""
        out: dict[str, torch.Tensor] = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight,
                                        "lm_head.weight": self.lm_head.weight,
                                        "d2t": self.hot - torch.arange(DRAFT_VOCAB),
                                        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, self.hot, True)}
        if embed:
            out["embed_tokens.weight"] = self.embed.weight
        for k, v in self.attn.state_dict().items():
            out[f"midlayer.self_attn.{k}"] = v
        for k, v in self.mlp.state_dict().items():
            out[f"midlayer.mlp.{k}"] = v
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            out[f"midlayer.{n}.weight"] = getattr(self, n).weight
        return {k: v.detach().clone() for k, v in out.items()}

    @torch.no_grad()
    def forward(self, ids: list[int], feats: torch.Tensor, raw_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``feats`` rows from ``raw_from`` on are the draft's own H-wide hidden (``feats[raw_from:, :H]``)."""
        n = len(ids) if raw_from is None else raw_from
        h = torch.cat([self.fc(feats[:n]), feats[n:, :H]])[None] if feats.shape[-1] != H else feats[None]
        emb = self.embed(torch.tensor([ids]))
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)
        a, _ = self.attn(x, position_embeddings=rope(self.cfg, x), attention_mask=causal(len(ids)))
        r = a + h
        out = self.mlp(self.post_attention_layernorm(r)) + r
        return self.norm(out)[0], out[0]

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        full = torch.full((hidden.shape[0], VOCAB), float("-inf"))
        full[:, self.hot] = self.lm_head(hidden)
        return full


def eagle3_config(**kw: Any):
    return hf_config(**{"num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB,
                        **kw})


def build_eagle3(cfg, ck: dict[str, torch.Tensor], tmp_path: Path | None = None) -> LlamaForCausalLMEagle3:
    model = LlamaForCausalLMEagle3(cfg, ctx())
    if tmp_path is None:
        model.load_weights(ck.items())
    else:  # through the engine's safetensors reader, as a checkpoint folder
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in ck.items()}, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
        model.load_weights(iter_weights(tmp_path))
    return model.eval()


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("prompt_lens", [[9], [5, 13]], ids=["one", "two"])
def test_eagle3_matches_reference(tmp_path, prompt_lens, backend):
    if backend == "cpu" and not cpu_decode.available():
        pytest.skip("needs the C++ CPU kernels")
    cfg = eagle3_config()
    ref = Eagle3Ref(cfg, torch.Generator().manual_seed(4))
    model = build_eagle3(cfg, ref.checkpoint(), tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    feats = [torch.randn(n, 3 * H, generator=gen) for n in prompt_lens]
    (got_logit_h, got_next), = run_draft(model, cfg, prompts, feats, backend)
    wants = [ref(p, f) for p, f in zip(prompts, feats)]
    torch.testing.assert_close(got_logit_h, torch.cat([w[0] for w in wants]), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_next, torch.cat([w[1] for w in wants]), atol=ATOL, rtol=0)
    logits = model.compute_logits(got_logit_h)
    assert logits.dtype == torch.float32 and logits.shape == (sum(prompt_lens), VOCAB)
    want_logits = ref.target_logits(torch.cat([w[0] for w in wants]))
    finite = torch.isfinite(want_logits)
    assert torch.equal(torch.isfinite(logits), finite)
    torch.testing.assert_close(logits[finite], want_logits[finite], atol=1e-3, rtol=0)
    # argmax is a target id: the draft argmax mapped through d2t
    draft_arg = ref.lm_head(torch.cat([w[0] for w in wants])).argmax(-1)
    assert torch.equal(logits.argmax(-1), ref.hot[draft_arg])


def test_eagle3_next_step_reads_its_own_hidden(tmp_path):
    """A prefill with the target's 3H features, then one token per sequence whose features are the
    draft's own H-wide pre-norm hidden (no fc), attending over the prefill's KV."""
    cfg = eagle3_config()
    ref = Eagle3Ref(cfg, torch.Generator().manual_seed(6))
    model = build_eagle3(cfg, ref.checkpoint())
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (4, 11)]
    feats = [torch.randn(n, 3 * H, generator=gen) for n in (4, 11)]
    own = [torch.randn(H, generator=gen) for _ in prompts]
    mixed = [torch.cat([f[:-1], nn.functional.pad(o, (0, 2 * H))[None]]) for f, o in zip(feats, own)]

    class Switch(nn.Module):  # the decode step's features: the H-wide hidden
        def forward(self, batch, f):
            return model(batch, f[:, :H] if batch.is_decode else f)

    outs = run_draft(Switch(), cfg, prompts, mixed, steps=2)
    wants = [ref(p, f, raw_from=len(p) - 1) for p, f in zip(prompts, mixed)]
    torch.testing.assert_close(outs[1][0], torch.stack([w[0][-1] for w in wants]), atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[1][1], torch.stack([w[1][-1] for w in wants]), atol=ATOL, rtol=0)


def test_eagle3_shares_the_targets_embedding(tmp_path):
    cfg = eagle3_config()
    target, hf = tiny_target(tmp_path)
    ref = Eagle3Ref(cfg, torch.Generator().manual_seed(8))
    model = build_eagle3(cfg, ref.checkpoint(embed=False))
    assert model.missing == {"model.embed_tokens.weight"}
    with pytest.raises(RuntimeError, match="share_target"):
        run_draft(model, cfg, [[3]], [torch.zeros(1, 3 * H)])
    model.share_target(target)
    assert model.model.embed_tokens is target.model.embed_tokens
    assert model.lm_head is not target.lm_head  # a draft vocabulary: its own head
    ref.embed.weight.data.copy_(hf.model.embed_tokens.weight)
    prompt, feats = [5, 9, 33, 2], torch.randn(4, 3 * H, generator=torch.Generator().manual_seed(9))
    (got, nxt), = run_draft(model, cfg, [prompt], [feats])
    want = ref(prompt, feats)
    torch.testing.assert_close(got, want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(nxt, want[1], atol=ATOL, rtol=0)


def test_eagle3_without_draft_vocab_takes_the_targets_head(tmp_path):
    cfg = hf_config(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"])
    target, hf = tiny_target(tmp_path)
    ck = {k: v for k, v in Eagle3Ref(cfg, torch.Generator().manual_seed(10)).checkpoint().items()
          if k not in ("lm_head.weight", "d2t", "t2d")}
    model = build_eagle3(cfg, ck)
    assert model.missing == {"lm_head.weight"} and model.hot_token_ids is None
    with pytest.raises(RuntimeError, match="share_target"):
        model.compute_logits(torch.zeros(1, H))
    model.share_target(target)
    assert model.lm_head is target.lm_head
    h = torch.randn(3, H)
    torch.testing.assert_close(model.compute_logits(h), h @ hf.lm_head.weight.T.detach(), atol=1e-4, rtol=0)


def test_eagle3_capture_layers_and_feature_size():
    cfg = eagle3_config(target_hidden_size=48)
    model = LlamaForCausalLMEagle3(cfg, ctx())
    assert model.feature_size == 144
    assert model.capture_layers(32) == (2, 16, 29)  # SGLang's default [2, L // 2, L - 3]
    cfg = eagle3_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 23, 44]})
    assert LlamaForCausalLMEagle3(cfg, ctx()).capture_layers(48) == (2, 24, 45)
    with pytest.raises(ModelLoadError, match="3 distinct"):
        LlamaForCausalLMEagle3(eagle3_config(), ctx()).capture_layers(4)  # [2, 2, 1]


def test_eagle3_fc_of_a_narrower_target(tmp_path):
    """target_hidden_size 48: fc is [H, 144]; the draft keeps its own embedding (SGLang's set_embed
    skips it); the H-wide hidden of later steps skips fc."""
    cfg = eagle3_config(target_hidden_size=48)
    ref = Eagle3Ref(cfg, torch.Generator().manual_seed(11), target_hidden=48)
    model = build_eagle3(cfg, ref.checkpoint())
    target, _ = tiny_target(tmp_path)
    model.share_target(target)
    assert model.model.embed_tokens is not target.model.embed_tokens
    prompt, feats = [7, 8, 9, 10, 11], torch.randn(5, 144, generator=torch.Generator().manual_seed(12))
    (got, nxt), = run_draft(model, cfg, [prompt], [feats])
    want = ref(prompt, feats)
    torch.testing.assert_close(got, want[0], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="wide"):
        run_draft(model, cfg, [prompt], [torch.zeros(5, 100)])
    no_embed = {k: v for k, v in ref.checkpoint().items() if k != "embed_tokens.weight"}
    with pytest.raises(ModelLoadError, match="embed_tokens"):
        build_eagle3(cfg, no_embed)


def test_eagle3_bad_checkpoints():
    cfg = eagle3_config()
    ck = Eagle3Ref(cfg, torch.Generator().manual_seed(13)).checkpoint()
    with pytest.raises(ModelLoadError, match="fc.weight"):
        build_eagle3(cfg, {**ck, "fc.weight": torch.zeros(H, 2 * H)})
    with pytest.raises(ModelLoadError, match="q_proj"):  # a plain H-wide q_proj
        build_eagle3(cfg, {**ck, "midlayer.self_attn.q_proj.weight": torch.zeros(H, H)})
    with pytest.raises(ModelLoadError, match="d2t"):
        build_eagle3(cfg, {k: v for k, v in ck.items() if k != "d2t"})
    with pytest.raises(ModelLoadError, match="d2t"):
        build_eagle3(cfg, {**ck, "d2t": ck["d2t"] + VOCAB})
    with pytest.raises(ModelLoadError, match="lm_head"):
        build_eagle3(cfg, {k: v for k, v in ck.items() if k != "lm_head.weight"})
    with pytest.raises(ModelLoadError, match="one decoder layer"):
        LlamaForCausalLMEagle3(eagle3_config(num_hidden_layers=2), ctx())


# --------------------------------------------------------------------------- target capture


def run_target(model: LlamaForCausalLM, prompts: list[list[int]], decode: list[int], backend: str):
    """A prefill of ``prompts`` then one decode token each; per step, (hidden, logits, captured)."""
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    pool = PagedPool(cfg.num_hidden_layers, cfg.num_key_value_heads, d, torch.float32, CPU, 4, 64, seed=2)
    acfg = AttentionConfig(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, d, torch.float32,
                           CPU, pool.kv)
    b = reference("attention_backend", "torch_native")(acfg) if backend == "torch_native" else _cpu_backend(acfg)
    seqs = [Seq() for _ in prompts]
    outs = []
    for step in ([list(p) for p in prompts], [[t] for t in decode]):
        for seq, toks in zip(seqs, step):
            pool.grow(seq, len(toks))
        batch = make_batch(seqs, [len(t) for t in step], b, CPU, input_ids=[t for toks in step for t in toks])
        b.prepare(batch)
        with torch.inference_mode():
            hidden = model(batch)
            logits = model.compute_logits(hidden)
        outs.append((hidden.clone(), logits, model.model.__dict__.pop("captured", None)))
    return outs, b


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_target_captures_layer_inputs(tmp_path, monkeypatch, backend):
    if backend == "cpu" and not cpu_decode.available():
        pytest.skip("needs the C++ CPU kernels")
    target, hf = tiny_target(tmp_path)
    prompts, decode = [[1, 5, 9, 40, 7], [1, 77, 3, 12, 90, 4, 18, 100, 6]], [11, 64]
    plain, _ = run_target(target, prompts, decode, backend)
    ran: list[int] = []
    real_run = cpu_decode.run
    monkeypatch.setattr(cpu_decode, "run", lambda *a: ran.append(1) or real_run(*a))
    target.model.capture_layers = (1, 2)
    captured, b = run_target(target, prompts, decode, backend)
    if backend == "cpu":
        assert ran, "the one-op layers (with their pending MLP outputs) should have run"
    hs = [hf(torch.tensor([p + [t]]), output_hidden_states=True).hidden_states for p, t in zip(prompts, decode)]
    for step, rows in ((0, [slice(0, len(p)) for p in prompts]), (1, [slice(len(p), len(p) + 1) for p in prompts])):
        want = torch.cat([torch.cat([h[1][0, r], h[2][0, r]], -1) for h, r in zip(hs, rows)]).detach()
        torch.testing.assert_close(captured[step][2], want, atol=ATOL, rtol=0)
        assert plain[step][2] is None
        torch.testing.assert_close(captured[step][1], plain[step][1], atol=ATOL, rtol=0)  # logits unchanged
        hf_logits = torch.cat([hf(torch.tensor([p + [t]])).logits[0, r] for p, t, r in zip(prompts, decode, rows)])
        torch.testing.assert_close(captured[step][1], hf_logits.detach(), atol=1e-3, rtol=0)


def test_target_capture_bypasses_the_decode_stack(tmp_path, monkeypatch):
    """The whole-stack CPU paths (``run_stack``/``run_stack_head``, ``decode_step(s)``) keep no
    layer inputs: while capturing they are not taken, even where a stack serves the batch. (A
    float32 model has no real stack, which needs int4/int8 linears: a stand-in plan here.)"""
    target, hf = tiny_target(tmp_path)

    def boom(*a: Any) -> None:
        raise AssertionError("the decode stack ran")

    monkeypatch.setattr(cpu_decode, "run_stack", boom)
    monkeypatch.setattr(cpu_decode, "run_stack_head", boom)
    monkeypatch.setattr(cpu_decode, "decode", boom)
    monkeypatch.setattr(cpu_decode, "decode_steps", boom)
    monkeypatch.setattr(target.model, "_cpu_stack", lambda backend, head: {"embeds": True, "max_rows": 64, "head_rows": 64})
    inputs = SimpleNamespace(seq_lens=[6, 10], input_ids=[11, 64], positions=[5, 9], out_cache_loc=[0, 0],
                             kv_indices=torch.zeros(2, 10, dtype=torch.int64), logit_rows=[(0, 2)])
    with pytest.raises(AssertionError, match="stack ran"):
        run_target(target, [[1, 5]], [7], "torch_native")
    assert target._decode_stack(inputs, None) is not None
    target.model.capture_layers = (0, 2)
    outs, b = run_target(target, [[1, 5]], [7], "torch_native")
    hs = hf(torch.tensor([[1, 5, 7]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(outs[1][2], torch.cat([hs[0][0, 2:], hs[2][0, 2:]], -1), atol=ATOL, rtol=0)
    assert target._decode_stack(inputs, b) is None
    assert target.decode_step(inputs, b) is None and target.decode_steps(inputs, b, 2, []) is None


def test_target_capture_after_the_last_layer(tmp_path):
    """Index num_layers: the stream after the last layer, before the final norm."""
    target, _ = tiny_target(tmp_path)
    target.model.capture_layers = (3, 0)
    outs, _ = run_target(target, [[1, 2, 3]], [4], "torch_native")
    hidden, _, cap = outs[0]
    emb = target.model.embed_tokens(torch.tensor([1, 2, 3]))
    torch.testing.assert_close(cap[:, H:], emb, atol=0, rtol=0)  # list order: layer 3 first, then 0
    torch.testing.assert_close(target.model.norm(cap[:, :H]), hidden, atol=1e-5, rtol=0)
    target.model.capture_layers = (4,)
    with pytest.raises(ValueError, match="out of range"):
        run_target(target, [[1]], [2], "torch_native")


def test_eagle3_accepts_model_prefixed_names():
    """SGLang's loader takes each name as is where it names a parameter, else with "model." before it."""
    cfg = eagle3_config()
    ck = Eagle3Ref(cfg, torch.Generator().manual_seed(14)).checkpoint()
    prefixed = {k if k in ("lm_head.weight", "d2t", "t2d") else "model." + k: v for k, v in ck.items()}
    a, b = build_eagle3(cfg, ck), build_eagle3(cfg, prefixed)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(a.hot_token_ids, b.hot_token_ids)


def test_eagle3_logits_before_loading_are_target_wide():
    """``--load-format dummy`` never loads d2t: the draft ids map to themselves, logits stay target-wide."""
    model = LlamaForCausalLMEagle3(eagle3_config(), ctx())
    nn.init.normal_(model.lm_head.weight)
    logits = model.compute_logits(torch.randn(2, H))
    assert logits.shape == (2, VOCAB)
    assert torch.isfinite(logits[:, :DRAFT_VOCAB]).all() and torch.isinf(logits[:, DRAFT_VOCAB:]).all()
