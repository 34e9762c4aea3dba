"""The findings of one run as plain data: what every renderer draws from, and summary.json.

Epochs in the summary are 1-based (as people say "epoch 2"); steps are 0-based global
step numbers, as ``--inject-fault MODULE@phase:STEP`` takes them.
"""

from __future__ import annotations

from typing import Any

from ..compare import ORIGIN, Comparison, RecordDiff
from ..runfolder import RunInfo
from ..trace import Trace
from .ranks import with_ranks

SUMMARY_SCHEMA = 1
MAP_LIMIT = 4000  # module x step cells kept for the divergence map


def summarize(info: RunInfo, comparison: Comparison, traces: list[Trace]) -> dict[str, Any]:
    """Build the summary of a run from its info, comparison and traces."""
    c = comparison
    first = _first_divergence(c)
    verdict = "failed" if c.failures and c.first_step is None else (
        "deterministic" if c.deterministic else "divergent"
    )
    loss_hidden = (
        c.param_drift_step is not None and c.loss.first_step is None and c.first_step is not None
    )
    extra = info.extra or {}
    ops = extra.get("ops") or {}
    census = extra.get("census") or {}
    summary = {
        "schema": SUMMARY_SCHEMA,
        "verdict": verdict,
        "headline": _headline(verdict, c, first, loss_hidden, ops),
        "probe": info.probe,
        "command": info.command,
        "config": info.config,
        "repeats": c.repeats,
        "steps": [{"step": s, "epoch": e + 1, "index": i} for s, e, i in c.steps],
        "first_divergence": first,
        "first_by_phase": {p: _record(d, c) for p, d in c.first_by_phase.items()},
        "origins": [
            {
                "step": f.step, "epoch": _epoch(c, f.step), "phase": f.phase, "module": f.module,
                "call": f.call, "slots": f.slots, "differing": f.differing, "repeats": f.repeats,
                "rng": f.rng,
            }
            for f in c.origins
        ],
        "cause": {"kind": c.cause, "text": c.cause_text},
        "loss": {
            "first_step": c.loss.first_step,
            "first_epoch": None if c.loss.first_epoch is None else c.loss.first_epoch + 1,
            "per_step": [
                {"step": s, "epoch": e + 1, "rel_diff": r} for s, e, r in c.loss.per_step
            ],
            "per_epoch": [{"epoch": e + 1, "max_rel_diff": r} for e, r in c.loss.per_epoch()],
            "curves": {
                str(t.repeat): [
                    {"step": s.step, "loss": sum(s.loss_values().values())} for s in t.steps
                    if s.losses
                ]
                for t in traces
            },
        },
        "param_drift_step": c.param_drift_step,
        "loss_hidden": loss_hidden,
        "fork": _record(c.fork, c) if c.fork else None,
        "records": {
            "total": c.total_records,
            "differing": c.differing_records,
            "missing": c.missing_records,
            "by_step": {str(k): v for k, v in c.differing_by_step.items()},
        },
        "map": [
            {"step": f.step, "module": f.module or "(model)", "phase": f.phase, "role": f.role}
            for f in c.findings[:MAP_LIMIT]
        ],
        "map_truncated": max(0, len(c.findings) - MAP_LIMIT),
        "failures": {str(k): v for k, v in c.failures.items()},
        "env": traces[0].env if traces else {},
        "env_differences": _env_differences(traces),
        "extra": extra,
        "ops": ops.get("ops") or [],
        "op_drill_down": {k: v for k, v in ops.items() if k not in ("ops", "knowledge")},
        "knowledge": ops.get("knowledge") or [],
        "census": census.get("ops") or [],
        "census_alerts": census.get("alerts") or [],
    }
    if info.extra.get("ranks"):  # a distributed audit: its ranks side by side
        summary = with_ranks(summary, info.extra["ranks"])
    return summary


def _epoch(c: Comparison, step: int | None) -> int | None:
    epoch = c.epoch_of(step)
    return None if epoch is None else epoch + 1


def _record(d: RecordDiff, c: Comparison) -> dict[str, Any]:
    return {
        "step": d.step, "epoch": _epoch(c, d.step), "phase": d.phase, "module": d.module,
        "call": d.call, "slot": d.slot, "differing": d.differing, "missing": d.missing,
        "repeats": d.repeats, "ref": d.ref, "other": d.other,
    }


def _first_divergence(c: Comparison) -> dict[str, Any] | None:
    """The first origin (or, without one, the first differing record) of the first step."""
    if c.first_step is None:
        return None
    origins = c.origins
    step_index = next((i for s, _, i in c.steps if s == c.first_step), None)
    if origins:
        o = origins[0]
        return {
            "step": o.step, "epoch": _epoch(c, o.step), "index": step_index, "phase": o.phase,
            "module": o.module, "call": o.call, "slots": o.slots, "role": ORIGIN,
            "differing": o.differing, "repeats": o.repeats,
        }
    d = c.first_diffs[0]
    return {
        "step": d.step, "epoch": _epoch(c, d.step), "index": step_index, "phase": d.phase,
        "module": d.module, "call": d.call, "slots": [d.slot], "role": "first record",
        "differing": d.differing, "repeats": d.repeats,
    }


def _headline(
    verdict: str, c: Comparison, first: dict[str, Any] | None, hidden: bool,
    ops: dict[str, Any],
) -> str:
    if verdict == "failed":
        return f"FAILED: {len(c.failures)} of {c.repeats} repeats did not finish"
    if first is None:
        return f"DETERMINISTIC: {c.repeats} repeats bit-identical over {len(c.steps)} steps"
    where = first["module"] or "(model)"
    text = (
        f"DIVERGENT: first at step {first['step']} (epoch {first['epoch']}), {first['phase']}, "
        f"{where} ({first['role']}); cause: {c.cause}"
    )
    origin_op = (ops.get("ops") or [{}])[0]
    if origin_op.get("role") == ORIGIN:
        text += f"; op: {origin_op['op']} in {origin_op['module']}"
    if hidden:
        text += "; the loss stayed bit-identical while parameters diverged"
    return text


def _env_differences(traces: list[Trace]) -> dict[str, list[Any]]:
    """Environment keys whose values differ between traces."""
    keys = sorted({k for t in traces for k in t.env})
    out = {}
    for k in keys:
        values = [t.env.get(k) for t in traces]
        if any(v != values[0] for v in values):
            out[k] = values
    return out
