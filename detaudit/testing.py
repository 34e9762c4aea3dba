"""Determinism as a unit test: ``assert_deterministic`` and the ``detaudit_check`` fixture.

To get the fixture, add ``pytest_plugins = ["detaudit.testing"]`` to your ``conftest.py``::

    def test_my_model_is_deterministic(detaudit_check):
        detaudit_check(make_probe, steps=2)
"""

from __future__ import annotations

from typing import Any, Callable

from .api import AuditResult, audit
from .report import render_console


def assert_deterministic(
    probe: Any, repeats: int = 2, epochs: int = 1, steps: int | None = None,
    **audit_kwargs: Any,
) -> AuditResult:
    """Audit `probe` (a probe function or a ProbeSpec); unless the audit is deterministic,
    raise AssertionError with the console summary."""
    result = audit(probe, repeats=repeats, epochs=epochs, steps=steps, **audit_kwargs)
    if not result.deterministic:
        raise AssertionError("\n" + render_console(result.summary))
    return result


try:  # the fixture needs pytest; assert_deterministic works without it
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:

    @pytest.fixture
    def detaudit_check() -> Callable[..., AuditResult]:
        """:func:`assert_deterministic`, as a pytest fixture."""
        return assert_deterministic
