"""Op level: the drill-down names the op, the census lists what the model runs and what
alerts, the fix is verified with its cost, `detaudit env` flags risky settings."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import gather_probe, small_cnn_probe
from test_cli import PROBES, run_cli
from test_recorder import _Checkpointed, _maskrcnn_probe, _mean_square_probe, _Spectral
from torch import nn

from detaudit import Fault, Probe, audit, seed_everything
from detaudit.analysis.compare import ORIGIN, CallFinding
from detaudit.analysis.knowledge import KNOWN, lookup
from detaudit.analysis.risks import risks
from detaudit.config import ANY_MODULE
from detaudit.errors import DetauditError
from detaudit.planting import op_matches
from detaudit.record.difference import tensor_difference
from detaudit.record.environment import capture_environment
from detaudit.trace import OP_PHASES

# under pytest-xdist (conftest): the race tests take two_threads, which runs them alone
pytestmark = pytest.mark.shares_cores


def _until_divergent(run, attempts: int = 5):
    """Real thread races do not fire every time: retry until one run shows it."""
    for _ in range(attempts):
        result = run()
        ops = result.investigations.get("ops") or {}
        if ops.get("reproduced") and ops.get("difference"):
            return result
    pytest.fail(f"no divergence reproduced in {attempts} attempts")


def test_real_gather_backward_is_named_as_index_put_of_that_module(two_threads):
    result = _until_divergent(lambda: audit(gather_probe, repeats=3, drill_down=True))
    drill = result.investigations["ops"]
    origin = drill["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"], origin["role"]) == (
        "aten.index_put", "gather", "backward", ORIGIN)
    assert drill["origin_ops"] == 1
    diff = drill["difference"]
    assert diff["elements"] > 0 and diff["max_ulp"] >= 1 and 0 < diff["rel_error"] < 1e-3
    assert any("duplicate indices" in k["why"] for k in drill["knowledge"])
    # everything downstream of it is propagated, never a second origin
    assert all(o["role"] != ORIGIN for o in drill["ops"][1:])


@pytest.mark.alone  # a real race must fire
def test_gather_on_cli_with_census_and_verified_fix(tmp_path):
    for _ in range(6):
        done = run_cli("run", "--probe", str(PROBES / "centre_gather.py"), "--repeats", "5",
                       "--epochs", "1", "--steps", "2", "--census", "--verify-fix",
                       "--out", str(tmp_path), "--json")
        summary = json.loads(done.stdout)
        if summary["verdict"] == "divergent" and summary["ops"]:
            break
    else:
        pytest.fail("the duplicate-index gather never diverged on 2 threads")
    assert done.returncode == 1, done.stderr
    assert "op: aten.index_put in centre_head" in summary["headline"]
    assert summary["knowledge"] and summary["knowledge"][0]["op"] == "aten.index_put"
    assert {"module": "centre_head", "phase": "backward",
            "op": "aten.index_put(accumulate=True)"}.items() <= summary["census"][0].items()
    verify = summary["extra"]["verify"]
    assert verify["deterministic"] is True
    assert verify["step_time_ratio"] > 0 and verify["peak_memory_ratio"] > 0
    text = run_cli("report", str(tmp_path)).stdout
    assert "fix: deterministic with the fix; step time" in text and "peak memory" in text
    html = (tmp_path / "report.html").read_text()
    assert "Fix verification" in html and "aten.index_put" in html


@pytest.mark.parametrize(("pattern", "op", "phase", "matches"), [
    ("torchvision.roi_align", "torchvision.roi_align", "forward", True),
    ("roi_align", "torchvision.roi_align", "forward", True),  # (a name in any namespace)
    ("roi_align", "torchvision._roi_align_backward", "backward", True),
    ("torchvision.roi_align", "torchvision._roi_align_backward", "backward", True),
    ("roi_align", "torchvision._roi_align_backward", "forward", False),
    ("convolution", "aten.convolution_backward", "backward", True),
    ("addmm", "aten.addmm", "forward", True),
    ("aten.addmm", "aten.addmm", "forward", True),
    ("mm", "aten.addmm", "forward", False),
    ("aten.addmm", "other.addmm", "forward", False),
    # backward ops named otherwise than OP_backward: a fault named by the forward op it
    # belongs to was refused as never run (`_softmax_backward_data` ran)
    ("aten._softmax", "aten._softmax_backward_data", "backward", True),
    ("_log_softmax", "aten._log_softmax_backward_data", "backward", True),
    ("relu", "aten.threshold_backward", "backward", True),
    ("aten.gather", "aten.scatter_add", "backward", True),
    ("aten.gather", "aten.scatter_add", "forward", False),
    ("embedding", "aten.embedding_dense_backward", "backward", True),
    ("torchvision.gather", "aten.scatter_add", "backward", False),
])
def test_an_op_fault_names_its_op_with_or_without_the_namespace(pattern, op, phase, matches):
    assert op_matches(pattern, op, phase) is matches


@pytest.mark.slow
def test_planted_nms_permutation_is_caught_and_named():
    fault = Fault("roi_heads", "forward", 0, op="torchvision.nms")
    result = audit(_maskrcnn_probe, repeats=2, steps=1, mode="infer", fault=fault,
                   drill_down=True)
    assert result.comparison.first_step == 0
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["role"]) == ("torchvision.nms", "roi_heads",
                                                                ORIGIN)
    # the same kept indices in another order: two elements differ, the sum does not
    assert origin["elements"] == 2 and origin["max_ulp"] is None


class _PutScatter(nn.Module):
    """Writes with put_ (accumulate=False, duplicate indices): alerts on CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(8)
        out.put_(torch.tensor([1, 1, 3]), torch.tensor([1.0, 2.0, 3.0]))
        return x + out.sum()


class _AlertingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.scatter = _PutScatter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scatter(self.body(x))


def _alerting_probe(device):
    model = _AlertingNet()
    batches = [torch.randn(4, 8) for _ in range(2)]
    return Probe(model=model, batches=batches, step=lambda m, b: m(b).pow(2).mean(),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_census_maps_each_alert_to_its_module_and_op():
    result = audit(_alerting_probe, repeats=2, census=True)
    census = result.investigations["census"]
    assert census["alerts"], census
    alert = census["alerts"][0]
    assert (alert["module"], alert["op"], alert["phase"]) == ("scatter", "aten.put_", "forward")
    assert "does not have a deterministic implementation" in alert["message"]
    # the ops run as configured (counted by the stress): put_ is known on CPU, Linear's are
    # not run-to-run risks
    assert [(o["module"], o["op"], o["epoch"]) for o in result.summary["census"]] == [
        ("scatter", "aten.put_(accumulate=False)", 1)]
    assert not torch.are_deterministic_algorithms_enabled()  # restored afterwards


def test_census_lists_known_ops_even_when_repeats_agree():
    result = audit(gather_probe, repeats=1, census=True, stress=0)  # no proof by re-execution
    assert result.comparison.deterministic
    ops = result.investigations["census"]["ops"]
    assert [(o["module"], o["phase"], o["op"], o["count"]) for o in ops] == [
        ("gather", "backward", "aten.index_put(accumulate=True)", 1)]


def test_a_census_that_finds_nothing_says_so_with_its_cost():
    from detaudit.report import render_console, render_markdown

    result = audit(small_cnn_probe, repeats=1, epochs=1, steps=1, census=True, stress=0)
    assert result.investigations["census"]["ops"] == []
    assert "census: no known-nondeterministic op, no deterministic-algorithms alert (each " \
           "epoch's first step, " in render_console(result.summary)
    assert "The census found no known-nondeterministic op" in render_markdown(result.summary)
    quiet = audit(small_cnn_probe, repeats=1, epochs=1, steps=1, census=False, stress=0)
    assert "census" not in render_console(quiet.summary)


def test_op_granularity_stays_quiet_on_a_deterministic_model():
    result = audit(small_cnn_probe, repeats=3, epochs=1, granularity="op", drill_down=True)
    assert result.deterministic and "ops" not in result.investigations
    phases = set(result.traces[0].records["phase"])
    assert set(OP_PHASES) <= phases
    assert result.comparison.total_records > 0


@pytest.mark.parametrize("phase,op", [("forward", "aten.convolution"),
                                      ("backward", "aten.convolution_backward")])
def test_op_granularity_drill_down_uses_the_recorded_ops(phase, op):
    fault = Fault("block1.conv", phase, 1, op="aten.convolution")
    result = audit(small_cnn_probe, repeats=2, epochs=1, granularity="op", fault=fault,
                   drill_down=True)
    assert result.comparison.origins[0].module == "block1.conv"
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"]) == (op, "block1.conv", phase)
    assert result.investigations["ops"]["step"] == 1 and origin["max_ulp"] == 1
    assert origin["planted"] and "(the planted fault, found where it was planted)" in (
        result.verdict.headline)
    # the fix is to stop planting it: no known remedies of the op (threads, for this one)
    assert result.investigations["ops"]["knowledge"] == []


@pytest.mark.parametrize("phase,op", [("forward", "aten.convolution"),
                                      ("backward", "aten.convolution_backward")])
def test_the_zoom_measures_the_planted_op_from_its_own_replays(monkeypatch, phase, op):
    """The zoom's replays keep the outputs of the op a fault plants (and of risky ops): the
    origin's difference is measured from them, with no replay of each repeat again."""
    from detaudit.investigate import drilldown

    def replayed(*args, **kwargs):
        raise AssertionError("the repeats were replayed again to capture the op's outputs")

    monkeypatch.setattr(drilldown, "_capture", replayed)
    fault = Fault("block1.conv", phase, 1, op="aten.convolution")
    result = audit(small_cnn_probe, repeats=2, epochs=1, stress=0, fault=fault)
    assert result.investigations["zoom"]["status"] == "found"
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"]) == (op, "block1.conv", phase)
    assert origin["max_ulp"] == 1 and origin["elements"] >= 1 and origin["planted"]


class _Gated(nn.Module):
    """`gate * sigmoid(x)`, with the gate 0 at the sigmoid's first element, where a fault
    planted in it goes: 1 ULP there leaves the output alone, and changes the gate's
    gradient, which multiplies by it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.gate[0] = 0.0
        return self.gate * torch.sigmoid(x)


def test_a_forward_op_whose_difference_only_the_gradients_show_is_a_forward_cause():
    """The module's outputs agree, its gradients do not: the first divergence is in the
    backward records, and the cause was "a backward computation gave different gradients
    from equal upstream gradients" beside the origin op, a forward one."""
    def probe(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), _Gated())
        return Probe(model=model, batches=[torch.randn(1, 8) for _ in range(3)],
                     step=lambda m, b: m(b).sum(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    result = audit(probe, repeats=2, epochs=1, stress=0,
                   fault=Fault("1", "forward", 1, op="aten.sigmoid"))
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"]) == ("aten.sigmoid", "1", "forward")
    first = result.verdict.first
    assert (first["step"], first["phase"], first["module"]) == (1, "backward", "1"), first
    assert result.summary["cause"]["kind"] == "forward", result.summary["cause"]
    assert "(aten.sigmoid in 1), which the module's outputs did not show" in (
        result.summary["cause"]["text"])


@pytest.mark.parametrize("planted", [True, False])
def test_an_origin_op_in_a_loss_outside_the_model_is_the_cause_and_the_first_divergence(planted):
    """An op of the loss, outside the model, that differs on equal inputs: a planted one was
    headlined at the first module whose gradient differed ("(first record)"), a real one at
    the op; and the cause listed what the loss might be computed from (targets, class
    weights, host draws), which the op's equal inputs rule out."""
    from detaudit.analysis.causes import cause_of

    def probe(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        return Probe(model=model, batches=[torch.randn(2, 8) for _ in range(3)],
                     step=lambda m, b: m(b).cumsum(1).square().sum(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    result = audit(probe, repeats=2, epochs=1, stress=0,
                   fault=Fault(ANY_MODULE, "backward", 1, op="aten.cumsum"))
    ops = result.investigations["ops"]
    origin = ops["ops"][0]
    assert (origin["module"], origin["role"], origin["planted"]) == (
        "(outside the model)", ORIGIN, True), origin
    if not planted:  # (as a race there is found: the same records, no fault to name)
        ops = {**ops, "ops": [{**origin, "planted": False}, *ops["ops"][1:]]}
    kind, text = cause_of(result.comparison, ops)
    assert kind == "backward" and text.startswith(
        "aten.cumsum in (outside the model) at test_ops.py:"), text  # (its backward: a cumsum)
    assert "class weights" not in text
    # a module call whose backward sent other gradients to its inputs from an equal output
    # gradient, or whose forward differs on equal inputs, began a difference the op cannot
    # have made (it ran after it: an evaluation, a FLOPs count of what torch.empty made),
    # unlike a weight's gradient, which the loop may add to itself
    for slots, phase, op_is_cause in ((["grad_in.0"], "backward", False),
                                      (["out"], "forward", False),
                                      (["param.weight"], "backward", True)):
        began = CallFinding(1, phase, "2", 0, ORIGIN, slots, 1, 2)
        apart = dataclasses.replace(result.comparison,
                                    findings=[began, *result.comparison.findings])
        _, said = cause_of(apart, ops)
        assert said.startswith("aten.cumsum in (outside the model)") is op_is_cause, said
    first = result.verdict.first
    assert (first["module"], first["role"], first["slots"]) == (
        "(outside the model)", "origin op", ["aten.cumsum"]), result.verdict.headline
    # and the divergence map has a row for it (every row said "origin at steps: -")
    assert {"step": 1, "module": "(outside the model)", "phase": "backward",
            "role": "origin"} in result.summary["map"]


def test_an_op_that_reads_what_torch_empty_made_is_no_nondeterministic_op():
    """A FLOPs count after training (Ultralytics' model.info) runs the model on a tensor
    torch.empty made: what that memory held differs from run to run, and the op that read
    it was named an origin, "different results from equal inputs", as a nondeterministic
    op is. It reads an input its record leaves out (noise, whatever its inputs say): it is
    marked so, named by the cause, and no origin."""
    built = itertools.count()

    def probe(device):  # (built for each repeat in turn, and again for the zoom's replays)
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        run = next(built) % 2

        def step(m, x):
            held = torch.empty(2, 1)
            held.numpy()[:] = run  # what the memory held: written behind torch's back
            return (m(x) + held.mul(2.0)).sum()

        return Probe(model=model, batches=[torch.randn(2, 4)], step=step,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    result = audit(probe, repeats=2, epochs=1, steps=1, stress=0)
    ops = result.investigations["ops"]
    read = [o for o in ops["ops"] if o.get("uninitialized")]
    assert [(o["op"], o["module"], o["role"]) for o in read] == [
        ("aten.mul", "(outside the model)", "propagated")], ops["ops"]
    assert ops["origin_ops"] == 0
    assert "aten.mul in (outside the model) at test_ops.py:" in result.summary["cause"]["text"]
    assert "read memory that torch.empty" in result.summary["cause"]["text"]


def test_the_known_fixes_of_the_origin_op_are_those_of_the_device_the_runs_recorded_on():
    """exec's audit knows the device only from its runs' traces (its configuration says
    cpu): a convolution backward that parted on a GPU was given the CPU's remedies, not
    cuDNN's."""
    from detaudit.analysis.compare import compare
    from detaudit.investigate.drilldown import drill_down

    fault = Fault("block1.conv", "backward", 1, op="aten.convolution")
    result = audit(small_cnn_probe, repeats=2, epochs=1, stress=0, fault=fault,
                   granularity="op")
    traces = result.traces
    unplanted = dataclasses.replace(result.config, fault=None)  # (else: "stop planting it")
    for recorded, kind in (("cpu", "cpu"), ("cuda:0", "cuda")):
        for trace in traces:
            trace.env["device"] = recorded
        found = drill_down(None, unplanted, compare(traces), None, traces)
        assert found["ops"][0]["op"] == "aten.convolution_backward"
        assert {k["device"] for k in found["knowledge"]} == {kind}


def test_tensor_difference_counts_elements_ulps_and_relative_error():
    a = torch.tensor([1.0, -2.0, 0.0, 4.0])
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(-math.inf))
    b[3] = torch.nextafter(torch.nextafter(b[3], torch.tensor(0.0)), torch.tensor(0.0))
    diff = tensor_difference(a, b)
    assert (diff["elements"], diff["of"], diff["max_ulp"]) == (2, 4, 2)
    assert diff["max_abs_diff"] == pytest.approx(2**-21)  # 2 ULPs just below 4.0
    assert tensor_difference(torch.tensor([0.0]), torch.tensor([-0.0]))["elements"] == 0
    ints = tensor_difference(torch.tensor([3, 1, 2]), torch.tensor([1, 3, 2]))
    assert (ints["elements"], ints["max_abs_diff"], ints["max_ulp"]) == (2, 2, None)


def test_knowledge_entries_are_complete_and_found_by_op():
    for known in KNOWN:
        assert known.ops and known.what and known.why and known.remedy
        assert known.device in ("cpu", "cuda", "any")
        assert known.deterministic_mode in ("raises", "switches", "no effect")
    assert lookup("torchvision._roi_align_backward", "backward", "cuda:0")
    assert not lookup("torchvision._roi_align_backward", "backward", "cpu")


def test_op_fault_syntax():
    assert Fault.parse("op:torchvision.nms@forward:2") == Fault(
        ANY_MODULE, "forward", 2, "torchvision.nms")
    assert Fault.parse("(model)/aten.mul@backward:1") == Fault("", "backward", 1, "aten.mul")
    assert Fault.parse("roi_heads.box_roi_pool/torchvision.roi_align@backward:1") == Fault(
        "roi_heads.box_roi_pool", "backward", 1, "torchvision.roi_align")
    assert Fault.parse("rpn.head@backward") == Fault("rpn.head", "backward", 0)


def test_capturing_the_environment_leaves_the_scripts_warnings_alone(monkeypatch):
    """It is captured in the audited process at its first step: `platform.processor()` ran
    `uname -p` there, whose subprocess call reset the warnings registry, and a warning the
    script shows once per line was shown again after the first step."""
    import platform
    import warnings

    mutated = []
    monkeypatch.setattr(warnings, "_filters_mutated", lambda: mutated.append(1))
    monkeypatch.setattr(platform, "_uname_cache", None)  # (as in a process that just began)
    monkeypatch.setattr(platform, "_platform_cache", {})
    env = capture_environment()
    assert mutated == [] and env["cpu"] and env["platform"]


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"),
                    reason="only Linux keeps the environment a process started with")
@pytest.mark.parametrize("started_with", ["7", None])
def test_the_hash_seed_recorded_is_the_one_the_process_started_with(started_with):
    """Its str hashes follow that one: a script that removes PYTHONHASHSEED (Ultralytics)
    or sets it after the start (a common seed_everything) changes only the processes it
    starts, and the recorded environment says so."""
    script = ("import os\n"
              "from detaudit.record.environment import capture_environment\n"
              "os.environ.pop('PYTHONHASHSEED', None) if 'PYTHONHASHSEED' in os.environ "
              "else os.environ.update(PYTHONHASHSEED='0')\n"
              "print(capture_environment()['PYTHONHASHSEED'])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**env, **({"PYTHONHASHSEED": started_with} if started_with
                                         else {})}, timeout=120, check=True)
    assert done.stdout.strip() == str(started_with)


def test_env_flags_risky_settings(monkeypatch):
    flagged = risks({**capture_environment(), "PYTHONHASHSEED": None})
    assert "deterministic_algorithms" in flagged and "PYTHONHASHSEED" in flagged
    assert "PYTHONHASHSEED" not in risks({**capture_environment(), "PYTHONHASHSEED": "0"})
    if torch.backends.mkl.is_available():  # MKL's run-time code paths, unless pinned
        monkeypatch.delenv("MKL_CBWR", raising=False)
        assert "MKL_CBWR" in risks({**capture_environment(), "device": "cpu"})
        monkeypatch.setenv("MKL_CBWR", "AUTO")
        assert "MKL_CBWR" not in risks({**capture_environment(), "device": "cpu"})
    done = run_cli("env", "--json")
    data = json.loads(done.stdout)
    assert done.returncode == 0 and "deterministic_algorithms" in data["risks"]
    # (the device `run` audits on by default: its row was blank)
    assert data["env"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_seed_everything_with_workers_fixes_the_hash_seed_of_child_processes(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    seed_everything(5, workers=True)
    import os

    assert os.environ["PYTHONHASHSEED"] == "5"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_op_drill_down_on_cuda_names_the_planted_op_and_backward_module():
    fault = Fault("block2.conv", "backward", 1, op="aten.convolution")
    result = audit(small_cnn_probe, repeats=2, epochs=1, device="cuda", fault=fault,
                   drill_down=True, census=True)
    assert result.comparison.first_step == 1
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"]) == (
        "aten.convolution_backward", "block2.conv", "backward")
    assert origin["max_ulp"] == 1
    assert result.investigations["census"]["device"].startswith("cuda")


def test_op_level_recording_of_an_inference_mode_step():
    """Tensors made under torch.inference_mode() have no version counter; the op level
    (including its uninitialised-memory tracking of empty()) must still record them."""
    def probe(device):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

        def step(m, batch):
            with torch.inference_mode():
                scratch = torch.empty(4)
                scratch.fill_(1.0)
                return m(batch) + scratch

        return Probe(model=model, batches=[torch.ones(2, 4)] * 2, step=step)

    result = audit(probe, repeats=2, mode="infer", granularity="op")
    assert result.deterministic
    assert any(p.startswith("op.") for p in result.traces[0].records["phase"])


class Scatter(nn.Module):
    """Scatters 60,000 values into 1,000 cells in place, with duplicates: on 2 threads the
    accumulation order (and so the float sum) varies run to run."""

    def forward(self, values: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(1000, values.shape[1], dtype=values.dtype, device=values.device)
        return grid.index_put_((cells,), values, accumulate=True)


class ScatterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.scatter = Scatter()
        self.head = nn.Linear(4, 1)

    def forward(self, points: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        return self.head(self.scatter(self.act(self.embed(points)), cells))


def scatter_probe(device: torch.device, steps: int = 2, points: int = 60_000) -> Probe:
    model = ScatterNet().to(device)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(points, 4, generator=g), torch.randint(0, 1000, (points,), generator=g))
               for _ in range(steps)]

    def step(m: nn.Module, batch):
        points, cells = (t.to(device) for t in batch)
        return m(points, cells).pow(2).mean()

    return Probe(model=model, batches=batches, step=step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def test_a_planted_fault_in_an_in_place_op_is_named():
    """Inside a dispatch mode an in-place op's output is still at its input's version: its
    print must not be the input's (it was, and the op was never found)."""
    fault = Fault("act", "forward", 1, op="aten.relu_")
    few = functools.partial(scatter_probe, points=2000)  # under the parallel grain: no race
    result = audit(few, repeats=2, epochs=1, fault=fault, drill_down=True)
    assert result.comparison.first_step == 1
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"]) == ("aten.relu_", "act", "forward")
    assert origin["max_ulp"] == 1


def test_a_real_race_in_an_in_place_scatter_is_named(two_threads):
    result = _until_divergent(lambda: audit(scatter_probe, repeats=3, epochs=1,
                                            drill_down=True))
    assert result.comparison.first_step == 0
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"], origin["role"]) == (
        "aten.index_put_", "scatter", "forward", ORIGIN)
    assert not origin["planted"] and "planted" not in result.verdict.headline
    assert any("duplicate indices" in k["why"] for k in result.investigations["ops"]["knowledge"])


def _scatter_with_unseeded_numpy(device: torch.device) -> Probe:
    """The scatter, in a process whose numpy RNG is reseeded from the OS and never drawn."""
    import numpy as np

    np.random.seed(None)
    return scatter_probe(device)


def test_an_unseeded_rng_nothing_draws_from_does_not_become_the_cause_in_the_zoom(two_threads):
    """The zoom's replays stop at the zoomed step, too soon to see that a stream is never
    drawn from: the scan's finding carries over, and the cause stays the forward op."""
    result = _until_divergent(lambda: audit(_scatter_with_unseeded_numpy, repeats=2, epochs=1))
    assert result.comparison.first_step == 0 and "numpy" in result.comparison.idle_rng
    assert result.summary["cause"]["kind"] == "forward", result.verdict.headline
    assert "cause: forward" in result.verdict.headline
    assert "op: aten.index_put_ in scatter" in result.verdict.headline


def test_a_backward_op_under_a_reentrant_checkpoint_is_named_with_its_module():
    """The graph a reentrant checkpoint builds in backward: the module-level origin is the
    module whose op the drill-down names (it was the layer before the checkpoint, 'outside
    the dispatcher')."""
    fault = Fault("block.2", "backward", 1, op="aten.mm")
    result = audit(_mean_square_probe(_Checkpointed), repeats=2, epochs=1, fault=fault,
                   drill_down=True)
    assert result.comparison.origins[0].module == "block.2"
    drill = result.investigations["ops"]
    origin = drill["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"]) == ("aten.mm", "block.2", "backward")
    assert drill["outside_dispatcher"] is None


class _CheckpointedNonReentrant(_Checkpointed):
    """_Checkpointed's block under a non-reentrant checkpoint, whose recomputation stops as
    soon as it has recomputed what backward saved, by an exception through the block's
    module calls."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)


def test_a_backward_op_under_a_non_reentrant_checkpoint_is_a_backward_op():
    """The calls its stopped recomputation left open took the backward's ops for theirs,
    in the forward phase: a backward op planted @forward fired there, and a real difference
    in it would have been called a forward one."""
    probe = _mean_square_probe(_CheckpointedNonReentrant)
    result = audit(probe, repeats=2, epochs=1, drill_down=True,
                   fault=Fault("block.2", "backward", 1, op="aten.mm"))
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["phase"]) == ("aten.mm", "block.2", "backward")
    with pytest.raises(DetauditError, match="did not run forward"):
        audit(probe, repeats=2, epochs=1, fault=Fault("block.2", "forward", 1, op="aten.mm"))


def test_an_op_fault_in_a_complex_output_is_one_ulp_and_measured_so():
    """A complex op output is moved by 1 ULP in one part (two elements were swapped), and
    the difference is measured on the complex values (the imaginary parts were dropped)."""
    fault = Fault("to_freq", "forward", 1, op="aten._fft_r2c")
    result = audit(_mean_square_probe(_Spectral), repeats=2, epochs=1, fault=fault,
                   drill_down=True)
    origin = result.investigations["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["planted"]) == ("aten._fft_r2c", "to_freq", True)
    assert (origin["elements"], origin["max_ulp"]) == (1, 1)
    assert 0 < origin["max_abs_diff"] < 1e-5


class _OwnCode(nn.Module):
    """Two layers, an op called as a function between them (in the model's own code), and
    optionally a TorchScript block after it, which takes no hooks."""

    def __init__(self, scripted: bool = False):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.block = torch.jit.script(nn.Sequential(nn.Linear(6, 6), nn.Tanh())) if scripted \
            else None
        self.c = nn.Linear(6, 1)

    def forward(self, x):
        x = torch.relu(self.a(x))
        return self.c(self.block(x) if self.block is not None else x)


@pytest.mark.parametrize("op,scripted,slots", [
    ("aten.relu", False, [["in.0 of c"]]),  # (the 1 ULP vanishes in c's rounding)
    # (whether it outlives c's rounding depends on the CPU's matmul kernel)
    ("aten.tanh", True, [["out"], ["in.0 of c"]]),
])
def test_a_difference_made_in_the_models_own_code_is_its_origin_not_the_data(op, scripted, slots):
    """An op the model calls between its layers (`torch.relu`), or inside a TorchScript
    module (which takes no hooks: hooking it crashed every zoom), makes the next layer's
    input differ while the model's own input agrees: the origin is the model's own code,
    in forward, and the drill-down names the op there (it was `cause: data`, "a value
    computed outside the model")."""
    fault = Fault("", "forward", 1, op=op)
    with _profiling_executor(False):  # (see below)
        result = audit(_mean_square_probe(functools.partial(_OwnCode, scripted)), repeats=2,
                       epochs=1, fault=fault, drill_down=True)
    c = result.comparison
    assert (c.first_step, c.cause) == (1, "forward")
    origin = c.origins[0]
    assert (origin.module, origin.phase, origin.role) == ("", "forward", ORIGIN)
    assert origin.slots in slots
    named = result.investigations["ops"]["ops"][0]
    assert (named["op"], named["module"], named["planted"]) == (op, "(model)", True)


class _Aggregating(nn.Module):
    """A graph layer: a linear map of the nodes, then a sum over edges by indexing (between
    its child and its output, in its own code), as message passing does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6, bias=False)
        self.src = torch.tensor([0, 1, 2, 3, 0, 1, 1, 2])
        self.dst = torch.tensor([1, 2, 3, 0, 2, 3, 0, 1])

    def forward(self, x):
        h = self.lin(x)
        return torch.zeros_like(h).index_add(0, self.dst, h[self.src])


def test_a_backward_difference_made_in_a_modules_own_code_is_that_modules_origin():
    """The backward of `h[src]` (an index_put accumulating into the gradient of `h`, in
    `agg`'s own code) made `agg.lin`'s output gradient differ while `agg`'s own was equal:
    the report named `agg.lin` as the first record and no origin at all."""
    def build():
        return nn.Sequential(_Aggregating(), nn.Linear(6, 1))

    result = audit(_mean_square_probe(build), repeats=2, epochs=1, drill_down=True,
                   fault=Fault.parse("0/aten.index_put@backward:1"))
    c = result.comparison
    assert (c.first_step, c.cause) == (1, "backward")
    assert [(o.module, o.phase, o.slots) for o in c.origins] == [
        ("0", "backward", ["grad_out of 0.lin"])]
    named = result.investigations["ops"]["ops"][0]
    assert (named["op"], named["module"], named["planted"]) == ("aten.index_put", "0", True)


def test_an_op_fault_at_the_model_itself_is_in_its_own_ops_not_its_layers():
    """`(model)/OP` was taken for an op in any module: an op that only a layer runs was
    planted there, and an op the model never runs was said to run "in any module" with
    no list of the ops the model itself ran."""
    with pytest.raises(DetauditError) as refused:
        audit(_mean_square_probe(_OwnCode), repeats=2, epochs=1,
              fault=Fault.parse("(model)/aten.addmm@forward:1"))
    said = str(refused.value)
    assert "op 'aten.addmm' in module '(model)' did not run forward" in said, said
    assert "the ops it ran forward there: aten.relu" in said, said
    anywhere = audit(_mean_square_probe(_OwnCode), repeats=2, epochs=1,
                     fault=Fault.parse("op:aten.addmm@forward:1"))
    assert anywhere.comparison.origins[0].module == "a"


@contextlib.contextmanager
def _profiling_executor(on: bool):
    """TorchScript's profiling executor runs a scripted module's first calls as they are,
    then optimized: in-process repeats, each a new module, part in their first steps."""
    before = torch._C._jit_set_profiling_executor(on)
    try:
        yield
    finally:
        torch._C._jit_set_profiling_executor(before)


def test_in_process_repeats_of_a_fresh_torchscript_module_part_and_are_told_why():
    """A scripted module's first calls in a process run unoptimized (profiled), later ones
    optimized: in-process repeats part in the first steps, and the replays of the zoom, run
    later, do not. The headline says why, beside "intermittent"."""

    class Block(nn.Module):  # (a class of this test's own: no TorchScript cache warms it)
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return torch.tanh(self.lin(x)) * torch.sigmoid(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.block, self.c = nn.Linear(6, 6), torch.jit.script(Block()), nn.Linear(6, 1)

        def forward(self, x):
            return self.c(self.block(self.a(x)))

    with _profiling_executor(True):
        result = audit(_mean_square_probe(Model), repeats=2, epochs=1)
    assert result.verdict.kind == "divergent" and result.comparison.first_step == 0
    assert "intermittent" in result.verdict.headline
    assert ("the model holds TorchScript modules (block), whose first calls in a process run "
            "unoptimized") in result.verdict.headline


def test_a_fault_planted_in_a_torchscript_module_says_where_to_plant_instead():
    """A model holding a TorchScript module audits deterministic (its executor's warm-up
    aside, see above), the module named among the risks; a fault planted in it is refused
    with where to plant instead."""
    with _profiling_executor(False):
        result = audit(_mean_square_probe(functools.partial(_OwnCode, True)), repeats=2,
                       epochs=1, drill_down=False)
    assert result.verdict.kind == "deterministic", result.verdict.headline
    assert "TorchScript modules (block)" in result.summary["env_risks"]["torchscript"]
    with pytest.raises(DetauditError, match=r"module 'block' is a TorchScript module "
                       r"\(torch.jit.script\), which takes no hooks: plant at the module that "
                       r"calls it"):
        audit(_mean_square_probe(functools.partial(_OwnCode, True)), repeats=2, epochs=1,
              fault=Fault("block", "forward", 1))


class _SparseEmbedding(nn.Module):
    """``nn.Embedding(sparse=True)``: its weight's gradient is a sparse tensor."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 4, sparse=True)
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def _sparse_embedding_probe(device):
    torch.manual_seed(0)
    model = _SparseEmbedding()
    g = torch.Generator().manual_seed(1)
    return Probe(model=model, batches=[torch.randint(0, 50, (8, 5), generator=g) for _ in range(3)],
                 step=lambda m, ids: m(ids).pow(2).mean(),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # (takes sparse grads)


@pytest.mark.parametrize("op", [None, "aten._sparse_coo_tensor_with_dims_and_tensors"])
def test_a_backward_fault_in_a_sparse_gradient_is_planted_in_its_values_and_named(op):
    """A planted backward fault in a module whose gradient is sparse is 1 ULP in one of its
    values (it crashed: ``!=`` has no sparse kernel), at module level and in the op that
    makes the sparse gradient."""
    result = audit(_sparse_embedding_probe, repeats=2, epochs=1,
                   fault=Fault("emb", "backward", 1, op=op), drill_down=op is not None)
    origin = result.comparison.origins[0]
    assert (origin.module, origin.phase, origin.step) == ("emb", "backward", 1)
    if op is not None:
        named = result.investigations["ops"]["ops"][0]
        assert (named["op"], named["module"], named["planted"]) == (op, "emb", True)
        assert (named["elements"], named["max_ulp"]) == (1, 1)


def test_tensor_difference_of_sparse_tensors_is_that_of_their_values_where_indices_agree():
    from detaudit.record.difference import identical

    def sparse(indices, values, size=(4,)):
        return torch.sparse_coo_tensor(torch.tensor([indices]), torch.tensor(values), size)

    a = sparse([0, 2], [1.0, 2.0])
    b = sparse([2, 0], [torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item(), 1.0])
    assert identical(a, sparse([2, 0], [2.0, 1.0])) and not identical(a, b)
    assert (tensor_difference(a, b)["elements"], tensor_difference(a, b)["max_ulp"]) == (1, 1)
    assert tensor_difference(a, sparse([0, 3], [1.0, 2.0]))["note"] == (
        "sparse, with different indices")
    assert tensor_difference(a, sparse([0, 2], [1.0, 2.0], (5,)))["note"] == (
        "(4,) torch.sparse_coo vs (5,) torch.sparse_coo")


def test_tensor_difference_of_complex_values_counts_the_ulps_of_their_parts():
    a = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex64)
    b = a.clone()
    b[1] = torch.complex(torch.tensor(2.0), torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)))
    diff = tensor_difference(a, b)
    assert (diff["elements"], diff["max_ulp"]) == (1, 1)
    assert diff["max_abs_diff"] == pytest.approx(2.0 ** -22)


def test_an_origin_op_in_another_module_leaves_the_dispatcher_unblamed():
    """Module records that place a backward difference where the op records do not (as a
    reentrant checkpoint once made them) must not be called code outside the dispatcher."""
    from types import SimpleNamespace

    from detaudit.analysis.compare import OpFinding
    from detaudit.investigate.drilldown import _outside_dispatcher

    modules = SimpleNamespace(origins=[SimpleNamespace(step=0, module="block.fc",
                                                       phase="backward")], built_buffers=[])
    op = OpFinding(0, "backward", "block.gather", 0, 3, "aten.index_put", ORIGIN, 1, 2,
                   ["out.0"], 1)
    assert _outside_dispatcher(modules, 0, [op], set()) is None
    forward_op = OpFinding(0, "forward", "head", 0, 0, "aten.mm", ORIGIN, 1, 2, ["out.0"], 1)
    assert _outside_dispatcher(modules, 0, [forward_op], set())["module"] == "block.fc"


def test_an_op_given_a_different_python_number_is_not_blamed():
    """A module scaling by a number drawn on the host (an RNG seeded from the OS): the op
    that takes it gets a different argument, not equal inputs, so the headline says the
    difference came from outside the dispatcher (it named aten.mul as the origin)."""
    import numpy as np

    class Jitter(nn.Module):
        def forward(self, x):
            return x * (1 + 1e-3 * float(np.random.default_rng().random()))

    def probe(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), Jitter(), nn.Linear(4, 1))
        return Probe(model=model, batches=[torch.ones(2, 4)], step=lambda m, b: m(b).sum(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    result = audit(probe, repeats=2, epochs=1)
    headline = result.verdict.headline
    assert "1 (origin)" in headline and "op: aten.mul" not in headline, headline
    assert "outside the dispatcher: no op in 1 differs on equal inputs" in headline, headline


def test_collectives_are_told_by_their_process_group_not_by_a_group_count():
    """A collective's outputs land after it returns (not recorded at it; never re-executed
    by stress); GroupNorm's `int group` makes no collective (its outputs were dropped)."""
    from detaudit.record.oprecorder import collective

    ops = torch.ops
    assert collective(ops.c10d.allreduce_.default)
    assert collective(ops._c10d_functional.all_reduce.default)
    assert not collective(ops._c10d_functional.wait_tensor.default)
    assert not collective(ops.aten.native_group_norm.default)
    assert not collective(ops.aten.native_group_norm_backward.default)
    assert not collective(ops.aten.add.Tensor)
