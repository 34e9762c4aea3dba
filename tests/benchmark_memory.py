"""Memory of a long recording: peak resident memory of a process that trains a small model
for N steps under ``detaudit.watch`` (scan level), with the trace streamed to its file (the
default) and held whole in memory (what a recorder did before streaming), and the trace's size.

    python tests/benchmark_memory.py [--steps 250 1000 4000]

Prints a table. Each row is a fresh process; "recording" is its peak RSS minus the peak of the
same loop without detaudit, so it is what the recording holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

CHILD = r"""
import json, resource, sys
import torch
from torch import nn
steps, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(16)])  # 32 parameters: 70 records a step
opt = torch.optim.SGD(model.parameters(), lr=0.001)
x, y = torch.randn(8, 64), torch.randn(8, 64)

def loop(w=None):
    for _ in range(steps):
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if w is not None:
            w.step()

if mode == "plain":
    loop()
else:
    import detaudit
    from detaudit.drivers import attach
    if mode == "held whole":
        attach.FLUSH_ROWS = 10**12
        attach.SAVE_EVERY_S = float("inf")  # saved once, at the end
    with detaudit.watch(model, opt, out=out) as w:
        loop(w)
print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _peak(steps: int, mode: str, out: Path) -> int:
    done = subprocess.run([sys.executable, "-c", CHILD, str(steps), mode, str(out)],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_kib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[250, 1000, 4000])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in args.steps:
            plain = _peak(steps, "plain", Path(tmp))
            for mode in ("streamed", "held whole"):
                out = Path(tmp) / f"{mode.replace(' ', '-')}-{steps}"
                peak = _peak(steps, mode, out)
                size = sum(p.stat().st_size for p in out.glob("trace-*.json.gz"))
                rows.append([steps, mode, f"{(peak - plain) / 1024:.1f}", f"{size / 1024:.0f}"])
    print(tabulate(rows, headers=["steps", "trace", "recording MiB (peak RSS over plain)",
                                  "trace KiB"]))


if __name__ == "__main__":
    main()
