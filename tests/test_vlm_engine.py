"""Vision-language serving end to end (issue 45): a tiny random Qwen2-VL with a locally built
processor, served by the engine. Greedy tokens equal transformers' for several images and
prompts in one batch mixing image and text-only requests; a repeated image is served from the
prefix cache, a different image with the same text is not; a chat request with a data URI works
over HTTP."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import assert_pool_free, char_tokenizer, greedy, make_engine
from tests.test_multimodal_inputs import SPECIAL, TEMPLATE

N_NEW = 6
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56 * 2


def tokenizer():
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL + ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TEMPLATE
    return tok


def picture(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(folder, transformers model, tokenizer): a tiny random Qwen2-VL whose folder has its tokenizer
    and image processor, as a real checkpoint does."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(vocab_size=len(tok) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25,
                bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, patch_size=14, spatial_merge_size=2,
                  in_channels=3, temporal_patch_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], architectures=["Qwen2VLForConditionalGeneration"])
    path = tmp_path_factory.mktemp("tiny-qwen2-vl")
    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration(cfg).float().eval()
    hf.set_attn_implementation("eager")
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    return path, hf, tok


def hf_greedy(vlm, text: str, images: list[Image.Image], n: int = N_NEW) -> list[int]:
    """transformers' greedy tokens for ``text`` (one ``<|image_pad|>`` per image, expanded here)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _, hf, tok = vlm
    ids = tok.encode(text)
    kw = {}
    if images:
        out = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)(images=images, return_tensors="pt")
        pad, counts = hf.config.image_token_id, (out["image_grid_thw"].prod(-1) // 4).tolist()
        expanded, k = [], 0
        for t in ids:
            expanded += [pad] * counts[k] if t == pad else [t]
            k += t == pad
        ids, kw = expanded, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                             # (transformers computes M-RoPE positions from these: 1 marks an image token)
                             "mm_token_type_ids": torch.tensor([[int(t == pad) for t in expanded]])}
    return hf_generate(hf, ids, n, **kw)


def hf_generate(hf, ids: list[int], n: int, **images) -> list[int]:
    """transformers' ``n`` greedy tokens after the expanded prompt ``ids`` (with its image inputs)."""
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, **images)
    return gen[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def eng(vlm):
    e = make_engine(vlm[0], max_total_tokens=2048)
    yield e
    e.shutdown()


IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def test_images_and_text_in_one_batch_match_transformers(vlm, eng):
    assert eng.engine.multimodal is not None and eng.engine.multimodal.mrope
    a, b, c = picture(60, 40, 1), picture(30, 90, 2), picture(50, 50, 3)
    texts = [f"look {IMG} here", f"two {IMG} and {IMG}!", "no picture at all", f"{IMG}"]
    images = [[a], [b, c], None, [c]]
    outs = eng.generate([*texts], greedy(N_NEW), image_data=images)
    for t, im, out in zip(texts, images, outs):
        assert out["output_ids"] == hf_greedy(vlm, t, im or []), t
    assert_pool_free(eng)


def test_a_repeated_image_is_cached_and_another_image_is_not(vlm, eng):
    text = f"cache {IMG} me please"
    a, b = picture(56, 56, 10), picture(56, 56, 11)  # same size: same number of image tokens
    first = eng.generate(text, greedy(N_NEW), image_data=a)
    again = eng.generate(text, greedy(N_NEW), image_data=a)
    other = eng.generate(text, greedy(N_NEW), image_data=b)
    n = first["meta_info"]["prompt_tokens"]
    assert again["meta_info"]["cached_tokens"] == n - 1 and again["output_ids"] == first["output_ids"]
    before = len(vlm[2].encode("cache <|vision_start|>"))  # the text before the image may be shared
    assert other["meta_info"]["cached_tokens"] <= before
    assert other["output_ids"] == hf_greedy(vlm, text, [b])
    assert first["output_ids"] == hf_greedy(vlm, text, [a])


def test_chunked_prefill_encodes_each_image_once(vlm):
    e = make_engine(vlm[0], max_total_tokens=2048, chunked_prefill_size=8)
    try:
        mm = e.engine.multimodal
        calls = []
        orig = mm.model.encode_images
        mm.model.encode_images = lambda *a: calls.append(a[1].tolist()) or orig(*a)
        text, a, b = f"x {IMG} y {IMG} z", picture(60, 40, 5), picture(40, 60, 6)
        out = e.generate(text, greedy(N_NEW), image_data=[a, b])
        assert out["output_ids"] == hf_greedy(vlm, text, [a, b])
        assert len(calls) == 1 and len(calls[0]) == 2  # one call, both images, though the prompt took several chunks
    finally:
        e.shutdown()


def test_bad_image_input_is_a_clear_error(vlm, eng):
    with pytest.raises(Exception, match="placeholder"):
        eng.generate(f"one {IMG}", greedy(2), image_data=[picture(30, 30, 1), picture(30, 30, 2)])
    with pytest.raises(Exception, match="image"):
        eng.generate(f"one {IMG}", greedy(2), image_data="not an image at all")


def test_chat_with_a_data_uri_over_http(vlm):
    from tests.server_utils import start_server

    img = picture(60, 40, 7)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "what is it?"}]}]
    with start_server("--model-path", str(vlm[0]), "--dtype", "float32", "--max-total-tokens", "2048") as url:
        import httpx

        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": messages, "max_tokens": N_NEW, "temperature": 0, "logprobs": True,
            "min_tokens": N_NEW})
        assert r.status_code == 200, r.text
        got = [vlm[2].convert_tokens_to_ids(t["token"]) for t in r.json()["choices"][0]["logprobs"]["content"]]
    text = vlm[2].apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
                                      tokenize=False, add_generation_prompt=True)
    assert got == hf_greedy(vlm, text, [img])


def test_enable_multimodal_false_refuses_images_and_a_text_only_model_ignores_the_flag(vlm, tmp_path):
    from tests.conftest import build_tiny_llama

    off = make_engine(vlm[0], max_total_tokens=1024, enable_multimodal=False)
    try:
        assert off.engine.multimodal is None
        with pytest.raises(Exception, match="text-only"):
            off.generate(f"x {IMG}", greedy(2), image_data=picture(30, 30, 1))
    finally:
        off.shutdown()
    build_tiny_llama(tmp_path / "llama")
    text_only = make_engine(tmp_path / "llama", enable_multimodal=True)  # SGLang: nothing happens
    try:
        assert text_only.engine.multimodal is None
    finally:
        text_only.shutdown()
    with pytest.raises(Exception, match="limit-mm-data-per-request"):
        make_engine(vlm[0], max_total_tokens=1024, limit_mm_data_per_request="{image: 2")


def test_data_parallel_replicas_are_refused_for_a_vision_language_model(vlm):
    with pytest.raises(Exception, match="--dp-size > 1 with the vision-language model"):
        make_engine(vlm[0], dp_size=2)


def test_the_copies_of_an_n_gt_1_request_share_one_encoding(vlm, eng):
    mm = eng.engine.multimodal
    calls = []
    orig = mm.model.encode_images
    mm.model.encode_images = lambda *a: calls.append(a[0].shape[0]) or orig(*a)
    try:
        text, img = f"twice {IMG} over", picture(44, 60, 9)
        outs = eng.generate(text, greedy(N_NEW, n=2), image_data=img)
    finally:
        mm.model.encode_images = orig
    assert [o["output_ids"] for o in outs] == [hf_greedy(vlm, text, [img])] * 2
    assert len(calls) == 1  # one call, for one image: the two sequences share its rows
    one = mm.processor.process(vlm[2].encode(text), [img]).pixel_values.shape[0]
    assert calls == [one]


def test_a_weight_update_rebinds_the_vision_tower(vlm, eng):
    """After /update_weights_from_disk the images go through the new module's vision tower (the
    processor stays: same architecture), and they still give transformers' tokens."""
    ae = eng.engine
    old = ae.model
    ok, message = eng._call(ae.update_weights_from_disk(str(vlm[0])))
    assert ok, message
    assert ae.model is not old and ae.multimodal.model is ae.model and ae.runner.mm is ae.multimodal
    a = picture(60, 40, 1)
    assert eng.generate(f"look {IMG} here", greedy(N_NEW), image_data=[a])["output_ids"] == \
        hf_greedy(vlm, f"look {IMG} here", [a])


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_draft_trees_over_an_image_request_keep_plain_decodings_tokens(vlm, tree):
    """M-RoPE: a request's tokens past its prompt are at position + the image's delta. A tree's
    nodes are at their depths; the delta was added to the row's index instead, so a node's
    position was wrong wherever the tree branched."""
    from core.interfaces import DraftTree

    text, img = f"look {IMG} here, now", picture(112, 84, 5)
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = make_engine(vlm[0], max_total_tokens=2048)
    try:
        ref = plain.generate(text, greedy, image_data=img)
    finally:
        plain.shutdown()
    want, n = ref["output_ids"], ref["meta_info"]["prompt_tokens"]

    def propose(state, tokens, k):  # per depth a wrong sibling, then the reference token
        nxt = want[len(tokens) - n:][:k // 2]
        if not tree:
            return nxt
        toks, parents = [], []
        for t in nxt:
            parents += [len(toks) - 1] * 2
            toks += [(t + 1) % 200, t]
        return DraftTree(toks, parents)

    eng = make_engine(vlm[0], max_total_tokens=2048, speculative_algorithm="NGRAM", speculative_num_draft_tokens=9)
    try:
        spec = eng.engine.scheduler.speculator
        spec.trees, spec.drafter.propose = True, propose
        out = eng.generate(text, greedy, image_data=img)
    finally:
        eng.shutdown()
    assert out["meta_info"]["spec_num_correct_drafts"] > 0
    assert out["output_ids"] == want
