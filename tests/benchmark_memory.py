"""Memory of a long recording: peak resident memory of a process that trains a small model
for N steps under ``detaudit.watch`` (scan level), with the trace streamed to its file (the
default) and held whole in memory (what a recorder did before streaming), and the trace's size;
then the memory of comparing two such runs with ``detaudit.compare``, the traces read a step at
a time (the default for streamed traces) and loaded whole.

    python tests/benchmark_memory.py [--steps 250 1000 4000]

Prints two tables. Each row is a fresh process; "recording" is its peak RSS minus the peak of
the same loop without detaudit, so it is what the recording holds; "comparing" is the peak RSS
of the comparison minus that of a process that only imports torch and detaudit.
"""

from __future__ import annotations

import argparse
import json
import shutil
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
    from detaudit import trace
    if mode == "held whole":
        trace.FLUSH_ROWS = 10**12
        trace.FLUSH_EVERY_S = float("inf")  # saved at the first step, then at the end
    with detaudit.watch(model, opt, out=out) as w:
        loop(w)
print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

COMPARE = r"""
import json, resource, sys
import torch
import detaudit
from detaudit.trace import Trace
mode, traces = sys.argv[1], sys.argv[2:]
if mode == "read a step at a time":
    result = detaudit.compare(*traces)
elif mode == "loaded whole":
    result = detaudit.compare(*[Trace.load(t) for t in traces])
print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "verdict": result.comparison.verdict if mode != "imports" else None}))
"""


def _peak(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[250, 1000, 4000])
    args = parser.parse_args()
    rows, compared = [], []
    with tempfile.TemporaryDirectory() as tmp:
        imports = _peak(COMPARE, "imports")["peak_kib"]
        for steps in args.steps:
            plain = _peak(CHILD, str(steps), "plain", tmp)["peak_kib"]
            for mode in ("streamed", "held whole"):
                out = Path(tmp) / f"{mode.replace(' ', '-')}-{steps}"
                peak = _peak(CHILD, str(steps), mode, str(out))["peak_kib"]
                size = sum(p.stat().st_size for p in out.glob("trace-*.json.gz"))
                rows.append([steps, mode, f"{(peak - plain) / 1024:.1f}", f"{size / 1024:.0f}"])
            trace = Path(tmp) / f"streamed-{steps}" / "trace-0.json.gz"
            second = shutil.copy(trace, trace.with_name("trace-1.json.gz"))  # a second run
            for mode in ("read a step at a time", "loaded whole"):
                done = _peak(COMPARE, mode, str(trace), str(second))
                compared.append([steps, mode, f"{(done['peak_kib'] - imports) / 1024:.1f}",
                                 done["verdict"]])
    print(tabulate(rows, headers=["steps", "trace", "recording MiB (peak RSS over plain)",
                                  "trace KiB"]))
    print()
    print(tabulate(compared, headers=["steps", "traces",
                                      "comparing 2 runs, MiB (peak RSS over the imports)",
                                      "verdict"]))

if __name__ == "__main__":
    main()
