"""What an installed wheel needs at run time: the C++ kernels are compiled at first use from
sources that ship as package data, so a wheel without them serves no C++ kernel (a GPU-machine
run installed the wheel and every ``cpp_build`` caller raised FileNotFoundError)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from core_kernels import cpp_build

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_every_cpp_source_and_header(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("core_engine-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"core_kernels/{p.name}" for p in (ROOT / "kernels").iterdir() if p.suffix in (".cpp", ".h")}
    wanted |= {f"core_plugins/attention/{p.name}" for p in (ROOT / "plugins" / "attention").glob("*.cpp")}
    assert {"core_kernels/cpu_ops.cpp", "core_kernels/cpu_rows.h", "core_plugins/attention/cpu_attention.cpp"} <= wanted
    assert wanted <= names, f"missing from the wheel: {sorted(wanted - names)}"


def test_a_missing_source_is_a_logged_fallback_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    gone = tmp_path / "not_there.cpp"
    assert not cpp_build.is_built("core_missing", gone)
    assert cpp_build.try_load("core_missing", gone, "missing_kernel", fallback="torch ops") is False
    with pytest.raises(RuntimeError, match=r"the C\+\+ source is missing: .*not_there\.cpp"):
        cpp_build.load("core_missing", gone)


def test_every_package_folder_is_listed():
    """Every Python package under core/, plugins/ and kernels/ is in pyproject.toml's packages, so a
    built wheel carries it (the editable install the tests run from finds unlisted ones too)."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
             for name, folder in cfg["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert found - set(cfg["packages"]) == set(), f"packages missing from pyproject.toml: {sorted(found - set(cfg['packages']))}"
