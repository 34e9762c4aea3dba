"""The Python API, and the one orchestrator behind every command.

An audit is always the same pipeline: record the repeats (in this process, one interpreter
each, or on N ranks) → compare them once → the investigations asked for → the verdict →
the run folder and its reports. :func:`run` does it; :func:`audit` is its keyword form for
Python callers, :func:`check` and :func:`diff` gate against a baseline or another run, and
:func:`render_folder` re-renders a saved run. The CLI only parses, calls these and prints.

Torch is imported only by the functions that record (:func:`run` and what calls it), so
``detaudit report`` and ``detaudit diff`` start without it.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .analysis.compare import DIVERGENT, Comparison, compare
from .analysis.diff import GateResult, diff_traces
from .analysis.ranks import RankAnalysis
from .analysis.verdict import MISMATCH, Verdict, judge, junit_error
from .config import (
    REBUILT_KINDS,
    SCAN,
    WATCHED_SCRIPT,
    AuditConfig,
    Fault,
    Investigations,
    Launch,
    ProbeSpec,
)
from .errors import EXIT_USAGE, DetauditError, FaultRefused, ProbeError
from .planting import check_op_known
from .report import render_console, summarize, write_reports
from .report.junit import JUnitCase, junit_case
from .runfolder import (
    COMPLETE,
    FAULT_REFUSED,
    REFUSED,
    RUN_FILE,
    RunFolder,
    RunInfo,
    load_baseline,
    load_run,
    load_zoom,
    new_run_id,
    save_baseline,
    save_run,
    trace_name,
    watched_run,
    zoom_name,
)
from .trace import BACKWARD, FORWARD, AnyTrace, Trace, probe_value

if TYPE_CHECKING:  # pragma: no cover
    from .drivers.runner import ProbeFactory, RepeatTiming


class Progress:
    """What the orchestrator reports while it works. This base says nothing; the CLI's
    subclass draws a progress bar."""

    def start(self, total: int | None, unit: str, description: str) -> None:
        """Work of `total` units (steps or repeats; None: unknown) begins."""

    def advance(self, description: str) -> None:
        """One unit is done; `description` says where the audit is now."""

    def status(self, description: str) -> None:
        """The unit under way has moved on (a run's steps); `description` says where."""

    def note(self, message: str) -> None:
        """Something the user must know before the work starts (e.g. which code will run)."""

    def stage(self, name: str) -> None:
        """An investigation (``ops``, ``census``, ``verify``) begins."""

    def close(self) -> None:
        """The recording is over (the bar, if any, goes away)."""


STAGE_NAMES = {"ops": "op-level replay of the first divergent step", "census": "census",
               "verify": "fix verification",
               "zoom": "zoom: replay to the first divergent step, module and op level"}
ZOOMED_CAUSES = ("forward", "backward")  # what the scan's step state cannot locate


def needs_zoom(comparison: Comparison) -> bool:
    """Whether the first divergent step of a scan needs a zoom to be located: it parted in
    forward or backward, or drew a different amount of randomness although it began alike."""
    return comparison.cause in ZOOMED_CAUSES or (
        comparison.cause == "rng" and bool(comparison.drawn))


UNREPLAYABLE = "unreplayable"  # run.json's extra: runs compare was given (no zoom possible)


def unreplayed(verdict: Verdict, comparison: Comparison, traces: list[AnyTrace]) -> Verdict:
    """The verdict of runs no zoom could replay (compare's): a divergence a scan cannot
    place says why its module and op are not named, and the command that would (the
    script a watch ran in, where it was one)."""
    if verdict.kind == DIVERGENT and needs_zoom(comparison) and not any(
            d.phase in (FORWARD, BACKWARD) for d in comparison.first_diffs):
        command = next((p for t in traces if (p := probe_value(t, WATCHED_SCRIPT))),
                       "train.py")
        if not os.path.basename(shlex.split(command)[0]).startswith("python"):
            command = f"python {command}"  # (a script recorded without its Python)
        return replace(verdict, headline=(
            f"{verdict.headline}; the runs were recorded at scan level and compare cannot "
            f"replay them, so the module and op are not named (`detaudit exec -- {command}` "
            "replays that step module by module)"))
    return verdict


@dataclass
class AuditResult:
    """Everything one audit produced: traces, the comparison (made once), the
    investigations, the verdict, and the summary every report is drawn from."""

    spec: ProbeSpec
    config: AuditConfig
    traces: list[AnyTrace]  # streamed ones (TraceFile) when the run has a folder
    comparison: Comparison
    verdict: Verdict
    summary: dict[str, Any]
    info: RunInfo  # what run.json holds (timings included)
    timings: list[RepeatTiming] = field(default_factory=list)  # in-process repeats
    investigations: dict[str, Any] = field(default_factory=dict)  # ops, census, verify
    ranks: RankAnalysis | None = None
    folder: Path | None = None  # the run folder, when one was written

    @property
    def deterministic(self) -> bool:
        return self.comparison.deterministic and self.verdict.passed

    @property
    def seconds(self) -> float:
        """Wall time of the recorded repeats."""
        return sum(t["seconds"] for t in self.info.timings)

    def junit_case(self, classname: str = "detaudit.run") -> JUnitCase:
        """The verdict as one JUnit test case, with the console summary as its text."""
        return junit_case(self.spec.name, classname, self.seconds, self.verdict.passed,
                          self.verdict.headline, render_console(self.summary),
                          junit_error(self.verdict.kind))


@dataclass
class CheckResult:
    """A baseline check: the new run, and how it compares with the baseline."""

    audit: AuditResult
    gate: GateResult

    @property
    def exit_code(self) -> int:
        return self.gate.exit_code


def audit(
    probe: ProbeFactory | ProbeSpec,
    *,
    repeats: int = 2,
    epochs: int = 1,
    steps: int | None = None,
    mode: str = "train",
    device: str = "cpu",
    seed: int = 0,
    deterministic: bool = False,
    fault: Fault | None = None,
    granularity: str = "scan",
    stress: int = 16,
    stress_every_op: bool = False,
    drill_down: bool = True,
    census: bool = False,
    verify_fix: bool = False,
    out: str | Path | None = None,
) -> AuditResult:
    """Run `probe` `repeats` times from the same seed, record everything, compare the runs.

    `probe(device)` must return a fresh :class:`detaudit.Probe` (or pass a
    :class:`ProbeSpec` of a built-in probe or a probe file). With `out`, each trace is
    saved there as it completes, then ``run.json`` and the reports.

    `granularity` ``"scan"`` records each step's state (batch, RNGs, losses, gradients,
    parameters after the update); after a divergence in forward or backward, `drill_down`
    replays to the first divergent step and records it at module and op level (the zoom),
    naming the module and the op (``result.investigations["ops"]``). ``"module"`` records
    every module call of every step, and `drill_down` replays the first divergent step op
    by op; ``"op"`` records every op of every step. `census` lists the
    known-nondeterministic ops the model runs and the deterministic-mode alerts
    (``["census"]``); `verify_fix` re-runs with PyTorch's deterministic settings and
    measures the cost (``["verify"]``). The last
    repeat re-runs each risky op `stress` times on identical inputs at the first step of
    every epoch (every op with `stress_every_op`; 0: off): see ``result.comparison.proven``.
    """
    check_op_known(fault)
    config = AuditConfig(
        repeats=repeats, epochs=epochs, steps=steps, mode=mode, device=device, seed=seed,
        deterministic=deterministic, fault=fault, granularity=granularity, stress=stress,
        stress_every_op=stress_every_op,
    )
    wanted = Investigations(drill_down=drill_down, census=census, verify_fix=verify_fix)
    if isinstance(probe, ProbeSpec):
        return run(probe, config, out=out, investigations=wanted)
    return run(describe_callable(probe), config, factory=probe, out=out, investigations=wanted)


def describe_callable(probe: Callable[..., Any]) -> ProbeSpec:
    """The description of a probe function passed from Python."""
    name = getattr(probe, "__qualname__", type(probe).__name__)
    return ProbeSpec("python", name, source=getattr(probe, "__module__", None))


def run(
    spec: ProbeSpec,
    config: AuditConfig,
    *,
    factory: ProbeFactory | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    investigations: Investigations | None = None,
    launch: Launch | None = None,
    command: str = "",
    preset: str = "",
    progress: Progress | None = None,
) -> AuditResult:
    """The audit pipeline: record → compare → investigate → verdict → run folder → summary.

    `factory` builds the probe for a ``python`` spec (a callable cannot be described as
    data); built-in and file probes are rebuilt from `spec`. `command` and `preset` are
    what the reports print as the command line and the preset line. With `out`, the folder
    is claimed first (refused when it holds another run, unless `overwrite`, or when another
    run is using it) and ``run.json`` is kept current from then on: an interrupted or
    failed audit leaves a folder that ``detaudit report`` renders.
    """
    progress = progress or Progress()
    investigations = investigations or Investigations()
    launch = launch or Launch()
    if spec.kind == "python" and (launch.isolation == "process" or launch.nproc):
        raise DetauditError(
            "a probe passed as a Python function runs in this process only; give a probe "
            "file to run repeats in other processes or on several ranks"
        )
    if out is None and (launch.isolation == "process" or launch.nproc):
        raise DetauditError("repeats in other processes need a run folder")
    if launch.nproc and config.stress:  # ranks compare each other; no re-execution proof yet
        config = replace(config, stress=0)
    if launch.nproc and config.granularity == SCAN:  # ranks are not replayed to zoom yet
        config = replace(config, granularity="module")
    info = RunInfo(probe={**spec.to_dict(), "preset": preset}, config=config.to_dict(),
                   command=command, traces=[], run_id=new_run_id(), state="recording")
    folder = RunFolder(out, info, overwrite) if out is not None else _Unsaved(info)
    with folder:
        try:
            if launch.nproc:
                return _run_distributed(spec, config, folder, launch, progress)
            return _run_here(spec, config, factory, folder, launch, investigations, progress)
        except KeyboardInterrupt:
            mark_interrupted(folder)
            raise
        except BaseException as exc:
            mark_stopped(folder, exc)
            if (isinstance(folder, RunFolder) and folder.info.state.startswith(REFUSED)
                    and not folder.info.traces and not folder.partial_traces()):
                folder.discard()  # bad input, found before anything was recorded
            elif folder.path is not None:  # (what a repeat streamed so far: kept, listed)
                folder.keep_partial_traces(
                    f"not complete: the run was {folder.info.state.split(' ')[0]} while it "
                    "was recorded")
                _render_what_was_recorded(folder)
            raise


def mark_stopped(folder: RunFolder | _Unsaved, exc: BaseException) -> None:
    """Set the folder's state once `exc` stopped the run (see stopped_state), noting a run
    refused for its fault (see runfolder.FAULT_REFUSED)."""
    if isinstance(exc, FaultRefused):
        folder.info.extra[FAULT_REFUSED] = True
    folder.set_state(stopped_state(folder.info.state, exc))


def stopped_state(state: str, exc: BaseException) -> str:
    """A run folder's state once `exc` stopped it during `state`: refused for bad input
    found on the way (exit 2 when rendered again, as it was live), else failed."""
    how = REFUSED if isinstance(exc, DetauditError) and exc.exit_code == EXIT_USAGE else "failed"
    return f"{how} during {state}: {failure_line(exc)}"


def failure_line(exc: BaseException) -> str:
    """What stopped a run, in one line: a detaudit error's own message (it names the user's
    file and line when it was theirs), otherwise the exception's type and message."""
    message = next(iter(str(exc).splitlines()), "")
    if isinstance(exc, DetauditError) and message:
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _run_here(
    spec: ProbeSpec, config: AuditConfig, factory: ProbeFactory | None,
    folder: RunFolder | _Unsaved, launch: Launch, wanted: Investigations, progress: Progress,
) -> AuditResult:
    """`run` in this process (or one interpreter per repeat)."""
    from .drivers.loading import make_factory

    factory = factory or make_factory(spec)
    traces, timings = _record(spec, factory, config, folder, launch.isolation, progress)
    comparison = compare(traces)
    check_fault_seen(config.fault, comparison)
    zoomed = _zoom(spec, factory, config, comparison, wanted, folder, progress, launch.isolation)
    found = _investigate(spec, factory, config, comparison, traces, wanted, folder, progress)
    folder.info.state = COMPLETE
    folder.save()
    verdict = judge(comparison, found.get("ops"), zoom=zoomed,
                    zoom_found=(folder.info.extra or {}).get("zoom"))
    summary = summarize(folder.info, comparison, traces, verdict, zoom=zoomed)
    write_run_reports(folder, summary)
    return AuditResult(spec, config, traces, comparison, verdict, summary, folder.info,
                       timings, found, folder=folder.path)


def check_fault_seen(fault: Fault | None, comparison: Comparison) -> None:
    """A planted fault is a self-test: when it fired (the recorder checks that) and yet no
    repeat differs from another, the test did not test anything; that is an error, never a
    pass. (Its step is recorded at module level in every repeat, so this takes a change that
    rounded away inside the module it was planted in.)"""
    if fault is None or comparison.repeats < 2 or not comparison.deterministic:
        return
    where = f"op {fault.op} in " if fault.op else ""
    raise DetauditError(
        f"the planted fault fired ({where}{fault.named}, {fault.phase}, step "
        f"{fault.step}) but no recorded value differs: the 1-ULP change rounded away before "
        "anything detaudit records; plant it elsewhere (a module's own output, or one nearer "
        "the parameters)" + ("; a parameter's gradient is recorded as the optimizer receives "
                             "it, so clipping (clip_grad_norm_) or a scaling in between can "
                             "round a change in it away: plant it in forward"
                             if fault.phase == "backward" else ""))


class _Unsaved:
    """A run without a folder (the Python API without `out`): the same calls, no files."""

    path = None

    def __init__(self, info: RunInfo) -> None:
        self.info = info

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def add_trace(self, trace: Trace, timing: dict[str, Any] | None, rank: int | None = None
                  ) -> None:
        self.info.traces.append(trace_name(trace.repeat, rank))
        if timing is not None:
            self.info.timings.append(timing)

    def add_zoom_trace(self, trace: Trace) -> None:
        pass

    def set_state(self, state: str) -> None:
        self.info.state = state

    def save(self) -> None:
        pass


def write_run_reports(folder: RunFolder | _Unsaved, summary: dict[str, Any]) -> None:
    """Every report of the run into its folder, if it has one."""
    if folder.path is None:
        return
    try:
        write_reports(folder.path, summary)
    except OSError as exc:
        raise DetauditError(f"cannot write the reports into {folder.path}: "
                            f"{exc.strerror or exc}") from None


def mark_interrupted(folder: RunFolder | _Unsaved) -> None:
    """Mark the run interrupted and leave reports of what was recorded."""
    folder.set_state(f"interrupted during {folder.info.state}")
    if folder.path is None:
        return
    folder.keep_partial_traces()
    _render_what_was_recorded(folder)


def _render_what_was_recorded(folder: RunFolder) -> None:
    """The reports of a run that stopped (failed, refused, interrupted), from the traces it
    recorded; none when there are none."""
    if not folder.info.traces:
        return
    try:
        render_folder(folder.path)
    except (DetauditError, OSError):
        pass  # run.json says what happened; `detaudit report` will say what is missing


@dataclass
class BaselineResult:
    """A stored baseline: where, its trace (repeat 0), and the audit that recorded it."""

    path: Path
    trace: AnyTrace
    audit: AuditResult

    @property
    def warnings(self) -> list[str]:
        """What the recording found that makes a check against this baseline flaky: its own
        repeats differ, one failed, or an op was proven nondeterministic by re-execution."""
        comparison = self.audit.comparison
        found = []
        if comparison.first_step is not None:
            found.append(
                f"the baseline's own {comparison.repeats} repeats differ from step "
                f"{comparison.first_step} ({comparison.cause}): the model is not deterministic, "
                "so a check against this baseline can fail with unchanged code")
        found += [f"repeat {repeat} of the baseline's recording failed: {why}"
                  for repeat, why in sorted(comparison.failures.items())]
        found += [f"proven nondeterministic while recording the baseline: {op.line()}; a check "
                  "against this baseline can fail with unchanged code"
                  for op in comparison.proven[:3]]
        return found


def check_baseline_config(config: AuditConfig) -> None:
    """Refuse what a baseline must not store: a planted fault, which every check would plant
    again (and then match)."""
    if config.fault is not None:
        raise DetauditError("a baseline records the model as it is; a planted fault "
                            "(--inject-fault) would be stored and planted again by every check: "
                            "plant faults with `detaudit run`")


def baseline(
    spec: ProbeSpec, config: AuditConfig, path: str | Path, *, out: str | Path,
    launch: Launch | None = None, command: str = "", progress: Progress | None = None,
) -> BaselineResult:
    """Run the probe and store repeat 0 as a baseline at `path`.

    A baseline is compared later with code that has changed, so it cannot be replayed to
    zoom: it keeps every module call of every step (a scan configuration becomes module).
    It records the model as it is (see :func:`check_baseline_config`). Its repeats are
    compared and its risky ops stressed as in `run`; what they find is in the result's
    warnings."""
    check_baseline_config(config)
    if config.granularity == SCAN:
        config = replace(config, granularity="module")
    result = run(spec, config, out=out, investigations=Investigations(drill_down=False),
                 launch=launch, command=command, preset="baseline", progress=progress)
    trace = result.traces[0]
    if trace.failure:
        raise DetauditError(f"the baseline run failed: {trace.failure}")
    return BaselineResult(save_baseline(path, spec, config, trace), trace, result)


def check(
    path: str | Path, *, out: str | Path | None = None, overwrite: bool = False,
    launch: Launch | None = None,
    rtol: float = 0.0, atol: float = 0.0, command: str = "", progress: Progress | None = None,
    factory: ProbeFactory | None = None, allow_external_probe: bool = False,
) -> CheckResult:
    """Re-run a baseline's stored configuration and compare its repeat 0 with the baseline.

    A baseline is code: it names the probe to run. A probe file outside the current folder
    is refused unless `allow_external_probe`; `factory` stands in for a ``python``
    baseline's probe function."""
    stored = load_baseline(path)
    progress = progress or Progress()
    if stored.spec.kind == "file":
        source = Path(stored.spec.source or "")
        if not source.is_file():
            raise DetauditError(
                f"the baseline {path} names the probe file {source}, which does not exist; keep "
                "the probe file where it was, relative to the baseline, when the baseline was "
                "recorded")
        progress.note(f"the baseline runs the probe file {source} ({stored.spec.func})")
        if not allow_external_probe and not source.resolve().is_relative_to(Path.cwd().resolve()):
            raise DetauditError(
                f"the baseline {path} names the probe file {source}, outside the current folder "
                f"{Path.cwd()}; a baseline is code: run check from the project folder, or allow "
                "it explicitly (--allow-external-probe)"
            )
    result = run(stored.spec, stored.config, factory=factory, out=out, overwrite=overwrite,
                 investigations=Investigations(drill_down=False), launch=launch,
                 command=command, preset="as stored in the baseline", progress=progress)
    gate = diff_traces(stored.trace, result.traces, rtol, atol, labels=("baseline", "now"),
                       audited_alike=True)
    unstable = _not_deterministic_by_itself(result.comparison)
    if unstable:
        gate.message += (f"\nnote: the new run is not deterministic by itself ({unstable}), so "
                         "it cannot be expected to match any baseline")
    for op in result.comparison.proven[:3]:
        gate.message += f"\nnote: proven by re-execution in this run: {op.line()}"
    if unstable and gate.ok and not gate.tolerance:  # a bitwise match, by chance: no pass
        gate.ok = False
        gate.headline = (f"MISMATCH: the new run is not deterministic by itself ({unstable}); "
                         f"{gate.headline.removeprefix('MATCH: ')}, by chance")
    if stored.config.fault is not None:  # stored before baselines refused one
        gate.message += ("\nnote: this baseline stores a planted fault, which the check planted "
                         "again: record the baseline again without --inject-fault")
    if result.folder is not None:  # the folder's reports give the check's verdict
        checked = {"baseline": str(path), "verdict": gate.verdict, "headline": gate.headline,
                   "message": gate.message,  # (and what differs in the environment since)
                   "env_differences": {k: list(v) for k, v in gate.env_differences.items()},
                   "steps_apart": gate.steps_apart, "steps_apart_total": gate.steps_apart_total}
        result.info.extra["check"] = checked
        save_run(result.folder, result.info)
        write_reports(result.folder, with_check(result.summary, checked))
    return CheckResult(result, gate)


def _not_deterministic_by_itself(c: Comparison) -> str:
    """How a run's own repeats, or its re-execution of risky ops, show it nondeterministic
    (empty where they do not)."""
    if c.repeats > 1 and c.first_step is not None:
        return f"its repeats differ from step {c.first_step}"
    if c.proven:
        op = c.proven[0]
        return f"re-execution proved {op.base_op} in {op.module or '(model)'} nondeterministic"
    return ""


def with_check(summary: dict[str, Any], checked: dict[str, Any]) -> dict[str, Any]:
    """A run's summary as the verdict of the baseline check it was run for (its cause, where
    its own repeats agree but the baseline does not: what changed since, and where)."""
    said = {**summary, "verdict": checked["verdict"], "headline": checked["headline"],
            "check": checked}
    if checked["verdict"] == MISMATCH and summary["cause"]["kind"] == "none":
        where = [line for line in checked["message"].splitlines()
                 if line.startswith(("origin:", "first difference:"))]
        said["cause"] = {"kind": "baseline", "text": (
            ("the repeats of this run agree, and differ" if summary["repeats"] > 1 else
             "this run differs") + " from the baseline: the code, its data or the "
            "environment changed since the baseline was recorded"
            + (f" ({where[-1]})" if where else ""))}
    return said


def diff(run_a: str | Path, run_b: str | Path, rtol: float = 0.0, atol: float = 0.0,
         zoom: bool = False) -> GateResult:
    """Compare repeat 0 of two saved run folders, bitwise or within rtol/atol. With `zoom`,
    when they part at a step, replay both here to that step at module and op level (see
    :func:`detaudit.investigate.zoom.zoom_between`)."""
    info_a, traces_a = _run_or_watched(run_a)
    info_b, traces_b = _run_or_watched(run_b)
    def replay_both(step: int) -> dict[str, Any]:
        from .investigate.zoom import NOT_POSSIBLE, zoom_between

        runs = [_replayable(info, traces[0], label)
                for info, traces, label in ((info_a, traces_a, "A"), (info_b, traces_b, "B"))]
        refused = next((r for r in runs if isinstance(r, str)), None)
        if refused:
            return {"status": NOT_POSSIBLE, "step": step, "why": refused}
        return zoom_between(runs, step)  # type: ignore[arg-type]

    return diff_traces(traces_a, traces_b, rtol, atol, labels=(str(run_a), str(run_b)),
                       zoom=replay_both if zoom else None)


def _run_or_watched(path: str | Path) -> tuple[RunInfo, list[Any]]:
    """A run folder, or what ``watch`` writes: a trace file, a folder of traces only."""
    path = Path(path)
    if path.is_file() or (path.is_dir() and not (path / RUN_FILE).exists()
                          and next(path.glob("trace-*.json.gz"), None) is not None):
        return watched_run(path)
    return load_run(path)


def _replayable(info: RunInfo, trace: Trace, label: str) -> tuple | str:
    """(spec, config, trace) to replay a saved run here, or why it cannot be."""
    spec = ProbeSpec.from_dict({k: v for k, v in info.probe.items() if k != "preset"})
    if spec.kind not in REBUILT_KINDS:
        return (f"{label} was recorded from {spec.kind} {spec.name!r}, which detaudit cannot "
                "replay (re-run it with the zoom: `detaudit exec` and `run` zoom by default)")
    if spec.kind == "file" and not Path(spec.source or "").exists():
        return f"{label}'s probe file {spec.source} is not on this machine"
    try:
        config = AuditConfig.from_dict(info.config)
        resolve_device(config.device)
    except (DetauditError, TypeError, ValueError) as exc:
        return f"{label} cannot be replayed here: {exc}"
    return spec, config, trace


def render_folder(folder: str | Path) -> dict[str, Any]:
    """Re-render a saved run folder's reports from its traces; return the summary."""
    info, traces = load_run(folder)
    comparison = compare(traces)
    stored = (info.extra or {}).get("ranks")
    ranks = RankAnalysis.from_dict(stored) if stored else None
    zoomed_traces = load_zoom(folder, info)
    zoomed = compare(zoomed_traces, comparison.idle_rng) if zoomed_traces else None
    verdict = judge(comparison, (info.extra or {}).get("ops"), ranks,
                    interrupted=None if info.complete else info.state, zoom=zoomed,
                    zoom_found=(info.extra or {}).get("zoom"))
    if (info.extra or {}).get(UNREPLAYABLE):
        verdict = unreplayed(verdict, comparison, traces)
    summary = summarize(info, comparison, traces, verdict, ranks, zoom=zoomed)
    if (info.extra or {}).get("check"):
        summary = with_check(summary, info.extra["check"])
    write_reports(folder, summary)
    return summary


def resolve_device(name: str) -> str:
    """`auto` picks CUDA when present; a CUDA request without CUDA is a clear error."""
    from .drivers.runner import resolve_device as resolve

    return str(resolve(name))


def environment() -> tuple[dict[str, Any], dict[str, str]]:
    """The determinism-relevant environment, on the device `run` would audit on by default,
    and the risky settings in it with the reason."""
    from .analysis.risks import risks
    from .record.environment import capture_environment

    env = capture_environment(resolve_device("auto"))
    return env, risks(env)


# -- the stages of run() --------------------------------------------------------------------
def _record(
    spec: ProbeSpec, factory: ProbeFactory, config: AuditConfig, folder: RunFolder | _Unsaved,
    isolation: str, progress: Progress,
) -> tuple[list[Trace], list[RepeatTiming]]:
    """Every repeat's trace, each added to the run folder as soon as it is complete."""
    import torch

    from .drivers.isolation import run_isolated
    from .drivers.runner import run_repeat

    description = (f"{config.granularity}: {spec.name} on {config.device}, "
                   f"threads={torch.get_num_threads()}")
    try:
        if isolation == "process":
            progress.start(config.repeats, "repeat", description)

            def on_repeat(trace: Trace, timing: RepeatTiming) -> None:
                folder.add_trace(trace, asdict(timing))
                progress.advance(f"repeat {trace.repeat + 1}")

            return run_isolated(spec, config, folder.path, folder.info.run_id, on_repeat)
        progress.start(config.total_steps, "step", description)
        traces, timings = [], []
        for repeat in range(config.repeats):
            def on_step(epoch: int, index: int, step: int, repeat: int = repeat) -> None:
                progress.advance(f"{config.granularity}: repeat {repeat + 1}/{config.repeats} "
                                 f"epoch {epoch + 1}/{config.epochs}")

            trace, timing = run_repeat(
                factory, config, repeat, spec, on_step, run_id=folder.info.run_id,
                stream_to=folder.path / trace_name(repeat) if folder.path else None)
            traces.append(trace)
            timings.append(timing)
            folder.add_trace(trace, asdict(timing))
            if repeat == 0 and trace.failure and not trace.steps:
                raise ProbeError(trace.failure)
            if repeat == 0 and config.repeats > 1 and _shares_algorithm_cache(config, trace.env):
                if spec.kind == "python" or folder.path is None:
                    progress.note(
                        "cudnn.benchmark is on: repeats in one process share cuDNN's "
                        "algorithm cache and may agree where separate runs would not; audit "
                        "a probe file with --isolation process for a verdict that holds"
                    )
                    continue
                more = _isolate_the_rest(spec, config, folder, progress)
                return traces + more[0], timings + more[1]
        return traces, timings
    finally:
        progress.close()


def _shares_algorithm_cache(config: AuditConfig, env: dict[str, Any]) -> bool:
    """Whether in-process repeats would share cuDNN's algorithm cache: benchmark mode on CUDA
    picks algorithms once per process, so later repeats reuse the first one's choices."""
    return str(config.device).startswith("cuda") and bool(env.get("cudnn_benchmark"))


def _isolate_the_rest(
    spec: ProbeSpec, config: AuditConfig, folder: RunFolder | _Unsaved, progress: Progress,
) -> tuple[list[Trace], list[RepeatTiming]]:
    """Repeats 2 to N, each in a fresh interpreter (repeat 1 ran as the first in this one)."""
    from .drivers.isolation import run_isolated

    why = "process from repeat 2: cudnn.benchmark is on"
    folder.info.extra["isolation"] = why
    progress.note(
        "cudnn.benchmark is on: in-process repeats would share cuDNN's algorithm cache and "
        f"could agree where separate runs would not, so repeats 2 to {config.repeats} run each "
        "in a fresh process (as --isolation process)"
    )
    progress.close()
    progress.start(config.repeats - 1, "repeat", "repeats in fresh processes")

    def on_repeat(trace: Trace, timing: RepeatTiming) -> None:
        folder.add_trace(trace, asdict(timing))
        progress.advance(f"repeat {trace.repeat + 1}")

    return run_isolated(spec, config, folder.path, folder.info.run_id, on_repeat, first=1)


def _zoom(
    spec: ProbeSpec, factory: ProbeFactory, config: AuditConfig, comparison: Comparison,
    wanted: Investigations, folder: RunFolder | _Unsaved, progress: Progress,
    isolation: str = "inprocess",
) -> Comparison | None:
    """A scanned run that parted in forward or backward (or drew a different amount of
    randomness in a step that began alike): replay to that step and record it at module and
    op level (the zoomed traces join the run folder); their comparison. Runs recorded each in
    its own process are replayed so too when a replay here does not part. A repeat that
    failed later does not stop it: the steps compared are those every repeat completed, and
    the replays end at the zoomed step."""
    if not (config.granularity == SCAN and wanted.drill_down and comparison.first_step
            is not None and needs_zoom(comparison)):
        return None
    from .investigate.zoom import zoom

    folder.set_state(f"investigating: {STAGE_NAMES['zoom']}")
    progress.stage("zoom")
    apart = isolation == "process" or "isolation" in folder.info.extra
    found, traces = zoom(factory, config, comparison, spec, wanted.zoom_tries, apart)
    found["traces"] = [zoom_name(t.repeat) for t in traces]
    for trace in traces:
        folder.add_zoom_trace(trace)
    folder.info.extra["zoom"] = {k: v for k, v in found.items() if k != "ops"}
    if found["ops"] is not None:
        folder.info.extra["ops"] = found["ops"]
    folder.save()
    return compare(traces, comparison.idle_rng) if traces else None


def _investigate(
    spec: ProbeSpec, factory: ProbeFactory, config: AuditConfig, comparison: Comparison,
    traces: list[Trace], wanted: Investigations, folder: RunFolder | _Unsaved,
    progress: Progress,
) -> dict[str, Any]:
    """The investigations asked for, as plain data (a failed one says so in its place);
    ``run.json`` says which one is running and keeps each result as it comes."""
    drill = wanted.drill_down and config.granularity != SCAN
    if not (drill and comparison.first_step is not None) and not (
        wanted.census or wanted.verify_fix
    ):
        return dict(folder.info.extra)
    from .investigate.stages import investigate

    def on_stage(name: str) -> None:
        folder.set_state(f"investigating: {STAGE_NAMES.get(name, name)}")
        progress.stage(name)

    def on_done(name: str, result: Any) -> None:
        folder.info.extra[name] = result
        folder.save()

    investigate(
        factory, config, comparison, ops=drill, census=wanted.census,
        verify=wanted.verify_fix, spec=spec, traces=traces, on_stage=on_stage,
        on_done=on_done,
    )
    return dict(folder.info.extra)


def _run_distributed(
    spec: ProbeSpec, config: AuditConfig, folder: RunFolder, launch: Launch, progress: Progress,
) -> AuditResult:
    """`run` on N ranks: launch, compare per rank and across ranks, write the run folder."""
    from .analysis.ranks import analyse, compare_ranks, finished
    from .drivers.distributed import run_distributed

    nproc = launch.nproc or 1
    progress.start(config.total_steps, "step", f"{spec.name} on {nproc} ranks ({config.device})")

    def on_step(repeat: int, epoch: int, step: int) -> None:
        progress.advance(f"repeat {repeat + 1}/{config.repeats} epoch {epoch + 1}/{config.epochs}")

    try:
        launched = run_distributed(spec, config, folder.path, nproc, launch.isolation, on_step,
                                   run_id=folder.info.run_id)
    finally:
        progress.close()
    comparisons = compare_ranks(launched.traces)
    ranks = analyse(launched.traces, comparisons, launched.crash)
    ranks.launch = shlex.join(launched.command)
    ranks.traces = {str(r): [trace_name(t.repeat, r) for t in ts]
                    for r, ts in launched.traces.items()}
    primary = ranks.primary_rank
    compared = finished(launched.traces[primary])
    info = folder.info
    info.traces = [trace_name(t.repeat, primary) for t in compared]
    info.timings = launched.timings
    info.extra = {"ranks": ranks.to_dict()}
    info.state = COMPLETE
    folder.save()
    verdict = judge(comparisons[primary], None, ranks)
    summary = summarize(info, comparisons[primary], compared, verdict, ranks)
    write_run_reports(folder, summary)
    return AuditResult(spec, config, compared, comparisons[primary], verdict, summary, info,
                       ranks=ranks, folder=folder.path)
