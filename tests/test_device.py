"""CPU runtime settings the engine applies before its first GEMM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from core.engine import device

GEMMS_OF_400_SHAPES = textwrap.dedent("""
    import sys, psutil, torch
    from core.engine.device import configure_cpu_runtime
    configure_cpu_runtime(1)
    p = psutil.Process()
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    torch.nn.functional.linear(torch.randn(8, 64, dtype=torch.bfloat16), w)
    start = p.memory_info().rss
    for rows in range(16, 416):  # a server's GEMMs take almost every row count
        torch.nn.functional.linear(torch.randn(rows, 64, dtype=torch.bfloat16), w)
    print((p.memory_info().rss - start) / 2**20)
""")


def test_kernel_cache_defaults_are_set_and_user_values_win(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    device.configure_cpu_runtime(None)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == device.CPU_KERNEL_CACHE_DEFAULT
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


def test_gemms_of_many_shapes_keep_memory_bounded():
    """With oneDNN's default caches (1,024 primitives each, ~0.65 MiB per shape) these 400 shapes
    grow the process by ~260 MiB; bounded, by ~30."""
    env = {k: v for k, v in os.environ.items() if k not in device.CPU_KERNEL_CACHE_ENV}
    out = subprocess.run([sys.executable, "-c", GEMMS_OF_400_SHAPES], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    grown_mib = float(out.stdout.strip())
    assert grown_mib < 100, f"RSS grew {grown_mib:.0f} MiB over 400 GEMM shapes"
