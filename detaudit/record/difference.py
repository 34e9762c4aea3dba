"""How two versions of one tensor differ: what a report says about the size of a divergence."""

from __future__ import annotations

from typing import Any

import torch

_INT_OF_FLOAT = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
                 torch.float32: torch.int32, torch.float64: torch.int64}


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two versions of one tensor are equal (sparse ones: their coalesced indices
    and values)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
        return False
    if a.layout is torch.sparse_coo:
        a, b = a.coalesce(), b.coalesce()
        return torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())
    return torch.equal(a, b)


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """How two versions of one tensor differ: elements, max |a-b|, max ULP, relative error
    (complex: |a-b| as a modulus, ULPs of the real and imaginary parts; sparse: those of
    their values, where their indices agree)."""
    if torch.sparse_coo in (a.layout, b.layout):
        return _sparse_difference(a, b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"elements": None, "of": a.numel(),
                "note": f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"}
    differ = a != b
    if a.is_floating_point() or a.is_complex():
        differ = differ & ~(a.isnan() & b.isnan())
    out: dict[str, Any] = {"elements": int(differ.sum()), "of": a.numel(),
                           "max_abs_diff": None, "max_ulp": None, "rel_error": None}
    if not out["elements"]:
        return out
    wide = (torch.complex128 if a.is_complex() else
            torch.float64 if a.is_floating_point() else torch.int64)
    diff = (a.to(wide) - b.to(wide)).abs()
    out["max_abs_diff"] = float(diff.max())
    # a complex number's ULPs are those of its real and imaginary parts
    parts_a, parts_b = ((torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj()))
                        if a.is_complex() else (a, b))
    if parts_a.dtype in _INT_OF_FLOAT:
        out["max_ulp"] = int((_ordered_bits(parts_a) - _ordered_bits(parts_b)).abs().max())
        norm = float(a.to(wide).norm())
        out["rel_error"] = float(diff.norm()) / norm if norm else None
    return out


def first_difference(reference: list[torch.Tensor], outputs: list[torch.Tensor]
                     ) -> dict[str, Any] | None:
    """How far apart the first pair of one op's outputs that differ is (None if none does)."""
    return next((tensor_difference(a, b) for a, b in zip(reference, outputs)
                 if not identical(a, b)), None)


def differences_from(reference: dict[Any, list[torch.Tensor]],
                     outputs: dict[Any, list[torch.Tensor]]) -> dict[Any, dict[str, Any] | None]:
    """For each op (by key) whose outputs one replay kept, as did the `reference` replay's:
    how far apart they are (see first_difference)."""
    return {key: first_difference(reference[key], kept) for key, kept in outputs.items()
            if key in reference}


def _sparse_difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    stored = a._nnz() if a.layout is torch.sparse_coo else a.numel()
    if a.layout != b.layout or a.shape != b.shape:
        return {"elements": None, "of": stored,
                "note": f"{tuple(a.shape)} {a.layout} vs {tuple(b.shape)} {b.layout}"}
    a, b = a.coalesce(), b.coalesce()
    if not torch.equal(a.indices(), b.indices()):
        return {"elements": None, "of": stored, "note": "sparse, with different indices"}
    return tensor_difference(a.values(), b.values())


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bit patterns mapped to integers that count ULPs (-0.0 and +0.0 both at 0)."""
    bits = t.contiguous().view(_INT_OF_FLOAT[t.dtype]).to(torch.int64)
    magnitude = bits & ((1 << (t.element_size() * 8 - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)
