"""Process isolation: each repeat in a fresh interpreter, traces handed back through files.

This catches what one process hides: ordering that depends on ``PYTHONHASHSEED``, and state
left in modules or globals by an earlier repeat. Run as
``python -m detaudit.drivers.isolation JOB``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from ..config import AuditConfig, ProbeSpec
from ..errors import DetauditError
from ..runfolder import save_crashed, timing_name, trace_name
from ..trace import Trace, open_trace
from .loading import make_factory
from .runner import RepeatTiming, run_repeat


def run_isolated(
    spec: ProbeSpec,
    config: AuditConfig,
    folder: str | Path,
    run_id: str = "",
    on_repeat: Callable[[Trace, RepeatTiming], None] | None = None,
    first: int = 0,
) -> tuple[list[Trace], list[RepeatTiming]]:
    """Run every repeat from `first` on in its own interpreter; a crashed repeat becomes a
    failed trace. `on_repeat(trace, timing)` is called as each repeat ends."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    traces, timings = [], []
    for repeat in range(first, config.repeats):
        code, last = run_child("detaudit.drivers.isolation", folder / f"job-{repeat}.json", {
            "spec": spec.to_dict(), "config": config.to_dict(), "repeat": repeat,
            "folder": str(folder), "run": run_id})
        trace_path = folder / trace_name(repeat)
        timing_path = folder / timing_name(repeat)
        if code == 0 and trace_path.exists():
            traces.append(open_trace(trace_path))
            timings.append(RepeatTiming(**json.loads(timing_path.read_text())))
            timing_path.unlink()
        else:
            why = f"repeat {repeat} crashed (exit code {code}): {last}"
            traces.append(save_crashed(folder, spec, config, repeat, why, run_id))
            timings.append(RepeatTiming(repeat, 0.0, 0))
        if on_repeat:
            on_repeat(traces[-1], timings[-1])
    return traces, timings


def run_child(module: str, job_path: Path, job: dict[str, Any]) -> tuple[int, str]:
    """Run ``python -m <module> JOB`` in a fresh interpreter with `job` written to
    `job_path` (removed after); its exit code and the last line it wrote to stderr."""
    job_path.write_text(json.dumps(job))
    try:
        done = subprocess.run([sys.executable, "-m", module, str(job_path)],
                              capture_output=True, text=True, check=False)
    finally:
        job_path.unlink(missing_ok=True)
    return done.returncode, (done.stderr.strip().splitlines() or ["no output"])[-1]


def _child(job_path: str) -> int:
    """Run one repeat described by a job file and write its trace and timing."""
    job = json.loads(Path(job_path).read_text())
    folder = Path(job["folder"])
    try:
        spec = ProbeSpec.from_dict(job["spec"])
        _, timing = run_repeat(  # the trace is in the folder, under its own name
            make_factory(spec), AuditConfig.from_dict(job["config"]), job["repeat"], spec,
            run_id=job.get("run", ""), stream_to=folder / trace_name(job["repeat"]),
        )
    except DetauditError as exc:
        print(f"detaudit: {exc}", file=sys.stderr)
        return 2
    (folder / timing_name(job["repeat"])).write_text(json.dumps(asdict(timing)))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
