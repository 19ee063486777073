"""PageAllocator, ReqToTokenTable and the KV pool tensors (no model)."""

from __future__ import annotations

import random

import pytest
import torch

from core.engine.mem_cache.kv_cache import PageAllocator, ReqToTokenTable, allocate_kv_cache, kv_bytes_per_token


def test_needs_two_pages():
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(1, 4)
    a = PageAllocator(2, 4)
    assert a.capacity == 1 and a.num_free == 1


def test_padding_page_is_never_handed_out():
    a = PageAllocator(9, 2)
    assert a.capacity == 8
    taken = a.allocate(8)
    assert sorted(taken) == list(range(1, 9))
    assert 0 not in taken
    assert taken == sorted(taken), "low pages first"
    with pytest.raises(RuntimeError, match="cannot allocate"):
        a.allocate(1)
    a.free(taken)
    assert a.num_free == 8


def test_allocate_free_accounting():
    a = PageAllocator(11, 1)
    assert a.can_allocate(10) and not a.can_allocate(11)
    pages = a.allocate(6)
    assert a.num_free == 4 and a.can_allocate(4) and not a.can_allocate(5)
    with pytest.raises(RuntimeError, match="cannot allocate 5 pages, 4 free"):
        a.allocate(5)
    assert a.num_free == 4, "a refused allocation takes nothing"
    a.free(pages)
    assert a.num_free == 10


def test_double_free_detected():
    a = PageAllocator(4, 1)
    pages = a.allocate(2)
    a.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        a.free(pages + pages[:1])


@pytest.mark.parametrize("page_size,tokens,pages", [(1, 0, 0), (1, 7, 7), (4, 1, 1), (4, 4, 1), (4, 5, 2), (16, 33, 3)])
def test_pages_for_rounds_up(page_size, tokens, pages):
    assert PageAllocator(2, page_size).pages_for(tokens) == pages


def test_random_churn_never_loses_a_page():
    rng = random.Random(0)
    a = PageAllocator(33, 2)
    live: list[list[int]] = []
    for _ in range(500):
        if live and (rng.random() < 0.4 or not a.can_allocate(1)):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            need = rng.randint(1, max(1, min(8, a.num_free)))
            if not a.can_allocate(need):
                continue
            pages = a.allocate(need)
            assert 0 not in pages
            live.append(pages)
        in_use = [p for pages in live for p in pages]
        assert len(in_use) == len(set(in_use))
        assert a.num_free + len(in_use) == a.capacity
    for pages in live:
        a.free(pages)
    assert a.num_free == a.capacity
    assert sorted(a._free) == list(range(1, 33))


def test_req_to_token_table_rows():
    t = ReqToTokenTable(3, 10, torch.device("cpu"))
    assert t.table.shape == (3, 10) and t.table.dtype == torch.int64
    assert not t.table.any(), "unused slots point at the zeroed padding page"
    rows = [t.alloc_row() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and t.num_free == 0
    t.free_row(rows[1])
    assert t.num_free == 1 and t.alloc_row() == rows[1]


def test_allocate_kv_cache_shapes_and_zero_padding_page():
    kv = allocate_kv_cache(3, 5, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert kv.page_size == 4 and len(kv.k) == len(kv.v) == 3
    for buf in (*kv.k, *kv.v):
        assert buf.shape == (20, 2, 8) and buf.dtype == torch.float32
        assert torch.equal(buf[:4], torch.zeros(4, 2, 8))
    assert kv.k[0].data_ptr() != kv.k[1].data_ptr() != kv.v[0].data_ptr()


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(2, 1, 16, torch.float32) == 2 * 2 * 16 * 4


@pytest.mark.parametrize("writes", [3, 8, 9, 40], ids=["few", "eight", "nine", "many"])
@pytest.mark.parametrize("seqs", [1, 3])
def test_step_inputs_record_the_slots_and_gather_each_sequences_row(writes, seqs):
    """The runner writes a batch's (row, position, slot) entries into the CPU table (one by one
    for a few, in one numpy op for more) and hands the forward each sequence's slots so far: a
    view of the row for one sequence, a contiguous copy of the rows in use for several."""
    from types import SimpleNamespace

    from core.engine.model_runner import ModelRunner

    table = ReqToTokenTable(4, 64, torch.device("cpu"))
    assert table.host is not None and table.host.base is not None  # the table's own memory
    runner = ModelRunner(None, None, table, None, (), torch.device("cpu"))
    rows = [3, 0, 2][:seqs]
    rng = random.Random(writes)
    entries = [(rows[i % seqs], i // seqs, rng.randrange(1, 10_000)) for i in range(writes)]
    lens = [1 + max(p for r, p, _ in entries if r == row) for row in rows]
    reqs = [SimpleNamespace(row=row, kv_len=n) for row, n in zip(rows, lens)]
    w_rows, w_cols, w_slots = map(list, zip(*entries))
    batch = SimpleNamespace(reqs=reqs, table_writes=(w_rows, w_cols, w_slots), is_prefill=False, input_ids=[1] * seqs,
                            positions=[n - 1 for n in lens], out_cache_loc=[0] * seqs, extend_lens=[1] * seqs,
                            rows=rows, seq_lens=lens, live=list(range(seqs)), draft_parents=None)
    inputs, live, _ = runner.step_inputs(batch)
    for r, p, s in entries:
        assert table.table[r, p].item() == s
    assert inputs.kv_indices.shape == (seqs, max(lens)) and live == list(range(seqs))
    assert torch.equal(inputs.kv_indices, table.table[rows, : max(lens)])
    assert inputs.kv_indices.view(-1).numel() == seqs * max(lens)  # viewable flat, as backends read it
    table.table[rows[0], 0] = -5  # one sequence: the forward reads the table itself, no copy
    assert (inputs.kv_indices[0, 0].item() == -5) == (seqs == 1)
