"""SGLang's ``/get_weights_by_name`` (``core.engine.model_loader.weights_by_name``): a parameter by
its checkpoint name equals transformers' (packed parts are their rows, a quantized layer its
dequantized weight, a tied lm_head the embedding table); unknown names are a 400."""

from __future__ import annotations

import pytest
import torch

from core.errors import InvalidRequest
from tests.conftest import make_engine

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
         "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
         "model.layers.1.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
         "model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight"]


def test_parameters_match_transformers(tiny_llama):
    from core.engine.model_loader.weights_by_name import weights_by_name

    path, hf = tiny_llama()
    ref = dict(hf.named_parameters())
    eng = make_engine(path)
    try:
        model = eng.engine.model
        for name in NAMES:
            want = (ref.get(name, ref["model.embed_tokens.weight"]))[:3].float().tolist()  # (tied lm_head)
            assert weights_by_name(model, name, 3) == want, name
        assert len(weights_by_name(model, "model.norm.weight")) == min(100, ref["model.norm.weight"].numel())
        for bad in ("model.layers.0.self_attn.nope.weight", "model.layers.99.mlp.up_proj.weight", "x"):
            with pytest.raises(InvalidRequest, match="no parameter named"):
                weights_by_name(model, bad)
    finally:
        eng.shutdown()
    eng = make_engine(path, torchao_config="int8wo")  # a quantized layer: its dequantized weight
    try:
        got = torch.tensor(weights_by_name(eng.engine.model, "model.layers.0.mlp.up_proj.weight", 4))
        want = ref["model.layers.0.mlp.up_proj.weight"][:4].float()
        assert got.shape == want.shape and torch.allclose(got, want, atol=want.abs().max().item() / 100)
    finally:
        eng.shutdown()


def test_the_http_endpoint(tiny_llama):
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    path, hf = tiny_llama()

    async def calls(c):
        return (await c.post("/get_weights_by_name", json={"name": "model.layers.0.self_attn.k_proj.weight",
                                                           "truncate_size": 2}),
                await c.post("/get_weights_by_name", json={"name": "model.nope"}))

    ok, bad = serve_in_process({"model_path": str(path)}, ServerArgs(), calls)
    assert ok.status_code == 200 and ok.json() == hf.model.layers[0].self_attn.k_proj.weight[:2].float().tolist()
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
