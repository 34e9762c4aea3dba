"""Faster R-CNN probes."""

from __future__ import annotations

import torch
from torchvision.models import detection

from ..probe import Probe
from .data import make_dataset
from .options import RecipeOptions
from .recipe import make_probe, model_kwargs
from .registry import register


@register(
    "fasterrcnn",
    "Faster R-CNN ResNet50-FPN: RPN/ROI sampler randperm, MultiScaleRoIAlign backward, NMS",
)
def build_fasterrcnn(device: torch.device, options: RecipeOptions) -> Probe:
    """Faster R-CNN ResNet50-FPN (v1) on the shared recipe."""
    model = detection.fasterrcnn_resnet50_fpn(**model_kwargs(options))
    return make_probe(model, make_dataset(options), options, device)


@register(
    "fasterrcnn_v2",
    "Faster R-CNN ResNet50-FPN v2: BatchNorm FPN and conv box head, sampler randperm, "
    "RoIAlign backward, NMS",
)
def build_fasterrcnn_v2(device: torch.device, options: RecipeOptions) -> Probe:
    """Faster R-CNN ResNet50-FPN v2 on the shared recipe."""
    model = detection.fasterrcnn_resnet50_fpn_v2(**model_kwargs(options))
    return make_probe(model, make_dataset(options), options, device)


@register(
    "fasterrcnn_mobilenet",
    "Faster R-CNN MobileNetV3-Large FPN: depthwise convolutions, sampler randperm, "
    "RoIAlign backward, NMS",
)
def build_fasterrcnn_mobilenet(device: torch.device, options: RecipeOptions) -> Probe:
    """Faster R-CNN MobileNetV3-Large FPN on the shared recipe."""
    model = detection.fasterrcnn_mobilenet_v3_large_fpn(**model_kwargs(options))
    return make_probe(model, make_dataset(options), options, device)
