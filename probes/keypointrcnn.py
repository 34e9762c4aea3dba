"""Keypoint R-CNN probe."""

from __future__ import annotations

import torch
from torchvision.models import detection

from ..probe import Probe
from .data import NUM_KEYPOINTS, make_dataset
from .options import RecipeOptions
from .recipe import KEYPOINT_TARGETS, make_probe, model_kwargs
from .registry import register


@register(
    "keypointrcnn",
    "Keypoint R-CNN ResNet50-FPN: sampler randperm, RoIAlign backward, keypoint heatmap loss, NMS",
)
def build_keypointrcnn(device: torch.device, options: RecipeOptions) -> Probe:
    """Keypoint R-CNN ResNet50-FPN (one object class, 17 keypoints) on the shared recipe."""
    kwargs = {**model_kwargs(options), "num_classes": 2, "num_keypoints": NUM_KEYPOINTS}
    model = detection.keypointrcnn_resnet50_fpn(**kwargs)
    return make_probe(
        model, make_dataset(options), options, device, targets=KEYPOINT_TARGETS, one_class=True
    )
