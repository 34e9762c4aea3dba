"""The device fingerprint (wsum) of many tensors in one fused kernel, where Triton runs.

The torch form of wsum (fingerprint.py) mixes and weighs every element in a dozen full passes
over int64 temporaries. Here one Triton kernel reads each element once: it widens the bits,
mixes them, computes the weight of the element's position in its own tensor, and sums a block
of products; the block sums of each tensor are then added with one running sum. The
arithmetic is fingerprint.py's, in wrapping int64, so the values are exactly the torch form's
on every device, and integer addition makes them independent of the blocks' order.

Used for CUDA tensors when Triton imports (``DETAUDIT_FUSED_WSUM=0`` turns it off); the tests
run the kernel on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any

import numpy as np
import torch

BLOCK = 4096  # elements per program
# The block tables of recent layouts (the parameters of a model are the same every step).
_TABLES: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}


# Device types on which the kernel failed to build or launch: the torch form is used there.
_FAILED: set[str] = set()


def usable(device: torch.device) -> bool:
    """Whether tensors on `device` are printed by the fused kernel (asked per tensor: the
    cheap tests first)."""
    if device.type in _FAILED or (
            device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return False
    return os.environ.get("DETAUDIT_FUSED_WSUM", "1") != "0" and _kernel() is not None


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any failure to import means: use the torch form
        return None

    @triton.jit
    def wsum_blocks(bits, block_start, block_position, block_length, out, mix, mix2, low33,
                    BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = tl.load(block_start + pid)
        position = tl.load(block_position + pid)
        length = tl.load(block_length + pid)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < length
        x = tl.load(bits + start + offsets, mask=inside, other=0).to(tl.int64) + mix
        x = x * mix2
        x = x ^ ((x >> 31) & low33)
        w = (position + offsets).to(tl.int64) * mix + 1
        w = w * mix2
        w = (w ^ ((w >> 31) & low33)) | 1
        tl.store(out + pid, tl.sum(tl.where(inside, x * w, 0), axis=0))

    return wsum_blocks


def _tables(sizes: tuple[int, ...], device: torch.device):
    """Per block: its start in the packed buffer, its first position in its own tensor, its
    length; and per tensor, the index of its last block. Cached per layout (the packed
    parameters or gradients of a model: the same every step)."""
    # the tables are copied without waiting, on the current stream: reused on that one only
    key = (sizes, device, current_stream(device))
    cached = _TABLES.get(key)
    if cached is not None:
        return cached
    counts = np.array([-(-n // BLOCK) for n in sizes], dtype=np.int64)
    owner = np.repeat(np.arange(len(sizes)), counts)
    first_block = np.cumsum(counts) - counts
    within = np.arange(counts.sum(), dtype=np.int64) - first_block[owner]
    offsets = np.cumsum(sizes, dtype=np.int64) - np.array(sizes, dtype=np.int64)
    position = within * BLOCK
    start = offsets[owner] + position
    length = np.minimum(np.array(sizes, dtype=np.int64)[owner] - position, BLOCK)
    last = np.cumsum(counts) - 1
    tables = tuple(to_device_async(torch.from_numpy(a), device)
                   for a in (start, position, length, last))
    if len(_TABLES) >= 64:
        _TABLES.clear()
    _TABLES[key] = tables
    return tables


def current_stream(device: torch.device) -> int | None:
    """The current CUDA stream of `device` (None elsewhere): what a cache of device tensors
    made without waiting is kept per."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on `device`, with no wait on a CUDA stream."""
    if device.type == "cuda":  # from pinned memory, asynchronously: no wait on the stream
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def segment_wsum(bits: list[torch.Tensor], mix: int, mix2: int, low33: int
                 ) -> torch.Tensor | None:
    """The wsum of each flat bit view in `bits` (one dtype, one device, none empty), as one
    int64 vector on their device, in a constant number of kernels; None where the kernel
    cannot be built or launched here (it is not tried on that device type again)."""
    if len(bits) == 1:  # one tensor: its blocks' tables made on the device, no cache
        packed = bits[0]
        start = position = torch.arange(0, packed.numel(), BLOCK, device=packed.device)
        length = (packed.numel() - position).clamp_(max=BLOCK)
        last = None
    else:
        packed = torch.cat(bits)
        start, position, length, last = _tables(tuple(b.numel() for b in bits), packed.device)
    partial = torch.empty(start.numel(), dtype=torch.int64, device=packed.device)
    # Triton launches on the current CUDA device: make it the tensors' (a rank's cuda:1)
    on_device = torch.cuda.device(packed.device) if packed.is_cuda else contextlib.nullcontext()
    try:
        with on_device:
            _kernel()[(start.numel(),)](packed, start, position, length, partial, mix, mix2,
                                        low33, BLOCK=BLOCK)
    except Exception as exc:  # noqa: BLE001 - a compiler or driver that cannot run it
        _FAILED.add(packed.device.type)
        warnings.warn(f"detaudit: the fused fingerprint kernel failed on {packed.device} "
                      f"({type(exc).__name__}: {exc}); using the torch form", stacklevel=2)
        return None
    if last is None:
        return partial.sum(0, keepdim=True)
    at_end = partial.cumsum_(0)[last]
    return torch.diff(at_end, prepend=at_end.new_zeros(1))
