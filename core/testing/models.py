"""The model-architecture suite: a model plugin against transformers on a tiny random config.

The config is the author's (``model_config``) or derived from the architecture's transformers
class (``transformers.<Architecture>.config_class`` with small sizes). transformers builds a
random model from it (seeded, with a large ``initializer_range`` so that greedy tokens are far
from ties), saves it, and the plugin's model loads that checkpoint through ``load_weights``,
exactly as the engine does. Both then run in float32: the plugin's model over a paged KV pool
with the ``torch_native`` backend, driven step by step here (prefill, chunked prefill mixed
with decodes, greedy decode), transformers over whole sequences. Log-probabilities must agree
within :data:`LOGPROB_ATOL`, and greedy tokens must be transformers' greedy tokens except at a
genuine near-tie (top-2 gap below :data:`TIE_GAP`).
"""

from __future__ import annotations

import copy
import random
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch

from core.interfaces import AttentionConfig, ModelContext
from core.testing.paged import PagedPool, Seq, make_batch
from core.testing.suite import Case, Skipped, assert_close, fail, reference, resolve_target, seed_for

KIND = "model"
LOGPROB_ATOL = 1e-4
TIE_GAP = 1e-3
VOCAB = 256

# Small sizes for a derived config; a key is set only where the config class has it.
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.25,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=8, query_pre_attn_scalar=16,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
    num_local_experts=4,
)


def derive_config(architecture: str) -> Any:
    """A tiny config for ``architecture`` from its transformers class, or Skipped if there is none."""
    import transformers

    ref = getattr(transformers, architecture, None)
    if ref is None or getattr(ref, "config_class", None) is None:
        raise Skipped(f"transformers has no class {architecture!r} to derive a config from and compare with; "
                      f"pass model_config (and model_reference) for it")
    if "text_config" in (getattr(ref.config_class, "sub_configs", None) or {}):
        # a composite config (text + vision towers): its defaults are the full-size model, and its
        # towers' tiny shapes are the model's own business (e.g. Qwen2-VL's M-RoPE sections)
        raise Skipped(f"transformers' {ref.config_class.__name__} is a composite (text + vision) config; "
                      f"pass model_config, a tiny one")
    known = ref.config_class().to_dict()
    return ref.config_class(**{k: v for k, v in TINY.items() if k in known}, architectures=[architecture])


@attrs.define
class ModelSubject:
    """A model under test: its factory, the tiny config and the transformers class to compare with."""

    factory: Any
    label: str
    architecture: str
    config: Any
    reference: Any
    device: torch.device
    kind: str = KIND
    _built: Any = None

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None, config: Any = None, reference: Any = None,
              device: Any = None) -> ModelSubject:
        """``target``: an architecture name (looked up among installed plugins) or a factory
        ``(hf_config, ModelContext) -> nn.Module``; ``config``: a transformers config (its
        ``architectures[0]`` names the transformers reference class unless ``reference`` is given)."""
        factory, label = resolve_target(KIND, target, plugins)
        arch = target if isinstance(target, str) else (getattr(config, "architectures", None) or [label])[0]
        return cls(factory, label, arch, config, reference, torch.device(device or "cpu"))

    def models(self) -> tuple[Any, Any]:
        """(plugin model, transformers model), built once per subject."""
        if self._built is None:
            self._built = _build(self)
        return self._built


def _reference_class(s: ModelSubject, config: Any) -> Any:
    import transformers

    if s.reference is not None:
        return s.reference
    for name in [*(getattr(config, "architectures", None) or []), s.architecture]:
        if getattr(transformers, name, None) is not None:
            return getattr(transformers, name)
    raise Skipped(f"no transformers class for {s.architecture!r}; pass model_reference")


def _build(s: ModelSubject) -> tuple[Any, Any]:
    from core.engine.model_loader.loader import iter_weights

    config = copy.deepcopy(s.config) if s.config is not None else derive_config(s.architecture)
    ref_cls = _reference_class(s, config)
    config._attn_implementation = "eager"  # the plain reference path (soft-capping included)
    torch.manual_seed(seed_for(KIND, s.architecture))
    hf = ref_cls(config).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)  # the checkpoint layout a real model ships, names included
        with torch.device(s.device):
            model = s.factory(config, ModelContext(torch.float32, s.device, reference("quant_method", "none")()))
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.data = p.data.float()
        model.load_weights(iter_weights(Path(tmp)))
    for m in model.modules():
        if getattr(m, "quant_method", None) is not None:
            m.quant_method.process_weights_after_loading(m)
    return model.eval(), hf


class _Runner:
    """Drives a model over a paged pool with the reference attention backend, step by step."""

    def __init__(self, model: Any, config: Any, device: torch.device) -> None:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.pool = PagedPool(config.num_hidden_layers, kv_heads, head_dim, torch.float32, device, 4, 64, seed=1)
        cfg = AttentionConfig(config.num_hidden_layers, heads, kv_heads, head_dim, torch.float32, device, self.pool.kv)
        self.backend = reference("attention_backend", "torch_native")(cfg)
        self.model, self.device = model, device

    @torch.inference_mode()
    def step(self, seqs: list[Seq], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Add ``tokens[i]`` to ``seqs[i]`` in one forward; returns each sequence's ``[n, V]`` logprobs."""
        for seq, toks in zip(seqs, tokens):
            self.pool.grow(seq, len(toks))
            seq.tokens += toks
        batch = make_batch(seqs, [len(t) for t in tokens], self.backend, self.device,
                           input_ids=[t for toks in tokens for t in toks])
        self.backend.prepare(batch)
        hidden = self.model(batch)
        lp = torch.log_softmax(self.model.compute_logits(hidden).float(), -1).cpu()
        return list(lp.split([len(t) for t in tokens]))


def _prompt(s: ModelSubject, n: int, seed: int) -> list[int]:
    """``n`` token ids: 1 (BOS in the derived configs), then random ids past the specials."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, model_config(s).vocab_size) for _ in range(n - 1)]


@torch.no_grad()
def _hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def _causal(s: ModelSubject) -> tuple[Any, Any]:
    model, hf = s.models()
    if callable(getattr(model, "classify", None)) or not callable(getattr(model, "compute_logits", None)):
        raise Skipped("a classification model (it has classify): the classify case compares its scores")
    return model, hf


def check_prefill(s: ModelSubject) -> None:
    """Two fresh prompts in one batch: logprobs at every position equal transformers'."""
    model, hf = _causal(s)
    run = _Runner(model, model_config(s), s.device)
    prompts = [_prompt(s, 5, 1), _prompt(s, 23, 2)]
    seqs = [Seq(), Seq()]
    for p, got in zip(prompts, run.step(seqs, prompts)):
        assert_close(s, "prefill", f"prompt of {len(p)} tokens, logprobs", got, _hf_logprobs(hf, p), LOGPROB_ATOL, 0)


def check_chunked_prefill(s: ModelSubject) -> None:
    """A prompt in chunks of 7 while another sequence decodes in the same batches."""
    model, hf = _causal(s)
    run = _Runner(model, model_config(s), s.device)
    long, short = _prompt(s, 20, 3), _prompt(s, 4, 4)
    a, b = Seq(), Seq()
    got_a, outs_b = [], [run.step([b], [short])[0]]
    for k in range(0, len(long), 7):
        tok_b = int(outs_b[-1][-1].argmax())
        la, lb = run.step([a, b], [long[k:k + 7], [tok_b]])
        got_a.append(la)
        outs_b.append(lb)
    assert_close(s, "chunked_prefill", "chunked prompt logprobs", torch.cat(got_a), _hf_logprobs(hf, long), LOGPROB_ATOL, 0)
    want_b = _hf_logprobs(hf, b.tokens)
    assert_close(s, "chunked_prefill", "decoding neighbour logprobs", torch.cat(outs_b)[: len(b.tokens)],
                 want_b, LOGPROB_ATOL, 0)


def check_greedy(s: ModelSubject, steps: int = 8) -> None:
    """Three prompts (past the sliding window where there is one) decoded greedily as a batch:
    the tokens are transformers' greedy tokens and every logprob agrees."""
    model, hf = _causal(s)
    run = _Runner(model, model_config(s), s.device)
    prompts = [_prompt(s, 3, 5), _prompt(s, 30, 6), _prompt(s, 17, 7)]
    seqs = [Seq() for _ in prompts]
    lps = run.step(seqs, prompts)
    gen: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = [int(lp[-1].argmax()) for lp in lps]
        for g, t in zip(gen, nxt):
            g.append(t)
        lps = [torch.cat([old, new]) for old, new in zip(lps, run.step(seqs, [[t] for t in nxt]))]
    for p, g, lp in zip(prompts, gen, lps):
        ref = _hf_logprobs(hf, p + g)
        assert_close(s, "greedy_decode", f"prompt of {len(p)} + {steps} greedy tokens, logprobs",
                     lp, ref, LOGPROB_ATOL, 0)
        for k, t in enumerate(g):
            row = ref[len(p) - 1 + k]
            best = int(row.argmax())
            if t != best and float(row[best] - row[t]) >= TIE_GAP:
                raise fail(s, "greedy_decode", f"prompt of {len(p)} tokens: greedy token {k} is {t}, "
                                               f"transformers' is {best} (logprob gap {float(row[best] - row[t]):.4f})")


@torch.inference_mode()
def check_classify(s: ModelSubject) -> None:
    """A classification model (``classify(pooled)``): scores of the last token equal transformers'."""
    model, hf = s.models()
    if not callable(getattr(model, "classify", None)):
        raise Skipped("not a classification model (no classify method)")
    run = _Runner(model, model_config(s), s.device)
    for n, seed in ((6, 8), (19, 9)):
        p = _prompt(s, n, seed)
        seq = Seq()
        run.pool.grow(seq, n)
        batch = make_batch([seq], [n], run.backend, s.device, input_ids=p)
        run.backend.prepare(batch)
        got = model.classify(model(batch)[-1:])
        want = hf(torch.tensor([p])).logits.float()
        assert_close(s, "classify", f"scores of a {n}-token prompt", got.cpu(), want, LOGPROB_ATOL, 1e-4)


def model_config(s: ModelSubject) -> Any:
    """The reference's language-model config (a vision-language model's text config): layer and head
    counts, vocabulary. A text-only prompt exercises a vision-language model's language model."""
    return s.models()[1].config.get_text_config()


def model_cases() -> list[Case]:
    return [
        Case("prefill", check_prefill, check_prefill.__doc__ or ""),
        Case("chunked_prefill", check_chunked_prefill, check_chunked_prefill.__doc__ or ""),
        Case("greedy_decode", check_greedy, check_greedy.__doc__ or ""),
        Case("classify", check_classify, check_classify.__doc__ or ""),
    ]
