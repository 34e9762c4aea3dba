"""The census and the fix verification in a child process whose settings are in force from
its start.

cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when it initialises, at the first GEMM: setting it
later, in a process that has already run the audit on CUDA, makes the deterministic pass
fail at its first matmul or verify a different fix than the one reported. A fresh
interpreter started with the variable set has it in force. Run as
``python -m detaudit.investigate.isolated JOB``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..config import AuditConfig, ProbeSpec
from ..errors import DetauditError
from ..storage import atomic_write, dump_json, jsonable

WORKSPACE = ":4096:8"


def needs_child(config: AuditConfig, spec: ProbeSpec | None) -> bool:
    """Whether the deterministic passes must run in a child: on CUDA, unless the workspace
    setting was already in force when this process started (a Python function probe cannot
    be rebuilt elsewhere, so it runs here, and the result says so)."""
    import torch

    return (torch.device(config.device).type == "cuda" and spec is not None
            and spec.kind != "python" and "CUBLAS_WORKSPACE_CONFIG" not in os.environ)


def run_in_child(name: str, spec: ProbeSpec, config: AuditConfig, cause: str) -> dict[str, Any]:
    """The result of one investigation (``census`` or ``verify``) run in a fresh interpreter
    with ``CUBLAS_WORKSPACE_CONFIG`` set from its start."""
    with tempfile.TemporaryDirectory(prefix="detaudit-") as scratch:
        job, result = Path(scratch) / "job.json", Path(scratch) / "result.json"
        job.write_text(json.dumps({"name": name, "spec": spec.to_dict(), "cause": cause,
                                   "config": config.to_dict(), "result": str(result)}))
        env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": WORKSPACE}
        done = subprocess.run([sys.executable, "-m", "detaudit.investigate.isolated", str(job)],
                              capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0 or not result.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise DetauditError(f"the {name} process failed (exit code {done.returncode}): "
                                f"{last}")
        found = json.loads(result.read_text())
    found["process"] = f"a fresh process with CUBLAS_WORKSPACE_CONFIG={WORKSPACE}"
    return found


def _child(job_path: str) -> int:
    """Run the investigation a job file names and write its result."""
    from ..drivers.loading import make_factory
    from .census import take_census
    from .fixes import verify_fix

    job = json.loads(Path(job_path).read_text())
    spec, config = ProbeSpec.from_dict(job["spec"]), AuditConfig.from_dict(job["config"])
    try:
        factory = make_factory(spec)
        if job["name"] == "census":
            found = take_census(factory, config, spec)
        else:
            found = verify_fix(factory, config, job["cause"], spec)
    except DetauditError as exc:
        print(f"detaudit: {exc}", file=sys.stderr)
        return 2
    atomic_write(job["result"], dump_json(jsonable(found)))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
