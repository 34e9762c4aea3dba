"""Zoom: after a scanned audit, replay every repeat to the first divergent step and record
that step at module level and op level in the same replay.

The scan names the step (and, from the step state, the class of cause); the zoom names the
module and the op. Replays can race differently from the scanned run, so their scanned steps
before the zoomed one are compared first: if a replay parted earlier, the zoom moves to that
step; if the zoomed step does not part again, it is tried again, and after `tries` attempts
reported as intermittent, with what the scan found.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ..analysis.compare import ORIGIN, Comparison, compare, compare_ops, fingerprints_before
from ..config import AuditConfig, ProbeSpec
from ..drivers.runner import OpPlan, ProbeFactory, run_repeat
from ..trace import Trace
from .drilldown import drill_down

FOUND, INTERMITTENT = "found", "intermittent"
NOT_REPRODUCED, NOT_POSSIBLE = "not reproduced", "not possible"


def zoom(
    factory: ProbeFactory, config: AuditConfig, comparison: Comparison,
    spec: ProbeSpec | None = None, tries: int = 3,
) -> tuple[dict[str, Any], list[Trace]]:
    """Plain data for the report (status, zoomed step, attempts, and the op drill-down under
    ``ops``) and the zoomed traces (module and op records at the zoomed step)."""
    plans: dict[int, OpPlan] = {}

    def replay(step: int) -> list[Trace]:
        at = frozenset({step})
        plans[step] = OpPlan(steps=at, last_step=step, zoom=at, stress=at)
        return [run_repeat(factory, config, r, spec, ops=plans[step])[0]
                for r in range(config.repeats)]

    def drill(zoomed: Comparison, traces: list[Trace]) -> dict[str, Any] | None:
        step = zoomed.first_step
        return drill_down(factory, replace(config, granularity="module"), zoomed, spec, traces,
                          plans[step].host_draws.get(step, set()))

    return zoom_by_replay(comparison, replay, drill, tries)


def zoom_by_replay(
    comparison: Comparison, replay: Callable[[int], list[Trace]],
    drill: Callable[[Comparison, list[Trace]], dict[str, Any] | None], tries: int = 3,
) -> tuple[dict[str, Any], list[Trace]]:
    """The zoom, whatever replays the runs: `replay(step)` returns every repeat's trace with
    `step` recorded at module and op level; `drill` names the op from them."""
    step = comparison.first_step
    assert step is not None, "zoom needs a divergent step"
    attempts: list[dict[str, Any]] = []
    for _ in range(max(1, tries)):
        traces = replay(step)
        zoomed = compare(traces, comparison.idle_rng)
        if zoomed.first_step is not None and zoomed.first_step < step:
            attempts.append({"step": step, "outcome": f"parted earlier, at step "
                             f"{zoomed.first_step}: zooming there"})
            step = zoomed.first_step
            continue
        if zoomed.first_step == step:
            attempts.append({"step": step, "outcome": "parted again"})
            return {"status": FOUND, "step": step, "attempts": attempts,
                    "ops": drill(zoomed, traces)}, traces
        attempts.append({"step": step, "outcome": "did not part this time"})
    return {"status": INTERMITTENT, "step": step, "attempts": attempts, "ops": None}, []


def zoom_between(
    runs: list[tuple[ProbeSpec, AuditConfig, ProbeFactory, Trace]], step: int,
) -> dict[str, Any]:
    """``detaudit diff --zoom``: two runs of different configurations (or code) part at
    `step`. Each is replayed here from its own configuration, repeat 0, to that step, which is
    recorded at module and op level; the replays must reproduce the steps each run recorded
    before it (else this machine does not replay them and nothing is concluded); then where
    the two replays part is the origin. `runs` holds (spec, config, factory, recorded trace)."""
    at = frozenset({step})
    replays = []
    for label, (spec, config, factory, recorded) in zip("AB", runs):
        trace, _ = run_repeat(factory, config, 0, spec,
                              ops=OpPlan(steps=at, last_step=step, zoom=at))
        if trace.failure:
            return {"status": NOT_POSSIBLE, "step": step,
                    "why": f"the replay of {label} failed: {trace.failure}"}
        if fingerprints_before(trace, step) != fingerprints_before(recorded, step):
            return {"status": NOT_REPRODUCED, "step": step,
                    "why": f"the replay of {label} on this machine does not reproduce the steps "
                           f"{label} recorded before step {step}"}
        replays.append(trace)
    zoomed = compare(replays)
    if zoomed.first_step is None:
        return {"status": NOT_REPRODUCED, "step": step,
                "why": "the replays agree at that step: the difference did not recur"}
    origin = next(iter(zoomed.origins), None)
    ops = [f for f in compare_ops(replays) if f.role == ORIGIN and f.step == zoomed.first_step]
    return {
        "status": FOUND, "step": zoomed.first_step,
        "module": origin.module if origin else None, "phase": origin.phase if origin else None,
        "op": ops[0].op if ops else None, "op_module": ops[0].module if ops else None,
        "op_phase": ops[0].phase if ops else None,
    }
