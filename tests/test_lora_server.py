"""Multi-LoRA serving's HTTP and offline surface (issue 44): ``lora_path`` on /generate and on the
OpenAI endpoints, ``model`` naming an adapter (``base:adapter`` or its own name), /v1/models,
``/load_lora_adapter`` / ``/unload_lora_adapter`` and the offline ``Engine``'s methods.

The first part runs in-process over a stand-in engine (request parsing, name resolution, the
endpoints' bodies and errors); the second serves a tiny random Llama with random peft adapters
(``init_lora_weights=False``) through ``core serve --enable-lora --lora-paths`` and the offline
``Engine``, so it needs the engine side of LoRA serving."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from core.errors import CoreError, InvalidRequest
from tests.conftest import assert_greedy_matches, build_tiny_llama, greedy

SERVED = "base-model"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [1] + [5 + (i * 7) % 90 for i in range(11)]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


# ----------------------------------------------------------------------------- a stand-in engine
class FakeEngine:
    """What the LoRA handlers use of ``AsyncEngine``: the adapter registry, and ``make_requests``
    recording each request's adapter."""

    def __init__(self, enable_lora: bool = True, adapters: dict[str, str] | None = None) -> None:
        self.args = SimpleNamespace(enable_lora=enable_lora, is_embedding=False)
        self.adapters = dict(adapters or {})
        self.tokenizer = None
        self.model_config = SimpleNamespace(context_len=100, source="/models/base")
        self.max_total_tokens = 10_000

    def lora_adapters(self) -> dict[str, str]:
        return dict(self.adapters) if self.args.enable_lora else {}

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        if not self.args.enable_lora:
            raise InvalidRequest("LoRA adapters need a server started with --enable-lora", param="lora_name")
        if name in self.adapters:
            raise CoreError(f"LoRA adapter {name!r} is already loaded")
        if "bad" in path:
            raise CoreError(f"LoRA adapter {name!r}: {path!r} is not a folder")
        self.adapters[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise CoreError(f"LoRA adapter {name!r} is not loaded")
        del self.adapters[name]

    def tokenize(self, prompt: Any, input_ids: Any) -> list[int]:
        return list(input_ids) if input_ids is not None else [ord(c) for c in prompt]

    def make_requests(self, ids, params, rid=None, *args: Any, lora_path: str | None = None, **kw: Any) -> list:
        return [SimpleNamespace(rid=rid, prompt_ids=ids, lora_path=lora_path)]


def _state(engine: FakeEngine | None = None, **args: Any):
    from core.server.args import ServerArgs
    from core.server.metrics import Metrics
    from core.server.state import ServerState

    return ServerState(engine=engine or FakeEngine(adapters={"a1": "/ad/a1", "a2": "/ad/a2"}),  # type: ignore[arg-type]
                       args=ServerArgs(**args), metrics=Metrics("test", enabled=False), served_model_name=SERVED)


def _generate(state, **body: Any) -> list:
    import msgspec

    from core.server.native import GenerateReqInput, build_generate_requests

    reqs, _, _ = build_generate_requests(state, msgspec.convert(body, GenerateReqInput))
    return [r.lora_path for r in reqs]


def test_generate_lora_path_string_list_and_batch() -> None:
    st = _state()
    assert _generate(st, input_ids=[1, 2, 3]) == [None]
    assert _generate(st, input_ids=[1, 2, 3], lora_path="a1") == ["a1"]
    assert _generate(st, input_ids=[1, 2, 3], lora_path=["a2"]) == ["a2"]
    assert _generate(st, text=["x", "y", "z"], lora_path="a1") == ["a1"] * 3  # one name for the whole batch
    assert _generate(st, text=["x", "y", "z"], lora_path=["a1", None, "a2"]) == ["a1", None, "a2"]
    assert _generate(st, input_ids=[[1], [2]], lora_path=["", "a2"]) == [None, "a2"]  # "" is the base model
    assert _generate(st, text="x", lora_path="") == [None]
    for bad, words in ((dict(text=["x", "y"], lora_path=["a1"]), "1 entries but there are 2 prompts"),
                       (dict(text="x", lora_path=["a1", "a2"]), "2 entries but there are 1 prompts"),
                       (dict(text="x", lora_path="nope"), "'nope' is not loaded; loaded adapters: a1, a2"),
                       (dict(text=["x", "y"], lora_path=["a1", "nope"]), "'nope' is not loaded")):
        with pytest.raises(InvalidRequest, match=words) as e:
            _generate(st, **bad)
        assert e.value.param == "lora_path"
    off = _state(FakeEngine(enable_lora=False))
    assert _generate(off, text="x", lora_path=None) == [None]
    with pytest.raises(InvalidRequest, match="'a1' was requested, but LoRA is not enabled") as e:
        _generate(off, text="x", lora_path="a1")
    assert e.value.param == "lora_path"
    with pytest.raises(InvalidRequest, match="lora_id is not supported"):  # SGLang's internal id
        _generate(st, text="x", lora_id="1")


def test_model_names_pick_adapters_as_sglang_does() -> None:
    from core.server.lora import request_adapters, split_model

    assert split_model("m", "m") == ("m", None)
    assert split_model("s3://bucket/m", "s3://bucket/m") == ("s3://bucket/m", None)  # the served name, colons and all
    assert split_model("s3://bucket/m:a1", "s3://bucket/m") == ("s3://bucket/m", "a1")
    assert split_model("other:a1", "m") == ("other", "a1")
    assert split_model("m:", "m") == ("m", None)
    st = _state()
    assert request_adapters(st, None, None, 1) == [None]
    assert request_adapters(st, SERVED, None, 1) == [None]
    assert request_adapters(st, "anything-else", None, 1) == [None]  # any model name is accepted, as SGLang does
    assert request_adapters(st, f"{SERVED}:a1", None, 2) == ["a1", "a1"]
    assert request_adapters(st, "a2", None, 1) == ["a2"]  # an adapter's own name
    assert request_adapters(st, "gpt:a2", None, 1) == ["a2"]  # SGLang's split at the first colon
    assert request_adapters(st, SERVED, "a1", 1) == ["a1"]  # the lora_path extension
    assert request_adapters(st, f"{SERVED}:a2", "a1", 1) == ["a2"]  # model wins over lora_path
    assert request_adapters(st, None, ["a1", None], 2) == ["a1", None]
    for model in (f"{SERVED}:nope", "gpt:nope"):
        with pytest.raises(InvalidRequest, match="'nope' is not loaded") as e:
            request_adapters(st, model, None, 1)
        assert e.value.param == "model"
    off = _state(FakeEngine(enable_lora=False))
    assert request_adapters(off, "llama3:8b", None, 1) == [None]  # no LoRA: other names with colons stay names
    with pytest.raises(InvalidRequest, match="LoRA is not enabled") as e:
        request_adapters(off, f"{SERVED}:a1", None, 1)
    assert e.value.param == "model"


def test_completions_prompts_get_their_adapters() -> None:
    import msgspec

    from core.server.openai.completions import prepare_completion
    from core.server.openai.protocol import CompletionRequest

    def adapters(**body: Any) -> list:
        r = msgspec.convert({"max_tokens": 2, **body}, CompletionRequest)
        return [req.lora_path for req in prepare_completion(_state(), r).reqs]

    assert adapters(prompt=[1, 2], model=f"{SERVED}:a1") == ["a1"]
    assert adapters(prompt=[[1, 2], [3, 4]], model="a2") == ["a2", "a2"]
    assert adapters(prompt=[[1, 2], [3, 4]], lora_path=[None, "a1"]) == [None, "a1"]
    with pytest.raises(InvalidRequest, match="2 entries but there are 1 prompts"):
        adapters(prompt=[1, 2], lora_path=["a1", "a2"])


def _asgi(state) -> httpx.AsyncClient:
    from core.server.app import build_app

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://test")


def test_load_unload_and_models_bodies() -> None:
    engine = FakeEngine(adapters={"a1": "/ad/a1"})
    state = _state(engine)

    async def run() -> None:
        async with _asgi(state) as c:
            r = await c.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/ad/a2", "pinned": True})
            assert r.status_code == 200, r.text
            assert r.json() == {"success": True, "error_message": "", "loaded_adapters": {"a1": "/ad/a1", "a2": "/ad/a2"}}
            models = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m["root"], m["parent"], m["max_model_len"]) for m in models] == [
                (SERVED, "/models/base", None, 100), ("a1", "/ad/a1", SERVED, None), ("a2", "/ad/a2", SERVED, None)]
            assert (await c.get("/v1/models/a2")).json()["root"] == "/ad/a2"
            # refusals: SGLang's LoRAUpdateOutput with success false, plus the error object
            r = await c.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/ad/other"})
            assert r.status_code == 400
            body = r.json()
            assert body["success"] is False and "'a2' is already loaded" in body["error_message"]
            assert body["error"]["message"] == body["error_message"] and body["error"]["code"] == 400
            assert body["loaded_adapters"] == {"a1": "/ad/a1", "a2": "/ad/a2"}
            r = await c.post("/load_lora_adapter", json={"lora_name": "a3", "lora_path": "/bad/folder"})
            assert r.status_code == 400 and "not a folder" in r.json()["error_message"]
            r = await c.post("/load_lora_adapter", json={"lora_name": " ", "lora_path": "/ad/x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
            r = await c.post("/load_lora_adapter", json={"lora_name": "a3", "lora_path": "/ad/x", "lora_id": "7"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_id"
            for body in ({"lora_name": "a3"}, {"lora_name": "a3", "lora_path": "/ad/x", "color": "red"}):
                r = await c.post("/load_lora_adapter", json=body)  # malformed: the plain error object
                assert r.status_code == 400 and "success" not in r.json(), r.text
            r = await c.post("/unload_lora_adapter", json={"lora_name": "nope"})
            assert r.status_code == 400 and r.json()["success"] is False and "'nope'" in r.json()["error_message"]
            r = await c.post("/unload_lora_adapter", json={"lora_name": "a1"})
            assert r.json() == {"success": True, "error_message": "", "loaded_adapters": {"a2": "/ad/a2"}}
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [SERVED, "a2"]
            assert (await c.get("/v1/models/a1")).status_code == 404
            assert (await c.get("/load_lora_adapter")).status_code == 405

    asyncio.run(run())


def test_endpoints_without_enable_lora() -> None:
    state = _state(FakeEngine(enable_lora=False))

    async def run() -> None:
        async with _asgi(state) as c:
            for path, body in (("/load_lora_adapter", {"lora_name": "a", "lora_path": "/ad/a"}),
                               ("/unload_lora_adapter", {"lora_name": "a"})):
                r = await c.post(path, json=body)
                assert r.status_code == 400 and r.json()["success"] is False
                assert "--enable-lora" in r.json()["error_message"]
                assert r.json()["loaded_adapters"] == {}
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [SERVED]

    asyncio.run(run())


# ----------------------------------------------------------------------------- a real model (needs the engine side)
def _adapter(base: Path, out: Path, seed: int, rank: int, targets: list[str] = TARGETS) -> Path:
    """A random peft LoRA of the tiny model in ``base`` (non-zero B: it changes the output)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("lora-server")
    build_tiny_llama(root / "base")
    return SimpleNamespace(base=root / "base", a1=_adapter(root / "base", root / "a1", 1, 8),
                           a2=_adapter(root / "base", root / "a2", 2, 4))


@pytest.fixture(scope="module")
def lora_server(lora_model):
    from tests.server_utils import launch, stop

    server = launch("--model-path", str(lora_model.base), "--dtype", "float32", "--skip-server-warmup",
                    "--enable-lora", "--lora-paths", f"a1={lora_model.a1}", "--max-lora-rank", "8",
                    "--chat-template", TEMPLATE, base_args=("--cpu-threads", "1", "--log-level", "warning"))
    try:
        yield server.base_url
    finally:
        stop(server)


def _tokens(http: httpx.Client, lora_path: Any = None, **body: Any) -> Any:
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy(8), "lora_path": lora_path, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


def test_served_adapter_changes_greedy_tokens_and_repeats(lora_server, lora_model) -> None:
    with httpx.Client(base_url=lora_server, timeout=120) as http:
        base, a1, again = _tokens(http), _tokens(http, "a1"), _tokens(http, "a1")
        assert a1 != base and a1 == again
        assert _tokens(http, "") == base
        # a batch mixing the base model and the adapter: each prompt as it runs alone
        assert _tokens(http, [None, "a1", "a1"], input_ids=[PROMPT] * 3) == [base, a1, a1]
        assert _tokens(http, "a1", input_ids=[PROMPT] * 2) == [a1, a1]
        r = http.post("/generate", json={"input_ids": [PROMPT] * 2, "lora_path": ["a1"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        r = http.post("/generate", json={"input_ids": PROMPT, "lora_path": "nope"})
        assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"]
        # OpenAI: model "<served>:a1", the adapter's own name, and the lora_path extension
        served = http.get("/v1/models").json()["data"][0]["id"]
        texts = {}
        for model, extra in ((served, {}), (f"{served}:a1", {}), ("a1", {}), (served, {"lora_path": "a1"})):
            r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            texts[model, bool(extra)] = r.json()["choices"][0]["text"]
        gen = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy(8), "lora_path": "a1"}).json()
        assert texts[f"{served}:a1", False] == texts["a1", False] == texts[served, True] == gen["text"]
        assert texts[served, False] != gen["text"]
        chats = []
        for model in (served, f"{served}:a1", "a1"):
            r = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            chats.append(r.json()["choices"][0]["message"]["content"])
        assert chats[1] == chats[2] != chats[0]
        for model in (f"{served}:nope", "other:nope"):
            r = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "'nope'" in r.json()["error"]["message"]


def test_served_adapters_load_and_unload_at_run_time(lora_server, lora_model) -> None:
    with httpx.Client(base_url=lora_server, timeout=120) as http:
        served = http.get("/v1/models").json()["data"][0]["id"]
        r = http.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(lora_model.a2)})
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "error_message": "",
                            "loaded_adapters": {"a1": str(lora_model.a1), "a2": str(lora_model.a2)}}
        cards = http.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards[1:]] == [
            ("a1", str(lora_model.a1), served), ("a2", str(lora_model.a2), served)]
        base, a1, a2 = _tokens(http), _tokens(http, "a1"), _tokens(http, "a2")
        assert a2 not in (base, a1)
        assert _tokens(http, ["a2", None, "a1"], input_ids=[PROMPT] * 3) == [a2, base, a1]
        r = http.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(lora_model.a2)})
        assert r.status_code == 400 and r.json()["success"] is False and "a2" in r.json()["error_message"]
        r = http.post("/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(lora_model.base / "nope")})
        assert r.status_code == 400 and r.json()["success"] is False and r.json()["error"]["message"]
        r = http.post("/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a1": str(lora_model.a1)}
        r = http.post("/generate", json={"input_ids": PROMPT, "lora_path": "a2"})
        assert r.status_code == 400 and "'a2'" in r.json()["error"]["message"]
        r = http.post("/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 400 and r.json()["success"] is False
        assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [served, "a1"]
        # loaded again under another name: the same tokens as before
        assert http.post("/load_lora_adapter", json={"lora_name": "again", "lora_path": str(lora_model.a2)}).status_code == 200
        assert _tokens(http, "again") == a2
        assert http.post("/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200


def test_offline_engine_lora_methods(lora_model) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from tests.conftest import make_engine

    eng = make_engine(lora_model.base, enable_lora=True, lora_paths=[f"a1={lora_model.a1}"], max_lora_rank=8)
    try:
        base = eng.generate(input_ids=PROMPT, sampling_params=greedy(8))["output_ids"]
        a1 = eng.generate(input_ids=PROMPT, sampling_params=greedy(8), lora_path="a1")["output_ids"]
        assert a1 != base
        peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(lora_model.base).float().eval(), lora_model.a1)
        assert_greedy_matches(peft.eval(), PROMPT, a1, 8)
        out = eng.load_lora_adapter("a2", str(lora_model.a2))
        assert out.success and out.loaded_adapters == {"a1": str(lora_model.a1), "a2": str(lora_model.a2)}
        outs = eng.generate(input_ids=[PROMPT] * 3, sampling_params=greedy(8), lora_path=["a2", None, "a1"])
        a2 = outs[0]["output_ids"]
        assert [o["output_ids"] for o in outs] == [a2, base, a1] and a2 not in (base, a1)

        async def streamed() -> list:
            gen = await eng.async_generate(input_ids=PROMPT, sampling_params=greedy(8), lora_path="a2", stream=True)
            return [chunk async for chunk in gen][-1]["output_ids"]

        assert asyncio.run(streamed()) == a2
        with pytest.raises(CoreError):
            eng.load_lora_adapter("a2", str(lora_model.a2))  # a duplicate name
        assert eng.unload_lora_adapter("a2").loaded_adapters == {"a1": str(lora_model.a1)}
        with pytest.raises(InvalidRequest, match="a2"):
            eng.generate(input_ids=PROMPT, sampling_params=greedy(2), lora_path="a2")
        with pytest.raises(CoreError):
            eng.unload_lora_adapter("a2")
    finally:
        eng.shutdown()


def test_lora_paths_alone_enable_lora_for_the_server_too(lora_model) -> None:
    """``--lora-paths`` implies ``--enable-lora`` (SGLang): the server's checks see the adapters the
    engine serves, as the engine does."""
    from core.server.lora import check_adapter, loaded_adapters
    from tests.conftest import make_engine

    eng = make_engine(lora_model.base, lora_paths=[f"a1={lora_model.a1}"], max_lora_rank=8)
    try:
        assert eng.engine.lora is not None and loaded_adapters(eng.engine) == {"a1": str(lora_model.a1)}
        check_adapter(eng.engine, "a1", "lora_path")
        with pytest.raises(InvalidRequest, match="'nope' is not loaded; loaded adapters: a1"):
            check_adapter(eng.engine, "nope", "lora_path")
    finally:
        eng.shutdown()
