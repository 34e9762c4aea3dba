"""The terminal summary: verdict, first divergence, cause, loss drift (tabulate tables)."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate


def render_console(summary: dict[str, Any]) -> str:
    """A one-screen text summary of a run."""
    lines = [summary["headline"]]
    probe = summary.get("probe", {})
    if probe.get("preset"):
        lines.append(f"preset: {probe['preset']}")
    first = summary.get("first_divergence")
    if first:
        lines.append("")
        rows = [
            ("step", f"{first['step']} (epoch {first['epoch']}, step {first['index']} of the epoch)"),
            ("phase", first["phase"]),
            ("module", first["module"] or "(model)"),
            ("role", first["role"]),
            ("records", ", ".join(first["slots"][:4]) + (" ..." if len(first["slots"]) > 4 else "")),
            ("repeats differing", f"{first['differing']} of {first['repeats'] - 1} (vs repeat 0)"),
            ("cause", f"{summary['cause']['kind']}: {summary['cause']['text']}"),
        ]
        lines.append(tabulate(rows, tablefmt="plain"))
        others = summary["origins"][1:6]
        if others:
            lines.append("")
            lines.append("other origins in that step:")
            lines.append(
                tabulate(
                    [(o["phase"], o["module"] or "(model)", ", ".join(o["slots"][:3])) for o in others],
                    headers=["phase", "module", "records"],
                )
            )
        if summary.get("fork"):
            f = summary["fork"]
            lines.append(
                f"control flow forked at step {f['step']}: {f['module'] or '(model)'} {f['slot']} "
                f"is missing in {f['missing']} repeat(s)"
            )
    loss = summary["loss"]
    if loss["per_epoch"]:
        lines.append("")
        if loss["first_step"] is None:
            lines.append("loss: bit-identical in every step")
        else:
            lines.append(f"loss first differs at step {loss['first_step']} (epoch {loss['first_epoch']})")
        lines.append(
            tabulate(
                [(e["epoch"], "identical" if e["max_rel_diff"] == 0 else f"{e['max_rel_diff']:.3g}")
                 for e in loss["per_epoch"]],
                headers=["epoch", "max rel. loss diff"],
            )
        )
    if summary.get("loss_hidden"):
        lines.append(
            f"parameters diverged from step {summary['param_drift_step']} while the loss stayed "
            "bit-identical: the loss alone hides this"
        )
    for repeat, message in summary.get("failures", {}).items():
        lines.append(f"repeat {repeat} failed: {message}")
    if summary.get("env_differences"):
        lines.append("environment differs between traces: " + ", ".join(summary["env_differences"]))
    return "\n".join(lines)
