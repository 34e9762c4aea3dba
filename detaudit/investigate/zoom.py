"""Zoom: after a scanned audit, replay every repeat to the first divergent step and record
that step at module level and op level in the same replay.

The scan names the step (and, from the step state, the class of cause); the zoom names the
module and the op. Replays can race differently from the scanned run, so their scanned steps
before the zoomed one are compared first: if a replay parted earlier, the zoom moves to that
step; if the zoomed step does not part again, it is tried again, and after `tries` attempts
reported as intermittent, with what the scan found.

Runs that were recorded each in its own process are replayed here first, then, when those
replays do not part, each repeat in a fresh interpreter as they ran: a step that parts only
so depends on per-process state (``PYTHONHASHSEED``...), which the zoomed traces say. Run as
``python -m detaudit.investigate.zoom JOB`` for one such replay (and for each replay of
``detaudit diff --zoom``).

Torch is imported only by what replays a probe: `exec`'s own process zooms by re-running its
command (zoom_by_replay) without it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..analysis.compare import (
    ORIGIN,
    PER_PROCESS,
    Comparison,
    compare,
    compare_ops,
    fingerprints_before,
)
from ..analysis.diff import env_differences
from ..config import AuditConfig, ProbeSpec
from ..errors import DetauditError
from ..storage import atomic_write, dump_json
from ..trace import Trace
from .drilldown import Measured, drill_down

if TYPE_CHECKING:
    from ..drivers.runner import OpPlan, ProbeFactory

FOUND, INTERMITTENT = "found", "intermittent"
NOT_REPRODUCED, NOT_POSSIBLE = "not reproduced", "not possible"
REPLAY_FAILED = "replay failed"  # a replay ended in an error: nothing concluded from it
HERE_FIRST = 2  # replays in this process that agree before runs recorded apart are replayed so


def zoom(
    factory: ProbeFactory, config: AuditConfig, comparison: Comparison,
    spec: ProbeSpec | None = None, tries: int = 3, apart: bool = False,
) -> tuple[dict[str, Any], list[Trace]]:
    """Plain data for the report (status, zoomed step, attempts, and the op drill-down under
    ``ops``) and the zoomed traces (module and op records at the zoomed step). With `apart`
    (the runs were recorded each in its own process) replays that do not part here are
    made each in its own process too (a probe file or a built-in probe: `spec`)."""
    from ..drivers.runner import run_repeat
    from ..record.difference import differences_from

    plans: dict[int, OpPlan] = {}
    replayed_apart = False
    measured: Measured = []  # per repeat: see OpPlan.keep_risky

    def replay(step: int) -> list[Trace]:
        nonlocal replayed_apart
        replayed_apart, plans[step] = False, replace(_plan(step), keep_risky=True,
                                                     keep_planted=config.fault)
        traces = []
        measured.clear()
        reference: dict[tuple[str, str, int, str], list] = {}  # the first repeat's outputs
        for r in range(config.repeats):
            modes = len(plans[step].modes)
            traces.append(run_repeat(factory, config, r, spec, ops=plans[step])[0])
            kept = {key: outputs for mode in plans[step].modes[modes:]
                    for key, outputs in mode.kept.items()}
            for mode in plans[step].modes[modes:]:
                mode.kept = {}  # (held once, in `reference` or measured at once)
            if r == 0:
                reference = kept
            measured.append(differences_from(reference, kept) if r else {})
        return traces

    def replay_apart(step: int) -> list[Trace]:
        nonlocal replayed_apart
        replayed_apart, plans[step] = True, _plan(step)
        traces = []
        for repeat in range(config.repeats):
            trace, draws = _replay_in_own_process(spec, config, repeat, step)
            plans[step].host_draws.setdefault(step, set()).update(draws)
            traces.append(trace)
        return traces

    def drill(zoomed: Comparison, traces: list[Trace]) -> dict[str, Any] | None:
        step = zoomed.first_step
        # an op's difference is captured by replaying here, where apart ones need not part
        return drill_down(None if replayed_apart else factory,
                          replace(config, granularity="module"), zoomed, spec, traces,
                          plans[step].host_draws.get(step, set()),
                          measured=None if replayed_apart else measured)

    can_part = apart and spec is not None and spec.kind != "python"
    return zoom_by_replay(comparison, replay, drill, tries, replay_apart if can_part else None)


def zoom_by_replay(
    comparison: Comparison, replay: Callable[[int], list[Trace]],
    drill: Callable[[Comparison, list[Trace]], dict[str, Any] | None], tries: int = 3,
    apart: Callable[[int], list[Trace]] | None = None,
) -> tuple[dict[str, Any], list[Trace]]:
    """The zoom, whatever replays the runs: `replay(step)` returns every repeat's trace with
    `step` recorded at module and op level; `drill` names the op from them. `apart(step)`,
    for runs recorded each in its own process, replays them so: once replays here did not
    part :data:`HERE_FIRST` times, the tries left (one at least) are made apart, and a step
    that parts only apart is marked :data:`PER_PROCESS` in its traces."""
    step = comparison.first_step
    assert step is not None, "zoom needs a divergent step"
    attempts: list[dict[str, Any]] = []
    # how many replays in this process did not part, per step: two before the tries left
    # are made apart (one agreeing replay of a race that fires half the time is no proof)
    agreed_here: dict[int, int] = {}
    for _ in range(max(HERE_FIRST + 1 if apart else 1, tries)):
        here = apart is None or agreed_here.get(step, 0) < HERE_FIRST
        if here:
            traces = replay(step)
        else:
            try:
                traces = apart(step)
            except DetauditError as exc:  # the scan's verdict stands; the tries left, here
                attempts.append({"step": step, "outcome": f"not replayed apart: {exc}",
                                 "replayed": False})
                apart = None
                continue
        how = "" if apart is None else (" (replayed in this process)" if here else
                                        " (each repeat replayed in its own process)")
        zoomed = compare(traces, comparison.idle_rng)
        if zoomed.first_step is not None and zoomed.first_step < step:
            attempts.append({"step": step, "outcome": f"parted earlier, at step "
                             f"{zoomed.first_step}: zooming there{how}"})
            step = zoomed.first_step
            continue
        failure = next((t.failure for t in traces if t.failure), None)
        if failure is not None:  # (not a step that did not part: a replay that did not run)
            attempts.append({"step": step, "outcome": f"the replay failed{how}: {failure}"})
            return {"status": REPLAY_FAILED, "step": step, "attempts": attempts, "ops": None,
                    "why": failure}, []
        if zoomed.first_step == step:
            attempts.append({"step": step, "outcome": f"parted again{how}"})
            if not here and agreed_here.get(step, 0) >= HERE_FIRST:
                for trace in traces:
                    trace.probe[PER_PROCESS] = (f"replayed in one process, step {step} agreed "
                                                "in every repeat")
            return {"status": FOUND, "step": step, "attempts": attempts,
                    "ops": drill(zoomed, traces)}, traces
        attempts.append({"step": step, "outcome": f"did not part this time{how}"})
        if here:
            agreed_here[step] = agreed_here.get(step, 0) + 1
    return {"status": INTERMITTENT, "step": step, "attempts": attempts, "ops": None}, []


def zoom_between(runs: list[tuple[ProbeSpec, AuditConfig, Trace]], step: int) -> dict[str, Any]:
    """``detaudit diff --zoom``: two runs of different configurations (or code) part at
    `step`. Each is replayed from its own configuration, repeat 0, to that step, which is
    recorded at module and op level: in a fresh interpreter (a probe file imports the modules
    beside it, not those the other run's probe file brought in) at the thread count the run
    recorded. The replays must reproduce the steps each run recorded before it (else this
    machine does not replay them and nothing is concluded); then where the two replays part
    is the origin. `runs` holds (spec, config, recorded trace)."""
    replays = []
    for label, (spec, config, recorded) in zip("AB", runs):
        try:
            trace, _ = _replay_in_own_process(spec, config, 0, step, stress=False,
                                              recorded_env=recorded.env)
        except DetauditError as exc:
            return {"status": NOT_POSSIBLE, "step": step, "why": f"the replay of {label} "
                    f"failed: {exc}"}
        if trace.failure:
            return {"status": NOT_POSSIBLE, "step": step,
                    "why": f"the replay of {label} failed: {trace.failure}"}
        unrestored = _unrestored(label, recorded.env, trace.env)
        if fingerprints_before(trace, step) != fingerprints_before(recorded, step):
            return {"status": NOT_REPRODUCED, "step": step,
                    "why": f"the replay of {label} on this machine does not reproduce the steps "
                           f"{label} recorded before step {step}" + (
                               f": {unrestored}" if unrestored else "")}
        # the step itself: the records both hold (the run's scan, within the replay's detail)
        replayed = fingerprints_before(trace, step + 1)
        if any(replayed.get(key, fp) != fp
               for key, fp in fingerprints_before(recorded, step + 1).items()):
            return {"status": NOT_REPRODUCED, "step": step,
                    "why": f"the replay of {label} does not reproduce what {label} recorded at "
                           f"step {step}: " + (unrestored or (
                               f"its probe (code or data) differs from when {label} was "
                               "recorded (a replay runs it as it is now), or that step does "
                               "not reproduce from run to run"))}
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


def _unrestored(label: str, recorded: dict[str, Any], replayed: dict[str, Any]) -> str:
    """What a replay here could not restore of the environment run `label` was recorded in
    (its torch version, its device...), in words; empty when nothing differs."""
    differs = env_differences(recorded, replayed)
    if not differs:
        return ""
    settings = ", ".join(f"{key} {was!r} -> {now!r}" for key, (was, now) in differs.items())
    return (f"{label} was recorded in another environment than this machine replays it in "
            f"({settings}), which a replay here cannot restore, and PyTorch does not promise "
            f"bit-identical results across it: replay {label} where it was recorded")


def _plan(step: int, stress: bool = True) -> OpPlan:
    """A zoom's replay: scanned to `step`, which is recorded at module and op level (and,
    with `stress`, its risky ops re-executed in the last repeat), then stop."""
    from ..drivers.runner import OpPlan

    at = frozenset({step})
    return OpPlan(steps=at, last_step=step, zoom=at, stress=at if stress else frozenset())


def _replay_in_own_process(
    spec: ProbeSpec | None, config: AuditConfig, repeat: int, step: int, stress: bool = True,
    recorded_env: dict[str, Any] | None = None,
) -> tuple[Trace, set[tuple[str, int]]]:
    """One repeat's zoom replay in a fresh interpreter, as a run recorded in its own process
    ran (its own hash seed, no state left by other repeats; with `recorded_env`, the thread
    counts it records): its trace, and the module calls of `step` during which Python's or
    numpy's RNG advanced."""
    assert spec is not None, "a replay in another process rebuilds the probe from its spec"
    from ..drivers.isolation import run_child

    with tempfile.TemporaryDirectory(prefix="detaudit-zoom-") as scratch:
        job, out, draws = (Path(scratch) / name for name in (
            "job.json", "trace.json.gz", "draws.json"))
        code, last = run_child("detaudit.investigate.zoom", job, {
            "spec": spec.to_dict(), "config": config.to_dict(), "repeat": repeat,
            "step": step, "stress": stress, "env": recorded_env or {}, "trace": str(out),
            "draws": str(draws)})
        if code != 0 or not out.exists():
            raise DetauditError(f"the zoom's replay of repeat {repeat} in its own process "
                                f"failed (exit code {code}): {last}")
        return Trace.load(out), {(m, c) for m, c in json.loads(draws.read_text())}


def _child(job_path: str) -> int:
    """Run the zoom replay a job file describes and write its trace and host draws."""
    from ..drivers.loading import make_factory
    from ..drivers.runner import run_repeat, threads_as_recorded

    job = json.loads(Path(job_path).read_text())
    spec, config, step = (ProbeSpec.from_dict(job["spec"]), AuditConfig.from_dict(job["config"]),
                          job["step"])
    plan = _plan(step, job["stress"])
    try:
        with threads_as_recorded(job["env"]):
            trace, _ = run_repeat(make_factory(spec), config, job["repeat"], spec, ops=plan)
    except DetauditError as exc:
        print(f"detaudit: {exc}", file=sys.stderr)
        return 2
    trace.save(job["trace"])
    atomic_write(job["draws"], dump_json(sorted(plan.host_draws.get(step, set()))))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
