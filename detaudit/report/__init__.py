"""Renderers: each turns a run summary (plain data, see summary.py) into one output format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..storage import atomic_write, jsonable
from .console import render_console, render_ranks_console
from .github import render_github
from .html import render_html
from .markdown import render_markdown
from .summary import summarize


def summary_json(summary: dict[str, Any]) -> str:
    """The summary as strict JSON text (summary.json and ``--json``): a NaN or infinite
    value is written as the string "nan", "inf" or "-inf"."""
    return json.dumps(jsonable(summary), indent=1, sort_keys=True, allow_nan=False)


def write_reports(folder: str | Path, summary: dict[str, Any]) -> list[Path]:
    """Write every report of a run into its folder; return the paths written."""
    folder = Path(folder)
    texts = {
        "summary.json": summary_json(summary),
        "report.md": render_markdown(summary),
        "report.html": render_html(summary),
        "report.github.html": render_github(summary),
    }
    return [atomic_write(folder / name, text) for name, text in texts.items()]


__all__ = [
    "render_console", "render_github", "render_html", "render_markdown", "render_ranks_console",
    "summarize", "summary_json", "write_reports",
]
