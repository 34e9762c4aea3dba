"""The architecture, kept honest: no import cycles, each stage imports only the stages below
it, and everything below the recorder works without torch."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "detaudit"
GOLDEN = Path(__file__).parent / "golden" / "planted"

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

# Stages from the bottom up: a module may import its own stage and the stages below it.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("files", ("detaudit.errors", "detaudit.storage", "detaudit.words")),
    ("format", ("detaudit.trace",)),
    ("config", ("detaudit.config", "detaudit.probe", "detaudit.seeding", "detaudit.planting")),
    ("run folder", ("detaudit.runfolder",)),
    ("analysis", ("detaudit.analysis",)),
    ("reports", ("detaudit.report",)),
    ("recording", ("detaudit.record",)),
    ("drivers", ("detaudit.drivers", "detaudit.probes", "detaudit.bootstrap")),
    ("investigations", ("detaudit.investigate",)),
    ("api", ("detaudit.api", "detaudit.testing", "detaudit.attached", "detaudit.execution")),
    ("cli", ("detaudit.cli", "detaudit.__main__", "detaudit")),
]
# What `detaudit report`, `detaudit diff` and the analysis of saved runs need: no torch.
TORCH_FREE = [
    "detaudit", "detaudit.errors", "detaudit.storage", "detaudit.words", "detaudit.trace",
    "detaudit.config", "detaudit.planting",
    "detaudit.runfolder", "detaudit.analysis.compare", "detaudit.analysis.ranks",
    "detaudit.analysis.diff", "detaudit.analysis.verdict", "detaudit.report",
    "detaudit.report.summary", "detaudit.report.console", "detaudit.report.markdown",
    "detaudit.report.html", "detaudit.report.github", "detaudit.report.svg",
    "detaudit.report.junit", "detaudit.analysis.knowledge", "detaudit.api", "detaudit.cli",
    # exec's own process: it starts the command, compares what it recorded and zooms
    "detaudit.execution", "detaudit.drivers.stopping", "detaudit.investigate.zoom",
    "detaudit.investigate.drilldown",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (the probes live in probes/ but install as
    detaudit.probes)."""
    found = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    probes = PACKAGE.parent / "probes"
    for p in probes.glob("*.py"):
        name = "detaudit.probes" + ("" if p.stem == "__init__" else f".{p.stem}")
        found[name] = p
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere (module level or in a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _stage(name: str) -> int:
    """The stage of a module: the one with the longest matching prefix."""
    matches = [(len(prefix), level) for level, (_, prefixes) in enumerate(STAGES)
               for prefix in prefixes if name == prefix or name.startswith(prefix + ".")]
    assert matches, f"{name} belongs to no stage: add it to STAGES"
    return max(matches)[1]


def test_the_import_graph_has_no_cycles() -> None:
    graph = _graph()
    assert "detaudit.analysis.compare" in graph["detaudit.analysis.verdict"]  # the walk works
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_each_stage_imports_only_the_stages_below_it() -> None:
    wrong = [
        f"{name} ({STAGES[_stage(name)][0]}) imports {target} ({STAGES[_stage(target)][0]})"
        for name, targets in sorted(_graph().items()) for target in sorted(targets)
        if _stage(target) > _stage(name)
    ]
    assert not wrong, "\n".join(wrong)


_NO_TORCH = (
    "import sys\n"
    "for name in ('torch', 'torchvision'):\n"
    "    sys.modules[name] = None  # `import torch` now raises ImportError\n"
)


def _without_torch(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_TORCH + code], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)


def test_analysis_and_reports_import_and_run_without_torch(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    shutil.copytree(GOLDEN, folder)
    code = (
        "import importlib\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "from detaudit.cli import main\n"
        f"assert main(['report', {str(folder)!r}]) == 1\n"
        f"assert main(['diff', {str(folder)!r}, {str(folder)!r}]) == 0\n"
        "try:\n"
        "    main(['models', '--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0\n"
        "print('torch-free')\n"
    )
    done = _without_torch(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("torch-free")
    assert "DIVERGENT: first at step 1" in done.stdout and "MATCH" in done.stdout
    assert (folder / "report.html").exists() and (folder / "summary.json").exists()


def test_the_without_torch_harness_really_blocks_torch(tmp_path: Path) -> None:
    done = _without_torch("import detaudit.drivers.runner\n", tmp_path)
    assert done.returncode != 0 and "torch" in done.stderr
