"""The ``cpu`` attention backend (C++ kernel reading the paged pool in place) against torch_native:
the conformance suite in three dtypes, shapes beyond it (SmolLM2's 9/3 heads, extends longer than
one task, windows and caps across key blocks, odd head dims), the same greedy tokens from an engine,
the default-backend policy, and clear errors where the kernel cannot be built.

The kernel compiles once per machine (cached under the torch extensions folder); the ``kernel``
fixture builds it once per session, or skips everything with the reason where no toolchain exists.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from core.errors import CoreError
from core.interfaces import AttentionConfig
from core.plugins import load_plugins
from core import testing as kit
from core.testing import AttentionCase
from core.testing.attention import AttentionSubject, check_case
from core_kernels import cpp_build
from core_plugins.attention import cpu as cpu_plugin
from core_plugins.attention import default as builtin_choice
from core_plugins.attention.cpu import CpuBackend
from tests.conftest import greedy, hf_logprobs, make_engine

pytest_plugins = ["core.testing.pytest_plugin"]  # a no-op where its pytest11 entry point loaded it
CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def kernel():
    if problem := cpp_build.toolchain_problem():
        pytest.skip(f"the cpu attention kernel cannot be built here: {problem}")
    return cpu_plugin.load_kernel()


@pytest.fixture
def attention_backend(kernel):
    return "cpu"


@pytest.fixture(params=[torch.float32, torch.bfloat16, torch.float16], ids=str)
def attention_dtype(request):
    return request.param


TestCpuConformance = kit.attention_backend_conformance  # every case of the kit, in each dtype above

# Shapes the kit's cases do not reach: 9 query heads on 3 KV heads (SmolLM2), extends longer than one
# task (16 tokens at 3 heads per KV head), windows and soft caps over several 32-key blocks, head dims
# without a specialised kernel (16, 96) or of no whole number of vectors (20: the scalar extend path),
# one step mixing a long decode with a prefix-hit extend, and decodes over several 256-key chunks.
EXTRA_CASES = [
    AttentionCase("smollm2_prefill_prefix", (0, 37), ((70, 45), (1, 1)), num_heads=9, num_kv_heads=3, page_size=16),
    AttentionCase("smollm2_page_1", (5, 90), ((33, 1), (1, 1)), num_heads=9, num_kv_heads=3, page_size=1),
    AttentionCase("window_blocks", (100, 0), ((1, 80), (1, 1)), num_heads=6, num_kv_heads=2, sliding_window=40),
    AttentionCase("soft_cap_blocks", (70, 0), ((1, 50), (1, 1)), num_heads=8, num_kv_heads=1, logit_cap=5.0),
    AttentionCase("head_dim_16", (20, 0), ((1, 21), (1, 1)), head_dim=16),
    AttentionCase("head_dim_32", (30, 5), ((1, 13), (1, 1)), head_dim=32),
    AttentionCase("head_dim_96_mha", (40, 3), ((1, 29),), num_heads=3, num_kv_heads=3, head_dim=96, page_size=1),
    # a head dim that is no whole number of vectors: the scalar extend path, windowed and capped
    AttentionCase("head_dim_20_window_cap", (60, 0), ((1, 45), (1, 1)), num_heads=4, num_kv_heads=2, head_dim=20,
                  sliding_window=30, logit_cap=8.0),
    # a prompt of many tasks and key blocks, the mask on the blocks past each task's first token
    AttentionCase("long_prompt", (0,), ((300,),), num_heads=9, num_kv_heads=3),
    AttentionCase("mixed_long", (260, 0, 40), ((1, 20, 17), (1, 1, 1)), num_heads=9, num_kv_heads=3),
    AttentionCase("head_dim_128_gqa", (50, 9), ((1, 40),), num_heads=16, num_kv_heads=4, head_dim=128, page_size=16),
    # bf16 decodes walk keys in chunks of 256 with an online softmax between chunks
    AttentionCase("decode_chunks", (600, 255), ((1, 1), (1, 1)), num_heads=9, num_kv_heads=3),
    AttentionCase("window_chunks", (700,), ((1,), (1,)), num_heads=4, num_kv_heads=2, sliding_window=300),
    # group sizes with and without every head's V accumulators in registers
    AttentionCase("mha_decode", (90, 31), ((1, 1),), num_heads=4, num_kv_heads=4),
    AttentionCase("group_of_5", (90, 31), ((1, 1),), num_heads=10, num_kv_heads=2),
    AttentionCase("group_of_2_d128", (90, 31), ((1, 1),), num_heads=4, num_kv_heads=2, head_dim=128),
    # enough decodes for one task per sequence (all KV heads together)
    AttentionCase("many_decodes", tuple(7 + 29 * i for i in range(20)), ((1,) * 20, (1,) * 20), num_heads=9,
                  num_kv_heads=3),
    AttentionCase("many_decodes_window", tuple(11 + 31 * i for i in range(20)), ((1,) * 20,), num_heads=4,
                  num_kv_heads=2, head_dim=128, sliding_window=200),
    # few decodes over long contexts: each one's keys split over tasks, then merged
    AttentionCase("one_long_decode", (1300,), ((1,), (1,)), num_heads=4, num_kv_heads=1),
    AttentionCase("two_long_decodes", (700, 1030), ((1, 1),), num_heads=9, num_kv_heads=3),
    AttentionCase("long_decode_window", (1500,), ((1,),), num_heads=8, num_kv_heads=2, head_dim=128,
                  sliding_window=600),
    AttentionCase("long_decode_and_extend", (900, 40), ((1, 9),), num_heads=4, num_kv_heads=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", EXTRA_CASES, ids=lambda c: c.name)
def test_matches_torch_native_beyond_the_kit(kernel, case, dtype):
    check_case(AttentionSubject.build(CpuBackend, device="cpu", dtype=dtype), case)


def _one_step(dtype: torch.dtype, threads: int, q_view: bool = False) -> torch.Tensor:
    """Output of one mixed step (decodes and extends) on a fixed pool with ``threads`` threads."""
    from core.interfaces import AttentionLayerSpec
    from core.testing.paged import PagedPool, Seq, make_batch

    gen = torch.Generator().manual_seed(3)
    pool = PagedPool(1, 3, 64, dtype, CPU, 16, 64)
    seqs, new = [Seq() for _ in range(6)], [1, 1, 40, 1, 7, 1]
    for i, s in enumerate(seqs):
        pool.grow(s, 30 * i + 5)
    for buf in (pool.kv.k[0], pool.kv.v[0]):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    backend = CpuBackend(AttentionConfig(1, 9, 3, 64, dtype, CPU, pool.kv))
    batch = make_batch(seqs, new, backend, CPU)
    t = sum(new)
    q = torch.randn(t, 9 * 64 + 32, generator=gen).to(dtype)
    q = q[:, 32:].view(t, 9, 64) if q_view else q[:, 32:].contiguous().view(t, 9, 64)
    kv = torch.randn(2, t, 3, 64, generator=gen).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        backend.prepare(batch)
        return backend.forward(q, kv[0], kv[1], AttentionLayerSpec(0, 9, 3, 64, 0.125), batch)
    finally:
        torch.set_num_threads(before)


def test_decode_with_only_very_negative_scores(kernel):
    """Every score of a decode far below zero (here -400 to -300): the softmax over them is still
    the softmax, not uniform weights (a decode path that starts its running max at a finite
    floor would flatten them)."""
    from core.interfaces import AttentionLayerSpec
    from core.testing.paged import PagedPool, Seq, make_batch
    from core_plugins.attention.torch_native import TorchNativeBackend

    dtype, n = torch.bfloat16, 40
    pool = PagedPool(1, 1, 64, dtype, CPU, 1, 64)
    seq = Seq()
    pool.grow(seq, n)
    direction = torch.zeros(64)
    direction[0] = 1.0
    keys = torch.linspace(300.0, 400.0, n)[:, None] * direction  # score = (q . k) * 0.125 = -key[0]
    slots = torch.tensor(seq.slots)
    pool.kv.k[0][slots] = keys[:, None, :].to(dtype)
    pool.kv.v[0][slots] = torch.randn(n, 1, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    q = (-8.0 * direction)[None, None, :].expand(1, 3, 64).to(dtype).contiguous()
    spec = AttentionLayerSpec(0, 3, 1, 64, 0.125)
    outs = []
    for backend_cls in (CpuBackend, TorchNativeBackend):
        backend = backend_cls(AttentionConfig(1, 3, 1, 64, dtype, CPU, pool.kv))
        batch = make_batch([seq], [1], backend, CPU)
        backend.prepare(batch)
        outs.append(backend.forward(q, pool.kv.k[0][slots[-1:]], pool.kv.v[0][slots[-1:]], spec, batch).float())
    got, want = outs
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_thread_count_and_strided_q_do_not_change_the_result(kernel, dtype):
    """Each (sequence, KV head, tokens) task runs whole on one thread, so the sums are the same."""
    one = _one_step(dtype, 1)
    assert torch.equal(one, _one_step(dtype, 2))
    assert torch.equal(one, _one_step(dtype, 2, q_view=True))  # q rows strided inside a wider tensor


# --------------------------------------------------------------------------- engine


@pytest.mark.parametrize("opts", [dict(page_size=1), dict(page_size=16, chunked_prefill_size=16, enable_mixed_chunk=True)],
                         ids=["page_1", "page_16_mixed_chunks"])
def test_engine_greedy_tokens_equal_torch_native(kernel, tiny_llama, opts):
    path, _ = tiny_llama()
    prompts = ["hello world", "abcabcabc abcabcabc abcabcabc abc", "a longer prompt: " * 3, "x"]
    more = [p + " and then some" for p in prompts]  # a second round: prefix-cache hits
    got = {}
    for backend in ("torch_native", "cpu"):
        eng = make_engine(path, attention_backend=backend, **opts)
        try:
            assert eng.engine.attention_backend_name == backend
            got[backend] = [[o["output_ids"] for o in eng.generate(ps, greedy(12))] for ps in (prompts, more)]
        finally:
            eng.shutdown()
    assert got["cpu"] == got["torch_native"]


def test_bfloat16_engine_is_as_close_to_float32_as_torch_native(kernel, tiny_llama):
    """In bf16 the kernel rounds differently from torch_native (which rounds scores and probabilities to
    bf16 as transformers does), but its prompt logprobs are no further from the float32 model's."""
    path, hf = tiny_llama()
    prompt = [(7 * i + 3) % 250 + 3 for i in range(60)]
    want = hf_logprobs(hf, prompt)[torch.arange(59), torch.tensor(prompt[1:])]
    err = {}
    for backend in ("torch_native", "cpu"):
        eng = make_engine(path, skip_tokenizer_init=True, dtype="bfloat16", attention_backend=backend)
        try:
            out = eng.generate(input_ids=prompt, sampling_params=greedy(1), return_logprob=True, logprob_start_len=0)
        finally:
            eng.shutdown()
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
        err[backend] = (got - want).abs()
    assert err["cpu"].max() < 0.5 and err["cpu"].mean() <= 1.25 * err["torch_native"].mean(), err


# --------------------------------------------------------------------------- default and errors


def test_cpu_is_the_default_on_cpu_once_built(kernel):
    assert cpu_plugin.kernel_status(build=True)[0]
    name, why, chooser = load_plugins().choose_attention_backend(CPU, object())  # an engine start (has a model)
    assert (name, chooser) == ("cpu", "attention_default") and "C++ paged-attention kernel" in why


def test_policy_falls_back_to_torch_native_when_the_kernel_is_unusable(monkeypatch):
    monkeypatch.setattr(cpu_plugin, "kernel_status", lambda build=True: (False, "no C++ compiler: 'c++' is not on PATH"))
    name, why = builtin_choice.choose_attention_backend(CPU, object(), ["torch_native", "cpu"])
    assert name == "torch_native" and "no C++ compiler" in why


def test_listing_plugins_never_compiles(monkeypatch):
    """`core plugins` asks without a model: with a toolchain but no build yet it answers cpu, compiling nothing."""
    monkeypatch.setattr(cpp_build, "toolchain_problem", lambda: None)
    monkeypatch.setattr(cpu_plugin, "is_built", lambda: False)
    monkeypatch.setattr(cpu_plugin, "load_kernel", lambda: pytest.fail("compiled while listing plugins"))
    cpu_plugin.kernel_status.cache_clear()
    try:
        ok, why = cpu_plugin.kernel_status(build=False)
    finally:
        cpu_plugin.kernel_status.cache_clear()
    assert ok and "first engine start" in why


@pytest.fixture
def fresh_kernel_cache():
    """load_kernel / kernel_status forget their results before and after (the real kernel reloads from disk)."""
    for f in (cpu_plugin.load_kernel, cpu_plugin.kernel_status):
        f.cache_clear()
    yield
    for f in (cpu_plugin.load_kernel, cpu_plugin.kernel_status):
        f.cache_clear()


def test_no_compiler_is_a_core_error_naming_it(monkeypatch, fresh_kernel_cache):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(CoreError, match=r"cannot be built: no C\+\+ compiler: '/nonexistent/c\+\+' is not on PATH"):
        CpuBackend(AttentionConfig(1, 4, 2, 64, torch.float32, CPU, None))
    ok, why = cpu_plugin.kernel_status(build=True)
    assert not ok and "no C++ compiler" in why


def test_a_compile_error_is_a_core_error_with_the_compiler_message(tmp_path, monkeypatch, fresh_kernel_cache):
    if cpp_build.toolchain_problem():
        pytest.skip("needs a C++ toolchain")
    broken = tmp_path / "cpu_attention.cpp"
    broken.write_text("#error deliberately broken kernel\n")
    monkeypatch.setattr(cpu_plugin, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(CoreError, match=r"cannot be built: compiling failed: .*deliberately broken kernel"):
        cpu_plugin.load_kernel()


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 only: AVX2 code generation")
def test_an_avx2_only_build_passes_too(kernel):
    """Code generated for an AVX2 CPU without AVX-512 (-march=haswell) builds and agrees with torch_native
    (run here only where this CPU has AVX2, which every -march=haswell binary needs)."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    script = textwrap.dedent("""
        import torch
        from core_kernels import cpp_build
        from core_plugins.attention import cpu
        cpp_build.flags = lambda: ["-O3", "-fopenmp", "-march=haswell"]
        from core.testing import ATTENTION_CASES
        from core.testing.attention import AttentionSubject, check_case
        for dtype in (torch.float32, torch.bfloat16):
            subject = AttentionSubject.build(cpu.CpuBackend, device="cpu", dtype=dtype)
            for case in ATTENTION_CASES:
                check_case(subject, case)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_a_built_kernel_loads_past_a_lock_left_by_a_killed_build(kernel, monkeypatch, fresh_kernel_cache):
    """torch's build path waits on a lock file; a process killed while holding it must not leave
    every later start waiting: a built library is loaded without touching the lock."""
    d = cpp_build.build_dir(cpu_plugin.PREFIX, cpu_plugin.SOURCE)
    lock = d / "lock"
    lock.touch()
    try:
        proc = subprocess.run([sys.executable, "-c", "from core_plugins.attention import cpu; cpu.load_kernel(); print('ok')"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
    finally:
        lock.unlink(missing_ok=True)
