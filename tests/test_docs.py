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


# --------------------------------------------------------------------------- the plugin guide

GUIDE = DOC.parent / "writing-a-plugin.md"


def _blocks(text: str, lang: str) -> list[str]:
    import re

    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def test_plugin_guide_code_runs(tmp_path, monkeypatch):
    """Every ```python block of docs/writing-a-plugin.md, run in order as the module ``my_plugin``."""
    import sys
    import tomllib
    import types

    text = GUIDE.read_text()
    (toml,) = _blocks(text, "toml")
    project = tomllib.loads(toml)
    assert project["project"]["entry-points"]["core.plugins"] == {"myplugin": "my_plugin"}
    blocks = _blocks(text, "python")
    assert len(blocks) >= 6
    monkeypatch.delenv("CORE_PLUGINS", raising=False)
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("my_plugin")
    module.__file__ = str(GUIDE)
    monkeypatch.setitem(sys.modules, "my_plugin", module)
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{GUIDE.name}[python block {i + 1}]", "exec"), module.__dict__)
        except Exception as e:
            raise AssertionError(f"docs/writing-a-plugin.md python block {i + 1} failed: {e!r}\n{block}") from e


def test_docs_link_each_other():
    for name in ("writing-a-plugin.md", "interfaces.md", "architecture.md"):
        assert (DOC.parent / name).exists()
        assert name in DOC.read_text(), f"docs/plugins.md does not link {name}"
