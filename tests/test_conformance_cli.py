"""``core plugins --check NAME``: the conformance suites of NAME's kinds from the command line,
a pass/fail table, exit status 1 when a case fails (2 for a name nobody registered)."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import attrs

import core.plugins as plugins
from core import hookimpl
from core.cli import main
from core_plugins.attention.torch_native import TorchNativeBackend
from core_plugins.parsers.tools import Qwen25ToolParser


def test_check_a_builtin_backend_from_the_shell():
    proc = subprocess.run([sys.executable, "-m", "core.cli", "plugins", "--check", "torch_native"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "CASE", "RESULT", "SECONDS", "DETAIL"]
    assert any(line.split()[:4] == ["attention_backend", "torch_native", "sliding_window_decode", "PASSED"] for line in lines)
    assert lines[-1] == "17 passed, 0 failed, 1 skipped"


def test_check_a_name_registered_as_two_kinds(capsys):
    assert main(["plugins", "--check", "glm45", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert {r["kind"] for r in results} == {"tool_parser", "reasoning_parser"}
    assert all(r["status"] == "passed" for r in results), [r for r in results if r["status"] != "passed"]


class IgnoresSlidingWindow(TorchNativeBackend):
    def forward(self, q, k, v, layer, batch):
        return super().forward(q, k, v, attrs.evolve(layer, sliding_window=None), batch)


class LosesFirstCharacter(Qwen25ToolParser):
    """Streams normal text without its first character (parse is right)."""

    def parse_streaming(self, delta, tools=None):
        text, calls = super().parse_streaming(delta, tools)
        if text and not getattr(self, "started", False):
            self.started, text = True, text[1:]
        return text, calls


class FakeEP:
    name, value, dist = "broken", "broken_plugin", types.SimpleNamespace(name="broken-dist", version="0.1")

    def load(self):
        mod = types.ModuleType("broken_plugin")
        mod.register_attention_backends = hookimpl(lambda register: register("broken_window", IgnoresSlidingWindow))
        mod.register_tool_parsers = hookimpl(lambda register: register("broken_qwen25", LosesFirstCharacter))
        return mod


def test_a_broken_installed_plugin_fails_with_a_table_naming_the_cases(monkeypatch, capsys):
    real = plugins._entry_points
    monkeypatch.setattr(plugins, "_entry_points", lambda: [*real(), FakeEP()])
    monkeypatch.delenv("CORE_PLUGINS", raising=False)
    assert main(["plugins", "--check", "broken_window"]) == 1
    out = capsys.readouterr().out
    rows = [line.split()[:4] for line in out.splitlines()]
    assert ["attention_backend", "broken_window", "sliding_window_prefill", "FAILED"] in rows
    assert ["attention_backend", "broken_window", "decode", "PASSED"] in rows
    assert "failures:\n  attention_backend 'broken_window' case 'sliding_window_prefill': step 1 of 1" in out
    assert out.rstrip().endswith("15 passed, 2 failed, 1 skipped")
    # a parser the kit has no samples for still gets the format-independent cases
    assert main(["plugins", "--check", "broken_qwen25"]) == 1
    rows = {line.split()[2]: line.split()[3] for line in capsys.readouterr().out.splitlines()[1:] if line.count("  ") > 3}
    assert rows["streaming_agreement"] == "FAILED" and rows["samples_parse"] == "SKIPPED"


def test_an_unknown_name_is_a_clear_error(capsys):
    assert main(["plugins", "--check", "torch_nativ"]) == 2
    err = capsys.readouterr().err
    assert "no installed plugin registers 'torch_nativ'; did you mean 'torch_native'?" in err
