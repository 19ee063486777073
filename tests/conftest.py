"""Shared engine fixtures: tiny random Llama checkpoints built on the fly, a char-level
tokenizer for them, transformers reference helpers, and pool-leak checks.

Server fixtures live elsewhere; keep this file about the engine.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import string
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

# Without a GPU the Triton kernels run in triton's interpreter, which triton reads when a kernel
# module is first imported: set before any test module imports one, so that a run of a few files
# imports them as the whole suite does (else a kernel imported first by one module is compiled
# code that another module's interpreted launch cannot call).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --------------------------------------------------------------------------- tiny models

TINY_VOCAB = 256
TINY_BASE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Larger than the default 0.02 so logits are peaked enough that greedy argmax is far
    # from ties: fp32 kernel differences must never flip a token.
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# name -> LlamaConfig overrides. Every variant is compared against transformers.
TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "head_dim": {"head_dim": 32, "num_hidden_layers": 3},  # head_dim != hidden / heads
    "mqa": {"num_key_value_heads": 1},
    "tied": {"tie_word_embeddings": True},
    "rope_llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "rope_linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
}


def char_tokenizer():
    """A char-level fast tokenizer over the tiny vocab: ids 0-2 are <unk>, <s>, </s>; then
    printable ASCII and newline, one char per token; the rest are two-letter tokens that
    encoding never produces but decoding renders. Decoded text is always plain ASCII, so
    text-level behaviour (streaming, stop strings) is testable on a random model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\n": 3}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    for a, b in itertools.product(string.ascii_lowercase, repeat=2):
        if len(vocab) >= TINY_VOCAB:
            break
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_tiny_llama(path: Path, seed: int = 0, safe_serialization: bool = True, **overrides: Any):
    """Save a random transformers Llama (plus the char tokenizer) to ``path``; return the HF model.

    ``safe_serialization=False`` writes ``pytorch_model.bin`` instead of safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_BASE, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path)
    if not safe_serialization:
        # transformers 5 always writes safetensors; write the legacy PyTorch .bin layout by hand
        for f in path.glob("*.safetensors"):
            f.unlink()
        state = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
        torch.save(state, path / "pytorch_model.bin")
    char_tokenizer().save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Callable[..., tuple[Path, Any]]:
    """``tiny_llama(variant="gqa", **overrides) -> (folder, transformers model)``, built once per session."""
    cache: dict[tuple, tuple[Path, Any]] = {}

    def get(variant: str = "gqa", **overrides: Any) -> tuple[Path, Any]:
        key = (variant, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{variant}")
            safe = overrides.pop("safe_serialization", True)
            cache[key] = path, build_tiny_llama(path, safe_serialization=safe, **{**TINY_VARIANTS[variant], **overrides})
        return cache[key]

    return get


# CORE_TEST_OVERLAP=1: engines made here schedule with overlap (unless a test says otherwise), their
# decodes' tokens left on the device as on a GPU (ModelRunner.defer_results): the engine suites run
# again so (tests/test_overlap_suites.py), with the same expectations.
OVERLAP = os.environ.get("CORE_TEST_OVERLAP") == "1"


def make_engine(path: Path | str, **kwargs: Any):
    """A small fp32 CPU engine over a tiny model (tokenizer on unless told otherwise)."""
    import core

    opts: dict[str, Any] = dict(model_path=str(path), dtype="float32", max_total_tokens=1024, cpu_threads=1, device="cpu",
                                random_seed=0)  # (unseeded samples repeat across the engines a test compares)
    if OVERLAP and "disable_overlap_schedule" not in kwargs and "enable_overlap_schedule" not in kwargs:
        opts["enable_overlap_schedule"] = True
    opts.update(kwargs)
    eng = core.Engine(**opts)
    if OVERLAP and (runner := getattr(eng.engine, "runner", None)) is not None:
        runner.defer_results = eng.engine.overlap and eng.engine.tp_group is None
    return eng


# Every device the engine can run on here: the CPU always, CUDA when present (those runs carry
# the ``gpu`` marker), so the same engine tests run on a GPU machine.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def device_params() -> list:
    return [pytest.param(d, id=d, marks=() if d == "cpu" else pytest.mark.gpu) for d in DEVICES]


@pytest.fixture(scope="module", params=device_params())
def device(request) -> str:
    """Each available device in turn (``cpu``; ``cuda`` when present)."""
    return request.param


@pytest.fixture(scope="module")
def engine_factory(device):
    """``engine_factory(path, **kwargs) -> Engine`` on each available device (``device=`` to pin
    one); every engine made is shut down with the module."""
    made = []

    def make(path: Path | str, **kwargs: Any):
        kwargs.setdefault("device", device)
        eng = make_engine(path, **kwargs)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="session")
def smollm2():
    """``(Engine, transformers model)`` for the default SmolLM2-135M-Instruct GGUF, both float32.

    The GGUF conversion is cached under ~/.cache/core (or $CORE_CACHE_DIR), shared with CI runs."""
    import core
    from core.engine.model_loader.gguf_cache import gguf_dense_folder
    from transformers import AutoModelForCausalLM

    eng = core.Engine(dtype="float32", max_total_tokens=8192, cpu_threads=2, device="cpu")
    try:
        mc = eng.engine.model_config  # its path holds no linear weights: the whole model is the dense folder
        hf = AutoModelForCausalLM.from_pretrained(gguf_dense_folder(mc.gguf_file, mc.path), dtype=torch.float32).eval()
        yield eng, hf
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------- references


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly ``n`` tokens (EOS cannot end it early)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


TIE_GAP = 1e-3  # logprob gap below which two tokens count as tied in fp32


def assert_greedy_matches(model, prompt_ids: list[int], got: list[int], n: int | None = None) -> None:
    """``got`` equals transformers' greedy continuation token for token.

    A divergence is tolerated only at a genuine near-tie (top-2 gap < TIE_GAP in
    transformers' own logprobs); everything before it must match exactly."""
    n = len(got) if n is None else n
    ref = hf_greedy(model, prompt_ids, n)
    assert len(got) == n, (got, ref)
    if got == ref:
        return
    k = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
    lp = hf_logprobs(model, prompt_ids + ref[:k])[-1]
    gap = (lp[ref[k]] - lp[got[k]]).item()
    assert gap < TIE_GAP, f"diverged at token {k}: engine {got} vs transformers {ref} (logprob gap {gap:.4f})"


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-softmax of transformers' logits over the whole sequence."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids], device=model.device)).logits[0].float(), -1).cpu()


# --------------------------------------------------------------------------- invariants


def assert_pool_free(engine) -> None:
    """Nothing queued or running, every KV page back in the free list or held (unlocked) by the
    prefix cache, every table row free."""
    ae = getattr(engine, "engine", engine)
    sched, alloc, table = ae.scheduler, ae.allocator, ae.table
    assert not sched.waiting and not sched.running, (list(sched.waiting), sched.running)
    tree = getattr(sched, "tree_cache", None)
    cached = [] if tree is None else tree.all_pages()
    if tree is not None:
        tree.check()
        assert tree.protected_pages == 0, "a finished request still locks the prefix cache"
    assert alloc.num_free + len(cached) == alloc.capacity
    assert sorted(alloc._free + cached) == list(range(1, alloc.num_pages)), "page 0 handed out or a page duplicated"
    assert table.num_free == table.table.shape[0]
    assert sorted(table._free_rows) == list(range(table.table.shape[0]))


@contextlib.contextmanager
def finished_requests(engine):
    """Collect every request the engine finishes, as ``{rid: Req}`` (its final state, whatever
    path it took: finished, aborted, abandoned stream or shutdown)."""
    ae = getattr(engine, "engine", engine)
    done: dict[str, Any] = {}

    def record(req) -> None:
        done[req.rid] = req

    ae.finish_listeners.append(record)
    try:
        yield done
    finally:
        ae.finish_listeners.remove(record)



def greedy(num_tokens: int, /, **extra: Any) -> dict[str, Any]:
    """Greedy sampling params for exactly ``num_tokens`` tokens (EOS is blocked until then)."""
    return {"temperature": 0.0, "max_new_tokens": num_tokens, "min_new_tokens": num_tokens, **extra}
