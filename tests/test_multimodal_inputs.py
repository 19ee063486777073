"""Image inputs (issue 45): decoding SGLang's and OpenAI's image forms under the server's media
policy, content hashes, the built-in Qwen2-VL processor against transformers' own, and the HTTP /
offline request surface over a stand-in engine (no model runs here)."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from core.engine.multimodal import ImageInputs
from core.engine.multimodal.images import MediaPolicy, image_hash, images_per_prompt, load_image
from core.errors import InvalidRequest
from tests.conftest import char_tokenizer

SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# Qwen2-VL's chat template (its image branch), enough for the placeholders
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _img(w: int = 40, h: int = 30, seed: int = 0, mode: str = "RGB") -> Image.Image:
    arr = np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def _png(img: Image.Image | None = None, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    (img or _img()).save(buf, format=fmt)
    return buf.getvalue()


def _load(item: Any, **kw: Any) -> Image.Image:
    return load_image(item, **{"allow_local": False, "allow_url": False, "timeout": 2.0, "max_bytes": 1 << 20, **kw})


def _same(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and a.mode == b.mode and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- load_image
def test_each_form_decodes_to_the_same_rgb_image(tmp_path) -> None:
    ref = _img()
    raw = _png(ref)
    b64 = base64.b64encode(raw).decode()
    path = tmp_path / "cat.png"
    path.write_bytes(raw)
    forms = [raw, bytearray(raw), b64, f"data:image/png;base64,{b64}", f"  data:image/png;base64,{b64}\n",
             base64.urlsafe_b64encode(raw).decode().rstrip("=")]
    for form in forms:
        assert _same(_load(form), ref), type(form)
    assert _same(_load(str(path), allow_local=True), ref)
    assert _same(_load(f"file://{path}", allow_local=True), ref)
    assert _same(_load(str(path), allow_local=True, local_root=str(tmp_path)), ref)
    # a JPEG's base64 starts with "/9j/": base64, not a path
    jpeg = base64.b64encode(_png(ref, "JPEG")).decode()
    assert jpeg.startswith("/9j/") and _load(jpeg).size == ref.size
    # other modes are converted to RGB; a PIL image passes through
    for mode in ("RGBA", "L", "P", "CMYK"):
        out = _load(_png(_img(mode=mode)) if mode != "CMYK" else _png(_img(mode=mode), "JPEG"))
        assert out.mode == "RGB" and out.size == ref.size
    assert _same(_load(ref), ref) and _load(_img(mode="L")).mode == "RGB"


@pytest.mark.parametrize("item,kw,words", [
    ("data:image/png;base64,AAAA", {}, "could not be decoded"),
    (b"not an image at all", {}, "could not be decoded"),
    (b"", {}, "empty"),
    ("", {}, "empty string"),
    ("data:image/png,rawtext", {}, "must be base64-encoded"),
    ("@@@not base64@@@", {}, "neither|none of them"),
    ("http://127.0.0.1:9/x.png", {}, "image URLs are not fetched"),
    ("ftp://host/x.png", {}, "unsupported image URL scheme 'ftp'"),
    ("/tmp/x.png", {}, "local image paths are disabled: start the server with --allowed-local-media-path"),
    ("file:///tmp/x.png", {}, "--allowed-local-media-path"),
    ("/no/such/file.png", {"allow_local": True}, "image file not found"),
    ("/etc/hostname.png", {"allow_local": True, "local_root": "/srv/media"}, "outside --allowed-local-media-path"),
    (12, {}, "must be a string"),
])
def test_each_error_is_a_400_naming_the_problem(item, kw, words) -> None:
    with pytest.raises(InvalidRequest, match=words) as e:
        _load(item, **kw)
    assert e.value.param == "image_data"


def test_size_and_pixel_limits() -> None:
    raw = _png(_img(64, 64))
    with pytest.raises(InvalidRequest, match=rf"too large: {len(raw)} bytes, the limit is 100 bytes"):
        _load(raw, max_bytes=100)
    with pytest.raises(InvalidRequest, match=r"too many pixels: 64x64 = 4096, more than the limit of 1000 pixels"):
        _load(raw, max_pixels=1000)
    with pytest.raises(InvalidRequest, match="more than the limit of 1000 pixels"):
        _load(_img(64, 64), max_pixels=1000)
    assert _load(raw, max_pixels=4096).size == (64, 64)
    policy = MediaPolicy(max_images=1)
    from core.engine.multimodal.images import load_images

    with pytest.raises(InvalidRequest, match=r"2 images, more than the limit of 1 per request \(--limit-mm-data"):
        load_images([raw, raw], policy)


def test_offline_refuses_urls_and_the_policy_follows_sglang_flags(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = MediaPolicy.from_args(SimpleNamespace())
    assert not p.allow_url and not p.allow_local and p.max_bytes == 64 << 20 and p.max_images is None
    with pytest.raises(InvalidRequest, match=r"started offline \(HF_HUB_OFFLINE"):
        _load("https://example.com/a.png", allow_url=p.allow_url)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    p = MediaPolicy.from_args(SimpleNamespace(allowed_media_domains=["Example.COM."], media_url_max_file_size_mb=2,
                                              limit_mm_data_per_request='{"image": 3}',
                                              allowed_local_media_path=str(tmp_path)))
    assert p.allow_url and p.allow_local and p.local_root == str(tmp_path.resolve())
    assert p.allowed_domains == ("example.com",) and p.max_bytes == 2 << 20 and p.max_images == 3
    with pytest.raises(InvalidRequest, match=r"host 'other.org' is not in --allowed-media-domains \(example.com\)"):
        _load("http://other.org/a.png", allow_url=True, allowed_domains=p.allowed_domains)


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict, bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, headers, body = self.routes.get(self.path, (404, {}, b"missing"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: Any) -> None:
        pass


def test_url_fetch_from_a_local_server() -> None:
    ref = _img()
    _Handler.routes = {"/a.png": (200, {"Content-Type": "image/png"}, _png(ref)),
                       "/moved": (302, {"Location": "/a.png"}, b""),
                       "/big": (200, {}, b"x" * 5000),
                       "/junk": (200, {}, b"not an image")}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert _same(_load(f"{base}/a.png", allow_url=True), ref)
        assert _same(_load(f"{base}/moved", allow_url=True), ref)  # a redirect is followed
        assert _same(_load(f"{base}/a.png", allow_url=True, allowed_domains=("127.0.0.1",)), ref)
        for path, kw, words in (("/nope", {}, "HTTP 404"), ("/big", {"max_bytes": 1000}, "too large: 5000 bytes"),
                                ("/junk", {}, "could not be decoded")):
            with pytest.raises(InvalidRequest, match=words):
                _load(base + path, allow_url=True, **kw)
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(InvalidRequest, match="fetching the image URL .* failed"):  # the server is gone
        _load(f"{base}/a.png", allow_url=True)


def test_image_hash_follows_the_pixels() -> None:
    a = _img()
    assert image_hash(a) == image_hash(_img()) == image_hash(_load(_png(a)))
    assert 0 <= image_hash(a) < 1 << 64
    b = a.copy()
    b.putpixel((3, 4), tuple((v + 1) % 256 for v in b.getpixel((3, 4))))
    assert image_hash(b) != image_hash(a)
    assert image_hash(_img(30, 40)) != image_hash(_img(40, 30))  # same byte count, another size


def test_cache_keys_keep_adapters_and_images_apart() -> None:
    """An adapter's keys of an image's tokens are neither the base model's keys of that image nor,
    as an OR of the adapter's tag would have made them, the base model's keys of another image
    whose hash differs in the tag's bits; every key stays a signed 64-bit int (storage hashes them so)."""
    from core.engine.request import Req
    from core.engine.sampling_params import SamplingParams

    h = 0x1234_5678_9A
    def req(hash_: int, lora: int) -> Req:
        mm = ImageInputs([5, 7, 7, 7, 9], torch.zeros(1), None, [(1, 3)], [hash_])
        return Req("r", mm.input_ids, SamplingParams(), lora_id=lora, mm=mm)

    base, lora = req(h, 0).cache_ids(), req(h, 1).cache_ids()
    other = req(h | 1 << 12, 0).cache_ids()  # (bit 12 of the hash is bit 32 of a key: the uid-1 tag's)
    assert base[0] == 5 and lora[0] == 1 << 32 | 5 and lora[4] == 1 << 32 | 9  # text tokens: the tag
    assert not set(lora[1:4]) & (set(base[1:4]) | set(other[1:4]))
    assert req(h, 2).cache_ids()[1:4] != lora[1:4]
    assert all(0 <= k < 1 << 63 for k in base + lora + other)


def test_image_data_forms_per_prompt() -> None:
    assert images_per_prompt(None, 2, True) == [[], []]
    assert images_per_prompt([], 1, False) == [[]]
    assert images_per_prompt("a", 1, False) == [["a"]]
    assert images_per_prompt(["a", "b"], 1, False) == [["a", "b"]]  # one prompt's images
    assert images_per_prompt("a", 2, True) == [["a"], ["a"]]
    assert images_per_prompt(["a", "b"], 2, True) == [["a"], ["b"]]  # one per prompt
    assert images_per_prompt([["a", "b"], None, "c", []], 4, True) == [["a", "b"], [], ["c"], []]
    with pytest.raises(InvalidRequest, match="image_data has 3 entries but there are 2 prompts"):
        images_per_prompt(["a", "b", "c"], 2, True)


# ----------------------------------------------------------------------------- the Qwen2-VL processor
def _tokenizer(template: str | None = TEMPLATE):
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL + ["<|im_start|>", "<|im_end|>"]})
    if template is not None:
        tok.chat_template = template
    return tok


def _image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56 * 2)


def _hf_processor(tok):
    """transformers' Qwen2VLProcessor, built without a video processor (which needs torchvision)."""
    from transformers import Qwen2VLProcessor

    class ImagesOnly(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ImagesOnly(image_processor=_image_processor(), tokenizer=tok)


@pytest.fixture(scope="module")
def qwen():
    from core_plugins.multimodal.qwen2_vl import Qwen2VLInputProcessor

    tok = _tokenizer()
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    proc = Qwen2VLInputProcessor("/nonexistent", SimpleNamespace(image_token_id=pad), tok,
                                 image_processor=_image_processor())
    return SimpleNamespace(tok=tok, pad=pad, proc=proc, hf=_hf_processor(tok))


@pytest.mark.parametrize("sizes", [[(40, 30)], [(70, 45), (28, 90)]])
def test_qwen2_vl_matches_transformers(qwen, sizes) -> None:
    images = [_img(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    text = "Look: " + " and ".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in images) + " ok?"
    ref = qwen.hf(text=[text], images=images, return_tensors="pt")
    ref_ids = ref["input_ids"][0].tolist()
    from_ids = qwen.tok.encode(text, add_special_tokens=True)
    assert from_ids.count(qwen.pad) == len(images)
    for prompt in (text, from_ids):
        out = qwen.proc.process(prompt, images)
        assert isinstance(out, ImageInputs)
        assert out.input_ids == ref_ids
        assert torch.equal(out.pixel_values, ref["pixel_values"])
        assert torch.equal(out.image_grid_thw, ref["image_grid_thw"]) and out.image_grid_thw.dtype == torch.int64
        assert out.hashes == [image_hash(i) for i in images]
        assert out.mrope_positions is None
        counts = (ref["image_grid_thw"].prod(-1) // 4).tolist()
        assert [n for _, n in out.spans] == counts
        for (start, n) in out.spans:
            assert out.input_ids[start - 1] == qwen.tok.convert_tokens_to_ids("<|vision_start|>")
            assert set(out.input_ids[start:start + n]) == {qwen.pad}
            assert out.input_ids[start + n] == qwen.tok.convert_tokens_to_ids("<|vision_end|>")
    assert qwen.proc.image_token_id == qwen.pad and qwen.proc.max_images is None


def test_qwen2_vl_counts_must_match(qwen) -> None:
    one = "a <|vision_start|><|image_pad|><|vision_end|> b"
    with pytest.raises(InvalidRequest, match="the prompt has 1 image placeholder but 2 images were sent"):
        qwen.proc.process(one, [_img(), _img(seed=1)])
    with pytest.raises(InvalidRequest, match="the prompt has 2 image placeholders but 1 image was sent"):
        qwen.proc.process(qwen.tok.encode(one + one), [_img()])
    with pytest.raises(InvalidRequest, match="0 image placeholders but 1 image was sent"):
        qwen.proc.process("no placeholder", [_img()])


def test_qwen2_vl_registration_and_token_check() -> None:
    from core.errors import ModelLoadError
    from core_plugins.multimodal import qwen2_vl

    names = []
    qwen2_vl.register_multimodal_processors(lambda name, target: names.append((name, target)))
    assert [n for n, _ in names] == ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"]
    tok = _tokenizer()
    with pytest.raises(ModelLoadError, match="image_token_id 7"):
        qwen2_vl.Qwen2VLInputProcessor("/x", SimpleNamespace(image_token_id=7), tok, image_processor=_image_processor())
    from core import plugins

    assert plugins.REQUIRED_METHODS["multimodal_processor"] == ("process",)
    assert plugins._missing_methods("multimodal_processor", qwen2_vl.Qwen2VLInputProcessor) == []


# ----------------------------------------------------------------------------- the HTTP surface
class FakeEngine:
    """What the request builders use of ``AsyncEngine``; ``make_requests`` records the images."""

    def __init__(self, multimodal: Any = None, tokenizer: Any = None) -> None:
        self.args = SimpleNamespace(enable_lora=False, is_embedding=False)
        self.multimodal = multimodal
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(context_len=4000, source="/models/vl")
        self.max_total_tokens = 100_000
        self.vocab_size = 300
        self.plugins = None  # (no parsers configured)

    def lora_adapters(self) -> dict[str, str]:
        return {}

    def tokenize(self, prompt: Any, input_ids: Any) -> list[int]:
        return list(input_ids) if input_ids is not None else self.tokenizer.encode(prompt)

    def make_requests(self, ids, params, rid=None, *args: Any, images: list | None = None, **kw: Any) -> list:
        return [SimpleNamespace(rid=rid, prompt_ids=ids, images=images, log_metrics=True)]


def _state(engine: FakeEngine, **args: Any):
    from core.server.args import ServerArgs
    from core.server.metrics import Metrics
    from core.server.state import ServerState

    return ServerState(engine=engine, args=ServerArgs(**args), metrics=Metrics("test", enabled=False),  # type: ignore[arg-type]
                       served_model_name="vl-model")


def _generate(state, **body: Any) -> list:
    from core.server.native import GenerateReqInput, build_generate_requests

    reqs, _, _ = build_generate_requests(state, msgspec.convert(body, GenerateReqInput))
    return [r.images for r in reqs]


def _sizes(images: list | None) -> list | None:
    return None if images is None else [im.size for im in images]


def test_generate_image_data_forms() -> None:
    st = _state(FakeEngine(multimodal=SimpleNamespace(max_images=None), tokenizer=_tokenizer()))
    a, b = _png(_img(20, 10)), _png(_img(10, 20))
    ua, ub = base64.b64encode(a).decode(), f"data:image/png;base64,{base64.b64encode(b).decode()}"
    assert _generate(st, input_ids=[1, 2]) == [None]
    assert [_sizes(x) for x in _generate(st, input_ids=[1, 2], image_data=ua)] == [[(20, 10)]]
    assert [_sizes(x) for x in _generate(st, text="x", image_data=[ua, ub], modalities=["multi-images"])] == [
        [(20, 10), (10, 20)]]
    assert [_sizes(x) for x in _generate(st, text=["x", "y"], image_data=[ua, ub])] == [[(20, 10)], [(10, 20)]]
    assert [_sizes(x) for x in _generate(st, text=["x", "y", "z"], image_data=[[ua, ub], None, []])] == [
        [(20, 10), (10, 20)], None, None]
    assert [_sizes(x) for x in _generate(st, text=["x", "y"], image_data=ua)] == [[(20, 10)], [(20, 10)]]
    for body, param, words in (
            (dict(text=["x", "y"], image_data=[ua]), "image_data", "1 entries but there are 2 prompts"),
            (dict(text=["x", "y"], image_data=[ua, "AAAA"]), "image_data[1]", "could not be decoded"),
            (dict(text="x", image_data="/etc/passwd"), "image_data", "--allowed-local-media-path"),
            (dict(text="x", image_data=ua, modalities=["video"]), "modalities", "modality 'video'"),
            (dict(text="x", video_data="v.mp4"), "video_data", "not supported")):
        with pytest.raises(InvalidRequest, match=words) as e:
            _generate(st, **body)
        assert e.value.param == param
    limited = _state(FakeEngine(multimodal=SimpleNamespace(max_images=1), tokenizer=_tokenizer()))
    with pytest.raises(InvalidRequest, match="more than the limit of 1 per request"):
        _generate(limited, text="x", image_data=[ua, ua])
    text_only = _state(FakeEngine(tokenizer=_tokenizer()))
    assert _generate(text_only, text="x", image_data=[]) == [None]
    with pytest.raises(InvalidRequest, match="image_data was sent, but the model 'vl-model' is text-only") as e:
        _generate(text_only, text="x", image_data=ua)
    assert e.value.param == "image_data"


def _chat(state, messages: list) -> list:
    from core.server.openai.chat import prepare_chat
    from core.server.openai.protocol import ChatCompletionRequest

    r = msgspec.convert({"model": "m", "messages": messages, "max_tokens": 4}, ChatCompletionRequest)
    return prepare_chat(state, r).reqs


def test_chat_image_parts_reach_the_template_and_the_engine(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is fetched
    tok = _tokenizer()
    st = _state(FakeEngine(multimodal=SimpleNamespace(max_images=None), tokenizer=tok))
    url = f"data:image/png;base64,{base64.b64encode(_png(_img(20, 10))).decode()}"
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
        {"type": "image_url", "image_url": url}, {"type": "text", "text": "?"}]}]
    (req,) = _chat(st, messages)
    assert _sizes(req.images) == [(20, 10), (20, 10)]
    text = tok.decode(req.prompt_ids)
    assert "<|im_start|>user\nwhat<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|>" in text
    assert text.endswith("?<|im_end|>\n<|im_start|>assistant\n")
    (plain,) = _chat(st, [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert plain.images is None and tok.decode(plain.prompt_ids).startswith("<|im_start|>user\na\nb<|im_end|>")
    bad = [({"type": "image_url", "image_url": {"url": url, "detail": "huge"}}, "detail must be one of"),
           ({"type": "image_url", "image_url": {}}, "must be an object with a 'url' string"),
           ({"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}, "started offline"),
           ({"type": "input_audio", "input_audio": {}}, "only 'text' and 'image_url' content parts")]
    for part, words in bad:
        with pytest.raises(InvalidRequest, match=words):
            _chat(st, [{"role": "user", "content": [part]}])
    text_only = _state(FakeEngine(tokenizer=tok))
    with pytest.raises(InvalidRequest, match="has type 'image_url', but this model is text-only"):
        _chat(text_only, messages)


def test_offline_engine_decodes_image_data(monkeypatch) -> None:
    from core.engine import offline

    seen = {}

    from core.engine.frontend import RequestFrontEnd

    class Inner:
        tokenizer = None
        args = SimpleNamespace()  # (no media flags: SGLang's defaults)
        offline_media_policy = RequestFrontEnd.offline_media_policy  # the engine's, which the offline Engine uses

        async def generate(self, *a: Any, **kw: Any) -> dict:
            seen.update(kw)
            return {"text": "ok"}

    eng = offline.Engine.__new__(offline.Engine)
    import asyncio

    eng._loop = asyncio.new_event_loop()
    threading.Thread(target=eng._loop.run_forever, daemon=True).start()
    eng.engine = Inner()
    try:
        assert eng.generate("x") == {"text": "ok"} and "image_data" not in seen
        raw = _png(_img(12, 8))
        eng.generate("x", image_data=raw)
        assert [im.size for im in seen["image_data"]] == [(12, 8)]
        eng.generate(["x", "y"], image_data=[[raw, _img(5, 6)], None])
        assert [[im.size for im in ims] for ims in seen["image_data"]] == [[(12, 8), (5, 6)], []]
        asyncio.run(eng.async_generate(input_ids=[[1], [2]], image_data=[raw, raw]))
        assert [len(ims) for ims in seen["image_data"]] == [1, 1]
    finally:
        eng._loop.call_soon_threadsafe(eng._loop.stop)


def test_http_refusals_from_a_text_only_model() -> None:
    """Bodies with images are built on a worker thread; a text-only model answers 400 naming it."""
    import asyncio

    import httpx

    from core.server.app import build_app

    state = _state(FakeEngine(tokenizer=_tokenizer()))
    url = f"data:image/png;base64,{base64.b64encode(_png()).decode()}"

    async def run() -> list:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            gen = await c.post("/generate", json={"text": "x", "image_data": url})
            chat = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}]})
            return [gen, chat]

    gen, chat = asyncio.run(run())
    assert gen.status_code == 400 and gen.json()["error"]["param"] == "image_data", gen.text
    assert "text-only" in gen.json()["error"]["message"]
    assert chat.status_code == 400 and "text-only" in chat.json()["error"]["message"], chat.text


def test_url_fetch_times_out() -> None:
    import time

    class Slow(_Handler):
        def do_GET(self) -> None:  # noqa: N802
            time.sleep(1.0)
            try:
                super().do_GET()
            except OSError:  # the client gave up
                pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(InvalidRequest, match="timed out after 0.3 s"):
            _load(f"http://127.0.0.1:{server.server_address[1]}/a.png", allow_url=True, timeout=0.3)
    finally:
        server.shutdown()
        server.server_close()
