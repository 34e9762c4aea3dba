"""Walking the nested values detection models pass around (lists, dicts, tuples, ImageList)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

import torch


def iter_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside `obj` with a stable path such as ``0.boxes`` or ``features.p2``."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_tensors(value, _join(path, str(key)))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, _join(path, str(i)))
    elif hasattr(obj, "tensors") and isinstance(obj.tensors, torch.Tensor):
        # torchvision's ImageList: the padded batch plus the original sizes.
        yield from iter_tensors(obj.tensors, _join(path, "tensors"))


def replace_first_float(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, bool]:
    """A copy of `obj` with `fn` applied to its first non-empty floating tensor; (new, found)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() > 0:
            return fn(obj), True
        return obj, False
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        found = False
        for key, value in obj.items():
            if not found:
                value, found = replace_first_float(value, fn)
            out[key] = value
        return out, found
    if isinstance(obj, (list, tuple)):
        items, found = [], False
        for value in obj:
            if not found:
                value, found = replace_first_float(value, fn)
            items.append(value)
        if isinstance(obj, list):
            return items, found
        return (type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)), found
    if hasattr(obj, "tensors") and isinstance(obj.tensors, torch.Tensor):
        new_tensors, found = replace_first_float(obj.tensors, fn)
        if found:
            return type(obj)(new_tensors, obj.image_sizes), True
    return obj, False


def next_ulp(t: torch.Tensor, largest: bool = False) -> torch.Tensor:
    """`t` with one element moved up by one ULP, as a graph-preserving new tensor: the
    first element, or with `largest` the one of largest magnitude (the first of them) --
    for gradients, which are often zero where nothing reached, and 1 ULP of zero vanishes
    in the next sum."""
    flat = t.detach().reshape(-1)
    i = int(torch.nan_to_num(flat.abs().float(), nan=0.0, posinf=0.0).argmax()) if (
        largest and flat.numel() > 1) else 0
    x = flat[i:i + 1]
    delta = torch.full_like(flat, -0.0)
    delta[i:i + 1] = torch.nextafter(x, torch.full_like(x, float("inf"))) - x
    # x + (-0.0) is exactly x (signed zeros included) and x0 + (next(x0) - x0) == next(x0),
    # so exactly one element changes.
    return t + delta.reshape(t.shape)


def within(name: str, module: str) -> bool:
    """Whether the module (or parameter owner) named `name` is `module` or inside it ("" is
    the model: everything is inside it)."""
    return not module or name == module or name.startswith(f"{module}.")


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part
