"""Op-level recording benchmark; prints tables. Run: python tests/benchmark_ops.py [--pairs N]

1. Overhead on one Mask R-CNN (v1, weights=None) train step at 128 px, batch 1, on the CPU
   with 1 thread by default (``--threads``): the plain step against the same step recorded
   at module level (Recorder), at op level (Recorder + OpRecorder) and under PyTorch's own
   DebugMode with tensor hashes of every op's outputs (``DebugMode.log_tensor_hashes`` with
   "norm", an L1 norm in float64, or "hash_tensor", an xor of the bits). The variants run in
   rounds on one model and batch (lr=0, so every step does the same work), in rotating
   order; each round gives one ratio per variant against that round's plain step, and the
   median ratio (wall and CPU time) is reported.
2. Localising a planted fault: the same train step runs twice from the same seed, the second
   time with one op's output changed by detaudit's own fault planting: +1 ULP in the first
   element of the first roi_align output, or two of the first nms's kept indices swapped (a
   permutation, as a nondeterministic sort makes). detaudit compares its op-level
   fingerprints (``compare_ops``, origin = inputs agree, outputs differ); DebugMode's logs,
   taken with the identical fault planted underneath it (so it sees the changed output as
   the op's own), are compared with ``DebugMode.check_hash_mismatches``, and the op it names
   is the first whose output hash differs.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tabulate import tabulate
from torch.utils._debug_mode import DebugMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmark import train_step as _step  # the same instrumented step as the module benchmark

from detaudit import Fault
from detaudit.analysis.compare import ORIGIN, compare_ops
from detaudit.config import ANY_MODULE, AuditConfig
from detaudit.drivers.loading import builtin_spec, make_factory
from detaudit.drivers.runner import run_repeat
from detaudit.record.oprecorder import OpRecorder, op_name
from detaudit.record.recorder import Recorder
from detaudit.seeding import seed_everything

PROBE = ("maskrcnn_v1", {"image_size": 128, "num_images": 1, "lr": 0.0})
HASHES = ("norm", "hash_tensor")  # DebugMode's two built-in tensor hashes
OP_LEVEL = "detaudit, op level (Recorder + OpRecorder)"
FAULTS = {
    "1-ULP": Fault("roi_heads.box_roi_pool", "forward", 0, op="torchvision.roi_align"),
    "permutation": Fault(ANY_MODULE, "forward", 0, op="torchvision.nms"),
}


def _factory() -> Callable[[torch.device], Any]:
    return make_factory(builtin_spec(*PROBE))


def _debug_variant(hash_fn: str) -> str:
    return f"DebugMode + log_tensor_hashes({hash_fn!r})"


@contextlib.contextmanager
def _debug_mode(hash_fn: str | list[str], into: list | None = None):
    """DebugMode with tensor hashes of every op's outputs; its logs go to `into`."""
    with DebugMode() as mode, DebugMode.log_tensor_hashes(hash_fn):
        yield
    if into is not None:
        into.extend(mode.logs)


def overhead(pairs: int) -> list[tuple]:
    """Median step time and median paired ratio to the plain step, per variant."""
    seed_everything(0)
    probe = _factory()(torch.device("cpu"))
    probe.model.train()
    batch = next(iter(probe.batches))
    recorder = Recorder(probe.model)
    counter = iter(range(10**9))

    def recorded(op_level: bool) -> Callable[[], None]:
        def run() -> None:
            step = next(counter)
            scope = (lambda: OpRecorder(recorder, step, record=True)) if op_level else None
            with recorder:
                _step(probe, batch, recorder, step, scope)
        return run

    variants: dict[str, Callable[[], None]] = {
        "plain": lambda: _step(probe, batch),
        "detaudit, module level (Recorder)": recorded(False),
        OP_LEVEL: recorded(True),
    }
    for hash_fn in HASHES:
        variants[_debug_variant(hash_fn)] = (
            lambda h=hash_fn: _step(probe, batch, scope=lambda: _debug_mode(h)))
    for run in variants.values():  # warm-up
        run()
    names = list(variants)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i in range(pairs):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:  # rotate the order each round
            t, c = time.perf_counter(), time.process_time()
            variants[name]()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    rows = []
    for name in names:
        ratios = [w / p for w, p in zip(wall[name], wall["plain"])]
        cpu_ratios = [c / p for c, p in zip(cpu[name], cpu["plain"])]
        rows.append((name, f"{statistics.median(wall[name]):.2f}",
                     f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}",
                     f"{statistics.median(cpu_ratios):.2f}x"))
    return rows


def _config(fault: Fault | None) -> AuditConfig:
    return AuditConfig(repeats=2, steps=1, fault=fault, granularity="op")


def detaudit_finding(clean: Any, fault: Fault) -> tuple[bool, str]:
    """Whether detaudit's op fingerprints differ, and the origin op it names."""
    faulted, _ = run_repeat(_factory(), _config(fault), 1)
    findings = compare_ops([clean, faulted])
    origins = [f for f in findings if f.role == ORIGIN]
    if not origins:
        return bool(findings), "-"
    first = origins[0]
    return True, (f"{first.op} in {first.module or '(model)'} (origin; "
                  f"+{len(findings) - 1} propagated)")


def debugmode_logs(fault: Fault | None) -> list:
    """DebugMode's logs of one train step, with `fault` planted by detaudit's OpRecorder
    underneath DebugMode (so DebugMode sees the changed output as the op's own)."""
    seed_everything(0)
    probe = _factory()(torch.device("cpu"))
    probe.model.train()
    batch = next(iter(probe.batches))
    logs: list = []

    @contextlib.contextmanager
    def scope():
        with OpRecorder(recorder, 0, record=False, fault=fault), _debug_mode(list(HASHES), logs):
            yield

    with Recorder(probe.model, fault=fault) as recorder:
        _step(probe, batch, recorder, 0, scope)
    if fault is not None and not recorder.fault_fired:
        raise RuntimeError(f"the planted fault {fault} never fired")
    return logs


def debugmode_finding(clean: list, faulted: list, which: int) -> tuple[bool, str]:
    """Whether DebugMode's output hashes (`which`: index into HASHES) differ anywhere, and
    the op it names: the first in execution order whose output hash differs."""
    try:
        mismatches = DebugMode.check_hash_mismatches(clean, faulted)
    except ValueError as error:  # the op sequences no longer line up
        return True, f"logs do not align ({str(error).splitlines()[0][:60]})"
    mine = [m for m in mismatches if m["pytree_path"].endswith(f"[{which}]")]
    if not mine:
        return False, "-"
    for index, (a, b) in enumerate(zip(clean, faulted)):
        if a.log and "hash" in a.log and _differs(a.log["hash"], b.log["hash"], which):
            return True, f"{op_name(a.op)}, log entry #{index} (+{len(mine) - 1} later)"
    return True, "?"


def _differs(x: Any, y: Any, which: int) -> bool:
    """Whether hash number `which` of any tensor differs between two hash trees."""
    if isinstance(x, tuple) and len(x) == len(HASHES) and not isinstance(x[0], (tuple, list)):
        return x[which] != y[which]
    if isinstance(x, (list, tuple)):
        return len(x) != len(y) or any(_differs(a, b, which) for a, b in zip(x, y))
    return x != y


def localisation(ratios: dict[str, str]) -> list[tuple]:
    """One row per tool: overhead, and what each planted fault shows."""
    clean, _ = run_repeat(_factory(), _config(None), 0)
    ours = {kind: detaudit_finding(clean, fault) for kind, fault in FAULTS.items()}
    clean_logs = debugmode_logs(None)
    theirs = {kind: debugmode_logs(fault) for kind, fault in FAULTS.items()}
    rows = [("detaudit op level (xxh3 of bytes)", ratios[OP_LEVEL], *_cells(ours))]
    for which, hash_fn in enumerate(HASHES):
        found = {kind: debugmode_finding(clean_logs, logs, which) for kind, logs in theirs.items()}
        rows.append((f"DebugMode, {hash_fn!r} hash", ratios[_debug_variant(hash_fn)],
                     *_cells(found)))
    return rows


def _cells(found: dict[str, tuple[bool, str]]) -> list[str]:
    return [*("yes" if found[kind][0] else "no" for kind in FAULTS),
            *(found[kind][1] for kind in FAULTS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="rounds of paired steps")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 is steadiest on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s); "
          "Mask R-CNN v1 train step, 128 px, batch 1\n")
    rows = overhead(args.pairs)
    print(tabulate(rows, headers=["variant", "median wall s", "median ratio to plain",
                                  f"range ({args.pairs} rounds)", "median CPU-time ratio"]))
    ratios = {row[0]: row[2] for row in rows}
    print()
    print(tabulate(localisation(ratios), headers=[
        "tool", "overhead", "detects 1-ULP", "detects permutation",
        f"op named ({FAULTS['1-ULP'].op} +1 ULP)", f"op named ({FAULTS['permutation'].op} swap)"]))
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
