"""Which device to run on, and which dtype ``--dtype auto`` means there.

On CPUs the right dtype depends on the instruction set: with AVX512-BF16 or AMX the bf16
GEMMs run several times faster than fp32 (and halve the bytes read per weight), while on
AVX2-only CPUs oneDNN emulates bf16 and a matmul runs ~150x slower than in fp32.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import structlog
import torch

from core import openmp

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


# oneDNN and its ideep wrapper each keep an LRU cache of compiled GEMM primitives keyed by shape,
# 1,024 entries by default. Under serving load the row count of a GEMM takes almost every value
# (batch sizes, prefill chunks), each entry costs ~0.5 MiB, and the server's RSS grew by GBs
# before the caches filled. 32 entries keep it flat (measured: `docs/benchmarks.md`, soak) at
# no measurable speed cost; a miss costs ~0.2 ms per distinct shape, not per layer.
CPU_KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CPU_KERNEL_CACHE_DEFAULT = "32"


def configure_cpu_runtime(cpu_threads: int | None) -> None:
    """Thread count and bounded kernel caches; call before the process's first GEMM (the caches
    read their capacity once). A value the user exported wins."""
    for name in CPU_KERNEL_CACHE_ENV:
        os.environ.setdefault(name, CPU_KERNEL_CACHE_DEFAULT)
    if cpu_threads:
        torch.set_num_threads(cpu_threads)


def check_openmp_policy(device: torch.device) -> bool:
    """Warns where torch was imported before core: this process's libgomp then runs without the
    spin settings ``core/openmp.py`` exports, and a CPU decode step's ~200 thread meetings each
    wait on a futex wake-up (batch-1 steps ~2x slower on a 2-vCPU EPYC). False where it warned."""
    if device.type != "cpu" or openmp.APPLIED:
        return True
    structlog.get_logger("core.engine").warning(
        "cpu.openmp_spin_missed", reason="torch was imported before core (libgomp read its defaults)",
        effect="CPU decode steps up to ~2x slower",
        fix="import core before torch, or export OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=30000")
    return False


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model_name() -> str:
    """The CPU's model name as Linux reports it (for benchmark headers and logs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_native_bf16(flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """(native bf16 math?, the reason in words) for this CPU."""
    flags = cpu_flags() if flags is None else flags
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    capability = torch.backends.cpu.get_cpu_capability()
    if found:
        return True, f"CPU has {'+'.join(found)} (torch capability {capability})"
    if not flags and "AMX" in capability.upper():
        return True, f"torch capability {capability}"
    return False, f"CPU lacks avx512_bf16/amx_bf16 (torch capability {capability}): bf16 would be emulated"


def fast_cpu_dtype() -> tuple[torch.dtype, str]:
    """The fastest serving dtype on this CPU, and why: bf16 with native bf16 math, else fp32 (fp16
    and emulated bf16 GEMMs run many times slower than either)."""
    native, why = cpu_native_bf16()
    return (torch.bfloat16 if native else torch.float32), why


def auto_dtype(device: torch.device, config_dtype: torch.dtype | None) -> tuple[torch.dtype, str]:
    """``--dtype auto``: bf16 on CPUs with native bf16, fp32 on other CPUs; on GPUs the
    checkpoint's dtype, with fp32 checkpoints served in fp16 as SGLang does."""
    if device.type == "cpu":
        return fast_cpu_dtype()
    if config_dtype in (None, torch.float32):
        return torch.float16, "float32 checkpoint served in float16 on GPU"
    return config_dtype, "the checkpoint's dtype"
