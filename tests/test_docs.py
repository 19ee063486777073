"""The hook reference in docs/plugins.md must cover every hook spec with its exact signature."""

from __future__ import annotations

import inspect
from pathlib import Path

from core import hookspecs

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def hook_specs() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(hookspecs).items()
        if callable(fn) and getattr(fn, "core_spec", None) is not None
    }


def test_every_hook_is_documented_with_its_signature() -> None:
    text = DOC.read_text()
    specs = hook_specs()
    assert len(specs) >= 9
    for name, sig in specs.items():
        params = ", ".join(sig.parameters)
        assert f"### `{name}({params})`" in text, f"docs/plugins.md lacks a section for {name}({params})"
