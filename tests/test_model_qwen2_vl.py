"""Qwen2-VL (issue 45): our model plugin, built through the engine's model-building path from a
tiny random checkpoint, against transformers' Qwen2VLForConditionalGeneration in float32: the
vision tower's output, the M-RoPE positions, and a prompt with two images prefilled in one
forward (image embeddings spliced in, three position rows) then decoded greedily."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.engine.config import EngineArgs
from core.engine.model_loader.loader import iter_weights, load_model_config
from core.engine.mem_cache.kv_cache import allocate_kv_cache
from core.engine.model_loader.model_build import build_model
from core.interfaces import AttentionConfig, ForwardBatch, ModelContext
from core.plugins import load_plugins
from core_plugins.attention.torch_native import TorchNativeBackend
from core_plugins.models.qwen2_vl import Qwen2VLForConditionalGeneration as Ours

ARCH = "Qwen2VLForConditionalGeneration"
VSTART, VEND, IMAGE, VIDEO = 288, 289, 290, 291
CPU = torch.device("cpu")
ATOL = 1e-4


def tiny_config():
    from transformers import Qwen2VLConfig

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25, bos_token_id=1,
                eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 3, 3]})  # head_dim 16: 8 pairs
    vision = dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, patch_size=14, spatial_merge_size=2,
                  in_channels=3, temporal_patch_size=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                         vision_start_token_id=VSTART, vision_end_token_id=VEND, architectures=[ARCH])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    path = tmp_path_factory.mktemp("qwen2-vl")
    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration(tiny_config()).float().eval()
    hf.set_attn_implementation("eager")  # the plain reference definition
    hf.save_pretrained(path)
    return path, hf


def build_ours(path, arch: str = ARCH):
    """Our model of the checkpoint at ``path``, through the engine's model-building path."""
    mc = load_model_config(str(path), "float32", CPU, None)
    assert mc.architecture == arch
    return build_model(load_plugins(), EngineArgs(model_path=str(path), dtype="float32"), mc, CPU)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return build_ours(checkpoint[0])


@pytest.fixture(scope="module")
def images():
    """(pixel_values, image_grid_thw) of two random images of different sizes, from transformers' processor."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    pics = [Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (120, 50, 3), dtype=np.uint8))]
    out = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16)(images=pics, return_tensors="pt")
    pixels, grid = out["pixel_values"], out["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6], [1, 8, 4]]  # 6 and 8 tokens: different sizes and aspect ratios
    return pixels, grid


def prompt(grid: torch.Tensor) -> list[int]:
    """Text, image 1, text, image 2, text (each image between its start and end tokens)."""
    n1, n2 = (grid.prod(-1) // 4).tolist()
    return [1, 5, 6, VSTART] + [IMAGE] * n1 + [VEND, 7, 8, 9, 10, VSTART] + [IMAGE] * n2 + [VEND, 11, 12, 13]


def hf_inputs(ids: list[int], pixels: torch.Tensor, grid: torch.Tensor) -> dict:
    ids_t = torch.tensor([ids])
    return dict(input_ids=ids_t, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids_t == IMAGE).int())


def test_registered_and_built_through_the_engine(ours):
    assert ARCH in load_plugins().names("model")
    assert isinstance(ours, Ours) and ours.image_token_id == IMAGE
    assert ours.config.num_hidden_layers == 2 and ours.vision_config.depth == 2


@torch.inference_mode()
def check_encode_images(ours, hf, pixels: torch.Tensor, grid: torch.Tensor) -> None:
    """Our tower's embeddings of the two test images equal transformers', alone and together."""
    want = torch.cat(hf.model.get_image_features(pixels, grid).pooler_output)
    got = ours.encode_images(pixels, grid)
    assert got.shape == (6 + 8, 64)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    first = pixels[: int(grid[0].prod())]  # one image alone: the same rows (attention stays within an image)
    torch.testing.assert_close(ours.encode_images(first, grid[:1]), want[:6], atol=ATOL, rtol=0)


def check_mrope_positions(ours, hf, grid: torch.Tensor) -> None:
    """Our M-RoPE positions (and decode delta) of the two-image prompt are transformers' get_rope_index."""
    ids = prompt(grid)
    inputs = hf_inputs(ids, None, grid)
    want, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], grid)
    got, got_delta = ours.mrope_positions(ids, grid)
    assert got.dtype == torch.int64 and got.shape == (3, len(ids))
    assert torch.equal(got, want[:, 0]) and got_delta == int(delta) < 0


def test_encode_images_matches_the_vision_tower(ours, checkpoint, images):
    check_encode_images(ours, checkpoint[1], *images)


def test_mrope_positions_match_get_rope_index(ours, checkpoint, images):
    grid = images[1]
    check_mrope_positions(ours, checkpoint[1], grid)
    text, d = ours.mrope_positions([1, 5, 6], None)  # no image: plain positions
    assert torch.equal(text, torch.arange(3).expand(3, -1)) and d == 0
    with pytest.raises(ValueError, match="image tokens"):
        ours.mrope_positions([1] + [IMAGE] * 5, grid[:1])  # 5 tokens for an image of 6


def batch_for(backend, ids: list[int], start: int, **mm) -> ForwardBatch:
    """The tokens ``ids`` at sequence positions ``start``.. of one sequence (its KV in slots 1..)."""
    end = start + len(ids)
    return ForwardBatch(input_ids=torch.tensor(ids), positions=torch.arange(start, end),
                        out_cache_loc=torch.arange(start + 1, end + 1), seq_lens=torch.tensor([end]),
                        extend_lens=torch.tensor([len(ids)]), kv_indices=torch.arange(1, end + 1)[None],
                        seq_lens_cpu=[end], extend_lens_cpu=[len(ids)], attn_backend=backend, **mm)


def torch_native(ours, slots: int) -> TorchNativeBackend:
    """The reference attention backend over a float32 KV pool of ``slots`` slots for ``ours``."""
    cfg = ours.config
    kv = allocate_kv_cache(cfg.num_hidden_layers, slots, 1, cfg.num_key_value_heads, 16, torch.float32, CPU)
    return TorchNativeBackend(AttentionConfig(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                                              16, torch.float32, CPU, kv))


@torch.inference_mode()
def check_prefill_and_decode(ours, hf, pixels: torch.Tensor, grid: torch.Tensor, steps: int,
                             backend: TorchNativeBackend | None = None, plain_positions: bool = False) -> None:
    """The two-image prompt prefilled in one forward, then ``steps`` greedy decode steps, give
    transformers' logits and tokens. ``plain_positions``: every other decode step passes its
    M-RoPE position (``p + delta`` in all three rows) as plain ``positions`` instead of ``[3, 1]`` rows."""
    ids = prompt(grid)
    backend = backend or torch_native(ours, len(ids) + steps + 1)
    positions, delta = ours.mrope_positions(ids, grid)
    rows = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE])
    fb = batch_for(backend, ids, 0, mm_rows=rows, mm_embeds=ours.encode_images(pixels, grid), mrope_positions=positions)
    backend.prepare(fb)
    logits = [ours.compute_logits(ours(fb))]
    tokens: list[int] = []
    for k in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        p = len(ids) + k
        plain = plain_positions and k % 2 == 1
        mm = {} if plain else {"mrope_positions": torch.full((3, 1), p + delta)}
        fb = batch_for(backend, [tokens[-1]], p, **mm)
        if plain:
            fb.positions = torch.tensor([p + delta])
        backend.prepare(fb)
        logits.append(ours.compute_logits(ours(fb)))
    got = torch.cat(logits)

    want = hf(**hf_inputs(ids, pixels, grid)).logits[0]
    torch.testing.assert_close(got[: len(ids)], want, atol=ATOL, rtol=0)  # the prompt, in one forward
    # the decode steps against transformers' own cached greedy decode (a random model may pick the
    # image token, which a whole-sequence forward would take for an image placeholder)
    gen = hf.generate(**hf_inputs(ids, pixels, grid), max_new_tokens=steps + 1, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    assert gen.sequences[0, len(ids):-1].tolist() == tokens
    torch.testing.assert_close(got[len(ids) - 1:], torch.cat(gen.logits), atol=ATOL, rtol=0)


def test_prefill_with_images_and_greedy_decode_match_transformers(ours, checkpoint, images):
    steps = 6
    backend = torch_native(ours, len(prompt(images[1])) + steps + 1)
    assert ours.decode_step(None, backend) is None and ours.model._cpu_stack(backend, ours.lm_head) is None
    assert all(layer._cpu_decode(backend) is None for layer in ours.model.layers)  # no one-op layers
    check_prefill_and_decode(ours, checkpoint[1], *images, steps, backend, plain_positions=True)


def test_text_only_prompt_matches_transformers(ours, checkpoint):
    """No image: ``positions`` rotates all three rows, as transformers' positions for plain text."""
    _, hf = checkpoint
    ids = [1, 17, 40, 99, 3, 250, 8, 8, 120]
    kv = allocate_kv_cache(2, len(ids) + 1, 1, 2, 16, torch.float32, CPU)
    backend = TorchNativeBackend(AttentionConfig(2, 4, 2, 16, torch.float32, CPU, kv))
    fb = batch_for(backend, ids, 0)
    backend.prepare(fb)
    with torch.inference_mode():
        got = ours.compute_logits(ours(fb))
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_loads_the_nested_checkpoint_layout(ours, checkpoint):
    """``model.visual.*`` / ``model.language_model.*`` (transformers' in-memory names) load the same."""
    path, _ = checkpoint
    nested = {"visual.": "model.visual.", "model.": "model.language_model."}

    def renamed(name: str) -> str:
        return next((new + name[len(old):] for old, new in nested.items() if name.startswith(old)), name)

    from core.testing.suite import reference

    other = Ours(tiny_config(), ModelContext(torch.float32, CPU, reference("quant_method", "none")()))
    other.load_weights((renamed(n), t) for n, t in iter_weights(path))
    mine = ours.state_dict()
    assert all(torch.equal(t, mine[n]) for n, t in other.state_dict().items())
