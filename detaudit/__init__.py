"""detaudit: finds where, when and why a PyTorch detection model stops training the same way twice."""

from __future__ import annotations

from .api import AuditResult, audit
from .compare import Comparison, compare
from .errors import DetauditError
from .probe import Probe
from .recorder import Fault
from .seeding import seed_everything, seed_worker, seeded_loader_kwargs
from .trace import Trace

__version__ = "0.1.0"

__all__ = [
    "AuditResult", "Comparison", "DetauditError", "Fault", "Probe", "Trace", "audit", "compare",
    "seed_everything", "seed_worker", "seeded_loader_kwargs",
]
