"""Audits of training detaudit does not drive: ``watch`` records the user's own loop in
this process, one trace per run; ``compare`` analyses traces of separate runs (``watch``'s,
or ``exec``'s: see :mod:`.execution`) as ``run`` does its own repeats.
"""

from __future__ import annotations

import copy
import html
import os
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .analysis.compare import Comparison
from .analysis.compare import compare as compare_traces
from .analysis.ranks import RankAnalysis
from .analysis.verdict import Verdict, judge
from .api import UNREPLAYABLE, unreplayed, write_run_reports
from .config import (
    ATTACH_MODES,
    AUTO,
    CALLS_UNSEEN,
    ENDED,
    JOB_VARIABLE,
    SCAN,
    WATCHED_SCRIPT,
    AuditConfig,
    ProbeSpec,
)
from .errors import DetauditError
from .report import render_html, summarize
from .runfolder import (
    COMPLETE,
    RunFolder,
    RunInfo,
    info_of_traces,
    load_traces,
    new_run_id,
    trace_name,
    trace_probe,
)
from .trace import (
    PROBE_CONFIG,
    PROBE_RUN,
    PROBE_SPEC,
    STATE,
    AnyTrace,
    Trace,
    TraceFile,
    state_name,
)
from .words import counted


@dataclass
class Compared:
    """Traces of separate runs of one training, compared: the verdict, the summary, and (in
    a notebook) the HTML report inline."""

    comparison: Comparison
    verdict: Verdict
    summary: dict[str, Any]
    traces: list[AnyTrace]
    folder: Path | None = None
    timings: list[dict[str, Any]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def __repr__(self) -> str:
        """The verdict line (a console or terminal IPython shows this, not the report)."""
        where = f"; reports: {self.folder}" if self.folder is not None else ""
        return f"<detaudit.Compared {self.verdict.headline} (exit {self.exit_code}){where}>"

    def _repr_html_(self) -> str:
        """The HTML report in a frame of its own: a notebook shows it inline, and the
        report's styles stay off the notebook's page."""
        page = html.escape(render_html(self.summary), quote=True)
        return (f'<iframe srcdoc="{page}" style="width:100%;height:640px;border:1px solid '
                '#d0d7de" sandbox></iframe>')


# -- compare -------------------------------------------------------------------------------
def compare(*runs: str | Path | Trace, out: str | Path | None = None,
            overwrite: bool = False) -> Compared:
    """Compare separate runs of one training: trace files, folders of them (every
    ``trace-*.json.gz`` inside, as ``watch`` writes them) or :class:`Trace` objects. With
    `out`, a run folder is written there (the traces, ``run.json``, the reports)."""
    traces = load_traces(runs)
    if len(traces) < 2:
        raise DetauditError(f"compare needs at least two runs; found {counted(len(traces), 'trace')}")
    names = list(dict.fromkeys(str(t.probe.get(PROBE_SPEC, {}).get("name")) for t in traces))
    if len(names) > 1:
        raise DetauditError(f"these are runs of different trainings ({', '.join(names)}): "
                            "compare runs of one training (`detaudit diff A B` tells two apart: "
                            "run folders, trace files or folders of traces)")
    _refuse_other_models(traces)
    run_id = new_run_id()
    originals, traces = traces, [_as_repeat(t, i, run_id) for i, t in enumerate(traces)]
    for trace, given in zip(traces, originals):
        if trace.failure is None and trace.probe.get(ENDED) is False:
            # killed (SIGTERM, SIGKILL), os._exit, or still running: the steps since its
            # last save are missing, so it is short of what ran, not different
            trace.failure = ("the run ended without its recording closing (killed, or "
                             "os._exit; or it is still running) after step "
                             f"{len(trace.steps) - 1}, the last step saved; the steps after it "
                             "are lost")
        if trace.failure is not None and isinstance(given, TraceFile):  # which one to leave out
            trace.failure += f" (its trace: {given.path.name})"
    finished = [given.path for trace, given in zip(traces, originals)
                if trace.failure is None and isinstance(given, TraceFile)]
    if len(finished) >= 2:  # (a notebook's crashed cell, then good runs: how to compare those)
        for trace in traces:
            if trace.failure is not None:
                trace.failure += (f"; the {len(finished)} runs that finished compare alone: "
                                  f"detaudit compare {shlex.join(map(str, finished))}")
    named = " ".join(str(r) for r in runs if not isinstance(r, (Trace, TraceFile)))
    info = info_of_traces(traces, run_id, f"detaudit compare {named}",
                          f"{len(traces)} runs compared")
    if out is None:
        return conclude(traces, info, None, replayed=False)
    inside = [t.path for t in traces if isinstance(t, TraceFile)
              and t.path.resolve().parent == Path(out).resolve()]
    if inside:
        raise DetauditError(f"--out {out} holds {inside[0].name}, one of the traces compared: "
                            "the run folder would write over it; choose another --out")
    with RunFolder(out, info, overwrite) as folder:
        for trace in traces:
            folder.add_trace(trace, None)
        return conclude(traces, info, folder, replayed=False)


def _refuse_other_models(traces: list[AnyTrace]) -> None:
    """Runs whose parameters differ in name or shape before their first step trained
    different models (a notebook's class edited between the runs): refused, not compared
    (their differences would read as an unseeded initialisation)."""
    recorded = [(t, shapes) for t in traces if (shapes := _parameter_shapes(t))]
    if not recorded:  # (runs that failed before their first step are failed runs)
        return
    first, shapes_first = recorded[0]
    for trace, theirs in recorded[1:]:
        if theirs == shapes_first:
            continue
        name = next(n for n in sorted(shapes_first.keys() | theirs.keys())
                    if shapes_first.get(n) != theirs.get(n))
        was, now = (str(of.get(name, "absent")) for of in (shapes_first, theirs))
        raise DetauditError(
            f"these runs trained different models: parameter {name} is {was} in "
            f"{_source(first)} and {now} in {_source(trace)}; compare runs of one "
            "model (`detaudit diff A B` tells two apart)")


def _parameter_shapes(trace: AnyTrace) -> dict[str, list[int]]:
    """Each parameter's shape before the first step, by name."""
    for _, cut in trace.by_step():
        r = cut.records
        return {state_name(module, slot): shape
                for phase, module, slot, shape in zip(r["phase"], r["module"], r["slot"],
                                                      r["shape"])
                if phase == STATE and slot.startswith("param.")}
    return {}


def _source(trace: AnyTrace) -> str:
    path = getattr(trace, "path", None)
    return path.name if path is not None else f"run {trace.repeat}"


def _as_repeat(trace: AnyTrace, repeat: int, run_id: str) -> AnyTrace:
    """The trace as repeat `repeat` of a new run (a run folder's traces carry its id)."""
    renamed = copy.copy(trace)
    renamed.repeat, renamed.probe = repeat, {**trace.probe, PROBE_RUN: run_id}
    return renamed


def conclude(traces: list[AnyTrace], info: RunInfo, folder: RunFolder | None,
              timings: list[dict[str, Any]] | None = None,
              zoom: Comparison | None = None, ranks: RankAnalysis | None = None,
              comparison: Comparison | None = None, replayed: bool = True) -> Compared:
    """The verdict and reports of compared traces (`replayed`: a divergence in forward or
    backward could be zoomed: exec's runs, not those compare is given)."""
    comparison = comparison or compare_traces(traces)
    info.state = COMPLETE
    if not replayed:
        info.extra[UNREPLAYABLE] = True
    if folder is not None:
        folder.save()
    verdict = judge(comparison, info.extra.get("ops"), ranks, zoom=zoom,
                    zoom_found=info.extra.get("zoom"))
    if not replayed:
        verdict = unreplayed(verdict, comparison, traces)
    summary = summarize(info, comparison, traces, verdict, ranks, zoom=zoom)
    if folder is not None:
        write_run_reports(folder, summary)
    return Compared(comparison, verdict, summary, traces, folder.path if folder else None,
                    timings or [])


# -- watch ---------------------------------------------------------------------------------
class WatchLimit(BaseException):
    """Raised inside the watched loop when `max_steps` is reached; ``watch`` swallows it."""


class watch:
    """Record the training loop inside the ``with`` block, at scan level, into one trace in
    `out` (the next free ``trace-<n>.json.gz``; `name` names the run in the reports).

    Steps are optimizer steps (found through torch's optimizer hooks); ``w.step(losses)``
    names the loss terms of the current step and ends it, ``w.epoch(i)`` says which epoch
    the next steps belong to. After `max_steps` steps the loop is ended cleanly. `mode`:
    ``"infer"`` makes each call of the model a step (its outputs recorded), ``"train"``
    never does; ``"auto"`` infers when the model's first call is in eval mode and no
    optimizer exists. Run the same loop twice (two processes, or twice in one), then
    ``detaudit.compare(out)``.
    """

    def __init__(self, model: Any, optimizer: Any = None, *, out: str | Path = "reports/watch",
                 max_steps: int | None = None, name: str | None = None, mode: str = AUTO
                 ) -> None:
        from torch import nn

        if not isinstance(model, nn.Module):
            raise DetauditError(f"watch needs the nn.Module being trained, not {type(model).__name__}")
        if mode not in ATTACH_MODES:
            raise DetauditError(f"mode must be one of {', '.join(ATTACH_MODES)}, not {mode!r}")
        self.mode = mode
        if max_steps is not None and max_steps < 1:
            raise DetauditError("max_steps must be at least 1")
        if optimizer is not None and not _trains(optimizer, model):
            if _made_for_another_model(optimizer, model):
                raise DetauditError(
                    f"the optimizer given updates none of the parameters of the model given "
                    f"({type(model).__name__}): give watch the model it trains, or an "
                    "optimizer made for this one (in a notebook, the optimizer may be an "
                    "earlier model's: re-run the cell that makes it after the one that builds "
                    "the model)")
            warnings.warn(
                f"detaudit.watch: the optimizer given updates copies of the parameters of the "
                f"model given ({type(model).__name__}), not them (float32 master weights, a "
                "flattened buffer): the gradients it gets are not recorded, the model's "
                "parameters are as they change", stacklevel=2)
        self.model, self.optimizer = model, optimizer
        self.out, self.max_steps = Path(out), max_steps
        self.name = name or type(model).__name__
        self.path: Path | None = None
        self._attachment: Any = None
        self._unrecorded: set[str] = set()  # what w.step got that holds nothing to record

    def __enter__(self) -> watch | _LeftToExec:
        from .drivers.attach import Attachment
        from .record.sites import in_a_library

        if os.environ.get(JOB_VARIABLE):  # (a run of `detaudit exec`, or a process of one)
            warnings.warn("detaudit.watch: this process is recorded by `detaudit exec`, so the "
                          "watch records nothing and leaves its folder as it is (nor ends the "
                          "loop at its max_steps: exec's --max-steps does)", stacklevel=2)
            return _LeftToExec()
        if id(self.model) in _WATCHED:  # both would record the one run: a pass of nothing
            raise DetauditError(f"this {type(self.model).__name__} is already watched (a watch "
                                "inside another on the same model): one watch records one run")
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = _free_trace_path(self.out)
        config = AuditConfig(repeats=1, steps=self.max_steps, granularity=SCAN, stress=0)
        probe = trace_probe(ProbeSpec("watch", self.name), config, new_run_id())
        # watch seeds nothing and picks no device: the user's code does
        del probe[PROBE_CONFIG]["seed"], probe[PROBE_CONFIG]["device"]
        script = sys.argv[0] if sys.argv else ""
        if script.endswith(".py") and not in_a_library(os.path.abspath(script)):
            # (a notebook's kernel, pytest: a library's; the Python it ran in, which has
            # torch, for the command exec would replay it by)
            probe[WATCHED_SCRIPT] = shlex.join([sys.executable, os.path.relpath(script),
                                                *sys.argv[1:]])
        self._attachment = Attachment(self.path, probe, model=self.model,
                                      optimizer=self.optimizer, max_steps=self.max_steps,
                                      on_limit=self._limit, mode=self.mode).install()
        _WATCHED.add(id(self.model))
        return self

    def step(self, losses: dict[str, Any] | Any = None) -> None:
        """Name the current step's loss terms (a dict, or one tensor) and end the step (or,
        called between backward and the optimizer's update, let the update end it). What
        else the loop logs may go in the dict too (an accuracy, a count): each value is
        recorded, and one that differs between runs is a divergence of the step."""
        if losses is not None:
            unrecorded = self._attachment.name_losses(
                losses if isinstance(losses, dict) else {"loss": losses})
            for name in unrecorded:
                if name not in self._unrecorded:
                    self._unrecorded.add(name)
                    warnings.warn(f"detaudit.watch: w.step got {name!r}, which holds no tensor "
                                  "or number: not recorded", stacklevel=2)
        if self._attachment.awaits_update():
            return
        self._attachment.end_step()
        if self.max_steps is not None and self.steps >= self.max_steps:
            self._attachment.stop()

    def epoch(self, index: int) -> None:
        """The next steps belong to epoch `index` (0-based)."""
        self._attachment.set_epoch(index)

    @property
    def steps(self) -> int:
        """The steps recorded so far."""
        return self._attachment.stream.steps

    @property
    def trace(self) -> Trace:
        """The trace as recorded so far (read back from its file: a long run holds only its
        newest records in memory)."""
        if self._attachment.installed:
            self._attachment.save()
        return Trace.load(self._attachment.path)

    def _limit(self) -> None:
        raise WatchLimit

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        from .drivers.runner import describe_user_error

        if self._attachment is None:  # (left to exec)
            return False
        failure = None
        if exc is not None and not isinstance(exc, WatchLimit):
            steps = self.steps
            failure = describe_user_error(exc, (
                f"in step {steps}" if self._attachment.info is not None
                else f"after step {steps - 1}" if steps else "before the first step"))
        try:
            self._attachment.finish(failure)
        finally:
            _WATCHED.discard(id(self.model))
            self._attachment.uninstall()
            if self.path is not None and self.path.stat().st_size == 0:
                self.path.unlink()  # nothing was recorded: no trace, not an empty file
        trace = self._attachment.trace
        if not self.steps and self._attachment.batches_seen == 0 and exc is None:
            warnings.warn("detaudit.watch recorded no step: no optimizer step was seen, nor "
                          "calls of the model to infer (mode='infer' takes every call of the "
                          "model for a step)", stacklevel=2)
        if self.optimizer is None and self._attachment.trained_none_of(self.model):
            warnings.warn(f"detaudit.watch: the optimizer that stepped updated no parameter of "
                          f"the model given ({type(self.model).__name__}): it trains another "
                          "model (in a notebook, an optimizer made for an earlier model: re-run "
                          "the cell that makes it after the one that builds the model)",
                          stacklevel=2)
        if self._attachment.given_optimizer_idle:
            warnings.warn("detaudit.watch: the optimizer given never stepped while another one "
                          "did, so no update was recorded: give watch the optimizer your loop "
                          "steps, or none (watch finds it)", stacklevel=2)
        if self.model is not None and self.steps and not self._attachment.batches_seen and (
                not trace.probe.get(CALLS_UNSEEN)):  # (then the report says why)
            warnings.warn(f"detaudit.watch: the model given ({type(self.model).__name__}) was "
                          "never called in training mode, so no batch was recorded: give "
                          "watch the module your loop calls", stacklevel=2)
        return isinstance(exc, WatchLimit)


_WATCHED: set[int] = set()  # the ids of the models inside a watch block now


class _LeftToExec:
    """What ``with detaudit.watch(...) as w`` gives in a process `detaudit exec` records:
    that recording is the run's, so `w` records nothing (its calls do nothing)."""

    steps = 0

    def step(self, losses: Any = None) -> None:
        pass

    def epoch(self, index: int) -> None:
        pass

    @property
    def trace(self) -> Trace:
        raise DetauditError("this watch records nothing: `detaudit exec` records the run")


def _made_for_another_model(optimizer: Any, model: Any) -> bool:
    """Whether `optimizer`, which updates none of `model`'s parameters, was made for another
    model: it updates tensors of the very shapes and dtypes of `model`'s (an earlier build
    of it, in a notebook), or another live module's. Master copies in another dtype, or
    flattened into buffers, are no other model's."""
    from torch import nn

    from .drivers.attach_models import live_objects, parameters_of

    updated = parameters_of(optimizer)
    mine = {(p.shape, p.dtype) for p in model.parameters()}
    if any((p.shape, p.dtype) in mine for p in updated):
        return True
    ids = {id(p) for p in updated}
    return any(any(id(p) in ids for p in m.parameters(recurse=False))
               for m in live_objects(nn.Module))


def _trains(optimizer: Any, model: Any) -> bool:
    """Whether `optimizer` updates a parameter of `model` (one with no parameters: yes)."""
    from .drivers.attach_models import parameters_of

    owned = {id(p) for p in model.parameters()}
    return not owned or any(id(p) in owned for p in parameters_of(optimizer))


def _free_trace_path(folder: Path) -> Path:
    """The first unused `trace-<n>.json.gz` in `folder`, claimed at once (an empty file)."""
    for n in range(100000):
        path = folder / trace_name(n)
        try:
            path.touch(exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise DetauditError(f"{folder} has no free trace name")
