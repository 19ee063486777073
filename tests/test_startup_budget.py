"""The CPU KV pool's size at start-up (issue 41): stable for a machine, fits the default model when a
few GB are free, and a clear error naming a flag that works when memory is short."""

from __future__ import annotations

import re

import pytest
import torch

from core.engine.mem_cache.kv_cache import GIB, cpu_kv_tokens, kv_bytes_per_token
from core.errors import ModelLoadError

# SmolLM2-135M (the default model): 30 layers, 3 KV heads of 64, bf16, 8192-token context
PER_TOKEN = kv_bytes_per_token(30, 3, 64, torch.bfloat16)
CONTEXT = 8192
TOTAL = 23 * GIB


def tokens(available: float, total: int = TOTAL, frac: float = 0.3, **kw) -> int:
    return cpu_kv_tokens(total, int(available * GIB), frac, PER_TOKEN, CONTEXT, **kw)


def test_stable_while_memory_is_plentiful() -> None:
    """Other programs and the page cache move ``available`` between starts; the pool does not move."""
    sizes = {tokens(avail) for avail in (9, 12, 17, 20, 22.5)}
    assert sizes == {int(TOTAL * 0.3) // PER_TOKEN}


def test_fits_the_default_model_with_a_few_gb_free() -> None:
    """Used to fail past ~30 % RAM in use (``total * 0.3 - used`` went negative)."""
    for avail in (2, 3, 5):
        assert tokens(avail) >= CONTEXT
    assert tokens(2) <= (2 * GIB) // PER_TOKEN  # never more than what is free


def test_capped_at_what_running_requests_can_use() -> None:
    assert tokens(20, max_running=4) == 4 * CONTEXT
    assert tokens(900, total=1024 * GIB, frac=0.9) == 256 * CONTEXT


def test_short_memory_names_max_total_tokens() -> None:
    with pytest.raises(ModelLoadError, match=r"--max-total-tokens (\d+)") as e:
        tokens(0.55)
    n = int(re.search(r"--max-total-tokens (\d+)", str(e.value)).group(1))
    assert 0 < n * PER_TOKEN <= 0.55 * GIB


def test_a_tiny_fraction_names_mem_fraction_static() -> None:
    with pytest.raises(ModelLoadError, match=r"--mem-fraction-static (0\.\d\d) ") as e:
        tokens(20, frac=0.001)
    frac = float(re.search(r"pass --mem-fraction-static (0\.\d\d)", str(e.value)).group(1))
    assert tokens(20, frac=frac) >= 2048
