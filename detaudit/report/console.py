"""The terminal summary: verdict, first divergence, cause, loss drift (tabulate tables)."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from ..analysis.causes import random_origin_op
from ..words import counted, joined, op_place
from .sections import (
    CALLS_UNSEEN_NOTE,
    EPOCHS_UNSEEN_NOTE,
    INFERRED_NOTE,
    LOADER_IN_A_THREAD_NOTE,
    SIDE_HEADERS,
    calls_matter,
    ended,
    epochs_spanned_note,
    first_module,
    first_pass_note,
    fork_text,
    identical_loss,
    loss_first_differs,
    nonfinite_line,
    other_origins,
    planted_after_note,
    seeded_over_note,
    short_epochs_note,
    side_rows,
    updates_note,
)


def render_console(summary: dict[str, Any]) -> str:
    """A one-screen text summary of a run."""
    lines = [summary["headline"]]
    probe = summary.get("probe", {})
    if probe.get("preset"):
        lines.append(f"preset: {probe['preset']}")
    if summary.get("model_class"):
        lines.append(f"model: {summary['model_class']}")
    first = summary.get("first_divergence")
    if first:
        lines.append("")
        calls = calls_matter(summary)
        where = [("steps run", first["steps_run"])] if ended(summary) else [
            ("phase", first["phase"]),
            ("module", first_module(summary)),
            ("role", first["role"]),
            ("records", ", ".join(first["slots"][:4]) + (" ..." if len(first["slots"]) > 4 else "")),
        ]
        rows = [
            ("step", f"{first['step']} (epoch {first['epoch']}, step {first['index']} of the epoch)"),
            *where,
            ("repeats differing", f"{first['differing']} of {first['repeats'] - 1} (vs repeat 0)"),
            ("cause", f"{summary['cause']['kind']}: {summary['cause']['text']}"),
        ]
        lines.append(tabulate(rows, tablefmt="plain"))
        others = other_origins(summary)[:5]
        if others:
            lines.append("")
            lines.append("other origins in that step:")
            lines.append(tabulate(
                [(o["phase"], o["module"] or "(model)", *([o.get("call", 0)] if calls else []),
                  ", ".join(o["slots"][:3])) for o in others],
                headers=["phase", "module", *(["call"] if calls else []), "records"]))
        if summary.get("fork"):
            lines.append(f"control flow forked {fork_text(summary['fork'])}")
    if summary.get("idle_rng"):
        # (the runs may have drawn from it: draws that happened to agree, a coin flip, are
        # luck, not proof that nothing uses it)
        lines.append(f"note: the RNG state of {', '.join(summary['idle_rng'])} differs between "
                     "the repeats (unseeded), and nothing drawn from it changed the runs this "
                     "time: seed it, or a draw from it may part them in another run")
    if summary.get("updates_without_backward"):
        lines.append(f"note: {updates_note(summary['updates_without_backward'])}")
    if summary.get("short_epochs"):
        lines.append(f"note: {short_epochs_note(summary['short_epochs'])}")
    if summary.get("calls_unseen"):
        lines.append(f"note: {CALLS_UNSEEN_NOTE}")
    if summary.get("loader_in_a_thread"):
        lines.append(f"note: {LOADER_IN_A_THREAD_NOTE}")
    if summary.get("inferred"):
        lines.append(f"note: {INFERRED_NOTE}")
    if summary.get("epochs_unseen"):
        lines.append(f"note: {EPOCHS_UNSEEN_NOTE}")
    if seeded_over := seeded_over_note(summary):
        lines.append(f"note: {seeded_over}")
    if planted_after := planted_after_note(summary):
        lines.append(f"note: {planted_after}")
    if summary.get("first_pass_unfinished"):
        lines.append(f"note: {first_pass_note(summary)}")
    if summary.get("epochs_spanned"):
        lines.append(f"note: {epochs_spanned_note(summary)}")
    flagged = summary.get("env_risks") or {}
    if flagged:
        lines.append("")
        lines.append(f"risky settings: {', '.join(flagged)} (the report says why; "
                     "`detaudit env` checks this machine)")
    lines.extend(_op_lines(summary))
    loss = summary["loss"]
    if loss["per_epoch"]:
        lines.append("")
        if loss.get("nonfinite"):
            lines.append(nonfinite_line(loss["nonfinite"]))
        if loss["first_step"] is None:
            lines.append(f"loss: {identical_loss(summary)}")
        else:
            lines.append(loss_first_differs(summary))
        lines.append(
            tabulate(
                [(e["epoch"], "identical" if e["max_rel_diff"] == 0 else f"{e['max_rel_diff']:.3g}")
                 for e in loss["per_epoch"]],
                headers=["epoch", "max rel. loss diff"],
            )
        )
    if summary.get("loss_hidden"):
        lines.append(
            f"{summary.get('param_drift_what', 'parameters')} diverged from step "
            f"{summary['param_drift_step']} while the loss stayed "
            "bit-identical: the loss alone hides this"
        )
    lines.extend(_stress_lines(summary))
    lines.extend(_census_lines(summary))
    lines.extend(_verify_lines(summary.get("extra", {}).get("verify")))
    for repeat, message in summary.get("failures", {}).items():
        lines.append(f"repeat {repeat} failed: {message}")
    if summary.get("env_differences"):
        lines.append("environment differs between traces: " + ", ".join(summary["env_differences"]))
    return "\n".join(lines)


def _op_lines(summary: dict[str, Any]) -> list[str]:
    """The op the drill-down named, how much it differs, and what is known about it."""
    ops = summary.get("ops") or []
    drill = summary.get("op_drill_down") or {}
    if drill.get("error"):
        return ["", f"op-level replay failed: {drill['error']}"]
    if drill.get("ops_not_recorded"):
        return ["", drill["ops_not_recorded"]["text"]]
    if drill and not drill.get("reproduced"):
        return ["", "op-level replay did not reproduce the divergence (intermittent)"]
    outside = drill.get("outside_dispatcher")
    if outside:
        return ["", outside["text"] if outside.get("planted") else
                f"outside the dispatcher: {outside['text']}"]
    if not ops or ops[0].get("role") != "origin":
        return []
    o = ops[0]
    drawn = ": it draws random numbers, and its generator's state differs" if (
        random_origin_op({"ops": ops})) else ""
    said = f"op: {o['op']} in {op_place(o)} ({o['phase']}), inputs equal, outputs differ{drawn}"
    lines = ["", said]
    if o.get("elements") is not None:
        lines.append(
            f"    between the repeats: {o['elements']} of {o['of']} elements differ; "
            f"max |Δ| {_g(o.get('max_abs_diff'))}, "
            f"max ULP {_g(o.get('max_ulp'))}, relative error {_g(o.get('rel_error'))}"
        )
    for k in summary.get("knowledge") or []:
        lines.append(f"    known: {k['what']} -- {k['why']}")
        lines.append(f"    fix: {k['remedy']}")
    return lines


def _stress_lines(summary: dict[str, Any]) -> list[str]:
    """What re-executing the risky ops proved."""
    stress = summary.get("stress") or []
    if not stress:
        return []
    proven = [op for op in stress if op.get("proven")]
    if not proven:
        fewest, most = (f(op.get("runs") or 0 for op in stress) for f in (min, max))
        runs = f"{most}" if fewest == most else f"{fewest} to {most}"  # (see stress.py)
        steps = sorted({step for op in stress for step in op.get("steps") or ()})
        at = f" at step{'s' if len(steps) > 1 else ''} {joined(steps)}" if steps else ""
        return ["", (f"proof by re-execution{at}: {counted(len(stress), 'risky op')} re-run {runs} "
                     "times on identical inputs each gave one result")]
    lines = [""]
    for op in proven[:6]:
        proof = op.get("proof") or {}
        lines.append(f"proven nondeterministic: {op['line']}; between two of its "
                     f"re-executions: {proof.get('differing')} of {proof.get('elements')} "
                     f"elements differ, max ULP {_g(proof.get('max_ulp'))}")
        if op.get("remedy"):
            lines.append(f"    fix: {op['remedy']}")
    if len(proven) > 6:
        lines.append(f"... {len(proven) - 6} more proven ops in the report")
    return lines


def _census_lines(summary: dict[str, Any]) -> list[str]:
    census, alerts = summary.get("census") or [], summary.get("census_alerts") or []
    errors = summary.get("census_errors") or []
    if not census and not alerts and not errors:
        seconds = summary.get("census_seconds")
        if not isinstance(seconds, (int, float)):
            return []  # no census ran
        return ["", ("census: no known-nondeterministic op, no deterministic-algorithms alert "
                     f"(each epoch's first step, {seconds:.3g} s)")]
    lines = ["", *errors]
    if census or alerts:
        lines.append("census: known-nondeterministic ops this model runs on this device "
                     "(each epoch's first step)")
    if census:
        lines.append(tabulate([(c["module"], c["phase"], c["op"], c["count"],
                                f"epoch {c.get('epoch', 1)}") for c in census[:12]],
                              headers=["module", "phase", "op", "count", "first seen"]))
        if len(census) > 12:
            lines.append(f"... {len(census) - 12} more in the report")
    for a in alerts[:8]:
        lines.append(f"alert in {a['module']} ({a['op']}): {a['message']}")
    return lines


def _verify_lines(verify: dict[str, Any] | None) -> list[str]:
    if not verify:
        return []
    if verify.get("error"):
        return ["", f"fix verification failed: {verify['error']}"]
    return ["", (f"fix: {verify['headline']}; step time {_g(verify.get('step_time_ratio'))}x, "
            f"peak memory {_g(verify.get('peak_memory_ratio'))}x the original")]


def _g(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


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
