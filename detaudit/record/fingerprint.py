"""Order-aware, bit-exact tensor fingerprints and the cheap stats kept beside them.

Two algorithms, chosen per tensor by where it lives:

* ``xxh3`` (CPU): xxh3-64 of the dtype and shape followed by the raw bytes, read through a
  zero-copy view of the contiguous tensor. Above 1 MiB the bytes are hashed as a tree:
  each 1 MiB chunk on its own (by as many threads as torch uses), then the chunk digests in
  order. The chunking is fixed, so the print does not depend on the thread count; the stats
  are taken chunk by chunk while the chunk is in cache, so memory is read once.
* ``wsum`` (accelerators): a position-weighted sum of the mixed bit patterns, computed on
  the device in int64. Integer addition is associative, so the fingerprint is itself
  deterministic on a GPU, where a float reduction would not be; the result stays on the
  device until :meth:`Fingerprinter.collect` fetches every pending value in one transfer.

Neither draws from an RNG or writes into the tensor.
"""

from __future__ import annotations

import math
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
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
_WSUM_CHUNK = 1 << 22  # elements per chunk, bounds the temporaries on the device
CHUNK_BYTES = 1 << 20  # bytes per leaf of the xxh3 tree, and per stats block (stays in L2)
_TORCH_MINMAX = 1 << 16  # elements from which torch's threaded aminmax beats numpy's argmax, argmin


class TensorPrint(NamedTuple):
    """A tensor's fingerprint and the stats that say how large a difference is."""

    fp: str
    shape: tuple[int, ...]
    dtype: str
    norm: float | None  # None where stats were not asked for (non-float, optimizer state)
    absmax: float | None
    nonfinite: int


_print = TensorPrint._make  # a third of the cost of TensorPrint(...), which parses keywords

_DESCRIPTIONS: dict[tuple[torch.dtype, torch.Size], tuple[bytes, tuple[int, ...], str]] = {}


def _describe(t: torch.Tensor) -> tuple[bytes, tuple[int, ...], str]:
    """(hash header, shape, dtype name) of a tensor, cached per dtype and shape."""
    key = (t.dtype, t.shape)
    described = _DESCRIPTIONS.get(key)
    if described is None:
        if len(_DESCRIPTIONS) >= 1 << 14:  # detection shapes vary with box counts: stay bounded
            _DESCRIPTIONS.clear()
        shape = tuple(t.shape)
        described = _DESCRIPTIONS[key] = (
            f"{t.dtype}|{shape}".encode(), shape, str(t.dtype).replace("torch.", "")
        )
    return described


def _flat_view(t: torch.Tensor) -> np.ndarray:
    """A flat, zero-copy numpy view of a CPU tensor's logical content (copies only if strided).

    Dtypes numpy lacks (bfloat16, complex, ...) come as bytes."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _NUMPY_VIEWABLE and t.is_contiguous():
        try:
            return t.numpy() if t.dim() == 1 else t.numpy().reshape(-1)
        except RuntimeError:  # a lazily negated view: resolved below
            pass
    flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.dtype in _NUMPY_VIEWABLE:
        return flat.numpy()
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8).numpy()


_pool: ThreadPoolExecutor | None = None


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="detaudit-hash")
    return _pool


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)


def _hash_piece(
    a: np.ndarray, start: int, stop: int, header: bytes | None, stats: bool, alone: bool = True
) -> tuple[int, tuple[float, Any, Any] | None]:
    """xxh3 of elements [start, stop) of a flat array (after `header`, if given) and, with
    stats, their (sum of squares, max, min); the sum is inf or NaN if any element is.
    `alone`: no other hashing runs meanwhile, so torch's threads may take the max and min."""
    part = a[start:stop]
    if header is None:
        digest = xxhash.xxh3_64_intdigest(part)
    else:
        h = xxhash.xxh3_64(header)
        h.update(part)
        digest = h.intdigest()
    if not stats:
        return digest, None
    wide = part.astype(np.float32) if part.dtype == np.float16 else part
    sq = float(wide.dot(wide))
    if alone and part.size >= _TORCH_MINMAX:
        lo, hi = torch.aminmax(torch.from_numpy(part))
        return digest, (sq, float(hi), float(lo))
    return digest, (sq, part[part.argmax()], part[part.argmin()])  # argmax: less overhead


def _hash_pieces(pieces: list[tuple]) -> list[tuple[int, tuple[float, Any, Any] | None]]:
    """`_hash_piece` of every piece, in order. Over 1 MiB in all, the pieces are shared among
    torch's thread count in contiguous runs of about equal bytes; xxhash and numpy release
    the GIL, so the runs proceed in parallel (this thread takes the first)."""
    sizes = [(stop - start) * a.itemsize for a, start, stop, _, _ in pieces]
    total = sum(sizes)
    parts = min(torch.get_num_threads(), total // CHUNK_BYTES)
    if parts < 2:
        return _hash_run(pieces, alone=True)
    runs: list[list[tuple]] = [[]]
    done = 0
    for piece, size in zip(pieces, sizes):
        runs[-1].append(piece)
        done += size
        if done * parts >= total * len(runs) and len(runs) < parts:
            runs.append([])
    futures = [_thread_pool().submit(_hash_run, run, False) for run in runs[1:]]
    results = _hash_run(runs[0], alone=False)
    for future in futures:
        results += future.result()
    return results


def _hash_run(pieces: list[tuple], alone: bool) -> list[tuple[int, tuple[float, Any, Any] | None]]:
    return [_hash_piece(*piece, alone) for piece in pieces]


def _cpu_prints(tensors: list[torch.Tensor], stats: bool) -> list[TensorPrint]:
    """The xxh3 prints of CPU tensors, with (L2 norm, absmax, non-finite count) if `stats`.

    A tensor of up to 1 MiB is one piece, hashed after its header; a larger one is cut into
    1 MiB chunks hashed on their own, and its print is the hash of the header and the chunk
    digests. The pieces of all the tensors are hashed together."""
    views, pieces, piece_ranges = [], [], []
    for t in tensors:
        header, _, _ = described = _describe(t)
        a = _flat_view(t)
        numpy_stats = stats and a.size > 0 and t.dtype in _NUMPY_FLOATS
        first = len(pieces)
        if a.nbytes <= CHUNK_BYTES:
            pieces.append((a, 0, a.size, header, numpy_stats))
        else:
            step = CHUNK_BYTES // a.itemsize
            pieces += [(a, i, i + step, None, numpy_stats) for i in range(0, a.size, step)]
        views.append((t, a, described, numpy_stats))
        piece_ranges.append((first, len(pieces)))
    results = _hash_pieces(pieces)
    out = []
    for (t, a, (header, shape, dtype), numpy_stats), (first, stop) in zip(views, piece_ranges):
        done = results[first:stop]
        if a.nbytes <= CHUNK_BYTES:
            fp = done[0][0]
        else:
            fp = xxhash.xxh3_64_intdigest(
                header + b"".join(digest.to_bytes(8, "little") for digest, _ in done)
            )
        out.append(_finish(t, a, f"{fp:016x}", shape, dtype, stats,
                           [s for _, s in done] if numpy_stats else None))
    return out


def _finish(
    t: torch.Tensor, a: np.ndarray, fp: str, shape: tuple[int, ...], dtype: str, stats: bool,
    sums: list[tuple[float, Any, Any]] | None,
) -> TensorPrint:
    """A print from its hash and, if `stats`, the per-piece sums (None: stats in float64)."""
    if not stats or not t.is_floating_point():
        return _print((fp, shape, dtype, None, None, 0))
    if a.size == 0:
        return _print((fp, shape, dtype, 0.0, 0.0, 0))
    if sums is not None:
        if len(sums) == 1:
            sq, hi, lo = sums[0]
        else:
            sq, hi, lo = math.fsum(s[0] for s in sums), max(s[1] for s in sums), min(
                s[2] for s in sums
            )
        norm = math.sqrt(sq)
        if math.isfinite(norm):  # then no element is NaN or Inf
            return _print((fp, shape, dtype, norm, max(float(hi), -float(lo)), 0))
    return _print((fp, shape, dtype, *_exact_stats(t)))


def _exact_stats(t: torch.Tensor) -> tuple[float, float, int]:
    """(L2 norm, absmax, count of NaN/Inf) in float64, skipping the non-finite elements."""
    x = t.detach().double()
    finite = torch.isfinite(x)
    good = x[finite]
    nonfinite = int(x.numel() - good.numel())
    if good.numel() == 0:
        return 0.0, 0.0, nonfinite
    return float(good.norm()), float(good.abs().max()), nonfinite


def _cpu_print(t: torch.Tensor, stats: bool) -> TensorPrint:
    """The print of one CPU tensor: a small one at once, in this thread."""
    a = _flat_view(t)
    if a.nbytes > CHUNK_BYTES:
        return _cpu_prints([t], stats)[0]
    header, shape, dtype = _describe(t)
    numpy_stats = stats and a.size > 0 and t.dtype in _NUMPY_FLOATS
    fp, sums = _hash_piece(a, 0, a.size, header, numpy_stats)
    return _finish(t, a, f"{fp:016x}", shape, dtype, stats, [sums] if sums else None)


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
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | None, tuple]] = []
        # A module's input is usually the previous module's output: hash each tensor once
        # per collect. Weak references, so grads freed by backward are not kept alive.
        self._seen: dict[tuple[int, bool], tuple[weakref.ref, int, int]] = {}

    def add(self, t: torch.Tensor, stats: bool | None = None) -> int:
        """Queue a tensor; return its slot number. `stats=False` skips norm/absmax."""
        slot = len(self._done)
        want_stats = self.stats if stats is None else stats
        if self._reuse(t, want_stats, slot):
            return slot
        if t.is_cpu and self.algorithm != "wsum":
            self._done.append(_cpu_print(t, want_stats))
            return slot
        device_stats = _device_float_stats(t) if want_stats and t.is_floating_point() else None
        self._done.append(None)
        self._pending.append((slot, wsum_device_value(t), device_stats, _describe(t)))
        return slot

    def add_many(self, tensors: list[torch.Tensor], stats: bool | None = None) -> None:
        """Queue tensors in order, the CPU ones hashed together on torch's thread count."""
        want_stats = self.stats if stats is None else stats
        batch: list[tuple[int, torch.Tensor]] = []
        for t in tensors:
            if not t.is_cpu or self.algorithm == "wsum":
                self.add(t, stats)
            elif not self._reuse(t, want_stats, len(self._done)):
                batch.append((len(self._done), t))
                self._done.append(None)
        for (slot, _), print_ in zip(batch, _cpu_prints([t for _, t in batch], want_stats)):
            self._done[slot] = print_

    def _reuse(self, t: torch.Tensor, stats: bool, slot: int) -> bool:
        """Point at the earlier slot of this very tensor, unchanged since; else remember it."""
        key = (id(t), stats)
        version = t._version
        seen = self._seen.get(key)
        if seen is not None and seen[1] == version and seen[0]() is t:
            self._done.append(seen[2])
            return True
        self._seen[key] = (weakref.ref(t), version, slot)
        return False

    def add_bytes(self, data: bytes) -> int:
        """Queue the print of raw bytes (an RNG state); return its slot number."""
        self._done.append(TensorPrint(fingerprint_bytes(data), (len(data),), "bytes", None, None, 0))
        return len(self._done) - 1

    def collect(self) -> list[TensorPrint]:
        """All prints added since the last call, fetching device values in one transfer."""
        if self._pending:
            values = _fetch([p[1] for p in self._pending])
            stats = _fetch([p[2] for p in self._pending if p[2] is not None])
            stats_iter = iter(stats)
            for (slot, _, has_stats, (header, shape, dtype)), value in zip(self._pending, values):
                norm, absmax, nonfinite = (
                    next(stats_iter) if has_stats is not None else (None, None, 0)
                )
                self._done[slot] = TensorPrint(
                    f"{_finish_wsum(header, int(value)):016x}", shape, dtype,
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
