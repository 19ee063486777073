"""Multi-LoRA, the model side (issue 44): peft adapters read into our layer names
(``core.engine.lora.adapter``), the pool's per-token deltas against peft's own LoRA modules,
layer by layer and through a whole prefill (``core.engine.lora.pool``), and the manager's
residency rules (``core.engine.lora.manager``).

Everything runs on the CPU in float32. The model runs its Python path: the layers are called
directly, and the whole-model prefill uses the ``torch_native`` attention backend, which has
no decode caches, so the fused C++ decoder-layer ops never plan (they would bypass the LoRA
hook; the engine makes them step aside while ``pool.active``)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from core.engine.model_loader.loader import finish_loading, iter_weights
from core.engine.lora import LoRAAdapter, LoRAError, LoRAManager, LoRAPool, read_adapter
from core.interfaces import AttentionConfig, ModelContext
from core.testing.paged import PagedPool, Seq, make_batch
from core.testing.suite import reference
from core_plugins.models.llama import LlamaForCausalLM
from tests.conftest import TINY_BASE

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")
PACKED = LlamaForCausalLM.packed_modules
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (r, alpha, rslora, targets, safetensors)
ADAPTERS: dict[str, tuple[int, int, bool, list[str], bool]] = {
    "a": (4, 8, False, ALL, True),
    "b": (8, 16, True, ["q_proj", "v_proj", "down_proj"], False),
    "c": (2, 4, False, ["o_proj", "gate_proj", "up_proj"], True),
}
OURS = {"q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"), "v_proj": ("self_attn", "qkv_proj"),
        "o_proj": ("self_attn", "o_proj"), "gate_proj": ("mlp", "gate_proj"), "up_proj": ("mlp", "up_proj"),
        "down_proj": ("mlp", "down_proj")}


class Log:
    """A structlog-shaped logger that keeps its events."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    debug = info


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict[str, Any]:
    """A tiny Llama (transformers and ours, same weights) and three peft adapters of it, saved."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    root = tmp_path_factory.mktemp("lora")
    config = LlamaConfig(**TINY_BASE)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = HFLlama(config).float().eval()
    hf.save_pretrained(root / "base")
    hf = HFLlama.from_pretrained(root / "base", attn_implementation="eager").float().eval()  # (named after its folder)
    peft_models, paths = {}, {}
    for i, (name, (r, alpha, rslora, targets, safe)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False)
        pm = peft.get_peft_model(copy.deepcopy(hf), cfg).eval()
        with torch.no_grad():  # B large enough that every delta is far above float noise
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(4)
        paths[name] = root / name
        pm.save_pretrained(paths[name], safe_serialization=safe)
        peft_models[name] = pm
    quant = reference("quant_method", "none")()
    with torch.device(CPU):
        model = LlamaForCausalLM(config, ModelContext(torch.float32, CPU, quant))
    model.load_weights(iter_weights(root / "base"))
    finish_loading(model, quant)
    return {"root": root, "hf": hf, "peft": peft_models, "paths": paths, "model": model.eval(), "config": config}


def make_pool(case: dict[str, Any], slots: int = 3, max_rank: int = 8, targets=None) -> LoRAPool:
    return LoRAPool(case["model"], slots=slots, max_rank=max_rank, target_modules=targets, dtype=torch.float32,
                    device=CPU)


def adapter(case: dict[str, Any], name: str) -> LoRAAdapter:
    return read_adapter(name, str(case["paths"][name]), PACKED)


def peft_delta(case: dict[str, Any], name: str | None, layer: int, hf_names: list[str], x: torch.Tensor) -> torch.Tensor:
    """peft's delta (its LoRA module's output minus its base layer's) for the HF projections
    ``hf_names`` of ``layer``, concatenated as our packed layer's parts; zero where not adapted."""
    outs = []
    for hf_name in hf_names:
        block, _ = OURS[hf_name]
        ref = case["hf"] if name is None else case["peft"][name].base_model.model
        mod = getattr(getattr(ref.model.layers[layer], block), hf_name)
        base = getattr(mod, "base_layer", None)
        outs.append(torch.zeros(x.shape[0], mod.out_features) if base is None else mod(x) - base(x))
    return torch.cat(outs, dim=-1)


# --------------------------------------------------------------------------- reading adapters


def test_read_adapter_maps_peft_names_to_our_layers(case):
    a = adapter(case, "a")
    assert (a.name, a.rank, a.scaling) == ("a", 4, 2.0)
    assert a.base_model == str(case["root"] / "base")
    keys = set(a.weights)
    for i in range(2):
        p = f"model.layers.{i}"
        assert {(f"{p}.self_attn.qkv_proj", s) for s in "qkv"} <= keys
        assert {(f"{p}.self_attn.o_proj", None), (f"{p}.mlp.gate_proj", None), (f"{p}.mlp.down_proj", None)} <= keys
    assert len(keys) == 14
    A, B = a.weights[("model.layers.1.self_attn.qkv_proj", "k")]
    assert A.shape == (4, 64) and B.shape == (32, 4) and A.dtype == B.dtype == torch.float32
    mod = case["peft"]["a"].base_model.model.model.layers[1].self_attn.k_proj
    torch.testing.assert_close(A, mod.lora_A["default"].weight)
    torch.testing.assert_close(B, mod.lora_B["default"].weight)
    b = adapter(case, "b")  # a .bin file, rsLoRA
    assert (case["paths"]["b"] / "adapter_model.bin").is_file()
    assert b.rank == 8 and b.scaling == pytest.approx(16 / 8**0.5)
    assert {m.rsplit(".", 1)[-1] for m, _ in b.weights} == {"qkv_proj", "down_proj"}
    assert {s for _, s in b.weights} == {"q", "v", None}


def test_read_adapter_with_an_adapter_name_segment(case, tmp_path):
    from safetensors.torch import load_file, save_file

    src = case["paths"]["c"]
    shutil.copytree(src, tmp_path / "c")
    tensors = load_file(str(src / "adapter_model.safetensors"))
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "c" / "adapter_model.safetensors"))
    got = read_adapter("c", str(tmp_path / "c"), PACKED)
    want = adapter(case, "c")
    assert got.weights.keys() == want.weights.keys()
    for k in got.weights:
        assert all(torch.equal(g, w) for g, w in zip(got.weights[k], want.weights[k]))


def _edited(case, tmp_path: Path, **config: Any) -> str:
    dst = tmp_path / "edited"
    shutil.copytree(case["paths"]["a"], dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("field, value, words", [
    ("use_dora", True, "use_dora"),
    ("bias", "all", "bias"),
    ("bias", "lora_only", "bias"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("fan_in_fan_out", True, "fan_in_fan_out"),
    ("rank_pattern", {"q_proj": 2}, "rank_pattern"),
    ("alpha_pattern", {"q_proj": 2}, "alpha_pattern"),
])
def test_unsupported_peft_features_are_refused(case, tmp_path, field, value, words):
    with pytest.raises(LoRAError, match=f"'x'.*{words}.*not supported"):
        read_adapter("x", _edited(case, tmp_path, **{field: value}), PACKED)


def test_missing_files_are_named(case, tmp_path):
    with pytest.raises(LoRAError, match="'x'.*is not a folder"):
        read_adapter("x", str(tmp_path / "nowhere"), PACKED)
    with pytest.raises(LoRAError, match="'x'.*has no adapter_config.json"):
        read_adapter("x", str(tmp_path), PACKED)
    path = _edited(case, tmp_path)
    (Path(path) / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match="'x'.*neither adapter_model.safetensors nor adapter_model.bin"):
        read_adapter("x", path, PACKED)
    (Path(path) / "adapter_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(LoRAError, match="'x': cannot read"):
        read_adapter("x", path, PACKED)


def test_unpaired_lora_tensors_are_refused(case, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _edited(case, tmp_path)
    file = Path(path) / "adapter_model.safetensors"
    tensors = load_file(str(file))
    del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    save_file(tensors, str(file))
    with pytest.raises(LoRAError, match="'x'.*layers.1.mlp.up_proj.*lora_A but no lora_B"):
        read_adapter("x", path, PACKED)


@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["lm_head"], ".*embed_tokens"])
def test_embedding_and_head_targets_are_refused(case, tmp_path, targets):
    cfg = peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(case["hf"]), cfg).save_pretrained(tmp_path / "e")
    with pytest.raises(LoRAError, match="'e'.*embedding.*not supported"):
        read_adapter("e", str(tmp_path / "e"), PACKED)


# --------------------------------------------------------------------------- the pool against peft


SEGMENTS = [(3, "a"), (2, None), (4, "b"), (1, "c"), (2, "a"), (3, "c")]  # a's tokens in two runs


@pytest.fixture
def loaded(case) -> Iterator[tuple[LoRAPool, dict[str, int]]]:
    pool = make_pool(case)
    slots = {"a": 2, "b": 0, "c": 1}
    for name, slot in slots.items():
        pool.load(adapter(case, name), slot)
    yield pool, slots
    pool.clear_batch()


def _segments(slots: dict[str, int]) -> tuple[list[int], list[int]]:
    return [n for n, _ in SEGMENTS], [-1 if a is None else slots[a] for _, a in SEGMENTS]


def _expected(case, layer: int, hf_names: list[str], x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    want, start = base.clone(), 0
    for n, name in SEGMENTS:
        want[start : start + n] += peft_delta(case, name, layer, hf_names, x[start : start + n])
        start += n
    return want


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("hf_names", [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj"], ["up_proj"],
                                      ["down_proj"]])
def test_layer_deltas_match_peft(case, loaded, layer, hf_names):
    pool, slots = loaded
    block, ours = OURS[hf_names[0]]
    mod = getattr(getattr(case["model"].model.layers[layer], block), ours)
    x = torch.randn(sum(n for n, _ in SEGMENTS), mod.in_features, generator=torch.Generator().manual_seed(layer))
    pool.clear_batch()
    base = mod(x)
    torch.testing.assert_close(base, _hf_base(case, layer, hf_names, x))
    pool.set_batch(*_segments(slots))
    assert pool.active
    got = mod(x)
    want = _expected(case, layer, hf_names, x, base)
    assert (want - base).abs().max() > 0.1  # the adapters do change this layer
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    pool.clear_batch()
    torch.testing.assert_close(mod(x), base, atol=0, rtol=0)


def _hf_base(case, layer: int, hf_names: list[str], x: torch.Tensor) -> torch.Tensor:
    hf_layer = case["hf"].model.layers[layer]
    return torch.cat([getattr(getattr(hf_layer, OURS[n][0]), n)(x) for n in hf_names], dim=-1)


def test_fused_gemm_paths_apply_the_deltas(case, loaded):
    """The GPU-only fusions (gate/up as one GEMM, o_proj adding the residual inside its GEMM),
    forced on the CPU: both still add each part's delta."""
    pool, slots = loaded
    src = case["model"].model.layers[1]
    layer = copy.deepcopy(src)  # the copy's projections share no state with the pool: attach the same objects
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        layer.get_submodule(name).__dict__["lora"] = src.get_submodule(name).__dict__["lora"]
    pool.set_batch(*_segments(slots))
    t = sum(n for n, _ in SEGMENTS)
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(t, 64, generator=g), torch.randn(t, 64, generator=g)
    want_mlp, want_o = src.mlp(x, res.clone()), src.self_attn.o_proj(x, res.clone())
    layer.mlp.fuse_after_loading(("cpu",))
    layer.self_attn.o_proj.__dict__["add_in_gemm"] = True
    assert "gate_up" in layer.mlp.__dict__
    torch.testing.assert_close(layer.mlp(x, res.clone()), want_mlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.self_attn.o_proj(x, res.clone()), want_o, atol=1e-5, rtol=1e-5)
    pool.clear_batch()
    assert (layer.mlp(x, res.clone()) - want_mlp).abs().max() > 0.1


def test_whole_model_prefill_matches_peft(case, loaded):
    """Three prompts in one prefill, with adapters a, none and b: each prompt's logits are
    its peft model's (the base model's for none)."""
    pool, slots = loaded
    model, cfg = case["model"], case["config"]
    prompts = [[1, 5, 9, 33, 70, 21], [1, 44, 8, 100], [1, 7, 7, 250, 3, 18, 90]]
    names = ["a", None, "b"]
    d = cfg.hidden_size // cfg.num_attention_heads
    kv = PagedPool(cfg.num_hidden_layers, cfg.num_key_value_heads, d, torch.float32, CPU, 4, 64, seed=2)
    acfg = AttentionConfig(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, d, torch.float32,
                           CPU, kv.kv)
    backend = reference("attention_backend", "torch_native")(acfg)
    seqs = [Seq() for _ in prompts]
    for s, p in zip(seqs, prompts):
        kv.grow(s, len(p))
    batch = make_batch(seqs, [len(p) for p in prompts], backend, CPU, input_ids=[t for p in prompts for t in p])
    backend.prepare(batch)
    pool.set_batch([len(p) for p in prompts], [-1 if n is None else slots[n] for n in names])
    logits = model.compute_logits(model(batch))
    pool.clear_batch()
    start = 0
    for p, n in zip(prompts, names):
        ref = case["hf"] if n is None else case["peft"][n]
        want = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[start : start + len(p)], want, atol=1e-4, rtol=1e-4)
        start += len(p)
    base = case["hf"](torch.tensor([prompts[0]])).logits[0]
    assert (logits[: len(prompts[0])] - base).abs().max() > 0.1


def test_set_batch_all_base_is_the_fast_path(case, loaded):
    pool, _ = loaded
    pool.set_batch([3, 4], [-1, -1])
    assert not pool.active
    pool.set_batch([3, 4], [-1, 0])
    assert pool.active
    pool.clear_batch()
    assert not pool.active
    with pytest.raises(ValueError):
        pool.set_batch([3], [0, 1])
    with pytest.raises(ValueError):
        pool.set_batch([3], [3])


def test_pool_attaches_one_object_per_targeted_layer(case):
    model = case["model"]
    pool = make_pool(case, slots=2, max_rank=4, targets=["q_proj", "v_proj", "down_proj"])
    qkv = model.model.layers[0].self_attn.qkv_proj
    state = qkv.__dict__["lora"]
    assert state.shards == ["q", "v"] and "lora" not in dict(qkv.named_modules())
    assert state.A.shape == (2, 2 * 4, 64) and state.B.shape == (2, qkv.out_features, 4)
    assert "lora" not in model.model.layers[0].self_attn.o_proj.__dict__
    assert set(pool.layers) == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj", "mlp.down_proj")}
    with pytest.raises(LoRAError, match="'bogus' is unknown"):
        make_pool(case, targets=["bogus"])


def test_q8_rows_codes_times_power_of_two_scales_are_exact_in_bf16():
    """The int8 form adapters take over packed weights: per row a power-of-two scale whose codes
    use the int8 range (|code| > 63 on a row's largest value), code x scale exact in bf16, and
    every value within half a step; an all-zero row stays zero."""
    from core.engine.lora.pool import q8_rows

    t = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-4, 0.01, 1, 30, 1e3, 0])[:, None]
    q, s = q8_rows(t)
    assert q.dtype == torch.int8 and q.shape == t.shape and s.shape == (6,)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    deq = q.float() * s[:, None]
    assert torch.equal(deq.to(torch.bfloat16).float(), deq)
    assert ((deq - t).abs() <= s[:, None] / 2).all()
    assert (q[:5].abs().amax(dim=1) > 63).all() and q.abs().max() <= 127 and not deq[5].any()


def test_dense_weights_keep_the_adapters_values(case):
    """Over plain (unpacked) weights the pool keeps the adapter as given: no int8 codes."""
    pool = make_pool(case, slots=1, max_rank=8)
    ad = adapter(case, "a")
    pool.load(ad, 0)
    state = pool.layers["model.layers.0.mlp.down_proj"]
    a, _ = ad.weights[("model.layers.0.mlp.down_proj", None)]
    assert not any(st.q8 for st in pool.layers.values()) and state.A_q8 is None
    assert torch.equal(state.A[0, : a.shape[0]], a)


def test_fused_target_names_select_every_part(case):
    pool = make_pool(case, slots=1, max_rank=2, targets=["qkv_proj", "gate_up_proj"])
    assert pool.layers["model.layers.0.self_attn.qkv_proj"].shards == ["q", "k", "v"]
    assert {k.rsplit(".", 1)[-1] for k in pool.layers} == {"qkv_proj", "gate_proj", "up_proj"}


def test_pool_check_refuses_adapters_that_do_not_fit(case, tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(LoRAError, match="'a' has rank 4, above the server's max LoRA rank 2"):
        make_pool(case, slots=1, max_rank=2).check(adapter(case, "a"))
    with pytest.raises(LoRAError, match=r"'a' adapts model\.layers\.\d\.(self_attn\.o|mlp\.\w+)_proj, which is not "
                       r"among the server's LoRA target modules \(k_proj, q_proj, v_proj\)"):
        make_pool(case, slots=1, max_rank=8, targets=["q_proj", "k_proj", "v_proj"]).check(adapter(case, "a"))
    with pytest.raises(LoRAError, match=r"'a' adapts .*qkv_proj \(part k\), which is not among"):
        make_pool(case, slots=1, max_rank=8, targets=[t for t in ALL if t != "k_proj"]).check(adapter(case, "a"))
    pool = make_pool(case, slots=1)
    path = _edited(case, tmp_path)
    file = Path(path) / "adapter_model.safetensors"
    tensors = load_file(str(file))
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(renamed, str(file))
    with pytest.raises(LoRAError, match="'x' adapts 'model.layers.7.*which this model does not have"):
        pool.check(read_adapter("x", path, PACKED))
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    tensors[key] = torch.zeros(4, 100)
    save_file(tensors, str(file))
    with pytest.raises(LoRAError, match=r"'x': model.layers.0.mlp.down_proj expects lora_A \[r, 128\].*\(4, 100\)"):
        pool.check(read_adapter("x", path, PACKED))
    with pytest.raises(LoRAError):
        pool.load(read_adapter("x", path, PACKED), 0)


def test_load_pads_ranks_folds_scaling_and_zeroes_missing_modules(case):
    pool = make_pool(case, slots=2, max_rank=8)
    pool.load(adapter(case, "a"), 0)
    pool.load(adapter(case, "c"), 0)  # replaces a: its qkv / down parts must be gone
    assert pool.slot_of("c") == 0 and pool.slot_of("a") is None and pool.name_in(1) is None
    qkv = pool.layers["model.layers.0.self_attn.qkv_proj"]
    assert not qkv.A[0].any() and not qkv.B[0].any()
    o = pool.layers["model.layers.0.self_attn.o_proj"]
    A, B = adapter(case, "c").weights[("model.layers.0.self_attn.o_proj", None)]
    torch.testing.assert_close(o.A[0, :2], A)
    torch.testing.assert_close(o.B[0, :, :2], B * 2.0)
    assert not o.A[0, 2:].any() and not o.B[0, :, 2:].any()
    pool.free(0)
    assert pool.slot_of("c") is None


# --------------------------------------------------------------------------- the manager


def manager(case, slots: int = 2, max_loaded: int | None = None) -> tuple[LoRAManager, Log]:
    log = Log()
    return LoRAManager(make_pool(case, slots=slots), PACKED, max_loaded=max_loaded, log=log), log


def test_manager_add_resolve_and_uids(case):
    m, log = manager(case)
    assert m.resolve(None) == 0 and m.resolve("") == 0
    m.add("a", str(case["paths"]["a"]))
    m.add("b", str(case["paths"]["b"]))
    assert m.names() == ["a", "b"]
    ua, ub = m.resolve("a"), m.resolve("b")
    assert ua >= 1 and ub >= 1 and ua != ub
    with pytest.raises(LoRAError, match="'a' is already loaded"):
        m.add("a", str(case["paths"]["c"]))
    with pytest.raises(LoRAError, match=r"'zzz' is not loaded \(loaded: a, b\)"):
        m.resolve("zzz")
    m.remove("a")
    m.add("a", str(case["paths"]["c"]))  # the name again: a new uid, never the old one
    assert m.resolve("a") not in (ua, ub)
    assert m.adapter("a").rank == 2
    with pytest.raises(LoRAError):
        m.add("bad", str(case["root"] / "nowhere"))
    assert "bad" not in m.names() and [e for e, _ in log.events].count("lora.added") == 3


def test_manager_evicts_least_recently_used_unpinned_unused(case):
    m, log = manager(case, max_loaded=2)
    p = case["paths"]
    m.add("a", str(p["a"]), pinned=True)
    m.add("b", str(p["b"]))
    m.add("c", str(p["c"]))  # a is pinned: b goes
    assert m.names() == ["a", "c"] and ("lora.evicted", {"name": "b", "by": "c"}) in log.events
    m.add("b", str(p["b"]))  # c goes
    assert m.names() == ["a", "b"]
    m.acquire(m.resolve("b"))  # b in use, a pinned: nothing can go
    with pytest.raises(LoRAError, match="cannot load LoRA adapter 'c'.*pinned or in use"):
        m.add("c", str(p["c"]))
    m.release(m.resolve("b"))
    m2, _ = manager(case, max_loaded=2)
    m2.add("a", str(p["a"]))
    m2.add("b", str(p["b"]))
    m2.resolve("a")  # a used more recently than b
    m2.add("c", str(p["c"]))
    assert m2.names() == ["a", "c"]


def test_manager_remove_waits_for_running_requests(case):
    m, _ = manager(case)
    m.add("a", str(case["paths"]["a"]))
    uid = m.resolve("a")
    m.acquire(uid)
    m.acquire(uid)
    assert m.slots_for([uid]) == [0]
    m.remove("a")
    with pytest.raises(LoRAError, match="'a' is not loaded"):
        m.resolve("a")
    with pytest.raises(LoRAError, match="'a' is being removed"):
        m.add("a", str(case["paths"]["b"]))
    assert m.names() == [] and m.pool.slot_of("a") == 0  # still serving its running requests
    assert m.slots_for([uid, 0]) == [0, -1]
    m.release(uid)
    assert m.pool.slot_of("a") == 0
    m.release(uid)  # the last user: host copy and slot go
    assert m.pool.slot_of("a") is None
    with pytest.raises(LoRAError, match="no longer loaded"):
        m.slots_for([uid])
    with pytest.raises(LoRAError, match="'nope' is not loaded"):
        m.remove("nope")
    m.acquire(0), m.release(0)  # the base model: no-ops


def test_manager_slots_for_loads_and_replaces_lru_slots(case):
    m, _ = manager(case, slots=2)
    for n in "abc":
        m.add(n, str(case["paths"][n]))
    ua, ub, uc = (m.resolve(n) for n in "abc")
    assert m.slots_for([ua, 0, ub, ua]) == [0, -1, 1, 0]
    assert m.slots_for([ub]) == [1]  # b used after a: a's slot is the least recently used
    assert m.slots_for([uc, ub]) == [0, 1]
    assert m.pool.slot_of("a") is None and m.pool.slot_of("c") == 0
    with pytest.raises(LoRAError, match="3 LoRA adapters but the pool has 2 slots"):
        m.slots_for([ua, ub, uc])
    assert m.slots_for([ua, uc]) == [1, 0]  # b's slot, not c's (needed by this batch)
    pool = m.pool
    qkv = pool.layers["model.layers.0.self_attn.qkv_proj"]
    A, _ = m.adapter("a").weights[("model.layers.0.self_attn.qkv_proj", "q")]
    torch.testing.assert_close(qkv.A[1, :4], A)


# --------------------------------------------------------------------------- checkpoint-fused projections


def test_phi3_fused_projections_take_whole_layer_deltas(tmp_path):
    """Phi-3's checkpoint fuses qkv_proj and gate_up_proj, as our model does: an adapter on them
    is one part (shard None) covering the layer's whole output, whatever target names say."""
    from transformers import Phi3Config, Phi3ForCausalLM as HFPhi3

    from core_plugins.models.phi3 import Phi3ForCausalLM

    config = Phi3Config(**{**TINY_BASE, "pad_token_id": 0})
    torch.manual_seed(0)
    hf = HFPhi3(config).float().eval()
    hf.save_pretrained(tmp_path / "base")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj", "down_proj"],
                          init_lora_weights=False)
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg).eval()
    pm.save_pretrained(tmp_path / "lora")
    quant = reference("quant_method", "none")()
    model = Phi3ForCausalLM(config, ModelContext(torch.float32, CPU, quant))
    model.load_weights(iter_weights(tmp_path / "base"))
    a = read_adapter("p", str(tmp_path / "lora"), Phi3ForCausalLM.packed_modules)
    assert {s for _, s in a.weights} == {None}
    pool = LoRAPool(model, slots=2, max_rank=8, target_modules=["q_proj", "gate_proj", "down_proj"],
                    dtype=torch.float32, device=CPU)
    assert {k.rsplit(".", 1)[-1] for k in pool.layers} == {"qkv_proj", "gate_up_proj", "down_proj"}
    pool.load(a, 1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for block, name in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
        ours = getattr(model.model.layers[1], block).get_submodule(name)
        ref = getattr(getattr(pm.base_model.model.model.layers[1], block), name)
        pool.set_batch([2, 3], [1, -1])
        got = ours(x)
        pool.clear_batch()
        want = ref.base_layer(x)
        want[:2] = ref(x[:2])
        assert (want[:2] - got[:2]).abs().max() < 1e-5 < (want[:2] - ours(x)[:2]).abs().max()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tensor_parallel_ranks_hold_their_slices(case):
    """Under tensor parallelism each rank's pool keeps its slice: a column-parallel layer's
    delta is the full delta's columns of that rank, a row-parallel layer's deltas (over the
    rank's input slice) sum to the full one, before the all-reduce that sums the outputs."""
    from core.parallel import TensorParallel, building

    full = make_pool(case, slots=1)
    full.load(adapter(case, "a"), 0)
    full.set_batch([5], [0])
    g = torch.Generator().manual_seed(5)
    x_qkv, x_o = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    qkv_full = case["model"].model.layers[1].self_attn.qkv_proj
    want_qkv = full.layers["model.layers.1.self_attn.qkv_proj"](x_qkv, torch.zeros(5, qkv_full.out_features))
    want_o = full.layers["model.layers.1.self_attn.o_proj"](x_o, torch.zeros(5, 64))
    quant = reference("quant_method", "none")()
    o_sum = torch.zeros(5, 64)
    for rank in range(2):
        with building(TensorParallel(rank=rank, size=2)):
            model = LlamaForCausalLM(case["config"], ModelContext(torch.float32, CPU, quant))
        pool = make_pool({"model": model}, slots=1)
        pool.load(adapter(case, "a"), 0)
        pool.set_batch([5], [0])
        qkv = pool.layers["model.layers.1.self_attn.qkv_proj"]
        got = qkv(x_qkv, torch.zeros(5, qkv.layer.out_features))
        for part in range(3):
            (start, size), (fstart, _) = qkv.layer.shard_span(part), qkv_full.shard_span(part)
            src = fstart + qkv.layer.source_start(part)
            torch.testing.assert_close(got[:, start : start + size], want_qkv[:, src : src + size], atol=1e-5, rtol=0)
        o = pool.layers["model.layers.1.self_attn.o_proj"]
        o_sum += o(x_o[:, rank * 32 : (rank + 1) * 32], torch.zeros(5, 64))
    torch.testing.assert_close(o_sum, want_o, atol=1e-5, rtol=1e-5)
    assert want_o.abs().max() > 0.1
    full.clear_batch()
