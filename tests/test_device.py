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


def _env_without_wait_policy() -> dict[str, str]:
    """This process's environment less the two variables ``core/openmp.py`` exports, for a child
    that starts as a fresh program would."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def _env_after_import(env: dict[str, str]) -> tuple[str | None, str | None]:
    import json

    code = "import json, os, core; print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT')]))"
    base = _env_without_wait_policy()
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_core_lets_libgomp_threads_spin_unless_the_user_chose():
    assert _env_after_import({}) == ("ACTIVE", "30000")
    assert _env_after_import({"OMP_WAIT_POLICY": "PASSIVE"}) == ("PASSIVE", None)
    assert _env_after_import({"GOMP_SPINCOUNT": "5"}) == (None, "5")


def test_intel_openmp_is_left_alone(tmp_path, monkeypatch):
    """Under Intel's OpenMP, ACTIVE means never sleeping: no wait policy is set there."""
    import importlib.machinery
    import importlib.util

    from core import openmp

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    openmp.wait_policy()
    assert "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    (tmp_path / "lib" / "libiomp5.so").unlink()
    openmp.wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


LATE_POLICY = textwrap.dedent("""
    import json, sys
    first = sys.argv[1]
    if first == "torch":
        import torch
    import core, torch
    from core.engine.device import check_openmp_policy
    from core.log import configure_logging
    configure_logging("warning")
    print(json.dumps([core.openmp.APPLIED, check_openmp_policy(torch.device("cpu")),
                      check_openmp_policy(torch.device("meta"))]))
""")


def test_a_program_that_imports_torch_first_is_told_the_spin_settings_came_too_late():
    """libgomp reads its wait policy as torch loads it: after ``import torch; import core`` the
    variables are exported (for worker processes) but this process runs without them, and the
    engine says so on CPU, with the fix."""
    import json

    base = _env_without_wait_policy()
    got = {}
    for first in ("torch", "core"):
        out = subprocess.run([sys.executable, "-c", LATE_POLICY, first], env=base, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got[first] = (json.loads(out.stdout.strip().splitlines()[-1]), out.stdout + out.stderr)
    assert got["core"][0] == [True, True, True] and "openmp_spin_missed" not in got["core"][1]
    assert got["torch"][0] == [False, False, True]
    assert "openmp_spin_missed" in got["torch"][1] and "import core before torch" in got["torch"][1]
