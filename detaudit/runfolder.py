"""A run folder and a baseline file: what detaudit saves, under which names, in which format.

A run folder holds the traces of every repeat plus ``run.json`` (what was run, timings,
investigations, meta). A baseline is one repeat's trace plus what reproduces it. Everything
after recording (comparison, reports, baselines) reads these files, never a model: a run
saved today can be compared and rendered later, on another machine.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import AuditConfig, ProbeSpec
from .errors import TraceError
from .storage import atomic_write, check_format, dump_json, read_json
from .trace import PROBE_CONFIG, PROBE_SPEC, Trace

# History:
#   1: first format.
RUN_FORMAT_VERSION = 1
RUN_FORMAT = "detaudit-run"
RUN_FILE = "run.json"
# History:
#   1: first format: probe description, audit config, environment, the trace of repeat 0.
BASELINE_VERSION = 1
BASELINE_FORMAT = "detaudit-baseline"


def trace_name(repeat: int | str, rank: int | str | None = None) -> str:
    """The file name of one repeat's trace (of one rank, in a distributed audit); "*" globs."""
    return f"trace-{repeat}.json.gz" if rank is None else f"trace-r{rank}-{repeat}.json.gz"


def timing_name(repeat: int | str, rank: int | str | None = None) -> str:
    """The file a repeat run in another process leaves its timing in."""
    return f"timing-{repeat}.json" if rank is None else f"timing-r{rank}-{repeat}.json"


def trace_probe(spec: ProbeSpec | None, config: AuditConfig) -> dict[str, Any]:
    """What a trace says about its probe and configuration."""
    return {PROBE_SPEC: spec.to_dict() if spec else {}, PROBE_CONFIG: config.to_dict()}


def failed_trace(spec: ProbeSpec | None, config: AuditConfig, repeat: int, why: str) -> Trace:
    """The trace of a repeat that left none (its process crashed): no records, a failure."""
    return Trace(probe=trace_probe(spec, config), repeat=repeat, env={}, failure=why)


def save_trace(folder: str | Path, trace: Trace, rank: int | None = None) -> Path:
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

    def to_dict(self) -> dict[str, Any]:
        return {"format": RUN_FORMAT, "version": RUN_FORMAT_VERSION, **asdict(self)}


def save_run(folder: str | Path, info: RunInfo) -> Path:
    """Write ``run.json`` into `folder` (the traces are saved as each repeat finishes)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    info.meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    info.meta.setdefault("host", platform.node())
    return atomic_write(folder / RUN_FILE, dump_json(info.to_dict(), indent=1, allow_nan=True))


def load_run(folder: str | Path) -> tuple[RunInfo, list[Trace]]:
    """Read a run folder; any missing or damaged file is one clear error naming it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(f"{folder} is not a run folder (no such directory)")
    path = folder / RUN_FILE
    if not path.exists():
        raise TraceError(f"{path} is missing: {folder} is not a detaudit run folder")
    data = check_format(read_json(path, "run file"), RUN_FORMAT, RUN_FORMAT_VERSION, str(path),
                        "upgrade detaudit or re-run the audit")
    try:
        info = RunInfo(**{k: v for k, v in data.items() if k not in ("format", "version")})
    except TypeError as exc:
        raise TraceError(f"{path} is damaged: {exc}") from None
    traces = [Trace.load(folder / name) for name in info.traces]
    if not traces:
        raise TraceError(f"{path} lists no traces")
    return info, traces


@dataclass
class Baseline:
    """A stored reference run: what to run again and the trace it must reproduce."""

    spec: ProbeSpec
    config: AuditConfig
    env: dict[str, Any]
    trace: Trace


def save_baseline(path: str | Path, spec: ProbeSpec, config: AuditConfig, trace: Trace) -> Path:
    """Store `trace` as a baseline (gzip when the name ends in .gz)."""
    path = Path(path)
    data = {
        "format": BASELINE_FORMAT, "version": BASELINE_VERSION, "probe": spec.to_dict(),
        "config": config.to_dict(), "env": trace.env, "trace": trace.to_dict(),
    }
    return atomic_write(path, dump_json(data, compress=path.suffix == ".gz"))


def load_baseline(path: str | Path) -> Baseline:
    """Read a baseline written by :func:`save_baseline`; one clear error for anything else."""
    path = Path(path)
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
    return Baseline(spec, config, data["env"], trace)
