"""A third-party plugin end to end: build examples/core-plugin-example as a wheel, install
it into a fresh virtual environment beside core, list it with ``core plugins`` and serve
with its attention backend, model, tool parser and grammar backend, with no edit to core.

The venv sees this interpreter's site-packages (through a ``.pth`` file, see ``see_outer_site``)
so torch & co. (and core, installed editable) are not downloaded again; only the example wheel
goes into it, with ``--no-deps``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import build_tiny_llama
from tests.server_utils import start_server_process

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "core-plugin-example"

pytestmark = pytest.mark.slow


def run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def example_src(tmp_path_factory) -> Path:
    """A clean copy of the example package, so building and testing it leaves the source tree alone."""
    dst = tmp_path_factory.mktemp("example-src") / "core-plugin-example"
    shutil.copytree(EXAMPLE, dst, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*"))
    return dst


def see_outer_site(python: Path) -> None:
    """Make the venv of ``python`` see this interpreter's site-packages, after its own.

    ``venv --system-site-packages`` is not enough: run from inside a virtual environment (the
    README's set-up) it adds the *base* interpreter's site-packages, where core is not. A
    ``.pth`` line that calls ``site.addsitedir`` adds each directory and runs its own ``.pth``
    files (core's editable install), on the system Python and inside a venv alike."""
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    dirs = [d for d in (*site.getsitepackages(), *user) if os.path.isdir(d)]
    (Path(purelib) / "_core_outer_site.pth").write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory, example_src) -> Path:
    tmp = tmp_path_factory.mktemp("plugin-pkg")
    run(sys.executable, "-m", "venv", tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    see_outer_site(python)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", example_src, "-w", tmp / "dist")
    (wheel,) = (tmp / "dist").glob("core_plugin_example-0.3.0-*.whl")
    run(python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel)
    return python


def test_core_plugins_lists_the_installed_example(venv_python):
    env = {k: v for k, v in os.environ.items() if k != "CORE_PLUGINS"}
    listing = json.loads(run(venv_python, "-m", "core.cli", "plugins", "--json", cwd="/", env=env).stdout)
    ex = {p["name"]: p for p in listing}["example"]
    assert (ex["distribution"], ex["version"], ex["module"]) == ("core-plugin-example", "0.3.0", "core_plugin_example")
    assert ex["api_version"] == ">=1.0,<2" and ex["error"] is None
    assert ex["registrations"] == {
        "attention_backend": ["example_counting"], "model": ["ExampleLlamaForCausalLM"],
        "tool_parser": ["example_brackets"], "grammar_backend": ["example_counting_xgrammar"],
    }
    assert {p["name"] for p in listing} >= {"llama", "torch_native", "parsers", "grammar"}  # core's built-ins too
    table = run(venv_python, "-m", "core.cli", "plugins", cwd="/", env=env).stdout
    assert "core-plugin-example" in table and "0.3.0" in table
    assert any(line.split()[:2] == ["example_counting", "example"] for line in table.splitlines())
    # The system interpreter, outside the venv, does not see it: nothing was installed into core.
    assert "example" not in {p["name"] for p in json.loads(
        run(sys.executable, "-m", "core.cli", "plugins", "--json", cwd="/", env=env).stdout)}


def test_the_example_package_own_tests_pass_against_the_install(venv_python, example_src):
    (example_src / "core_plugin_example.py").unlink()  # so they import the installed module
    proc = run(venv_python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=example_src)
    passed = re.search(r"(\d+) passed", proc.stdout)  # its 3 own tests and core.testing's suites (34 cases)
    assert passed and int(passed.group(1)) >= 30 and "failed" not in proc.stdout, proc.stdout[-3000:]


def test_serve_with_the_example_backend_model_parser_and_grammar(venv_python, tmp_path):
    model = tmp_path / "model"
    build_tiny_llama(model)  # a tiny random Llama + char tokenizer, relabelled as the example's architecture
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "architectures": ["ExampleLlamaForCausalLM"]}))
    tok = json.loads((model / "tokenizer_config.json").read_text())
    tok["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(tok))
    stats = tmp_path / "stats.json"
    args = ("--model-path", str(model), "--dtype", "float32",
            "--plugins", "unquantized,example",  # only core's dense weights and the example
            "--attention-backend", "example_counting", "--tool-call-parser", "example_brackets",
            "--grammar-backend", "example_counting_xgrammar", "--example-stats-file", str(stats),
            "--skip-server-warmup")
    base = ("--cpu-threads", "1", "--max-total-tokens", "8192", "--log-level", "warning")
    with start_server_process(*args, python=str(venv_python), base_args=base) as server:
        url = server.base_url
        assert httpx.get(url + "/get_model_info").json()["architecture"] == "ExampleLlamaForCausalLM"
        r = httpx.post(url + "/generate", json={"text": "hello", "sampling_params": {
            "temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 6
        r = httpx.post(url + "/generate", json={"text": "x", "sampling_params": {
            "temperature": 0, "max_new_tokens": 8, "regex": "[0-9]{3}"}}, timeout=60)
        assert r.status_code == 200 and r.json()["text"].isdigit() and len(r.json()["text"]) == 3, r.text
        r = httpx.post(url + "/parse_function_call", json={
            "text": 'ok [[tool get_weather {"city": "Paris"}]]', "tool_call_parser": "example_brackets",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]}, timeout=60)
        assert r.status_code == 200, r.text
        calls = r.json()["calls"]
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["parameters"]) == {"city": "Paris"}
        # A chat completion with tools runs the selected parser over the model's output.
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 4, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
            timeout=60)
        assert r.status_code == 200, r.text
    counts = json.loads(stats.read_text())  # written by the plugin's on_shutdown hook
    assert counts["startups"] == 1 and counts["model_instances"] == 1
    assert counts["attention_prepare"] >= 6 + 3 + 4  # every forward went through the example backend
    assert counts["attention_forward"] == 2 * counts["attention_prepare"]
    assert counts["grammar_compile_regex"] == 1
    assert counts["tool_parser_instances"] >= 2 and counts["tool_calls_parsed"] >= 1
