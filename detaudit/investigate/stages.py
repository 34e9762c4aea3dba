"""After the module-level audit: the op drill-down, the census and the fix verification.

Each step is optional and self-contained; a failure in one is reported in its place and
never loses the audit that came before it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..analysis.compare import Comparison
from ..config import AuditConfig, ProbeSpec
from ..drivers.runner import ProbeFactory, describe_user_error
from ..errors import DetauditError
from ..trace import Trace
from .census import take_census
from .drilldown import drill_down
from .fixes import verify_fix
from .isolated import needs_child, run_in_child


def investigate(
    factory: ProbeFactory, config: AuditConfig, comparison: Comparison,
    *, ops: bool = True, census: bool = False,
    verify: bool = False, spec: ProbeSpec | None = None,
    traces: list[Trace] | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_done: Callable[[str, Any], None] | None = None,
    child: bool | None = None,
) -> dict[str, Any]:
    """Plain data under the keys ``ops``, ``census`` and ``verify`` (those asked for).
    `traces` recorded at op granularity are used for the drill-down without a replay.
    The census and the fix verification run in a child process where their settings must
    be in force from its start (`child`; default: on CUDA, see :mod:`.isolated`)."""
    if child is None:
        child = needs_child(config, spec)
    stages: list[tuple[str, Callable[[], Any]]] = []
    if ops and comparison.first_step is not None and not comparison.failures:
        stages.append(("ops", lambda: drill_down(
            factory, config, comparison, spec,
            traces if config.granularity == "op" else None)))
    if census:
        stages.append(("census", lambda: run_in_child("census", spec, config, "")
                       if child and spec else take_census(factory, config, spec)))
    if verify:
        stages.append(("verify", lambda: run_in_child("verify", spec, config, comparison.cause)
                       if child and spec else verify_fix(factory, config, comparison.cause, spec)))
    out: dict[str, Any] = {}
    for name, run in stages:
        if on_stage:
            on_stage(name)
        started = time.perf_counter()
        try:
            out[name] = run()
        except DetauditError as exc:
            out[name] = {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 -- the user's code failed in a replay
            out[name] = {"error": describe_user_error(exc, f"in the {name} run")}
        if isinstance(out[name], dict):
            out[name]["seconds"] = time.perf_counter() - started  # what the investigation cost
        if on_done:
            on_done(name, out[name])
    return out
