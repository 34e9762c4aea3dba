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

from ..analysis.compare import Comparison, compare
from ..config import AuditConfig, ProbeSpec
from ..drivers.runner import OpPlan, ProbeFactory, run_repeat
from ..trace import Trace
from .drilldown import drill_down

FOUND, INTERMITTENT = "found", "intermittent"


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
        zoomed = compare(traces)
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
