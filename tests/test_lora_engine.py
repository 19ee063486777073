"""Multi-LoRA serving end to end in the engine (issue 44): each adapter's greedy tokens equal
peft's, in one batch mixing adapters and the base model; the radix cache never shares KV across
adapters; adapters load and unload at run time; bad input is a clear error."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # peft imports triton: the kernel tests after this module need its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.conftest import assert_pool_free, build_tiny_llama, greedy, make_engine
from tests.model_utils import prompt

peft = pytest.importorskip("peft")

N_NEW = 8


def save_adapter(base, folder: Path, seed: int, r: int = 8, targets=("q_proj", "v_proj"), **kw) -> torch.nn.Module:
    """A random peft adapter (``init_lora_weights=False``: B is not zero) on a copy of ``base``,
    saved to ``folder``; returns the peft model (float32, eval)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **kw)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():  # larger deltas than peft's init, so that each adapter changes the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(folder)
    return model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(root / "base")
    adapters = {
        "qv8": save_adapter(base, root / "qv8", 1),
        "all16": save_adapter(base, root / "all16", 2, r=16,
                              targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        "mlp4rs": save_adapter(base, root / "mlp4rs", 3, r=4, targets=("gate_proj", "down_proj"), use_rslora=True),
    }
    return root, base, adapters


@pytest.fixture(scope="module")
def eng(setup, device):
    """On each device: CUDA runs the segmented Triton kernels (``--lora-backend csgmv``), the CPU torch's."""
    root, _, adapters = setup
    e = make_engine(root / "base", enable_lora=True, lora_paths=[f"{n}={root / n}" for n in adapters],
                    max_loras_per_batch=2, device=device)
    yield e
    e.shutdown()


def test_each_adapter_matches_peft_in_one_mixed_batch(setup, eng):
    _, base, adapters = setup
    prompts = [prompt(12 + i, seed=40 + i) for i in range(6)]
    names = [None, "qv8", "all16", "mlp4rs", "qv8", None]  # 3 adapters > 2 slots: the scheduler splits them
    outs = eng.generate(input_ids=prompts, sampling_params=greedy(N_NEW), lora_path=names)
    for p, name, out in zip(prompts, names, outs):
        ref = hf_greedy(base if name is None else adapters[name], p, N_NEW)
        assert out["output_ids"] == ref, name
    # the adapters matter: each gives other tokens than the base for some prompt
    for name in adapters:
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts[:3], sampling_params=greedy(N_NEW), lora_path=name)]
        assert got != [hf_greedy(base, p, N_NEW) for p in prompts[:3]], name
    assert_pool_free(eng)


def test_prefix_cache_is_isolated_per_adapter(setup, eng):
    p = prompt(40, seed=7)
    first = eng.generate(input_ids=p, sampling_params=greedy(4), lora_path="qv8")
    again = eng.generate(input_ids=p, sampling_params=greedy(4), lora_path="qv8")
    assert again["meta_info"]["cached_tokens"] >= 32 and again["output_ids"] == first["output_ids"]
    other = eng.generate(input_ids=p, sampling_params=greedy(4), lora_path="all16")
    base = eng.generate(input_ids=p, sampling_params=greedy(4))
    # (at most the BOS token every prompt starts with, cached under that adapter by an earlier test)
    assert other["meta_info"]["cached_tokens"] <= 1 and base["meta_info"]["cached_tokens"] <= 1
    assert other["output_ids"] == hf_greedy(setup[2]["all16"], p, 4)
    assert base["output_ids"] == hf_greedy(setup[1], p, 4)
    assert_pool_free(eng)


def test_load_and_unload_at_run_time(setup, tmp_path):
    root, base, adapters = setup
    extra = save_adapter(base, tmp_path / "late", 9, r=8)
    e = make_engine(root / "base", enable_lora=True, max_lora_rank=16,
                    lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    try:
        assert e.engine.lora_adapters() == {}
        e.load_lora_adapter("late", str(tmp_path / "late"))
        assert e.engine.lora_adapters() == {"late": str(tmp_path / "late")}
        p = prompt(10, seed=3)
        assert e.generate(input_ids=p, sampling_params=greedy(N_NEW), lora_path="late")["output_ids"] == hf_greedy(extra, p, N_NEW)
        with pytest.raises(Exception, match="already loaded"):
            e.load_lora_adapter("late", str(tmp_path / "late"))
        with pytest.raises(Exception, match="down_proj, which is not among"):  # outside --lora-target-modules
            e.load_lora_adapter("mlp", str(root / "mlp4rs"))
        e.unload_lora_adapter("late")
        assert e.engine.lora_adapters() == {}
        with pytest.raises(Exception, match="'late' is not loaded"):
            e.generate(input_ids=p, sampling_params=greedy(2), lora_path="late")
        assert_pool_free(e)
    finally:
        e.shutdown()


def test_unknown_adapter_and_disabled_lora_are_clear_errors(setup, eng, tmp_path):
    root = setup[0]
    with pytest.raises(Exception, match="'nope' is not loaded.*qv8"):
        eng.generate(input_ids=prompt(5, seed=1), sampling_params=greedy(2), lora_path="nope")
    with pytest.raises(Exception, match="must match the number of prompts"):
        eng.generate(input_ids=[prompt(5, seed=1)] * 2, sampling_params=greedy(2), lora_path=["qv8"])
    plain = make_engine(root / "base")
    try:
        with pytest.raises(Exception, match="without --enable-lora"):
            plain.generate(input_ids=prompt(5, seed=1), sampling_params=greedy(2), lora_path="qv8")
    finally:
        plain.shutdown()
    with pytest.raises(Exception, match="--max-lora-rank and --lora-target-modules"):
        make_engine(root / "base", enable_lora=True)
    with pytest.raises(Exception, match="rank"):  # rank 16 adapter over a rank-8 pool
        make_engine(root / "base", lora_paths=[f"a={root / 'all16'}"], max_lora_rank=8)
    # a weight reload would leave the adapters on the old module: refused, and the adapters still serve
    ok, message = eng._call(eng.engine.update_weights_from_disk(str(root / "base")))
    assert not ok and "--enable-lora" in message
    assert eng.generate(input_ids=prompt(5, seed=1), sampling_params=greedy(2), lora_path="qv8")["output_ids"]


def test_sglang_lora_flags_parse_into_engine_args():
    from core.engine.lora.serving import kernel_backend, parse_lora_paths
    from core.cli import build_parser
    from core.server.args import engine_args_from_namespace

    ns = build_parser().parse_args([
        "serve", "--model-path", "/m", "--enable-lora", "--lora-paths", "a=/x", "/y",
        '{"lora_name": "c", "lora_path": "/z", "pinned": true}', "--max-loras-per-batch", "4", "--max-lora-rank", "16",
        "--lora-target-modules", "q_proj", "v_proj", "--max-loaded-loras", "6", "--lora-backend", "torch_native",
        "--lora-eviction-policy", "fifo"])
    args = engine_args_from_namespace(ns)
    assert args.enable_lora and args.max_loras_per_batch == 4 and args.max_lora_rank == 16
    assert args.lora_target_modules == ["q_proj", "v_proj"] and args.max_loaded_loras == 6
    assert args.lora_backend == "torch_native" and args.lora_eviction_policy == "fifo"
    assert parse_lora_paths(args.lora_paths) == [("a", "/x", False), ("/y", "/y", False), ("c", "/z", True)]
    assert parse_lora_paths({"n": "/p"}) == [("n", "/p", False)]
    with pytest.raises(Exception, match="names an adapter twice"):
        parse_lora_paths(["a=/x", "a=/y"])
    with pytest.raises(Exception, match="not valid JSON"):
        parse_lora_paths(['{"lora_name": '])
    # lora_backend: csgmv / triton run the Triton kernels on a GPU only; torch_native runs torch's matmuls
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [kernel_backend(b, cuda) for b in ("csgmv", "triton", "torch_native")] == ["triton", "triton", "torch"]
    assert {kernel_backend(b, cpu) for b in ("csgmv", "triton", "torch_native")} == {"torch"}


def test_data_parallel_replicas_serve_the_same_adapters(setup, tmp_path):
    """--dp-size 2: both replicas hold the --lora-paths adapters and every run-time load and unload;
    a mixed batch spread over them matches peft; past --max-loaded-loras the front end picks the
    adapter to evict (the least recently named idle one), the same on every replica."""
    root, base, adapters = setup
    late = save_adapter(base, tmp_path / "late", 9, r=8)
    e = make_engine(root / "base", lora_paths=[f"qv8={root / 'qv8'}", f"all16={root / 'all16'}"], max_loras_per_batch=2,
                    max_loaded_loras=3, dp_size=2, log_level="warning")
    try:
        prompts = [prompt(10 + i, seed=60 + i) for i in range(4)]
        names = [None, "qv8", "all16", "qv8"]
        outs = e.generate(input_ids=prompts, sampling_params=greedy(N_NEW), lora_path=names)
        for p, name, out in zip(prompts, names, outs):
            assert out["output_ids"] == hf_greedy(base if name is None else adapters[name], p, N_NEW), name
        assert [r["routed_requests"] for r in e.engine.replica_loads()] == [2, 2]  # (round robin: both replicas)
        e.load_lora_adapter("late", str(tmp_path / "late"))
        want = hf_greedy(late, prompts[0], N_NEW)
        assert [o["output_ids"] for o in e.generate(input_ids=prompts[:1] * 2, sampling_params=greedy(N_NEW),
                                                    lora_path="late")] == [want, want]  # one on each replica
        with pytest.raises(Exception, match="'late' is already loaded"):
            e.load_lora_adapter("late", str(tmp_path / "late"))
        with pytest.raises(Exception, match="missing"):  # the replicas' refusal, naming the folder
            e.load_lora_adapter("bad", str(tmp_path / "missing"))
        assert set(e.engine.lora_adapters()) == {"qv8", "all16", "late"}
        e.generate(input_ids=prompts[0], sampling_params=greedy(1), lora_path="qv8")  # all16 is now the least recent
        e.load_lora_adapter("mlp", str(root / "mlp4rs"))
        assert set(e.engine.lora_adapters()) == {"qv8", "late", "mlp"}
        assert e.generate(input_ids=prompts[1], sampling_params=greedy(N_NEW), lora_path="mlp")["output_ids"] == \
            hf_greedy(adapters["mlp4rs"], prompts[1], N_NEW)
        e.unload_lora_adapter("late")
        with pytest.raises(Exception, match="'late' is not loaded"):
            e.generate(input_ids=prompts[0], sampling_params=greedy(2), lora_path="late")
        for replica in e.engine.replicas:  # gone from each replica too
            with pytest.raises(Exception, match="'late' is not loaded"):
                e._call(e.engine._call(replica, "unload_lora", "late"))
    finally:
        e.shutdown()


def test_tensor_parallel_ranks_serve_the_adapters(setup, tmp_path):
    """--tp-size 2: each rank holds its shard of every adapter (column-parallel B rows, row-parallel
    A columns); slots refilled between batches, run-time loads and unloads reach rank 1."""
    root, base, adapters = setup
    late = save_adapter(base, tmp_path / "late", 9, r=8, targets=("o_proj", "up_proj", "down_proj"))
    e = make_engine(root / "base", lora_paths=[f"{n}={root / n}" for n in adapters], max_loras_per_batch=2,
                    tp_size=2, log_level="warning")
    try:
        prompts = [prompt(12 + i, seed=80 + i) for i in range(6)]
        names = [None, "qv8", "all16", "mlp4rs", "qv8", None]  # 3 adapters > 2 slots: refilled between batches
        for _ in range(2):
            outs = e.generate(input_ids=prompts, sampling_params=greedy(N_NEW), lora_path=names)
            for p, name, out in zip(prompts, names, outs):
                assert out["output_ids"] == hf_greedy(base if name is None else adapters[name], p, N_NEW), name
        e.load_lora_adapter("late", str(tmp_path / "late"))
        e.unload_lora_adapter("qv8")
        names = ["late", "all16", None, "late"]
        outs = e.generate(input_ids=prompts[:4], sampling_params=greedy(N_NEW), lora_path=names)
        for p, name, out in zip(prompts, names, outs):
            model = base if name is None else late if name == "late" else adapters[name]
            assert out["output_ids"] == hf_greedy(model, p, N_NEW), name
        with pytest.raises(Exception, match="'qv8' is not loaded"):
            e.generate(input_ids=prompts[0], sampling_params=greedy(2), lora_path="qv8")
        rank0 = e.engine.lora
        assert rank0.ranks.pending is None and not rank0.ranks.dropped  # qv8's drop reached rank 1 with a step
    finally:
        e.shutdown()


def test_a_load_one_replica_refuses_is_undone_on_the_others():
    import asyncio
    import types

    from core.engine.lora.adapter import LoRAError
    from core.engine.lora.replicated import ReplicatedAdapters

    calls, refuse = [], [True]

    async def call_all(what, *args):
        calls.append((what, args[0]))
        return [None, LoRAError("replica 1 says no")] if what == "load_lora" and refuse[0] else [None, None]

    args = types.SimpleNamespace(lora_paths=["a=/x"], max_loaded_loras=None, max_loras_per_batch=2)
    reg = ReplicatedAdapters(args, call_all, set)
    with pytest.raises(LoRAError, match="replica 1 says no"):
        asyncio.run(reg.load("b", "/y"))
    assert calls == [("load_lora", "b"), ("unload_lora", "b")] and reg.adapters() == {"a": "/x"}
    uid = reg.resolve("a")
    asyncio.run(reg.unload("a"))
    refuse[0] = False
    asyncio.run(reg.load("a", "/z"))  # the same name again, another adapter
    # a request that named the unloaded one is not sent under the new one (nor as the base model)
    assert reg.name_of(uid) is None and reg.name_of(reg.resolve("a")) == "a"
    for limit, match in ((1, "at least --max-loras-per-batch"), (2, None)):  # the limits the replicas no longer check
        args = types.SimpleNamespace(lora_paths=["a=/x", "b=/y", "c=/z"], max_loaded_loras=limit, max_loras_per_batch=2)
        with pytest.raises(LoRAError, match=match or "names 3 adapters, more than --max-loaded-loras"):
            ReplicatedAdapters(args, call_all, set)


def test_max_loaded_loras_and_the_slot_eviction_policy(setup):
    root, _, adapters = setup
    for policy, evicted in (("lru", "qv8"), ("fifo", "all16")):
        e = make_engine(root / "base", lora_paths=[f"{n}={root / n}" for n in adapters], max_loras_per_batch=2,
                        lora_eviction_policy=policy)
        try:
            pool = e.engine.lora.pool
            for name in ("all16", "qv8", "all16"):  # all16 loads first, qv8 is the least recently used
                e.generate(input_ids=prompt(6, seed=2), sampling_params=greedy(1), lora_path=name)
            e.generate(input_ids=prompt(6, seed=2), sampling_params=greedy(1), lora_path="mlp4rs")  # needs a slot
            assert pool.slot_of(evicted) is None and pool.slot_of("mlp4rs") is not None, policy
        finally:
            e.shutdown()
    # max_loaded_loras: past it the least recently used idle, unpinned adapter's host copy goes
    e = make_engine(root / "base", enable_lora=True, max_loras_per_batch=1, max_loaded_loras=1, max_lora_rank=16,
                    lora_target_modules=["all"])
    try:
        e.load_lora_adapter("one", str(root / "qv8"))
        e.load_lora_adapter("two", str(root / "all16"))
        assert e.engine.lora_adapters() == {"two": str(root / "all16")}
        e.unload_lora_adapter("two")
        e.load_lora_adapter("pinned", str(root / "qv8"), pinned=True)
        with pytest.raises(Exception, match="pinned or in use"):
            e.load_lora_adapter("three", str(root / "mlp4rs"))
    finally:
        e.shutdown()
    with pytest.raises(Exception, match="--max-loaded-loras"):
        make_engine(root / "base", lora_paths=[f"a={root / 'qv8'}"], max_loaded_loras=1, max_loras_per_batch=2)
    # more adapters at start than may stay loaded: a start-up error, as with --dp-size (it evicted the first)
    with pytest.raises(Exception, match="names 3 adapters, more than --max-loaded-loras"):
        make_engine(root / "base", lora_paths=[f"{n}={root / n}" for n in adapters], max_loaded_loras=2,
                    max_loras_per_batch=2)


def test_unloading_an_adapter_in_use_lets_its_requests_finish(setup, eng):
    import asyncio

    root, _, adapters = setup
    p = prompt(8, seed=11)
    n = 160
    want = hf_greedy(adapters["mlp4rs"], p, n)
    manager = eng.engine.lora.manager

    async def run():
        stream = await eng.async_generate(input_ids=p, sampling_params=greedy(n), lora_path="mlp4rs", stream=True)
        out, still_running = None, None
        async for chunk in stream:
            out = chunk
            if still_running is None and chunk["output_ids"]:
                eng.unload_lora_adapter("mlp4rs")  # (blocks this loop briefly: the call runs on the engine's)
                # gone for new requests, kept (being removed) while this one runs
                still_running = "mlp4rs" not in eng.engine.lora_adapters() and "mlp4rs" in manager._entries
        return out, still_running

    out, still_running = asyncio.run(run())
    assert still_running and "mlp4rs" not in manager._entries  # dropped with its last request
    assert out["output_ids"] == want
    with pytest.raises(Exception, match="'mlp4rs' is not loaded"):
        eng.generate(input_ids=p, sampling_params=greedy(2), lora_path="mlp4rs")
    eng.load_lora_adapter("mlp4rs", str(root / "mlp4rs"))  # (the module's other tests use it)
    assert_pool_free(eng)


def test_decode_graphs_hold_the_lora_kernels_and_replays_write_each_rows_slot(setup):
    """The CUDA-graph protocol of the triton pool, checked on the host: a decode's rows are grouped
    by slot (one segment per adapter, chunks of at most 16 rows, gathered through a token index;
    rows without an adapter in no segment). A graph of ``bs`` rows is captured over
    ``graph_capacity(bs)`` empty segments; before a replay the real rows' groups (none for a batch
    without adapters) land in the same buffers, empty segments past them."""
    from core.engine.lora.pool import LoRAPool

    root = setup[0]
    e = make_engine(root / "base")
    try:
        pool = LoRAPool(e.engine.model, slots=2, max_rank=8, target_modules=["q_proj"], dtype=torch.float32,
                        device=torch.device("cpu"), backend="triton")
        pool.reserve_segments(8)
        start, slot, tok = pool._seg_start, pool._seg_slot, pool._tok
        with pool.capturing(4):  # 2 slots, 4 rows: at most 2 groups
            assert pool.active and pool._num_segments == pool.graph_capacity(4) == 2 and pool._max_seg_len == 4
            assert slot[:2].tolist() == [-1, -1] and start[:3].tolist() == [0, 0, 0]
        assert not pool.active
        pool.set_batch([1, 1, 1, 1], [1, -1, 0, 1])  # an eager decode is grouped too: exactly its groups
        assert pool._num_segments == 2 and pool._max_seg_len == 4 and pool._tok_index is tok
        assert start[:3].tolist() == [0, 1, 3] and slot[:2].tolist() == [0, 1] and tok[:3].tolist() == [2, 0, 3]
        pool.graph_segments(3, 4)  # rows 0-2 of the batch above: slots 1, -1, 0
        assert start[:3].tolist() == [0, 1, 2] and slot[:2].tolist() == [0, 1] and tok[:2].tolist() == [2, 0]
        pool.clear_batch()  # a decode without adapters replays the same graph: every segment empty
        pool.graph_segments(2, 4)
        assert slot[:2].tolist() == [-1, -1] and start[:3].tolist() == [0, 0, 0]
        assert pool._seg_start is start and pool._seg_slot is slot and pool._tok is tok  # graphs keep the addresses
        pool.set_batch([3, 1], [0, 1])  # not a decode: one segment per request, no token index
        assert pool._tok_index is None and pool._max_seg_len == 3
        assert start[:3].tolist() == [0, 3, 4] and slot[:2].tolist() == [0, 1]

        rows = [0] * 37 + [-1, 1, 0]  # 38 rows on slot 0: chunks of 16, 16 and 6 rows; 1 on slot 1
        pool.reserve_segments(48)
        pool.set_batch([1] * 40, rows)
        assert pool._num_segments == 4 and pool._max_seg_len == 16
        assert pool._seg_start[:5].tolist() == [0, 16, 32, 38, 39] and pool._seg_slot[:4].tolist() == [0, 0, 0, 1]
        assert pool._tok[:39].tolist() == [*range(37), 39, 38]
        pool.graph_segments(40, 48)  # capacity min(48, 2 + 48 // 16) = 5: one empty segment last
        assert pool._seg_start[:6].tolist() == [0, 16, 32, 38, 39, 39]
        assert pool._seg_slot[:5].tolist() == [0, 0, 0, 1, -1]
    finally:
        e.shutdown()


def test_cuda_decodes_with_adapters_replay_graphs(setup, eng, device):
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    graphs = eng.engine.runner.graphs
    assert graphs is not None and graphs.lora is not None  # the pool's kernels are captured
    replays = []
    orig = graphs.replay
    graphs.replay = lambda batch: replays.append(batch.batch_size) or orig(batch)
    try:
        p = [prompt(9, seed=21), prompt(11, seed=22)]
        outs = eng.generate(input_ids=p, sampling_params=greedy(N_NEW), lora_path=["qv8", None])
    finally:
        graphs.replay = orig
    assert replays, "decode steps with an adapter ran eagerly"
    assert outs[0]["output_ids"] == hf_greedy(setup[2]["qv8"], p[0], N_NEW)
    assert outs[1]["output_ids"] == hf_greedy(setup[1], p[1], N_NEW)


@pytest.mark.parametrize("block_k", [None, 16], ids=["plain", "split_k"])
def test_graph_replays_with_and_without_adapters_match_peft(setup, monkeypatch, block_k):
    """The CUDA-graph path of LoRA without a GPU: triton attention and the SGMV kernels in
    triton's interpreter behind ``tests.test_cuda_graph``'s stand-in graphs (a replay reruns the
    captured forward over the same static buffers). Batches with adapters replay the graphs that
    hold the LoRA kernels, over the slot groups ``graph_segments`` wrote; batches without, the
    others. ``split_k``: 16-wide K tiles, so that the tiny model's shrinks split K (2-4 chunks)."""
    pytest.importorskip("triton")
    from core.engine.lora import serving
    from tests.test_cuda_graph import EagerGraphRunner

    if block_k is not None:
        import core_kernels.lora as kernels

        monkeypatch.setattr(kernels, "BLOCK_K", block_k)
        assert kernels.k_splits(64, 4, 1) == 2
    root, base, adapters = setup
    monkeypatch.setattr(serving, "kernel_backend", lambda backend, device: "triton")
    e = make_engine(root / "base", attention_backend="triton", disable_cuda_graph=True, max_loras_per_batch=2,
                    lora_paths=[f"{n}={root / n}" for n in ("qv8", "all16")])
    try:
        ae = e.engine
        runner = EagerGraphRunner(ae.model, ae.attn_backend, 4, ae.table.table.shape[1], ae.device, ae.lora).capture()
        assert runner.lora is ae.lora.pool and sorted(runner._graphs) == [(b, w) for b in (1, 2, 4) for w in (False, True)]
        ae.runner.graphs = runner
        p = [prompt(7, seed=31), prompt(9, seed=32), prompt(5, seed=33)]
        outs = e.generate(input_ids=p, sampling_params=greedy(4), lora_path=["all16", None, "qv8"])
        assert [o["output_ids"] for o in outs] == [hf_greedy(adapters["all16"], p[0], 4), hf_greedy(base, p[1], 4),
                                                   hf_greedy(adapters["qv8"], p[2], 4)]
        assert runner._graphs[4, True].replays == 3 and runner._graphs[4, False].replays == 0
        plain = e.generate(input_ids=p[1], sampling_params=greedy(4))
        # (4: its prompt is cached but for the last token, whose one-token extend is a decode too)
        assert plain["output_ids"] == hf_greedy(base, p[1], 4) and runner._graphs[1, False].replays == 4
        assert runner._graphs[1, True].replays == 0
    finally:
        e.shutdown()


def test_encode_after_an_adapters_batch_is_the_base_models(setup, monkeypatch):
    """The pool keeps the last forward's adapter segments; ``encode`` ran the model under them (the
    Python layers: a GPU, or a model without the CPU's one-op stack), so an embedding after a
    LoRA request took that adapter's deltas."""
    import core_plugins.models.llama as llama

    monkeypatch.setattr(llama.LlamaModel, "_cpu_stack", lambda self, backend, head: None)
    monkeypatch.setattr(llama.LlamaDecoderLayer, "_cpu_decode", lambda self, backend: None)
    root, _, _ = setup
    e = make_engine(root / "base", lora_paths=[f"qv8={root / 'qv8'}"])
    try:
        ids = prompt(30, seed=5)  # as many tokens as the adapter's prefill below
        before = e.encode(input_ids=ids)["embedding"]
        e.generate(input_ids=prompt(30, seed=6), sampling_params=greedy(1), lora_path="qv8")
        after = e.encode(input_ids=ids)["embedding"]
    finally:
        e.shutdown()
    torch.testing.assert_close(torch.tensor(after), torch.tensor(before), atol=1e-5, rtol=0)
