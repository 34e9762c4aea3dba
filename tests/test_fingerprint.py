from __future__ import annotations

import contextlib
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from detaudit.record import fingerprint as fpmod
from detaudit.record import fused
from detaudit.record.fingerprint import (
    Fingerprinter,
    fingerprint,
    position_signs,
    wsum_device_value,
)

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

ALGORITHMS = ["xxh3", "wsum"]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES = [*FLOATS, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
          torch.complex64]


def fp(t, algorithm):
    return fingerprint(t, algorithm).fp


def _sample(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 7, generator=g) * 10
    return (x > 0) if dtype == torch.bool else x.to(dtype)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_order_and_content_change_the_print(algorithm, dtype):
    x = _sample(dtype)
    base = fp(x, algorithm)
    assert fp(x.clone(), algorithm) == base
    perm = x.flatten()[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    if not torch.equal(perm, x.flatten()):
        assert fp(perm.reshape(x.shape), algorithm) != base
    assert fp(x.reshape(7, 6), algorithm) != base  # same bytes, other shape
    swapped = x.clone().flatten()
    swapped[[0, 1]] = swapped[[1, 0]]
    if not torch.equal(swapped, x.flatten()):
        assert fp(swapped.reshape(x.shape), algorithm) != base  # a single swap
    # the same logical content, stored transposed, gives the same print
    assert fp(x.t().contiguous().t(), algorithm) == base


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_one_ulp_changes_the_print(algorithm, dtype):
    x = _sample(dtype)
    y = x.clone()
    y[3, 4] = torch.nextafter(y[3, 4], torch.tensor(float("inf"), dtype=dtype))
    assert fp(y, algorithm) != fp(x, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_transpose_and_dtype_change_the_print(algorithm):
    x = torch.arange(12.0).reshape(3, 4)
    assert fp(x.t().contiguous(), algorithm) != fp(x, algorithm)
    assert fp(x.double(), algorithm) != fp(x, algorithm)
    assert fp(x.to(torch.int64), algorithm) != fp(x, algorithm)
    assert fp(torch.zeros(0, 4), algorithm) != fp(torch.zeros(4, 0), algorithm)
    assert fp(torch.tensor(-0.0), algorithm) != fp(torch.tensor(0.0), algorithm)


def test_stats_describe_size_and_nonfinite():
    p = fingerprint(torch.tensor([3.0, -4.0]))
    assert (p.norm, p.absmax, p.nonfinite) == (5.0, 4.0, 0)
    q = fingerprint(torch.tensor([1.0, float("nan"), float("inf"), -2.0]))
    assert q.nonfinite == 2 and q.absmax == 2.0
    assert fingerprint(torch.zeros(0)).norm == 0.0
    assert fingerprint(torch.ones(3, dtype=torch.int64)).norm is None  # stats are for floats


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_same_print_under_1_and_2_threads(algorithm):
    x = torch.randn(512, 1031, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint(x, algorithm)
        torch.set_num_threads(2)
        two = fingerprint(x, algorithm)
    finally:
        torch.set_num_threads(before)
    assert one.fp == two.fp


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_no_rng_drawn_and_nothing_written(algorithm):
    x = torch.randn(100, 100)
    version = x._version
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    fp(x, algorithm)
    fp(x.t(), algorithm)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert random.getstate() == states[2]
    assert x._version == version


def test_fingerprinter_cache_sees_inplace_changes():
    f = Fingerprinter()
    x = torch.randn(10)
    f.add(x)
    f.add(x)
    x.add_(1.0)  # bumps the version: must be hashed again
    f.add(x)
    a, b, c = f.collect()
    assert a.fp == b.fp != c.fp


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_prints_are_deterministic_and_match_cpu_wsum():
    x = torch.randn(1000, 333)
    gpu = [fingerprint(x.cuda()).fp for _ in range(3)]
    assert len(set(gpu)) == 1
    assert gpu[0] == fingerprint(x, "wsum").fp


def test_large_tensors_hash_as_a_tree_and_keep_exact_stats():
    x = torch.randn(3 * (1 << 18) + 5, generator=torch.Generator().manual_seed(4))  # 3+ chunks
    p = fingerprint(x)
    exact = x.double()
    assert p.norm == pytest.approx(float(exact.norm()), rel=1e-6)
    assert p.absmax == float(exact.abs().max()) and p.nonfinite == 0
    for i in (0, 1 << 18, x.numel() - 1):  # a 1-ULP change in the first, a middle, the last chunk
        y = x.clone()
        y[i] = torch.nextafter(y[i], torch.tensor(float("inf")))
        assert fingerprint(y).fp != p.fp
    swapped = torch.cat([x[1 << 18 : 2 << 18], x[: 1 << 18], x[2 << 18 :]])  # two whole chunks
    assert fingerprint(swapped).fp != p.fp
    x[7], x[1 << 19] = float("nan"), float("-inf")
    q = fingerprint(x)
    assert q.nonfinite == 2 and q.absmax == float(x[torch.isfinite(x)].abs().max())


def test_small_prints_are_xxh3_of_header_and_bytes():
    x = torch.arange(6.0).reshape(2, 3)
    expected = xxhash.xxh3_64_intdigest(b"torch.float32|(2, 3)" + x.numpy().tobytes())
    assert fingerprint(x).fp == f"{expected:016x}"


def test_add_many_gives_the_prints_of_add():
    g = torch.Generator().manual_seed(5)
    big = torch.randn(700_000, generator=g)
    tensors = [big, torch.randn(3, 4, generator=g), big, torch.arange(10),
               torch.randn(600_000, generator=g).to(torch.bfloat16), torch.zeros(0)]
    one, many = Fingerprinter(), Fingerprinter()
    for t in tensors:
        one.add(t)
    many.add_many(tensors)
    assert many.collect() == one.collect()


class _Ops(TorchDispatchMode):
    """Records the aten ops run and the largest tensor any of them made."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(func.__name__)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _stats_case(dtype, kind):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(6)) * 3
    if kind == "huge":  # near the top of each dtype's range: squares overflow float32
        top = {torch.float16: 6e4, torch.bfloat16: 1e38, torch.float32: 1e30,
               torch.float64: 1e100}[dtype]
        x = x.double() / 12 * top
    x = x.to(dtype)
    if kind == "nonfinite":
        x[[3, 100, 2999, 4999]] = torch.tensor([float("nan"), float("inf"), float("-inf"),
                                                 float("nan")], dtype=dtype)
    return x


def _assert_same_stats(p, q, rel=1e-6):
    assert abs(p.norm - q.norm) <= rel * q.norm
    assert abs(p.signed - q.signed) <= rel * q.norm
    assert (p.absmax, p.nonfinite) == (q.absmax, q.nonfinite)


@pytest.mark.parametrize("chunk", [1024, None])
@pytest.mark.parametrize("kind", ["plain", "nonfinite", "huge"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_device_stats_match_the_cpu_stats(dtype, kind, chunk, monkeypatch):
    """In float64, chunk by chunk: no overflow for large finite values (1e30 in float32,
    above float32's range in float64), and NaN/Inf counted as on the CPU."""
    if chunk:
        monkeypatch.setattr(fpmod, "_WSUM_CHUNK", chunk)  # 5 chunks, the last one short
    x = _stats_case(dtype, kind)
    p, q = fingerprint(x, "wsum"), fingerprint(x, "xxh3")
    assert math.isfinite(p.norm) and p.nonfinite == (4 if kind == "nonfinite" else 0)
    _assert_same_stats(p, q)


@pytest.mark.parametrize("kind", ["plain", "nonfinite", "huge"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_device_stats_without_float64_scale_and_do_not_overflow(dtype, kind, monkeypatch):
    """A device without float64 (MPS): float32, each chunk scaled by the absmax so far."""
    monkeypatch.setattr(fpmod, "widest_float", lambda device: torch.float32)
    monkeypatch.setattr(fpmod, "_WSUM_CHUNK", 1024)
    x = _stats_case(dtype, kind)
    if kind == "huge":  # an increasing absmax: every chunk rescales the sum so far
        x = x.abs().sort().values
    _assert_same_stats(fingerprint(x, "wsum"), fingerprint(x, "xxh3"))
    assert fingerprint(torch.zeros(3000, dtype=dtype), "wsum")[3:] == (0.0, 0.0, 0, 0.0)
    assert fingerprint(torch.zeros(0, dtype=dtype), "wsum")[3:] == (0.0, 0.0, 0, 0.0)


def test_device_stats_without_float64_count_past_2_pow_24(monkeypatch):
    monkeypatch.setattr(fpmod, "widest_float", lambda device: torch.float32)
    x = torch.full(((1 << 24) + 3,), float("inf"), dtype=torch.float16)
    x[5] = -2.0
    assert fingerprint(x, "wsum")[3:] == (2.0, 2.0, (1 << 24) + 2, -2.0 * position_signs(6)[5])


def test_device_stats_temporaries_stay_within_a_chunk(monkeypatch):
    monkeypatch.setattr(fpmod, "_WSUM_CHUNK", 1024)
    x = torch.randn(100_000).half()
    with _Ops() as ops:
        fpmod._device_float_stats(x)
    assert 0 < ops.largest <= 1024 * 8  # one chunk in float64; the tensor in float32: 400 kB


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_signed_sum_moves_where_elements_trade_places_and_norm_and_absmax_do_not(algorithm):
    """What tolerance compares a record by: a flip, a swap of two images of a batch, a
    transpose and a roll keep norm and absmax, and move the sum under fixed signs (by about
    the norm, as a random-sign sum: here 4 % to 170 %), far past what `diff --rtol 1e-4`
    allows (8e-4 of the norm); the same values give the same sum, and a 1-ULP change moves
    it by no more than its rounding."""
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    base = fingerprint(x, algorithm)
    assert fingerprint(x.clone(), algorithm).signed == base.signed
    for moved in (x.flip(-1), x[[1, 0]], x.transpose(-1, -2), x.roll(1)):
        p = fingerprint(moved.contiguous(), algorithm)
        assert (p.norm, p.absmax) == pytest.approx((base.norm, base.absmax), rel=1e-6)
        assert abs(p.signed - base.signed) > 0.01 * base.norm
    nudged = x.clone()
    nudged.view(-1)[100] = torch.nextafter(nudged.view(-1)[100], torch.tensor(9.0))
    assert abs(fingerprint(nudged, algorithm).signed - base.signed) < 1e-6 * base.norm


def test_position_signs_repeat_no_block_of_positions():
    """Rows, channels and images start at multiples of a power of two: no such block's
    signs repeat the first one's, and about half the signs are each."""
    signs = position_signs(1 << 16)
    assert abs(signs.mean()) < 0.02
    for size in (64, 256, 1024, 4096):
        blocks = signs.reshape(-1, size)
        assert not any((blocks[k] == blocks[0]).all() or (blocks[k] == -blocks[0]).all()
                       for k in range(1, len(blocks)))


M64 = (1 << 64) - 1


def _xorshift(x, arithmetic=False):
    """x ^ (x >> 31) on python ints in [0, 2**64): the old mixer shifted arithmetically."""
    shifted = x >> 31
    if arithmetic and x >> 63:
        shifted |= M64 ^ ((1 << 33) - 1)  # the sign copied into the 31 high bits
    return x ^ shifted


def _mix(x, arithmetic=False):
    """The wsum mixer on python ints in [0, 2**64)."""
    return _xorshift(x * (fpmod._MIX2 & M64) & M64, arithmetic)


def _reference_wsum(bits):
    """The wsum device value of int bit patterns, in python ints: the algorithm's definition."""
    total = 0
    for i, b in enumerate(bits):
        weight = _mix((i * fpmod._MIX + 1) & M64) | 1
        total += _mix((b + fpmod._MIX) & M64) * weight
    total &= M64
    return total - (1 << 64) if total >> 63 else total


@pytest.mark.parametrize("chunk", [7, None])
def test_wsum_value_is_the_reference_sum(chunk, monkeypatch):
    """Chunks, cached and fresh weights, and each dtype's bits give the defined sum."""
    if chunk:
        monkeypatch.setattr(fpmod, "_WSUM_CHUNK", chunk)
    g = torch.Generator().manual_seed(7)
    cases = [torch.randint(-(1 << 63), (1 << 63) - 1, (40,), generator=g),
             torch.tensor([-(1 << 63), (1 << 63) - 1, -1, 0, 1]),
             torch.randn(30, generator=g).double(), torch.randn(3, generator=g),
             torch.randint(-(1 << 15), 1 << 15, (25,), generator=g).short(),
             torch.randint(0, 256, (9,), generator=g).to(torch.uint8), torch.zeros(0)]
    for t in cases:
        bits = t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[
            t.element_size()])
        assert int(wsum_device_value(t)) == _reference_wsum(bits.tolist())


def test_the_mixer_is_a_bijection_on_64_bit_values():
    """Two int64 values the old (arithmetic-shift) mixer sent to one now print differently."""
    mixed = (1 + fpmod._MIX) * (fpmod._MIX2 & M64) & M64  # the value 1, before the xorshift
    # its partner x: x ^ (x >> 31) (logical) equals that of `mixed` with the 31 high bits flipped
    y = (mixed ^ (mixed >> 31)) ^ (M64 ^ ((1 << 33) - 1))
    partner = y ^ (y >> 31) ^ (y >> 62)  # the inverse of the logical xorshift
    assert partner ^ (partner >> 31) == y and partner >> 63 != mixed >> 63
    value = (partner * pow(fpmod._MIX2 & M64, -1, 1 << 64) - fpmod._MIX) & M64
    value -= 1 << 64 if value >> 63 else 0
    assert _xorshift(mixed, arithmetic=True) == _xorshift(partner, arithmetic=True)
    old = [_mix((v + fpmod._MIX) & M64, arithmetic=True) for v in (1, value)]
    assert old[0] == old[1]  # the old mixer sent 1 and `value` to one number
    a, b = torch.tensor([1]), torch.tensor([value])
    assert fp(a, "wsum") != fp(b, "wsum")
    assert fp(a.view(torch.float64), "wsum") != fp(b.view(torch.float64), "wsum")
    assert fp(a, "xxh3") != fp(b, "xxh3")
    # the torch mixer sets the top bit (the old one never did) and matches the python one
    values = [mixed, partner, 0, 1, M64, 1 << 63, 12345678901234567]
    signed = torch.tensor([v - (1 << 64) if v >> 63 else v for v in values])
    got = [v & M64 for v in fpmod._splitmix(signed.clone()).tolist()]
    assert got == [_mix(v) for v in values] and len(set(got)) == len(values)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("inside", [False, True])
def test_inference_tensors_print_like_normal_ones(algorithm, inside):
    """Made in inference mode, fingerprinted outside or inside it."""
    x = _sample(torch.float32)
    with torch.inference_mode():
        y = x.clone()
    expected = fingerprint(x, algorithm)
    fpmod._WEIGHTS.clear()  # inside: the wsum weights are made in inference mode
    with torch.inference_mode() if inside else contextlib.nullcontext():
        assert fingerprint(y, algorithm) == expected
        f = Fingerprinter(algorithm=algorithm)
        f.add(y)
        f.add(y)
        f.add_many([y, x])
        if inside:
            y.add_(1.0)  # allowed in inference mode, and not counted: must be hashed again
            f.add(y)
        prints = f.collect()
    assert prints[:4] == [expected] * 4
    if inside:
        assert prints[4] == fingerprint(x + 1.0, algorithm) != expected
    assert fingerprint(x, algorithm) == expected  # with weights cached in inference mode


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_lazy_conj_and_neg_views_print_as_materialised(algorithm):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, dtype=torch.complex64, generator=g).conj()
    assert x.is_conj()
    assert fingerprint(x, algorithm) == fingerprint(x.resolve_conj(), algorithm)
    assert fp(x, algorithm) != fp(x.conj().resolve_conj(), algorithm)
    for n in (3, 1):  # one element: the negated view is contiguous
        y = torch.randn(n, dtype=torch.complex64, generator=g).conj().imag
        assert y.is_neg()
        assert fingerprint(y, algorithm) == fingerprint(y.resolve_neg(), algorithm)
        assert fp(y, algorithm) != fp(-y.resolve_neg(), algorithm)
    f = Fingerprinter(algorithm=algorithm)
    f.add_many([x, y])
    assert f.collect() == [fingerprint(x.resolve_conj(), algorithm),
                           fingerprint(y.resolve_neg(), algorithm)]


def test_wsum_weights_are_cached_per_device_and_bounded():
    fpmod._WEIGHTS.clear()
    key = (torch.device("cpu"), None)  # per device and stream (none on the CPU)
    first = fingerprint(torch.arange(10.0), "wsum")
    cached = fpmod._WEIGHTS[key]
    fingerprint(torch.arange(3000.0), "wsum")  # within the cached size: the same tensor
    assert fpmod._WEIGHTS[key] is cached
    fingerprint(torch.arange(70_000.0), "wsum")  # grown to a power of two, never past a chunk
    assert fpmod._WEIGHTS[key].numel() == 1 << 17
    fingerprint(torch.arange(fpmod._WSUM_CHUNK + 5, dtype=torch.int8), "wsum")
    assert fpmod._WEIGHTS[key].numel() == fpmod._WSUM_CHUNK
    assert fingerprint(torch.arange(10.0), "wsum") == first


def test_wsum_adds_no_host_sync_per_tensor():
    """Values stay on the device until collect (an item() or a bool() would be a sync)."""
    tensors = [torch.randn(50, 3), torch.randn(4, dtype=torch.complex64).conj(),
               torch.tensor([1.0, float("nan")]).double(), torch.arange(5), torch.zeros(0)]
    f = Fingerprinter(algorithm="wsum")
    with _Ops() as ops:
        for t in tensors:
            f.add(t)
        f.add_many(tensors[:2])
    assert ops.names and "_local_scalar_dense" not in ops.names
    assert [p.fp for p in f.collect()] == [fp(t, "wsum") for t in tensors + tensors[:2]]


def test_integers_print_alike_on_every_device_scheme():
    """Integers and bools are printed by wsum on CPU too, so a CPU trace and a CUDA trace
    compare them bitwise; floats keep xxh3 on CPU."""
    from detaudit.record.fingerprint import scheme

    labels = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64)
    mask = torch.tensor([True, False, True])
    for t in (labels, mask):
        assert fingerprint(t).fp == fingerprint(t, algorithm="wsum").fp
    x = torch.randn(8)
    assert fingerprint(x).fp == fingerprint(x, algorithm="xxh3").fp != fingerprint(
        x, algorithm="wsum").fp
    assert scheme("cpu") == "xxh3+wsum2-int+state-xxh3"
    assert scheme("cuda:1") == "wsum2+state-xxh3"


def test_a_batch_as_loaded_is_printed_by_xxh3_in_every_dtype():
    """The batch as the data pipeline yields it lives on the CPU in every run: xxh3 prints
    its integers too (a mask's bytes read as bytes, not each widened to int64); the same
    tensor printed otherwise in the same step gets its own print, not the other's."""
    masks = torch.randint(0, 2, (3, 40, 40), dtype=torch.uint8)
    f = Fingerprinter(stats=False)
    f.add_many([masks], algorithm="xxh3")
    f.add_many([masks])
    as_loaded, otherwise = f.collect()
    assert as_loaded.fp == fingerprint(masks, "xxh3").fp
    assert otherwise.fp == fingerprint(masks, "wsum").fp != as_loaded.fp


@pytest.mark.parametrize("chunk", [64, None])
def test_segmented_many_tensor_wsum_equals_the_per_tensor_print(chunk, monkeypatch):
    """The device path of add_many (run on CPU tensors) packs tensors of one bit width into
    shared buffers; every print is still exactly the per-tensor print, in every dtype, with
    buckets split at the chunk size and tensors larger than a chunk reduced alone."""
    if chunk:
        monkeypatch.setattr(fpmod, "_WSUM_CHUNK", chunk)
    g = torch.Generator().manual_seed(11)
    tensors = [_sample(dtype) for dtype in DTYPES]
    tensors += [torch.randn(n, generator=g) for n in (1, 63, 64, 65, 200)]
    tensors += [torch.randint(-(1 << 62), 1 << 62, (30,), generator=g), torch.zeros(0),
                torch.randn(5, 6, generator=g).t(), tensors[2]]
    many = Fingerprinter(algorithm="wsum")
    many.add_many(tensors)
    assert [p.fp for p in many.collect()] == [fp(t, "wsum") for t in tensors]


def test_segmented_wsum_stays_order_aware_and_bit_exact():
    """Permutation, swap, 1 ULP, shape and dtype each change a print made in a shared buffer,
    and only the print of the tensor that changed."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(4, 5, generator=g), torch.randn(7, generator=g), torch.arange(6)]

    def prints(tensors):
        f = Fingerprinter(algorithm="wsum", stats=False)
        f.add_many(tensors)
        return [p.fp for p in f.collect()]

    reference = prints(base)
    bumped = base[1].clone()
    bumped[3] = torch.nextafter(bumped[3], torch.tensor(math.inf))
    swapped = base[2].clone()
    swapped[[0, 5]] = swapped[[5, 0]]
    for i, changed in [(0, base[0].flip(0)), (1, bumped), (2, swapped), (0, base[0].reshape(5, 4)),
                       (2, base[2].to(torch.int32)), (1, base[1][torch.randperm(7, generator=g)])]:
        tensors = list(base)
        tensors[i] = changed
        got = prints(tensors)
        assert got[i] != reference[i]
        assert [p for j, p in enumerate(got) if j != i] == [
            p for j, p in enumerate(reference) if j != i]


def test_segmented_wsum_launches_the_same_kernels_for_10_or_200_tensors():
    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in ("detach", "alias"):
                self.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (10, 200):
        tensors = [torch.randn(50) for _ in range(n)]
        f = Fingerprinter(algorithm="wsum", stats=False)
        with Kernels() as kernels:
            f.add_many(tensors)
            f.collect()
        counts.append(kernels.count)
    assert counts[0] == counts[1] < 40



def test_the_fused_kernel_prints_exactly_what_the_torch_form_prints():
    """Run in a fresh interpreter: Triton's interpreter must be chosen before Triton loads.
    Every dtype, one element to several blocks, alone and packed, top-bit 64-bit values; and
    order-aware and bit-exact across blocks (see the script)."""
    pytest.importorskip("triton")
    script = Path(__file__).parent / "scripts" / "fused_wsum_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"


def test_a_fused_kernel_that_cannot_run_falls_back_to_the_torch_form(monkeypatch):
    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no compiler for this device")
            return launch

    tensors = [torch.randn(10), torch.arange(4)]
    monkeypatch.setenv("DETAUDIT_FUSED_WSUM", "0")
    f = Fingerprinter(algorithm="wsum", stats=False)
    f.add_many(tensors)
    expected = f.collect()
    monkeypatch.setenv("DETAUDIT_FUSED_WSUM", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # makes CPU tensors eligible
    monkeypatch.setattr(fused, "_kernel", lambda: Broken())
    monkeypatch.setattr(fused, "_FAILED", set())
    assert fused.usable(torch.device("cpu"))
    with pytest.warns(UserWarning, match="fused fingerprint kernel failed on cpu"):
        f.add_many(tensors)
    assert f.collect() == expected
    assert not fused.usable(torch.device("cpu"))


def test_the_fused_kernel_builds_for_a_hopper_gpu_without_one():
    """Triton compiles the kernel ahead for sm_90 (no GPU needed) in each bit width it reads."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ahead-of-time compile API")
    for bits in ("u8", "i16", "i32", "i64"):
        signature = {"bits": f"*{bits}", "block_start": "*i64", "block_position": "*i64",
                     "block_length": "*i64", "out": "*i64", "mix": "i64", "mix2": "i64",
                     "low33": "i64", "BLOCK": "constexpr"}
        source = ASTSource(fn=fused._kernel(), signature=signature,
                           constexprs={"BLOCK": fused.BLOCK})
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sparse_nested_and_quantized_tensors_print_by_their_content():
    """An nn.Embedding(sparse=True) gradient has no strided storage (it crashed the user's
    loop): such tensors print by their content, shape included, in both algorithms."""
    def coo(values, size=(3, 3)):
        return torch.sparse_coo_tensor(torch.tensor([[0, 2, 1], [1, 0, 0]]),
                                       torch.tensor(values), size)

    a = coo([1.0, 2.0, 3.0])
    one_ulp = coo([1.0, 2.0, torch.nextafter(torch.tensor(3.0), torch.tensor(4.0)).item()])
    for algorithm in ("xxh3", "wsum"):
        def fp(t, algorithm=algorithm):
            return fingerprint(t, algorithm=algorithm).fp

        assert fp(a) == fp(a.clone()) == fp(a.coalesce())  # the same content
        assert fp(a) == fp(a.to_dense().to_sparse_csr())
        assert len({fp(a), fp(one_ulp), fp(coo([1.0, 2.0, 3.0], (3, 4)))}) == 3
        nested = [torch.ones(2), torch.zeros(3)]
        assert fp(torch.nested.nested_tensor(nested)) != fp(
            torch.nested.nested_tensor([torch.ones(3), torch.zeros(2)]))
        # a jagged one is a wrapper subclass with a symbolic size: printed by its components
        jagged = torch.nested.nested_tensor([torch.ones(2, 4), torch.zeros(3, 4)],
                                            layout=torch.jagged)
        assert fp(jagged) != fp(torch.nested.nested_tensor(
            [torch.ones(3, 4), torch.zeros(2, 4)], layout=torch.jagged))
        q = torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.1, 0, torch.qint8)
        assert fp(q) != fp(torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.2, 0,
                                                     torch.qint8))


def test_a_printed_tensor_can_still_be_resized_as_fsdp_does():
    """FSDP frees a parameter's memory by resizing its storage to 0 and refills it the same
    way; `Tensor.numpy()` marks a storage not resizable for good, and a print made that way
    failed the user's next forward ("Trying to resize storage that is not resizable")."""
    tensors = [torch.randn(300), torch.randn(700, 800),  # one piece; a tree of 1 MiB pieces
               torch.randn(8, dtype=torch.bfloat16),  # printed as bytes
               torch.randn(30, 40)[:, :7]]  # strided: printed from a copy
    for t in tensors:
        before = fingerprint(t)
        f = Fingerprinter()
        f.add_many([t])
        assert f.collect()[0] == before == fingerprint(t.clone())
        t.untyped_storage().resize_(0)  # raised with the print taken by t.numpy()
        assert t.untyped_storage().nbytes() == 0
        # freed, as FSDP leaves a parameter between its uses: its elements are not read
        # (torch's own ops crash on them), its shape is printed
        # (no freed tensor in an assert: pytest's message would print its elements)
        freed, again = fingerprint(t).fp, fingerprint(t).fp
        assert freed == again != before.fp
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    for t in (a, b):
        t.untyped_storage().resize_(0)
    freed_a, freed_b = fingerprint(a).fp, fingerprint(b).fp
    assert freed_a != freed_b


def test_a_wrapper_subclass_prints_by_the_tensors_it_holds():
    """A tensor subclass that wraps others (FSDP2's parameters are DTensors) has no memory
    of its own to read: it prints by what it holds. A DTensor is printed by its local
    shard; a subclass holding two tensors by both."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(6), torch.randn(6)
    pair = fingerprint(TwoTensor(a, b)).fp
    assert pair == fingerprint(TwoTensor(a.clone(), b.clone())).fp
    nudged = b.clone()
    nudged[3] = torch.nextafter(b[3], torch.tensor(math.inf))
    assert pair != fingerprint(TwoTensor(a, nudged)).fp
    assert pair != fingerprint(TwoTensor(b, a)).fp


def test_a_dtensor_prints_as_its_local_shard_and_a_pending_collective_once_landed(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        weight = torch.randn(4, 3)
        sharded = tensor_api.distribute_tensor(weight, mesh, [tensor_api.Shard(0)])
        param = nn.Parameter(sharded)
        assert fingerprint(param) == fingerprint(sharded) == fingerprint(sharded.to_local())
        from detaudit.record.recorder import _is_shard

        assert _is_shard(param) and not _is_shard(weight)
        assert not _is_shard(tensor_api.distribute_tensor(weight, mesh,
                                                          [tensor_api.Replicate()]))
        # a functional collective's result lands when waited for: its print waits first
        from torch.distributed import _functional_collectives as funcol

        pending = funcol.all_reduce(weight, "sum", dist.group.WORLD)
        assert isinstance(pending, funcol.AsyncCollectiveTensor) and not pending.completed
        assert fingerprint(pending) == fingerprint(weight) and pending.completed
    finally:
        dist.destroy_process_group()
