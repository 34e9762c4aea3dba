"""report.html: one standalone page (inline CSS and SVG, no scripts, nothing fetched)."""

from __future__ import annotations

from html import escape
from typing import Any

from .sections import Block, Code, Section, Table, Text, sections, title
from .svg import figure

VERDICTS = {"deterministic": "deterministic", "divergent": "divergent", "failed": "failed",
            "nondeterministic op": "divergent", "match": "deterministic",
            "mismatch": "divergent"}  # verdict -> header class
CAPTIONS = {
    "loss": "Loss per step of every repeat; where repeats agree, their curves lie on each other.",
    "drift": "Relative |Δloss| between repeats per step (log scale); dashed lines start epochs.",
    "map": "Where records diverge: origin (the difference starts there) apart from propagated.",
}
CSS = """
:root{--ink:#1f2328;--muted:#59636e;--line:#d1d9e0;--soft:#f6f8fa}
*{box-sizing:border-box}
body{margin:0;background:var(--soft);color:var(--ink);
 font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1200px;margin:0 auto;padding:24px 40px 48px;background:#fff}
header{border-left:6px solid var(--muted);padding:6px 16px;margin:8px 0 24px}
header.divergent{border-color:#cf222e}header.deterministic{border-color:#1a7f37}
header.failed{border-color:#9a6700}
header p{margin:4px 0;color:var(--muted)}
h1{font-size:1.3em;margin:4px 0}
h2{font-size:1.15em;border-bottom:1px solid var(--line);padding-bottom:4px;margin:32px 0 10px}
h3{font-size:1em;margin:16px 0 6px}
table{border-collapse:collapse;font-size:.9em;margin:4px 0 12px}
th,td{border:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top}
th{background:var(--soft)}
td{font-variant-numeric:tabular-nums;overflow-wrap:anywhere}
pre,code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.9em}
pre{background:var(--soft);padding:10px 12px;white-space:pre-wrap;overflow-wrap:anywhere}
.scroll{max-height:28em;overflow:auto;display:inline-block;max-width:100%}
.note{color:var(--muted);font-style:italic}
figure{margin:12px 0}figcaption{color:var(--muted);font-size:.9em}
svg{display:block;width:100%;height:auto}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Arial,sans-serif;font-size:12px;
 fill:#1f2328}
@media print{
 body{background:#fff;font-size:10pt}main{max-width:none;padding:0}
 .scroll{max-height:none;overflow:visible;display:block}
 figure,tr,pre{break-inside:avoid}h2,h3{break-after:avoid}
 th{background:none}
}
"""


def render_html(summary: dict[str, Any]) -> str:
    """The whole report as one HTML page."""
    parts = sections(summary)
    head, rest = parts[0], parts[1:]
    body = [_header(head, summary)] + [_section(s, summary) for s in rest]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title(summary))}</title>\n<style>{CSS}</style>\n</head>\n"
        "<body>\n<main>\n" + "\n".join(body) + "\n</main>\n</body>\n</html>\n"
    )


def table_html(table: Table) -> str:
    """A table in plain tags only (no attributes), cells escaped."""
    head = ""
    if any(table.headers):
        cells = "".join(f"<th>{escape(h)}</th>" for h in table.headers)
        head = f"<thead><tr>{cells}</tr></thead>"
    rows = "".join(
        "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in table.rows
    )
    return f"<table>{head}<tbody>{rows}</tbody></table>"


def omitted_note(table: Table) -> str:
    """The line saying how many rows of a table were left out, or ''."""
    if not table.omitted:
        return ""
    return f"… {table.omitted} more rows left out to keep this short (see report.html)."


def _header(head: Section, summary: dict[str, Any]) -> str:
    verdict = summary.get("verdict")
    kind = VERDICTS.get(verdict, "")
    lines = [f"<p>{escape(title(summary))}</p>"]
    for block in head.blocks:
        if isinstance(block, Text):
            tag = "h1" if block.strong else "p"
            lines.append(f"<{tag}>{escape(block.text)}</{tag}>")
    return f'<header class="{kind}">' + "".join(lines) + "</header>"


def _section(section: Section, summary: dict[str, Any]) -> str:
    blocks = "\n".join(_block(b, summary) for b in section.blocks)
    return (
        f'<section id="{escape(section.key)}">\n<h2>{escape(section.title)}</h2>\n{blocks}\n'
        "</section>"
    )


def _block(block: Block, summary: dict[str, Any]) -> str:
    if isinstance(block, Text):
        return f"<p>{escape(block.text)}</p>"
    if isinstance(block, Code):
        return f"<pre><code>{escape(block.text)}</code></pre>"
    if isinstance(block, Table):
        return _table(block)
    drawn = figure(block.kind, summary)
    if not drawn:
        return "\n".join(_block(b, summary) for b in block.fallback)
    return f"<figure>{drawn}<figcaption>{escape(CAPTIONS[block.kind])}</figcaption></figure>"


def _table(table: Table) -> str:
    caption = f"<h3>{escape(table.caption)}</h3>" if table.caption else ""
    body = table_html(table)
    if table.fold:
        body = f'<div class="scroll">{body}</div>'
    note = omitted_note(table)
    return caption + body + (f'<p class="note">{escape(note)}</p>' if note else "")
