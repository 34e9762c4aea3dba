"""Mask R-CNN probes."""

from __future__ import annotations

import torch
from torchvision.models import detection

from ..probe import Probe
from .data import make_dataset
from .options import RecipeOptions
from .recipe import MASK_TARGETS, make_probe, model_kwargs
from .registry import register


@register(
    "maskrcnn",
    "Mask R-CNN ResNet50-FPN v2: RPN/ROI sampler randperm, MultiScaleRoIAlign forward/backward, "
    "mask head, NMS",
)
def build_maskrcnn(device: torch.device, options: RecipeOptions) -> Probe:
    """Mask R-CNN ResNet50-FPN v2 on the shared recipe."""
    model = detection.maskrcnn_resnet50_fpn_v2(**model_kwargs(options))
    return make_probe(model, make_dataset(options), options, device, targets=MASK_TARGETS)


@register(
    "maskrcnn_v1",
    "Mask R-CNN ResNet50-FPN v1: RPN/ROI sampler randperm, MultiScaleRoIAlign forward/backward, "
    "mask head, NMS",
)
def build_maskrcnn_v1(device: torch.device, options: RecipeOptions) -> Probe:
    """Mask R-CNN ResNet50-FPN (v1) on the shared recipe."""
    model = detection.maskrcnn_resnet50_fpn(**model_kwargs(options))
    return make_probe(model, make_dataset(options), options, device, targets=MASK_TARGETS)
