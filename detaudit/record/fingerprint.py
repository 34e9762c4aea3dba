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

import itertools
import math
import os
import signal
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import fused

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
    # the sum of the elements under fixed signs, one per position (`position_signs`): moves
    # when elements trade places (a flip, a shuffled batch), which norm and absmax do not
    signed: float | None = None


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

    Dtypes numpy lacks (bfloat16, complex, ...) come as bytes. The view is made from the
    tensor's address (see _Memory), never by ``Tensor.numpy()``, which marks the tensor's
    storage as not resizable for good: FSDP frees and refills its parameters' storage by
    resizing it, and a script that did so after a print would fail."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().contiguous()
    typestr = _TYPESTRS.get(t.dtype)
    if typestr is None:
        return np.asarray(_Memory(t, "|u1", t.numel() * t.element_size()))
    return np.asarray(_Memory(t, typestr, t.numel()))


class _Memory:
    """A contiguous CPU tensor's memory as numpy reads it (``__array_interface__``); the
    view holds this, and this holds the tensor. (Marked writable, though nothing writes
    to it: torch warns when it wraps a read-only array, as a print's stats do.) Unlike
    ``Tensor.numpy()`` it does not stop another thread from resizing the storage while it
    is read; FSDP frees and refills storage in the training thread, between prints."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor, typestr: str, count: int) -> None:
        self.tensor = t
        # (a tensor without elements may have no address; numpy wants one)
        address = t.data_ptr() or _EMPTY.ctypes.data
        self.__array_interface__ = {"data": (address, False), "shape": (count,),
                                    "typestr": typestr, "version": 3}


_EMPTY = np.empty(8, dtype=np.uint8)
# numpy's name of each dtype it shares with torch (the rest are viewed as bytes)
_TYPESTRS = {dtype: torch.empty(0, dtype=dtype).numpy().dtype.str for dtype in _NUMPY_VIEWABLE}


_pool: ThreadPoolExecutor | None = None


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="detaudit-hash",
                                   initializer=_leave_signals_to_others)
    return _pool


def _leave_signals_to_others() -> None:
    """A hashing thread takes no SIGINT or SIGTERM: one it took would wait for the main
    thread to run Python code before its handler ran (a main thread blocked on a read, as
    an idle notebook kernel is, would never run it)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)


def _hash_piece(
    a: np.ndarray, start: int, stop: int, header: bytes | None, stats: bool, alone: bool = True
) -> tuple[int, tuple[float, Any, Any, float] | None]:
    """xxh3 of elements [start, stop) of a flat array (after `header`, if given) and, with
    stats, their (sum of squares, max, min, signed sum); the sums are inf or NaN if any
    element is. `alone`: no other hashing runs meanwhile, so torch's threads may take the
    max and min."""
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
    with np.errstate(over="ignore", invalid="ignore"):  # inf or NaN is the answer then
        sq = float(wide.dot(wide))
        end = start + part.size  # (the last piece may end before `stop`)
        signed = float(wide.dot(_numpy_signs(end, wide.dtype)[start:end]))
    if alone and part.size >= _TORCH_MINMAX:
        lo, hi = torch.aminmax(torch.from_numpy(part))
        return digest, (sq, float(hi), float(lo), signed)
    return digest, (sq, part[part.argmax()], part[part.argmin()], signed)  # argmax: cheaper


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
    if stats:  # the signs grown here, before the pieces share them among threads
        longest: dict[type, int] = {}
        for t in tensors:
            if t.dtype in _NUMPY_FLOATS:
                dtype = np.float64 if t.dtype == torch.float64 else np.float32
                longest[dtype] = max(longest.get(dtype, 0), t.numel())
        for dtype, n in longest.items():
            _numpy_signs(n, dtype)
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
    sums: list[tuple[float, Any, Any, float]] | None,
) -> TensorPrint:
    """A print from its hash and, if `stats`, the per-piece sums (None: stats in float64)."""
    if not stats or not t.is_floating_point():
        return _print((fp, shape, dtype, None, None, 0, None))
    if a.size == 0:
        return _print((fp, shape, dtype, 0.0, 0.0, 0, 0.0))
    if sums is not None:
        if len(sums) == 1:
            sq, hi, lo, signed = sums[0]
        else:
            sq, hi, lo = math.fsum(s[0] for s in sums), max(s[1] for s in sums), min(
                s[2] for s in sums
            )
            signed = math.fsum(s[3] for s in sums)
        norm = math.sqrt(sq)
        if math.isfinite(norm):  # then no element is NaN or Inf
            return _print((fp, shape, dtype, norm, max(float(hi), -float(lo)), 0, signed))
    return _print((fp, shape, dtype, *_exact_stats(t)))


def _exact_stats(t: torch.Tensor) -> tuple[float, float, int, float]:
    """(L2 norm, absmax, count of NaN/Inf, signed sum) in float64, skipping the non-finite
    elements."""
    x = t.detach().double().flatten()
    finite = torch.isfinite(x)
    good = x[finite]
    nonfinite = int(x.numel() - good.numel())
    if good.numel() == 0:
        return 0.0, 0.0, nonfinite, 0.0
    signed = float(np.dot(x.where(finite, 0.0).numpy(), _numpy_signs(x.numel(), np.float64)[
        : x.numel()]))
    return float(good.norm()), float(good.abs().max()), nonfinite, signed


_SIGN_MIX = 0xBF58476D1CE4E5B9  # splitmix64's first multiplier
_numpy_sign_cache: dict[np.dtype, np.ndarray] = {}


def position_signs(n: int) -> np.ndarray:
    """The sign (+1 or -1) of each position 0..n-1 that the signed sum weighs elements by:
    the top bit of a 64-bit mix of the position, so the signs of a block of positions (a
    row, a channel, an image of a batch) do not repeat another block's. The host's copy is
    kept as long as the largest float tensor printed with stats (twice at most)."""
    x = np.arange(n, dtype=np.uint64) * np.uint64(_MIX & (2**64 - 1))
    x ^= x >> np.uint64(30)
    x *= np.uint64(_SIGN_MIX)
    x ^= x >> np.uint64(31)
    return np.where(x >> np.uint64(63), -1.0, 1.0)


def _numpy_signs(n: int, dtype: np.dtype) -> np.ndarray:
    """`position_signs` of at least n positions, as `dtype` (float32 or float64): cached, and
    grown (doubled) as larger tensors come."""
    cached = _numpy_sign_cache.get(np.dtype(dtype))
    if cached is None or len(cached) < n:
        size = max(n, 2 * len(cached) if cached is not None else 1 << 16)
        cached = _numpy_sign_cache[np.dtype(dtype)] = position_signs(size).astype(dtype)
        cached.flags.writeable = False
    return cached


def _cpu_print(t: torch.Tensor, stats: bool) -> TensorPrint:
    """The print of one CPU tensor: a small one at once, in this thread."""
    if t.numel() * t.element_size() > CHUNK_BYTES:
        return _cpu_prints([t], stats)[0]
    a = _flat_view(t)
    header, shape, dtype = _describe(t)
    numpy_stats = stats and a.size > 0 and t.dtype in _NUMPY_FLOATS
    fp, sums = _hash_piece(a, 0, a.size, header, numpy_stats)
    return _finish(t, a, f"{fp:016x}", shape, dtype, stats, [sums] if sums else None)


_LOW33 = (1 << 33) - 1  # keeps the low 33 bits: an int64 `>> 31` made a logical shift


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """Mix an int64 tensor of our own in place (wrapping arithmetic, same on every device).

    A bijection: a product by an odd constant, then an xor with the *logical* right shift.
    torch's `>>` on int64 is arithmetic, and copying the sign into the high bits cleared the
    top bit of every result, so two 64-bit values mixed to one."""
    x.mul_(_MIX2)
    return x.bitwise_xor_((x >> 31).bitwise_and_(_LOW33))


def _new_weights(start: int, n: int, device: torch.device) -> torch.Tensor:
    """The odd int64 weights of positions [start, start + n), on `device`."""
    pos = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return _splitmix(pos.mul_(_MIX).add_(1)).bitwise_or_(1)


# Per device, the weights of the first positions, as many as the largest tensor asked for
# (rounded up to a power of two, at most a chunk: 32 MiB). Most tensors fit in one chunk, so
# they are weighed by a slice of this; later chunks of a larger tensor are weighed anew, which
# costs about what mixing the chunk does, rather than keeping 8 bytes per element on the device.
# Kept per stream too: weights made on one stream and replaced while a kernel on another
# still reads them would go back to the allocator under that kernel.
_WEIGHTS: dict[tuple[torch.device, Any], torch.Tensor] = {}


def _weights(start: int, n: int, device: torch.device) -> torch.Tensor:
    if start:
        return _new_weights(start, n, device)
    key = (device, fused.current_stream(device))
    weights = _WEIGHTS.get(key)
    if weights is None or weights.numel() < n:
        if len(_WEIGHTS) >= 16:
            _WEIGHTS.clear()
        size = max(n, min(max(1 << 12, 1 << (n - 1).bit_length()), _WSUM_CHUNK))
        weights = _WEIGHTS[key] = _new_weights(0, size, device)
    return weights[:n]


def _device_flat(t: torch.Tensor) -> torch.Tensor:
    """A flat, contiguous tensor of `t`'s logical content, lazy conjugation and negation
    resolved (a copy only where `t` is strided, conjugated or negated)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)


def _wsum(flat: torch.Tensor) -> torch.Tensor:
    """Position-weighted int64 sum of the mixed bit patterns of a `_device_flat` tensor."""
    bits = _wsum_bits(flat)
    if bits.numel() and fused.usable(bits.device):
        sums = fused.segment_wsum([bits], _MIX, _MIX2, _LOW33)
        if sums is not None:
            return sums[0]
    total = None
    for start in range(0, bits.numel(), _WSUM_CHUNK):
        # a copy of our own (`to` alone returns 64-bit bits as they are): mixed in place
        mixed = _splitmix(bits[start : start + _WSUM_CHUNK].to(torch.int64, copy=True).add_(_MIX))
        part = mixed.mul_(_weights(start, mixed.numel(), flat.device)).sum()
        total = part if total is None else total + part
    return torch.zeros((), dtype=torch.int64, device=flat.device) if total is None else total


def _wsum_bits(flat: torch.Tensor) -> torch.Tensor:
    """The bit-pattern view `_wsum` reduces (complex as pairs, bool as bytes)."""
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_BITS_DTYPE[flat.element_size()])


def _wsum_many(flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """`_wsum` of many `_device_flat` tensors of one device, in a number of kernels that
    grows with their bytes, not their count: tensors of one bit width are packed into one
    buffer of at most a chunk, mixed and weighed at their positions within their own tensor,
    and reduced per tensor with an integer index_add (wrapping integer addition is
    associative, so the sums are exactly `_wsum`'s, in any order, on any device). A tensor
    larger than a chunk is reduced alone."""
    out: list[torch.Tensor | None] = [None] * len(flats)
    buckets: dict[int, list[tuple[int, torch.Tensor]]] = {}  # bit width -> the open bucket
    filled: dict[int, int] = {}  # bit width -> elements in its open bucket
    for i, flat in enumerate(flats):
        bits = _wsum_bits(flat)
        n, width = bits.numel(), bits.element_size()
        if n > _WSUM_CHUNK or n == 0:
            out[i] = _wsum(flat)
            continue
        bucket = buckets.setdefault(width, [])
        if filled.get(width, 0) + n > _WSUM_CHUNK:
            _reduce_bucket(bucket, out)
            bucket.clear()
            filled[width] = 0
        bucket.append((i, bits))
        filled[width] = filled.get(width, 0) + n
    for bucket in buckets.values():
        if bucket:
            _reduce_bucket(bucket, out)
    return out  # type: ignore[return-value]


def _reduce_bucket(bucket: list[tuple[int, torch.Tensor]], out: list[Any]) -> None:
    """The weighted sums of one bucket's bit views, into their places in `out`."""
    sums = _segment_wsum([bits for _, bits in bucket])
    for k, (i, _) in enumerate(bucket):
        out[i] = sums[k]


def _segment_wsum(bits: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor weighted sums of bit views of one width, packed into one buffer: each
    element weighed by its position in its own tensor, then one running (prefix) sum, read at
    each tensor's end and differenced. Wrapping integer sums are exact in any order, and a scan
    adds no atomic contention (an index_add into one slot per tensor serialised on a GPU)."""
    device = bits[0].device
    sums = fused.segment_wsum(bits, _MIX, _MIX2, _LOW33) if fused.usable(device) else None
    if sums is not None:
        return sums
    sizes = [b.numel() for b in bits]
    weights = _weights(0, max(sizes), device)
    packed = torch.cat(bits).to(torch.int64, copy=True).add_(_MIX)
    mixed = _splitmix(packed).mul_(torch.cat([weights[:n] for n in sizes]))
    ends = fused.to_device_async(
        torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int64).sub_(1), device)
    at_end = mixed.cumsum_(0)[ends]
    return torch.diff(at_end, prepend=at_end.new_zeros(1))


def wsum_device_value(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted int64 sum of the mixed bit patterns, left on the tensor's device."""
    return _wsum(_device_flat(t))


def _finish_wsum(header: bytes, value: int) -> int:
    return xxhash.xxh3_64_intdigest(value.to_bytes(8, "little", signed=True), seed=0) ^ (
        xxhash.xxh3_64_intdigest(header)
    )


_FLOAT64_DEVICES: dict[str, bool] = {}


def widest_float(device: torch.device) -> torch.dtype:
    """float64 where the device has it (CPU, CUDA), else float32 (MPS: whose floats are all
    exact in float32)."""
    has = _FLOAT64_DEVICES.get(device.type)
    if has is None:
        try:
            torch.zeros(1, dtype=torch.float64, device=device)
            has = True
        except (RuntimeError, TypeError):  # MPS raises TypeError
            has = False
        _FLOAT64_DEVICES[device.type] = has
    return torch.float64 if has else torch.float32


def _device_float_stats(flat: torch.Tensor) -> torch.Tensor:
    """The stats of a flat floating tensor as one device vector (no sync), for `_read_stats`.

    Like the CPU's, they skip NaN and Inf. Taken chunk by chunk, so the temporaries stay
    within a chunk's size. In float64: [norm, absmax, nonfinite, signed sum]. A device
    without float64 (MPS) divides each chunk by the absmax so far before squaring, so no
    finite square overflows, and gives [norm / absmax, absmax, nonfinite >> 24,
    nonfinite & 0xFFFFFF, signed sum / absmax]: the host multiplies (the norm may pass
    float32's range where no element does), and a float32 holds integers exactly only to
    2**24."""
    wide = widest_float(flat.device)
    scaled = wide != torch.float64
    if flat.numel() == 0:
        return torch.zeros(5 if scaled else 4, dtype=wide, device=flat.device)
    signs = _device_signs(flat.numel(), wide, flat.device)
    sq = absmax = finite = signed = None
    for start in range(0, flat.numel(), _WSUM_CHUNK):
        part = flat[start : start + _WSUM_CHUNK]
        part_finite = torch.isfinite(part).sum()
        x = part.to(wide, copy=True).nan_to_num_(0.0, 0.0, 0.0)  # a copy of our own
        lo, hi = torch.aminmax(x)
        peak = torch.maximum(hi, -lo)
        if absmax is None:
            top, finite = peak, part_finite
        else:
            top, finite = torch.maximum(absmax, peak), finite + part_finite
        if scaled:  # sq holds the sum of (x / absmax)**2, signed that of x / absmax
            unit = torch.where(top > 0, top, 1.0)
            x.div_(unit)
        part_sq, part_signed = torch.dot(x, x), torch.dot(x, signs[start : start + x.numel()])
        if sq is None:
            sq, signed = part_sq, part_signed
        elif scaled:
            sq = sq * (absmax / unit).square() + part_sq
            signed = signed * (absmax / unit) + part_signed
        else:
            sq, signed = sq + part_sq, signed + part_signed
        absmax = top
    nonfinite = flat.numel() - finite
    if scaled:
        return torch.stack([sq.sqrt(), absmax, (nonfinite >> 24).to(wide),
                            (nonfinite & 0xFFFFFF).to(wide), signed])
    return torch.stack([sq.sqrt(), absmax, nonfinite.to(wide), signed])


_device_sign_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _device_signs(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`position_signs` of at least n positions on `device`: cached per device and dtype,
    grown (doubled) as larger tensors come."""
    key = (device, dtype)
    cached = _device_sign_cache.get(key)
    if cached is None or cached.numel() < n:
        size = max(n, 2 * cached.numel() if cached is not None else 1 << 16)
        cached = _device_sign_cache[key] = torch.from_numpy(position_signs(size)).to(
            device=device, dtype=dtype)
    return cached


def _read_stats(stats: list[float]) -> tuple[float, float, int, float]:
    """(norm, absmax, nonfinite, signed sum) from the host values of a
    `_device_float_stats` vector."""
    if len(stats) == 4:
        return stats[0], stats[1], int(stats[2]), stats[3]
    root, absmax, high, low, signed = stats
    return root * absmax, absmax, (int(high) << 24) + int(low), signed * absmax


WSUM = "wsum2"  # the device algorithm's version: 2 has a bijective mixer for 64-bit values


AS_LOADED = "state-xxh3"  # the batch as the data pipeline yields it: xxh3 on CPU, every dtype


def scheme(device: str | torch.device | None) -> str:
    """Which algorithm prints what, for a trace made on `device` (kept in its environment,
    so that a diff knows which records two traces can compare bitwise): floats by xxh3 on
    CPU and wsum elsewhere; integers and bools by wsum everywhere, so that they compare
    exactly across devices; except the batch as the data pipeline yields it (before the
    training code moves it), which lives on the CPU in a CPU run and a GPU run alike and is
    printed by xxh3 in every dtype (wsum reads a mask's every byte as an int64)."""
    kind = torch.device(device).type if device is not None else "cpu"
    return f"xxh3+{WSUM}-int+{AS_LOADED}" if kind == "cpu" else f"{WSUM}+{AS_LOADED}"


def _exact_dtype(t: torch.Tensor) -> bool:
    """Integers and bools: printed by wsum on every device."""
    return not (t.is_floating_point() or t.is_complex())


def storage_address(t: torch.Tensor) -> int | None:
    """The address of `t`'s storage; None for a tensor without one of its own (a wrapper
    subclass such as a DTensor, a tensor inside a ``torch.func`` transform)."""
    if _wraps_tensors(t):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding `t`'s elements: its own, or those of the tensors a wrapper
    subclass holds (a DTensor's local shard); none for a tensor without storage."""
    if _wraps_tensors(t):
        return [s for held in _held_tensors(t) for s in storages_of(held)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


def _held_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass holds (a DTensor's `__tensor_flatten__` also names its
    device mesh, which is no tensor)."""
    names, _ = t.__tensor_flatten__()
    return [held for held in (getattr(t, name) for name in names)
            if isinstance(held, torch.Tensor)]


_WRAPPERS: dict[type, bool] = {}


def _wraps_tensors(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor subclass that wraps others (asked once per type)."""
    kind = type(t)
    wraps = _WRAPPERS.get(kind)
    if wraps is None:
        wraps = _WRAPPERS[kind] = is_traceable_wrapper_subclass(t)
    return wraps


def _freed(t: torch.Tensor) -> bool:
    """Whether `t`'s storage was resized to nothing, as FSDP frees a parameter between its
    uses: it no longer holds the elements (torch's own ops crash on them)."""
    try:
        return bool(t.numel()) and not t.untyped_storage().nbytes()
    except NotImplementedError:  # a tensor inside a torch.func transform: no storage to ask
        return False


def _plain(t: torch.Tensor) -> torch.Tensor:
    """`t`, or where its content is not one strided buffer (a sparse gradient of
    ``nn.Embedding(sparse=True)``, a nested or a quantized tensor) a flat uint8 tensor of
    its content, after its shape: a sparse tensor's coalesced indices then values, a nested
    tensor's components in order (each after its shape), a quantized tensor's integers,
    scales and zero points; a tensor whose storage was freed, its shape. A tensor subclass
    that wraps others (a DTensor, as FSDP2's parameters and gradients are) is printed by
    what it holds: a DTensor by its local shard, as this process has it; one holding
    several tensors (a float8 tensor and its scale) by its shape then each of them; an
    AsyncCollectiveTensor by its result, once it has landed."""
    if _wraps_tensors(t) and not t.is_nested:  # (a jagged nested tensor is one: see below)
        settled = getattr(t, "trigger_wait", None)
        if callable(settled):  # an async collective's result: waited for, as its use would
            return _plain(settled())
        inner = [_plain(held) for held in _held_tensors(t)]
        return inner[0] if len(inner) == 1 else _as_bytes([_shape_of(t), *inner])
    if t.layout is torch.strided and not (t.is_nested or t.is_quantized):
        return _as_bytes([_shape_of(t)]) if _freed(t) else t
    t = t.detach()
    if t.is_nested:
        parts = [part for c in t.unbind() for part in (_shape_of(c), c)]
    elif t.is_quantized:
        parts = [_shape_of(t), t.int_repr(), *_quantization(t)]
    else:
        coo = (t if t.layout is torch.sparse_coo else t.to_sparse_coo()).coalesce()
        parts = [_shape_of(t), coo.indices(), coo.values()]
    return _as_bytes(parts)


def _as_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of `parts`, one after another, as one flat uint8 tensor."""
    return torch.cat([p.detach().contiguous().reshape(-1).view(torch.uint8) for p in parts])


def _quantization(t: torch.Tensor) -> list[torch.Tensor]:
    """A quantized tensor's scales and zero points (per tensor, or per channel)."""
    if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return [torch.tensor([t.q_scale()], dtype=torch.float64, device=t.device),
                torch.tensor([t.q_zero_point()], dtype=torch.int64, device=t.device)]
    return [t.q_per_channel_scales().to(torch.float64),
            t.q_per_channel_zero_points().to(torch.int64)]


def _shape_of(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor(t.shape, dtype=torch.int64, device=t.device)


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
        self._seen: dict[tuple[int, bool, bool], tuple[weakref.ref, int, int]] = {}

    def _by_xxh3(self, t: torch.Tensor, algorithm: str | None) -> bool:
        """Whether `t` is printed by xxh3 (CPU only): as `algorithm` (this call's) or the
        fingerprinter's says, else floats by xxh3 and integers by wsum."""
        chosen = algorithm or self.algorithm
        return t.is_cpu and chosen != "wsum" and (chosen == "xxh3" or not _exact_dtype(t))

    def add(self, t: torch.Tensor, stats: bool | None = None,
            algorithm: str | None = None) -> int:
        """Queue a tensor; return its slot number. `stats=False` skips norm/absmax;
        `algorithm` ("xxh3" or "wsum") overrides the fingerprinter's for this tensor."""
        slot = len(self._done)
        want_stats = self.stats if stats is None else stats
        t = _plain(t)
        xxh3 = self._by_xxh3(t, algorithm)
        if self._reuse(t, want_stats, slot, xxh3):
            return slot
        if xxh3:
            self._done.append(_cpu_print(t, want_stats))
            return slot
        flat = _device_flat(t)
        self._done.append(None)
        self._queue(slot, t, flat, _wsum(flat), want_stats)
        return slot

    def add_many(self, tensors: list[torch.Tensor], stats: bool | None = None,
                 algorithm: str | None = None, written: bool = False) -> None:
        """Queue tensors in order: the CPU ones hashed together on torch's thread count, the
        device (wsum) ones reduced together per device (see `_wsum_many`). `algorithm`
        overrides the fingerprinter's for these tensors. `written`: they were just written
        in place by an op whose version bump has not happened yet (inside a dispatch mode),
        so no earlier print of them is reused."""
        want_stats = self.stats if stats is None else stats
        batch: list[tuple[int, torch.Tensor]] = []
        on_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for t in map(_plain, tensors):
            xxh3 = self._by_xxh3(t, algorithm)
            if self._reuse(t, want_stats, len(self._done), xxh3, written):
                continue
            if xxh3:
                batch.append((len(self._done), t))
            else:
                on_device.setdefault(t.device, []).append((len(self._done), t))
            self._done.append(None)
        for (slot, _), print_ in zip(batch, _cpu_prints([t for _, t in batch], want_stats)):
            self._done[slot] = print_
        for queued in on_device.values():
            flats = [_device_flat(t) for _, t in queued]
            for (slot, t), flat, value in zip(queued, flats, _wsum_many(flats)):
                self._queue(slot, t, flat, value, want_stats)

    def _queue(
        self, slot: int, t: torch.Tensor, flat: torch.Tensor, value: torch.Tensor, stats: bool
    ) -> None:
        """Keep a device print's value (and stats) on the device until `collect`."""
        device_stats = _device_float_stats(flat) if stats and t.is_floating_point() else None
        self._pending.append((slot, value, device_stats, _describe(t)))

    def _reuse(self, t: torch.Tensor, stats: bool, slot: int, xxh3: bool,
               written: bool = False) -> bool:
        """Point at the earlier slot of this very tensor, unchanged since and printed by the
        same algorithm; else (or where it was `written` since) remember it."""
        if t.is_inference():  # no version counter, and changes in place in inference mode
            return False
        key = (id(t), stats, xxh3)
        version = t._version
        seen = self._seen.get(key)
        if not written and seen is not None and seen[1] == version and seen[0]() is t:
            self._done.append(seen[2])
            return True
        self._seen[key] = (weakref.ref(t), version, slot)
        return False

    def forget(self, storages: set[int]) -> None:
        """No print taken so far of a tensor in these storages is reused: they were written
        without a version bump (a collective's result landing)."""
        for key, (ref, _, _) in list(self._seen.items()):
            held = ref()
            if held is None or storage_address(held) in storages:
                del self._seen[key]

    def add_print(self, print_: TensorPrint) -> None:
        """Queue a print taken earlier (by another fingerprinter)."""
        self._done.append(print_)

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
                norm, absmax, nonfinite, signed = (
                    _read_stats(next(stats_iter)) if has_stats is not None
                    else (None, None, 0, None)
                )
                self._done[slot] = TensorPrint(
                    f"{_finish_wsum(header, int(value)):016x}", shape, dtype,
                    norm, absmax, nonfinite, signed,
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
