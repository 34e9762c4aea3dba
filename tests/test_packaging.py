"""What a plain (not editable) install ships: every module of the package and the
bootstrap that `exec` puts on PYTHONPATH (it was left out, and exec recorded nothing)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py


def test_the_wheel_holds_every_module_and_the_exec_bootstrap(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 71 and not importlib.util.find_spec("wheel"):
        pytest.skip("this setuptools builds wheels only with the wheel package")
    source = tmp_path / "source"  # (a build writes build/ beside the sources: not into ours)
    for name in ("detaudit", "probes"):
        shutil.copytree(ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    ours = {str(p.relative_to(source)) for p in (source / "detaudit").rglob("*.py")}
    ours |= {f"detaudit/probes/{p.relative_to(source / 'probes')}"
             for p in (source / "probes").rglob("*.py")}
    assert "detaudit/bootstrap/sitecustomize.py" in ours
    assert ours <= shipped, sorted(ours - shipped)


def test_exec_with_its_bootstrap_missing_says_so_before_running_anything(tmp_path, monkeypatch):
    from detaudit import execution
    from detaudit.config import ExecJob
    from detaudit.errors import DetauditError

    monkeypatch.setattr(execution, "BOOTSTRAP", tmp_path / "bootstrap")
    with pytest.raises(DetauditError, match="lacks .*sitecustomize.py.*reinstall detaudit"):
        execution.exec_command([sys.executable, "-c", "raise SystemExit(9)"], ExecJob(),
                               out=tmp_path / "run")
    assert not (tmp_path / "run").exists()
