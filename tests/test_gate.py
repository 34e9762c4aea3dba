"""Tests of the regression gate, JUnit output and the pytest helpers (CPU, tiny models)."""

from __future__ import annotations

import functools
import gzip
import json
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from conftest import module_audit
from torch import nn

from detaudit import Probe, api
from detaudit.analysis.diff import GateResult, diff_traces, env_differences
from detaudit.errors import TraceError
from detaudit.report.junit import JUnitCase, junit_case, junit_xml, write_junit
from detaudit.runfolder import load_baseline, save_baseline
from detaudit.trace import TraceFile

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

pytest_plugins = ["detaudit.testing"]  # the detaudit_check fixture, as users get it


class Act(nn.Module):
    """A ReLU the tests can patch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


class ConvNet(nn.Module):
    """Conv -> act -> conv: the model the baseline tests store and re-check."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 32, 3)
        self.act = Act()
        self.head = nn.Conv2d(32, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x)))


def mse_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def conv_probe(device: torch.device) -> Probe:
    model = ConvNet().to(device)
    batches = [(torch.randn(1, 16, 32, 32), torch.randn(1, 4, 28, 28)) for _ in range(2)]
    return Probe(
        model=model,
        batches=batches,
        step=mse_step,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


class Gather(nn.Module):
    """Rows of a [H*W, C] feature table picked by index (index_put accumulate in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(32 * 32, 16))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


class GatherNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gather = Gather()
        self.head = nn.Linear(16, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.gather(idx))


def gather_probe(device: torch.device) -> Probe:
    model = GatherNet().to(device)
    # 4000 indices into 64 rows: many duplicates, so the accumulation order matters; the
    # per-index targets give each duplicate its own gradient. The threads race only when both
    # get a core at once, so four steps give it several chances.
    batches = [(torch.randint(0, 64, (4000,)), torch.randn(4000, 16)) for _ in range(4)]
    return Probe(model=model, batches=batches, step=mse_step)


def check_conv(path: Path) -> GateResult:
    """`detaudit check` of a baseline of conv_probe (a Python function, so passed along)."""
    return api.check(path, factory=conv_probe).gate


def store_baseline(path: Path, result: api.AuditResult) -> Path:
    return save_baseline(path, result.spec, result.config, result.traces[0])


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def conv_baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gate") / "conv.baseline.json"
    store_baseline(path, module_audit(conv_probe, repeats=1, steps=2))
    return path


def test_baseline_round_trip_and_unchanged_code_passes(conv_baseline: Path) -> None:
    baseline = load_baseline(conv_baseline)
    assert baseline.spec.name == "conv_probe" and baseline.config.steps == 2
    assert len(baseline.trace) > 0 and baseline.env["device"] == "cpu"
    result = check_conv(conv_baseline)
    assert result.ok and result.exit_code == 0
    assert result.message.startswith("MATCH")


def test_patched_numerics_fail_the_check_naming_the_module(
    conv_baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Act, "forward", lambda self, x: torch.relu(x) * (1 + 2**-20))
    result = check_conv(conv_baseline)
    assert not result.ok and result.exit_code == 1
    assert (result.origin_module, result.origin_phase) == ("act", "forward")
    assert result.first is not None and result.first.module == "act" and result.first.step == 0
    assert "MISMATCH" in result.headline and "act" in result.headline
    assert "origin: act (forward)" in result.message


def test_parameters_that_differ_as_built_are_the_origin_not_a_forward(conv_baseline: Path):
    def changed_init(device: torch.device) -> Probe:
        probe = conv_probe(device)
        with torch.no_grad():
            probe.model.head.bias.add_(1e-3)  # a different init constant in the new code
        return probe

    gate = api.check(conv_baseline, factory=changed_init).gate
    assert gate.exit_code == 1 and gate.first.step == 0 and gate.first.phase == "state"
    assert "origin: the parameters of head, different before step 0" in gate.message
    assert "(forward)" not in gate.message


def test_a_check_folder_reports_the_checks_verdict(
    conv_baseline: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The folder a check writes (CI's artifact) says MATCH or MISMATCH, not the verdict of
    its one run alone (NOT COMPARED), and a re-render keeps it."""
    from detaudit.cli import main

    passed = api.check(conv_baseline, factory=conv_probe, out=tmp_path / "pass")
    summary = json.loads((tmp_path / "pass" / "summary.json").read_text())
    assert (summary["verdict"], passed.exit_code) == ("match", 0)
    assert summary["headline"].startswith("MATCH")
    monkeypatch.setattr(Act, "forward", lambda self, x: torch.relu(x) * (1 + 2**-20))
    failed = api.check(conv_baseline, factory=conv_probe, out=tmp_path / "fail")
    assert failed.exit_code == 1
    for name in ("report.md", "report.html", "summary.json"):
        text = (tmp_path / "fail" / name).read_text()
        assert "MISMATCH" in text and "NOT COMPARED" not in text
    assert main(["report", str(tmp_path / "fail")]) == 1
    said = json.loads((tmp_path / "fail" / "summary.json").read_text())
    assert said["verdict"] == "mismatch"
    # its repeats agree: the cause is what changed since the baseline, not "no divergence"
    assert said["cause"]["kind"] == "baseline" and "(origin: act (forward))" in said["cause"]["text"]
    # (one repeat: none to agree with)
    assert said["cause"]["text"].startswith(
        "this run differs from the baseline" if said["repeats"] == 1 else
        "the repeats of this run agree, and differ from the baseline"), said["cause"]["text"]
    # what differs in the environment since the baseline, in the artifact a CI job reads (it
    # was on the console and in --json only)
    assert said["check"]["env_differences"] == {}
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    api.check(conv_baseline, factory=conv_probe, out=tmp_path / "moved")
    moved = json.loads((tmp_path / "moved" / "summary.json").read_text())["check"]
    assert moved["env_differences"]["torch"][1] == "9.9.9", moved


def test_a_baseline_given_to_diff_is_named_for_what_it_is(conv_baseline: Path) -> None:
    """It was "not a detaudit trace file", as any JSON would be."""
    with pytest.raises(TraceError, match=r"is a detaudit baseline file, not a detaudit trace "
                       r"file \(`detaudit check` runs a baseline"):
        api.diff(conv_baseline, conv_baseline)


def test_a_check_whose_run_crashes_is_failed_never_a_mismatch(conv_baseline: Path) -> None:
    """The new code raising at step 1 is a crash (exit 3), even though the steps both runs
    completed agree; it was MISMATCH (exit 1), a divergence."""
    def crashing(device: torch.device) -> Probe:
        probe = conv_probe(device)

        def step(model: nn.Module, batch: Any) -> torch.Tensor:
            step.calls += 1
            if step.calls == 2:
                raise RuntimeError("out of memory")
            return mse_step(model, batch)

        step.calls = 0
        return Probe(model=probe.model, batches=probe.batches, step=step,
                     optimizer=probe.optimizer)

    gate = api.check(conv_baseline, factory=crashing).gate
    assert (gate.verdict, gate.exit_code) == ("failed", 3)
    assert gate.headline.startswith("FAILED: now stopped early: RuntimeError in step 1 at ")
    case = ET.fromstring(junit_xml([junit_case("conv", "c", 1.0, gate.ok, gate.headline, "",
                                               "failed")]).encode())
    assert case.find("testsuite/testcase/error") is not None


def test_tolerance_never_passes_a_difference_it_cannot_measure(tmp_path: Path) -> None:
    """A 1-step baseline, and new code whose lr is 50 times larger: only the parameters
    after the update differ. They carry stats at module level, so tolerance measures them;
    a float without stats that differs is a difference (it was counted as agreeing)."""
    def faster(device: torch.device) -> Probe:
        probe = conv_probe(device)
        probe.optimizer.param_groups[0]["lr"] = 5.0
        return probe

    path = store_baseline(tmp_path / "one.json", module_audit(conv_probe, repeats=1, steps=1))
    gate = api.check(path, factory=faster, rtol=1e-5, atol=1e-6).gate
    assert gate.exit_code == 1 and gate.first.phase == "optimizer", gate.message
    assert "beyond rtol=1e-05, atol=1e-06" in gate.headline and gate.first.norm[0] is not None
    assert api.check(path, factory=conv_probe, rtol=1e-5, atol=1e-6).gate.ok
    a, b = (load_baseline(path).trace for _ in range(2))
    i = a.records["slot"].index("param.weight")
    for t in (a, b):  # a parameter as a scan records it: no stats
        t.records["norm"][i] = t.records["absmax"][i] = None
    b.records["fp"][i] = "f" * 16
    unmeasured = diff_traces(a, b, rtol=1e-3)
    assert not unmeasured.ok and unmeasured.first.unmeasured
    assert "a run stored no stats to measure it within tolerance by" in unmeasured.message


def _conv_probe_with(device: torch.device, **group: float) -> Probe:
    """conv_probe, its optimizer's parameter group set to `group`."""
    probe = conv_probe(device)
    probe.optimizer.param_groups[0].update(group)
    return probe


@pytest.mark.parametrize("granularity", ["module", "scan"])
def test_a_changed_learning_rate_is_named_as_the_rate_not_as_the_first_parameter(
        tmp_path: Path, granularity: str) -> None:
    """New code whose learning rate is 0.11 where the baseline's was 0.1: every parameter the
    update wrote differs, and the gate named the first of them. It names the rate, with each
    run's value; an update changed otherwise (weight decay) is not said to be the rate."""
    runs = {name: api.audit(functools.partial(_conv_probe_with, **group), repeats=1, steps=2,
                            granularity=granularity, drill_down=False).traces
            for name, group in (("old", {}), ("faster", {"lr": 0.11}),
                                ("decayed", {"weight_decay": 0.01}))}
    faster = diff_traces(runs["old"], runs["faster"], labels=("baseline", "now"))
    assert faster.exit_code == 1 and (faster.first.step, faster.first.phase) == (0, "optimizer")
    assert ("at step 0 in the learning rate its update read (baseline 0.1, now 0.11)"
            in faster.headline), faster.message
    assert "origin: the learning rate differs (baseline 0.1, now 0.11)" in faster.message
    assert [row["step"] for row in faster.steps_apart] == [0, 1]
    assert f"records differ at 2 steps: 0 ({faster.steps_apart[0]['records']} records), 1 (" \
        in faster.message
    decayed = diff_traces(runs["old"], runs["decayed"], labels=("baseline", "now"))
    assert decayed.exit_code == 1 and decayed.first.phase == "optimizer", decayed.message
    assert "learning rate" not in decayed.message


def _flipped_probe(device: torch.device) -> Probe:
    """conv_probe, each input image flipped left to right (the same values, other places)."""
    probe = conv_probe(device)
    probe.batches = [(x.flip(-1), y) for x, y in probe.batches]
    return probe


def test_tolerance_sees_a_flipped_image_in_the_batch_not_in_the_first_layer(tmp_path: Path):
    """A data change that moves values without changing them: a flipped image has its
    norm and its absmax, so under --rtol the batch passed and the first conv was blamed.
    The sum under fixed signs moves, so the batch is the first difference, said as such;
    the same run checked against itself still passes within tolerance."""
    path = store_baseline(tmp_path / "conv.json", module_audit(conv_probe, repeats=1, steps=1))
    gate = api.check(path, factory=_flipped_probe, rtol=1e-4, atol=1e-6).gate
    assert gate.exit_code == 1 and gate.tolerance, gate.message
    assert (gate.first.phase, gate.first.slot) == ("state", "batch.0"), gate.message
    assert gate.first.norm[0] == pytest.approx(gate.first.norm[1], rel=1e-6)
    assert "elements moved or traded places (a flip, a shuffled batch" in gate.message
    assert "origin: the batch of step 0, different before the model ran" in gate.message
    assert api.check(path, factory=conv_probe, rtol=1e-4, atol=1e-6).gate.ok


def test_a_checks_report_lists_every_step_where_it_differs_from_the_baseline(tmp_path: Path):
    """A check's report gave its first difference only: it lists each step that differs,
    with its epoch, how many records differ and the loss's relative difference."""
    path = store_baseline(tmp_path / "conv.json", module_audit(conv_probe, repeats=1, epochs=2,
                                                               steps=2))
    check = api.check(path, factory=functools.partial(_conv_probe_with, lr=0.11),
                      out=tmp_path / "check")
    rows = check.gate.steps_apart
    assert [(r["step"], r["epoch"]) for r in rows] == [(0, 1), (1, 1), (2, 2), (3, 2)]
    assert check.gate.steps_apart_total == 4
    assert rows[0]["loss"] == 0 and rows[1]["loss"] > 0  # (step 0's update alone differs)
    report = (tmp_path / "check" / "report.md").read_text()
    assert "steps where the baseline and this run differ (4)" in report
    assert f"| 2 | 2 | {rows[2]['records']} |" in report, report


def _batchnorm_probe(momentum: float, device: torch.device) -> Probe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum),
                          nn.ReLU(), nn.Flatten(), nn.LazyLinear(1)).to(device)
    model(torch.zeros(2, 3, 8, 8))  # (the lazy layer's shape)
    model[1].reset_running_stats()
    g = torch.Generator().manual_seed(1)
    return Probe(model=model, batches=[torch.randn(2, 3, 8, 8, generator=g) for _ in range(3)],
                 step=lambda m, b: m(b).square().mean(),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def test_tolerance_measures_a_norm_layers_running_statistics(tmp_path: Path) -> None:
    """A BatchNorm whose momentum moved in its last digits: its running statistics differ
    by a few ULPs, and `check --rtol` could never pass, as a module-level run stored the
    buffers without the stats every other float record has."""
    path = store_baseline(tmp_path / "bn.json", module_audit(
        functools.partial(_batchnorm_probe, 0.1), repeats=1, steps=3))
    nudged = functools.partial(_batchnorm_probe, 0.1 + 1e-7)
    assert api.check(path, factory=nudged).gate.exit_code == 1  # bitwise: they differ
    gate = api.check(path, factory=nudged, rtol=1e-4, atol=1e-7).gate
    assert gate.ok and gate.tolerance, gate.message


def test_a_module_level_step_records_the_learning_rate_its_update_used(tmp_path: Path) -> None:
    """A scheduler stepped each step: `lr.0` held the rate after the scheduler's step (0.009
    where the update used 0.01), as the scheduler stepped before the optimizer's record."""
    def scheduled(device: torch.device) -> Probe:
        probe = conv_probe(device)
        probe.scheduler = torch.optim.lr_scheduler.StepLR(probe.optimizer, 1, gamma=0.5)
        probe.scheduler_interval = "step"
        return probe

    trace = module_audit(scheduled, repeats=1, steps=2).traces[0]
    records = trace.frame()
    rates = records[(records.phase == "optimizer") & (records.slot == "lr.0")]
    assert list(rates.norm) == [0.1, 0.05]  # (a scalar's norm: itself)
    assert [s.lr for s in trace.steps] == [[0.1], [0.05]]


def test_a_renamed_module_is_said_to_be_one_not_parameters_built_otherwise() -> None:
    """A submodule renamed, every value the same: the origin was "the parameters of lat,
    different before step 0 (as built, loaded or carried over)"."""
    from collections import OrderedDict

    def named(name: str) -> Callable[[torch.device], Probe]:
        def probe(device: torch.device) -> Probe:
            torch.manual_seed(0)
            model = nn.Sequential(OrderedDict([(name, nn.Linear(4, 4)), ("head", nn.Linear(4, 1))]))
            return Probe(model=model, batches=[torch.ones(2, 4)], step=lambda m, b: m(b).sum(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        return probe

    before, after = (module_audit(named(n), repeats=1, steps=1).traces[0] for n in ("lat", "lateral"))
    result = diff_traces(before, after)
    assert result.exit_code == 1
    assert "origin: the model's modules differ: lat weight is a parameter of one run only" in (
        result.message), result.message
    assert "as built, loaded or carried over" not in result.message


def test_a_diff_of_two_configurations_says_so_and_names_no_place_it_cannot_locate(
        conv_baseline: Path) -> None:
    """Runs of other step counts part where their batches do: the diff says their
    configurations differ, and what each audited where that differs (two exec runs of other
    commands); a first differing record that no origin call explains is called that, not a
    place ("differs at step 0 in conv" read as a location)."""
    a, b = (load_baseline(conv_baseline).trace for _ in range(2))
    b.probe["config"] = {**a.probe["config"], "steps": 3}
    b.probe["info"] = {"kind": "command", "name": "train.py", "source": "python train.py --lr 2"}
    i = b.records["slot"].index("batch.0")
    b.records["fp"][i] = "f" * 16
    result = diff_traces(a, b)
    assert "configuration differs between A and B" in result.message
    assert "  audited: 'python test_gate' -> 'command python train.py --lr 2'" in result.message
    assert "  steps: 2 -> 3" in result.message
    assert "audited" not in diff_traces(a, b, audited_alike=True).message  # (a baseline's)
    assert "at step 0 (its first differing record: state (model) batch.0)" in result.headline
    # two runs of a built-in model at other recipe options (the image size was unsaid)
    for t, size in ((a, 96), (b, 64)):
        t.probe["info"] = {"kind": "builtin", "name": "maskrcnn",
                           "options": {"image_size": size, "num_images": 3}}
    said = diff_traces(a, b).message
    assert "  option image_size: 96 -> 64" in said and "num_images" not in said
    assert "audited" not in said


class Energy(nn.Module):
    """Mean square of a 1M-element activation: a reduction split across CPU threads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().mean()


class EnergyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.energy = Energy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.energy(self.conv(x))


def energy_probe(device: torch.device) -> Probe:
    model = EnergyNet().to(device)
    batches = [torch.randn(1, 16, 256, 256) for _ in range(2)]
    return Probe(model=model, batches=batches, step=lambda m, x: m(x),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_thread_count_diff_names_the_module_and_tolerance_passes(
    threads: Callable[[int], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # run folders, as `detaudit diff` reads them: traces streamed, read back lazily
    threads(1)
    one = module_audit(energy_probe, repeats=1, steps=2, out=tmp_path / "one").traces
    threads(2)
    two = module_audit(energy_probe, repeats=1, steps=2, out=tmp_path / "two").traces
    assert isinstance(one[0], TraceFile) and isinstance(two[0], TraceFile)
    held = [diff_traces(one[0].whole(), two[0].whole(), rtol=r) for r in (0, 1e-3, 1e-12)]

    def whole(self: TraceFile) -> None:
        raise AssertionError("the diff loaded a trace whole")

    monkeypatch.setattr(TraceFile, "whole", whole)  # a diff reads them a step at a time
    assert [diff_traces(one, two, rtol=r) for r in (0, 1e-3, 1e-12)] == held
    result = diff_traces(one, two)
    assert result.exit_code == 1
    assert result.env_differences == {"threads": (1, 2)}
    assert result.message.splitlines()[1] == "  threads: 1 -> 2"  # the environment comes first
    # The 1M-element reduction splits by thread count; on CPUs whose conv kernels split by
    # thread count too, the conv is named first instead.
    assert result.origin_module in ("energy", "conv") and result.origin_phase == "forward"
    assert result.first is not None and result.first.module == result.origin_module
    loose = diff_traces(one, two, rtol=1e-3)
    assert loose.ok and loose.tolerance and "within rtol=0.001" in loose.headline
    tight = diff_traces(one, two, rtol=1e-12)
    assert not tight.ok and tight.origin_module == result.origin_module


def test_mixed_fingerprint_algorithms_force_tolerance_mode(conv_baseline: Path) -> None:
    a = load_baseline(conv_baseline).trace
    b = load_baseline(conv_baseline).trace
    b.env["device"], b.env["fingerprint"] = "cuda:0", "wsum2+state-xxh3"
    for t in (a, b):  # record 0 as a scan records a float: no stats
        t.records["norm"][0], t.records["absmax"][0] = None, None
    # Another algorithm for every tensor; RNG states (bytes) are hashed the same way everywhere.
    prints = zip(b.records["fp"], b.records["dtype"])
    b.records["fp"] = [fp if dtype == "bytes" else "0" * 16 for fp, dtype in prints]
    result = diff_traces(a, b)
    assert result.ok and result.tolerance
    assert ("different algorithms (xxh3+wsum2-int+state-xxh3 vs wsum2+state-xxh3)"
            in result.message)
    assert result.message.index("device") < result.message.index("MATCH")
    assert env_differences(a.env, b.env) == {"device": ("cpu", "cuda:0")}
    # what tolerance cannot judge is said, and never counted as agreeing
    unjudged = sum(1 for d, n in zip(b.records["dtype"], b.records["norm"])
                   if d != "bytes" and n is None)
    assert unjudged and result.not_comparable == unjudged
    assert f"{unjudged} differing records not comparable within tolerance" in result.headline
    assert f"on {len(a) - unjudged} records" in result.headline


# same device, or CPU vs CUDA
def test_a_run_that_failed_before_its_first_step_differs_in_no_environment_setting() -> None:
    """A repeat that failed before its first step captured no environment: it is not
    "the environment differs" in every setting (the report listed them all)."""
    from detaudit.report.summary import _env_differences
    from detaudit.trace import Trace

    captured = {"threads": 2, "torch": "2.5.0"}
    assert env_differences({}, captured) == {}
    assert env_differences({**captured, "threads": 4}, captured) == {"threads": (4, 2)}
    traces = [Trace(probe={}, repeat=r, env=env)
              for r, env in enumerate([captured, {}, {**captured, "threads": 4}])]
    assert _env_differences(traces[:2]) == {}
    assert _env_differences(traces) == {"threads": [2, None, 4]}


@pytest.mark.parametrize("b_scheme", ["xxh3+wsum2-int+state-xxh3", "wsum2+state-xxh3"])
def test_tolerance_never_excuses_a_changed_integer_record(conv_baseline: Path, b_scheme) -> None:
    a = load_baseline(conv_baseline).trace
    b = load_baseline(conv_baseline).trace
    b.env["fingerprint"] = b_scheme  # integers are printed by wsum2 in both schemes
    for t in (a, b):  # record 0 as an integer tensor (e.g. the batch's labels): no stats
        t.records["dtype"][0], t.records["norm"][0], t.records["absmax"][0] = "int64", None, None
    b.records["fp"][0] = "f" * 16
    result = diff_traces(a, b, rtol=1e-3)
    assert not result.ok and result.first is not None and result.first.slot == a.records["slot"][0]


def test_a_baseline_whose_batch_integers_were_printed_by_wsum_says_they_are_not_compared(
        conv_baseline: Path) -> None:
    """Before the batch as loaded was printed by xxh3, its integers were printed by wsum: a
    baseline of then against a run of now cannot compare them, and says so (as for any
    record printed by two algorithms), never counting them as agreeing."""
    a = load_baseline(conv_baseline).trace
    b = load_baseline(conv_baseline).trace
    b.env["fingerprint"] = "xxh3+wsum2-int"
    for t in (a, b):
        t.records["dtype"][0], t.records["norm"][0], t.records["absmax"][0] = "int64", None, None
    b.records["fp"][0] = "f" * 16  # the same labels, printed by the other algorithm
    result = diff_traces(a, b)
    assert result.tolerance and result.not_comparable == 1
    assert "1 differing records not comparable within tolerance" in result.headline
    assert "different algorithms (xxh3+wsum2-int+state-xxh3 vs xxh3+wsum2-int)" in result.message


def test_junit_xml_parses_and_holds_the_failure(
    conv_baseline: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(Act, "forward", lambda self, x: torch.relu(x) * (1 + 2**-20))
    gate = check_conv(conv_baseline)
    failed = junit_case("conv", "detaudit", 1.5, gate.ok, gate.headline, gate.message)
    cases = [failed, JUnitCase("ok <&>", "detaudit", 0.25, None, "\x1b[1mfine\x1b[0m")]
    root = ET.parse(write_junit(tmp_path / "junit.xml", cases)).getroot()
    suite = root.find("testsuite")
    assert root.tag == "testsuites" and suite is not None
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")
    first, second = suite.findall("testcase")
    failure = first.find("failure")
    assert failure is not None and "MISMATCH" in failure.get("message", "")
    assert "origin: act (forward)" in (failure.text or "")
    assert second.get("name") == "ok <&>" and second.find("failure") is None
    assert ET.fromstring(junit_xml([]).encode()).get("tests") == "0"


def test_bad_baselines_are_one_clear_error(conv_baseline: Path, tmp_path: Path) -> None:
    data = json.loads(conv_baseline.read_text())
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(TraceError, match=r"wrong\.json.*version 99"):
        load_baseline(wrong)
    bad = tmp_path / "bad.json"
    bad.write_text(conv_baseline.read_text()[:100])
    with pytest.raises(TraceError, match=r"bad\.json is truncated or corrupt"):
        load_baseline(bad)
    with pytest.raises(TraceError, match=r"missing\.json"):
        load_baseline(tmp_path / "missing.json")
    other = tmp_path / "trace.json"
    other.write_text(json.dumps(data["trace"]))
    with pytest.raises(TraceError, match=r"trace\.json is a detaudit trace file, not a "
                       r"detaudit baseline file"):
        load_baseline(other)
    # a run folder's trace, streamed as runs write them (it was "truncated or corrupt")
    api.audit(conv_probe, repeats=1, epochs=1, steps=1, stress=0, out=tmp_path / "run")
    streamed = tmp_path / "run" / "trace-0.json.gz"
    with pytest.raises(TraceError, match=r"trace-0\.json\.gz is a run's trace, not a baseline"):
        load_baseline(streamed)
    # the run folder, or its run.json (it was "Is a directory", "not a detaudit baseline")
    for given in (tmp_path / "run", tmp_path / "run" / "run.json"):
        with pytest.raises(TraceError, match=r"is a run folder, not a baseline: .*detaudit "
                           r"diff A B"):
            load_baseline(given)


def test_gzip_baseline(tmp_path: Path) -> None:
    result = module_audit(conv_probe, repeats=1, steps=1)
    path = store_baseline(tmp_path / "b.json.gz", result)
    assert gzip.decompress(path.read_bytes()).startswith(b"{")
    assert check_conv(path).ok


def test_assert_deterministic_passes_on_a_deterministic_probe(
    detaudit_check: Callable[..., Any],
) -> None:
    result = detaudit_check(conv_probe, steps=1)
    assert result.deterministic


def test_assert_deterministic_fails_on_duplicate_index_gather(
    detaudit_check: Callable[..., Any], threads: Callable[[int], None]
) -> None:
    threads(2)
    with pytest.raises(AssertionError) as info:
        detaudit_check(gather_probe, repeats=3)
    message = str(info.value)
    # a divergence between the repeats, or (when the race did not fire) its proof by re-execution
    assert message.lstrip().startswith(("DIVERGENT", "NONDETERMINISTIC OP: aten.index_put in gather"))
    assert "gather" in message and "backward" in message


class _HiddenRace(nn.Module):
    """Sums 40,000 values into 4 cells with index_put_(accumulate=True) (a race on 2+
    threads) and lets nothing of the sum reach its output: its records never differ."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.register_buffer("cells", torch.arange(40_000) % 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros(4).index_put_((self.cells,), x.detach().flatten().repeat(
            40_000 // x.numel()), accumulate=True)
        return self.linear(x) + (sums.isnan().any() * 0.0)


def _hidden_race_probe(device: torch.device) -> Probe:
    torch.manual_seed(0)
    model = _HiddenRace().to(device)
    g = torch.Generator().manual_seed(0)
    return Probe(model=model, batches=[torch.randn(8, 4, generator=g)],
                 step=lambda m, x: m(x.to(device)).pow(2).mean(),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_check_whose_new_run_is_proven_nondeterministic_is_no_match(tmp_path, threads):
    """Repeat 0 matches the baseline bitwise while re-execution proves an op racing: that
    match is chance, and a bitwise gate does not pass it (exit 1, said why); within a
    tolerance it is a note."""
    threads(2)
    options = {"repeats": 1, "epochs": 1, "steps": 1}
    path = store_baseline(tmp_path / "race.json", module_audit(_hidden_race_probe, **options))
    result = api.check(path, factory=_hidden_race_probe)
    assert result.audit.comparison.proven and result.gate.first is None
    assert "note: proven by re-execution in this run: aten.index_put_ in (model)" in (
        result.gate.message)
    assert result.gate.exit_code == 1
    assert result.gate.headline.startswith(
        "MISMATCH: the new run is not deterministic by itself (re-execution proved "
        "aten.index_put_ in (model) nondeterministic); now agrees with baseline bitwise")
    within = api.check(path, factory=_hidden_race_probe, rtol=1e-3, atol=1e-6)
    assert within.audit.comparison.proven and "by itself" in within.gate.message
    assert within.gate.exit_code == 0 and within.gate.headline.startswith("MATCH")


def test_diff_notes_a_fault_planted_in_a_repeat_it_does_not_compare(tmp_path: Path) -> None:
    """A run that planted its fault in its last repeat matches a clean one on repeat 0, which
    diff compares: said, beside the configuration that differs."""
    from detaudit.config import Fault

    options: dict[str, Any] = {"epochs": 1, "steps": 2, "stress": 0}
    api.audit(conv_probe, repeats=1, out=tmp_path / "clean", **options)
    api.audit(conv_probe, repeats=2, fault=Fault("act", step=1), out=tmp_path / "planted",
              **options)
    gate = api.diff(tmp_path / "clean", tmp_path / "planted")
    assert gate.exit_code == 0
    assert (f"note: {tmp_path / 'planted'} planted its fault in its last repeat; diff "
            "compares repeat 0 of each run, where none was planted") in gate.message
    assert "planted its fault" not in api.diff(tmp_path / "clean", tmp_path / "clean").message


def test_runs_recorded_at_different_granularities_compare_the_records_both_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scan and a module-level run of the same code match on the step state both kept; the
    module calls only one recorded are counted apart, never as differences."""
    options: dict[str, Any] = {"repeats": 1, "epochs": 2, "steps": 2, "stress": 0}
    api.audit(conv_probe, granularity="scan", out=tmp_path / "scan", **options)
    module_audit(conv_probe, out=tmp_path / "module", **options)
    gate = api.diff(tmp_path / "scan", tmp_path / "module")
    assert gate.exit_code == 0, gate.message
    only_module = gate.finer_only[1]
    assert gate.finer_only[0] == 0 and only_module > 0
    assert f"on {gate.total_records} records over 4 steps" in gate.headline
    assert (f"not compared: {only_module} records only {tmp_path / 'module'} recorded"
            in gate.message)
    assert api.diff(tmp_path / "module", tmp_path / "scan").exit_code == 0
    module_audit(conv_probe, out=tmp_path / "shorter", **{**options, "epochs": 1})
    shorter = api.diff(tmp_path / "scan", tmp_path / "shorter")  # its step state is missing
    assert shorter.exit_code == 1 and shorter.first is not None and shorter.first.step == 2
    monkeypatch.setattr(Act, "forward", lambda self, x: torch.relu(x) * (1 + 2**-20))
    module_audit(conv_probe, out=tmp_path / "changed", **options)
    changed = api.diff(tmp_path / "scan", tmp_path / "changed")
    assert changed.exit_code == 1 and changed.first is not None and not changed.first.missing


def test_a_baseline_checks_out_in_another_folder_with_its_probe_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CI flow: baseline and probe committed together, checked in a fresh checkout."""
    import shutil

    from detaudit.cli import main
    from detaudit.config import AuditConfig
    from detaudit.drivers.loading import file_spec

    recorded, checkout = tmp_path / "recorded", tmp_path / "checkout"
    for folder in (recorded, checkout):
        (folder / "baselines").mkdir(parents=True)
        shutil.copy(Path(__file__).parent / "probe_files" / "tiny_cnn.py", folder)
    spec = file_spec(str(recorded / "tiny_cnn.py"))
    config = AuditConfig(repeats=1, epochs=1, steps=2, stress=0)
    made = api.baseline(spec, config, recorded / "baselines" / "tiny.json",
                        out=tmp_path / "baseline-run")
    assert json.loads(made.path.read_text())["probe"]["source"] == "../tiny_cnn.py"
    shutil.copy(made.path, checkout / "baselines")
    shutil.rmtree(recorded)
    monkeypatch.chdir(checkout)
    capsys.readouterr()
    assert main(["check", "baselines/tiny.json", "--out", str(tmp_path / "check"),
                 "--junit", str(tmp_path / "match.xml")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("MATCH") and f"probe file {checkout / 'tiny_cnn.py'}" in err
    assert out.rstrip().endswith(f"report folder: {tmp_path / 'check'}")  # (a mismatch's only)
    (checkout / "tiny_cnn.py").unlink()
    assert main(["check", "baselines/tiny.json", "--out", str(tmp_path / "again"),
                 "--junit", str(tmp_path / "error.xml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tiny_cnn.py, which does not exist" in err
    # one test case, whatever the outcome (the error's was named "check", the match's "tiny")
    names = [ET.parse(tmp_path / f"{kind}.xml").getroot().find("testsuite/testcase").get("name")
             for kind in ("match", "error")]
    assert names == ["tiny", "tiny"], names


NOT_REPEATABLE = '''
import torch
from torch import nn

import detaudit

built = []  # global state the repeats of one process share


def probe(device):
    built.append(1)
    model = nn.Linear(4, 2).to(device)
    with torch.no_grad():
        model.bias.add_(len(built))
    batches = [(torch.ones(3, 4), torch.zeros(3, 2))]
    return detaudit.Probe(model=model, batches=batches,
                          step=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
'''


def test_baseline_honours_its_options_or_refuses_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--repeats and --stress are recorded and reported, --json is JSON, and what a baseline
    cannot keep (a planted fault, --verify-fix) is one line, exit 2, and not in its help."""
    from detaudit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "drifts.py").write_text(NOT_REPEATABLE)
    common = ["baseline", "--probe", "drifts.py", "--epochs", "1", "--steps", "1"]
    assert main([*common, "--repeats", "2", "--stress", "0", "--out", "b.json", "--json"]) == 0
    out, err = capsys.readouterr()
    made = json.loads(out)
    assert (made["path"], made["steps"]) == ("b.json", 1) and made["records"] > 0
    assert made["warnings"] and "the baseline's own 2 repeats differ from step 0" in err
    assert load_baseline(tmp_path / "b.json").config.repeats == 2
    for refused, said in ((["--inject-fault", "head:0"], "planted fault"),
                          (["--verify-fix"], "--verify-fix")):
        assert main([*common, *refused, "--out", "refused.json"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err
        assert not (tmp_path / "refused.json").exists()
    with pytest.raises(SystemExit):  # and its help lists neither
        main(["baseline", "--help"])
    shown = capsys.readouterr().out
    assert "--inject-fault" not in shown and "--verify-fix" not in shown
    assert "--zoom-tries" not in shown and "(default: 1)" in shown


def test_a_check_of_a_baseline_that_stores_a_planted_fault_says_so(tmp_path: Path) -> None:
    """Baselines recorded before `baseline` refused --inject-fault plant it again in every
    check, which then matches: the check says so."""
    from detaudit.config import Fault

    planted = module_audit(conv_probe, repeats=1, steps=1, stress=0, fault=Fault.parse("act:0"))
    gate = check_conv(store_baseline(tmp_path / "planted.json", planted))
    assert gate.ok and "note: this baseline stores a planted fault" in gate.message
    clean = module_audit(conv_probe, repeats=1, steps=1, stress=0)
    assert "planted fault" not in check_conv(store_baseline(tmp_path / "clean.json", clean)).message


def test_a_baseline_recorded_before_buffers_were_recorded_still_matches(tmp_path):
    """A trace of record set 1 (no buffers, no plain output values) against a new one of
    the same training: MATCH, the buffers said to be recorded by one run alone (every CI
    gate with an older baseline turned red)."""
    import detaudit
    from detaudit.trace import PROBE_RECORD_SET, Trace

    def train():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with detaudit.watch(model, opt, out=tmp_path) as w:
            for _ in range(3):
                model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).sum().backward()
                opt.step()
                opt.zero_grad()
        return w.trace

    old, new = train(), train()
    assert any(slot.startswith("buffer.") for slot in new.records["slot"])
    keep = [i for i, slot in enumerate(old.records["slot"]) if not slot.startswith("buffer.")]
    old = Trace(probe={k: v for k, v in old.probe.items() if k != PROBE_RECORD_SET},
                repeat=0, env=old.env, steps=old.steps,
                records={c: [col[i] for i in keep] for c, col in old.records.items()})
    result = diff_traces(old, new)
    assert result.exit_code == 0, result.message
    assert result.finer_only[1] > 0 and "an older A did not record" in result.message
    new_too = Trace(probe=new.probe, repeat=0, env=old.env, steps=old.steps,
                    records=old.records)  # a new trace lacking them differs
    assert diff_traces(new_too, new).exit_code == 1


def test_an_op_level_baseline_recorded_before_op_arguments_were_recorded_still_matches():
    """A trace of record set 2 recorded op by op has no plain op arguments: compared with a
    new one of the same training it matches, those records left out as the older run's."""
    from conftest import small_cnn_probe

    from detaudit import audit
    from detaudit.trace import PROBE_RECORD_SET, Trace

    old, new = (audit(small_cnn_probe, repeats=1, epochs=1, steps=1, granularity="op",
                      drill_down=False).traces[0] for _ in range(2))
    assert any(slot.endswith("/in.args") for slot in new.records["slot"])
    keep = [i for i, slot in enumerate(old.records["slot"]) if not slot.endswith("/in.args")]
    old = Trace(probe={**old.probe, PROBE_RECORD_SET: 2}, repeat=0, env=old.env,
                steps=old.steps, records={c: [col[i] for i in keep] for c, col in old.records.items()})
    result = diff_traces(old, new)
    assert result.exit_code == 0, result.message
