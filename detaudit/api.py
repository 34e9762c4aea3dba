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

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .analysis.compare import Comparison, compare
from .analysis.diff import GateResult, diff_traces
from .analysis.ranks import RankAnalysis
from .analysis.verdict import Verdict, judge
from .config import AuditConfig, Fault, Investigations, Launch, ProbeSpec
from .errors import DetauditError, ProbeError
from .report import render_console, summarize, write_reports
from .report.junit import JUnitCase, junit_case
from .runfolder import (
    RunInfo,
    load_baseline,
    load_run,
    save_baseline,
    save_run,
    save_trace,
    trace_name,
)
from .trace import Trace

if TYPE_CHECKING:  # pragma: no cover
    from .drivers.runner import ProbeFactory, RepeatTiming


class Progress:
    """What the orchestrator reports while it works. This base says nothing; the CLI's
    subclass draws a progress bar."""

    def start(self, total: int | None, unit: str, description: str) -> None:
        """Work of `total` units (steps or repeats; None: unknown) begins."""

    def advance(self, description: str) -> None:
        """One unit is done; `description` says where the audit is now."""

    def stage(self, name: str) -> None:
        """An investigation (``ops``, ``census``, ``verify``) begins."""

    def close(self) -> None:
        """The recording is over (the bar, if any, goes away)."""


STAGE_NAMES = {"ops": "op-level replay of the first divergent step", "census": "census",
               "verify": "fix verification"}


@dataclass
class AuditResult:
    """Everything one audit produced: traces, the comparison (made once), the
    investigations, the verdict, and the summary every report is drawn from."""

    spec: ProbeSpec
    config: AuditConfig
    traces: list[Trace]
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
                          self.verdict.headline, render_console(self.summary))


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
    granularity: str = "module",
    drill_down: bool = False,
    census: bool = False,
    verify_fix: bool = False,
    out: str | Path | None = None,
) -> AuditResult:
    """Run `probe` `repeats` times from the same seed, record everything, compare the runs.

    `probe(device)` must return a fresh :class:`detaudit.Probe` (or pass a
    :class:`ProbeSpec` of a built-in probe or a probe file). With `out`, each trace is
    saved there as it completes, then ``run.json`` and the reports.

    After a divergence, `drill_down` replays the first divergent step op by op to name the
    op (``result.investigations["ops"]``); `census` lists the known-nondeterministic ops the
    model runs and the deterministic-mode alerts (``["census"]``); `verify_fix` re-runs with
    PyTorch's deterministic settings and measures the cost (``["verify"]``).
    """
    config = AuditConfig(
        repeats=repeats, epochs=epochs, steps=steps, mode=mode, device=device, seed=seed,
        deterministic=deterministic, fault=fault, granularity=granularity,
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
    investigations: Investigations | None = None,
    launch: Launch | None = None,
    command: str = "",
    preset: str = "",
    progress: Progress | None = None,
) -> AuditResult:
    """The audit pipeline: record → compare → investigate → verdict → run folder → summary.

    `factory` builds the probe for a ``python`` spec (a callable cannot be described as
    data); built-in and file probes are rebuilt from `spec`. `command` and `preset` are
    what the reports print as the command line and the preset line.
    """
    progress = progress or Progress()
    investigations = investigations or Investigations()
    launch = launch or Launch()
    folder = Path(out) if out is not None else None
    if spec.kind == "python" and (launch.isolation == "process" or launch.nproc):
        raise DetauditError(
            "a probe passed as a Python function runs in this process only; give a probe "
            "file to run repeats in other processes or on several ranks"
        )
    if launch.nproc:
        if folder is None:
            raise DetauditError("a distributed audit needs a run folder")
        return _run_distributed(spec, config, folder, launch, command, preset, progress)
    from .drivers.loading import make_factory

    factory = factory or make_factory(spec)
    traces, timings = _record(spec, factory, config, folder, launch.isolation, progress)
    comparison = compare(traces)
    found = _investigate(spec, factory, config, comparison, traces, timings, investigations,
                         progress)
    verdict = judge(comparison, found.get("ops"))
    info = RunInfo(
        probe={**spec.to_dict(), "preset": preset}, config=config.to_dict(), command=command,
        traces=[trace_name(t.repeat) for t in traces], timings=[asdict(t) for t in timings],
        extra=found,
    )
    summary = summarize(info, comparison, traces, verdict)
    if folder is not None:
        save_run(folder, info)
        write_reports(folder, summary)
    return AuditResult(spec, config, traces, comparison, verdict, summary, info, timings, found,
                       folder=folder)


def baseline(
    spec: ProbeSpec, config: AuditConfig, path: str | Path, *, out: str | Path,
    launch: Launch | None = None, command: str = "", progress: Progress | None = None,
) -> tuple[Path, Trace]:
    """Run the probe and store repeat 0 as a baseline at `path`; return it and its trace."""
    result = run(spec, config, out=out, investigations=Investigations(drill_down=False),
                 launch=launch, command=command, preset="baseline", progress=progress)
    trace = result.traces[0]
    if trace.failure:
        raise DetauditError(f"the baseline run failed: {trace.failure}")
    return save_baseline(path, spec, config, trace), trace


def check(
    path: str | Path, *, out: str | Path | None = None, launch: Launch | None = None,
    rtol: float = 0.0, atol: float = 0.0, command: str = "", progress: Progress | None = None,
    factory: ProbeFactory | None = None,
) -> CheckResult:
    """Re-run a baseline's stored configuration and compare its repeat 0 with the baseline.

    `factory` stands in for a ``python`` baseline's probe function."""
    stored = load_baseline(path)
    result = run(stored.spec, stored.config, factory=factory, out=out,
                 investigations=Investigations(drill_down=False), launch=launch,
                 command=command, preset="as stored in the baseline", progress=progress)
    gate = diff_traces(stored.trace, result.traces, rtol, atol, labels=("baseline", "now"))
    if len(result.traces) > 1 and not result.comparison.deterministic:
        gate.message += (
            f"\nnote: the new run is not deterministic by itself (its repeats differ from step "
            f"{result.comparison.first_step}), so it cannot be expected to match any baseline"
        )
    return CheckResult(result, gate)


def diff(run_a: str | Path, run_b: str | Path, rtol: float = 0.0, atol: float = 0.0) -> GateResult:
    """Compare repeat 0 of two saved run folders, bitwise or within rtol/atol."""
    _, traces_a = load_run(run_a)
    _, traces_b = load_run(run_b)
    return diff_traces(traces_a, traces_b, rtol, atol, labels=(str(run_a), str(run_b)))


def render_folder(folder: str | Path) -> dict[str, Any]:
    """Re-render a saved run folder's reports from its traces; return the summary."""
    info, traces = load_run(folder)
    comparison = compare(traces)
    stored = (info.extra or {}).get("ranks")
    ranks = RankAnalysis.from_dict(stored) if stored else None
    verdict = judge(comparison, (info.extra or {}).get("ops"), ranks)
    summary = summarize(info, comparison, traces, verdict, ranks)
    write_reports(folder, summary)
    return summary


def resolve_device(name: str) -> str:
    """`auto` picks CUDA when present; a CUDA request without CUDA is a clear error."""
    from .drivers.runner import resolve_device as resolve

    return str(resolve(name))


def environment() -> tuple[dict[str, Any], dict[str, str]]:
    """The determinism-relevant environment, and the risky settings in it with the reason."""
    from .record.environment import capture_environment, risks

    env = capture_environment()
    return env, risks(env)


# -- the stages of run() --------------------------------------------------------------------
def _record(
    spec: ProbeSpec, factory: ProbeFactory, config: AuditConfig, folder: Path | None,
    isolation: str, progress: Progress,
) -> tuple[list[Trace], list[RepeatTiming]]:
    """Every repeat's trace, each saved into `folder` as soon as it is complete."""
    import torch

    from .drivers.isolation import run_isolated
    from .drivers.runner import run_repeat

    description = f"{spec.name} on {config.device}, threads={torch.get_num_threads()}"
    try:
        if isolation == "process":
            progress.start(config.repeats, "repeat", description)
            if folder is None:
                raise DetauditError("process isolation needs a run folder")
            return run_isolated(spec, config, folder,
                                on_repeat=lambda r: progress.advance(f"repeat {r + 1}"))
        progress.start(config.total_steps, "step", description)
        traces, timings = [], []
        for repeat in range(config.repeats):
            def on_step(epoch: int, index: int, step: int, repeat: int = repeat) -> None:
                progress.advance(f"repeat {repeat + 1}/{config.repeats} "
                                 f"epoch {epoch + 1}/{config.epochs}")

            trace, timing = run_repeat(factory, config, repeat, spec, on_step)
            traces.append(trace)
            timings.append(timing)
            if folder is not None:
                save_trace(folder, trace)
            if repeat == 0 and trace.failure and not trace.steps:
                raise ProbeError(trace.failure)
        return traces, timings
    finally:
        progress.close()


def _investigate(
    spec: ProbeSpec, factory: ProbeFactory, config: AuditConfig, comparison: Comparison,
    traces: list[Trace], timings: list[RepeatTiming], wanted: Investigations,
    progress: Progress,
) -> dict[str, Any]:
    """The investigations asked for, as plain data (a failed one says so in its place)."""
    if not (wanted.drill_down and comparison.first_step is not None) and not (
        wanted.census or wanted.verify_fix
    ):
        return {}
    from .investigate.stages import investigate

    return investigate(
        factory, config, comparison, timings, ops=wanted.drill_down, census=wanted.census,
        verify=wanted.verify_fix, spec=spec, traces=traces, on_stage=progress.stage,
    )


def _run_distributed(
    spec: ProbeSpec, config: AuditConfig, folder: Path, launch: Launch, command: str,
    preset: str, progress: Progress,
) -> AuditResult:
    """`run` on N ranks: launch, compare per rank and across ranks, write the run folder."""
    from .analysis.ranks import analyse, compare_ranks, finished
    from .drivers.distributed import run_distributed

    nproc = launch.nproc or 1
    progress.start(config.total_steps, "step", f"{spec.name} on {nproc} ranks ({config.device})")

    def on_step(repeat: int, epoch: int, step: int) -> None:
        progress.advance(f"repeat {repeat + 1}/{config.repeats} epoch {epoch + 1}/{config.epochs}")

    try:
        launched = run_distributed(spec, config, folder, nproc, launch.isolation, on_step)
    finally:
        progress.close()
    comparisons = compare_ranks(launched.traces)
    ranks = analyse(launched.traces, comparisons, launched.crash)
    ranks.launch = shlex.join(launched.command)
    ranks.traces = {str(r): [trace_name(t.repeat, r) for t in ts]
                    for r, ts in launched.traces.items()}
    primary = ranks.primary_rank
    compared = finished(launched.traces[primary])
    info = RunInfo(
        probe={**spec.to_dict(), "preset": preset}, config=config.to_dict(), command=command,
        traces=[trace_name(t.repeat, primary) for t in compared], timings=launched.timings,
        extra={"ranks": ranks.to_dict()},
    )
    verdict = judge(comparisons[primary], None, ranks)
    summary = summarize(info, comparisons[primary], compared, verdict, ranks)
    save_run(folder, info)
    write_reports(folder, summary)
    return AuditResult(spec, config, compared, comparisons[primary], verdict, summary, info,
                       ranks=ranks, folder=folder)
