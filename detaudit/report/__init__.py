"""Renderers: each turns a run summary (plain data, see summary.py) into one output format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..compare import compare
from ..runfolder import load_run
from .console import render_console
from .github import render_github
from .html import render_html
from .markdown import render_markdown
from .summary import summarize


def write_reports(folder: str | Path, summary: dict[str, Any]) -> list[Path]:
    """Write every report of a run into its folder; return the paths written."""
    folder = Path(folder)
    texts = {
        "summary.json": json.dumps(summary, indent=1, sort_keys=True, default=str),
        "report.md": render_markdown(summary),
        "report.html": render_html(summary),
        "report.github.html": render_github(summary),
    }
    return [_write(folder / name, text) for name, text in texts.items()]


def render_folder(folder: str | Path) -> dict[str, Any]:
    """Re-render a saved run folder's reports from its traces; return the summary."""
    info, traces = load_run(folder)
    summary = summarize(info, compare(traces), traces)
    write_reports(folder, summary)
    return summary


def _write(path: Path, text: str) -> Path:
    """Write through a temporary file, so a failure never leaves half a report."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


__all__ = [
    "render_console", "render_folder", "render_github", "render_html", "render_markdown",
    "summarize", "write_reports",
]
