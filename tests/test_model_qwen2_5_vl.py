"""Qwen2.5-VL (issue 45): our model plugin, built through the engine's model-building path from a
tiny random checkpoint, against transformers' Qwen2_5_VLForConditionalGeneration in float32: the
windowed vision tower's output (windows of 2 x 2 merged tokens, so both test images span several,
one unevenly), its window order, the M-RoPE positions, a prompt with two images prefilled in one
forward then decoded greedily, and the engine serving images end to end."""

from __future__ import annotations

import pytest
import torch

from core.plugins import load_plugins
from core_plugins.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Ours
from tests.test_model_qwen2_vl import (  # noqa: F401 (images: the shared fixture)
    IMAGE, VEND, VIDEO, VSTART, build_ours, check_encode_images, check_mrope_positions, check_prefill_and_decode,
    images,
)

ARCH = "Qwen2_5_VLForConditionalGeneration"
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25, bos_token_id=1,
            eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [2, 3, 3]})  # head_dim 16: 8 pairs
# window_size 56 px = 2 x 2 merged tokens (2 x 2 patches of 14 px each); block 1 of 3 attends the whole image
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
              spatial_merge_size=2, in_channels=3, temporal_patch_size=2, window_size=56,
              fullatt_block_indexes=[1])


def tiny_config(text: dict = TEXT, **ids):
    from transformers import Qwen2_5_VLConfig

    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND) | ids
    return Qwen2_5_VLConfig(text_config=text, vision_config=VISION, architectures=[ARCH], **ids)


def reference(config):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(config).float().eval()
    hf.set_attn_implementation("eager")  # the plain reference definition
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2.5-vl")
    hf = reference(tiny_config())
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def ours(checkpoint):
    return build_ours(checkpoint[0], ARCH)


def test_registered_and_built_through_the_engine(ours):
    assert ARCH in load_plugins().names("model")
    assert isinstance(ours, Ours) and ours.image_token_id == IMAGE
    assert ours.config.num_hidden_layers == 2 and ours.vision_config.depth == 3
    assert ours.visual.window == 2 and ours.visual.full_attention == {1}


@pytest.mark.parametrize("grids", [[[1, 4, 6], [1, 8, 4]], [[2, 10, 6]], [[1, 4, 4], [3, 6, 14], [1, 2, 2]]])
def test_window_order_matches_transformers(ours, grids):
    from transformers.vision_utils import get_vision_window_index

    grid = torch.tensor(grids)
    want, cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=56, patch_size=14)
    order, lengths = ours.visual.windows(grids)
    assert torch.equal(order, want)
    assert [0, *torch.tensor(lengths).cumsum(0).tolist()] == cu.tolist()


def test_encode_images_matches_the_vision_tower(ours, checkpoint, images):
    check_encode_images(ours, checkpoint[1], *images)  # (windows stay within an image too)


def test_windows_matter(ours, images):
    """Every block attending the whole image gives other embeddings: the windows are exercised."""
    pixels, grid = images
    visual = ours.visual
    with torch.inference_mode():
        windowed = visual(pixels, grid)
        saved = visual.full_attention
        visual.full_attention = frozenset(range(len(visual.blocks)))
        try:
            full = visual(pixels, grid)
        finally:
            visual.full_attention = saved
    assert not torch.allclose(windowed, full, atol=1e-3)


def test_mrope_positions_match_get_rope_index(ours, checkpoint, images):
    check_mrope_positions(ours, checkpoint[1], images[1])


def test_prefill_with_images_and_greedy_decode_match_transformers(ours, checkpoint, images):
    check_prefill_and_decode(ours, checkpoint[1], *images, steps=5)


def test_engine_serves_images_like_transformers(tmp_path):
    """The engine end to end (processor, vision tower once per request, M-RoPE, prefix cache): a
    batch mixing image and text-only requests gives transformers' greedy tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.conftest import assert_pool_free, greedy, make_engine
    from tests.test_multimodal_inputs import SPECIAL
    from tests.test_vlm_engine import IMG, MAX_PIXELS, MIN_PIXELS, N_NEW, hf_greedy, picture, tokenizer

    tok = tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = TEXT | dict(vocab_size=len(tok) + 4, max_position_embeddings=512)
    hf = reference(tiny_config(text, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                               vision_start_token_id=ids["<|vision_start|>"],
                               vision_end_token_id=ids["<|vision_end|>"]))
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(tmp_path)
    vlm = (tmp_path, hf, tok)

    eng = make_engine(tmp_path, max_total_tokens=2048)
    try:
        assert eng.engine.multimodal is not None and eng.engine.multimodal.mrope
        a, b = picture(90, 60, 1), picture(40, 100, 2)
        texts = [f"look {IMG} here", f"two {IMG} and {IMG}!", "no picture at all"]
        pics = [[a], [b, a], None]
        outs = eng.generate(texts, greedy(N_NEW), image_data=pics)
        for t, im, out in zip(texts, pics, outs):
            assert out["output_ids"] == hf_greedy(vlm, t, im or []), t
        again = eng.generate(texts[0], greedy(N_NEW), image_data=[a])  # the same image: from the prefix cache
        assert again["output_ids"] == outs[0]["output_ids"]
        assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
        assert_pool_free(eng)
    finally:
        eng.shutdown()
