"""Checks the fused wsum kernel against the torch form on CPU tensors; run with
TRITON_INTERPRET=1 (set before Triton loads). Prints "ok", or fails with what differed."""

import math
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from detaudit.record import fused
from detaudit.record.fingerprint import Fingerprinter

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def prints(tensors, use_kernel: bool, many: bool = True) -> list[str]:
    os.environ["DETAUDIT_FUSED_WSUM"] = "1" if use_kernel else "0"
    f = Fingerprinter(algorithm="wsum", stats=False)
    if many:
        f.add_many(tensors)
    else:
        for t in tensors:
            f.add(t)
    return [p.fp for p in f.collect()]


def sample(dtype, n, g):
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype) if not dtype.is_complex \
            else torch.randn(n, generator=g, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)


def main() -> None:
    warnings.simplefilter("error")  # a fallback to the torch form is a failure here
    assert fused.usable(torch.device("cpu")), "the interpreter is not on"
    g = torch.Generator().manual_seed(5)
    block = fused.BLOCK
    tensors = [sample(dtype, n, g) for dtype in DTYPES for n in (1, 37)]
    tensors += [torch.randn(n, generator=g) for n in (block - 1, block, 2 * block + 1)]
    tensors += [torch.tensor([-(1 << 63), (1 << 63) - 1, -1]), torch.randn(6, 7).t(),
                torch.zeros(0)]
    for many in (True, False):
        got, want = prints(tensors, True, many), prints(tensors, False, many)
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        assert not bad, f"differ at {bad} ({[tensors[i].dtype for i in bad]}), many={many}"
    base = [torch.randn(3 * block + 5, generator=g), torch.arange(9)]
    reference = prints(base, True)
    bumped = base[0].clone()
    bumped[block + 2] = torch.nextafter(bumped[block + 2], torch.tensor(math.inf))
    swapped = base[0].clone()
    swapped[[1, block + 1]] = swapped[[block + 1, 1]]  # across two blocks
    for name, changed in (("1 ulp", bumped), ("swap", swapped), ("roll", base[0].roll(block)),
                          ("dtype", base[0].double()), ("shape", base[0][:-5].reshape(-1, 2))):
        got = prints([changed, base[1]], True)
        assert got[0] != reference[0] and got[1] == reference[1], name
    assert not fused._FAILED
    print("ok")


if __name__ == "__main__":
    main()
