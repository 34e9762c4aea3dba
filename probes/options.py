"""The knobs of the built-in training recipe, as plain JSON-able data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

AUGMENTS = ("none", "flip")
SCHEDULERS = ("none", "cosine")
_NON_FINITE = ("nan", "inf", "-inf")


@dataclass
class RecipeOptions:
    """Options shared by every built-in probe."""

    image_size: int = 128
    batch_size: int = 1
    num_images: int = 4
    instances: int = 3
    num_classes: int = 5
    workers: int = 0
    shuffle: bool = False
    augment: str = "none"
    amp: bool = False
    accumulate: int = 1
    clip_grad_norm: float | None = None
    lr: float = 0.005
    momentum: float = 0.9
    weight_decay: float = 5e-4
    scheduler: str = "none"
    weights: str | None = None
    data: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse values the recipe cannot run with."""
        if self.augment not in AUGMENTS:
            raise ValueError(f"augment must be one of {', '.join(AUGMENTS)}, not {self.augment!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"scheduler must be one of {', '.join(SCHEDULERS)}, not {self.scheduler!r}"
            )
        # Detection backbones downsample by 32; smaller images leave no feature map.
        if self.image_size < 32:
            raise ValueError(f"image_size must be at least 32, not {self.image_size}")
        if self.num_classes < 2:
            raise ValueError(
                f"num_classes must be at least 2 (background + 1), not {self.num_classes}"
            )
        for name in ("batch_size", "num_images", "instances", "accumulate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.workers < 0:
            raise ValueError(f"workers must be 0 or more, not {self.workers}")
        if self.seed < 0:
            raise ValueError(f"seed must be 0 or more, not {self.seed}")

    def to_dict(self) -> dict[str, Any]:
        """The options as a plain dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecipeOptions:
        """Options from a dict as written by `to_dict`; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown recipe option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        # A non-finite float (a clip norm of inf) is stored as a string in strict JSON.
        floats = {"clip_grad_norm", "lr", "momentum", "weight_decay"}
        return cls(**{k: float(v) if k in floats and v in _NON_FINITE else v
                      for k, v in data.items()})
