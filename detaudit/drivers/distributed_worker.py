"""One rank of a distributed audit, started by ``torch.distributed.run``.

Run as ``python -m torch.distributed.run ... -m detaudit.drivers.distributed_worker JOB``. Each rank
runs the job's repeats with the usual runner and writes ``trace-r<rank>-<repeat>.json.gz``
as each repeat ends, then a status file ``rank-<rank>.json``: done, failed (a step raised;
the rank stops so that no other rank waits on it) or error (bad input).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import AuditConfig, ProbeSpec
from ..errors import DetauditError
from ..runfolder import timing_name, trace_name
from .loading import make_factory
from .rankprobe import RankWatch, is_rank_aware, prepare_rank_probe
from .runner import run_repeat

PROGRESS = "detaudit-progress"


def status_path(folder: Path, rank: int) -> Path:
    """Where a rank writes how it ended."""
    return folder / f"rank-{rank}.json"


def write_status(folder: Path, rank: int, state: str, repeat: int | None, message: str) -> None:
    """Write the rank's status once: the first way a rank ends is the one that counts. It
    appears whole or not at all (a rank the launcher kills while writing it left an empty
    file, which the launching process could not read)."""
    final = status_path(folder, rank)
    part = final.with_name(f"{final.name}.{os.getpid()}.part")
    part.write_text(json.dumps({"state": state, "repeat": repeat, "message": message,
                                "time": time.time()}))
    try:
        os.link(part, final)  # (fails where a status is already there)
    except FileExistsError:
        pass
    finally:
        part.unlink(missing_ok=True)


def main(job_path: str) -> int:
    """Run this rank's repeats of the job."""
    job = json.loads(Path(job_path).read_text())
    folder = Path(job["folder"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = AuditConfig.from_dict(job["config"])
    if config.device.startswith("cuda"):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    fault = config.fault.in_wrapper() if config.fault else None
    config = dataclasses.replace(config, device=str(device), fault=fault)
    current: dict[str, Any] = {"repeat": None}

    def terminated(signum: int, frame: Any) -> None:
        write_status(folder, rank, "terminated", current["repeat"], "stopped by the launcher")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    dist.init_process_group(backend)
    try:
        spec = ProbeSpec.from_dict(job["spec"])
        fn = make_factory(spec)
        rank_aware = is_rank_aware(fn)
    except DetauditError as exc:
        write_status(folder, rank, "error", None, str(exc))
        return 2
    for repeat in job["repeats"]:
        current["repeat"] = repeat
        watch = RankWatch(rank, world_size, backend)

        def factory(dev: torch.device, watch: RankWatch = watch) -> Any:
            probe = fn(dev, rank, world_size) if rank_aware else fn(dev)
            return prepare_rank_probe(probe, dev, watch, config.seed, rank_aware)

        def on_step(epoch: int, index: int, step: int, repeat: int = repeat) -> None:
            if rank == 0:
                print(f"{PROGRESS} {repeat} {epoch} {step}", flush=True)

        try:
            trace, timing = run_repeat(
                factory, config, repeat, spec, on_step, run_id=job.get("run", ""),
                stream_to=folder / trace_name(repeat, rank),
                amend=watch.note_in)
        except DetauditError as exc:
            write_status(folder, rank, "error", repeat, str(exc))
            return 2
        if trace.failure:
            write_status(folder, rank, "failed", repeat, trace.failure)
        timing_file = folder / timing_name(repeat, rank)
        timing_file.write_text(json.dumps({**dataclasses.asdict(timing), "rank": rank}))
        if trace.failure:
            return 1
    write_status(folder, rank, "done", None, "")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written: skip the seconds of tearing torch down per rank
