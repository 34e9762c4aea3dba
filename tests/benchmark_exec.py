"""`detaudit exec` overhead: the same training script run plain and under `exec` (scan only,
one run), in alternating pairs on this machine, and the cost of one zoom re-run.

    python tests/benchmark_exec.py [--pairs 3] [--steps 200]

Prints a table. Ratios are measured within each pair (the order alternates), so that a
shared, noisy machine shifts both sides of a pair alike. Beside wall time, the CPU time of the
whole process tree (user + system, the DataLoader workers included): other jobs on a shared
machine stretch wall time far more than the work a command does.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

SCRIPT = Path(__file__).parent / "scripts" / "train_resnet.py"


def _timed(command: list[str]) -> tuple[float, float]:
    """Wall time and CPU time (user + system, every process of the tree) of `command`."""
    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    started, cpu_before = time.perf_counter(), cpu()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started, cpu() - cpu_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    script = [sys.executable, str(SCRIPT), "--steps", str(args.steps)]
    rows, ratios, cpu_ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        def audited(name: str, *options: str) -> list[str]:
            return [sys.executable, "-m", "detaudit", "exec", "--repeats", "1", "--quiet",
                    "--out", str(Path(tmp) / name), *options, "--", *script]

        for pair in range(args.pairs):
            first_plain = pair % 2 == 0
            plain = exec_ = (0.0, 0.0)
            for side in ((0, 1) if first_plain else (1, 0)):
                if side == 0:
                    plain = _timed(script)
                else:
                    exec_ = _timed(audited(f"exec-{pair}", "--seed", "0"))
            ratios.append(exec_[0] / plain[0] - 1)
            cpu_ratios.append(exec_[1] / plain[1] - 1)
            rows.append([pair + 1, "plain first" if first_plain else "exec first",
                         f"{plain[0]:.1f}", f"{exec_[0]:.1f}", f"{100 * ratios[-1]:+.1f} %",
                         f"{plain[1]:.1f}", f"{exec_[1]:.1f}", f"{100 * cpu_ratios[-1]:+.1f} %"])
        # one zoom: two runs of the command to the planted step, that step at module and op level
        step = args.steps // 2
        started = time.perf_counter()
        subprocess.run(audited("zoom", "--seed", "0", "--repeats", "2", "--max-steps",
                               str(step + 1), "--inject-fault", f"fc@backward:{step}"),
                       capture_output=True, check=False)
        with_zoom = time.perf_counter() - started
        started = time.perf_counter()
        subprocess.run(audited("nozoom", "--seed", "0", "--repeats", "2", "--max-steps",
                               str(step + 1), "--inject-fault", f"fc@backward:{step}",
                               "--no-zoom"), capture_output=True, check=False)
        without = time.perf_counter() - started
    print(tabulate(rows, headers=["pair", "order", "plain wall s", "exec wall s", "wall",
                                  "plain CPU s", "exec CPU s", "CPU"]))
    print(f"\nmedian overhead of exec (scan, 1 run, {args.steps} steps of ResNet-18 at 64 px, "
          f"batch 16): wall {100 * statistics.median(ratios):+.1f} %, "
          f"CPU time {100 * statistics.median(cpu_ratios):+.1f} %")
    print(f"zoom into step {step} (2 runs re-run to it, that step at module and op level): "
          f"{with_zoom - without:.1f} s on top of the {without:.1f} s scan")


if __name__ == "__main__":
    main()
