"""A run folder: the traces of every repeat plus ``run.json`` (what was run, timings, meta).

Everything after recording (comparison, reports, baselines) reads a run folder, never a
model: a run saved today can be compared and rendered later, on another machine.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import TraceError
from .trace import Trace

# History:
#   1: first format.
RUN_FORMAT_VERSION = 1
RUN_FILE = "run.json"


@dataclass
class RunInfo:
    """What a run folder says about its run (the volatile parts live in `meta`)."""

    probe: dict[str, Any]  # name, kind (builtin|file), source, options
    config: dict[str, Any]  # AuditConfig.to_dict()
    command: str  # a command line that reproduces the run
    traces: list[str]  # file names, by repeat
    timings: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. fix verification results
    meta: dict[str, Any] = field(default_factory=dict)  # created, host: never compared

    def to_dict(self) -> dict[str, Any]:
        return {"format": "detaudit-run", "version": RUN_FORMAT_VERSION, **asdict(self)}


def save_run(folder: str | Path, info: RunInfo) -> Path:
    """Write ``run.json`` into `folder` (the traces are saved as each repeat finishes)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    info.meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    info.meta.setdefault("host", platform.node())
    path = folder / RUN_FILE
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(info.to_dict(), indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load_run(folder: str | Path) -> tuple[RunInfo, list[Trace]]:
    """Read a run folder; any missing or damaged file is one clear error naming it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(f"{folder} is not a run folder (no such directory)")
    path = folder / RUN_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"{path} is missing: {folder} is not a detaudit run folder") from None
    except (OSError, ValueError):
        raise TraceError(f"{path} is truncated or corrupt") from None
    if not isinstance(data, dict) or data.get("format") != "detaudit-run":
        raise TraceError(f"{path} is not a detaudit run file")
    if data.get("version") != RUN_FORMAT_VERSION:
        raise TraceError(
            f"{path} has run format version {data.get('version')!r}; this detaudit reads "
            f"version {RUN_FORMAT_VERSION}"
        )
    try:
        info = RunInfo(**{k: v for k, v in data.items() if k not in ("format", "version")})
    except TypeError as exc:
        raise TraceError(f"{path} is damaged: {exc}") from None
    traces = [Trace.load(folder / name) for name in info.traces]
    if not traces:
        raise TraceError(f"{path} lists no traces")
    return info, traces
