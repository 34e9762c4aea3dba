"""detaudit: finds where, when and why a PyTorch detection model stops training the same way twice.

The public names below are imported on first use (PEP 562), so that `import detaudit` --
and the commands that only read saved runs -- do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "AuditConfig": "config",
    "AuditResult": "api",
    "Comparison": "analysis.compare",
    "DetauditError": "errors",
    "Fault": "config",
    "Probe": "probe",
    "ProbeSpec": "config",
    "Trace": "trace",
    "audit": "api",
    "compare": "attached",
    "exec_command": "execution",
    "watch": "attached",
    "seed_everything": "seeding",
    "seed_worker": "seeding",
    "seeded_loader_kwargs": "seeding",
}

__all__ = [
    "AuditConfig", "AuditResult", "Comparison", "DetauditError", "Fault", "Probe", "ProbeSpec",
    "Trace", "audit", "compare", "exec_command", "seed_everything", "seed_worker",
    "seeded_loader_kwargs", "watch",
]

if TYPE_CHECKING:  # pragma: no cover
    from .analysis.compare import Comparison
    from .api import AuditResult, audit
    from .attached import compare, watch
    from .config import AuditConfig, Fault, ProbeSpec
    from .errors import DetauditError
    from .execution import exec_command
    from .probe import Probe
    from .seeding import seed_everything, seed_worker, seeded_loader_kwargs
    from .trace import Trace


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'detaudit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
