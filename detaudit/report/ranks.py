"""The ranks of a distributed audit in a report: verdict, side-by-side table, cross-rank checks."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from .sections import Block, Section, Table, Text, clip, num

FINDINGS_SHOWN = 20  # rows of one check's findings in a report


def with_ranks(summary: dict[str, Any], ranks: dict[str, Any]) -> dict[str, Any]:
    """The summary with the ranks under ``"ranks"``, and a verdict that counts them."""
    summary["ranks"] = ranks
    summary["extra"] = {k: v for k, v in summary.get("extra", {}).items() if k != "ranks"}
    crash = ranks.get("crash")
    flagged = [c for c in ranks["checks"] if c["status"] == "flagged"]
    primary = ranks["primary_rank"]
    if crash:
        summary["verdict"] = "failed"
        summary["headline"] = f"FAILED: {crash_line(crash)}"
    elif summary["verdict"] == "divergent":
        divergent = [r for r in ranks["per_rank"] if r["verdict"] == "divergent"]
        summary["headline"] += (
            f"; on rank {primary} ({len(divergent)} of {ranks['world_size']} ranks diverge)"
        )
        if flagged:
            summary["headline"] += f"; {len(flagged)} cross-rank check(s) flagged"
    elif flagged:
        summary["verdict"] = "divergent"
        more = f" (+{len(flagged) - 1} more cross-rank checks flagged)" if len(flagged) > 1 else ""
        summary["headline"] = f"DIVERGENT ACROSS RANKS: {flagged[0]['detail']}{more}"
    elif summary["verdict"] == "deterministic":
        summary["headline"] += f"; {ranks['world_size']} ranks in sync"
    return summary


def crash_line(crash: dict[str, Any]) -> str:
    """One line naming the crashed rank."""
    repeat = "" if crash.get("repeat") is None else f" in repeat {crash['repeat']}"
    return f"rank {crash['rank']} crashed{repeat}: {crash['message']}"


def ranks_section(summary: dict[str, Any]) -> Section:
    """The "Ranks" section: ranks side by side, then the cross-rank checks and findings."""
    ranks = summary["ranks"]
    blocks: list[Block] = [Text(
        f"{ranks['world_size']} ranks ({ranks.get('backend') or '?'}); the sections below detail "
        f"rank {ranks['primary_rank']}."
    )]
    if ranks.get("crash"):
        blocks.append(Text(crash_line(ranks["crash"]), strong=True))
    blocks.append(Table("ranks side by side", SIDE_HEADERS, side_rows(ranks)))
    blocks.append(Table(
        "cross-rank checks", ["check", "result", "detail"],
        [[c["title"], c["status"], clip(c["detail"])] for c in ranks["checks"]],
    ))
    for check in ranks["checks"]:
        if check["findings"]:
            blocks.append(_findings(check))
    return Section("ranks", "Ranks", blocks)


SIDE_HEADERS = ["rank", "verdict", "first step", "epoch", "phase", "module", "role", "cause",
                "source", "failed repeats"]


def side_rows(ranks: dict[str, Any]) -> list[list[str]]:
    """One row per rank: its run-to-run verdict and first divergence."""
    return [
        [str(r["rank"]), r["verdict"], num(r["first_step"]), num(r["first_epoch"]),
         num(r["phase"]), "–" if r["module"] is None else (r["module"] or "(model)"),
         num(r["role"]), r["cause"], num(r["source"]), ", ".join(r["failures"]) or "–"]
        for r in ranks["per_rank"]
    ]


def _findings(check: dict[str, Any]) -> Table:
    findings = check["findings"]
    keys = [k for k in findings[0] if k != "groups"]
    rows = [[_cell(f[k]) for k in keys] + ([_cell(f["groups"])] if "groups" in f else [])
            for f in findings[:FINDINGS_SHOWN]]
    headers = keys + (["ranks by equal value"] if "groups" in findings[0] else [])
    repeats = f" (repeats {', '.join(map(str, check['repeats']))})" if check["repeats"] else ""
    table = Table(f"{check['title']}: findings{repeats}", headers, rows, key=f"ranks.{check['key']}",
                  fold=len(rows) > 10)
    table.omitted = max(0, len(findings) - FINDINGS_SHOWN)
    return table


def _cell(value: Any) -> str:
    if isinstance(value, list):
        if value and isinstance(value[0], list):
            return " | ".join(", ".join(map(str, g)) for g in value)
        return ", ".join(map(str, value)) or "–"
    return num(value)


def render_ranks_console(summary: dict[str, Any]) -> str:
    """The ranks for the terminal: side by side, then each check's result."""
    ranks = summary.get("ranks")
    if not ranks:
        return ""
    head = (f"ranks ({ranks['world_size']}, {ranks.get('backend') or '?'}); details above are "
            f"for rank {ranks['primary_rank']}:")
    lines = [head, tabulate(side_rows(ranks), headers=SIDE_HEADERS), ""]
    lines.append(tabulate(
        [[c["title"], c["status"], c["detail"]] for c in ranks["checks"]],
        headers=["cross-rank check", "result", "detail"],
    ))
    return "\n".join(lines)
