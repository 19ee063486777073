"""A first start compiles the C++ kernels for minutes: each compile is announced and timed; a cached
build loads silently (issue 41)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from core_kernels import cpp_build

SOURCE = """#include <torch/library.h>
int64_t twice(int64_t x) { return x * 2; }
TORCH_LIBRARY(core_test_progress, m) { m.def("twice(int x) -> int", &twice); }
"""


@pytest.mark.slow
def test_build_logs_progress_and_a_cached_load_does_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if problem := cpp_build.toolchain_problem():
        pytest.skip(problem)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "progress.cpp"
    source.write_text(SOURCE)
    with capture_logs() as logs:
        d, compiled = cpp_build.load("core_test_progress", source, "progress")
    events = [e["event"] for e in logs]
    assert compiled and d.parent == tmp_path / "ext"
    assert events[0].startswith("building progress (first start, ~") and events[0].endswith("s)…")
    assert events[1].startswith("built progress in ")
    with capture_logs() as logs:
        _, compiled = cpp_build.load("core_test_progress", source, "progress")
    assert torch.ops.core_test_progress.twice(21) == 42
    assert not compiled and not [e for e in logs if "build" in e["event"]]
