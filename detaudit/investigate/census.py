"""The census: which known-nondeterministic ops the model runs, where, and how often.

Two one-step runs of the probe (same seed, no planted fault), op by op:

1. as configured: every op counted per module and phase; those the knowledge table lists
   as nondeterministic on this device are reported, even when the repeats agreed;
2. under ``torch.use_deterministic_algorithms(True, warn_only=True)``: every alert PyTorch
   raises (``<op> does not have a deterministic implementation ...``) is captured, not
   deduplicated, with the op and module that raised it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from ..analysis.knowledge import applicable
from ..config import AuditConfig, ProbeSpec
from ..drivers.runner import OpPlan, ProbeFactory, run_repeat


def take_census(
    factory: ProbeFactory, config: AuditConfig, spec: ProbeSpec | None = None
) -> dict[str, Any]:
    """Plain data for the report: known-nondeterministic ops per module, and the alerts."""
    config = replace(config, fault=None, granularity="module", repeats=1)
    device = str(torch.device(config.device))
    counts: Counter[tuple[str, str, str, bool | None]] = Counter()
    errors: list[str] = []
    modes, env = _one_step(factory, config, spec, "as configured", errors)
    for mode in modes:
        counts.update(mode.counts)
    ops = [
        {"module": module or "(model)", "phase": phase,
         "op": op if accumulate is None else f"{op}(accumulate={accumulate})", "count": n,
         "what": known[0].what}
        for (module, phase, op, accumulate), n in sorted(counts.items(), key=str)
        if (known := applicable(op, phase, device, env, accumulate))
    ]
    deterministic, _ = _one_step(factory, replace(config, deterministic=True), spec,
                                 "under use_deterministic_algorithms(True)", errors)
    alerts = [
        {"module": a.module or "(model)", "phase": a.phase, "op": a.op, "message": a.message}
        for mode in deterministic for a in mode.alerts
    ]
    return {"device": device, "ops": ops, "alerts": alerts, "errors": errors,
            "ops_seen": sum(counts.values())}


def _one_step(
    factory: ProbeFactory, config: AuditConfig, spec: ProbeSpec | None, which: str,
    errors: list[str],
) -> tuple[list[Any], dict[str, Any]]:
    """The op-level modes of one census step and the environment it ran in; a step that
    stopped early is an error of the census (its lists are then partial), never silent."""
    plan = OpPlan(last_step=0, census=True)
    trace, _ = run_repeat(factory, config, 0, spec, ops=plan)
    if trace.failure:
        errors.append(f"the census step {which} stopped, so its lists are partial: "
                      f"{trace.failure}")
    return plan.modes, trace.env
