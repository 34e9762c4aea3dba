"""Speed and memory benchmarks; prints tables. Run: python tests/benchmark.py [--pairs N]

1. Recording overhead on a Mask R-CNN (v1) train step at 128 px: plain and recorded steps
   alternate on the same model and batch (lr=0 and the RNG reset before each step, so every
   step does the same work), and the median of the paired ratios is reported (robust on a
   shared, noisy machine). Two floors run the same way with the xxh3 kernel swapped out: the
   same bytes read once and not hashed, and no byte read at all (the hooks' bookkeeping).
   Then the time spent inside the recorder per step, by entry point, for the same variants.
2. Fingerprint throughput on a 256 MB tensor against `x.sum()` and hashlib.sha256, and the
   per-call cost on small tensors.
3. Trace size against image size: records, not tensor bytes, set what a trace holds.
4. The cost of the proof by re-execution (--stress): the `detaudit run --model maskrcnn`
   CPU-preset audit (no investigations) with --stress 0 and --stress 16, alternating, and
   the re-executions' own time as the audit counts it.
5. A whole audit, `detaudit run --model maskrcnn` (CPU preset), at scan level (the default)
   and at module level, deterministic and with a planted fault: wall time and peak memory.
   The recorded variants of 1. include the zoomed step (module and op level in one pass).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from detaudit import api, audit
from detaudit.config import CPU_PRESET, AuditConfig, Investigations
from detaudit.drivers.loading import builtin_spec, make_factory
from detaudit.record import fingerprint as fingerprint_module
from detaudit.record.fingerprint import CHUNK_BYTES, Fingerprinter, fingerprint
from detaudit.record.oprecorder import OpRecorder
from detaudit.record.recorder import Recorder
from detaudit.record.structure import iter_tensors
from detaudit.seeding import seed_everything
from detaudit.trace import OPTIMIZER


def train_step(probe, batch, recorder=None, step=0, scope=None):
    """One train step, recorded when `recorder` is given; `scope()` (a dispatch mode) wraps
    its forward and backward."""
    if recorder:
        recorder.begin_step(step)
        recorder.record_state(batch)
    with scope() if scope else contextlib.nullcontext():
        losses = probe.step(probe.model, batch)
        total = sum(losses.values())
        if recorder:
            recorder.before_backward(total)
        total.backward()
    if recorder:
        recorder.record_param_grads(stats=recorder._records_modules)  # a scan: no stats
    probe.optimizer.step()
    probe.optimizer.zero_grad(set_to_none=True)
    if recorder:
        recorder.record_parameters(OPTIMIZER)
        if recorder._records_modules:  # a scanned step keeps optimizer state at epoch ends
            recorder.record_optimizer(probe.optimizer)
        recorder.end_step()


def _read_once(a, start, stop, header, stats, alone=True):
    """Stands in for the xxh3 kernel: one read of the same bytes, nothing computed."""
    return int(a[start:stop].view(np.uint8).max()), (0.0, 0.0, 0.0, 0.0) if stats else None


def _read_nothing(a, start, stop, header, stats, alone=True):
    """Stands in for the xxh3 kernel: no byte read at all (the hooks' bookkeeping only)."""
    return 0, (0.0, 0.0, 0.0, 0.0) if stats else None


def _maskrcnn_warmed_up():
    """A Mask R-CNN v1 probe at 128 px (lr=0: every step does the same work), its one batch,
    and one step already taken."""
    seed_everything(0)
    factory = make_factory(builtin_spec("maskrcnn_v1", {"image_size": 128, "num_images": 1,
                                                         "lr": 0.0}))
    probe = factory(torch.device("cpu"))
    probe.model.train()
    batch = next(iter(probe.batches))
    train_step(probe, batch)
    return probe, batch


# Each recorded variant and what it swaps out: the real recorder, then two floors under it,
# with the xxh3 kernel replaced.
ZOOMED = "zoomed step: module + op level in one pass"
VARIANTS = {
    "recorded (xxh3 + stats)": {},
    "floor: same bytes read once, no hash": {(fingerprint_module, "_hash_piece"): _read_once},
    "floor: bookkeeping only, no byte read": {(fingerprint_module, "_hash_piece"): _read_nothing},
    "scan: step state only (xxh3)": {},
    "scan floor: same bytes read once": {(fingerprint_module, "_hash_piece"): _read_once},
    ZOOMED: {},
}


def _scope(name: str | None, recorder: Recorder | None, step: int):
    """The op level of a zoomed step (the recorder's module hooks record the same step)."""
    return (lambda: OpRecorder(recorder, step, record=True)) if name == ZOOMED else None


def _recorder(name: str, model) -> Recorder:
    """The recorder a variant runs: module level, or a scan (no module hooks)."""
    return Recorder(model, watch="none" if name.startswith("scan") else "module")


@contextlib.contextmanager
def _swapped(patches: dict):
    """Each (module, attribute) replaced as a variant asks, for the duration of the block."""
    with contextlib.ExitStack() as stack:
        for (module, attr), replacement in patches.items():
            stack.enter_context(mock.patch.object(module, attr, replacement))
        yield


def recording_overhead(pairs: int) -> list[tuple]:
    """Per round: a plain step, then one recorded step per variant, each on the same model and
    batch with the RNG reset, so every step samples the same proposals and does the same work.
    Only the step is timed: entering the recorder (registering hooks) is once per repeat."""
    probe, batch = _maskrcnn_warmed_up()
    times: dict[str | None, list[float]] = {None: [], **{name: [] for name in VARIANTS}}
    for i in range(pairs):
        for name, samples in times.items():
            gc.collect()
            torch.manual_seed(i)
            recording = _recorder(name, probe.model) if name else contextlib.nullcontext()
            with _swapped(VARIANTS.get(name, {})), recording as recorder:
                t0 = time.perf_counter()
                train_step(probe, batch, recorder, i, _scope(name, recorder, i))  # None: plain
                samples.append(time.perf_counter() - t0)
    plain = times.pop(None)
    rows = [("plain step", f"{statistics.median(plain):.3f}", "", pairs)]
    for name, recorded in times.items():
        ratios = [r / p for r, p in zip(recorded, plain)]
        rows.append((name, f"{statistics.median(recorded):.3f}",
                     f"{(statistics.median(ratios) - 1) * 100:+.1f}%", pairs))
    return rows


def _timed(fn, totals: dict[str, list[float]], label: str):
    """`fn`, adding its wall time and call count to `totals[label]`."""
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = totals.setdefault(label, [0.0, 0])
            entry[0] += time.perf_counter() - t0
            entry[1] += 1
    return timed


def time_inside_recorder(steps: int) -> tuple[list[str], list[tuple]]:
    """Wall time spent inside the recorder's hooks and calls per recorded step, by entry point,
    for each variant of `recording_overhead`: a low-noise view of detaudit's own cost, which
    leaves out what it costs the model around it (caches, slower module calls)."""
    probe, batch = _maskrcnn_warmed_up()
    columns: list[dict[str, list[float]]] = []
    for variant, patches in VARIANTS.items():
        totals: dict[str, list[float]] = {}
        recorder = _recorder(variant, probe.model)
        for name in ("_pre_hook", "_post_hook", "before_backward", "record_state",
                     "record_param_grads", "record_parameters", "record_optimizer", "end_step"):
            setattr(recorder, name, _timed(getattr(recorder, name), totals, name.strip("_")))
        for factory_name, label in (("_grad_out_hook", "gradient hooks (outputs)"),
                                    ("_boundary_hook", "gradient hooks (inputs)")):
            make = getattr(recorder, factory_name)
            setattr(recorder, factory_name,
                    lambda *a, _make=make, _totals=totals, _label=label: _timed(
                        _make(*a), _totals, _label))
        gc.collect()
        with _swapped(patches), recorder:
            for i in range(steps):
                torch.manual_seed(i)
                train_step(probe, batch, recorder, i, _scope(variant, recorder, i))
        columns.append(totals)
    order = sorted(columns[0], key=lambda name: -columns[0][name][0])
    rows = [(name, *(f"{c.get(name, [0.0])[0] / steps * 1e3:.1f}" for c in columns),
             columns[0][name][1] // steps) for name in order]
    rows.append(("total", *(f"{sum(v[0] for v in c.values()) / steps * 1e3:.1f}"
                            for c in columns), ""))
    return ["inside the recorder, ms per step", *VARIANTS, "calls"], rows


def bytes_per_step() -> list[tuple]:
    """Bytes fingerprinted per Mask R-CNN step, module level vs scan, counted by the
    fingerprinter itself (what one read of them costs is the floor rows above)."""
    probe, batch = _maskrcnn_warmed_up()
    rows = []
    for name in ("recorded (xxh3 + stats)", "scan: step state only (xxh3)"):
        counted = {"bytes": 0, "tensors": 0}
        real = fingerprint_module._hash_piece

        def counting(a, start, stop, *args, counted=counted, real=real, **kwargs):
            counted["bytes"] += (stop - start) * a.itemsize
            counted["tensors"] += start == 0
            return real(a, start, stop, *args, **kwargs)

        with mock.patch.object(fingerprint_module, "_hash_piece", counting), \
                _recorder(name, probe.model) as recorder:
            torch.manual_seed(0)
            train_step(probe, batch, recorder, 0)
        rows.append((name, f"{counted['bytes'] / 1e6:.0f} MB", counted["tensors"]))
    return rows


def _best(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _sha256(view) -> bytes:
    """sha256 of the same zero-copy byte view, fed in the fingerprint's 1 MiB chunks."""
    h = hashlib.sha256()
    for start in range(0, len(view), CHUNK_BYTES):
        h.update(view[start : start + CHUNK_BYTES])
    return h.digest()


def fingerprint_speed() -> tuple[list[tuple], list[tuple]]:
    x = torch.randn(64 * 1024 * 1024)  # 256 MB
    gb = x.numel() * 4 / 1e9
    view = x.numpy().view("uint8")
    threads = torch.get_num_threads()

    def one_thread_print():
        torch.set_num_threads(1)
        try:
            fingerprint(x, "xxh3", stats=False)
        finally:
            torch.set_num_threads(threads)

    t_sum = _best(lambda: x.sum())
    t_xxh = _best(lambda: fingerprint(x, "xxh3", stats=False))
    t_xxh1 = _best(one_thread_print)
    t_xxh_stats = _best(lambda: fingerprint(x, "xxh3"))
    t_wsum = _best(lambda: fingerprint(x, "wsum", stats=False), 2)
    t_sha = _best(lambda: _sha256(view), 2)
    big = [
        (f"x.sum() (read bandwidth, {threads} threads)", f"{gb / t_sum:.1f}", "1.00", ""),
        (f"xxh3 fingerprint ({threads} threads)", f"{gb / t_xxh:.1f}", f"{t_sum / t_xxh:.2f}",
         f"{t_sha / t_xxh:.1f}"),
        ("xxh3 fingerprint (1 thread)", f"{gb / t_xxh1:.1f}", f"{t_sum / t_xxh1:.2f}",
         f"{t_sha / t_xxh1:.1f}"),
        (f"xxh3 fingerprint + stats ({threads} threads)", f"{gb / t_xxh_stats:.1f}",
         f"{t_sum / t_xxh_stats:.2f}", f"{t_sha / t_xxh_stats:.1f}"),
        ("wsum (device algorithm, on CPU)", f"{gb / t_wsum:.1f}", f"{t_sum / t_wsum:.2f}", ""),
        ("hashlib.sha256 (one stream, same view and chunks)", f"{gb / t_sha:.2f}",
         f"{t_sum / t_sha:.2f}", "1.0"),
    ]
    tensors = [torch.randn(64) for _ in range(2000)]
    per_call: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(11):  # alternating rounds, median: robust on a shared machine
        for stats in (False, True):
            f = Fingerprinter(stats=stats)
            t = time.perf_counter()
            for s in tensors:
                f.add(s)
            f.collect()
            per_call[stats].append((time.perf_counter() - t) / len(tensors) * 1e6)
    small = [(f"64-element tensor, stats={stats}", f"{statistics.median(times):.1f}")
             for stats, times in per_call.items()]
    return big, small


def batch_state_print() -> list[tuple]:
    """The step state of the CUDA preset's batch (Mask R-CNN, 800 px, batch 2, a 3-instance
    mask per image), printed where it lives (CPU): as loaded, as `run` and `exec` record it
    (xxh3 in every dtype), and with the integer targets by wsum (how a batch the model is
    called with is printed); several tensors at once, alternating, median of 5."""
    factory = make_factory(builtin_spec("maskrcnn_v1", {"image_size": 800, "batch_size": 2,
                                                         "num_images": 2}))
    tensors = [t for _, t in iter_tensors(next(iter(factory(torch.device("cpu")).batches)))]
    times: dict[str | None, list[float]] = {"xxh3": [], None: []}
    for _ in range(6):
        for algorithm, samples in times.items():
            f = Fingerprinter(stats=False)
            t = time.perf_counter()
            f.add_many(tensors, algorithm=algorithm)
            f.collect()
            samples.append(time.perf_counter() - t)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return [(f"800 px, batch 2, {label}", len(tensors), f"{nbytes / 1e6:.1f}",
             f"{statistics.median(times[algorithm][1:]) * 1e3:.1f}")
            for label, algorithm in (("as loaded (xxh3)", "xxh3"),
                                     ("integers by wsum", None))]


def trace_size() -> list[tuple]:
    rows = []
    for size in (64, 128):
        factory = make_factory(builtin_spec("fasterrcnn_mobilenet", {"image_size": size,
                                                                      "num_images": 1}))
        trace = audit(factory, repeats=1, steps=1).traces[0]
        data = json.dumps(trace.to_dict()).encode()
        rows.append((f"{size} px", len(trace), f"{len(data) / 1e6:.2f}",
                     f"{len(gzip.compress(data)) / 1e6:.2f}"))
    return rows


def stress_cost(pairs: int) -> list[tuple]:
    """The CPU-preset Mask R-CNN audit without and with the stress, alternating."""
    p = CPU_PRESET
    spec = builtin_spec("maskrcnn", {"seed": 0, "image_size": p.image_size,
                                     "batch_size": p.batch_size, "num_images": p.num_images})
    seconds: dict[int, list[float]] = {0: [], 16: []}
    stressed: list[float] = []
    for _ in range(pairs):
        for runs, samples in seconds.items():
            config = AuditConfig(repeats=p.repeats, epochs=p.epochs, steps=p.steps, stress=runs)
            t0 = time.perf_counter()
            result = api.run(spec, config, investigations=Investigations(drill_down=False))
            samples.append(time.perf_counter() - t0)
            if runs:
                stressed.append(sum(t.get("stress_seconds", 0.0) for t in result.info.timings))
    ratios = [b / a for a, b in zip(seconds[0], seconds[16])]
    return [
        ("--stress 0", f"{statistics.median(seconds[0]):.1f}", "", "", pairs),
        ("--stress 16 (default)", f"{statistics.median(seconds[16]):.1f}",
         f"{(statistics.median(ratios) - 1) * 100:+.1f}%", f"{statistics.median(stressed):.2f}",
         pairs),
    ]


WHOLE_AUDIT = r"""
import json, resource, sys, time
from detaudit.cli import main
started = time.perf_counter()
code = main(sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.perf_counter() - started,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def whole_audit() -> list[tuple]:
    """`detaudit run --model maskrcnn` (CPU preset) at scan level (the default) against
    module level, deterministic and with a planted fault (a scan then zooms into its step):
    wall time and peak RSS, each in a fresh process."""
    import subprocess
    import tempfile

    rows = []
    fault = ["--inject-fault", "roi_heads.box_head@backward:2"]
    with tempfile.TemporaryDirectory() as tmp:
        for label, options in (("scan (default)", []), ("module level", ["--granularity", "module"]),
                               ("scan + zoom, planted fault", fault),
                               ("module level, planted fault", ["--granularity", "module", *fault])):
            out = Path(tmp) / str(len(rows))
            done = subprocess.run([sys.executable, "-c", WHOLE_AUDIT, "run", "--model", "maskrcnn",
                                   "--quiet", "--out", str(out), *options],
                                  capture_output=True, text=True, check=False)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append((label, result["code"], f"{result['seconds']:.1f}",
                         f"{result['peak_mib']:.0f}"))
    return rows


def _overhead_tables(pairs: int) -> None:
    print(tabulate(recording_overhead(pairs),
                   headers=["Mask R-CNN v1 train step, 128 px", "s (median)",
                            "overhead (median ratio)", "pairs"]))
    print()
    headers, rows = time_inside_recorder(pairs)
    print(tabulate(rows, headers=headers))
    print()
    print(tabulate(bytes_per_step(), headers=["fingerprinted per step", "bytes", "pieces"]))


def _speed_tables(pairs: int) -> None:
    big, small = fingerprint_speed()
    print(tabulate(big, headers=["256 MB float32", "GB/s", "speed vs x.sum()",
                                 "speed vs sha256"]))
    print()
    print(tabulate(small, headers=["per call", "µs"]))
    print()
    print(tabulate(batch_state_print(), headers=["batch printed on CPU (scan step state)",
                                                 "tensors", "MB", "ms (median)"]))
    print()
    print(tabulate(trace_size(), headers=["trace of 1 step", "records", "JSON MB", "gzip MB"]))


def _audit_tables(pairs: int) -> None:
    print(tabulate(whole_audit(), headers=["detaudit run --model maskrcnn (CPU preset)",
                                           "exit code", "wall s", "peak RSS MiB"]))
    print()
    print(tabulate(stress_cost(max(1, pairs // 3)),
                   headers=["detaudit run --model maskrcnn (CPU preset)", "s (median)",
                            "vs --stress 0 (median ratio)", "re-executions, s", "pairs"]))


TABLES = {"overhead": _overhead_tables, "speed": _speed_tables, "audit": _audit_tables}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6, help="paired steps for the overhead")
    parser.add_argument("--only", choices=list(TABLES), nargs="+", default=list(TABLES),
                        help="which tables: overhead (1.), speed (2., 3.), audit (4., 5.)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    for name in args.only:
        TABLES[name](args.pairs)
        print()


if __name__ == "__main__":
    main()
