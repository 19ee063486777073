"""Which device to run on, and which dtype ``--dtype auto`` means there.

On CPUs the right dtype depends on the instruction set: with AVX512-BF16 or AMX the bf16
GEMMs run several times faster than fp32 (and halve the bytes read per weight), while on
AVX2-only CPUs oneDNN emulates bf16 and a matmul runs ~150x slower than in fp32.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

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


def placed_device(args: Any, gpus: int | None = None) -> torch.device:
    """The device of ``args``' first rank: on CUDA the GPU SGLang's ``--base-gpu-id`` names (or
    ``--device cuda:N``: one or the other), checked to leave room for every rank and replica
    ``--gpu-id-step`` apart (``gpu_index``); ``gpus``: the GPU count (default: this machine's)."""
    from core.errors import CoreError

    device, base, step = pick_device(args.device), args.base_gpu_id, args.gpu_id_step
    if base < 0 or step < 1:
        raise CoreError(f"--base-gpu-id must be >= 0 and --gpu-id-step >= 1, got {base} and {step}")
    if device.type != "cuda":
        if (base, step) != (0, 1):
            raise CoreError(f"--base-gpu-id and --gpu-id-step place ranks on CUDA GPUs; this engine runs on {device.type}")
        return device
    if device.index is not None and base:
        raise CoreError(f"--device {device} and --base-gpu-id {base} both name the first GPU: give one of them")
    first = device.index if device.index is not None else base
    per_node = args.tp_size // max(1, args.nnodes)
    last = gpu_index(first, step, args.dp_size - 1, per_node, per_node - 1)
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if last >= gpus:
        raise CoreError(f"{args.dp_size * per_node} GPU(s) from cuda:{first}, {step} apart (--base-gpu-id, "
                        f"--gpu-id-step, --dp-size, --tp-size), reach cuda:{last}; this machine has {gpus}")
    return torch.device("cuda", first)


def engine_device(args: Any) -> torch.device:
    """``placed_device``, made the process's current CUDA device there (streams, CUDA graphs and
    kernels launched without a device go to it)."""
    device = placed_device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    use_cuda_device(device, args)
    return device


def use_cuda_device(device: torch.device, args: Any) -> None:
    """On CUDA: this process's float32 matmuls in TensorFloat32 or not (``--enable-tf32-matmul`` /
    ``--no-enable-tf32-matmul``, SGLang's; unset: off, PyTorch's default). Nothing elsewhere: TF32 is
    a CUDA format (SGLang: "CUDA only")."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if getattr(args, "enable_tf32_matmul", None) else "highest")


def gpu_index(first: int, step: int, replica: int, ranks_per_node: int, local_rank: int) -> int:
    """SGLang's placement: data-parallel replica ``replica``'s local tensor-parallel rank
    ``local_rank`` runs on GPU ``first + (replica * ranks_per_node + local_rank) * step``."""
    return first + (replica * ranks_per_node + local_rank) * step


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
