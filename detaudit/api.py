"""The Python API: run an audit and get its traces and findings back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .compare import Comparison, compare
from .errors import ProbeError
from .investigate import investigate
from .recorder import Fault
from .runner import AuditConfig, ProbeFactory, RepeatTiming, run_repeat, save_traces
from .trace import Trace


@dataclass
class AuditResult:
    """Everything one audit produced."""

    config: AuditConfig
    traces: list[Trace]
    comparison: Comparison
    timings: list[RepeatTiming]
    extra: dict[str, Any] = field(default_factory=dict)  # ops, census, verify (if asked for)

    @property
    def deterministic(self) -> bool:
        return self.comparison.deterministic


def audit(
    probe: ProbeFactory,
    *,
    repeats: int = 2,
    epochs: int = 1,
    steps: int | None = None,
    mode: str = "train",
    device: str = "cpu",
    seed: int = 0,
    deterministic: bool = False,
    fault: Fault | None = None,
    granularity: str = "module",
    drill_down: bool = False,
    census: bool = False,
    verify_fix: bool = False,
    out: str | Path | None = None,
    probe_info: dict[str, Any] | None = None,
    on_step: Callable[[int, int, int, int], None] | None = None,
) -> AuditResult:
    """Run `probe` `repeats` times from the same seed, record everything, compare the runs.

    `probe(device)` must return a fresh :class:`detaudit.Probe`. With `out`, each trace is
    saved there as it completes, so a failure half way loses nothing already recorded.
    `on_step(repeat, epoch, index, global_step)` is called after every step (progress bars).

    After a divergence, `drill_down` replays the first divergent step op by op to name the
    op (``result.extra["ops"]``); `census` lists the known-nondeterministic ops the model
    runs and the deterministic-mode alerts (``extra["census"]``); `verify_fix` re-runs with
    PyTorch's deterministic settings and measures the cost (``extra["verify"]``).
    """
    config = AuditConfig(
        repeats=repeats, epochs=epochs, steps=steps, mode=mode, device=device, seed=seed,
        deterministic=deterministic, fault=fault, granularity=granularity,
    )
    result = audit_config(probe, config, out=out, probe_info=probe_info, on_step=on_step)
    result.extra = investigate(
        probe, config, result.comparison, result.timings, ops=drill_down, census=census,
        verify=verify_fix, probe_info=probe_info, traces=result.traces,
    )
    return result


def audit_config(
    probe: ProbeFactory,
    config: AuditConfig,
    *,
    out: str | Path | None = None,
    probe_info: dict[str, Any] | None = None,
    on_step: Callable[[int, int, int, int], None] | None = None,
) -> AuditResult:
    """:func:`audit` with a ready-made :class:`AuditConfig`."""
    traces: list[Trace] = []
    timings: list[RepeatTiming] = []
    for repeat in range(config.repeats):
        hook = (lambda e, i, s, r=repeat: on_step(r, e, i, s)) if on_step else None
        trace, timing = run_repeat(probe, config, repeat, probe_info, hook)
        traces.append(trace)
        timings.append(timing)
        if out is not None:
            save_traces([trace], out)
        if repeat == 0 and trace.failure and not trace.steps:
            raise ProbeError(trace.failure)
    return AuditResult(config, traces, compare(traces), timings)
