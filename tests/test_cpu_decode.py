"""A Llama decoder layer as one C++ op (``kernels/cpu_decode``): same tokens as the Python forward
it replaces, at every batch size, taken only where every piece has its C++ kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from core_kernels import cpu_decode, cpu_gemv
from tests.conftest import greedy, make_engine

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="needs the C++ CPU kernels (a C++ compiler); "
                                "elsewhere layers keep their Python forward")
needs_gemv = pytest.mark.skipif(not cpu_gemv.available(), reason="int4/int8 layers take the op through kernels/cpu_gemv, "
                                "which needs AVX512-BF16")
needs_gemv_f32 = pytest.mark.skipif(not cpu_gemv.available_f32(), reason="float32 int4/int8 layers take the op through "
                                    "kernels/cpu_gemv's AVX2 kernels, which need AVX2 and FMA")
# the stack's activation dtypes, each where this CPU has its gemv kernels
DTYPES = [pytest.param(torch.bfloat16, marks=needs_gemv, id="bf16"), pytest.param(torch.float32, marks=needs_gemv_f32, id="f32")]

PROMPTS = ["a", "hello world", "abc abc abc abc", "xy"]
REAL_RUN, REAL_PLAN, REAL_STACK, REAL_PLAN_STACK = cpu_decode.run, cpu_decode.plan, cpu_decode.run_stack, cpu_decode.plan_stack
REAL_STACK_HEAD, REAL_DECODE = cpu_decode.run_stack_head, cpu_decode.decode
STACK_ROWS: list[int] = []  # the row counts of the last generate's stack ops
HEAD_ROWS: list[int] = []  # those of its stack ops that ran the LM head too
DECODE_ROWS: list[int] = []  # those of them that ran whole decode steps from the lists (cpu_decode.decode)


def generate(path, monkeypatch, fast: bool, prompts: list[str] = PROMPTS, dtype: str = "bfloat16", stack: bool = True,
             **opts) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of ``prompts`` (all together, batch sizes shrinking as requests finish, then
    the first two alone), and the row counts of the forwards the C++ ops ran (a stack's counted
    once per layer); ``stack=False`` keeps the one-op layers from being joined into one op."""
    calls = []
    STACK_ROWS.clear()
    HEAD_ROWS.clear()
    DECODE_ROWS.clear()
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(a[1].shape[0]) or REAL_RUN(*a))
    monkeypatch.setattr(cpu_decode, "run_stack", lambda p, x, b: STACK_ROWS.append(x.shape[0])
                        or calls.extend([x.shape[0]] * p["layers"]) or REAL_STACK(p, x, b))
    monkeypatch.setattr(cpu_decode, "run_stack_head", lambda p, x, b: STACK_ROWS.append(x.shape[0])
                        or HEAD_ROWS.append(x.shape[0]) or calls.extend([x.shape[0]] * p["layers"])
                        or REAL_STACK_HEAD(p, x, b))
    monkeypatch.setattr(cpu_decode, "decode", lambda p, ids, *a: STACK_ROWS.append(len(ids)) or HEAD_ROWS.append(len(ids))
                        or DECODE_ROWS.append(len(ids)) or calls.extend([len(ids)] * p["layers"]) or REAL_DECODE(p, ids, *a))
    monkeypatch.setattr(cpu_decode, "plan", REAL_PLAN if fast else (lambda *a: None))
    monkeypatch.setattr(cpu_decode, "plan_stack", REAL_PLAN_STACK if stack else (lambda *a: None))
    eng = make_engine(path, dtype=dtype, **opts)
    try:
        together = [o["output_ids"] for o in eng.generate(prompts, [greedy(6 + 3 * (i % 4)) for i in range(len(prompts))])]
        alone = [eng.generate(p, greedy(8))["output_ids"] for p in prompts[:2]]
    finally:
        eng.shutdown()
    return together + alone, calls


@pytest.mark.parametrize("quant,variant", [
    pytest.param("int4wo-32", {}, marks=needs_gemv), pytest.param("int8wo", {}, marks=needs_gemv),
    pytest.param("int4wo-32", {"attention_bias": True}, marks=needs_gemv), (None, {}), (None, {"attention_bias": True})],
                         ids=["int4", "int8", "int4_with_biases", "unquantized", "unquantized_with_biases"])
def test_same_tokens_as_the_python_forward(tiny_llama, monkeypatch, quant, variant):
    path, _ = tiny_llama(**variant)
    opts = {"torchao_config": quant} if quant else {}
    want, none = generate(path, monkeypatch, False, attention_backend="cpu", **opts)
    got, used = generate(path, monkeypatch, True, attention_backend="cpu", **opts)
    assert not none and used
    assert got == want


@needs_gemv
def test_many_rows_use_the_dense_gemm_inside_the_op(tiny_llama, monkeypatch):
    """Batches past the gemv kernels' row limit (and prefills) run the layers' dense GEMMs from the
    op; the tokens stay those of the Python forward."""
    from core_plugins.quant import packed

    path, _ = tiny_llama()
    monkeypatch.setattr(packed, "_dense_beats_gemv", lambda dtype: True)  # (a CPU where the copies serve)
    probe = make_engine(path, dtype="bfloat16", torchao_config="int4wo-32", attention_backend="cpu")
    try:
        down = probe.engine.model.model.layers[0].mlp.down_proj
        limit = packed._dense_from(down, down.dense_weight)
    finally:
        probe.shutdown()
    prompts = [chr(97 + i) * (i + 1) for i in range(limit + 3)]
    want, _ = generate(path, monkeypatch, False, prompts, torchao_config="int4wo-32", attention_backend="cpu")
    got, rows = generate(path, monkeypatch, True, prompts, torchao_config="int4wo-32", attention_backend="cpu")
    assert got == want
    assert max(rows) > limit and min(rows) < limit  # both sides of the gemv limit ran in the op


def test_float32_layers_take_it_too(tiny_llama, monkeypatch):
    path, _ = tiny_llama()
    want, _ = generate(path, monkeypatch, False, dtype="float32", attention_backend="cpu")
    got, used = generate(path, monkeypatch, True, dtype="float32", attention_backend="cpu")
    assert used and got == want


@needs_gemv
def test_other_backends_keep_the_python_forward(tiny_llama, monkeypatch):
    path, _ = tiny_llama()
    _, used = generate(path, monkeypatch, True, torchao_config="int4wo-32", attention_backend="torch_native")
    assert not used


def test_an_avx2_only_build_takes_it_in_float32(tiny_llama):
    """What an AVX2-only CPU runs by default (fp32): every C++ library built for -march=haswell (no
    AVX-512 paths, no gemv), the one-op layers taken, the same tokens as the Python forward."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    path, _ = tiny_llama()
    script = textwrap.dedent("""
        import sys
        from core_kernels import cpp_build
        cpp_build.flags = lambda: ["-O3", "-fopenmp", "-march=haswell"]
        from core_kernels import cpu_decode
        from tests.conftest import greedy, make_engine

        runs, real_run = [], cpu_decode.run
        cpu_decode.run = lambda *a: runs.append(1) or real_run(*a)

        def tokens():
            eng = make_engine(sys.argv[1], attention_backend="cpu", cpu_threads=2)
            try:
                return [o["output_ids"] for o in eng.generate(["a", "hello world", "abc abc"], [greedy(8)] * 3)]
            finally:
                eng.shutdown()

        fast, used = tokens(), len(runs)
        cpu_decode.plan = lambda *a: None
        slow = tokens()
        assert used and fast == slow, (used, fast, slow)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# ---- the whole stack as one op (cpu_decode.run_stack) ----

def random_packed(n: int, k: int, kind: int, dtype: torch.dtype, g: torch.Generator,
                  group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed random weight of ``n`` rows and ``k`` columns: (codes, scales) of kind 0 (int4,
    scales and zeros per ``group`` columns), 1 (int8, per-row scales) or 3 (int8 blocks, the LM
    head's: fp16 scales per row and run of 32 columns)."""
    if kind == 3:
        return (cpu_gemv.pack_int8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)),
                cpu_gemv.pack_block_scales(0.001 + 0.002 * torch.rand(n, k // 32, generator=g)))
    if kind == 0:
        q = torch.randint(0, 16, (n, k), generator=g)
        return cpu_gemv.pack(q, 0.02 * torch.rand(n, k // group, generator=g), 0.01 * torch.randn(n, k // group, generator=g),
                             dtype)
    return (cpu_gemv.pack_int8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)),
            (0.001 + 0.002 * torch.rand(n, generator=g)).to(dtype))


def random_stack(layers: int, kinds: list[int], bias: bool, seed: int = 0, hid: int = 64, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 16, inter: int = 96, group: int = 32, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Packed random layers (linear i of layer l of kind ``kinds[(5 * l + i) % len(kinds)]``) and the
    arguments both ops share, for activations of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [((heads + 2 * kv_heads) * head_dim, hid), (hid, heads * head_dim), (inter, hid), (inter, hid), (hid, inter)]
    per_layer, stack, kind_list = [], [], []
    for l in range(layers):
        norms = [(1 + 0.1 * torch.randn(hid, generator=g)).to(dtype) for _ in range(2)]
        lin, flat = [], [*norms]
        for i, (n, k) in enumerate(shapes):
            kind = kinds[(5 * l + i) % len(kinds)]
            a, b = random_packed(n, k, kind, dtype, g, group)
            bi = (0.1 * torch.randn(n, generator=g)).to(dtype) if bias and i in (0, 2) else cpu_decode._EMPTY
            lin += [a, b, bi, cpu_decode._EMPTY]
            flat += [a, b, bi]
            kind_list.append(kind)
        per_layer.append((norms, lin, kind_list[-5:]))
        stack += flat
    rot = head_dim // 2  # partial rotary: the rest of each head passes through
    pos = torch.arange(64, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(0, rot, 2) / rot))
    cos, sin = torch.cat([pos.cos()] * 2, 1).contiguous(), torch.cat([pos.sin()] * 2, 1).contiguous()
    return {"per_layer": per_layer, "stack": stack, "kinds": kind_list, "rotary": (cos, sin, rot),
            "heads": (heads, kv_heads, head_dim), "hid": hid, "g": g, "dtype": dtype}


def random_head(n: int, k: int, kind: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    """A packed random LM head of ``n`` rows and ``k`` columns: [codes, scales] of kind 0 (int4) or 1 (int8)."""
    return list(random_packed(n, k, kind, dtype, torch.Generator().manual_seed(seed)))


def run_both(s: dict, seq_lens: list[int], extend_lens: list[int], threads: int, head: list[torch.Tensor] | None = None,
             head_kind: int = 1):
    """(h, mlp_out, K caches, V caches) from a chain of decode_layer and from a DecodeStack, on one
    batch of sequences over random, already filled caches; with ``head`` ([final norm, codes,
    scales]), the stack's ``run_head`` outputs (hidden, logits) after those."""
    g, (heads, kv_heads, head_dim), hid = s["g"], s["heads"], s["hid"]
    rows = sum(extend_lens)
    slots = 128
    caches = [torch.randn(slots, kv_heads, head_dim, generator=g).to(s["dtype"]) for _ in range(2 * len(s["per_layer"]))]
    width = max(seq_lens)
    kv_indices = torch.zeros(len(seq_lens), width, dtype=torch.long)
    perm = torch.randperm(slots, generator=g)
    used = 0
    for b, n in enumerate(seq_lens):
        kv_indices[b, :n] = perm[used:used + n]
        used += n
    positions = torch.cat([torch.arange(n - e, n) for n, e in zip(seq_lens, extend_lens)])
    out_loc = torch.cat([kv_indices[b, n - e:n] for b, (n, e) in enumerate(zip(seq_lens, extend_lens))])
    x = torch.randn(rows, hid, generator=g).to(s["dtype"])
    cos, sin, rot = s["rotary"]
    sl, el = torch.tensor(seq_lens), torch.tensor(extend_lens)
    attn = dict(kv_indices=kv_indices, seq_lens=sl, extend_lens=el, scale=head_dim ** -0.5, window=0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ka, va = [c.clone() for c in caches[0::2]], [c.clone() for c in caches[1::2]]
        h, res = x, None
        for l, (norms, lin, kinds) in enumerate(s["per_layer"]):
            h, res = torch.ops.core_cpu_decode.decode_layer(
                h, res, norms[0], norms[1], 1e-5, lin, kinds, [1 << 30] * 5, positions, cos, sin, rot, heads, kv_heads,
                head_dim, ka[l], va[l], out_loc, kv_indices, sl, el, attn["scale"], 0, 0.0)
        kb, vb = [c.clone() for c in caches[0::2]], [c.clone() for c in caches[1::2]]
        stack = torch.classes.core_cpu_decode.DecodeStack(s["stack"], s["kinds"], 1e-5, cos, sin, rot, heads, kv_heads,
                                                          head_dim, kb, vb, attn["scale"], 0, head or [], head_kind, 1e-5)
        h2, res2 = stack.run(x, positions, out_loc, kv_indices, sl, el)
        # run_head rewrites the same cache rows with the same values
        tail = stack.run_head(x, positions, out_loc, kv_indices, sl, el) if head else ()
    finally:
        torch.set_num_threads(before)
    return (h, res, ka, va), (h2, res2, kb, vb, *tail)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", ["int4wo-32", "int8wo"])
@pytest.mark.parametrize("step", ["decode", "forward"])
def test_the_stack_gives_the_tokens_of_the_layer_ops(tiny_llama, monkeypatch, quant, dtype, step):
    """Batches of a few rows (decodes and short prefills) take the whole stack as one op, decodes
    with the final norm and the LM head, and the tokens are those of the one-op layers: decodes
    from the scheduler's lists (the model's decode_step), or, without that, through the model's
    forward with the embedded rows."""
    path, _ = tiny_llama()
    opts = dict(attention_backend="cpu", torchao_config=quant, cpu_threads=2, dtype=str(dtype).removeprefix("torch."))
    want, rows = generate(path, monkeypatch, True, stack=False, **opts)
    assert rows and not STACK_ROWS
    from core.layers import VocabEmbedding
    from core_plugins.models.llama import LlamaForCausalLM

    if step == "forward":
        monkeypatch.setattr(LlamaForCausalLM, "decode_step", lambda *a: None)
    # the hidden states the stack returned with its logits: the head's own op never sees them again
    with_logits: list[torch.Tensor] = []

    def kept(real):
        def run(*args):
            out = real(*args)
            with_logits.append(out[0])
            return out
        return run

    # what generate()'s counting wrappers call
    monkeypatch.setitem(globals(), "REAL_STACK_HEAD", kept(REAL_STACK_HEAD))
    monkeypatch.setitem(globals(), "REAL_DECODE", kept(REAL_DECODE))
    head_op = VocabEmbedding.logits
    recomputed = []
    monkeypatch.setattr(VocabEmbedding, "logits", lambda self, h: recomputed.append(any(h.data_ptr() == t.data_ptr() for t in with_logits))
                        or head_op(self, h))
    got, _ = generate(path, monkeypatch, True, **opts)
    assert got == want
    assert 1 in STACK_ROWS and max(STACK_ROWS) > 1
    assert 1 in HEAD_ROWS and max(HEAD_ROWS) > 1  # decodes run the packed LM head inside the stack
    assert (DECODE_ROWS == HEAD_ROWS) if step == "decode" else not DECODE_ROWS
    assert with_logits and recomputed and not any(recomputed)  # prefills still call the head op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kinds,bias", [([0], False), ([1], False), ([0, 1, 1], True)], ids=["int4", "int8", "mixed_with_biases"])
@pytest.mark.parametrize("batch", [([9], [1]), ([5, 30], [1, 1]), ([40, 7, 3], [1, 1, 1]), ([12, 6], [2, 1])],
                         ids=["one_decode", "two_decodes", "three_decodes", "extend_and_decode"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_stack_op_equals_the_chain_of_layer_ops(kinds, bias, batch, threads, dtype):
    """Bit for bit: the outputs and every layer's cache writes (MLP width 96; in bf16 the gated
    activation's last 32 elements take torch's scalar path; partial rotary), in bf16 (AVX512-BF16
    kernels) and float32 (AVX2 kernels)."""
    from core_plugins.attention import cpu

    cpu.load_kernel()
    want, got = run_both(random_stack(3, kinds, bias, dtype=dtype), *batch, threads)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    for a, b in zip(want[2] + want[3], got[2] + got[3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [0, 1, 3], ids=["int4_head", "int8_head", "int8_blocks_head"])
@pytest.mark.parametrize("batch", [([9], [1]), ([40, 7, 3], [1, 1, 1]), ([12, 6], [2, 1])],
                         ids=["one_decode", "three_decodes", "extend_and_decode"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_stack_with_its_head_equals_the_norm_and_head_ops(kind, batch, threads, dtype):
    """run_head: the layers as run() gives them, then bit for bit what the model's final norm of
    h + mlp_out and the head's gemv op (its Python path) give."""
    from core_kernels import cpu_ops
    from core_plugins.attention import cpu

    cpu.load_kernel()
    s = random_stack(2, [0, 1], False, dtype=dtype)
    norm = (1 + 0.1 * torch.randn(s["hid"], generator=s["g"])).to(dtype)
    head = random_head(160, s["hid"], kind, dtype)
    _, (h, res, *_, hidden, logits) = run_both(s, *batch, threads, [norm, *head], kind)
    want = cpu_ops.rms_norm(h + res, norm, 1e-5, 0.0)
    assert torch.equal(hidden, want)
    mm = {0: cpu_gemv.mm, 1: cpu_gemv.mm_int8, 3: cpu_gemv.mm_int8_blocks}[kind]
    assert logits.shape == (sum(batch[1]), 160) and torch.equal(logits, mm(want, *head))
    assert logits.dtype == (torch.float32 if kind == 3 else dtype)  # int8 blocks: float32 logits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 96], ids=["rows_shared_out", "rows_in_every_thread"])
@pytest.mark.parametrize("batch", [([9, 8, 7, 6, 5, 4, 3, 2, 1, 10], [1] * 10), ([20, 6], [12, 1])],
                         ids=["ten_decodes", "extend_and_decode"])
@pytest.mark.parametrize("threads", [2, 3])
def test_many_rows_give_the_bits_of_the_layer_ops(inter, batch, threads, dtype):
    """From 8 rows the threads share the row loops between the GEMMs out where the MLP width is a
    multiple of 64 (128 here; 96 keeps every thread running all rows): the outputs, the cache
    writes and run_head's hidden and logits are still bit for bit those of the layer ops, the
    final norm and the head op, with an uneven split (13 rows on 3 threads) too."""
    from core_kernels import cpu_ops
    from core_plugins.attention import cpu

    cpu.load_kernel()
    s = random_stack(3, [0, 1, 1], True, inter=inter, dtype=dtype)
    norm = (1 + 0.1 * torch.randn(s["hid"], generator=s["g"])).to(dtype)
    head = random_head(160, s["hid"], 0, dtype)
    want, (h, res, kb, vb, hidden, logits) = run_both(s, *batch, threads, [norm, *head], 0)
    assert torch.equal(want[0], h) and torch.equal(want[1], res)
    assert all(torch.equal(a, b) for a, b in zip(want[2] + want[3], kb + vb))
    ref = cpu_ops.rms_norm(h + res, norm, 1e-5, 0.0)
    assert torch.equal(hidden, ref) and torch.equal(logits, cpu_gemv.mm(ref, *head))


def decode_setup(dtype: torch.dtype, seq_lens: list[int], vocab: int = 160, seed: int = 0, head_kind: int = 1) -> dict:
    """A random two-layer stack with an int8 head of 160 rows and an embedding table of ``vocab``
    rows, caches already filled, and one decode row per sequence of ``seq_lens``."""
    s = random_stack(2, [0, 1], False, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = s["heads"]
    slots, b = 128, len(seq_lens)
    kv_indices = torch.zeros(b, max(seq_lens), dtype=torch.long)
    perm, used = torch.randperm(slots, generator=g), 0
    for i, n in enumerate(seq_lens):
        kv_indices[i, :n] = perm[used:used + n]
        used += n
    return {"s": s, "norm": (1 + 0.1 * torch.randn(s["hid"], generator=g)).to(dtype), "head": random_head(160, s["hid"], head_kind, dtype),
            "head_kind": head_kind,
            "table": torch.randn(vocab, s["hid"], generator=g).to(dtype), "kv_indices": kv_indices, "seq_lens": seq_lens,
            "ids": torch.randint(0, vocab, (b,), generator=g).tolist(), "positions": [n - 1 for n in seq_lens],
            "out_loc": [int(kv_indices[i, n - 1]) for i, n in enumerate(seq_lens)],
            "caches": [torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype) for _ in range(4)]}


def decode_stack(d: dict, embedding: bool = True):
    s, (heads, kv_heads, head_dim) = d["s"], d["s"]["heads"]
    cos, sin, rot = s["rotary"]
    caches = [c.clone() for c in d["caches"]]
    stack = torch.classes.core_cpu_decode.DecodeStack(s["stack"], s["kinds"], 1e-5, cos, sin, rot, heads, kv_heads, head_dim,
                                                      caches[0::2], caches[1::2], head_dim ** -0.5, 0, [d["norm"], *d["head"]],
                                                      d["head_kind"], 1e-5)
    if embedding:
        stack.set_embedding(d["table"])
    return stack, caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens", [[9], [40, 7, 3]], ids=["one", "three"])
@pytest.mark.parametrize("vocab", [160, 150], ids=["whole_head", "padded_head"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_kind", [1, 3], ids=["int8_head", "int8_blocks_head"])
def test_a_decode_from_lists_is_run_head_on_the_embedded_rows_and_their_argmax(dtype, seq_lens, vocab, threads, head_kind):
    """decode(): bit for bit run_head's hidden, logits and cache writes for the rows of its ids in
    the embedding table, and each row's argmax over its first ``vocab`` logits (the head's other
    rows, padding, never win)."""
    from core_kernels import cpu_ops
    from core_plugins.attention import cpu

    cpu.load_kernel()
    d = decode_setup(dtype, seq_lens, head_kind=head_kind)
    if vocab < 160:  # padding rows that would win: the argmax must not look at them
        if head_kind == 3:  # block scales: [rows / 16, runs, 16]
            d["head"][1][vocab // 16:] = d["head"][1].abs().max() * 100
            d["head"][1][vocab // 16, :, vocab % 16:] = d["head"][1].abs().max() * 100
        else:
            d["head"][1][vocab:] = d["head"][1].abs().max() * 100
    b = len(seq_lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stack_a, caches_a = decode_stack(d)
        hidden_a, logits_a = stack_a.run_head(d["table"][d["ids"]], torch.tensor(d["positions"]), torch.tensor(d["out_loc"]),
                                              d["kv_indices"], torch.tensor(seq_lens), torch.ones(b, dtype=torch.long))
        stack_b, caches_b = decode_stack(d)
        hidden, logits, ids = stack_b.decode(d["ids"], d["positions"], d["out_loc"], d["kv_indices"], seq_lens, vocab)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(hidden, hidden_a) and torch.equal(logits, logits_a)
    assert all(torch.equal(x, y) for x, y in zip(caches_a, caches_b))
    assert ids.dtype == torch.long and ids.tolist() == cpu_ops.argmax(logits[:, :vocab]).tolist()
    if vocab < 160:
        assert (logits[:, vocab:].max(-1).values > logits[:, :vocab].max(-1).values).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("call,message", [
    (lambda st, d: st.decode([d["ids"][0]] * 2, d["positions"], d["out_loc"], d["kv_indices"], d["seq_lens"], 160),
     "one id, position, slot and length per sequence"),
    (lambda st, d: st.decode([160], d["positions"], d["out_loc"], d["kv_indices"], d["seq_lens"], 160),
     "token id 160 outside the embedding's 160 rows"),
    (lambda st, d: st.decode([-1], d["positions"], d["out_loc"], d["kv_indices"], d["seq_lens"], 160), "token id -1"),
    (lambda st, d: st.decode(d["ids"], d["positions"], d["out_loc"], d["kv_indices"], d["seq_lens"], 161),
     r"vocab 161 outside 1\.\.160"),
    (lambda st, d: st.decode(d["ids"], [10_000], d["out_loc"], d["kv_indices"], d["seq_lens"], 160), "outside the rotary cache"),
    (lambda st, d: st.decode(d["ids"], d["positions"], d["out_loc"], d["kv_indices"][:, :3].t().contiguous(), d["seq_lens"], 160),
     "one row per sequence"),
    (lambda st, d: st.set_embedding(d["table"][:, :32].contiguous()), r"embedding table \[vocab, 64\]"),
    (lambda st, d: st.set_embedding(d["table"].double()), r"embedding table \[vocab, 64\] contiguous"),
], ids=["lengths", "id_past_the_table", "negative_id", "vocab_past_the_head", "position", "kv_rows", "table_width", "table_dtype"])
def test_a_decode_refuses_bad_arguments(call, message, dtype):
    """decode() and set_embedding(): an error naming the problem, and the stack still serves."""
    from core_plugins.attention import cpu

    cpu.load_kernel()
    d = decode_setup(dtype, [9])
    stack, _ = decode_stack(d)
    with pytest.raises(RuntimeError, match=message):
        call(stack, d)
    hidden, logits, ids = stack.decode(d["ids"], d["positions"], d["out_loc"], d["kv_indices"], d["seq_lens"], 160)
    assert ids.tolist() == logits.argmax(-1).tolist()
    bare, _ = decode_stack(d, embedding=False)
    with pytest.raises(RuntimeError, match="decode needs a head and an embedding table"):
        bare.decode(d["ids"], d["positions"], d["out_loc"], d["kv_indices"], d["seq_lens"], 160)


def steps_setup(dtype: torch.dtype, seq_lens: list[int], steps: int) -> dict:
    """decode_setup with table columns and slots for ``steps`` steps (step-major ``out_loc``)."""
    d = decode_setup(dtype, seq_lens)
    b, old = len(seq_lens), d["kv_indices"]
    free = sorted(set(range(128)) - set(old.flatten().tolist()))
    kv = torch.zeros(b, max(seq_lens) + steps - 1, dtype=torch.long)
    kv[:, : old.shape[1]] = old
    out_loc = list(d["out_loc"])
    for k in range(1, steps):
        for i, n in enumerate(seq_lens):
            kv[i, n - 1 + k] = slot = free.pop()
            out_loc.append(slot)
    return {**d, "kv_indices": kv, "out_loc": out_loc}


PHASES = ["setup", "rows", "gemm", "gemm_wait", "rotary", "attention", "head", "argmax", "join"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_profiling_splits_the_calls_and_leaves_them_as_they_were(dtype, threads):
    """set_profiling(True): every call adds the seconds of its phases to profile() (the count of
    calls first), within the calls' wall time; the outputs are those of a stack not profiling, bit
    for bit. Turned off, the sums are cleared and nothing more is added."""
    import time

    from core_plugins.attention import cpu

    cpu.load_kernel()
    d = decode_setup(dtype, [40])
    args = (d["ids"], d["positions"], d["out_loc"], d["kv_indices"], d["seq_lens"], 160)
    plain, caches_a = decode_stack(d)
    timed, caches_b = decode_stack(d)
    assert timed.phase_names() == PHASES
    assert timed.profile() == [0.0] * (1 + len(PHASES))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = [plain.decode(*args) for _ in range(3)]
        timed.set_profiling(True)
        t = time.perf_counter()
        got = [timed.decode(*args) for _ in range(3)]
        wall = time.perf_counter() - t
        calls, *seconds = timed.profile()
        timed.set_profiling(False)
        timed.decode(*args)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(x, y) for w, g in zip(want, got) for x, y in zip(w, g))
    assert all(torch.equal(x, y) for x, y in zip(caches_a, caches_b))
    phases = dict(zip(PHASES, seconds))
    assert calls == 3 and all(v >= 0 for v in seconds) and 0 < sum(seconds) <= wall
    for name in ("gemm", "head", "attention", "rows", "argmax"):  # each phase this call has took some time
        assert phases[name] > 0, name
    assert timed.profile() == [0.0] * (1 + len(PHASES))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens", [[9], [40, 7, 3]], ids=["one", "three"])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_steps_are_decodes_fed_their_argmax(dtype, seq_lens, threads):
    """decode_steps(): the tokens and cache writes of ``steps`` decode() calls, each fed the last
    one's argmax; it stops after the first step that produced one of the stop ids."""
    from core_plugins.attention import cpu

    cpu.load_kernel()
    steps, b = 4, len(seq_lens)
    d = steps_setup(dtype, seq_lens, steps)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stack_a, caches_a = decode_stack(d)
        ids, want = d["ids"], []
        for k in range(steps):
            _, _, nxt = stack_a.decode(ids, [p + k for p in d["positions"]], d["out_loc"][k * b : (k + 1) * b],
                                       d["kv_indices"], [n + k for n in seq_lens], 160)
            ids = nxt.tolist()
            want.append(ids)
        stack_b, caches_b = decode_stack(d)
        got = cpu_decode.decode_steps({"stack": stack_b}, d["ids"], d["positions"], d["out_loc"], d["kv_indices"],
                                      seq_lens, 160, steps, [])
        assert got == want
        assert all(torch.equal(x, y) for x, y in zip(caches_a, caches_b))
        # a stop id ends the steps after the first step that produced it (in any row)
        stop = want[1][-1]
        first = next(k for k in range(steps) if stop in want[k])
        stack_c, _ = decode_stack(d)
        got = cpu_decode.decode_steps({"stack": stack_c}, d["ids"], d["positions"], d["out_loc"], d["kv_indices"],
                                      seq_lens, 160, steps, [10_000, stop])
        assert got == want[: first + 1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(steps=0), "steps 0 < 1"),
    (lambda d: d.update(out_loc=d["out_loc"][:-1]), "one slot per sequence and step"),
    (lambda d: d.update(kv_indices=d["kv_indices"][:, :-1].contiguous()), "does not fit 3 steps in the slot table's 10"),
    (lambda d: d.update(positions=[d["positions"][0] + 10_000]), "does not fit 3 steps"),
    (lambda d: d.update(out_loc=d["out_loc"][:-1] + [128]), "slot 128 outside the pool"),
    (lambda d: d.update(ids=[-3]), "token id -3"),
], ids=["no_steps", "slots", "table_columns", "position", "last_slot", "bad_id"])
def test_decode_steps_refuse_bad_arguments(change, message, dtype):
    """An error naming the problem before any step writes the caches, and the stack still serves."""
    from core_plugins.attention import cpu

    cpu.load_kernel()
    d = {**steps_setup(dtype, [9], 3), "steps": 3}
    stack, caches = decode_stack(d)
    change(d)
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match=message):
        stack.decode_steps(d["ids"], d["positions"], d["out_loc"], d["kv_indices"], d["seq_lens"], 160, d["steps"], [])
    assert all(torch.equal(x, y) for x, y in zip(before, caches))
    good = steps_setup(dtype, [9], 3)
    assert len(stack.decode_steps(good["ids"], good["positions"], good["out_loc"], good["kv_indices"], [9], 160, 3, [])) == 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(kinds=[2] * len(a["kinds"])), r"kind 2 is not int4 \(0\)"),
    (lambda a: a.update(stack=a["stack"][:-1]), "per layer 17 tensors"),
    (lambda a: a.update(caches=[c[:, :1] for c in a["caches"]]), r"(BFloat16|Float) caches \[16, 2, 16\]"),
    (lambda a: a.update(caches=[c.double() for c in a["caches"]]), r"(BFloat16|Float) caches"),
    (lambda a: a.update(positions=a["positions"] + 1000), "outside the rotary cache"),
    (lambda a: a.update(out_loc=a["out_loc"] + 1000), "outside the pool"),
    (lambda a: a.update(x=a["x"].to(torch.float32 if a["x"].dtype == torch.bfloat16 else torch.bfloat16)),
     r"contiguous (BFloat16|Float)"),
    (lambda a: a.update(x=a["x"][:, :32].contiguous()), r"\[rows, 64\] contiguous"),
    (lambda a: a.update(no_head=True), "built without a head"),
    (lambda a: a.update(head=[a["x"][0, :32], *random_head(32, 64, 1, a["x"].dtype)]), "final norm weights of 64"),
    (lambda a: a.update(head=[a["x"][0, :64], *random_head(32, 48, 1, a["x"].dtype)]), "lm_head: int8 weight of 32 x 64"),
    (lambda a: a.update(head=[a["x"][0, :64], *random_head(32, 64, 1, a["x"].dtype)[:1]]), "head: \\(final norm"),
], ids=["dense_kind", "missing_tensor", "cache_shape", "cache_dtype", "position", "slot", "other_dtype_rows", "hidden_size",
        "no_head", "head_norm_size", "head_shape", "head_tensors"])
def test_the_stack_refuses_bad_arguments(change, message, dtype):
    """Bad layers when the stack is built, bad rows when it runs: an error naming the problem."""
    from core_plugins.attention import cpu

    cpu.load_kernel()
    s = random_stack(2, [0], False, dtype=dtype)
    cos, sin, rot = s["rotary"]
    args = {"x": torch.randn(1, 64).to(dtype), "stack": s["stack"], "kinds": s["kinds"], "positions": torch.tensor([3]),
            "out_loc": torch.tensor([3]), "caches": [torch.zeros(16, 2, 16).to(dtype) for _ in range(4)]}
    change(args)
    with pytest.raises(RuntimeError, match=message):
        stack = torch.classes.core_cpu_decode.DecodeStack(args["stack"], args["kinds"], 1e-5, cos, sin, rot, 4, 2, 16,
                                                          args["caches"][0::2], args["caches"][1::2], 0.25, 0,
                                                          args.get("head", []), args.get("head_kind", 1), 1e-5)
        if "head" in args or "no_head" in args:
            stack.run_head(args["x"], args["positions"], args["out_loc"], torch.arange(4).view(1, 4), torch.tensor([4]),
                           torch.tensor([1]))
        stack.run(args["x"], args["positions"], args["out_loc"], torch.arange(4).view(1, 4), torch.tensor([4]),
                  torch.tensor([1]))


@needs_gemv
def test_a_stack_it_cannot_build_leaves_the_layer_ops(tiny_llama, monkeypatch):
    """Were DecodeStack to refuse the layers (a layout the Python checks let through), the
    engine says so and keeps one op per layer, with the same tokens."""
    path, _ = tiny_llama()
    want, _ = generate(path, monkeypatch, True, stack=False, attention_backend="cpu", torchao_config="int4wo-32")

    class Refusing:
        def DecodeStack(self, *args):
            raise RuntimeError("DecodeStack: layer 0 qkv_proj: int4 weight of 96 x 64 expected")

    monkeypatch.setattr(torch, "classes", type("Classes", (), {"core_cpu_decode": Refusing()})())
    got, rows = generate(path, monkeypatch, True, attention_backend="cpu", torchao_config="int4wo-32")
    assert got == want and rows and not STACK_ROWS


def test_only_a_plain_norm_and_an_int4_or_int8_head_join_the_stack():
    """_head: a dense head, a bias, an offset norm (Gemma's), scales in another dtype or another
    width keep the head out of the stack (it then runs as its own op)."""
    from core.layers import RMSNorm

    codes, scales = random_head(32, 64, 1, torch.float32)

    class Head(torch.nn.Module):
        def __init__(self, args, bias=None):
            super().__init__()
            self.args, self.bias = args, bias

        def cpu_linear_args(self):
            return self.args

    norm = RMSNorm(64, 1e-5)
    tail, kind, rows = cpu_decode._head(norm, Head((1, codes, scales, 1 << 30, None)), torch.float32)
    assert kind == 1 and rows == 1 << 30 and tail[1] is codes and tail[2] is scales and torch.equal(tail[0], norm.weight)
    refused = [
        (norm, Head((2, None, None, 0, torch.zeros(32, 64)))),  # dense
        (norm, Head((1, codes, scales, 1 << 30, None), bias=torch.zeros(32))),
        (RMSNorm(64, 1e-5, offset=1.0), Head((1, codes, scales, 1 << 30, None))),
        (RMSNorm(96, 1e-5), Head((1, codes, scales, 1 << 30, None))),  # another width
        (norm, Head(None)),
        (None, Head((1, codes, scales, 1 << 30, None))),
    ]
    for n, h in refused:
        assert cpu_decode._head(n, h, torch.float32) == ([], 0, 0)
    assert cpu_decode._head(norm, Head((1, codes, scales, 1 << 30, None)), torch.bfloat16) == ([], 0, 0)


def test_into_arena_moves_the_tensors_back_to_back_on_a_huge_page_boundary():
    """into_arena: every holder of a moved tensor sees the arena (set_ in place), values and shapes
    kept; the tensors lie in the order given, each on a cache line, the first on a 2 MiB boundary;
    a tensor given twice moves once, empty ones stay."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 255, (3, 100), dtype=torch.uint8, generator=g)
    b = torch.randn(7, 5, generator=g)
    with torch.inference_mode():  # weights loaded in inference mode are inference tensors
        c = torch.randn(16, generator=g).to(torch.bfloat16)
    empty = torch.empty(0)
    holder = {"b": b}
    want = [t.clone() for t in (a, b, c)]
    buf = cpu_decode.into_arena([a, b, a, empty, c])
    assert buf is not None and buf.dtype == torch.uint8
    for t, w in zip((a, b, c), want):
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert t.shape == w.shape and t.dtype == w.dtype and t.is_contiguous() and torch.equal(t, w)
    assert holder["b"] is b and torch.equal(holder["b"], want[1])
    assert a.data_ptr() % cpu_decode.HUGE_PAGE == 0
    assert b.data_ptr() == a.data_ptr() + 320  # 300 bytes, rounded up to whole 64-byte lines
    assert c.data_ptr() == b.data_ptr() + 192  # 140 bytes
    assert empty.numel() == 0 and empty.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert cpu_decode.into_arena([empty]) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_stack_reads_its_weights_from_one_arena(tiny_llama, monkeypatch, dtype):
    """After the first decode, every packed weight of the stack (and the head's) is a view of one
    buffer, in the order a step reads them, and the engine's tokens are unchanged."""
    path, _ = tiny_llama()
    opts = dict(attention_backend="cpu", torchao_config="int4wo-32", cpu_threads=2, dtype=str(dtype).removeprefix("torch."))
    want, _ = generate(path, monkeypatch, True, stack=False, **opts)
    arenas = []
    real = cpu_decode.into_arena
    monkeypatch.setattr(cpu_decode, "into_arena", lambda ts: arenas.append((ts, real(ts))) or arenas[-1][1])
    got, _ = generate(path, monkeypatch, True, **opts)
    assert got == want and arenas
    tensors, buf = arenas[0]
    ptrs = [t.data_ptr() for t in tensors]
    assert len(tensors) >= 2 * 5 * 2 + 2 and ptrs == sorted(ptrs)  # layers' codes and scales, then the head's
    assert {t.untyped_storage().data_ptr() for t in tensors} == {buf.untyped_storage().data_ptr()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_stack_outlives_a_later_move_of_its_weights(tiny_llama, dtype):
    """A DecodeStack holds what its raw pointers point into: moving its weights again afterwards
    (into_arena, set_) leaves the stack reading its own copy, with the same tokens; planning the
    same weights again copies nothing."""
    path, _ = tiny_llama()
    eng = make_engine(path, attention_backend="cpu", torchao_config="int4wo-32", cpu_threads=2,
                      dtype=str(dtype).removeprefix("torch."))
    try:
        first = eng.generate(PROMPTS[1], greedy(8))["output_ids"]
        model = eng.engine.model.model
        _, _, plan = model.__dict__["_cpu_stack_plan"]
        assert plan is not None
        arena = model.layers[0].self_attn.qkv_proj.qweight_int4_cpu.untyped_storage().data_ptr()
        modules = [*eng.engine.model.modules(), model.embed_tokens.head()]
        found = {id(t): t for m in modules for t in (*vars(m).values(), *m._parameters.values(), *m._buffers.values())
                 if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel()  # (not oneDNN's packed copies)
                 and t.untyped_storage().data_ptr() == arena}
        weights = sorted(found.values(), key=torch.Tensor.data_ptr)  # every weight the stack points into
        assert len(weights) == 2 * 5 * len(model.layers) + 2
        before = [t.data_ptr() for t in weights]
        assert cpu_decode.into_arena(weights) is None  # in one buffer already: nothing moves
        assert [t.data_ptr() for t in weights] == before
        moved = cpu_decode.into_arena(weights + [torch.zeros(64)])  # a second buffer: all move
        assert moved is not None and all(t.data_ptr() != p for t, p in zip(weights, before))
        junk = [torch.full((1 << 20,), 7.0) for _ in range(32)]  # reuse what a freed arena held
        assert eng.generate(PROMPTS[1], greedy(8))["output_ids"] == first
        del junk
    finally:
        eng.shutdown()
