"""SGLang's custom logit processors (``--enable-custom-logit-processor``,
``core.engine.logit_processor``): strings made by SGLang's own client class load here without
SGLang on the server, run over their own rows only (after penalties and before sampling, with the
request's live output ids), fail only their own requests when they raise, and are refused
without the flag, offline and over HTTP."""

from __future__ import annotations

import pytest

from core.errors import InvalidRequest
from tests.conftest import assert_pool_free, make_engine
from tests.model_utils import prompt

pytest.importorskip("dill")


@pytest.fixture(scope="module")
def sglang_clp():
    """SGLang 0.5.23's ``custom_logit_processor`` module, as a client imports it."""
    from tests.compat.conftest import sglang_frontend

    sglang_frontend()
    import sglang.srt.sampling.custom_logit_processor as m

    return m


def scripted(base: type) -> type:
    """A processor a client script defines (a local class: pickled by value, as one in a script's
    ``__main__``): each row gets ``custom_params["tokens"][len(output)]``, read from the live
    output ids SGLang hands it as ``custom_params["__req__"]``."""
    class Scripted(base):
        def __call__(self, logits, custom_param_list=None):
            for i, p in enumerate(custom_param_list):
                want = p["tokens"][len(p["__req__"].output_ids)]
                logits[i, :] = float("-inf")
                logits[i, want] = 0.0
            return logits
    return Scripted


def failing(base: type) -> type:
    class Failing(base):
        def __call__(self, logits, custom_param_list=None):
            raise RuntimeError("boom")
    return Failing


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama()[0]


def test_strings_from_sglangs_client_load_as_our_classes(sglang_clp):
    from core.engine import logit_processor as lp

    proc = lp.load(scripted(sglang_clp.CustomLogitProcessor).to_str())
    assert isinstance(proc, lp.CustomLogitProcessor)  # the base resolved to the stand-in, not SGLang's
    assert isinstance(lp.load(sglang_clp.DisallowedTokensLogitsProcessor.to_str()), lp.DisallowedTokensLogitsProcessor)
    assert type(lp.load(sglang_clp.Qwen3ThinkingBudgetLogitProcessor.to_str())).THINKING_END_TOKEN_ID == 151668
    with pytest.raises(InvalidRequest, match="DeepseekOCRNoRepeatNGramLogitProcessor, which this server does not have"):
        lp.load(sglang_clp.DeepseekOCRNoRepeatNGramLogitProcessor.to_str())
    for bad in ("not json", '{"callable": "zz"}', '{"other": 1}'):
        with pytest.raises(InvalidRequest, match="is not a serialized processor"):
            lp.load(bad)
    import dill

    with pytest.raises(InvalidRequest, match="must be a CustomLogitProcessor subclass"):
        lp.load('{"callable": "%s"}' % dill.dumps(len).hex())


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_processors_drive_their_own_rows_with_live_outputs(path, sglang_clp, overlap):
    """Three requests in one batch: two scripted through one processor (each its own custom_params,
    one sampled at temperature 1), one without; then a banned-token processor by SGLang's name.
    The scripted ones follow their script token by token (the processor reads each step's live
    outputs), the plain one matches its tokens alone."""
    text = scripted(sglang_clp.CustomLogitProcessor).to_str()
    eng = make_engine(path, enable_custom_logit_processor=True, enable_overlap_schedule=overlap,
                      disable_overlap_schedule=not overlap)
    try:
        ps = [prompt(7, seed=1), prompt(9, seed=2), prompt(8, seed=3)]
        greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        alone = eng.generate(input_ids=ps[2], sampling_params=greedy)["output_ids"]
        scripts = [[5, 9, 5, 9, 5, 9], [11, 12, 13, 14, 15, 16]]
        params = [{**greedy, "custom_params": {"tokens": scripts[0]}},
                  {**greedy, "temperature": 1.0, "custom_params": {"tokens": scripts[1]}}, greedy]
        outs = eng.generate(input_ids=ps, sampling_params=params, custom_logit_processor=[text, text, None])
        assert [o["output_ids"] for o in outs] == [*scripts, alone]
        banned = alone[:2]
        out = eng.generate(input_ids=ps[2], sampling_params={**greedy, "custom_params": {"token_ids": banned}},
                           custom_logit_processor=sglang_clp.DisallowedTokensLogitsProcessor.to_str())
        assert not set(out["output_ids"]) & set(banned) and out["output_ids"] != alone
        assert_pool_free(eng)
    finally:
        eng.shutdown()


def test_a_failing_processor_fails_only_its_request(path, sglang_clp):
    eng = make_engine(path, enable_custom_logit_processor=True)
    try:
        ps = [prompt(7, seed=1), prompt(8, seed=3)]
        greedy = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        alone = eng.generate(input_ids=ps[1], sampling_params=greedy)["output_ids"]
        outs = eng.generate(input_ids=ps, sampling_params=greedy,
                            custom_logit_processor=[failing(sglang_clp.CustomLogitProcessor).to_str(), None])
        reason = outs[0]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "RuntimeError: boom" in reason["message"]
        assert outs[1]["output_ids"] == alone and outs[1]["meta_info"]["finish_reason"]["type"] == "length"
        assert_pool_free(eng)
    finally:
        eng.shutdown()


def test_refused_without_the_flag_and_with_bad_values(path, sglang_clp):
    text = scripted(sglang_clp.CustomLogitProcessor).to_str()
    eng = make_engine(path)
    try:
        with pytest.raises(InvalidRequest, match="--enable-custom-logit-processor"):
            eng.generate(input_ids=prompt(5, seed=0), sampling_params={"max_new_tokens": 2}, custom_logit_processor=text)
    finally:
        eng.shutdown()
    eng = make_engine(path, enable_custom_logit_processor=True)
    try:
        with pytest.raises(InvalidRequest, match="custom_params"):
            eng.generate(input_ids=prompt(5, seed=0), sampling_params={"max_new_tokens": 2, "custom_params": [1]})
        with pytest.raises(InvalidRequest, match="must be a string"):
            eng.generate(input_ids=prompt(5, seed=0), sampling_params={"max_new_tokens": 2}, custom_logit_processor=3)
        assert_pool_free(eng)
    finally:
        eng.shutdown()


def test_over_http_generate_and_openai(path, sglang_clp):
    """/generate (``custom_logit_processor`` beside ``sampling_params.custom_params``) and the
    OpenAI endpoints (both fields in the body, as extra_body sends them); a server without the
    flag answers 400 with SGLang's reason."""
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    text = scripted(sglang_clp.CustomLogitProcessor).to_str()
    script = [21, 22, 23, 24]
    ids = prompt(6, seed=4)

    async def calls(c):
        r = await c.post("/generate", json={"input_ids": ids, "custom_logit_processor": text, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "custom_params": {"tokens": script}}})
        assert r.status_code == 200, r.text
        gen = r.json()["output_ids"]
        r = await c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True, "custom_logit_processor": text,
                                                  "custom_params": {"tokens": script}})
        assert r.status_code == 200, r.text
        return gen, r.json()["choices"][0]["text"]

    gen, completion = serve_in_process({"model_path": str(path), "enable_custom_logit_processor": True}, ServerArgs(),
                                       calls)
    assert gen == script
    from transformers import AutoTokenizer

    assert completion == AutoTokenizer.from_pretrained(path).decode(script)

    async def refused(c):
        r = await c.post("/generate", json={"input_ids": ids, "custom_logit_processor": text,
                                            "sampling_params": {"max_new_tokens": 2}})
        return r.status_code, r.json()

    status, body = serve_in_process({"model_path": str(path)}, ServerArgs(), refused)
    assert status == 400 and "--enable-custom-logit-processor" in body["error"]["message"]
    assert body["error"]["param"] == "custom_logit_processor"
