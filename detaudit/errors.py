"""The one exception family users see, and the exit codes the CLI maps results to."""

from __future__ import annotations

EXIT_OK = 0  # deterministic, or matches the baseline
EXIT_DIVERGED = 1  # a divergence was found
EXIT_USAGE = 2  # bad input or usage; the message says what
EXIT_CRASH = 3  # the user's code crashed (nothing left to compare) or detaudit failed itself
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM: what was recorded is kept


class DetauditError(Exception):
    """A problem with the user's input, reported as one line (no traceback without --debug)."""

    exit_code = EXIT_USAGE


class FaultRefused(DetauditError):
    """A fault to plant (``--inject-fault``) that cannot be planted where it was asked, or
    that never fired: what a run recorded before it was refused served only to try it."""


class TraceError(DetauditError):
    """A trace or run folder that cannot be read."""


class ProbeError(DetauditError):
    """An exception raised by the user's own probe code, located in their file (exit 3:
    a crash, not a usage error)."""

    exit_code = EXIT_CRASH
