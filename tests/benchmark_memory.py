"""Memory of a long recording: peak resident memory of a process that trains a small model
for N steps under ``detaudit.watch`` (scan level), with the trace streamed to its file (the
default) and held whole in memory (what a recorder did before streaming), and the trace's size;
then the memory of analysing two such runs -- compared run to run (``detaudit.compare``), as two
ranks of one run (the cross-rank checks) and diffed within a tolerance (``detaudit diff
--rtol``) -- with the traces read a step at a time (the default for streamed traces) and
loaded whole.

    python tests/benchmark_memory.py [--steps 250 1000 4000]

Prints two tables. Each row is a fresh process; "recording" is its peak RSS minus the peak of
the same loop without detaudit, so it is what the recording holds; an analysis row is the peak
RSS of the analysis minus that of a process that only imports torch and detaudit.
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
from detaudit.analysis.diff import diff_traces
from detaudit.analysis.ranks import analyse, compare_ranks
from detaudit.trace import Trace, open_trace
what, how, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
traces = [open_trace(p) if how == "step" else Trace.load(p) for p in paths]
verdict = None
if what == "compare":
    verdict = detaudit.compare(*traces).comparison.verdict
elif what == "ranks":  # the two runs as two ranks of one distributed run
    by_rank = {rank: [trace] for rank, trace in enumerate(traces)}
    checks = analyse(by_rank, compare_ranks(by_rank)).checks
    verdict = ", ".join(f"{c.key} {c.status}" for c in checks if c.key in ("params", "grads"))
elif what == "diff":
    verdict = diff_traces(traces[0], traces[1], rtol=1e-6).verdict
print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "verdict": verdict}))
"""

ANALYSES = (("compare", "comparing 2 runs"),
            ("ranks", "cross-rank checks of 2 ranks"),
            ("diff", "diff within rtol=1e-6"))
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
        imports = _peak(COMPARE, "imports", "none")["peak_kib"]
        for steps in args.steps:
            plain = _peak(CHILD, str(steps), "plain", tmp)["peak_kib"]
            for mode in ("streamed", "held whole"):
                out = Path(tmp) / f"{mode.replace(' ', '-')}-{steps}"
                peak = _peak(CHILD, str(steps), mode, str(out))["peak_kib"]
                size = sum(p.stat().st_size for p in out.glob("trace-*.json.gz"))
                rows.append([steps, mode, f"{(peak - plain) / 1024:.1f}", f"{size / 1024:.0f}"])
            trace = Path(tmp) / f"streamed-{steps}" / "trace-0.json.gz"
            second = shutil.copy(trace, trace.with_name("trace-1.json.gz"))  # a second run
            for what, title in ANALYSES:
                for how, mode in (("step", "read a step at a time"), ("whole", "loaded whole")):
                    done = _peak(COMPARE, what, how, str(trace), str(second))
                    compared.append([title, steps, mode,
                                     f"{(done['peak_kib'] - imports) / 1024:.1f}",
                                     done["verdict"]])
    print(tabulate(rows, headers=["steps", "trace", "recording MiB (peak RSS over plain)",
                                  "trace KiB"]))
    print()
    print(tabulate(compared, headers=["analysis", "steps", "traces",
                                      "MiB (peak RSS over the imports)", "verdict"]))

if __name__ == "__main__":
    main()
