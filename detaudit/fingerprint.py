"""Order-aware, bit-exact tensor fingerprints and the cheap stats kept beside them.

Two algorithms, chosen per tensor by where it lives:

* ``xxh3`` (CPU): xxh3-64 over a zero-copy byte view of the contiguous tensor, seeded
  with its dtype and shape.
* ``wsum`` (accelerators): a position-weighted sum of the mixed bit patterns, computed on
  the device in int64. Integer addition is associative, so the fingerprint is itself
  deterministic on a GPU, where a float reduction would not be; the result stays on the
  device until :meth:`Fingerprinter.collect` fetches every pending value in one transfer.

Neither draws from an RNG or writes into the tensor.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

# The bit-pattern integer type of each element size (bool and 1-byte types use uint8).
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_FLOATS = {torch.float16, torch.float32, torch.float64}
_NUMPY_VIEWABLE = _NUMPY_FLOATS | {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64
}
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (golden-ratio constant)
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9, splitmix64's first multiplier
_WSUM_CHUNK = 1 << 22
_LARGE = 1 << 16  # elements from which torch's one-pass aminmax beats numpy's min + max  # elements per chunk, bounds the temporaries on the device


class TensorPrint(NamedTuple):
    """A tensor's fingerprint and the stats that say how large a difference is."""

    fp: str
    shape: tuple[int, ...]
    dtype: str
    norm: float | None  # None where stats were not asked for (non-float, optimizer state)
    absmax: float | None
    nonfinite: int


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _header(t: torch.Tensor) -> bytes:
    return f"{t.dtype}|{tuple(t.shape)}".encode()


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A zero-copy byte view of a CPU tensor's logical content (copies only if strided)."""
    t = t.detach()
    if t.dtype in _NUMPY_VIEWABLE and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return t.numpy()
    flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8).numpy()


def xxh3_fingerprint(t: torch.Tensor) -> int:
    """xxh3-64 of dtype, shape and the raw bytes of a CPU tensor."""
    h = xxhash.xxh3_64(_header(t))
    if t.numel():
        h.update(_byte_view(t))
    return h.intdigest()


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """A cheap int64 bit mixer (wrapping arithmetic, same on every device)."""
    x = x * _MIX2
    return x ^ (x >> 31)


def wsum_device_value(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted int64 sum of the mixed bit patterns, left on the tensor's device."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_BITS_DTYPE[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _WSUM_CHUNK):
        chunk = bits[start : start + _WSUM_CHUNK].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=flat.device, dtype=torch.int64)
        weights = _splitmix(pos * _MIX + 1) | 1
        total = total + (_splitmix(chunk + _MIX) * weights).sum()
    return total


def _finish_wsum(header: bytes, value: int) -> int:
    return xxhash.xxh3_64_intdigest(value.to_bytes(8, "little", signed=True), seed=0) ^ (
        xxhash.xxh3_64_intdigest(header)
    )


def _float_stats(t: torch.Tensor) -> tuple[float, float, int]:
    """(L2 norm, absmax, count of NaN/Inf) of a CPU floating tensor, in one or two passes."""
    if t.numel() == 0:
        return 0.0, 0.0, 0
    if t.dtype in _NUMPY_FLOATS and t.is_contiguous():
        a = t.detach().numpy().reshape(-1)
        sq = float(np.dot(a, a))
        if math.isfinite(sq):  # no NaN/Inf anywhere: the common case, two fast passes
            if a.size >= _LARGE:
                lo, hi = torch.aminmax(t.detach())
                return math.sqrt(sq), float(max(hi, -lo)), 0
            return math.sqrt(sq), float(max(a.max(), -a.min())), 0
    x = t.detach().double()
    finite = torch.isfinite(x)
    good = x[finite]
    nonfinite = int(x.numel() - good.numel())
    if good.numel() == 0:
        return 0.0, 0.0, nonfinite
    return float(good.norm()), float(good.abs().max()), nonfinite


def _device_float_stats(t: torch.Tensor) -> torch.Tensor:
    """[norm, absmax, nonfinite] of a device floating tensor, as one device vector (no sync)."""
    x = t.detach().float()
    finite = torch.isfinite(x)
    good = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if x.numel() == 0:
        return torch.zeros(3, device=x.device)
    return torch.stack(
        [good.norm(), good.abs().amax(), (~finite).sum().float()]
    ).to(torch.float64)


class Fingerprinter:
    """Fingerprints tensors; device results are fetched once, in :meth:`collect`.

    ``add`` returns a slot number; ``collect`` returns the :class:`TensorPrint` of every
    slot added since the last ``collect``, in order. CPU tensors are finished at once;
    accelerator tensors keep device scalars until ``collect`` (one host sync per call).
    """

    def __init__(self, stats: bool = True, algorithm: str | None = None) -> None:
        if algorithm not in (None, "xxh3", "wsum"):
            raise ValueError(f"unknown fingerprint algorithm {algorithm!r}")
        self.stats = stats
        self.algorithm = algorithm
        self._done: list[TensorPrint | int | None] = []  # an int points at an earlier slot
        self._pending: list[tuple[int, torch.Tensor, bytes, torch.Tensor | None, Any]] = []
        # A module's input is usually the previous module's output: hash each tensor once
        # per collect. Weak references, so grads freed by backward are not kept alive.
        self._seen: dict[tuple[int, bool], tuple[weakref.ref, int, int]] = {}

    def add(self, t: torch.Tensor, stats: bool | None = None) -> int:
        """Queue a tensor; return its slot number. `stats=False` skips norm/absmax."""
        slot = len(self._done)
        want_stats = self.stats if stats is None else stats
        key = (id(t), want_stats)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            self._done.append(seen[2])
            return slot
        self._seen[key] = (weakref.ref(t), t._version, slot)
        algorithm = self.algorithm or ("xxh3" if t.device.type == "cpu" else "wsum")
        want_stats = want_stats and t.is_floating_point()
        if algorithm == "xxh3" and t.device.type == "cpu":
            norm, absmax, nonfinite = _float_stats(t) if want_stats else (None, None, 0)
            self._done.append(
                TensorPrint(
                    f"{xxh3_fingerprint(t):016x}", tuple(t.shape), _dtype_name(t.dtype),
                    norm, absmax, nonfinite,
                )
            )
            return slot
        value = wsum_device_value(t)
        device_stats = _device_float_stats(t) if want_stats else None
        self._done.append(None)
        self._pending.append((slot, value, _header(t), device_stats, t.shape))
        return slot

    def add_bytes(self, data: bytes) -> int:
        """Queue the print of raw bytes (an RNG state); return its slot number."""
        self._done.append(TensorPrint(fingerprint_bytes(data), (len(data),), "bytes", None, None, 0))
        return len(self._done) - 1

    def collect(self) -> list[TensorPrint]:
        """All prints added since the last call, fetching device values in one transfer."""
        if self._pending:
            values = _fetch([p[1] for p in self._pending])
            stats = _fetch([p[3] for p in self._pending if p[3] is not None])
            stats_iter = iter(stats)
            for (slot, _, header, has_stats, shape), value in zip(self._pending, values):
                norm, absmax, nonfinite = (
                    next(stats_iter) if has_stats is not None else (None, None, 0)
                )
                dtype = header.decode().split("|")[0].replace("torch.", "")
                self._done[slot] = TensorPrint(
                    f"{_finish_wsum(header, int(value)):016x}", tuple(shape), dtype,
                    norm, absmax, int(nonfinite),
                )
        done = [p if not isinstance(p, int) else self._done[p] for p in self._done]
        self._done, self._pending, self._seen = [], [], {}
        return done  # type: ignore[return-value]


def _fetch(tensors: list[torch.Tensor]) -> list[Any]:
    """Host values of device tensors: one stack and one transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[Any] = [None] * len(tensors)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([tensors[i] for i in indices]).cpu().tolist()):
            out[i] = value
    return out


def fingerprint(t: torch.Tensor, algorithm: str | None = None, stats: bool = True) -> TensorPrint:
    """The print of one tensor (fetches at once; use a Fingerprinter inside hot loops)."""
    fper = Fingerprinter(stats=stats, algorithm=algorithm)
    fper.add(t)
    return fper.collect()[0]


def fingerprint_bytes(data: bytes) -> str:
    """Fingerprint of raw bytes (RNG states, pickled-free python values)."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"
