"""Fix verification: re-run the audit with the remedies applied and measure their cost.

The remedies are PyTorch's deterministic settings (see
:func:`detaudit.drivers.runner.deterministic_settings`): deterministic algorithms,
``cudnn.benchmark=False`` / ``cudnn.deterministic=True``, ``CUBLAS_WORKSPACE_CONFIG``
on CUDA, filling uninitialized memory, and torchvision's mask targets kept on roi_align's
(deterministic) forward kernel. Data-loader seeding cannot be applied to a
user's loader from outside; when the cause is data it is offered as code instead.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

import torch

from ..analysis.compare import compare
from ..config import AuditConfig, ProbeSpec
from ..drivers.runner import ProbeFactory, RepeatTiming, run_repeat

SEEDING_CODE = (
    "detaudit.seed_everything(seed, workers=True)\n"
    "loader = DataLoader(dataset, ..., **detaudit.seeded_loader_kwargs(seed, rank))"
)


def applied_remedies(device: str) -> list[str]:
    """What the fixed run changes, in words."""
    remedies = [
        "torch.use_deterministic_algorithms(True, warn_only=True)",
        "torch.utils.deterministic.fill_uninitialized_memory = True",
        ("# torchvision's Mask R-CNN: its mask targets (roi_heads.project_masks_on_boxes) "
         "computed with deterministic algorithms off; their roi_align forward is "
         "deterministic, and its deterministic path would hold K x 28 x 28 x H x W floats"),
    ]
    if torch.device(device).type == "cuda":
        remedies += [
            "torch.backends.cudnn.benchmark = False",
            "torch.backends.cudnn.deterministic = True",
            "CUBLAS_WORKSPACE_CONFIG=:4096:8",
        ]
    return remedies


def verify_fix(
    factory: ProbeFactory, config: AuditConfig, cause: str, spec: ProbeSpec | None = None,
) -> dict[str, Any]:
    """Run the same audit with the remedies; say whether it is deterministic now and what
    it cost: step time and peak memory as ratios of the original's. Like is compared with
    like: original and fixed repeats both at module level without a planted fault, run in
    alternating order (original first, then fixed first, ...), timed over their steady
    steps (after the first, so neither building the probe nor warm-up counts)."""
    original_config = replace(config, fault=None, granularity="module", stress=0)
    fixed_config = replace(original_config, deterministic=True)
    runs: dict[bool, list[tuple[Any, RepeatTiming]]] = {False: [], True: []}
    for r in range(config.repeats):
        for fixed in ((False, True) if r % 2 == 0 else (True, False)):
            cfg = fixed_config if fixed else original_config
            runs[fixed].append(run_repeat(factory, cfg, r, spec))
    comparison = compare([trace for trace, _ in runs[True]])
    timings = [timing for _, timing in runs[True]]
    original = [timing for _, timing in runs[False]]
    time_ratio = _ratio(_step_seconds(timings), _step_seconds(original))
    memory_ratio = _ratio(_peak(timings), _peak(original))
    return {
        "deterministic": comparison.deterministic,
        "headline": "deterministic with the fix" if comparison.deterministic else
        f"still divergent with the fix: first at step {comparison.first_step}, "
        f"cause {comparison.cause}",
        "remedies": applied_remedies(config.device),
        "code": SEEDING_CODE if cause == "data" else None,
        "planted_fault_dropped": config.fault is not None,
        "step_time_ratio": time_ratio,
        "peak_memory_ratio": memory_ratio,
        "step_seconds": {"original": _step_seconds(original),
                         "fixed": _step_seconds(timings)},
        "peak_bytes": {"original": _peak(original), "fixed": _peak(timings)},
        "peak_memory_kind": "cuda max_memory_allocated" if torch.device(config.device).type
        == "cuda" else "process peak RSS",
        "timed": f"{config.repeats} original and {config.repeats} fixed repeats in alternating "
        "order, module level, steady steps only",
    }


def _step_seconds(timings: list[RepeatTiming]) -> float | None:
    """Median steady seconds per step over the repeats (whole repeats for 1-step runs)."""
    per_step = [t.steady_step_seconds or t.seconds / t.steps for t in timings if t.steps]
    return statistics.median(per_step) if per_step else None


def _peak(timings: list[RepeatTiming]) -> int | None:
    peaks = [t.peak_bytes for t in timings if t.peak_bytes is not None]
    return max(peaks) if peaks else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
