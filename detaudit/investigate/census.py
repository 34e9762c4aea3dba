"""The census: which known-nondeterministic ops the model runs, where, and how often.

Runs of the probe (same seed, no planted fault) up to the first step of its last epoch,
taken op by op at the first step of every epoch (a path that only runs from epoch 2 counts):

1. as configured, when the audit did not stress (the stress counts the same ops in the
   audit itself): every op counted per module and phase; those the knowledge table lists as
   nondeterministic on this device are reported, even when the repeats agreed;
2. under ``torch.use_deterministic_algorithms(True, warn_only=True)``: every alert PyTorch
   raises (``<op> does not have a deterministic implementation ...``) is captured, not
   deduplicated, with the op and module that raised it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..analysis.knowledge import applicable
from ..config import AuditConfig, ProbeSpec
from ..drivers.runner import OpPlan, ProbeFactory, run_repeat


def take_census(
    factory: ProbeFactory, config: AuditConfig, spec: ProbeSpec | None = None
) -> dict[str, Any]:
    """Plain data for the report: known-nondeterministic ops per module (first epoch seen),
    and the alerts. The census steps are the first step of every epoch; with the stress on,
    the audit's last repeat already counted the risky ops there (``trace.stress``), so only
    the alerts are taken here."""
    counting = not config.stress
    config = replace(config, fault=None, granularity="module", repeats=1, stress=0)
    device = str(torch.device(config.device))
    errors: list[str] = []
    ops: list[dict[str, Any]] = []
    if counting:
        counts: dict[tuple[str, str, str, bool | None], list[int]] = {}  # -> [count, epoch]
        modes, epochs, env = _census_steps(factory, config, spec, "as configured", errors)
        for mode in modes:
            for key, n in mode.counts.items():
                entry = counts.setdefault(key, [0, epochs.get(mode.step, 0)])
                entry[0] += n
        ops = [
            {"module": module or "(model)", "phase": phase,
             "op": op if accumulate is None else f"{op}(accumulate={accumulate})", "count": n,
             "epoch": epoch + 1, "what": known[0].what}
            for (module, phase, op, accumulate), (n, epoch) in sorted(counts.items(), key=str)
            if (known := applicable(op, phase, device, env, accumulate))
        ]
    modes, epochs, _ = _census_steps(factory, replace(config, deterministic=True), spec,
                                     "under use_deterministic_algorithms(True)", errors)
    alerts = [
        {"module": a.module or "(model)", "phase": a.phase, "op": a.op, "message": a.message,
         "epoch": epochs.get(mode.step, 0) + 1}
        for mode in modes for a in mode.alerts
    ]
    return {"device": device, "ops": ops, "alerts": alerts, "errors": errors,
            "steps": sorted(m.step for m in modes),
            "ops_seen": sum(sum(m.counts.values()) for m in modes)}


def _census_steps(
    factory: ProbeFactory, config: AuditConfig, spec: ProbeSpec | None, which: str,
    errors: list[str],
) -> tuple[list[Any], dict[int, int], dict[str, Any]]:
    """The op-level modes of the census steps (the first step of every epoch), the epoch of
    each step, and the environment they ran in; a run that stopped early is an error of the
    census (its lists are then partial), never silent."""
    last = (config.epochs - 1) * config.steps if config.steps else None
    plan = OpPlan(last_step=last, census=True)
    trace, _ = run_repeat(factory, config, 0, spec, ops=plan)
    if trace.failure:
        errors.append(f"the census run {which} stopped, so its lists are partial: "
                      f"{trace.failure}")
    return plan.modes, {s.step: s.epoch for s in trace.steps}, trace.env
