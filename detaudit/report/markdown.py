"""report.md: the report as Markdown, every value from the user's world escaped."""

from __future__ import annotations

import re
from typing import Any

from .sections import Block, Code, Figure, Table, Text, sections, title

_ESCAPES = {
    "\\": "\\\\", "`": "\\`", "|": "\\|", "*": "\\*", "_": "\\_", "[": "\\[", "]": "\\]",
    "~": "\\~", "#": "\\#", "<": "&lt;", ">": "&gt;", "&": "&amp;", "\n": " ", "\r": " ",
}


def render_markdown(summary: dict[str, Any]) -> str:
    """The whole report as Markdown."""
    out = [f"# {md(title(summary))}"]
    for section in sections(summary):
        out.append(f"## {md(section.title)}")
        out.extend(_block(b) for b in section.blocks)
    return "\n\n".join(part for part in out if part) + "\n"


def md(text: str) -> str:
    """`text` as inert Markdown: no markup, no HTML, one line."""
    return "".join(_ESCAPES.get(c, c) for c in str(text))


def fence(text: str) -> str:
    """`text` in a fenced code block whose fence no run of backticks in it can close."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    bar = "`" * max(3, longest + 1)
    return f"{bar}text\n{text}\n{bar}"


def _block(block: Block) -> str:
    if isinstance(block, Text):
        return f"**{md(block.text)}**" if block.strong else md(block.text)
    if isinstance(block, Code):
        return fence(block.text)
    if isinstance(block, Figure):
        return "\n\n".join(_block(b) for b in block.fallback)
    return _table(block)


def _table(table: Table) -> str:
    lines = [f"**{md(table.caption)}**", ""] if table.caption else []
    lines.append("| " + " | ".join(md(h) for h in table.headers) + " |")
    lines.append("|" + "---|" * len(table.headers))
    lines.extend("| " + " | ".join(md(c) for c in row) + " |" for row in table.rows)
    return "\n".join(lines)
