"""report.github.html: a fragment for a GitHub comment, in the tags GitHub keeps."""

from __future__ import annotations

from html import escape
from typing import Any

from .html import omitted_note, table_html
from .sections import Block, Code, Figure, Section, Table, Text, clip, omitted, sections, title

LIMIT = 65536  # characters GitHub accepts in one comment
TRUNCATE = ("map", "per_step", "origins", "census", "alerts", "ops")  # least important first
CAPS = (500, 100, 20, 0)


def render_github(summary: dict[str, Any]) -> str:
    """The report as a GitHub comment, shortened to fit one if it must be."""
    limits: dict[str, int] = {}
    text = _render(summary, limits)
    for key in TRUNCATE:
        for cap in CAPS:
            if len(text) <= LIMIT:
                return text
            limits[key] = cap
            text = _render(summary, limits)
    return text if len(text) <= LIMIT else _minimal(summary)


def _render(summary: dict[str, Any], limits: dict[str, int]) -> str:
    parts = sections(summary, limits)
    out = [f"<h3>{escape(title(summary))}</h3>"]
    cut = omitted(parts)
    if cut:
        out.append(
            "<p><i>" + escape(
                "Shortened to fit a GitHub comment; left out: " + "; ".join(cut)
                + ". The full report is report.html in the run folder."
            ) + "</i></p>"
        )
    out.extend(_section(s, i == 0) for i, s in enumerate(parts))
    return "\n".join(out) + "\n"


def _section(section: Section, first: bool) -> str:
    blocks = "\n".join(_block(b) for b in section.blocks)
    return blocks if first else f"<h4>{escape(section.title)}</h4>\n{blocks}"


def _block(block: Block) -> str:
    if isinstance(block, Text):
        text = escape(block.text)
        return f"<p><b>{text}</b></p>" if block.strong else f"<p>{text}</p>"
    if isinstance(block, Code):
        return f"<pre>{escape(block.text)}</pre>"
    if isinstance(block, Figure):
        return "\n".join(_block(b) for b in block.fallback)
    return _table(block)


def _table(table: Table) -> str:
    body = table_html(table)
    note = omitted_note(table)
    if note:
        body += f"<p><i>{escape(note)}</i></p>"
    if table.fold:
        shown = len(table.rows)
        count = f"{shown} of {shown + table.omitted}" if table.omitted else str(shown)
        head = f"{escape(table.caption)} ({count} rows)"
        return f"<details><summary>{head}</summary>\n{body}\n</details>"
    return (f"<p><b>{escape(table.caption)}</b></p>" if table.caption else "") + body


def _minimal(summary: dict[str, Any]) -> str:
    """Only the verdict, for a run too large for any shortened report."""
    return (
        f"<h3>{escape(clip(title(summary), 500))}</h3>\n"
        f"<p><b>{escape(clip(summary['headline'], 2000))}</b></p>\n"
        "<p><i>This run's report is too large for a GitHub comment even shortened; "
        "see report.html in the run folder.</i></p>\n"
    )
