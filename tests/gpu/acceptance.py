"""The GPU acceptance run: one command, under 10 minutes on one modern GPU, a table of results.

    python tests/gpu/acceptance.py            # on a CUDA machine
    python tests/gpu/acceptance.py --smoke    # the same steps on CPU at toy sizes (checks the script)

Rows:
1. the seed scenario, `detaudit run --model maskrcnn` at the CUDA preset (800 px, batch 2,
   2 epochs): verdict, first divergent step and epoch, origin module and op (expected:
   torchvision's roi_align backward, atomicAdd, in roi_heads.box_roi_pool or mask_roi_pool);
2. the dense single-class case (`--instances 1000 --num-images 1`);
3. `--verify-fix`: deterministic with the fix, at what step-time and peak-memory cost;
4. the census and its alerts under deterministic mode, with no error;
5. fingerprint throughput against HBM read bandwidth (`x.sum()`), per-call cost, and the
   recording's peak memory over a plain step;
6. `--nproc 2` on NCCL when two GPUs are present.
Each audit runs as a subprocess (`python -m detaudit ... --json`); the table is printed at the
end, and each run folder is kept under the output folder (`--out`, default
reports/gpu-acceptance).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from detaudit.record.fingerprint import Fingerprinter


def audit(out: Path, name: str, *args: str, timeout: int = 540) -> tuple[dict, float, int]:
    """Run one `detaudit run` and return its summary, wall time and exit code (the summary is
    also kept as NAME.json in `out`)."""
    folder = out / name
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "detaudit", "run", *args, "--out", str(folder), "--overwrite",
         "--json", "--quiet"],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False,
    )
    seconds = time.perf_counter() - started
    try:
        summary = json.loads(done.stdout)
    except json.JSONDecodeError:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        summary = {"headline": f"no summary (exit {done.returncode}): {last}"}
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary, seconds, done.returncode


def where(summary: dict) -> str:
    """Origin module and op of a summary, as one cell."""
    first = summary.get("first_divergence") or {}
    ops = summary.get("ops") or [{}]
    op = ops[0].get("op") if ops[0].get("role") == "origin" else None
    if not first:
        return "-"
    text = f"step {first['step']} (epoch {first['epoch']}), {first['phase']}, {first['module']}"
    return text + (f", op {op}" if op else "")


def throughput(device: str, size_mb: int) -> tuple[str, str, str, str]:
    """Fingerprint GB/s vs x.sum() GB/s, per-call cost, and recording's extra peak memory."""
    x = torch.randn(size_mb * (1 << 20) // 4, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn, rounds=5):
        best = float("inf")
        for _ in range(rounds):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t)
        return best

    def printed():
        fp = Fingerprinter()
        fp.add(x)
        fp.collect()

    gb = x.numel() * 4 / 1e9
    fp_rate, sum_rate = gb / timed(printed), gb / timed(lambda: x.sum().item())
    small = [torch.randn(64, device=device) for _ in range(2000)]

    def many():
        fp = Fingerprinter()
        for t in small:
            fp.add(t)
        fp.collect()

    per_call = timed(many, 3) / len(small) * 1e6
    peak = "-"
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        printed()
        peak = f"{(torch.cuda.max_memory_allocated() - base) / x.nbytes:.2f}x the tensor"
    return (f"{fp_rate:.1f} GB/s", f"{sum_rate:.1f} GB/s ({fp_rate / sum_rate:.2f}x)",
            f"{per_call:.1f} us", peak)


ROWS = ("seed", "dense", "verify", "throughput", "nproc")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes: check the script")
    parser.add_argument("--out", default="reports/gpu-acceptance", help="run folders go here")
    parser.add_argument("--only", nargs="+", choices=ROWS, default=list(ROWS),
                        help="the rows to run (default: all)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to accept here (use --smoke to check the script)")
        return 0
    out = ROOT / args.out
    if args.smoke:
        device, sizes = "cpu", ["--image-size", "96", "--epochs", "1", "--steps", "1"]
        dense = ["--image-size", "96", "--epochs", "1", "--steps", "1"]
    else:
        device, sizes, dense = "cuda", ["--epochs", "2"], ["--epochs", "2", "--steps", "1"]
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def add(row: tuple) -> None:
        """A row of the table, also printed at once (a run cut short keeps the rows so far)."""
        rows.append(row)
        print(" | ".join(str(cell) for cell in row), flush=True)
    started = time.perf_counter()
    if "seed" in args.only:
        summary, seconds, code = audit(out, "seed", "--model", "maskrcnn", "--device", device,
                                       *sizes)
        add(("seed scenario (maskrcnn, preset)", summary.get("verdict", "?"), where(summary),
             f"{seconds:.0f} s, exit {code}"))
        census_errors = summary.get("census_errors") or []
        add(("census (one step) and alerts", (f"{len(summary.get('census') or [])} ops, "
             f"{len(summary.get('census_alerts') or [])} alerts"),
             "; ".join(census_errors) or "no error", ""))
    if "dense" in args.only:
        summary, seconds, code = audit(out, "dense", "--model", "maskrcnn", "--device", device,
                                       "--instances", "1000", "--num-images", "1", *dense)
        add(("dense single class (1000 instances)", summary.get("verdict", "?"),
             where(summary), f"{seconds:.0f} s, exit {code}"))
    if "verify" in args.only:
        summary, seconds, code = audit(out, "verify", "--model", "maskrcnn", "--device", device,
                                       "--verify-fix", "--no-census", *sizes)
        verify = (summary.get("extra") or {}).get("verify") or {}
        add(("--verify-fix", verify.get("headline", verify.get("error", "-")),
             (f"step time {verify.get('step_time_ratio') or 0:.2f}x, peak memory "
              f"{verify.get('peak_memory_ratio') or 0:.2f}x"), f"{seconds:.0f} s"))
    if "throughput" in args.only:
        fp, sums, per_call, peak = throughput(device, 16 if args.smoke else 1024)
        add(("fingerprint throughput vs x.sum()", fp, sums,
             f"per call {per_call}, peak {peak}"))
    if "nproc" in args.only and not args.smoke and torch.cuda.device_count() >= 2:
        summary, seconds, code = audit(out, "nproc2", "--model", "maskrcnn", "--nproc", "2",
                                       "--epochs", "1", "--steps", "2")
        add(("--nproc 2 (NCCL)", summary.get("verdict", "?"), summary.get("headline", ""),
             f"{seconds:.0f} s, exit {code}"))
    elif "nproc" in args.only:
        add(("--nproc 2 (NCCL)", "skipped", "fewer than two GPUs", ""))
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (smoke)"
    print(f"detaudit GPU acceptance, {time.strftime('%Y-%m-%d')}, {name}, torch "
          f"{torch.__version__}, {time.perf_counter() - started:.0f} s")
    print(tabulate(rows, headers=["check", "result", "detail", "cost"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
