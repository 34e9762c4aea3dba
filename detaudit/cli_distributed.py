"""`detaudit run --nproc N`: a distributed audit, from launch to the report and exit code."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .cli import print_summary
from .distributed import run_distributed
from .distributed_worker import trace_name
from .errors import EXIT_DIVERGED, EXIT_OK
from .junit import JUnitCase, write_junit
from .ranks import analyse, compare_ranks, finished
from .report import render_console, summarize, write_reports
from .report.ranks import crash_line, render_ranks_console
from .runfolder import RunInfo, save_run
from .runner import AuditConfig


def run_command(
    args: argparse.Namespace, spec: dict[str, Any], config: AuditConfig, out: Path,
    preset_text: str, command: str,
) -> int:
    """Launch the ranks, analyse their traces, write the run folder and reports, print."""
    if spec["kind"] == "builtin" and args.num_images is None:
        spec["options"]["num_images"] *= args.nproc  # the preset's steps on every rank
    total = config.repeats * config.epochs * (config.steps or 0) or None
    bar = tqdm(total=total, disable=True if (args.quiet or args.json) else None, leave=False,
               file=sys.stderr, unit="step", dynamic_ncols=True,
               desc=f"{spec['name']} on {args.nproc} ranks ({config.device})")

    def on_step(repeat: int, epoch: int, step: int) -> None:
        bar.set_description(f"repeat {repeat + 1}/{config.repeats} epoch {epoch + 1}/{config.epochs}")
        bar.update(1)

    try:
        run = run_distributed(spec, config, out, args.nproc, args.isolation, on_step)
    finally:
        bar.close()
    comparisons = compare_ranks(run.traces)
    ranks = analyse(run.traces, comparisons, run.crash)
    ranks["launch"] = shlex.join(run.command)
    ranks["traces"] = {str(r): [trace_name(r, t.repeat) for t in ts] for r, ts in run.traces.items()}
    primary = ranks["primary_rank"]
    compared = finished(run.traces[primary])
    info = RunInfo(
        probe={**spec, "preset": f"{preset_text}, {args.nproc} ranks"}, config=config.to_dict(),
        command=command, traces=[trace_name(primary, t.repeat) for t in compared],
        timings=run.timings, extra={"ranks": ranks},
    )
    save_run(out, info)
    summary = summarize(info, comparisons[primary], compared)
    write_reports(out, summary)
    print_summary(args, summary, out, render_ranks_console(summary))
    if run.crash:
        print(f"detaudit: {crash_line(run.crash)}; traces kept in {out}: "
              f"{', '.join(run.crash['kept']) or 'none'}", file=sys.stderr)
    if args.junit:
        failure = None if summary["verdict"] == "deterministic" else summary["headline"]
        seconds = sum(t["seconds"] for t in run.timings)
        write_junit(args.junit, [JUnitCase(spec["name"], "detaudit.run", seconds, failure,
                                           render_console(summary))])
    return EXIT_OK if summary["verdict"] == "deterministic" else EXIT_DIVERGED
