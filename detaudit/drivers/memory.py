"""Peak memory of a stretch of work: what a fix costs in memory is measured with it."""

from __future__ import annotations

import os
import resource
import threading

import torch

_SAMPLE_SECONDS = 0.005


class PeakMemory:
    """Context manager: peak CUDA memory allocated (on CUDA), else peak resident set size.

    On CPU the RSS is sampled from ``/proc/self/statm`` every few milliseconds (the
    process-lifetime ``ru_maxrss`` cannot be reset between repeats); where /proc is missing,
    ``ru_maxrss`` is used.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:  # noqa: PYI034
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif _rss_bytes() is not None:
            self.peak_bytes = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes or 0, _rss_bytes() or 0)
        else:
            self.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _sample(self) -> None:
        while not self._stop.wait(_SAMPLE_SECONDS):
            rss = _rss_bytes()
            if rss is not None and rss > (self.peak_bytes or 0):
                self.peak_bytes = rss


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
