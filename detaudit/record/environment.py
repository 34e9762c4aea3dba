"""The determinism-relevant state of this process: versions, devices, threads, flags."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

import torch

from ..config import AUGMENTATION_LIBRARIES
from .fingerprint import scheme


def capture_environment(device: str | torch.device | None = None) -> dict[str, Any]:
    """A plain-data snapshot of everything that can change a run's numbers (and the
    versions of the AUGMENTATION_LIBRARIES imported)."""
    import numpy

    cuda = torch.cuda.is_available()
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": _platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torchvision": torchvision_version(),
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda else [],
        "cpu": _cpu(),
        "device": str(device) if device is not None else None,
        "fingerprint": scheme(device),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "tf32_matmul": _read(lambda: _tf32(torch.backends.cuda.matmul)),
        "tf32_cudnn": _read(lambda: _tf32(torch.backends.cudnn)),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "PYTHONHASHSEED": hash_seed_at_start(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "mkl": torch.backends.mkl.is_available(),
        "MKL_CBWR": os.environ.get("MKL_CBWR"),
    }
    for name in AUGMENTATION_LIBRARIES:
        if (library := sys.modules.get(name)) is not None:
            env[name] = str(getattr(library, "__version__", "unknown"))
    return env


def hash_seed_at_start() -> str | None:
    """PYTHONHASHSEED as this interpreter read it when it started, which is what its str
    hashes follow: a script that sets it later (a common ``seed_everything``) or removes it
    (Ultralytics does) changes only what the processes it starts get. Linux keeps the
    environment a process started with (/proc/self/environ); elsewhere, today's."""
    try:
        with open("/proc/self/environ", "rb") as started_with:
            entries = started_with.read().split(b"\0")
    except OSError:
        return os.environ.get("PYTHONHASHSEED")
    for entry in entries:
        if entry.startswith(b"PYTHONHASHSEED="):
            return entry.partition(b"=")[2].decode(errors="replace")
    return None


def _platform() -> str:
    """``platform.platform(terse=True)`` on Linux ("Linux-6.1.0-x86_64-with-glibc2.36"),
    made without asking for the processor, which runs a subprocess (see _cpu)."""
    libc, version = platform.libc_ver()
    return "-".join(filter(None, (platform.system(), platform.release(), platform.machine(),
                                  f"with-{libc}{version}" if libc else "")))


def _cpu() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else the machine's type. Not
    ``platform.processor()``: it runs `uname -p` in the audited process, and the subprocess
    call resets Python's warnings registry (a warning the script's code shows once was shown
    again after the first step)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _read(getter: Any) -> Any:
    """A setting's value, or why it could not be read: capturing never crashes a run."""
    try:
        return getter()
    except Exception as exc:  # noqa: BLE001 -- e.g. torch refusing a mix of TF32 APIs
        return f"unreadable: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _tf32(backend: Any) -> bool:
    """Whether a backend (cuBLAS matmul, cuDNN) may use TF32: by torch's fp32_precision API
    where it is set, else by the legacy allow_tf32 flag."""
    precision = getattr(backend, "fp32_precision", None)
    if precision not in (None, "none"):
        return precision == "tf32"
    return bool(backend.allow_tf32)


def torchvision_version() -> str | None:
    """torchvision's ``__version__``, read from its version file when it is not imported:
    importing it (its ops, its models) takes seconds that a user's script that never uses
    it should not pay in every recorded run."""
    loaded = sys.modules.get("torchvision")
    if loaded is not None:
        return str(loaded.__version__)
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    version = Path(spec.origin).with_name("version.py")
    text = version.read_text() if version.is_file() else ""
    found = re.search(r"^__version__ = ['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if found:
        return found.group(1)
    import torchvision

    return str(torchvision.__version__)
