"""The registry of built-in probes: a name, a one-line summary and a builder each."""

from __future__ import annotations

from typing import Callable

import torch

from ..probe import Probe
from .options import RecipeOptions

Builder = Callable[[torch.device, RecipeOptions], Probe]

_REGISTRY: dict[str, tuple[str, Builder]] = {}


def register(name: str, summary: str) -> Callable[[Builder], Builder]:
    """Decorator registering a probe builder under `name` with a one-line summary."""

    def decorate(build: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"a probe named {name!r} is already registered")
        _REGISTRY[name] = (summary, build)
        return build

    return decorate


def get(name: str) -> Builder:
    """The builder registered under `name`."""
    try:
        return _REGISTRY[name][1]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise KeyError(f"unknown probe {name!r}; known probes: {known}") from None


def available() -> list[tuple[str, str]]:
    """(name, summary) of every registered probe, sorted by name."""
    return sorted((name, summary) for name, (summary, _) in _REGISTRY.items())
