"""Built-in probes: torchvision detectors on a shared, seeded training recipe.

Importing this package registers every family's builder (see registry.py).
"""

from __future__ import annotations

from . import fasterrcnn, fcos, keypointrcnn, maskrcnn, retinanet, ssd  # noqa: F401
from .registry import Builder, available, get, register

__all__ = ["Builder", "available", "get", "register"]
