"""The one exception family users see, and the exit codes the CLI maps results to."""

from __future__ import annotations

EXIT_OK = 0  # deterministic, or matches the baseline
EXIT_DIVERGED = 1  # a divergence was found
EXIT_USAGE = 2  # bad input or usage; the message says what


class DetauditError(Exception):
    """A problem with the user's input, reported as one line (no traceback without --debug)."""


class TraceError(DetauditError):
    """A trace or run folder that cannot be read."""


class ProbeError(DetauditError):
    """An exception raised by the user's own probe code, located in their file."""
