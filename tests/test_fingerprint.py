from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import xxhash

from detaudit.record.fingerprint import Fingerprinter, fingerprint

ALGORITHMS = ["xxh3", "wsum"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool]


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
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
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
