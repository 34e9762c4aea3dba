"""Zoom benchmark: measuring the origin op from the outputs the zoom's replays kept, against
replaying two repeats once more to capture them; prints a table.
Run: python tests/benchmark_zoom.py [--pairs N] [--image-size PX]

A whole audit (`detaudit.audit`) of the built-in Mask R-CNN probe on the CPU, 2 repeats x 2
epochs x 1 step, with a 1-ULP fault planted in ROIAlign's backward at step 1: the scan parts
there, the zoom replays both repeats to it, and the drill-down names and measures the op.
"kept" is the audit as it is; "capture replays" is the same audit with the kept outputs
ignored (the drill-down then replays both repeats once more, as it did before the zoom kept
them). The two run in alternating order, pair after pair, in one process; the table gives
each one's median wall time, the median ratio of the pairs, and the difference each
measured (they must agree).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from detaudit import Fault, audit
from detaudit.drivers.loading import builtin_spec, make_factory
from detaudit.investigate import drilldown

FAULT = Fault("roi_heads.mask_roi_pool", "backward", 1, op="torchvision.roi_align")


def _audit(factory: Any, kept: bool) -> tuple[float, dict[str, Any]]:
    """One audit's wall time and its origin op's row."""
    started = time.perf_counter()
    if kept:
        result = audit(factory, repeats=2, epochs=2, steps=1, stress=0, fault=FAULT)
    else:
        with mock.patch.object(drilldown, "_kept_difference", lambda *args: None):
            result = audit(factory, repeats=2, epochs=2, steps=1, stress=0, fault=FAULT)
    seconds = time.perf_counter() - started
    return seconds, result.investigations["ops"]["ops"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()
    factory = make_factory(builtin_spec("maskrcnn", {"image_size": args.image_size}))
    times: dict[bool, list[float]] = {True: [], False: []}
    rows: dict[bool, dict[str, Any]] = {}
    ratios = []
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for kept in order:
            seconds, rows[kept] = _audit(factory, kept)
            times[kept].append(seconds)
        ratios.append(times[True][-1] / times[False][-1])
    table = [[name, f"{statistics.median(times[kept]):.1f}",
              f"{rows[kept].get('elements')} elements, max ULP {rows[kept].get('max_ulp')}"]
             for name, kept in (("kept (as it is)", True), ("capture replays", False))]
    print(f"Mask R-CNN audit, {args.image_size} px, CPU, fault {FAULT.module}/{FAULT.op}"
          f"@{FAULT.phase}:{FAULT.step}; {args.pairs} pairs")
    print(tabulate(table, headers=["measured from", "median wall s", "origin op measured"]))
    print(f"median ratio kept / capture replays: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
