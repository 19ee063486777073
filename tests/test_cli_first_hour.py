"""The first hour with the CLI (issue 41): a mistyped or SGLang-only flag, a bad ``--config``
value and a device this machine lacks each end in one line naming the problem, exit status 2,
before any model loads; a slow CPU dtype is warned about; the offline ``Engine`` logs to stderr.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from core.errors import CoreError
from core.server.args import SGLANG_FLAGS_LACKING, check_device_args

REPO = Path(__file__).resolve().parents[1]


def _parse(*argv: str) -> argparse.Namespace:
    from core.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def _exit_line(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """The one stderr line ``core serve ARGV`` exits 2 with."""
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _core(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "core.cli", *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    return proc, time.monotonic() - t0


# ---------------------------------------------------------------------------- unknown flags
def test_a_typo_names_the_closest_flags(capsys: pytest.CaptureFixture) -> None:
    line = _exit_line(capsys, "--max-runing-requests", "4")
    assert line.startswith("core serve: error: unknown flag --max-runing-requests; did you mean --max-running-requests")


def test_a_typo_with_equals_and_a_stray_word(capsys: pytest.CaptureFixture) -> None:
    assert "did you mean --context-length" in _exit_line(capsys, "--context-lenght=512")
    assert "unexpected argument 'my-model'" in _exit_line(capsys, "my-model")


@pytest.mark.parametrize("flag", ["--cpu-offload-gb", "--max-lora-chunk-size", "--speculative-draft-model-revision",
                                  "--enable-nccl-nvls", "--tool-server"])
def test_an_sglang_flag_core_lacks_is_named_as_one(capsys: pytest.CaptureFixture, flag: str) -> None:
    assert flag in SGLANG_FLAGS_LACKING
    assert _exit_line(capsys, flag) == f"core serve: error: {flag} is an SGLang flag this server does not support yet"


def _sglang_server_flags(root: Path) -> set[str]:
    """SGLang 0.5's server flags read from its source text (the package is never imported): the
    ``A[...]`` fields of ``arg_groups/fields/*.py`` under their cli_name and aliases, less
    ``no_cli``, plus ``server_args.py``'s own ``add_argument`` calls."""
    def const(n: ast.AST) -> object:
        return n.value if isinstance(n, ast.Constant) else None

    names: set[str] = set()
    for path in sorted((root / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(node.annotation, ast.Subscript) and getattr(node.annotation.value, "id", None) == "A"):
                continue
            parts = node.annotation.slice.elts if isinstance(node.annotation.slice, ast.Tuple) else []
            if len(parts) < 2:
                continue
            meta, flags = parts[1], ["--" + node.target.id.replace("_", "-")]
            if isinstance(meta, ast.Call):
                kw = {k.arg: k.value for k in meta.keywords}
                if "no_cli" in kw and const(kw["no_cli"]) is True:
                    continue
                if "cli_name" in kw and const(kw["cli_name"]):
                    flags = [const(kw["cli_name"])]
                if isinstance(kw.get("aliases"), ast.List):
                    flags += [const(e) for e in kw["aliases"].elts if const(e)]
            names.update(flags)
    for node in ast.walk(ast.parse((root / "server_args.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names.update(a.value for a in node.args if isinstance(const(a), str) and a.value.startswith("-"))
    return names


def test_every_sglang_server_flag_is_parsed_or_named() -> None:
    """The installed SGLang's flags (its source text) are each either a core flag or in the list."""
    spec = importlib.util.find_spec("sglang")
    root = Path(spec.origin).parent / "srt" if spec and spec.origin else None
    if root is None or not (root / "arg_groups" / "fields").is_dir():
        pytest.skip("SGLang 0.5.23's source is not installed here")
    from core.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    serve.parse_known_args([])  # loads plugin flags
    sglang = _sglang_server_flags(root)
    assert len(sglang) > 400
    assert sorted(sglang - set(serve._option_string_actions) - SGLANG_FLAGS_LACKING) == []


def test_a_typo_exits_2_in_one_line_without_loading(tmp_path: Path) -> None:
    proc, seconds = _core("serve", "--max-runing-requests", "4")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "core serve: error: unknown flag --max-runing-requests; did you mean --max-running-requests, "
        "--max-queued-requests or --log-requests?"]
    assert seconds < 60
    proc, _ = _core("generate", "hi", "--max-new-tokns", "3")
    assert proc.returncode == 2 and "did you mean --max-new-tokens" in proc.stderr and "usage:" not in proc.stderr


# ---------------------------------------------------------------------------- --config values
@pytest.mark.parametrize("text,expected", [
    ("dtype: float8\n", "dtype: 'float8' is not allowed (allowed: one of auto, float32, bfloat16, float16, half, float)"),
    ("port: abc\n", "port: 'abc' is not allowed (allowed: an integer)"),
    ("mem-fraction-static: lots\n", "mem_fraction_static: 'lots' is not allowed (allowed: a number)"),
    ("enable_metrics: 3\n", "enable_metrics: 3 is not allowed (allowed: true or false)"),
    ("schedule_policy: [lpm, fcfs]\n", "schedule_policy: takes one value, got the list ['lpm', 'fcfs']"),
    ("max_runing_requests: 3\n", "unknown flag --max-runing-requests; did you mean --max-running-requests"),
    ("enable_lmcache: true\n", "--enable-lmcache is an SGLang flag this server does not support yet"),
])
def test_a_bad_config_value_names_the_file_and_key(capsys: pytest.CaptureFixture, tmp_path: Path, text: str,
                                                   expected: str) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 4000\n" + text if not text.startswith("port") else text)
    assert _exit_line(capsys, "--config", str(cfg)).startswith(f"core serve: error: config file {cfg}: {expected}")


def test_good_config_values_still_parse(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("dtype: bfloat16\nmem_fraction_static: 0.5\nschedule_policy: lpm\nenable_metrics: true\n")
    ns = _parse("--config", str(cfg))
    assert (ns.dtype, ns.mem_fraction_static, ns.schedule_policy, ns.enable_metrics) == ("bfloat16", 0.5, "lpm", True)


# ---------------------------------------------------------------------------- devices
@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("argv,message", [
    (["--attention-backend", "flashinfer"], "--attention-backend flashinfer cannot run here: it needs a CUDA "
                                            "GPU and this machine has none; use cpu or torch_native, or leave it unset"),
    (["--attention-backend", "triton"], "--attention-backend triton cannot run here: it needs a CUDA GPU and this machine has none"),
    (["--decode-attention-backend", "triton"], "--decode-attention-backend triton cannot run here: it needs a CUDA GPU"),
    (["--prefill-attention-backend", "flashinfer"], "--prefill-attention-backend flashinfer cannot run here"),
    (["--device", "npu"], "--device npu is not supported: use cpu, cuda or cuda:N, or leave it unset"),
    (["--device", "cuda:x"], "--device cuda:x is not supported"),
    (["--device", "cuda"], "--device cuda needs a CUDA GPU; this machine has none: use cpu, or leave it unset"),
])
def test_device_choices_this_machine_lacks_are_refused(no_gpu: None, argv: list[str], message: str) -> None:
    from core.server.args import validate_serve_args

    with pytest.raises(CoreError) as e:
        validate_serve_args(_parse(*argv))
    assert str(e.value).startswith(message)


def test_a_cuda_backend_with_device_cpu_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(CoreError, match="needs a CUDA GPU and --device cpu was given"):
        check_device_args(_parse("--attention-backend", "flashinfer", "--device", "cpu"))
    check_device_args(_parse("--attention-backend", "flashinfer"))
    with pytest.raises(CoreError, match=r"--device cuda:1: this machine has 1 CUDA GPU\(s\), cuda:0 to cuda:0"):
        check_device_args(_parse("--device", "cuda:1"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("argv", [["serve", "--attention-backend", "flashinfer"], ["serve", "--device", "npu"],
                                  ["generate", "hi", "--device", "npu"]])
def test_device_refusals_exit_2_before_loading(argv: list[str]) -> None:
    proc, seconds = _core(*argv)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"core {argv[0]}: error: --") and "pip install" not in lines[0]
    assert seconds < 60


@pytest.mark.parametrize("native,dtype,faster", [
    (True, "float16", "bfloat16"), (True, "half", "bfloat16"), (False, "float16", "float32"),
    (False, "bfloat16", "float32"), (True, "bfloat16", None), (True, "float32", None), (False, "auto", None)])
def test_a_slow_cpu_dtype_is_warned_about(no_gpu: None, monkeypatch: pytest.MonkeyPatch, native: bool, dtype: str,
                                          faster: str | None) -> None:
    import core.engine.device as device

    import torch

    from core.engine.model_loader.loader import pick_dtype

    monkeypatch.setattr(device, "cpu_native_bf16", lambda flags=None: (native, "test CPU"))
    with capture_logs() as logs:  # where core serve and Engine(dtype=...) both pick the dtype
        pick_dtype(dtype, None, torch.device("cpu"))
    slow = [e for e in logs if e["event"] == "cpu.slow_dtype"]
    if faster is None:
        assert slow == []
    else:
        assert len(slow) == 1 and slow[0]["log_level"] == "warning" and slow[0]["faster"] == faster


# ---------------------------------------------------------------------------- the offline Engine's logs
def test_offline_engine_logs_to_stderr_not_stdout(tmp_path: Path) -> None:
    """``from core import Engine`` in a user's script: its stdout holds only what the script prints."""
    script = tmp_path / "use_engine.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from tests.conftest import build_tiny_llama, make_engine

        build_tiny_llama(Path({str(tmp_path / "tiny")!r}))
        engine = make_engine({str(tmp_path / "tiny")!r}, max_total_tokens=256)
        out = engine.generate("ab", {{"max_new_tokens": 2, "temperature": 0}})
        engine.shutdown()
        print("ANSWER", len(out["text"]) >= 0)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "ANSWER True\n"
    assert "[info     ] attention_backend.chosen" in proc.stderr


def test_an_application_structlog_setup_is_kept() -> None:
    import structlog

    from core.log import configure_default_logging

    was, saved = structlog.is_configured(), structlog.get_config()
    mine = structlog.PrintLoggerFactory(file=sys.stdout)
    structlog.configure(logger_factory=mine)
    try:
        configure_default_logging("debug")
        assert structlog.get_config()["logger_factory"] is mine
    finally:
        structlog.reset_defaults()
        if was:
            structlog.configure(**saved)


def test_captured_logs_stay_captured_when_an_engine_starts() -> None:
    """structlog's ``capture_logs`` (an application's processors alone) survives a later Engine's
    set-up, however logging was set up before: the default set-up itself included."""
    import structlog
    from structlog.testing import capture_logs

    from core.log import configure_default_logging

    was, saved = structlog.is_configured(), structlog.get_config()
    saved["processors"] = list(saved["processors"])  # (structlog edits its list in place)
    structlog.reset_defaults()
    try:
        configure_default_logging("info")  # (what the first Engine of a process does)
        with capture_logs() as logs:
            configure_default_logging("info")  # (a second Engine, inside the capture)
            structlog.get_logger("core.engine").info("engine.ready")
        assert [e["event"] for e in logs] == ["engine.ready"]
    finally:
        structlog.reset_defaults()
        if was:
            structlog.configure(**saved)
