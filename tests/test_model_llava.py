"""LLaVA (issue 45, a family with another vision tower): a tiny random LLaVA-1.5 (CLIP tower,
projector, Llama) saved with its tokenizer and CLIP image processor, against transformers'
LlavaForConditionalGeneration in float32: the image features (both feature strategies, and the
checkpoint layouts), and the engine end to end: a batch mixing image and text-only requests
gives transformers' greedy tokens, and a repeated image is served from the prefix cache."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from core.engine.model_loader.loader import iter_weights
from core.interfaces import ModelContext
from core.testing.suite import reference
from core_plugins.models.llava import LlavaForConditionalGeneration as Ours
from core_plugins.multimodal.llava import LlavaInputProcessor
from tests.conftest import TINY_VOCAB, assert_pool_free, char_tokenizer, greedy, make_engine
from tests.test_vlm_engine import hf_generate, picture

ARCH = "LlavaForConditionalGeneration"
IMAGE = TINY_VOCAB  # the <image> special token, right after the char tokenizer's vocabulary
SIZE, PATCH = 56, 14
TOKENS = (SIZE // PATCH) ** 2  # 16 image tokens (the class token dropped)
CPU = torch.device("cpu")
ATOL = 1e-4
N_NEW = 6


def tokenizer():
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == IMAGE
    return tok


def tiny_config(**overrides):
    from transformers import LlavaConfig

    text = dict(model_type="llama", vocab_size=IMAGE + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25,
                bos_token_id=1, eos_token_id=2)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=SIZE, patch_size=PATCH, projection_dim=32, initializer_range=0.2)
    opts = dict(text_config=text, vision_config=vision, image_token_index=IMAGE, projector_hidden_act="gelu",
                architectures=[ARCH])
    return LlavaConfig(**{**opts, **overrides})


def image_processor():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(folder, transformers model, tokenizer): the tiny random LLaVA, its tokenizer and image processor."""
    from transformers import LlavaForConditionalGeneration

    path = tmp_path_factory.mktemp("tiny-llava")
    torch.manual_seed(0)
    hf = LlavaForConditionalGeneration(tiny_config()).float().eval()
    hf.set_attn_implementation("eager")
    hf.save_pretrained(path)
    tok = tokenizer()
    tok.save_pretrained(path)
    image_processor().save_pretrained(path)
    return path, hf, tok


def ours_from(path, config) -> Ours:
    model = Ours(config, ModelContext(torch.float32, CPU, reference("quant_method", "none")()))
    model.load_weights(iter_weights(path))
    return model.eval()


def pixels(*pics: Image.Image) -> torch.Tensor:
    return image_processor()(images=list(pics), return_tensors="pt")["pixel_values"]


@torch.inference_mode()
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_encode_images_matches_get_image_features(llava, strategy):
    path, hf, _ = llava
    ours = ours_from(path, tiny_config(vision_feature_select_strategy=strategy))
    assert ours.image_token_id == IMAGE and ours.tokens_per_image == TOKENS + (strategy == "full")
    pv = pixels(picture(60, 40, 1), picture(30, 90, 2))
    assert pv.shape == (2, 3, SIZE, SIZE)
    want = torch.cat(hf.model.get_image_features(pv, vision_feature_select_strategy=strategy).pooler_output)
    got = ours.encode_images(pv, None)
    assert got.shape == (2 * ours.tokens_per_image, 64)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert len(ours.vision_tower.encoder.layers) == 1  # feature layer -2 of 2: the last layer never runs


def test_loads_the_other_checkpoint_layouts(llava):
    """transformers' in-memory names and the original LLaVA-HF layout load the same weights."""
    path, _, _ = llava
    mine = ours_from(path, tiny_config()).state_dict()
    layouts = [
        {"vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector.",
         "language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head."},
        {"vision_tower.": "vision_tower.vision_model."},
    ]
    for nested in layouts:
        def renamed(name: str) -> str:
            return next((new + name[len(old):] for old, new in nested.items() if name.startswith(old)), name)

        other = Ours(tiny_config(), ModelContext(torch.float32, CPU, reference("quant_method", "none")()))
        other.load_weights((renamed(n), t) for n, t in iter_weights(path))
        assert all(torch.equal(t, mine[n]) for n, t in other.state_dict().items())


def test_processor_expands_each_placeholder(llava):
    path, hf, tok = llava
    proc = LlavaInputProcessor(str(path), hf.config, tok)
    a, b = picture(60, 40, 1), picture(30, 90, 2)
    out = proc.process("x <image> y <image>", [a, b])
    ids = tok.encode("x ")
    assert out.spans == [(len(ids), TOKENS), (len(ids) + TOKENS + 3, TOKENS)]
    assert out.input_ids.count(IMAGE) == 2 * TOKENS and out.image_grid_thw is None
    assert torch.equal(out.pixel_values, pixels(a, b)) and len(set(out.hashes)) == 2


def hf_greedy(llava, text: str, images: list[Image.Image], n: int = N_NEW) -> list[int]:
    """transformers' greedy tokens for ``text`` (one ``<image>`` per image, expanded here)."""
    _, hf, tok = llava
    ids = tok.encode(text)
    kw = {}
    if images:
        ids = [x for t in ids for x in ([IMAGE] * TOKENS if t == IMAGE else [t])]
        kw = {"pixel_values": pixels(*images)}
    return hf_generate(hf, ids, n, **kw)


@pytest.fixture(scope="module")
def eng(llava):
    e = make_engine(llava[0], max_total_tokens=2048)
    yield e
    e.shutdown()


def test_images_and_text_in_one_batch_match_transformers(llava, eng):
    mm = eng.engine.multimodal
    assert mm is not None and not mm.mrope
    a, b, c = picture(60, 40, 1), picture(30, 90, 2), picture(50, 50, 3)
    texts = ["look <image> here", "two <image> and <image>!", "no picture at all", "<image>"]
    images = [[a], [b, c], None, [c]]
    outs = eng.generate(texts, greedy(N_NEW), image_data=images)
    for t, im, out in zip(texts, images, outs):
        assert out["output_ids"] == hf_greedy(llava, t, im or []), t
    assert_pool_free(eng)


def test_a_repeated_image_is_cached_and_another_image_is_not(llava, eng):
    text = "cache <image> me please"
    a, b = picture(56, 56, 10), picture(56, 56, 11)
    first = eng.generate(text, greedy(N_NEW), image_data=a)
    again = eng.generate(text, greedy(N_NEW), image_data=a)
    other = eng.generate(text, greedy(N_NEW), image_data=b)
    n = first["meta_info"]["prompt_tokens"]
    assert again["meta_info"]["cached_tokens"] == n - 1 and again["output_ids"] == first["output_ids"]
    assert other["meta_info"]["cached_tokens"] <= len(llava[2].encode("cache "))
    assert first["output_ids"] == hf_greedy(llava, text, [a])
    assert other["output_ids"] == hf_greedy(llava, text, [b])


def test_decode_step_leaves_batches_with_image_rows_to_the_forward(llava):
    path, _, _ = llava
    ours = ours_from(path, tiny_config())

    class Inputs:
        mm_rows = torch.tensor([0])

    assert ours.decode_step(Inputs(), None) is None
