"""`detaudit exec` overhead: the same training script run plain and under `exec` (scan only,
one run; and with `--stress 0`, which leaves out the re-execution of risky ops at each
epoch's first step), in alternating pairs on this machine, and the cost of one zoom re-run. Then the low-
noise view: the time spent inside detaudit's hooks per step of the same model, in one process,
against the plain step; and exec's fixed cost (its start, the comparison, the reports).

    python tests/benchmark_exec.py [--pairs 3] [--steps 200]
    python tests/benchmark_exec.py --device cuda --size 224 --batch-size 64 --steps 400  # GPU

Prints a table. Ratios are measured within each pair (the order alternates), so that a
shared, noisy machine shifts both sides of a pair alike. Beside wall time, the CPU time of the
whole process tree (user + system, the DataLoader workers included): other jobs on a shared
machine stretch wall time far more than the work a command does.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

SCRIPT = Path(__file__).parent / "scripts" / "train_resnet.py"
NOT_COMPARED = 2  # the exit code of one run recorded alone (the overhead is that of one run)


def _timed(command: list[str], exit_code: int = 0) -> tuple[float, float]:
    """Wall time and CPU time (user + system, every process of the tree) of `command`, which
    must end with `exit_code`."""
    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    started, cpu_before = time.perf_counter(), cpu()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != exit_code:
        raise SystemExit(f"{command[:4]} ended with exit code {done.returncode}: "
                         f"{done.stdout[-500:]}{done.stderr[-500:]}")
    return time.perf_counter() - started, cpu() - cpu_before


INSIDE = r"""
import json, sys, tempfile, time
import torch, torchvision
from torch import nn
from detaudit.drivers.attach import Attachment

steps, device, size, batch = int(sys.argv[1]), torch.device(sys.argv[2]), *map(int, sys.argv[3:])
torch.manual_seed(0)
model = torchvision.models.resnet18(num_classes=10).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(batch, 3, size, size, device=device)
y = torch.randint(0, 10, (batch,), device=device)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

def loop(n):
    for _ in range(n):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    sync()

loop(3)  # warm-up
started = time.perf_counter()
loop(steps)
plain = (time.perf_counter() - started) / steps
# the floor: one read of what a scan prints each step (the gradients as the update gets them,
# the parameters after it), timed right after a step, as the prints run
reads, printed = [], 0
for _ in range(5):
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    tensors = [t for p in model.parameters() for t in (p.grad, p.detach()) if t is not None]
    sync()
    t0 = time.perf_counter()
    for t in tensors:
        t.sum()
    sync()
    reads.append(time.perf_counter() - t0)
    printed = sum(t.numel() * t.element_size() for t in tensors)
    opt.zero_grad()
inside = {}
with tempfile.TemporaryDirectory() as tmp:
    attachment = Attachment(f"{tmp}/trace.json.gz", {}, model=model, optimizer=opt)
    for name in ("_global_pre", "_global_post", "on_backward", "_before_update",
                 "_after_update"):
        def timed(*args, _real=getattr(attachment, name), _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                inside[_name] = inside.get(_name, 0.0) + time.perf_counter() - t0
        setattr(attachment, name, timed)
    attachment.install()
    started = time.perf_counter()
    loop(steps)
    recorded = (time.perf_counter() - started) / steps
    attachment.finish()
    attachment.uninstall()
print(json.dumps({"plain": plain, "recorded": recorded, "printed": printed,
                  "read": sorted(reads)[len(reads) // 2],
                  "inside": {k: v / steps for k, v in inside.items()}}))
"""


def time_inside(steps: int, device: str, size: int, batch: int) -> list[list[str]]:
    """Per step of ResNet-18 in one process: the plain step, the time spent inside
    detaudit's hooks (each top-level entry point: what they call is theirs), and the floor
    of a scan's cost, one read of the bytes it prints."""
    done = subprocess.run([sys.executable, "-c", INSIDE, str(steps), device, str(size),
                           str(batch)], check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [[name, f"{1e3 * seconds:.1f}"] for name, seconds in
            sorted(result["inside"].items(), key=lambda item: -item[1])]
    total = sum(result["inside"].values())
    rows.append(["inside detaudit, total", f"{1e3 * total:.1f}",
                 f"{100 * total / result['plain']:.1f} % of the plain step"])
    rows.append(["plain step", f"{1e3 * result['plain']:.1f}", ""])
    rows.append(["floor: one read of the bytes a scan prints", f"{1e3 * result['read']:.1f}",
                 (f"{result['printed'] / 1e6:.1f} MB (gradients and parameters); "
                  f"{100 * result['read'] / result['plain']:.1f} % of the plain step")])
    rows.append(["recorded step (wall)", f"{1e3 * result['recorded']:.1f}",
                 f"{100 * (result['recorded'] / result['plain'] - 1):+.1f} %"])
    return rows


def fixed_cost(tmp: str) -> float:
    """Wall time of exec around a command that trains one tiny step: exec's start, its
    bootstrap in the command, the comparison and the reports, with almost no training."""
    tiny = ("import torch; m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), 0.1); "
            "m(torch.ones(1, 2)).sum().backward(); o.step()")
    plain = _timed([sys.executable, "-c", tiny])[0]
    audited = _timed([sys.executable, "-m", "detaudit", "exec", "--repeats", "1", "--quiet",
                      "--out", str(Path(tmp) / "fixed"), "--", sys.executable, "-c", tiny],
                     NOT_COMPARED)[0]
    return audited - plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3,
                        help="paired plain and exec runs (0: the in-process table only)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--inside-steps", type=int, default=30,
                        help="steps of the in-process view of detaudit's own time")
    parser.add_argument("--device", default="cpu", help="where the script trains")
    parser.add_argument("--size", type=int, default=64, help="image size (px)")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    script = [sys.executable, str(SCRIPT), "--steps", str(args.steps), "--device", args.device,
              "--size", str(args.size), "--batch-size", str(args.batch_size)]
    # The low-noise view first, each pair as it ends: a run cut short still tells something.
    print(tabulate(time_inside(args.inside_steps, args.device, args.size, args.batch_size),
                   headers=["per step, one process", "ms", ""]) + "\n", flush=True)
    if args.pairs < 1:
        return
    rows, ratios, cpu_ratios, stress_costs = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        def audited(name: str, *options: str) -> list[str]:
            return [sys.executable, "-m", "detaudit", "exec", "--repeats", "1", "--quiet",
                    "--out", str(Path(tmp) / name), *options, "--", *script]

        for pair in range(args.pairs):
            first_plain = pair % 2 == 0
            plain = exec_ = unstressed = (0.0, 0.0)
            for side in ((0, 1, 2) if first_plain else (2, 1, 0)):
                if side == 0:
                    plain = _timed(script)
                elif side == 1:
                    exec_ = _timed(audited(f"exec-{pair}", "--seed", "0"), NOT_COMPARED)
                else:
                    unstressed = _timed(audited(f"unstressed-{pair}", "--seed", "0",
                                                "--stress", "0"), NOT_COMPARED)
            ratios.append(exec_[0] / plain[0] - 1)
            cpu_ratios.append(exec_[1] / plain[1] - 1)
            stress_costs.append(exec_[0] - unstressed[0])
            rows.append([pair + 1, "plain first" if first_plain else "exec first",
                         f"{plain[0]:.1f}", f"{exec_[0]:.1f}", f"{100 * ratios[-1]:+.1f} %",
                         f"{plain[1]:.1f}", f"{exec_[1]:.1f}", f"{100 * cpu_ratios[-1]:+.1f} %",
                         f"{unstressed[0]:.1f}"])
            print(f"pair {pair + 1}: plain {plain[0]:.1f} s, exec {exec_[0]:.1f} s "
                  f"({100 * ratios[-1]:+.1f} %)", file=sys.stderr, flush=True)
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
        fixed = fixed_cost(tmp)
    print(tabulate(rows, headers=["pair", "order", "plain wall s", "exec wall s", "wall",
                                  "plain CPU s", "exec CPU s", "CPU", "exec --stress 0 wall s"]))
    print(f"\nmedian overhead of exec (scan, 1 run, {args.steps} steps of ResNet-18 at "
          f"{args.size} px, batch {args.batch_size}, {args.device}): wall "
          f"{100 * statistics.median(ratios):+.1f} %, "
          f"CPU time {100 * statistics.median(cpu_ratios):+.1f} %")
    print(f"the stress (risky ops re-executed at each epoch's first step), median: "
          f"{statistics.median(stress_costs):+.2f} s of wall time")
    print(f"zoom into step {step} (2 runs re-run to it, that step at module and op level): "
          f"{with_zoom - without:.1f} s on top of the {without:.1f} s scan")
    print(f"exec's fixed cost (start, bootstrap, comparison, reports): {fixed:.2f} s")


if __name__ == "__main__":
    main()
