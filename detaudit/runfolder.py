"""A run folder and a baseline file: what detaudit saves, under which names, in which format.

A run folder holds the traces of every repeat plus ``run.json`` (what was run, timings,
investigations, meta). A baseline is one repeat's trace plus what reproduces it. Everything
after recording (comparison, reports, baselines) reads these files, never a model: a run
saved today can be compared and rendered later, on another machine.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import re
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .config import AuditConfig, ProbeSpec
from .errors import DetauditError, TraceError
from .storage import atomic_write, check_format, describe, dump_json, jsonable, read_json
from .trace import (
    PROBE_CONFIG,
    PROBE_RECORD_SET,
    PROBE_RUN,
    PROBE_SPEC,
    RECORD_SET,
    AnyTrace,
    Trace,
    TraceFile,
    holds_steps,
    is_streamed_trace,
    open_trace,
)

# History:
#   1: first format.
RUN_FORMAT_VERSION = 1
RUN_FORMAT = "detaudit-run"
RUN_FILE = "run.json"
LOCK_FILE = ".detaudit.lock"
# What a run leaves in its folder (removed by --overwrite before a new run starts).
RUN_FILES = ("run.json", "summary.json", "report.md", "report.html", "report.github.html",
             "launch.log", "trace-*.json.gz", "zoom-*.json.gz", "timing-*.json", "job-*.json",
             "rank-*.json", "attach-*.json.gz", "attach-*.kept.pt", "attach-*.measured.json",
             "partial-*.json.gz", "*.part")
COMPLETE = "complete"  # the state of a run that ran to its end
INTERRUPTED = "interrupted (Ctrl-C or SIGTERM)"  # the failure of a repeat cut short
# a run stopped by bad input found once recording had begun (a planted fault that never
# fired): the state of its run.json begins so
REFUSED = "refused"
# the key in run.json's extra of a run refused for its fault (errors.FaultRefused): what it
# recorded served only to try that fault, and the next command may take its folder
FAULT_REFUSED = "fault_refused"
# History:
#   1: first format: probe description, audit config, environment, the trace of repeat 0.
BASELINE_VERSION = 1
BASELINE_FORMAT = "detaudit-baseline"


def trace_name(repeat: int | str, rank: int | str | None = None) -> str:
    """The file name of one repeat's trace (of one rank, in a distributed audit); "*" globs."""
    return f"trace-{repeat}.json.gz" if rank is None else f"trace-r{rank}-{repeat}.json.gz"


def zoom_name(repeat: int | str) -> str:
    """The file name of one repeat's zoomed trace (module and op level at the zoomed step)."""
    return f"zoom-{repeat}.json.gz"


def timing_name(repeat: int | str, rank: int | str | None = None) -> str:
    """The file a repeat run in another process leaves its timing in."""
    return f"timing-{repeat}.json" if rank is None else f"timing-r{rank}-{repeat}.json"


def trace_probe(spec: ProbeSpec | None, config: AuditConfig, run_id: str = "") -> dict[str, Any]:
    """What a trace says about its probe, its configuration and the run it belongs to."""
    probe = {PROBE_SPEC: spec.to_dict() if spec else {}, PROBE_CONFIG: config.to_dict(),
             PROBE_RECORD_SET: RECORD_SET}
    if run_id:
        probe[PROBE_RUN] = run_id
    return probe


def failed_trace(
    spec: ProbeSpec | None, config: AuditConfig, repeat: int, why: str, run_id: str = ""
) -> Trace:
    """The trace of a repeat that left none (its process crashed): no records, a failure."""
    return Trace(probe=trace_probe(spec, config, run_id), repeat=repeat, env={}, failure=why)


def partial_path(path: Path) -> Path:
    """The name a trace file has while its repeat runs: it takes its own name only once the
    repeat has ended, so a trace under its own name is never one a crash or Ctrl-C cut."""
    return path.with_name(f"partial-{path.name}")


def save_crashed(
    folder: str | Path, spec: ProbeSpec | None, config: AuditConfig, repeat: int, why: str,
    run_id: str = "", rank: int | None = None,
) -> AnyTrace:
    """Save the trace of a repeat that crashed in another process under its own name: what it
    streamed before the crash (see :func:`partial_path`), or no records if it flushed none;
    its failure is `why`."""
    kept = keep_partial(folder, repeat, rank, why)
    if kept is not None:
        return kept
    trace = failed_trace(spec, config, repeat, why, run_id)
    save_trace(folder, trace, rank)
    return trace


def keep_partial(folder: str | Path, repeat: int, rank: int | None, why: str
                 ) -> AnyTrace | None:
    """A repeat's streamed trace (see :func:`partial_path`) saved under its own name, its
    failure `why`; None when it flushed nothing (or not even that much was written)."""
    partial = partial_path(Path(folder) / trace_name(repeat, rank))
    try:
        trace: AnyTrace = open_trace(partial)
    except TraceError:
        return None
    trace.failure = why
    save_trace(folder, trace, rank)
    partial.unlink(missing_ok=True)
    return trace


def save_trace(folder: str | Path, trace: AnyTrace, rank: int | None = None) -> Path:
    """Write `trace` into `folder` under its repeat's (and rank's) name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return trace.save(folder / trace_name(trace.repeat, rank))


@dataclass
class RunInfo:
    """What a run folder says about its run (the volatile parts live in `meta`)."""

    probe: dict[str, Any]  # the ProbeSpec as a dict, plus the preset line
    config: dict[str, Any]  # AuditConfig.to_dict()
    command: str  # a command line that reproduces the run
    traces: list[str]  # file names, by repeat
    timings: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # investigations, ranks
    meta: dict[str, Any] = field(default_factory=dict)  # created, host: never compared
    run_id: str = ""  # this run's id; a folder whose traces carry another is mixed
    state: str = COMPLETE  # recording, investigating: <stage>, interrupted during <stage>

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON plain data (non-finite numbers as strings)."""
        return jsonable({"format": RUN_FORMAT, "version": RUN_FORMAT_VERSION, **asdict(self)})


def save_run(folder: str | Path, info: RunInfo) -> Path:
    """Write ``run.json`` into `folder` (the traces are saved as each repeat finishes)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    info.meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    info.meta.setdefault("host", platform.node())
    return atomic_write(folder / RUN_FILE, dump_json(info.to_dict(), indent=1))


def load_run(folder: str | Path) -> tuple[RunInfo, list[AnyTrace]]:
    """Read a run folder; any missing or damaged file is one clear error naming it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(f"{folder} is not a run folder ("
                         + ("a file" if folder.exists() else "no such directory") + ")")
    path = folder / RUN_FILE
    if not path.exists():
        raise TraceError(f"{path} is missing: {folder} is not a detaudit run folder")
    data = check_format(read_json(path, "run file"), RUN_FORMAT, RUN_FORMAT_VERSION, str(path),
                        "upgrade detaudit or re-run the audit")
    info = _run_info(data, path)
    if not info.complete:
        info.traces += _unlisted_traces(folder, info)
    traces = [open_trace(folder / name) for name in info.traces]
    if not traces:
        raise TraceError(f"{path} lists no traces (the run ended before its first repeat did)")
    mixed = [name for name, t in zip(info.traces, traces)
             if info.run_id and t.probe.get(PROBE_RUN, info.run_id) != info.run_id]
    if mixed:
        raise TraceError(f"{folder} mixes runs: {', '.join(mixed)} "
                         f"{'belongs' if len(mixed) == 1 else 'belong'} to another run than "
                         f"{RUN_FILE}; re-run the audit into an empty folder")
    return info, traces


def _unlisted_traces(folder: Path, info: RunInfo) -> list[str]:
    """The complete traces of an unfinished run that its run.json does not list yet: a
    repeat's trace takes its own name a moment before run.json lists it, and a run killed in
    between (or while a repeat's own process went on) would otherwise lose it. Only traces
    of this run, named as the listed ones are (the same rank), in repeat order."""
    listed = [_TRACE_NAME.fullmatch(name) for name in info.traces]
    ranks = {m.group("rank") for m in listed if m is not None}
    found = [(m, m.group(0)) for m in map(_TRACE_NAME.fullmatch, os.listdir(folder))
             if m is not None and m.group(0) not in info.traces]
    if not ranks and found:  # none listed yet: the repeats of the first rank, if any
        ranks = {min((m.group("rank") for m, _ in found),
                     key=lambda r: (r is not None, int(r or 0)))}
    picked = []
    for m, name in sorted(found, key=lambda item: int(item[0].group("repeat"))):
        if m.group("rank") not in ranks:
            continue
        try:
            run = open_trace(folder / name).probe.get(PROBE_RUN, info.run_id)
        except TraceError:  # not a trace this run finished
            continue
        if not info.run_id or run == info.run_id:
            picked.append(name)
    return picked


_TRACE_NAME = re.compile(r"trace-(?:r(?P<rank>\d+)-)?(?P<repeat>\d+)\.json\.gz")


def new_run_id() -> str:
    """A fresh id for one run (kept in run.json and in every trace of the run)."""
    return uuid.uuid4().hex[:12]


def new_folder(parent: str | Path, name: str) -> Path:
    """A new folder `parent/name-<timestamp>`, created exclusively: two runs started in the
    same second get two folders."""
    parent = Path(parent)
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for k in range(1, 1000):
        path = parent / (stem if k == 1 else f"{stem}-{k}")
        try:
            _writable(path.mkdir, path, parents=True)
            return path
        except FileExistsError:
            continue
    raise TraceError(f"cannot find a free folder name like {parent / stem}")


class RunFolder:
    """A run folder held by one run: locked against a concurrent run, and ``run.json`` kept
    current from the start, so that whatever happens later the folder can be reported."""

    def __init__(self, path: str | Path, info: RunInfo, overwrite: bool = False) -> None:
        self.path = Path(path)
        self.info = info
        self.overwrite = overwrite
        self._locked = False
        self._created = False  # the folder did not exist before this run

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Claim the folder: create it, refuse one that holds another run (unless
        overwriting) or that another run is using, and write ``run.json``."""
        if self.path.exists() and not self.path.is_dir():
            raise TraceError(f"--out {self.path} is a file, not a folder")
        self._created = not self.path.exists()
        _writable(self.path.mkdir, self.path, parents=True, exist_ok=True)
        self._lock()
        if (self.path / RUN_FILE).exists():
            # a run that recorded nothing (its command failed before its first step), or
            # that was refused for its fault (what it recorded served to try that fault, a
            # misspelt --inject-fault), holds nothing to lose: the folder is taken as if
            # overwriting
            if not self.overwrite and self._holds_records() and not self._fault_refused():
                self.close()
                raise TraceError(
                    f"{self.path} already holds a run; choose another --out or pass --overwrite"
                )
            for pattern in RUN_FILES:
                for old in self.path.glob(pattern):
                    old.unlink()
        self.save()

    def keep_partial_traces(self, why: str = INTERRUPTED) -> None:
        """The traces repeats were still streaming when the run was interrupted (or stopped
        otherwise: `why`): kept under their own names as far as they were flushed, their
        failure `why`, and listed."""
        for partial in self.partial_traces():
            match = _TRACE_NAME.fullmatch(partial.name.removeprefix("partial-"))
            if match is None:
                continue
            rank = match.group("rank")
            kept = keep_partial(self.path, int(match.group("repeat")),
                                None if rank is None else int(rank), why)
            if kept is not None and match.group(0) not in self.info.traces:
                self.info.traces.append(match.group(0))
        self.save()

    def partial_traces(self) -> list[Path]:
        """The traces repeats are streaming (or left when they stopped), in order."""
        return sorted(self.path.glob("partial-trace-*.json.gz"))

    def _fault_refused(self) -> bool:
        """Whether the run here was refused for its fault (see FAULT_REFUSED)."""
        try:
            run = read_json(self.path / RUN_FILE, "run file")
        except TraceError:
            return False
        extra = run.get("extra") if isinstance(run, dict) else None
        return isinstance(extra, dict) and extra.get(FAULT_REFUSED) is True

    def _holds_records(self) -> bool:
        """Whether a trace here recorded a step (a run that failed in its first step kept
        traces of none)."""
        return any(holds_steps(path) for pattern in (
            "trace-*.json.gz", "zoom-*.json.gz", "attach-*.json.gz", "partial-*.json.gz")
            for path in self.path.glob(pattern))

    def save(self) -> None:
        """Write ``run.json`` as the run stands now."""
        _writable(save_run, self.path / RUN_FILE, self.path, self.info)

    def add_trace(self, trace: AnyTrace, timing: dict[str, Any] | None, rank: int | None = None
                  ) -> None:
        """Record a finished repeat's trace and timing, then update ``run.json``."""
        name = trace_name(trace.repeat, rank)
        # a trace read from a file elsewhere is read from the folder's copy from now on
        if not (self.path / name).exists() or isinstance(trace, TraceFile):
            save_trace(self.path, trace, rank)
        if name not in self.info.traces:
            self.info.traces.append(name)
        if timing is not None:
            self.info.timings.append(timing)
        self.save()

    def add_zoom_trace(self, trace: AnyTrace) -> None:
        """Keep a zoomed trace in the folder (run.json's zoom entry lists them); a trace read
        from a file elsewhere is read from the folder's copy from now on."""
        _writable(trace.save, self.path, self.path / zoom_name(trace.repeat))

    def set_state(self, state: str) -> None:
        self.info.state = state
        self.save()

    def discard(self) -> None:
        """Leave no trace of a run refused before it recorded anything (bad input): its
        ``run.json``, and the folder itself where this run made it and nothing else is in it."""
        (self.path / RUN_FILE).unlink(missing_ok=True)
        self.close()
        if self._created:
            with contextlib.suppress(OSError):  # (not empty: something else is kept there)
                self.path.rmdir()

    def close(self) -> None:
        if self._locked:
            (self.path / LOCK_FILE).unlink(missing_ok=True)
            self._locked = False

    def _lock(self) -> None:
        lock = self.path / LOCK_FILE
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = _lock_holder(lock)
                if holder is not None:
                    raise TraceError(
                        f"{self.path} is in use by another detaudit run (pid {holder}); "
                        "choose another --out"
                    ) from None
                lock.unlink(missing_ok=True)  # left by a run that no longer exists
                continue
            except OSError as exc:
                raise TraceError(f"cannot write the run folder {self.path}: "
                                 f"{exc.strerror or exc}") from None
            with os.fdopen(fd, "w") as file:
                file.write(str(os.getpid()))
            self._locked = True
            return
        raise TraceError(f"cannot lock the run folder {self.path}")


def _lock_holder(lock: Path) -> int | None:
    """The pid of the live process holding `lock`, or None when it is stale."""
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        return None
    if pid <= 0 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def _writable(action: Any, path: Path, *args: Any, **kwargs: Any) -> Any:
    """Run a file-system action; an error becomes one line naming the folder."""
    try:
        return action(*args, **kwargs)
    except FileExistsError:
        raise
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            reason = f"{reason} (not writable)"
        raise TraceError(f"cannot write {path}: {reason}") from None


_RUN_FIELDS = {  # field -> (type, what it must be)
    "probe": (dict, "a dict"), "config": (dict, "a dict"), "command": (str, "a string"),
    "traces": (list, "a list of file names"), "timings": (list, "a list"),
    "extra": (dict, "a dict"), "meta": (dict, "a dict"), "run_id": (str, "a string"),
    "state": (str, "a string"),
}


def _run_info(data: dict[str, Any], path: Path) -> RunInfo:
    """run.json's fields, each checked; trace names must be plain file names in the folder."""
    for name, (kind, what) in _RUN_FIELDS.items():
        if name in data and not isinstance(data[name], kind):
            raise TraceError(f"{path} is damaged: {name} is {describe(data[name])}, not {what}")
    for name in ("probe", "config", "command", "traces"):
        if name not in data:
            raise TraceError(f"{path} is damaged: it has no {name}")
    for name in data["traces"]:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise TraceError(f"{path} is damaged: {describe(name)} is not a trace file name "
                             "in its own folder")
    return RunInfo(**{k: data[k] for k in _RUN_FIELDS if k in data})


def load_zoom(folder: str | Path, info: RunInfo) -> list[AnyTrace]:
    """The zoomed traces a run folder holds (none unless a scanned run was zoomed)."""
    names = ((info.extra or {}).get("zoom") or {}).get("traces") or []
    if not isinstance(names, list) or not all(
            isinstance(n, str) and Path(n).name == n and n.startswith("zoom-") for n in names):
        raise TraceError(f"{Path(folder) / RUN_FILE} is damaged: its zoom traces are not file "
                         "names in its own folder")
    return [open_trace(Path(folder) / name) for name in names]


@dataclass
class Baseline:
    """A stored reference run: what to run again and the trace it must reproduce."""

    spec: ProbeSpec
    config: AuditConfig
    env: dict[str, Any]
    trace: Trace


def save_baseline(path: str | Path, spec: ProbeSpec, config: AuditConfig, trace: Trace) -> Path:
    """Store `trace` as a baseline (gzip when the name ends in .gz). A probe file is named
    relative to the baseline's folder, so that the baseline and the probe committed together
    check out anywhere."""
    path = Path(path)
    if spec.kind == "file" and spec.source:
        spec = replace(spec, source=_relative_to(Path(spec.source), path.parent))
    stored = trace.to_dict()
    stored["probe"] = {**stored["probe"], PROBE_SPEC: jsonable(spec.to_dict())}
    data = {
        "format": BASELINE_FORMAT, "version": BASELINE_VERSION, "probe": jsonable(spec.to_dict()),
        "config": config.to_dict(), "env": jsonable(trace.env), "trace": stored,
    }
    return atomic_write(path, dump_json(data, compress=path.suffix == ".gz"))


def _relative_to(source: Path, folder: Path) -> str:
    """`source` as a path relative to `folder` (``/``-separated), or absolute where there is
    none (another drive)."""
    try:
        return Path(os.path.relpath(source.resolve(), folder.resolve())).as_posix()
    except ValueError:
        return str(source.resolve())


def load_baseline(path: str | Path) -> Baseline:
    """Read a baseline written by :func:`save_baseline`; one clear error for anything else."""
    path = Path(path)
    what = ("a run folder" if path.is_dir() or path.name == RUN_FILE
            else "a run's trace" if is_streamed_trace(path) else None)
    if what is not None:
        raise TraceError(f"{path} is {what}, not a baseline: `detaudit baseline ... --out "
                         "FILE` records one from a model or a probe file; `detaudit diff A B` "
                         "compares two runs (run folders, or exec's and watch's traces)")
    data = check_format(read_json(path, "baseline"), BASELINE_FORMAT, BASELINE_VERSION,
                        str(path), "upgrade detaudit or record the baseline again")
    if not all(isinstance(data.get(k), dict) for k in ("probe", "config", "env")):
        raise TraceError(f"baseline {path} is damaged: probe, config or env is missing")
    trace = Trace.from_dict(data.get("trace"), source=f"the trace in baseline {path}")
    try:
        spec = ProbeSpec.from_dict(data["probe"])
        config = AuditConfig.from_dict(data["config"])
    except (TypeError, ValueError) as exc:
        raise TraceError(f"baseline {path} is damaged: {exc}") from None
    if spec.kind == "file" and isinstance(spec.source, str):  # relative to the baseline's folder
        spec = replace(spec, source=str((path.parent / spec.source).resolve()))
    return Baseline(spec, config, data["env"], trace)


# -- traces recorded apart (watch) -----------------------------------------------------------
def load_traces(runs: tuple[str | Path | AnyTrace, ...]) -> list[AnyTrace]:
    """Traces given as trace files, folders of them (every ``trace-*.json.gz`` inside, as
    ``watch`` writes them) or trace objects, in order; a file given twice is refused."""
    given: list[Path | AnyTrace] = []
    for run in runs:
        if isinstance(run, (Trace, TraceFile)):
            given.append(run)
            continue
        path = Path(run)
        if path.is_dir():
            found = sorted(path.glob("trace-*.json.gz"), key=_run_order)
            if not found:
                raise DetauditError(f"{path} holds no trace-*.json.gz")
            given += found
        elif path.exists():
            given.append(path)
        else:
            raise DetauditError(f"no trace or folder at {path}")
    _refuse_twice([g for g in given if isinstance(g, Path)])
    traces = [open_trace(g) if isinstance(g, Path) else g for g in given]
    return traces


def _refuse_twice(paths: list[Path]) -> None:
    """A file among `paths` twice is refused: a run compared with itself agrees, whatever
    it did."""
    seen: set[Path] = set()
    for path in paths:
        if path.resolve() in seen:
            raise DetauditError(f"{path} is given twice: compare needs separate runs")
        seen.add(path.resolve())


def _run_order(path: Path) -> tuple[int, str]:
    """trace-2 before trace-10 (the order watch wrote them), other names after, by name."""
    number = path.name[len("trace-"):-len(".json.gz")]
    return (int(number), "") if number.isdigit() else (1 << 62, path.name)


def info_of_traces(traces: list[AnyTrace], run_id: str, command: str, preset: str) -> RunInfo:
    """The info of a run made of traces recorded apart (by ``watch``): the first one's, with
    the repeats and epochs the traces hold (each trace says 1 and 1 of itself)."""
    first = traces[0]
    config = {**first.probe.get(PROBE_CONFIG, {}), "repeats": len(traces),
              "epochs": max((t.steps[-1].epoch + 1 for t in traces if t.steps), default=0)}
    return RunInfo(probe={**first.probe.get(PROBE_SPEC, {}), "preset": preset},
                   config=config, command=command, traces=[], run_id=run_id,
                   state="comparing")


def watched_run(path: str | Path) -> tuple[RunInfo, list[AnyTrace]]:
    """What ``watch`` wrote (a trace file, or a folder of them), read as a run: its traces,
    and an info made from the first (`detaudit diff` takes it as it takes a run folder)."""
    traces = load_traces((path,))
    run_id = str(traces[0].probe.get(PROBE_RUN, ""))
    return info_of_traces(traces, run_id, "", "watched"), traces
