"""The findings of one run as plain data: what every renderer draws from, and summary.json.

Epochs in the summary are 1-based (as people say "epoch 2"); steps are 0-based global
step numbers, as ``--inject-fault MODULE@phase:STEP`` takes them.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ..analysis.causes import cause_of, outside_origin_op
from ..analysis.compare import GRADIENTS_DIFFER, ORIGIN, Comparison, RecordDiff
from ..analysis.ranks import RankAnalysis
from ..analysis.risks import risks
from ..analysis.verdict import Verdict, stressed_op_rows
from ..config import (
    CALLS_UNSEEN,
    EPOCHS_SPANNED,
    EPOCHS_UNSEEN,
    FIRST_PASS_UNFINISHED,
    INFERRED,
    LOADER_IN_A_THREAD,
    MODEL_CLASS,
    ROOT_NAME,
    SCRIPTED,
    SIDE_MODELS,
    TIED_PARAMETERS,
)
from ..runfolder import RunInfo
from ..trace import OUTSIDE_MODEL, STATE, Trace, probe_value, state_name
from ..words import one_based

SUMMARY_SCHEMA = 1
MAP_LIMIT = 4000  # module x step cells kept for the divergence map


def _updates_without_backward(traces: list[Trace]) -> list[int]:
    """The steps whose optimizer update came with no backward since the last one (repeat
    0): the update reused the previous step's gradients."""
    steps = traces[0].steps if traces else []
    return [s.step for s in steps if s.optimizer_stepped and not s.losses]


def _modules(traces: list[Trace]) -> list[str]:
    """The modules with parameters of the first repeat's models as its first step recorded
    them, in the models' order (model.2 before model.12), a module that holds a tied
    parameter under another name after the module it is recorded under: the names
    ``--inject-fault MODULE@phase:STEP`` takes (a model the loop calls apart by its own name
    only: a fault is planted at its output)."""
    probe = (traces[0].probe or {}) if traces else {}
    sides = probe.get(SIDE_MODELS) or []
    tied = probe.get(TIED_PARAMETERS) or {}
    for _, cut in traces[0].by_step() if traces else ():
        r = cut.records
        owners = [holder or ROOT_NAME for p, m, s in zip(r["phase"], r["module"], r["slot"])
                  if p == STATE and s.startswith("param.")  # (a model's own: "(model)")
                  for holder in (m, *(alias.rpartition(".")[0] for alias in tied.get(
                      state_name(m, s), ())))]
        return list(dict.fromkeys(
            next((side for side in sides if m == side or m.startswith(side + ".")), m)
            for m in owners))
    return []


def _scripted_risk(traces: list[Trace]) -> dict[str, str]:
    """The TorchScript modules of the model, a risk of their own where repeats share a
    process."""
    scripted = next((found for t in traces if (found := probe_value(t, SCRIPTED))), None)
    if not scripted:
        return {}
    return {"torchscript": (
        f"the model holds TorchScript modules ({', '.join(scripted)}): in a process, the first "
        "calls of a scripted module run unoptimized and later ones optimized, so repeats in one "
        "process (run's default isolation, watch twice) can part in their first steps; "
        "separate processes (--isolation process, exec) do not")}


def _short_epochs(info: RunInfo, c: Comparison) -> dict[str, Any] | None:
    """Where a probe's data ran out before ``--steps`` in an epoch (a finished run's): the
    steps asked for per epoch and those each short epoch had."""
    asked = info.config.get("steps")
    if not isinstance(asked, int) or c.failures or info.probe.get("kind") not in (
            "builtin", "file"):
        return None
    per_epoch = Counter(epoch for _, epoch, _ in c.steps)
    short = {str(e + 1): n for e, n in sorted(per_epoch.items()) if n < asked}
    return {"asked": asked, "had": short} if short else None


def _cause(c: Comparison, ops: dict[str, Any], info: RunInfo, traces: list[Trace]
           ) -> dict[str, str]:
    """The cause's kind and text, given how the run's processes were started (see
    :func:`cause_of`)."""
    own_hash_seeds = bool("seed" in info.config and info.config["seed"] is None and traces
                          and traces[0].env.get("PYTHONHASHSEED") in (None, "random"))
    kind, text = cause_of(c, ops, info.config.get("seed"), own_hash_seeds=own_hash_seeds,
                          planted=bool(info.config.get("fault")))
    return {"kind": kind, "text": text}


def summarize(
    info: RunInfo, comparison: Comparison, traces: list[Trace], verdict: Verdict,
    ranks: RankAnalysis | None = None, zoom: Comparison | None = None,
) -> dict[str, Any]:
    """Build the summary of a run from its info, comparison, traces and verdict; a scanned
    run's module-level origins and cause come from its `zoom`, when it has one."""
    c = comparison
    located = zoom if zoom is not None and zoom.first_step is not None else c
    extra = {k: v for k, v in (info.extra or {}).items() if k != "ranks"}
    ops = extra.get("ops") or {}
    census = extra.get("census") or {}
    cells = _map_cells(c, zoom) if info.config.get("granularity") == "scan" else [
        {"step": f.step, "module": f.module or "(model)", "phase": f.phase, "role": f.role}
        for f in c.findings]
    if (outside := outside_origin_op(ops, located.origins)) is not None \
            and located.first_step is not None:
        # (no module call began it: the op in the loop's own code did)
        cells.append({"step": located.first_step, "module": OUTSIDE_MODEL,
                      "phase": outside["phase"], "role": ORIGIN})
    summary = {
        "schema": SUMMARY_SCHEMA,
        "verdict": verdict.kind,
        "headline": verdict.headline,
        "probe": info.probe,
        "command": info.command,
        "config": info.config,
        "repeats": c.repeats,
        "steps": [{"step": s, "epoch": e + 1, "index": i} for s, e, i in c.steps],
        "steps_per_repeat": [len(t.steps) for t in traces],
        "epochs_per_repeat": [len({s.epoch for s in t.steps}) for t in traces],
        "first_divergence": verdict.first,
        "first_by_phase": {p: _record(d, located) for p, d in located.first_by_phase.items()},
        "origins": [
            {
                "step": f.step, "epoch": _epoch(c, f.step), "phase": f.phase, "module": f.module,
                "call": f.call, "slots": f.slots, "differing": f.differing, "repeats": f.repeats,
                "rng": f.rng,
            }
            for f in located.origins
        ],
        "cause": _cause(located, ops, info, traces),
        "idle_rng": list(c.idle_rng),
        "updates_without_backward": _updates_without_backward(traces),
        "short_epochs": _short_epochs(info, c),
        "calls_unseen": any(t.probe.get(CALLS_UNSEEN) for t in traces),
        "loader_in_a_thread": any(t.probe.get(LOADER_IN_A_THREAD) for t in traces),
        "inferred": any(t.probe.get(INFERRED) for t in traces),
        "epochs_unseen": any(t.probe.get(EPOCHS_UNSEEN) for t in traces),
        # --max-epochs, and every run ended within its first pass: {"batches": its length}
        "first_pass_unfinished": {"batches": traces[0].probe[FIRST_PASS_UNFINISHED]} if (
            traces and all(FIRST_PASS_UNFINISHED in t.probe for t in traces)) else None,
        # --max-epochs never ended the runs, whose steps spanned passes: the most passes made
        "epochs_spanned": max(t.probe[EPOCHS_SPANNED] for t in traces) if (
            traces and all(EPOCHS_SPANNED in t.probe for t in traces)) else None,
        "zoom": (info.extra or {}).get("zoom"),
        "loss_scale": _loss_scale(traces, c.first_step),
        "modules": _modules(traces),
        "model_class": next((t.probe[MODEL_CLASS] for t in traces if t.probe.get(MODEL_CLASS)),
                            None),
        # the first seed the code gave torch, [value, "file:line"] (exec without --seed: the
        # script's own seeding), or None
        "code_seed": next((seed for seed in c.first_seeds if seed), None),
        "loss": {
            "nonfinite": None if c.loss.nonfinite is None else dict(zip(
                ("step", "epoch", "value", "finite_again", "skipped"),
                (c.loss.nonfinite[0], c.loss.nonfinite[1] + 1, c.loss.nonfinite[2],
                 c.loss.finite_again, c.loss.skipped)
            )),
            "first_step": c.loss.first_step,
            "first_epoch": one_based(c.loss.first_epoch),
            # one run recorded: no drift to show (not "bit-identical")
            "per_step": [
                {"step": s, "epoch": e + 1, "rel_diff": r} for s, e, r in c.loss.per_step
            ] if c.repeats > 1 else [],
            "per_epoch": [{"epoch": e + 1, "max_rel_diff": r} for e, r in c.loss.per_epoch()]
            if c.repeats > 1 else [],
            "curves": {
                str(t.repeat): [
                    {"step": s.step, "loss": s.loss_total()} for s in t.steps
                    if s.losses
                ]
                for t in traces
            },
        },
        "param_drift_step": c.param_drift_step,
        "param_drift_what": c.drifted,
        "loss_hidden": verdict.loss_hidden,
        # (a record missing where one run ended before another is its end, not a fork)
        "fork": _record(c.fork, c) if c.fork and c.cause != "length" else None,
        "records": {
            "total": c.total_records,
            "differing": c.differing_records,
            "missing": c.missing_records,
            "by_step": {str(k): v for k, v in c.differing_by_step.items()},
            "detailed_steps": c.detailed_steps,
        },
        "map": cells[:MAP_LIMIT],
        "map_truncated": max(0, len(cells) - MAP_LIMIT),
        "failures": {str(k): v for k, v in c.failures.items()},
        "env": traces[0].env if traces else {},
        "env_risks": {**(risks(traces[0].env) if traces and traces[0].env else {}),
                      **_scripted_risk(traces)},
        "env_differences": _env_differences(traces),
        "extra": extra,
        "ops": ops.get("ops") or [],
        "op_drill_down": {k: v for k, v in ops.items() if k not in ("ops", "knowledge", "stress")},
        "knowledge": ops.get("knowledge") or [],
        "stress": stressed_op_rows(c, zoom, ops),
        "stress_seconds": _stress_seconds(info),
        "census": _census_ops(census.get("ops") or [], c) if census else [],
        "census_seconds": census.get("seconds"),
        "census_alerts": census.get("alerts") or [],
        "census_errors": list(census.get("errors") or []) + (
            [f"the census failed: {census['error']}"] if census.get("error") else []
        ),
    }
    if ranks is not None:  # a distributed audit: its ranks side by side
        summary["ranks"] = ranks.to_dict()
    return summary


def _census_ops(ops: list[Any], c: Comparison) -> list[dict[str, Any]]:
    """The census's risky ops (counted by the census when the audit did not stress), and
    those the stressed steps saw, each with the first epoch it was seen in."""
    rows = [{"epoch": 1, **o} for o in ops if isinstance(o, dict)]
    seen = {(o.get("module"), o.get("phase"), o.get("op")) for o in rows}
    for op in c.stress:
        row = op.to_dict()
        if (row["module"], row["phase"], row["op"]) not in seen:
            rows.append({"module": row["module"], "phase": row["phase"], "op": row["op"],
                         "count": op.calls, "what": row["what"], "epoch": row["epoch"]})
    return rows


def _loss_scale(traces: list[Any], step: int | None) -> float | None:
    """A GradScaler's scale after `step` in repeat 0, where one scaled its losses: the loss
    recorded is what backward was called on, the scaled loss (None: no scaler)."""
    steps = traces[0].steps if traces else []
    return steps[step].scale if step is not None and step < len(steps) else None


def _stress_seconds(info: RunInfo) -> float | None:
    """Time spent re-executing risky ops, from run.json's timings (None: not recorded)."""
    values = [t.get("stress_seconds") for t in info.timings if isinstance(t, dict)]
    numbers = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(numbers) if numbers else None


def _map_cells(c: Comparison, zoom: Comparison | None) -> list[dict[str, Any]]:
    """The divergence map: the differing module calls of every step (a scanned run has them
    only where zoomed) and, for scanned steps, the modules whose parameter gradients differ."""
    zoomed = [f for f in (zoom.findings if zoom else []) if f.step == zoom.first_step]
    # a step the scan recorded module by module (a planted fault's) is in the zoom too
    unique = dict.fromkeys((f.step, f.module or "(model)", f.phase, f.role)
                           for f in c.findings + zoomed)
    cells = [{"step": step, "module": module, "phase": phase, "role": role}
             for step, module, phase, role in unique]
    called = {(f.step, f.module) for f in c.findings + zoomed}
    grads: dict[tuple[int, str], list[str]] = {}
    for step, module, name in c.grad_diffs:
        if (step, module) not in called:
            grads.setdefault((step, module), []).append(name)
    cells += [{"step": step, "module": module or "(model)", "phase": "grad",
               "role": GRADIENTS_DIFFER, "params": names}
              for (step, module), names in sorted(grads.items())]
    return cells


def _epoch(c: Comparison, step: int | None) -> int | None:
    return one_based(c.epoch_of(step))


def _record(d: RecordDiff, c: Comparison) -> dict[str, Any]:
    return {
        "step": d.step, "epoch": _epoch(c, d.step), "phase": d.phase, "module": d.module,
        "call": d.call, "slot": d.slot, "differing": d.differing, "missing": d.missing,
        "repeats": d.repeats, "ref": d.ref, "other": d.other,
    }


def _env_differences(traces: list[Trace]) -> dict[str, list[Any]]:
    """Environment keys whose values differ between traces (those that captured one: a
    run that failed before its first step has none)."""
    out = {}
    for k in sorted({k for t in traces for k in t.env}):
        values = [t.env.get(k) for t in traces]
        captured = [v for t, v in zip(traces, values) if t.env]
        if any(v != captured[0] for v in captured):
            out[k] = values
    return out
