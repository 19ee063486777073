"""What every conformance suite is made of: named cases, their results, and how a target is found.

A *case* is one named check (``decode``, ``sliding_window_prefill``, ``streaming_agreement``...)
run against one *subject* (the plugin under test, resolved and ready). A case passes by
returning, fails by raising :class:`ConformanceError` (whose message names the case), and is
skipped by raising :class:`Skipped` with the reason. The same cases run under pytest (through
the suite classes and the ``core.testing`` pytest plugin) and from ``core plugins --check``.
"""

from __future__ import annotations

import time
import traceback
import zlib
from typing import Any, Callable

import attrs
import torch


class ConformanceError(AssertionError):
    """A plugin disagrees with the reference; the message names the kind, the plugin and the case."""


class Skipped(Exception):
    """A case that does not apply here (no GPU, no declared support); the message is the reason."""


@attrs.define(frozen=True)
class Case:
    """One named check of a suite; ``run(subject)`` raises on failure."""

    name: str
    run: Callable[[Any], None]
    doc: str = ""


@attrs.define(frozen=True)
class CaseResult:
    """The outcome of one case: ``status`` is ``passed``, ``failed`` or ``skipped``."""

    kind: str
    target: str
    case: str
    status: str
    message: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != "failed"


def fail(subject: Any, case: str, detail: str) -> ConformanceError:
    """The error a case raises: ``<kind> '<target>' case '<case>': <detail>``."""
    return ConformanceError(f"{subject.kind} '{subject.label}' case '{case}': {detail}")


def run_case(case: Case, subject: Any) -> CaseResult:
    """Run one case and record its outcome; an unexpected exception is a failure naming the case."""
    start = time.perf_counter()
    status, message = "passed", ""
    try:
        case.run(subject)
    except Skipped as e:
        status, message = "skipped", str(e)
    except ConformanceError as e:
        status, message = "failed", str(e)
    except Exception as e:  # a crash inside the plugin is a failure of that case, not of the kit
        status = "failed"
        where = traceback.extract_tb(e.__traceback__)[-1]
        message = (f"{subject.kind} '{subject.label}' case '{case.name}': raised {type(e).__name__}: {e} "
                   f"(at {where.filename}:{where.lineno})")
    return CaseResult(subject.kind, subject.label, case.name, status, message, time.perf_counter() - start)


def run_in_pytest(case: Case, subject: Any) -> None:
    """Run one case under pytest: a failure is reported by its message (no kit traceback)."""
    import pytest

    result = run_case(case, subject)
    if result.status == "skipped":
        pytest.skip(result.message)
    if result.status == "failed":
        pytest.fail(result.message, pytrace=False)


def resolve_target(kind: str, target: Any, plugins: Any = None) -> tuple[Callable[..., Any], str]:
    """``(factory, label)`` for a registered name (looked up in ``plugins``, by default every
    installed plugin) or for a factory passed directly (a class or a callable)."""
    if isinstance(target, str):
        if plugins is None:
            plugins = default_plugins()
        return plugins.resolve(kind, target), target
    if not callable(target):
        raise TypeError(f"a {kind} under test must be a registered name or a factory, got {target!r}")
    return target, getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)


_PLUGINS: list[Any] = []


def default_plugins() -> Any:
    """Every installed plugin (``$CORE_PLUGINS`` applies), loaded once per process."""
    if not _PLUGINS:
        from core.plugins import load_plugins

        _PLUGINS.append(load_plugins())
    return _PLUGINS[0]


REFERENCE_PLUGINS = "torch_native,unquantized"  # the built-in plugins that provide the references
_REFERENCES: list[Any] = []


def reference(kind: str, name: str) -> Callable[..., Any]:
    """A built-in reference (attention ``torch_native``, quant method ``none``), loaded from its
    plugin through the registry (core never imports a built-in plugin), whatever ``$CORE_PLUGINS`` says."""
    if not _REFERENCES:
        from core.plugins import load_plugins

        _REFERENCES.append(load_plugins(REFERENCE_PLUGINS))
    return _REFERENCES[0].resolve(kind, name)


def seed_for(*parts: object) -> int:
    """A stable seed from a case name (``hash()`` of a str changes between processes)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """Largest absolute difference and where it is (for a failure message)."""
    diff = (got.float() - want.float()).abs()
    flat = int(diff.argmax())
    return float(diff.view(-1)[flat]), tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))


def assert_close(subject: Any, case: str, what: str, got: torch.Tensor, want: torch.Tensor,
                 atol: float, rtol: float) -> None:
    """``|got - want| <= atol + rtol * |want|`` everywhere, else a failure naming the case and the worst element."""
    if got.shape != want.shape:
        raise fail(subject, case, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    g, w = got.float(), want.float()
    if not torch.isfinite(g).all():
        raise fail(subject, case, f"{what}: non-finite values at {torch.nonzero(~torch.isfinite(g))[:3].tolist()}")
    bad = (g - w).abs() > atol + rtol * w.abs()
    if bad.any():
        err, at = max_error(g, w)
        raise fail(subject, case, f"{what}: {int(bad.sum())} of {bad.numel()} values differ beyond "
                                  f"atol={atol:g}, rtol={rtol:g} (max |diff| {err:.3g} at {at}: "
                                  f"got {g[at].item():.5g}, reference {w[at].item():.5g})")
