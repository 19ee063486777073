"""Compile a C++ source of torch operators once per machine and load it (``torch.utils.cpp_extension``).

Used by the CPU kernels (``kernels/cpu_ops``, ``cpu_gemv``, ``cpu_decode`` and the ``cpu`` attention backend's kernel).
A build is cached under the torch extensions folder in a directory named by a hash of the source
(with the headers it includes, ``kernels/*.h``),
the flags, the CPU's instruction set and the torch version, so a changed source, another CPU
sharing the folder, or a new torch build never loads a stale library; later starts only load it.
Importing this module does not compile anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import time
from pathlib import Path

import torch


def flags() -> list[str]:
    out = ["-O3", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        out.append("-march=native")
        if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            out.append("-mprefer-vector-width=512")
    return out


def cpu_id() -> str:
    """What -march=native compiles for, so that a build folder shared between machines is never
    loaded by a CPU it was not built for."""
    try:
        with open("/proc/cpuinfo") as f:
            isa = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        isa = platform.processor()
    return f"{torch.backends.cpu.get_cpu_capability()} {isa}"


KERNELS = Path(__file__).parent  # the shared headers (cpu_rows.h, cpu_gemv.h, cpu_attention.h)


def include_dirs(source: Path) -> list[Path]:
    """Where ``#include "x.h"`` is looked for: beside the source, then in ``kernels/``."""
    return [source.parent] + ([KERNELS] if source.parent != KERNELS else [])


def source_text(source: Path) -> str:
    """The source with the text of every header it includes with quotes (``#include "x.h"``,
    recursively, from :func:`include_dirs`): what a build depends on besides the flags."""
    seen: set[Path] = set()
    dirs = include_dirs(source)

    def expand(path: Path) -> str:
        seen.add(path)
        text = path.read_text()
        for name in re.findall(r'^#include "([^"]+)"', text, re.M):
            header = next((d / name for d in dirs if (d / name).exists()), None)
            if header is not None and header not in seen:
                text += "\n" + expand(header)
        return text

    return expand(source)


def build_dir(prefix: str, source: Path) -> Path:
    """``<torch extensions folder>/<prefix>_<hash>``."""
    from torch.utils.cpp_extension import get_default_build_root

    key = "\n".join([source_text(source), *flags(), cpu_id(), torch.__version__, os.environ.get("CXX", "c++")])
    name = prefix + "_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


def toolchain_problem() -> str | None:
    """What is missing to compile here, or None."""
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: '{cxx}' is not on PATH (install g++, or set CXX)"
    if not is_ninja_available():
        return "the 'ninja' package is missing (pip install ninja)"
    return None


def is_built(prefix: str, source: Path) -> bool:
    try:
        d = build_dir(prefix, source)
    except OSError:  # the source is missing: nothing can be built or loaded
        return False
    return (d / f"{d.name}.so").exists()


STALE_LOCK_SECONDS = 600  # a build lock older than this was left by a process that died mid-build
# rough compile times on a 2-core machine, shown while a first start compiles (silent otherwise for minutes)
BUILD_SECONDS = {"core_cpu_decode": 29, "core_cpu_ops": 25, "core_cpu_attention": 13, "core_cpu_gemv": 12}
DEFAULT_BUILD_SECONDS = 20


def load(prefix: str, source: Path, name: str | None = None) -> tuple[Path, bool]:
    """Compile (if needed) and load ``source``, registering its ``TORCH_LIBRARY`` operators;
    (build folder, compiled now). Raises RuntimeError with the compiler's last lines.

    A library built already is loaded directly: torch's build path takes a lock file first, and a
    process killed while holding it (a tensor-parallel rank stopped mid-start, say) would leave
    every later start waiting on it forever. Only an actual compile logs ``building <name>`` and
    ``built <name>`` (it takes tens of seconds); loading a cached build logs nothing here."""
    try:
        d = build_dir(prefix, source)
    except OSError as e:  # an install that lacks the sources (a wheel built without its package data)
        raise RuntimeError(f"the C++ source is missing: {e}") from None
    so = d / f"{d.name}.so"
    if so.exists():
        try:
            torch.ops.load_library(str(so))
            return d, False
        except OSError:  # a build cut off mid-link: build again
            so.unlink(missing_ok=True)
    from torch.utils.cpp_extension import load as cpp_load

    if problem := toolchain_problem():
        raise RuntimeError(problem)
    d.mkdir(parents=True, exist_ok=True)
    lock = d / "lock"
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
    import structlog

    log = structlog.get_logger("core_kernels.build")
    name = name or prefix.removeprefix("core_")
    log.info(f"building {name} (first start, ~{BUILD_SECONDS.get(prefix, DEFAULT_BUILD_SECONDS)}s)…", kernel=name)
    t0 = time.perf_counter()
    try:
        cpp_load(d.name, [str(source)], extra_cflags=flags(), extra_ldflags=["-fopenmp"], build_directory=str(d),
                 extra_include_paths=[str(d) for d in include_dirs(source)],
                 is_python_module=False, verbose=False)
    except Exception as e:
        raise RuntimeError("compiling failed: " + " ".join(str(e).strip().splitlines()[-3:])) from None
    log.info(f"built {name} in {time.perf_counter() - t0:.0f}s", kernel=name, build_dir=str(d))
    return d, True


def try_load(prefix: str, source: Path, name: str, fallback: str) -> bool:
    """:func:`load`, logged as ``<name>.loaded`` (where from, whether compiled now, seconds) or, when it
    cannot be built here, ``<name>.unavailable`` with the reason and what callers use instead."""
    import structlog

    log = structlog.get_logger(f"core_kernels.{name}")
    t0 = time.perf_counter()
    try:
        d, compiled = load(prefix, source, name)
    except RuntimeError as e:
        log.warning(f"{name}.unavailable", reason=str(e), fallback=fallback)
        return False
    log.info(f"{name}.loaded", loaded_from=str(d), compiled=compiled, seconds=round(time.perf_counter() - t0, 1))
    return True
