"""The shared training recipe that turns a torchvision detector into a Probe."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from ..probe import Probe
from .data import DetectionDataset, ProbeInputError, Target, make_loader
from .options import RecipeOptions

BOX_TARGETS = ("boxes", "labels")
MASK_TARGETS = ("boxes", "labels", "masks")
KEYPOINT_TARGETS = ("boxes", "labels", "keypoints")


def model_kwargs(options: RecipeOptions, *, resize: bool = True) -> dict[str, Any]:
    """Constructor arguments for a torchvision detector: nothing downloaded, the options' size."""
    kwargs: dict[str, Any] = {
        "weights": None,
        "weights_backbone": None,
        "num_classes": options.num_classes,
    }
    if resize:
        # Without these GeneralizedRCNNTransform upscales every image to 800 px.
        kwargs.update(min_size=options.image_size, max_size=options.image_size)
    return kwargs


def _first(keys: list[str]) -> str:
    """A short parenthesised sample of key names, or nothing."""
    if not keys:
        return ""
    return " (" + ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "") + ")"


def load_weights(model: nn.Module, path: str) -> None:
    """Load a local state dict into `model`, refusing a missing file or mismatched keys."""
    if not os.path.isfile(path):
        raise ProbeInputError(f"weights file {path} does not exist.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load fails with many exception types on a bad file
        raise ProbeInputError(
            f"weights file {path} cannot be loaded with torch.load(weights_only=True) "
            f"({type(error).__name__})."
        ) from error
    # Checkpoints of torchvision's reference scripts keep the weights under "model".
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise ProbeInputError(
            f"weights file {path} holds a {type(state).__name__}, not a state dict."
        )
    expected, found = set(model.state_dict()), {str(key) for key in state}
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ProbeInputError(
            f"weights file {path} does not match the model: {len(missing)} missing key(s)"
            f"{_first(missing)} and {len(unexpected)} unexpected key(s){_first(unexpected)}."
        )
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise ProbeInputError(
            f"weights file {path} has tensors whose shapes differ from the model's "
            "(was it trained with another num_classes?)."
        ) from error


def _mixed_precision(device: torch.device, amp: bool) -> tuple[Any, Callable[[], Any] | None]:
    """The gradient scaler and autocast factory for `amp` on `device`."""
    if not amp:
        return None, None
    if device.type == "cuda":
        return torch.amp.GradScaler("cuda"), lambda: torch.autocast("cuda")
    # bfloat16 has float32's range, so CPU autocast needs no loss scaling.
    return None, lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _prepare(target: Target, keys: Sequence[str], one_class: bool, device: torch.device) -> Target:
    """The target fields a model trains on, on its device."""
    prepared = {key: target[key].to(device) for key in keys}
    if one_class:
        prepared["labels"] = torch.ones_like(prepared["labels"])
    return prepared


def _make_step(
    keys: Sequence[str], one_class: bool, autocast: Callable[[], Any] | None
) -> Callable[[nn.Module, Any], Any]:
    """A step returning the loss dict in train mode and the detections in eval mode."""

    def step(model: nn.Module, batch: Any) -> Any:
        images, targets = batch
        device = next(model.parameters()).device
        images = [image.to(device) for image in images]
        context = autocast() if autocast is not None else contextlib.nullcontext()
        if not model.training:
            with context:
                return model(images)
        prepared = [_prepare(target, keys, one_class, device) for target in targets]
        with context:
            return model(images, prepared)

    return step


def make_probe(
    model: nn.Module,
    dataset: DetectionDataset,
    options: RecipeOptions,
    device: torch.device,
    *,
    targets: Sequence[str] = BOX_TARGETS,
    one_class: bool = False,
) -> Probe:
    """Wrap a freshly built detector, its data and the options' optimiser set-up in a Probe.

    `targets` are the target fields the model trains on; `one_class` maps every label to 1
    for single-class models such as Keypoint R-CNN.
    """
    if not one_class and dataset.num_categories >= options.num_classes:
        raise ProbeInputError(
            f"the data has {dataset.num_categories} categories but num_classes is "
            f"{options.num_classes}; set num_classes to at least {dataset.num_categories + 1}."
        )
    device = torch.device(device)
    if options.weights:
        load_weights(model, options.weights)
    model.to(device)
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad],
        lr=options.lr,
        momentum=options.momentum,
        weight_decay=options.weight_decay,
    )
    scheduler = None
    if options.scheduler == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=2)
    scaler, autocast = _mixed_precision(device, options.amp)
    return Probe(
        model=model,
        batches=make_loader(dataset, options),
        step=_make_step(targets, one_class, autocast),
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        accumulate=options.accumulate,
        clip_grad_norm=options.clip_grad_norm,
    )
