"""SSD probes; these models resize every image to their own fixed size."""

from __future__ import annotations

import torch
from torchvision.models import detection

from ..probe import Probe
from .data import ProbeInputError, make_dataset
from .options import RecipeOptions
from .recipe import make_probe, model_kwargs
from .registry import register


@register(
    "ssd300",
    "SSD300 VGG16: fixed 300 px resize, anchor matching, hard negative mining (sort), NMS",
)
def build_ssd300(device: torch.device, options: RecipeOptions) -> Probe:
    """SSD300 VGG16 on the shared recipe."""
    model = detection.ssd300_vgg16(**model_kwargs(options, resize=False))
    return make_probe(model, make_dataset(options), options, device)


@register(
    "ssdlite",
    "SSDlite320 MobileNetV3-Large: BatchNorm heads, hard negative mining (sort), NMS; "
    "batch_size >= 2",
)
def build_ssdlite(device: torch.device, options: RecipeOptions) -> Probe:
    """SSDlite320 MobileNetV3-Large on the shared recipe."""
    # Its heads apply BatchNorm to 1x1 feature maps, which training cannot do on one image.
    if options.batch_size < 2:
        raise ProbeInputError(
            f"ssdlite needs batch_size of at least 2, not {options.batch_size}: its BatchNorm "
            "layers see 1x1 feature maps."
        )
    model = detection.ssdlite320_mobilenet_v3_large(**model_kwargs(options, resize=False))
    return make_probe(model, make_dataset(options), options, device)
