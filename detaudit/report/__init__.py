"""Renderers: each turns a run summary (plain data, see summary.py) into one output format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .console import render_console
from .summary import summarize


def write_reports(folder: str | Path, summary: dict[str, Any]) -> list[Path]:
    """Write every report of a run into its folder; return the paths written."""
    folder = Path(folder)
    path = folder / "summary.json"
    path.write_text(json.dumps(summary, indent=1, sort_keys=True, default=str))
    return [path]


__all__ = ["render_console", "summarize", "write_reports"]
