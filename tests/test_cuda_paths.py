"""What a GPU user would hit first, with the CUDA condition simulated on CPU where the logic
allows (the tests that need a real GPU are marked `cuda` and skip without one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import small_cnn_probe

from detaudit import Probe, audit
from detaudit.cli import main
from detaudit.drivers import rankprobe
from detaudit.drivers.loading import builtin_spec, make_factory
from detaudit.drivers.runner import deterministic_settings, resolve_device
from detaudit.errors import DetauditError

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

PROBES = Path(__file__).parent / "probe_files"


@pytest.fixture
def new_tf32_api():
    """torch's fp32_precision API in use (it makes the legacy allow_tf32 flags raise)."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    matmul.fp32_precision = "tf32"
    with pytest.raises(RuntimeError):  # the crash the audit used to hit
        _ = matmul.allow_tf32
    yield matmul
    matmul.fp32_precision = "none"


def test_the_new_tf32_api_never_crashes_a_run(new_tf32_api):
    result = audit(small_cnn_probe, repeats=2, steps=1)
    assert result.deterministic
    assert [t.env["tf32_matmul"] for t in result.traces] == [True, True]
    assert new_tf32_api.fp32_precision == "tf32"


def test_tf32_a_probe_turns_on_is_off_again_for_the_next_repeat():
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    seen = []

    def probe(device):
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        return small_cnn_probe(device)

    try:
        audit(probe, repeats=2, steps=1)
    finally:
        torch.backends.cuda.matmul.fp32_precision = "none"
    assert seen == ["none", "none"]


def test_a_cuda_index_beyond_the_devices_is_refused_up_front(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(DetauditError, match=r"no device cuda:2: 2 CUDA devices, cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    assert main(["run", "--model", "maskrcnn", "--device", "cuda:5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no device cuda:5" in err


def test_data_parallel_is_refused_with_the_way_out(tmp_path):
    def probe(device):
        inner = small_cnn_probe(device)
        return Probe(model=torch.nn.DataParallel(inner.model), batches=inner.batches,
                     step=inner.step, optimizer=inner.optimizer)

    with pytest.raises(DetauditError, match="nn.DataParallel.*--nproc N"):
        audit(probe, repeats=2, steps=1)


def test_a_step_grad_scaler_skips_is_not_an_optimizer_step():
    def probe(device):
        model = torch.nn.Linear(4, 1)
        batches = [torch.full((2, 4), float("inf")), torch.ones(2, 4), torch.ones(2, 4)]
        return Probe(model=model, batches=batches, step=lambda m, b: m(b).pow(2).mean(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     scaler=torch.amp.GradScaler("cpu", init_scale=2.0**4))

    result = audit(probe, repeats=1, steps=3)
    steps = result.traces[0].steps
    assert [s.optimizer_stepped for s in steps] == [False, True, True]
    assert steps[0].scale == 2.0**3  # backed off after the inf gradients


def test_ranks_compare_their_own_cuda_generator(monkeypatch):
    states = {0: {"torch": b"t", "cuda:0": b"same"}, 1: {"torch": b"t", "cuda:1": b"same"}}
    prints = {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for rank, state in states.items():
        monkeypatch.setattr(torch.cuda, "current_device", lambda rank=rank: rank)
        monkeypatch.setattr(rankprobe, "rng_states", lambda state=state: state)
        prints[rank] = rankprobe._rng_prints()
    assert set(prints[0]) == set(prints[1]) == {"torch", "cuda"}
    assert prints[0]["cuda"] == prints[1]["cuda"]  # the same draw on both ranks: comparable


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_index_is_the_current_device_during_a_repeat():
    device = f"cuda:{torch.cuda.device_count() - 1}"
    seen = []

    def probe(dev):
        seen.append(torch.cuda.current_device())
        return small_cnn_probe(dev)

    audit(probe, repeats=1, steps=1, device=device)
    assert seen == [torch.cuda.device_count() - 1]


def test_cudnn_and_cublas_entries_only_where_the_settings_leave_them_free():
    from detaudit.analysis.knowledge import CONDITIONS, KNOWN, applicable

    assert all(k.when in CONDITIONS for k in KNOWN)
    free = {"cudnn_benchmark": True, "cudnn_deterministic": False}
    pinned = {"cudnn_benchmark": False, "cudnn_deterministic": True,
              "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert applicable("aten.convolution", "forward", "cuda:0", free)
    assert not applicable("aten.convolution", "forward", "cuda:0", pinned)
    assert applicable("aten.addmm", "forward", "cuda", free)
    assert not applicable("aten.addmm", "forward", "cuda", pinned)
    assert applicable("torchvision._roi_align_backward", "backward", "cuda", pinned)
    assert not applicable("aten.addmm", "forward", "cpu", free)  # thread count alone: no


def test_a_census_step_that_fails_is_an_error_in_the_report(tmp_path, capsys):
    from detaudit import api
    from detaudit.config import AuditConfig, Investigations

    def probe(device):
        base = small_cnn_probe(device)

        def step(model, batch):
            if torch.are_deterministic_algorithms_enabled():  # the census's second pass
                raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasGemmEx")
            return base.step(model, batch)

        return Probe(model=base.model, batches=base.batches, step=step, optimizer=base.optimizer)

    result = api.run(api.describe_callable(probe), AuditConfig(steps=1), factory=probe,
                     out=tmp_path, investigations=Investigations(census=True))
    errors = result.summary["census_errors"]
    assert len(errors) == 1 and "under use_deterministic_algorithms(True) stopped" in errors[0]
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in errors[0]
    from detaudit.report import render_console

    assert "CUBLAS_STATUS_NOT_SUPPORTED" in render_console(result.summary)
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in (tmp_path / "report.html").read_text()


def test_verify_fix_alternates_like_with_like_and_times_steady_steps():
    import time

    from detaudit.config import AuditConfig
    from detaudit.drivers.runner import run_repeat
    from detaudit.investigate.fixes import verify_fix

    order = []

    def probe(device):
        order.append(torch.are_deterministic_algorithms_enabled())
        base = small_cnn_probe(device)

        def step(model, batch):
            if step.calls == 0:
                time.sleep(0.5)  # warming up: must not count
            step.calls += 1
            return base.step(model, batch)

        step.calls = 0
        return Probe(model=base.model, batches=base.batches, step=step, optimizer=base.optimizer)

    config = AuditConfig(repeats=2, steps=3, granularity="op")
    found = verify_fix(probe, config, "none")
    assert order == [False, True, True, False]  # original first, then fixed first
    assert found["deterministic"] and "module level, steady steps only" in found["timed"]
    _, timing = run_repeat(probe, config, 0)
    assert timing.seconds >= 0.5 and timing.steady_seconds <= timing.seconds - 0.5


def test_census_and_fix_verification_run_in_a_child_with_the_workspace_set(monkeypatch):
    import os

    from detaudit import api
    from detaudit.config import AuditConfig, ProbeSpec
    from detaudit.drivers.loading import make_factory
    from detaudit.investigate.isolated import needs_child
    from detaudit.investigate.stages import investigate

    spec = ProbeSpec("file", "tiny_cnn", source=str(PROBES / "tiny_cnn.py"))
    config = AuditConfig(repeats=2, steps=1)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not needs_child(config, spec)  # CPU: in this process
    assert needs_child(AuditConfig(device="cuda"), spec)  # CUDA: a fresh process
    assert not needs_child(AuditConfig(device="cuda"), api.describe_callable(small_cnn_probe))
    comparison = api.run(spec, config).comparison
    wanted = {"census": True, "verify": True, "ops": False, "spec": spec}
    here = investigate(make_factory(spec), config, comparison, child=False, **wanted)
    there = investigate(make_factory(spec), config, comparison, child=True, **wanted)
    assert there["census"]["process"].endswith("CUBLAS_WORKSPACE_CONFIG=:4096:8")
    assert there["census"]["ops_seen"] == here["census"]["ops_seen"] > 0
    assert there["census"]["alerts"] == here["census"]["alerts"]
    assert there["verify"]["deterministic"] and here["verify"]["deterministic"]
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # the parent is left as it was


def test_cudnn_benchmark_on_cuda_runs_the_later_repeats_in_fresh_processes(tmp_path, monkeypatch):
    """In-process repeats would share cuDNN's algorithm cache: with benchmark mode on CUDA
    (simulated here), repeat 1 runs in this process and repeats 2..N each in a fresh one."""
    from detaudit import api
    from detaudit.config import AuditConfig
    from detaudit.drivers import isolation
    from detaudit.drivers.loading import file_spec

    monkeypatch.setattr(api, "_shares_algorithm_cache", lambda config, env: True)
    isolated: list[int] = []
    real = isolation.run_isolated

    def spy(spec, config, folder, run_id="", on_repeat=None, first=0):
        isolated.append(first)
        return real(spec, config, folder, run_id, on_repeat, first)

    monkeypatch.setattr(isolation, "run_isolated", spy)
    spec = file_spec(str(Path(__file__).parent / "probe_files" / "tiny_cnn.py"))
    result = api.run(spec, AuditConfig(repeats=2, steps=1, stress=0), out=tmp_path / "run")
    assert isolated == [1] and [t.repeat for t in result.traces] == [0, 1]
    assert result.comparison.deterministic and result.verdict.exit_code == 0
    assert result.info.extra["isolation"] == "process from repeat 2: cudnn.benchmark is on"
    assert sorted(p.name for p in (tmp_path / "run").glob("trace-*")) == [
        "trace-0.json.gz", "trace-1.json.gz"]


def test_cudnn_benchmark_with_a_python_probe_stays_in_process_and_says_why(monkeypatch):
    from detaudit import api
    from detaudit.config import AuditConfig

    class Notes(api.Progress):
        def __init__(self):
            self.notes: list[str] = []

        def note(self, message: str) -> None:
            self.notes.append(message)

    monkeypatch.setattr(api, "_shares_algorithm_cache", lambda config, env: True)
    notes = Notes()
    result = api.run(api.describe_callable(small_cnn_probe), AuditConfig(repeats=2, steps=1),
                     factory=small_cnn_probe, progress=notes)
    assert len(result.traces) == 2 and "isolation" not in result.info.extra
    assert any("--isolation process for a verdict that holds" in n for n in notes.notes)


def test_the_trace_environment_is_the_one_the_steps_ran_in_with_deterministic_on():
    assert not torch.are_deterministic_algorithms_enabled()
    env = audit(small_cnn_probe, repeats=1, steps=1, deterministic=True, stress=0,
                drill_down=False).traces[0].env
    assert env["deterministic_algorithms"] is True and env["cudnn_deterministic"] is True
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run


def test_the_fix_keeps_mask_targets_on_the_deterministic_roi_align_kernel(monkeypatch):
    """Under the fix (deterministic algorithms), torchvision's Mask R-CNN computes its mask
    targets with them off: on CUDA their deterministic roi_align path would hold
    K x 28 x 28 x H x W floats (37.4 GiB at 800 px), and the forward kernel is deterministic.
    Seen through a real train step; the settings and the function are restored afterwards."""
    from torchvision.models.detection import roi_heads

    original = roi_heads.project_masks_on_boxes
    modes = []
    real = roi_heads.roi_align

    def spy(*args, **kwargs):
        modes.append((torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(roi_heads, "roi_align", spy)
    probe = make_factory(builtin_spec("maskrcnn_v1", {"image_size": 64, "num_images": 1}))(
        torch.device("cpu"))
    batch = next(iter(probe.batches))
    with deterministic_settings(True):
        sum(probe.step(probe.model, batch).values()).backward()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert modes and all(mode == (False, False) for mode in modes)
    assert roi_heads.project_masks_on_boxes is original
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_loss_is_kept_exactly_on_a_device_without_float64(monkeypatch):
    """MPS has no float64: the loss copy read after the step is float32 there, as exact."""
    from detaudit.drivers.runner import loss_copy
    from detaudit.record import fingerprint as fpmod
    from detaudit.trace import StepInfo

    loss = torch.tensor(1.0) + torch.finfo(torch.float32).eps
    assert loss_copy(loss).dtype == torch.float64
    monkeypatch.setitem(fpmod._FLOAT64_DEVICES, "cpu", False)
    copy = loss_copy(loss)
    assert copy.dtype == torch.float32
    info = StepInfo(step=0, epoch=0, index=0)
    info.keep_losses({"total": copy})
    assert info.losses["total"] == float(loss).hex() != (1.0).hex()


def test_the_torch_form_keeps_its_position_weights_per_stream(monkeypatch):
    """Weights grown on one stream must not free those another stream's kernel still reads."""
    from detaudit.record import fingerprint as fpmod

    monkeypatch.setattr(fpmod, "_WEIGHTS", {})
    monkeypatch.setattr(fpmod.fused, "current_stream", lambda device: "side")
    side = fpmod._weights(0, 10, torch.device("cpu"))
    monkeypatch.setattr(fpmod.fused, "current_stream", lambda device: "main")
    grown = fpmod._weights(0, 100_000, torch.device("cpu"))
    assert fpmod._WEIGHTS[(torch.device("cpu"), "side")].data_ptr() == side.data_ptr()
    assert torch.equal(grown[:10], side)  # the same weights, wherever they are kept
