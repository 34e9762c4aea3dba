"""Distributed audits: the probe on N ranks under DDP, launched by ``torch.distributed.run``.

Each rank records its own traces (see :mod:`detaudit.drivers.distributed_worker`); afterwards
they are compared run to run per rank and across ranks (:mod:`detaudit.analysis.ranks`). A rank that
crashes ends the audit: the launcher stops the others, and every trace already written is
kept and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import AuditConfig, ProbeSpec
from ..errors import DetauditError
from ..runfolder import save_crashed, timing_name, trace_name
from ..trace import Trace, open_trace
from .distributed_worker import PROGRESS, status_path

LAUNCH_LOG = "launch.log"
_EXIT_CODE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass
class DistributedRun:
    """What the ranks left behind: traces by rank (then repeat), timings, a crash if any."""

    traces: dict[int, list[Trace]]
    timings: list[dict[str, Any]]
    crash: dict[str, Any] | None
    command: list[str]


def run_distributed(
    spec: ProbeSpec,
    config: AuditConfig,
    folder: str | Path,
    nproc: int,
    isolation: str = "inprocess",
    on_step: Callable[[int, int, int], None] | None = None,
    run_id: str = "",
) -> DistributedRun:
    """Run the audit on `nproc` ranks; with process isolation, one launch per repeat."""
    _check_nproc(nproc, config.device)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LAUNCH_LOG).unlink(missing_ok=True)
    groups = (
        [[r] for r in range(config.repeats)] if isolation == "process"
        else [list(range(config.repeats))]
    )
    crash = None
    command: list[str] = []
    for repeats in groups:
        command, crash = _launch(spec, config, folder, nproc, repeats, on_step, run_id)
        if crash:
            break
    last = crash["repeat"] if crash else config.repeats - 1
    if last is None:
        raise DetauditError(f"{_crash_text(crash)}; no trace was written (see {folder / LAUNCH_LOG})")
    if crash:
        crash["kept"] = sorted(p.name for p in folder.glob(trace_name("*", "*")))
    traces = {rank: _rank_traces(folder, spec, config, rank, last, crash, run_id)
              for rank in range(nproc)}
    return DistributedRun(traces, _timings(folder), crash, command)


def _check_nproc(nproc: int, device: str) -> None:
    import torch

    if nproc < 1:
        raise DetauditError("--nproc must be at least 1")
    if device.startswith("cuda") and nproc > torch.cuda.device_count():
        raise DetauditError(
            f"--nproc {nproc} needs {nproc} CUDA devices; {torch.cuda.device_count()} found"
        )


def launch_command(nproc: int, job: Path) -> list[str]:
    """The torch.distributed.run command line that starts every rank on this machine."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), "--monitor-interval", "0.1", "-m", "detaudit.drivers.distributed_worker", str(job),
    ]


def _launch(
    spec: ProbeSpec, config: AuditConfig, folder: Path, nproc: int, repeats: list[int],
    on_step: Callable[[int, int, int], None] | None, run_id: str,
) -> tuple[list[str], dict[str, Any] | None]:
    """One launch of every rank over `repeats`; returns the command and the crash, if any."""
    job = folder / "job-distributed.json"
    job.write_text(json.dumps({"spec": spec.to_dict(), "config": config.to_dict(),
                               "repeats": repeats, "folder": str(folder), "run": run_id}))
    for rank in range(nproc):
        status_path(folder, rank).unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    command = launch_command(nproc, job)
    try:
        with open(folder / LAUNCH_LOG, "a") as log:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                                       env=env)
            assert process.stdout is not None
            try:
                for line in process.stdout:
                    if line.startswith(PROGRESS):
                        if on_step:
                            on_step(*(int(x) for x in line.split()[1:4]))
                    else:
                        log.write(line)
                        log.flush()
                code = process.wait()
            except BaseException:  # Ctrl-C / SIGTERM: stop the ranks, keep their traces
                process.terminate()
                process.wait(timeout=30)
                raise
    finally:
        job.unlink(missing_ok=True)
    statuses = _statuses(folder, nproc)
    errors = sorted((s["time"], rank) for rank, s in statuses.items() if s["state"] == "error")
    if errors:
        rank = errors[0][1]
        raise DetauditError(f"rank {rank}: {statuses[rank]['message']}")
    if code == 0 and all(s["state"] == "done" for s in statuses.values()) and len(statuses) == nproc:
        return command, None
    return command, _crash(folder, nproc, statuses, code, repeats)


def _statuses(folder: Path, nproc: int) -> dict[int, dict[str, Any]]:
    out = {}
    for rank in range(nproc):
        path = status_path(folder, rank)
        if path.exists():
            with contextlib.suppress(ValueError):  # (unreadable: no status)
                out[rank] = json.loads(path.read_text())
            path.unlink()
    return out


def _crash(
    folder: Path, nproc: int, statuses: dict[int, dict[str, Any]], code: int, repeats: list[int]
) -> dict[str, Any]:
    """Which rank crashed first, in which repeat, and why.

    A rank that left no status died without a word (a signal, ``os._exit``): it is the
    crash, the others only lost their peer. Otherwise the earliest failure is.
    """
    log = (folder / LAUNCH_LOG).read_text(errors="replace")
    exit_codes = {int(r): int(c) for r, c in _EXIT_CODE.findall(log)}
    silent = [r for r in range(nproc) if r not in statuses]
    failed = sorted((s["time"], r) for r, s in statuses.items() if s["state"] == "failed")
    if silent:
        rank = silent[0]
        repeat = next((k for k in repeats if not (folder / trace_name(k, rank)).exists()), None)
        exit_code = exit_codes.get(rank)
        how = f"exit code {exit_code}" if exit_code is not None else f"launcher exit code {code}"
        message = f"the process ended without a message ({how}; see {LAUNCH_LOG})"
    elif failed:
        rank = failed[0][1]
        repeat, message = statuses[rank]["repeat"], statuses[rank]["message"]
    else:
        last = (log.strip().splitlines() or ["no output"])[-1]
        raise DetauditError(f"torch.distributed.run failed (exit code {code}): {last}")
    return {"rank": rank, "repeat": repeat, "message": message}


def _crash_text(crash: dict[str, Any]) -> str:
    return f"rank {crash['rank']} crashed: {crash['message']}"


def _rank_traces(
    folder: Path, spec: ProbeSpec, config: AuditConfig, rank: int, last: int,
    crash: dict[str, Any] | None, run_id: str,
) -> list[Trace]:
    """The rank's traces of repeats 0..last; one it never wrote becomes a failed trace."""
    traces = []
    for repeat in range(last + 1):
        path = folder / trace_name(repeat, rank)
        if path.exists():
            traces.append(open_trace(path))
            continue
        why = (f"repeat {repeat} did not finish on rank {rank}: {_crash_text(crash)}" if crash
               else f"repeat {repeat} wrote no trace on rank {rank}")
        traces.append(save_crashed(folder, spec, config, repeat, why, run_id, rank))
    return traces


def _timings(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob(timing_name("*", "*"))):
        out.append(json.loads(path.read_text()))
        path.unlink()
    return sorted(out, key=lambda t: (t["rank"], t["repeat"]))
