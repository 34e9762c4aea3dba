"""Determinism as a unit test: ``assert_deterministic`` and the ``detaudit_check`` fixture.

To get the fixture, add ``pytest_plugins = ["detaudit.testing"]`` to your ``conftest.py``::

    def test_my_model_is_deterministic(detaudit_check):
        detaudit_check(make_probe, steps=2)
"""

from __future__ import annotations

from typing import Any, Callable

from .api import AuditResult, audit
from .report import render_console, summarize
from .runfolder import RunInfo
from .runner import ProbeFactory


def assert_deterministic(
    probe: ProbeFactory, repeats: int = 2, epochs: int = 1, steps: int | None = None,
    **audit_kwargs: Any,
) -> AuditResult:
    """Audit `probe`; unless it is deterministic, raise AssertionError with the console summary."""
    result = audit(probe, repeats=repeats, epochs=epochs, steps=steps, **audit_kwargs)
    if not result.deterministic:
        summary = summarize(_run_info(probe, result), result.comparison, result.traces)
        raise AssertionError("\n" + render_console(summary))
    return result


def _run_info(probe: ProbeFactory, result: AuditResult) -> RunInfo:
    """The run description the summary needs, for an audit that has no run folder."""
    name = getattr(probe, "__qualname__", type(probe).__name__)
    return RunInfo(
        probe={"name": name, "kind": "python", "source": getattr(probe, "__module__", None)},
        config=result.config.to_dict(),
        command=f"detaudit.testing.assert_deterministic({name})",
        traces=[f"trace-{t.repeat}.json.gz" for t in result.traces],
        timings=[vars(t) for t in result.timings],
    )


try:  # the fixture needs pytest; assert_deterministic works without it
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:

    @pytest.fixture
    def detaudit_check() -> Callable[..., AuditResult]:
        """:func:`assert_deterministic`, as a pytest fixture."""
        return assert_deterministic
