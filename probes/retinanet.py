"""RetinaNet probes."""

from __future__ import annotations

import torch
from torchvision.models import detection

from ..probe import Probe
from .data import make_dataset
from .options import RecipeOptions
from .recipe import make_probe, model_kwargs
from .registry import register


@register(
    "retinanet",
    "RetinaNet ResNet50-FPN: anchor matching, focal loss over all anchors, per-level top-k, "
    "batched NMS",
)
def build_retinanet(device: torch.device, options: RecipeOptions) -> Probe:
    """RetinaNet ResNet50-FPN (v1) on the shared recipe."""
    model = detection.retinanet_resnet50_fpn(**model_kwargs(options))
    return make_probe(model, make_dataset(options), options, device)


@register(
    "retinanet_v2",
    "RetinaNet ResNet50-FPN v2: GroupNorm heads, GIoU loss, anchor matching, top-k, batched NMS",
)
def build_retinanet_v2(device: torch.device, options: RecipeOptions) -> Probe:
    """RetinaNet ResNet50-FPN v2 on the shared recipe."""
    model = detection.retinanet_resnet50_fpn_v2(**model_kwargs(options))
    return make_probe(model, make_dataset(options), options, device)
