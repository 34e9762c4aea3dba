"""Walking the nested values detection models pass around (lists, dicts and other mappings,
tuples, dataclasses, ImageList, detectron2's Instances, PyTorch Geometric's Data and Batch, a
loop's own batch class)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

PLAIN_VALUES = (str, int, float, bool, type(None))  # what a label, a count or a score is


def iter_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside `obj` with a stable path such as ``0.boxes`` or ``features.p2``."""
    return _leaves(obj, path, plain=False)


def iter_leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every tensor inside `obj`, as :func:`iter_tensors` finds them, and every str, int,
    float, bool and None among them, each with its path (``0.label``)."""
    return _leaves(obj, path, plain=True)


def _leaves(obj: Any, path: str, plain: bool, objects: bool = True
            ) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _leaves(value, _join(path, str(i)), plain, objects)
    elif isinstance(obj, (dict, Mapping)):  # (Hugging Face's BatchEncoding is a UserDict;
        for key, value in obj.items():     # a dict is told first, without the ABC's check)
            yield from _leaves(value, _join(path, str(key)), plain, objects)
    elif hasattr(obj, "tensors") and isinstance(obj.tensors, torch.Tensor):
        # torchvision's ImageList: the padded batch plus the original sizes.
        yield from _leaves(obj.tensors, _join(path, "tensors"), plain, objects)
    elif plain and isinstance(obj, PLAIN_VALUES):
        yield path, obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), _join(path, f.name), plain, objects)
    elif callable(getattr(obj, "get_fields", None)):  # detectron2's Instances
        fields = obj.get_fields()
        if isinstance(fields, dict):
            yield from _leaves(fields, path, plain, objects)
    elif callable(getattr(obj, "to_dict", None)) and not isinstance(obj, type):
        fields = obj.to_dict()  # PyTorch Geometric's Data and Batch: their attributes
        if isinstance(fields, dict):
            yield from _leaves(fields, path, plain, objects)
    elif objects and _plain_object(obj):
        # a batch class of the loop's own (attributes set in its __init__): its public
        # attributes, one object deep (an object it holds is not walked: no cycles, and no
        # reach into whatever else the loop's objects point at)
        for key, value in vars(obj).items():
            if not key.startswith("_"):
                yield from _leaves(value, _join(path, key), plain, objects=False)


def _plain_object(obj: Any) -> bool:
    """An instance of a class of attributes: not a class, a module, or a callable (a
    function, a transform)."""
    return (hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module))
            and not callable(obj))


def replace_first_float(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, bool]:
    """A copy of `obj` with `fn` applied to its first non-empty floating (or complex) tensor;
    (new, found)."""
    if isinstance(obj, torch.Tensor):
        if has_ulps(obj) and obj.numel() > 0:
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


def has_ulps(t: torch.Tensor) -> bool:
    """Whether `t` holds floating-point numbers (real or complex) that :func:`next_ulp` moves:
    in a strided tensor, or in the values of a sparse one (``nn.Embedding(sparse=True)``'s
    gradient)."""
    return (t.is_floating_point() or t.is_complex()) and t.layout in _MOVABLE_LAYOUTS


_MOVABLE_LAYOUTS = (torch.strided, torch.sparse_coo)


def some_nonzero(t: torch.Tensor) -> bool:
    """Whether `t` (the part this process holds; of a sparse tensor, its values) has an
    element other than zero: 1 ULP of zero vanishes in the next sum (a gradient nothing
    reached is all zeros), so a fault is planted only where there is one."""
    t = local_part(t)
    return bool(((t._values() if t.layout is torch.sparse_coo else t) != 0).any())


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (each process holds a local shard or copy of it)."""
    return hasattr(t, "to_local") and hasattr(t, "placements") and hasattr(t, "device_mesh")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this process holds: a DTensor's local shard or copy, else `t`."""
    return t.to_local() if is_dtensor(t) else t


def on_local(t: torch.Tensor, change: Callable[[torch.Tensor], torch.Tensor | None]
             ) -> torch.Tensor | None:
    """`change(t)`; of a DTensor, `change` of the part this process holds, placed as `t`
    was (its ops on the whole tensor would be collectives, and some are not supported)."""
    if not is_dtensor(t):
        return change(t)
    changed = change(t.to_local())
    if changed is None:
        return None
    return type(t).from_local(changed, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def next_ulp(t: torch.Tensor, largest: bool = False) -> torch.Tensor:
    """`t` with one element moved up by one ULP, as a graph-preserving new tensor: the
    first element, or with `largest` the one of largest magnitude (the first of them) --
    for gradients, which are often zero where nothing reached, and 1 ULP of zero vanishes
    in the next sum. Of a complex tensor, one real or imaginary part (the first element's
    real part). Of a DTensor, in the part this process holds; of a sparse tensor, in its
    values (coalesced first: the sum of duplicates, which its user would take, moves)."""
    if is_dtensor(t):
        return on_local(t, lambda local: next_ulp(local, largest))  # type: ignore[return-value]
    if t.layout is torch.sparse_coo:
        coalesced = t.coalesce()
        return torch.sparse_coo_tensor(coalesced.indices(), next_ulp(coalesced.values(), largest),
                                       t.shape, is_coalesced=True, check_invariants=False)
    parts = torch.view_as_real(t.detach().resolve_conj()) if t.is_complex() else t.detach()
    flat = parts.reshape(-1)
    i = int(torch.nan_to_num(flat.abs().float(), nan=0.0, posinf=0.0).argmax()) if (
        largest and flat.numel() > 1) else 0
    x = flat[i:i + 1]
    delta = torch.full_like(flat, -0.0)
    delta[i:i + 1] = torch.nextafter(x, torch.full_like(x, float("inf"))) - x
    # x + (-0.0) is exactly x (signed zeros included) and x0 + (next(x0) - x0) == next(x0),
    # so exactly one element changes (complex addition adds the parts apart).
    delta = delta.reshape(parts.shape)
    return t + (torch.view_as_complex(delta) if t.is_complex() else delta)


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part
