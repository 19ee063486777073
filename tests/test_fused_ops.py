"""The fused per-layer kernels against the torch ops of core/layers.py that they replace: RMS
norm (plain and Gemma's offset), rotary (full, partial, llama3-scaled, on strided views of a
fused QKV output) and the gated activations; for both implementations, the Triton kernels
(kernels/fused_ops.py: on a GPU, else in triton's interpreter) and the C++ loops for CPU
tensors (kernels/cpu_ops.cpp). The reference is the torch path on the CPU, with the dispatch
to fused kernels switched off."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

from transformers import LlamaConfig  # noqa: E402

import core.layers  # noqa: E402
from core.layers import ACTIVATIONS, FUSED_ACT, RMSNorm, RotaryEmbedding  # noqa: E402
from core_kernels import cpu_ops, fused_ops, interpreting  # noqa: E402

GPU = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Triton kernels run
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["triton", "cpu"])
def impl(request):
    """(kernels module, device of its inputs)."""
    if request.param == "cpu":
        if not cpu_ops.available():
            pytest.skip("the C++ ops cannot be built here (no toolchain)")
        return cpu_ops, torch.device("cpu")
    return fused_ops, GPU


@pytest.fixture(autouse=True)
def torch_reference(monkeypatch):
    """The layers compute with their torch ops here: the reference."""
    monkeypatch.setattr(core.layers, "fused", lambda x: None)


def close(got: torch.Tensor, ref: torch.Tensor, mod) -> None:
    """Equal up to one rounding step of the dtype (float32: reduction order only). Triton's
    interpreter truncates float32 -> bfloat16 where a GPU or C++ rounds to nearest: two steps there."""
    if ref.dtype == torch.float32:
        tol = dict(atol=1e-5, rtol=1e-5)
    elif mod is fused_ops and interpreting():
        tol = dict(atol=2e-2, rtol=1.6e-2)
    else:
        tol = dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got.cpu(), ref, **tol)


def test_layers_use_the_fused_kernels_per_device(monkeypatch):
    monkeypatch.undo()  # the real dispatch
    if cpu_ops.available():
        assert core.layers.fused(torch.zeros(2)) is cpu_ops
    monkeypatch.setenv("CORE_FUSED_OPS", "0")
    core.layers._fused_ops.cache_clear()
    try:
        assert core.layers.fused(torch.zeros(2)) is None
    finally:
        monkeypatch.delenv("CORE_FUSED_OPS")
        core.layers._fused_ops.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_the_torch_layer(dtype, offset, impl):
    mod, dev = impl
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5, offset=offset)
    norm.weight.data = torch.randn(96, generator=g) * 0.5 + 1
    norm = norm.to(dtype)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    ref = norm(x)
    got = mod.rms_norm(x.to(dev), norm.weight.to(dev), norm.eps, offset)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, ref, mod)


def test_rms_norm_of_head_views_qk_norm(impl):
    """Qwen 3 normalises q and k per head: a strided [T, H, D] view of the QKV output."""
    mod, dev = impl
    qkv = torch.randn(5, 3 * 4 * 32, dtype=torch.bfloat16)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    norm = RMSNorm(32, eps=1e-6).to(torch.bfloat16)
    close(mod.rms_norm(q.to(dev), norm.weight.to(dev), 1e-6), norm(q), mod)


def test_rms_norm_of_no_rows(impl):
    mod, dev = impl
    assert mod.rms_norm(torch.zeros(0, 8, device=dev), torch.ones(8, device=dev), 1e-6).shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", list(FUSED_ACT))
def test_gated_act_matches_torch(dtype, act):
    """Triton only: on the CPU the layers keep torch's vectorised silu and mul."""
    mod, dev = fused_ops, GPU
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(6, 2 * 1100, generator=g) * 2).to(dtype)  # 1100: two column blocks, the second masked
    gate, up = gate_up.chunk(2, dim=-1)  # row-strided views, as Phi-3's fused gate_up gives
    ref = ACTIVATIONS[act](gate) * up
    d = gate_up.to(dev)
    got = mod.gated_act(*d.chunk(2, dim=-1), FUSED_ACT[act])
    close(got, ref, mod)


def test_gated_act_refuses_bad_input():
    mod, dev = fused_ops, GPU
    with pytest.raises(ValueError, match="gated_act"):
        mod.gated_act(torch.zeros(2, 4, device=dev), torch.zeros(2, 4, device=dev), "relu")
    with pytest.raises(ValueError, match="gated_act"):
        mod.gated_act(torch.zeros(2, 4, device=dev), torch.zeros(2, 5, device=dev))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 300), (2, 4096 + 80), (1, 16)])
def test_per_token_fp8_matches_the_fp8_plugins_torch_ops(dtype, shape):
    """Triton only (the fp8 method runs on a GPU): one launch for the scale and the cast. Scales are
    equal; codes equal on a GPU. The interpreter's float -> fp8 conversion is not the hardware's
    (127.3 becomes 64 there, not 128), so under it the codes are checked for place, sign and zeros,
    and to within half their value."""
    mod, dev = fused_ops, GPU
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x[0, : shape[1] // 2] = 0.0  # amax from the second half
    if shape[0] > 1:
        x[-1] = 0.0  # an all-zero row: the 1e-12 floor, every code 0
    s_ref = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    q_ref = (x.float() / s_ref).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    q, s = mod.per_token_fp8(x.to(dev), 448.0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape and s.shape == (shape[0], 1)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=0, atol=0)
    q = q.float().cpu()
    if interpreting():
        assert torch.equal(q == 0, q_ref == 0) and torch.equal(q.sign(), q_ref.sign())
        assert ((q - q_ref).abs() <= q_ref.abs() / 2).all()
        assert (q == q_ref).float().mean() > 0.5
    else:
        torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    assert q.abs().max() <= 448.0 and (shape[0] == 1 or (q[-1] == 0).all())


def test_per_token_fp8_refuses_bad_input():
    with pytest.raises(ValueError, match="per_token_fp8"):
        fused_ops.per_token_fp8(torch.zeros(2, 3, 4, device=GPU))


ROPES = {
    "default": ({}, 1.0),
    "partial": ({}, 0.5),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, 1.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_matches_the_torch_layer(dtype, rope, impl):
    mod, dev = impl
    scaling, partial = ROPES[rope]
    h, hkv, d, t = 4, 2, 64, 9
    cfg = LlamaConfig(hidden_size=h * d, num_attention_heads=h, num_key_value_heads=hkv, head_dim=d,
                      max_position_embeddings=256, rope_theta=10000.0, partial_rotary_factor=partial,
                      rope_scaling=scaling or None)
    with torch.device("cpu"):
        rot = RotaryEmbedding(cfg, d, 256)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)  # strided views
    pos = torch.tensor([0, 1, 2, 17, 100, 255, 3, 3, 64])
    ref_q, ref_k = rot(pos, q, k)
    got_q, got_k = mod.rotary(pos.to(dev), q.to(dev), k.to(dev), rot.cos.to(dev), rot.sin.to(dev), rot.rotary_dim)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    close(got_q, ref_q, mod)
    close(got_k, ref_k, mod)


def test_rotary_refuses_mismatched_shapes(impl):
    mod, dev = impl
    q, k = torch.zeros(2, 4, 16, device=dev), torch.zeros(3, 2, 16, device=dev)
    with pytest.raises(ValueError, match="rotary"):
        mod.rotary(torch.zeros(2, dtype=torch.int64, device=dev), q, k, torch.zeros(8, 16, device=dev),
                   torch.zeros(8, 16, device=dev), 16)


@pytest.mark.skipif(not cpu_ops.available(), reason="needs the C++ CPU ops (a C++ compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 256, 1000, 49152])
def test_cpu_argmax_is_torchs_first_index_of_the_maximum(n, dtype):
    """bf16 rows give torch's argmax of their float32 values (what greedy sampling took before)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g)
    x[1] = 0.0  # all tied: index 0
    x[2, n // 3] = x[2, n - 1] = 50.0  # a tie between two: the first
    x[3] = float("-inf")
    x[4, n // 2] = float("inf")
    x[5, n - 1] = float("nan")  # NaN counts as the maximum, as in torch
    x[6, n // 4] = float("nan")
    x[6, n - 1] = float("inf")
    x = x.to(dtype)
    want = x.float().argmax(-1)
    assert torch.equal(cpu_ops.argmax(x), want)
    wide = torch.zeros(9, n + 5, dtype=dtype)
    wide[:, 5:] = x
    assert torch.equal(cpu_ops.argmax(wide[:, 5:]), want)  # rows strided inside a wider tensor


def test_greedy_sampling_uses_the_cpu_argmax(monkeypatch):
    from core.engine import sampler

    if not cpu_ops.available():
        pytest.skip("needs the C++ CPU ops (a C++ compiler)")
    seen = []
    monkeypatch.setattr(core.layers, "fused", lambda x: cpu_ops)  # what the engine's layers get on this CPU
    monkeypatch.setattr(cpu_ops, "argmax", lambda x: seen.append(x.shape) or x.argmax(-1))
    assert sampler.argmax(torch.tensor([[0.0, 3.0, 1.0]])).tolist() == [1]
    assert seen == [(1, 3)]
    assert sampler.argmax(torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.bfloat16)).tolist() == [1]
    assert seen == [(1, 3), (1, 3)]
    assert sampler.argmax(torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.float16)).tolist() == [1]  # torch's
    assert seen == [(1, 3), (1, 3)]


@pytest.mark.skipif(not cpu_ops.available(), reason="needs the C++ CPU ops (a C++ compiler)")
def test_cpu_store_kv_writes_rows_as_index_copy_does():
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.zeros(20, 3, 8, dtype=torch.bfloat16), torch.zeros(20, 3, 8, dtype=torch.bfloat16)
    qkv = torch.randn(4, 9 * 8, generator=g)  # k and v: row-strided views of a fused projection, float32
    k, v = qkv[:, 3 * 8 : 6 * 8].view(4, 3, 8), qkv[:, 6 * 8 :].view(4, 3, 8)
    loc = torch.tensor([7, 0, 19, 3])
    want_k, want_v = kc.clone().index_copy_(0, loc, k.bfloat16()), vc.clone().index_copy_(0, loc, v.bfloat16())
    cpu_ops.store_kv(kc, vc, loc, k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_ops.store_kv(kc, vc, torch.tensor([1, 2, 20, 3]), k, v)
    with pytest.raises(RuntimeError, match="store_kv"):
        torch.ops.core_cpu_ops.store_kv(kc, vc, loc[:3], k.bfloat16(), v.bfloat16())  # one slot short


@pytest.mark.skipif(not cpu_ops.available(), reason="needs the C++ CPU ops (a C++ compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_cpu_add_rms_norm_is_the_add_then_the_norm(dtype, offset):
    g = torch.Generator().manual_seed(2)
    x, r = (torch.randn(2, 37, 96, generator=g) * 3).to(dtype)
    w = (torch.randn(96, generator=g) * 0.5 + 1).to(dtype)
    total, normed = torch.ops.core_cpu_ops.add_rms_norm(x, r, w, 1e-5, offset)
    assert torch.equal(total, x + r)
    assert torch.equal(normed, cpu_ops.rms_norm(x + r, w, 1e-5, offset))
    with pytest.raises(RuntimeError, match="add_rms_norm"):
        torch.ops.core_cpu_ops.add_rms_norm(x, r[:5], w, 1e-5, offset)


# --------------------------------------------------------------------------- sampling (Triton; the
# C++ loops for CPU tensors are tested in test_sampler.py)


def test_triton_sample_rows_picks_what_the_torch_route_picks() -> None:
    from core.engine.sampler import _inverse_cdf

    g = torch.Generator().manual_seed(11)
    n = 64
    x = torch.randn(n, 5000, generator=g) * 3
    temp = torch.rand(n, generator=g) * 2 + 0.05
    u = torch.rand(n, generator=g)
    fb = torch.full((n,), -1, dtype=torch.long)
    got = fused_ops.sample_rows(x.to(GPU), temp.to(GPU), u.to(GPU), fb.to(GPU)).cpu()
    want = _inverse_cdf(torch.softmax(x / temp[:, None], dim=-1), None, u, fb)
    assert (got != want).sum() <= 1  # the same search; float32 sums in another order may move a boundary tie


def test_triton_sample_rows_falls_back_where_there_is_no_distribution() -> None:
    inf = float("inf")
    x = torch.tensor([[0.0, float("nan"), 1.0], [0.0, inf, 1.0], [-inf, -inf, -inf], [1.0, 3e5, 2.0], [-inf, 2.0, -inf]])
    temp = torch.tensor([1.0, 1.0, 1.0, 1e-40, 1.0])
    out = fused_ops.sample_rows(x.to(GPU), temp.to(GPU), torch.full((5,), 0.999, device=GPU),
                                torch.tensor([7, 8, 9, 10, 11], device=GPU))
    assert out.tolist() == [7, 8, 9, 10, 1]  # a -inf entry is never chosen, even at u -> 1


@pytest.mark.parametrize("complete", [False, True])
def test_triton_sample_sorted_picks_what_the_torch_ops_pick(monkeypatch, complete) -> None:
    """Filtered rows: the same tokens as ``sampler._pick_sorted``'s torch ops (but for a rounding
    tie at a boundary), and the same rows marked -1 (kept prefix possibly past the candidates)."""
    from core.engine.sampler import _pick_sorted
    from tests.test_sampler import filtered_rows

    n = 96
    cand, order, cols, fb = filtered_rows(n, 64)
    got = fused_ops.sample_sorted(cand.to(GPU), order.to(GPU), cols.to(GPU), fb.to(GPU), complete).cpu()
    want = _pick_sorted(cand, order, cols, fb, complete)
    assert torch.equal(got < 0, want < 0)
    assert (got != want).sum() <= 1
    assert complete or 0 < (got < 0).sum() < n  # both kinds of rows are there


def test_triton_sample_sorted_over_several_blocks_and_without_mass() -> None:
    """A whole sorted vocabulary wider than one block (the complete route), and rows whose kept
    mass is zero or not finite (the fallback)."""
    from core.engine.sampler import _pick_sorted

    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(3, 9000, generator=g) * 0.5, dim=-1)  # flat: top_p reaches deep
    full, order = probs.sort(dim=-1, descending=True)
    cols = torch.tensor([[1.0, 9000.0, 0.95, 0.0, 0.7], [1.0, 9000.0, 1.0, 0.0, 0.999], [1.0, 20.0, 0.5, 0.0, 0.3]])
    fb = torch.tensor([-5, -6, -7])
    got = fused_ops.sample_sorted(full.to(GPU), order.to(GPU), cols.to(GPU), fb.to(GPU), True).cpu()
    want = _pick_sorted(full, order, cols, fb, True)
    assert (got != want).sum() <= 1 and (got >= 0).all()
    bad = torch.tensor([[0.0, 0.0, 0.0], [float("nan"), 0.1, 0.0]])
    out = fused_ops.sample_sorted(bad.to(GPU), torch.zeros(2, 3, dtype=torch.long, device=GPU),
                                  torch.tensor([[1.0, 3.0, 1.0, 0.0, 0.5]] * 2, device=GPU),
                                  torch.tensor([41, 42], device=GPU), True)
    assert out.tolist() == [41, 42]


def test_triton_sampling_refuses_bad_arguments() -> None:
    x, t, u, fb = (torch.zeros(2, 4, device=GPU), torch.ones(2, device=GPU), torch.zeros(2, device=GPU),
                   torch.zeros(2, dtype=torch.long, device=GPU))
    for args, what in [((x.double(), t, u, fb), "float32"), ((x, t[:1], u, fb), "temperature"),
                       ((x, t, u, fb.int()), "fallback"), ((x, t, u.double(), fb), "u must")]:
        with pytest.raises(ValueError, match=what):
            fused_ops.sample_rows(*args)
    p, o, c = torch.ones(2, 4, device=GPU) / 4, torch.zeros(2, 4, dtype=torch.long, device=GPU), torch.zeros(2, 5, device=GPU)
    for args, what in [((p.double(), o, c, fb), "float32"), ((p, o[:, :3], c, fb), "order"),
                       ((p, o, c[:, :4], fb), "cols"), ((p, o, c, fb[:1]), "fallback")]:
        with pytest.raises(ValueError, match=what):
            fused_ops.sample_sorted(*args, False)


def test_cpu_zero_past_is_the_masked_copy_of_the_slot_table():
    """The padding forward_batch promises (columns past a row's length hold slot 0), as one copy;
    the source table (a view with a row stride, as step_inputs hands it) is not written."""
    if not cpu_ops.available():
        pytest.skip("the CPU ops cannot be built here")
    table = torch.randint(1, 1000, (6, 40), dtype=torch.int64)
    view = table[:, :25]
    lens = torch.tensor([25, 0, 1, 24, 7, 30], dtype=torch.int64)  # (a length past n keeps the whole row)
    before = table.clone()
    got = cpu_ops.zero_past(view, lens)
    want = view.masked_fill(torch.arange(25)[None, :] >= lens[:, None], 0)
    assert torch.equal(got, want) and torch.equal(table, before)
    with pytest.raises(RuntimeError, match="seq_lens"):
        cpu_ops.zero_past(view, lens[:3])
