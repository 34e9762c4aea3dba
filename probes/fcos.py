"""FCOS probe."""

from __future__ import annotations

import torch
from torchvision.models import detection

from ..probe import Probe
from .data import make_dataset
from .options import RecipeOptions
from .recipe import make_probe, model_kwargs
from .registry import register


@register(
    "fcos",
    "FCOS ResNet50-FPN: anchor-free centre sampling, GroupNorm heads, GIoU loss, top-k, "
    "batched NMS",
)
def build_fcos(device: torch.device, options: RecipeOptions) -> Probe:
    """FCOS ResNet50-FPN on the shared recipe."""
    model = detection.fcos_resnet50_fpn(**model_kwargs(options))
    return make_probe(model, make_dataset(options), options, device)
