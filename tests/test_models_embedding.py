"""Embedding mode (--is-embedding): pooled final hidden states against transformers' base
model (last token by default, mean per the sentence-transformers files; normalised),
--load-format dummy and --json-model-override-args."""

from __future__ import annotations

import json

import torch

from tests.model_utils import build_tiny, prompt


def _hf_hidden(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].float()


def test_last_token_and_mean_pooling_match_transformers(tmp_path, engine_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = build_tiny(tmp_path, Qwen2Config, Qwen2ForCausalLM)
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, is_embedding=True, max_total_tokens=256)
    prompts = [prompt(5, 1), prompt(23, 2), prompt(1, 3)]
    outs = eng.encode(input_ids=prompts)
    for p, out in zip(prompts, outs):
        want = torch.nn.functional.normalize(_hf_hidden(hf, p)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(out["embedding"]), want, atol=1e-4, rtol=0)
        assert out["meta_info"]["prompt_tokens"] == len(p)
    assert eng.encode(input_ids=prompts[1])["embedding"] == outs[1]["embedding"]
    # sentence-transformers files ask for mean pooling and normalisation
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    outs = eng.encode(input_ids=prompts)
    for p, out in zip(prompts, outs):
        want = torch.nn.functional.normalize(_hf_hidden(hf, p).mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(out["embedding"]), want, atol=1e-4, rtol=0)


def test_dummy_weights_and_model_override_args(tmp_path, engine_factory):
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, load_format="dummy", max_total_tokens=256,
                         json_model_override_args=json.dumps({"num_hidden_layers": 1}))
    assert len(eng.engine.model.model.layers) == 1
    out = eng.generate(input_ids=prompt(8, 1), sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 4
    assert all(p.abs().max() <= 1e-3 for p in eng.engine.model.parameters())


def test_classification_head_matches_transformers(tmp_path, engine_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    hf = build_tiny(tmp_path, LlamaConfig, LlamaForSequenceClassification, num_labels=3)
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, is_embedding=True, max_total_tokens=256)
    prompts = [prompt(5, 1), prompt(23, 2)]
    outs = eng.encode(input_ids=prompts)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].float()
        torch.testing.assert_close(torch.tensor(out["embedding"]), want, atol=1e-4, rtol=0)


def test_http_endpoints(tmp_path, engine_factory):
    from starlette.testclient import TestClient
    from transformers import LlamaConfig, LlamaForCausalLM

    from core.server.app import build_app
    from core.server.args import ServerArgs
    from core.server.state import build_state
    from tests.conftest import char_tokenizer

    build_tiny(tmp_path, LlamaConfig, LlamaForCausalLM)
    char_tokenizer().save_pretrained(tmp_path)
    eng = engine_factory(tmp_path, is_embedding=True, max_total_tokens=256)
    state = build_state(eng.engine, ServerArgs())
    app = build_app(state)
    with TestClient(app) as c:
        ref = eng.encode("hello")["embedding"]
        for inp in ("hello", ["hello", "hi"], eng.tokenizer.encode("hello"), [eng.tokenizer.encode("hello")]):
            r = c.post("/v1/embeddings", json={"model": "tiny", "input": inp})
            assert r.status_code == 200, r.text
            assert r.json()["data"][0]["index"] == 0
            torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), torch.tensor(ref), atol=1e-5, rtol=0)
        assert c.post("/v1/embeddings", json={"input": "hello", "dimensions": 8}).status_code == 400
        assert c.post("/v1/embeddings", json={"input": []}).status_code == 400
        r = c.post("/encode", json={"text": ["hello", "hi"]})
        assert r.status_code == 200
        torch.testing.assert_close(torch.tensor(r.json()[0]["embedding"]), torch.tensor(ref), atol=1e-5, rtol=0)
        assert c.post("/classify", json={"text": "hello"}).status_code == 400  # no classification head
        # an input longer than the context: rejected, or with --allow-auto-truncate its head is embedded
        ctx = eng.engine.model_config.context_len
        long = (eng.tokenizer.encode("hello world") * ctx)[: ctx + 3]
        assert c.post("/v1/embeddings", json={"input": long}).json()["error"]["param"] == "input"
        state.args = ServerArgs(allow_auto_truncate=True)
        got = c.post("/v1/embeddings", json={"input": long}).json()["data"][0]["embedding"]
        head = c.post("/v1/embeddings", json={"input": long[:ctx]}).json()["data"][0]["embedding"]
        assert got == head
        assert c.post("/encode", json={"input_ids": long}).json()["embedding"] == head


def test_sentence_transformers_layouts_it_cannot_follow_are_refused_at_start(tmp_path):
    """A Pooling module asking for max (or several) pooling, or a Dense projection after it, was
    served with last-token pooling and no projection: a 200 with other vectors than the model's."""
    import pytest
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from core.errors import ModelLoadError
    from tests.conftest import make_engine

    build_tiny(tmp_path, Qwen2Config, Qwen2ForCausalLM)
    (tmp_path / "1_Pooling").mkdir()
    transformer = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    for modes, extra, why in (({"pooling_mode_max_tokens": True}, [], "max_tokens pooling"),
                              ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, [], r"cls_token \+ mean_tokens"),
                              ({"pooling_mode_mean_tokens": True}, [dense], "Dense module")):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
        (tmp_path / "modules.json").write_text(json.dumps([transformer, pooling, *extra]))
        with pytest.raises(ModelLoadError, match=why):
            make_engine(tmp_path, skip_tokenizer_init=True, is_embedding=True, max_total_tokens=256)
