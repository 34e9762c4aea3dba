"""``detaudit exec``: the user's command run ``--repeats`` times, each a fresh process tree
with recording attached before their code starts (a ``sitecustomize`` on ``PYTHONPATH`` that
acts only when the job variable is set), the runs compared as ``run`` compares its repeats,
and the first divergent step zoomed by running the command again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from .analysis.compare import Comparison
from .analysis.compare import compare as compare_traces
from .analysis.ranks import RankAnalysis, mark_received
from .api import (
    STAGE_NAMES,
    Progress,
    check_fault_seen,
    mark_interrupted,
    mark_stopped,
    needs_zoom,
)
from .attached import Compared, conclude
from .config import (
    CALLS_UNSEEN,
    CLAIM_SUFFIX,
    ENDED,
    EXIT_CALL,
    FAILED_AFTER_UPDATE,
    FAULT_FIRED,
    FAULT_MET_ZEROS,
    FLUSHED_EACH_STEP,
    INFER,
    JOB_VARIABLE,
    LOADED_FROM_EARLIER_RUNS,
    OPS_AT_FAULT,
    OWNER_VARIABLE,
    RANK_OWNER_VARIABLE,
    SCAN,
    SCRIPTED,
    STEPLESS_LOADS,
    STRESS_SECONDS,
    TRAIN,
    AuditConfig,
    ExecJob,
    Fault,
    ProbeSpec,
    fault_not_fired,
    measured_path,
    rank_trace_path,
    written_by_an_earlier_run,
    zoom_outputs,
)
from .drivers.stopping import (
    clear_files,
    dumped_wheres,
    keep_stacks,
    kill_left,
    say_timed_out,
    stop_run,
    wait_watching,
)
from .errors import DetauditError
from .planting import KNOWN_LATER, fault_target
from .runfolder import (
    INTERRUPTED,
    RunFolder,
    RunInfo,
    new_run_id,
    trace_name,
    trace_probe,
    zoom_name,
)
from .trace import PROBE_CONFIG, PROBE_DISTRIBUTED, STATE, AnyTrace, Trace, open_trace
from .words import counted

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"  # holds the sitecustomize
UNATTACHED = ".unattached"  # beside a run's trace: why its Python could not record
STOP_GRACE_S = 10.0  # after Ctrl-C, how long the command has to save its trace


def exec_command(
    command: list[str], job: ExecJob, *, out: str | Path, overwrite: bool = False,
    progress: Progress | None = None, output: Any = None, reproduce: str | None = None,
) -> Compared:
    """Run `command` ``job.repeats`` times with recording attached, compare the runs, write
    the run folder. The command's own output goes to `output` (default: inherited);
    `reproduce` is the detaudit command line the reports give to run it again."""
    progress = progress or Progress()
    if not command:
        raise DetauditError("exec needs a command after --, e.g. detaudit exec -- python train.py")
    if not (BOOTSTRAP / "sitecustomize.py").is_file():
        raise DetauditError(
            f"this detaudit install lacks {BOOTSTRAP / 'sitecustomize.py'}, which exec puts on "
            "PYTHONPATH to attach to the command: reinstall detaudit")
    if job.repeats < 1 or (job.max_steps or 1) < 1 or (job.max_epochs or 1) < 1:
        raise DetauditError("--repeats, --max-steps and --max-epochs must be at least 1")
    if job.fault is not None and job.max_steps is not None and job.fault.step >= job.max_steps:
        raise DetauditError(
            f"--inject-fault plants at step {job.fault.step}, past --max-steps {job.max_steps} "
            f"(steps 0 to {job.max_steps - 1})")
    _note_a_long_temporary_folder()
    run_id = new_run_id()
    config = AuditConfig(repeats=job.repeats, epochs=job.max_epochs or 1, steps=job.max_steps,
                         seed=job.seed or 0, granularity=SCAN, stress=job.stress,
                         stress_every_op=job.stress_every_op, fault=job.fault)
    spec = ProbeSpec("command", Path(command[0]).name if len(command) == 1 else
                     _script_name(command), source=_shell_line(command))
    limits = ", ".join(f"{flag} {v}" for flag, v in (("--max-steps", job.max_steps),
                       ("--max-epochs", job.max_epochs)) if v) or "to its end"
    seeded = f"seed {job.seed}" if job.seed is not None else "no --seed"
    info = RunInfo(probe={**spec.to_dict(), "preset": f"exec: {counted(job.repeats, 'run')}, {limits}, "
                          f"{seeded}"}, config=_exec_config(config, job.seed),
                   command=reproduce or f"detaudit exec -- {_shell_line(command)}", traces=[],
                   run_id=run_id, state="recording")
    stdin = _repeated_stdin()
    with RunFolder(out, info, overwrite) as folder:
        runs: list[Recorded] = []
        try:
            timings = []
            progress.start(job.repeats, "run", f"exec: {spec.source}")
            probe = trace_probe(spec, config, run_id)
            since_ns = time.time_ns()  # (a file written after this, a run of this audit wrote)
            for repeat in range(job.repeats):
                recorded, timing = _run_once(
                    command, job, folder.path, repeat, probe, output, stdin=stdin,
                    since_ns=since_ns, stepped_before=any(
                        t.steps for run in runs for t in run.values()),
                    like=runs[0] if runs else None, on_steps=_shown_as(
                        progress, f"run {repeat + 1}/{job.repeats}: ", job.max_steps))
                if runs and (None in recorded) != (None in runs[0]):
                    raise DetauditError(
                        f"repeat {repeat} recorded {_what(recorded)} and repeat 0 "
                        f"{_what(runs[0])}: the command must start its ranks the same way "
                        "every time")
                runs.append(recorded)
                timings.append(timing)
                # a run that failed before its first step leaves no step to compare: the
                # verdict is FAILED whatever the other runs do, so they are not run
                unstarted = repeat < job.repeats - 1 and all(
                    t.failure and not t.steps for t in recorded.values())
                others = ("repeat 1 was" if job.repeats == 2
                          else f"repeats 1 to {job.repeats - 1} were")
                for trace in recorded.values() if unstarted else ():
                    trace.failure += f"; {others} not run (no step to compare)"
                for rank, trace in recorded.items():
                    folder.add_trace(trace, timing if rank == min(recorded, key=_rank_order)
                                     else None, rank)
                _clear_attached(folder.path, repeat)
                if job.fault is not None and repeat < job.repeats - 1:
                    job = replace(job, fault=_check_fault_target(job.fault, recorded))
                steps = len(next(iter(recorded.values())).steps)
                progress.advance(f"run {repeat + 1}/{job.repeats}: {steps} steps"
                                 f"{f' on {len(recorded)} ranks' if None not in recorded else ''}")
                if unstarted:
                    break
            progress.close()
            config = replace(config, fault=job.fault)  # (named as planted: see above)
            ranks = _rank_analysis(runs, command) if None not in runs[0] else None
            primary = None if ranks is None else ranks.primary_rank
            traces = _of_rank(runs, primary)
            comparison = compare_traces(traces)
            check_fault_seen(job.fault, comparison)
            # what the command did, not the stand-ins its traces' configuration holds
            folder.info.config.update(mode=_mode_of(traces), seed=job.seed, deterministic=bool(
                traces[0].env.get("deterministic_algorithms")), epochs=max(
                (t.steps[-1].epoch + 1 for t in traces if t.steps), default=0))
            if ranks is not None:  # the primary rank's repeats, as compared across ranks
                comparison.failures.update({t.repeat: t.failure for t in traces if t.failure})
                folder.info.extra["ranks"] = ranks.to_dict()
                folder.info.traces = [trace_name(t.repeat, primary) for t in traces]
            zoomed = None
            # (a repeat that failed later does not stop it: see api._zoom)
            if job.zoom and comparison.first_step is not None and needs_zoom(comparison):
                folder.set_state(f"investigating: {STAGE_NAMES['zoom']}")
                progress.stage("zoom")
                zoomed, zoomed_rank = _zoom_command(command, job, folder, probe, comparison,
                                                    config, spec, output, primary, stdin,
                                                    since_ns, progress, ranks)
                if ranks is not None and zoomed_rank[0] != primary:
                    # the step parted first on another rank: the ranks after it received it
                    primary, later = zoomed_rank
                    traces = _of_rank(runs, primary)
                    comparison = compare_traces(traces)
                    comparison.failures.update({t.repeat: t.failure for t in traces if t.failure})
                    mark_received(ranks, primary, later)
                    folder.info.extra["ranks"] = ranks.to_dict()
                    folder.info.traces = [trace_name(t.repeat, primary) for t in traces]
        except KeyboardInterrupt:
            _keep_partial(folder, len(runs))
            mark_interrupted(folder)
            raise
        except BaseException as exc:
            mark_stopped(folder, exc)
            raise
        return conclude(traces, info, folder, timings, zoomed, ranks, comparison)


def _furthest_upstream(runs: list[Recorded], step: int, ranks: RankAnalysis, rank: int,
                       idle_rng: Iterable[str]) -> tuple[int, list[int]]:
    """Of the ranks of a tensor-parallel model (collectives in forward) that part at `step`
    with nothing of their own differing as it began (their loss first: see
    analysis.ranks._started), the one whose replays of `step` part
    first in the order of its records (the ranks of one program record the same calls in
    the same order): where the difference began, the ranks parting further on receiving it
    through a collective (a tensor-parallel layer's all-reduce in forward). Returns that
    rank (`rank` where none parts sooner) and those."""
    from .analysis.ranks import NO_PROCESS_GROUP

    candidates = [row.rank for row in ranks.per_rank
                  if row.first_step == step and row.source == "local" and row.phase != STATE]
    forward_collectives = any(  # (DDP's all-reduce is in backward: its losses are their own)
        (t.probe.get(PROBE_DISTRIBUTED) or {}).get("tensor_parallel") for t in runs[0].values())
    if (ranks.backend == NO_PROCESS_GROUP or not forward_collectives or len(candidates) < 2
            or rank not in candidates):
        return rank, []

    def position(r: int) -> float:
        traces = _of_rank(runs, r)
        zoomed = compare_traces(traces, idle_rng) if len(traces) > 1 else None
        cut = dict(traces[0].by_step()).get(step) if traces else None
        if zoomed is None or zoomed.first_step != step or not zoomed.first_diffs or cut is None:
            return float("inf")
        first, r0 = zoomed.first_diffs[0].key[1:], cut.records
        keys = zip(r0["phase"], r0["module"], r0["call"], r0["slot"])
        return next((i for i, key in enumerate(keys) if key == first), float("inf"))

    positions = {r: position(r) for r in candidates}
    source = min(candidates, key=lambda r: (positions[r], r != rank, r))
    if positions[source] == float("inf"):
        return rank, []
    return source, [r for r in candidates if positions[r] > positions[source]]


def _mode_of(traces: list[AnyTrace]) -> str:
    """What the runs recorded: inference (a step per call of the model) or training."""
    return INFER if any(t.probe.get(PROBE_CONFIG, {}).get("mode") == INFER for t in traces) else TRAIN


Recorded = dict[Optional[int], AnyTrace]  # rank (None: the command's own process) -> its trace


def _rank_order(rank: int | None) -> int:
    return -1 if rank is None else rank


def _what(recorded: Recorded) -> str:
    return "one process" if None in recorded else f"{len(recorded)} ranks"


def _of_rank(runs: list[Recorded], rank: int | None) -> list[Trace]:
    """Each run's trace of `rank` (None: of the command's own process)."""
    return [run[rank] for run in runs if rank in run]


def _rank_analysis(runs: list[Recorded], command: list[str]) -> RankAnalysis:
    """Every rank's repeats compared run to run, and every repeat's ranks with each other
    (the checks of ``run --nproc``)."""
    from .analysis.ranks import analyse, compare_ranks

    by_rank: dict[int, list[Trace]] = {}
    for run in runs:
        for rank, trace in sorted(run.items()):
            by_rank.setdefault(rank, []).append(trace)
    analysis = analyse(by_rank, compare_ranks(by_rank))
    analysis.launch = _shell_line(command)
    analysis.traces = {str(r): [trace_name(t.repeat, r) for t in ts] for r, ts in by_rank.items()}
    return analysis


def _keep_partial(folder: RunFolder, repeat: int) -> None:
    """The run that was interrupted joins the folder with what it (or each rank) recorded;
    a zoom's replay is dropped (its step is the scan's, which the folder keeps)."""
    if folder.info.state.startswith("investigating"):
        for path in folder.path.glob(_attach_name("*")):
            for left in (path, *zoom_outputs(path)):
                left.unlink(missing_ok=True)
        return
    for rank, trace in _recorded(folder.path / _attach_name(repeat)).items():
        trace.failure = trace.failure or INTERRUPTED
        folder.add_trace(trace, None, rank)
    _clear_attached(folder.path, repeat)


def _recorded(path: Path) -> Recorded:
    """What one run of the command left: the traces of its ranks (see
    :func:`detaudit.config.rank_trace_path`) or, when it started none, its own."""
    stem = path.name.removesuffix(".json.gz")
    ranks = {}
    for found in path.parent.glob(f"{stem}-r*.json.gz"):
        rank = found.name[len(stem) + 2:-len(".json.gz")]
        if rank.isdigit():
            ranks[int(rank)] = open_trace(found)
    if ranks:
        return dict(sorted(ranks.items()))
    return {None: open_trace(path)} if path.exists() else {}


def _clear_stepless(path: Path) -> None:
    """The notes of files loaded by processes of a run that made no step (see
    STEPLESS_LOADS), beside the run's trace or each rank's."""
    stem = path.name.removesuffix(".json.gz")
    for note in path.parent.glob(f"{stem}*{STEPLESS_LOADS}"):
        note.unlink(missing_ok=True)


def _clear_attached(folder: Path, repeat: int) -> None:
    """The command's own trace files of one run (and what a zoom replay left beside them
    for the audit), once the folder holds them."""
    stem = _attach_name(repeat).removesuffix(".json.gz")
    for path in [folder / _attach_name(repeat), *folder.glob(f"{stem}-r*.json.gz")]:
        for left in (path, *zoom_outputs(path)):
            left.unlink(missing_ok=True)


def _measured(folder: Path, repeat: int, rank: int | None
              ) -> dict[tuple[str, str, int, str], dict[str, Any] | None]:
    """How far the op outputs one zoom replay kept (of `rank`'s process) are from the first
    run's, by op key (see measured_path): {} for the first run, or where they cannot be
    read."""
    trace = folder.absolute() / _attach_name(repeat)
    path = measured_path(trace if rank is None else rank_trace_path(trace, rank))
    try:
        return {tuple(key): found for key, found in json.loads(path.read_text())}
    except (OSError, ValueError, TypeError):  # a measurement forgone, not the verdict's
        return {}


def _zoom_command(
    command: list[str], job: ExecJob, folder: RunFolder, probe: dict[str, Any],
    comparison: Comparison, config: AuditConfig, spec: ProbeSpec, output: Any,
    rank: int | None = None, stdin: Any = None, since_ns: int | None = None,
    progress: Progress | None = None, ranks: RankAnalysis | None = None,
) -> tuple[Comparison | None, tuple[int | None, list[int]]]:
    """Run the command again, each run recording the first divergent step at module and op
    level (the scan runs before it must agree again: if a run parts earlier, the zoom moves
    there; a step that does not part again is retried, then called intermittent). Returns
    the zoomed comparison, the rank it details (of `ranks`, the one where the replayed step
    parts furthest upstream, see _furthest_upstream; `rank` if none sooner) and the ranks
    that received the difference from it."""
    from .investigate.drilldown import Measured, drill_down
    from .investigate.zoom import zoom_by_replay

    zoomed_rank: tuple[int | None, list[int]] = (rank, [])
    measured: Measured = []  # per run: see measured_path

    def replay(step: int) -> list[AnyTrace]:
        # a fault planted after the step (a real divergence came first) is not reached
        planted = job.fault if job.fault is not None and job.fault.step <= step else None
        shown = progress or Progress()
        shown.start(job.repeats, "run", f"zoom: step {step}, module and op level")
        runs = []
        for r in range(job.repeats):
            run = f"zoom: step {step}, run {r + 1}/{job.repeats}: "
            detailed = f"{run}recording step {step} at module and op level"
            shown.status(detailed if step == 0 else f"{run}replaying the steps before it")
            runs.append(_run_once(
                command, replace(job, max_steps=step + 1, fault=planted), folder.path, r,
                probe, output, zoom=step, stdin=stdin, since_ns=since_ns,
                on_steps=lambda ended, run=run, detailed=detailed: shown.status(
                    detailed if ended >= step else f"{run}{ended}/{step} steps replayed"))[0])
            shown.advance(f"zoom: step {step}, run {r + 1}/{job.repeats} replayed")
        shown.close()
        nonlocal zoomed_rank
        if ranks is not None and rank is not None:
            zoomed_rank = _furthest_upstream(runs, step, ranks, rank, comparison.idle_rng)
        replayed = _of_rank(runs, zoomed_rank[0])
        measured[:] = [_measured(folder.path, r, zoomed_rank[0]) for r in range(job.repeats)]
        for trace in replayed:
            folder.add_zoom_trace(trace)  # moved out of the command's own files, cleared next
        for r in range(job.repeats):
            _clear_attached(folder.path, r)
        return replayed

    def drill(zoomed: Comparison, traces: list[Trace]) -> dict[str, Any] | None:
        return drill_down(None, replace(config, granularity="module"), zoomed, spec, traces,
                          measured=measured if len(measured) == len(traces) else None)

    found, traces = zoom_by_replay(comparison, replay, drill, job.zoom_tries)
    if not traces:  # intermittent: the replays kept nothing to list
        for path in folder.path.glob(zoom_name("*")):
            path.unlink()
    ops = found.pop("ops")
    if ops is not None:
        folder.info.extra["ops"] = ops
    for trace in traces:
        folder.add_zoom_trace(trace)
    if traces:
        found["traces"] = [zoom_name(t.repeat) for t in traces]
    folder.info.extra["zoom"] = found
    folder.save()
    return (compare_traces(traces, comparison.idle_rng) if traces else None), zoomed_rank


def _shown_as(progress: Progress, run: str, max_steps: int | None) -> Callable[[int], None]:
    """What shows a run's steps as they end, after `run` (which run it is)."""
    return lambda ended: progress.status(
        f"{run}{ended}{f'/{max_steps}' if max_steps else ''} steps")


@dataclass
class _Rewound:
    """Standard input from a file, inherited by each run from where the first began."""

    offset: int


# what a DataLoader worker adds to the temporary folder for the socket it sends a batch's
# shared memory through (pymp-XXXXXXXX/listener-XXXXXXXX), and the longest path a socket takes
_SOCKET_IN_TEMPORARY_FOLDER, _SOCKET_PATH_MAX = 32, 107


def _exec_config(config: AuditConfig, seed: int | None) -> dict[str, Any]:
    """The run's configuration as its reports show it: the seed as given (None: not seeded
    by detaudit), and no device (the command puts its model where it chooses, and the
    traces say where)."""
    data = {**config.to_dict(), "seed": seed}
    del data["device"]
    return data


def _note_a_long_temporary_folder() -> None:
    """A temporary folder whose path leaves too little room for a DataLoader worker's socket
    makes every batch a worker sends fail (``AF_UNIX path too long``, printed by the worker)
    and the loop wait forever for it: said before the command runs, which would hang with or
    without detaudit."""
    folder = tempfile.gettempdir()
    if len(os.fsencode(folder)) + _SOCKET_IN_TEMPORARY_FOLDER > _SOCKET_PATH_MAX:
        print(f"detaudit: note: the temporary folder {folder} is a long path: a DataLoader "
              "worker's socket there would pass the 107 bytes a socket path may have, and "
              "a loop whose workers send it batches would wait for them forever (set TMPDIR "
              "to a shorter folder)", file=sys.stderr)


def _repeated_stdin() -> Any:
    """What each run of the command reads as its standard input: the same in every run. A
    terminal is shared; a file is inherited, rewound before each run; a pipe (which only
    the first run would read) is given to none, and said so."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:  # no standard input
        return subprocess.DEVNULL
    if os.isatty(0):
        return None
    if stat.S_ISREG(mode):
        return _Rewound(os.lseek(0, 0, os.SEEK_CUR))
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        print("detaudit: note: the command's standard input is a pipe, which only one run "
              "could read: every run reads an empty input", file=sys.stderr)
    return subprocess.DEVNULL


def _run_once(command: list[str], job: ExecJob, folder: Path, repeat: int,
              probe: dict[str, Any], output: Any, zoom: int | None = None, stdin: Any = None,
              since_ns: int | None = None, stepped_before: bool = False,
              like: Recorded | None = None, on_steps: Callable[[int], None] | None = None,
              ) -> tuple[Recorded, dict[str, Any]]:
    """One run of the command in its own process group; its trace, or each rank's. `stdin`:
    its standard input (see _repeated_stdin), read from the start; `since_ns`: when the
    audit began (the run notes the files it loads that an earlier run wrote). A run that
    ends (exit 0) before its first step after an earlier run made steps is a run of no
    steps, compared with the others (a script that resumed from what an earlier run saved,
    with nothing left to train), not an error. `like`: what the first run recorded (its
    ranks), which one stopped for its step timeout before recording anything stands as.
    `on_steps` is given the steps the run ended, as they end (see wait_watching)."""
    path = folder.absolute() / _attach_name(repeat)  # (the command may change directory)
    fault = job.fault if job.fault is not None and repeat == job.repeats - 1 else None
    began_ns = time.time_ns()
    env = dict(os.environ)
    env.pop(OWNER_VARIABLE, None)
    env.pop(RANK_OWNER_VARIABLE, None)
    env[JOB_VARIABLE] = json.dumps({
        "trace": str(path), "probe": probe, "repeat": repeat, "seed": job.seed,
        "max_steps": job.max_steps, "max_epochs": job.max_epochs, "zoom": zoom,
        "fault": asdict(fault) if fault is not None else None,
        "planted_step": job.fault.step if job.fault is not None else None, "mode": job.mode,
        "launcher": _is_launcher(command), "since_ns": since_ns, "began_ns": began_ns,
        # the first run proves its risky ops by re-execution (a race its repeats missed)
        "stress": job.stress if repeat == 0 and zoom is None else 0,
        "stress_every_op": job.stress_every_op,
        "step_timeout": job.step_timeout,
        # the first run checks the fault the last plants (see Attachment.check_fault)
        "check_fault": asdict(job.fault) if job.fault is not None and repeat == 0
        and zoom is None and job.repeats > 1 else None,
        # a zoom replay keeps the outputs of the planted op (and of risky ops), to measure
        "keep_planted": asdict(job.fault) if job.fault is not None and zoom is not None
        else None,
        # ... and measures them against the first run's replay's (see measured_path)
        "measure_against": str(folder.absolute() / _attach_name(0))
        if zoom is not None and repeat > 0 else None,
    })
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BOOTSTRAP), env.get("PYTHONPATH")]))
    if job.seed is not None:
        env.setdefault("PYTHONHASHSEED", str(job.seed % 2**32))
    _claimant(path)  # (a claim an earlier run left, killed before it was read)
    _clear_stepless(path)  # (what a killed audit left in the folder)
    clear_files(path)
    stem = _attach_name(repeat).removesuffix(".json.gz")
    for left in [*zoom_outputs(path), *(found for kept in zoom_outputs(f"{stem}-r*.json.gz")
                                         for found in folder.glob(kept.name))]:
        left.unlink(missing_ok=True)  # (the same: never paired with this run's trace)
    started = time.perf_counter()
    try:
        if isinstance(stdin, _Rewound):
            os.lseek(0, stdin.offset, os.SEEK_SET)
        child = subprocess.Popen(command, env=env, start_new_session=True, stdout=output,
                                 stdin=None if isinstance(stdin, _Rewound) else stdin)
    except OSError as exc:  # not found, not executable, no interpreter line (ENOEXEC), ...
        raise DetauditError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    try:
        code, timed_out = wait_watching(child, path, job.step_timeout, STOP_GRACE_S,
                                        on_steps)
    except KeyboardInterrupt:  # the command saves its trace on SIGTERM, then ends
        stop_run(child, path, STOP_GRACE_S)
        clear_files(path)
        raise
    finally:
        kill_left(child, path)
        claimed_by = _claimant(path)  # (and cleared for the next run, interrupted or not)
    seconds = time.perf_counter() - started
    stacks = keep_stacks(path, str(repeat) if zoom is None else f"zoom-{repeat}") \
        if timed_out else None
    wheres = dumped_wheres(path) if timed_out else {}
    clear_files(path)
    recorded = _recorded(path)
    if timed_out:  # (a run that recorded nothing stands as the run before it: its ranks)
        stand_ins = {} if recorded else {
            rank: Trace(probe={**(like[rank].probe if like else probe), ENDED: True},
                        repeat=repeat, env={}) for rank in (like or {None: None})}
        say_timed_out(recorded, timed_out, job.step_timeout, STOP_GRACE_S, stand_ins, wheres)
    if None not in recorded and recorded and path.exists() and open_trace(path).steps:
        raise DetauditError(
            f"repeat {repeat} recorded ranks ({', '.join(map(str, sorted(recorded)))}) and a "
            "process of no rank that trained: a rank of their process group that detaudit "
            "did not see join it (please report this, with how the ranks are started)")
    unattached = path.with_name(path.name + UNATTACHED)  # (written by the bootstrap)
    if not recorded and unattached.exists():
        said = unattached.read_text(errors="replace").strip()
        unattached.unlink()
        raise DetauditError(
            f"repeat {repeat}: {_shell_line(command)!r} ran unaudited: {said}; run it with "
            f"the Python detaudit is installed in, e.g. detaudit exec -- {sys.executable} "
            "SCRIPT.py")
    unattached.unlink(missing_ok=True)  # (a child's, a Python of another tool: not the run's)
    stepless = path.with_name(path.name + STEPLESS_LOADS)
    loaded = list(dict.fromkeys(stepless.read_text().splitlines())) if stepless.exists() else []
    _clear_stepless(path)
    if not recorded and code == 0 and stepped_before and claimed_by is None:
        recorded = {None: Trace(probe={**probe, ENDED: True, **(
            {LOADED_FROM_EARLIER_RUNS: loaded} if loaded else {})}, repeat=repeat, env={})}
    if not recorded and code != 0 and claimed_by is None:
        raise DetauditError(
            f"repeat {repeat}: {_shell_line(command)!r} exited with code {code} before its "
            "first step, and nothing was recorded: the command failed (its own output above "
            "says why; it records in a Python that has detaudit and torch installed, as "
            f"{sys.executable} does)")
    if not recorded:
        how = "ended" if code == 0 else f"exited with code {code}"
        raise DetauditError(
            f"repeat {repeat}: {_shell_line(command)!r} {how} before its first step ("
            + ("no optimizer step was seen, and --mode train takes nothing else for a step"
               if job.mode == TRAIN else
               "no optimizer step and no call of a model was seen" if job.mode == INFER else
               "no optimizer step was seen, nor a model called for inference: a call in "
               "training mode with gradients on, or in a script that builds an optimizer, is "
               "no inference step; --mode infer takes every top-level call of the model for a "
               "step")
            + ("; the process of the command that trains records (the first to begin a step)"
               f", in a Python that has detaudit installed, as {sys.executable} does"
               if claimed_by is None else f"; {claimed_by!r} began one and left no trace: "
               "killed before it saved?")
            + ")"
        )
    for trace in recorded.values():
        at_limit = (job.max_steps is not None and len(trace.steps) >= job.max_steps) or (
            job.max_epochs is not None and trace.steps
            and trace.steps[-1].epoch + 1 >= job.max_epochs)
        how = "ended" if code == 0 else f"exited with code {code}"
        if trace.failure is not None:  # the command's own error: where in the run it came
            after = trace.probe.get(FAILED_AFTER_UPDATE)
            trace.failure += (
                f" (after step {after}'s update, before that step ended: " if after is not None
                else " (") + (f"the last step it completed: {len(trace.steps) - 1})"
                              if trace.steps else "before its first step completed)")
            written = _written_by_earlier_runs(trace.failure, since_ns, began_ns)
            named = {os.path.realpath(f) for f in written}  # (a load through a link: its file)
            loaded = [f for f in trace.probe.get(LOADED_FROM_EARLIER_RUNS, ())
                      if os.path.realpath(f) not in named]
            if written:
                trace.failure += (f"; {', '.join(written)} named there "
                                  f"{'was' if len(written) == 1 else 'were'} written by an "
                                  "earlier run of this audit (each run is the command as it "
                                  "is, writing where the one before wrote)")
            if loaded:  # (a run that resumed from what the one before saved, then failed)
                trace.failure += (f"; it loaded {', '.join(loaded)}, written by an earlier "
                                  "run of this audit (a checkpoint it resumed from?)")
        elif trace.probe.get(ENDED) is False:
            # os._exit, or a signal no handler sees (SIGKILL): the steps since the last save
            # are lost, so the trace is short of what ran, not different from the others'
            # (no mark at all: a detaudit in the command's Python that does not mark it)
            saved = f"after step {len(trace.steps) - 1}, the last step saved"
            trace.failure = (
                f"the recording process, a worker the command's launcher started, ended "
                f"without detaudit's exit hook running (its launcher ends its workers so, as "
                f"Ray does) {saved}; the step it was in is lost (the command {how}; with "
                "--max-steps K each run ends cleanly at step K)"
                if code == 0 and trace.probe.get(FLUSHED_EACH_STEP) else
                f"the command {how} without detaudit's exit hook running (os._exit, or "
                f"killed) {saved}; the steps after it are lost")
        elif code != 0 and not at_limit:
            trace.failure = f"the command {how} after step {len(trace.steps) - 1}" + (
                f" ({trace.probe[EXIT_CALL]})" if trace.probe.get(EXIT_CALL) else "")
        if stacks is not None and trace.failure is not None:
            trace.failure += f"; the stacks of its threads: {stacks.name}"
    if fault is not None and not any(t.probe.get(FAULT_FIRED) for t in recorded.values()) \
            and not any(t.failure for t in recorded.values()):
        steps = max(len(t.steps) for t in recorded.values())
        scripted = next((t.probe[SCRIPTED] for t in recorded.values() if SCRIPTED in t.probe), [])
        ran = {op for t in recorded.values() for op in t.probe.get(OPS_AT_FAULT, ())}
        zeros = any(t.probe.get(FAULT_MET_ZEROS) for t in recorded.values())
        raise DetauditError(
            "the planted fault never fired: "
            + fault_not_fired(fault, steps, scripted, ran, zeros)
            + ("; the model runs inside a compiled function, whose first step runs compiled "
               "before detaudit knows the model: plant at step 1 or later"
               if fault.step == 0 and any(t.probe.get(CALLS_UNSEEN) for t in recorded.values())
               else f"; {KNOWN_LATER}" if fault.step == 0 else "")
        )
    timing = {"repeat": repeat, "seconds": seconds,
              "steps": max(len(t.steps) for t in recorded.values()), "exit_code": code}
    stressed = [t.probe[STRESS_SECONDS] for t in recorded.values() if STRESS_SECONDS in t.probe]
    if stressed:  # (its ranks re-execute side by side)
        timing["stress_seconds"] = max(stressed)
    return recorded, timing


def _written_by_earlier_runs(text: str, since_ns: int | None, began_ns: int) -> list[str]:
    """The paths a failure's message names (as words: a folder, a file) that a run of the
    audit before this one wrote: what a script refuses to write over (Ignite's
    ModelCheckpoint, an output folder that must be empty)."""
    if since_ns is None:
        return []
    written = []
    for word in dict.fromkeys(re.findall(r"[\w./~-]*[\w~]", text)):
        with contextlib.suppress(OSError, ValueError):
            if written_by_an_earlier_run(os.path.expanduser(word), since_ns, began_ns):
                written.append(word)
    return written[:3]


def _check_fault_target(fault: Fault, recorded: Recorded) -> Fault:
    """After a run without the fault (it goes into the last): the fault to plant, checked
    against the first rank's trace (see planting.fault_target)."""
    return fault_target(fault, recorded[min(recorded, key=_rank_order)])


def _is_launcher(command: list[str]) -> bool:
    """Whether the command is a Python launcher that trains nothing itself and starts the
    script in a child process with no rank set (``accelerate launch`` on one process):
    that child records, not the launcher (launchers that set ranks, torchrun, need not)."""
    names = [os.path.basename(part) for part in command[:6]]  # (after `uv run`, `env`, ...)
    script = next((i for i, name in enumerate(names) if name.endswith(".py")), len(names))
    return "accelerate-launch" in names[:script] or any(
        names[i:i + 2] in (["accelerate", "launch"], ["-m", "accelerate.commands.launch"])
        for i in range(script))


def _claimant(trace: Path) -> str | None:
    """The command line of the process that claimed `trace` (see
    attach_process._first_to_claim), if one did; the claim is cleared for the next run."""
    claim = trace.with_name(trace.name + CLAIM_SUFFIX)
    try:
        said = claim.read_text(errors="replace").splitlines()
    except OSError:
        return None
    claim.unlink(missing_ok=True)
    return said[1] if len(said) > 1 else None


def _attach_name(repeat: int | str) -> str:
    return f"attach-{repeat}.json.gz"


def _script_name(command: list[str]) -> str:
    """A short name for the command: its script or module (``train.py``, ``pkg.train``),
    also inside a shell's command line (``bash -c "cd detr && python main.py"``)."""
    import shlex

    for i, part in enumerate(command[1:], 1):
        if command[i - 1] == "-m":
            return part
        if command[i - 1] == "-c" and Path(command[0]).name in _SHELLS:
            with contextlib.suppress(ValueError):  # (unbalanced quotes: the shell's to say)
                inner = _script_name(["sh", *shlex.split(part)])
                if inner != "sh":
                    return inner
        if part.endswith(".py"):
            return Path(part).name
    return Path(command[0]).name


_SHELLS = {"sh", "bash", "dash", "zsh", "ksh"}


def _shell_line(command: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in command)
