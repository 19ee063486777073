"""Running a suite outside pytest: :func:`check_plugin` and ``core plugins --check NAME``."""

from __future__ import annotations

import difflib
import json
from typing import Any, Callable, TextIO

from core.errors import UnknownNameError
from core.testing.attention import AttentionSubject, attention_cases
from core.testing.drafter import DrafterSubject, drafter_cases
from core.testing.grammar import GrammarSubject, grammar_cases
from core.testing.hicache_storage import StorageSubject, hicache_storage_cases
from core.testing.multimodal import ProcessorSubject, multimodal_processor_cases
from core.testing.models import ModelSubject, model_cases
from core.testing.parsers import ReasoningParserSubject, ToolParserSubject, reasoning_parser_cases, tool_parser_cases
from core.testing.quant import QuantSubject, quant_cases
from core.testing.suite import Case, CaseResult, Skipped, run_case

SUITES: dict[str, tuple[Callable[..., Any], Callable[[], list[Case]]]] = {
    "attention_backend": (AttentionSubject.build, attention_cases),
    "quant_method": (QuantSubject.build, quant_cases),
    "model": (ModelSubject.build, model_cases),
    "tool_parser": (ToolParserSubject.build, tool_parser_cases),
    "reasoning_parser": (ReasoningParserSubject.build, reasoning_parser_cases),
    "grammar_backend": (GrammarSubject.build, grammar_cases),
    "speculative_algorithm": (DrafterSubject.build, drafter_cases),
    "hicache_storage_backend": (StorageSubject.build, hicache_storage_cases),
    "multimodal_processor": (ProcessorSubject.build, multimodal_processor_cases),  # (pytest only: see the suite)
}


def check_plugin(target: Any, kind: str, *, plugins: Any = None, cases: list[str] | None = None,
                 **options: Any) -> list[CaseResult]:
    """Run ``kind``'s suite (or only the named ``cases``) against ``target`` — a registered name
    (looked up in ``plugins``, default every installed plugin) or a factory — and return one
    result per case. ``options`` are the subject's: ``device``, ``dtype`` / ``dtypes``,
    ``samples``, ``format_calls``, ``tools``, ``config``, ``reference``, tolerances."""
    if kind not in SUITES:
        raise UnknownNameError(f"no conformance suite for kind '{kind}'; kinds: {', '.join(SUITES)}")
    build, all_cases = SUITES[kind]
    chosen = [c for c in all_cases() if cases is None or c.name in cases]
    if cases is not None and (unknown := sorted(set(cases) - {c.name for c in chosen})):
        raise UnknownNameError(f"{kind} suite has no case {', '.join(unknown)}; cases: "
                               f"{', '.join(c.name for c in all_cases())}")
    try:
        subject = build(target, plugins=plugins, **options)
    except Skipped as e:
        return [CaseResult(kind, str(target), c.name, "skipped", str(e)) for c in chosen]
    return [run_case(c, subject) for c in chosen]


def kinds_of(name: str, plugins: Any) -> list[str]:
    """The extension kinds ``name`` is registered under (a parser name can be both a tool and a reasoning parser)."""
    kinds = [k for k in SUITES if name in plugins.names(k)]
    if not kinds:
        every = sorted({n for k in SUITES for n in plugins.names(k)})
        msg = f"no installed plugin registers '{name}'"
        if close := difflib.get_close_matches(name, every, n=1):
            msg += f"; did you mean '{close[0]}'?"
        raise UnknownNameError(msg + f"; registered names: {', '.join(every)}")
    return kinds


def format_results(results: list[CaseResult], width: int = 100) -> str:
    """A table (kind, name, case, result, seconds, detail), the failures in full, and a count."""
    rows = [("KIND", "NAME", "CASE", "RESULT", "SECONDS", "DETAIL")]
    for r in results:
        detail = "" if r.status == "passed" else r.message.split(": ", 1)[-1] if r.status == "failed" else r.message
        detail = detail if len(detail) <= width else detail[: width - 3] + "..."
        rows.append((r.kind, r.target, r.case, r.status.upper(), f"{r.seconds:.2f}", detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(row[:5], widths)), row[5]]).rstrip() for row in rows]
    failed = [r for r in results if r.status == "failed"]
    if failed:
        lines += ["", "failures:"] + [f"  {r.message}" for r in failed]
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "skipped")}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items())]
    return "\n".join(lines)


def check_command(name: str, plugins: Any, out: TextIO, as_json: bool = False) -> int:
    """``core plugins --check NAME``: every suite ``name`` is registered for; 1 if a case failed."""
    try:  # a quiet table: no progress bars from transformers while checkpoints are written
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    results = [r for kind in kinds_of(name, plugins) for r in check_plugin(name, kind, plugins=plugins)]
    if as_json:
        out.write(json.dumps([{"kind": r.kind, "name": r.target, "case": r.case, "status": r.status,
                               "message": r.message, "seconds": round(r.seconds, 3)} for r in results], indent=2) + "\n")
    else:
        out.write(format_results(results) + "\n")
    return 1 if any(r.status == "failed" for r in results) else 0
