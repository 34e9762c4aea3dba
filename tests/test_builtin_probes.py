"""Every built-in probe runs a train and an inference audit and is deterministic on CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import module_audit

from detaudit import probes
from detaudit.drivers.loading import builtin_spec, make_factory

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

NAMES = [name for name, _ in probes.available()]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Conv backward on 2 threads can differ run to run; these tests are about the probes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("name", NAMES)
def test_probe_audits_deterministic(name, mode):
    options = {"image_size": 64, "num_images": 2, "batch_size": 2 if name == "ssdlite" else 1}
    factory = make_factory(builtin_spec(name, options))
    result = module_audit(factory, repeats=2, epochs=1, steps=1, mode=mode)
    assert not result.traces[0].failure, result.traces[0].failure
    assert result.deterministic, result.comparison.first_by_phase
    phases = set(result.traces[0].records["phase"])
    assert ("backward" in phases) == (mode == "train")
    if mode == "infer":
        assert any(s.startswith("detections") for s in result.traces[0].records["slot"])


def test_dense_single_image_case_runs():
    factory = make_factory(builtin_spec(
        "maskrcnn_v1", {"image_size": 128, "instances": 1000, "num_images": 1, "num_classes": 2}))
    result = module_audit(factory, repeats=1, epochs=1, steps=1)
    assert not result.traces[0].failure
    assert result.traces[0].steps[0].losses
