"""Scan, then zoom: step state only on every step, module and op level at the first step
where the runs part, with the same findings as recording every module on every step."""

from __future__ import annotations

import json
import math
from typing import Callable

import pytest
import torch
from conftest import gather_probe, small_cnn_probe, unseeded_probe
from torch import nn

from detaudit import Fault, Probe, api, audit
from detaudit.record.recorder import Recorder

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

PLANTED = [
    Fault("head", "backward", 2),
    # (rounds away in block1's sum on 2 threads, whose order of summing it is: no loss or
    # gradient differs)
    Fault("stem", "forward", 2),
    Fault("stem", "backward", 2, op="aten.convolution"),
]


def _scan(probe, **kwargs):
    return audit(probe, granularity="scan", drill_down=True, **kwargs)


@pytest.mark.parametrize("fault", PLANTED, ids=lambda f: f"{f.module}/{f.op}@{f.phase}")
def test_scan_and_zoom_name_what_full_recording_names(fault, two_threads):
    full = audit(small_cnn_probe, repeats=2, steps=4, fault=fault, granularity="module")
    scan = _scan(small_cnn_probe, repeats=2, steps=4, fault=fault)
    want = full.verdict.first
    got = scan.verdict.first
    assert (got["step"], got["phase"], got["module"], got["role"]) == (
        want["step"], want["phase"], want["module"], want["role"]) == (
        2, fault.phase, fault.module, "origin")
    assert scan.investigations["zoom"]["status"] == "found"
    assert scan.investigations["zoom"]["step"] == 2
    if fault.op:
        op = scan.investigations["ops"]["ops"][0]
        assert (op["module"], op["role"]) == (fault.module, "origin")
        assert op["op"] == full.investigations["ops"]["ops"][0]["op"] == "aten.convolution_backward"
        assert f"op: aten.convolution_backward in {fault.module}" in scan.verdict.headline
    assert "zoomed in on step 2 after a scan" in scan.verdict.headline
    assert "a scanned step" not in scan.summary["cause"]["text"]  # the zoom recorded modules
    # a difference that no loss, gradient or parameter shows is said to leave them alone
    rounded = fault.phase == "forward"
    assert full.comparison.param_drift_step == (None if rounded else 2)
    for verdict in (scan.verdict, full.verdict):
        said = "; the training stayed bit-identical: no loss, gradient or parameter differs"
        assert (said in verdict.headline) == rounded, verdict.headline


def test_a_scan_records_step_state_only_and_few_records():
    scan = _scan(small_cnn_probe, repeats=2, steps=4).traces[0]
    full = audit(small_cnn_probe, repeats=2, steps=4, granularity="module").traces[0]
    phases = set(scan.records["phase"])
    assert phases == {"state", "output", "grad", "optimizer"}
    assert not scan.calls["step"]  # no module calls at scanned steps
    assert len(scan) < len(full) / 2
    # optimizer state once, at the epoch's end; parameters after every update
    momentum = [s for s, slot in zip(scan.records["step"], scan.records["slot"])
                if slot.startswith("state.")]
    assert momentum and set(momentum) == {3}


def test_no_false_alarm_over_five_repeats_and_two_epochs():
    result = _scan(small_cnn_probe, repeats=5, epochs=2, steps=4)
    assert result.deterministic and result.verdict.kind == "deterministic"
    assert "zoom" not in result.investigations


def test_scanning_perturbs_nothing():
    """Losses and parameters with scan recording equal those of a plain loop, bit for bit."""
    def plain():
        torch.manual_seed(0)
        probe = small_cnn_probe(torch.device("cpu"))
        losses = []
        for batch in probe.batches:
            loss = probe.step(probe.model, batch)["mse"]
            loss.backward()
            probe.optimizer.step()
            probe.optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()).hex())
        return losses, [p.detach().clone() for p in probe.model.parameters()]

    losses, params = plain()
    result = _scan(small_cnn_probe, repeats=1, steps=4, seed=0)
    assert [s.losses["mse"] for s in result.traces[0].steps] == losses
    torch.manual_seed(0)
    probe = small_cnn_probe(torch.device("cpu"))
    with Recorder(probe.model, watch="none") as recorder:
        for step, batch in enumerate(probe.batches):
            recorder.begin_step(step)
            recorder.record_state(batch)
            loss = probe.step(probe.model, batch)["mse"]
            loss.backward()
            recorder.record_param_grads()
            probe.optimizer.step()
            probe.optimizer.zero_grad(set_to_none=True)
            recorder.record_parameters("optimizer")
            recorder.end_step()
    assert all(torch.equal(a, b) for a, b in zip(params, probe.model.parameters()))


def test_cause_from_the_scan_alone_data():
    result = _scan(unseeded_probe, repeats=2)
    assert (result.comparison.first_step, result.comparison.cause) == (0, "data")
    assert "zoom" not in result.investigations  # the step state already says it


_BUILT = {"optimizers": 0}


class NudgingSGD(torch.optim.SGD):
    """SGD whose second instance moves one weight one ULP further at step 1: the gradients
    agree, the parameters after the update do not."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        _BUILT["optimizers"] += 1
        self.nudge, self.steps = _BUILT["optimizers"] == 2, 0

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        self.steps += 1
        if self.nudge and self.steps == 2:
            w = self.param_groups[0]["params"][0].view(-1)
            w[0] = torch.nextafter(w[0], torch.tensor(math.inf))


def test_cause_from_the_scan_alone_optimizer():
    def probe(device):
        model = nn.Linear(8, 2)
        g = torch.Generator().manual_seed(0)
        return Probe(model=model, batches=[torch.randn(4, 8, generator=g) for _ in range(3)],
                     step=lambda m, b: m(b).pow(2).mean(),
                     optimizer=NudgingSGD(model.parameters(), lr=0.1))

    _BUILT["optimizers"] = 0
    result = _scan(probe, repeats=2, steps=3)
    c = result.comparison
    assert (c.first_step, c.cause) == (1, "optimizer")
    assert {d.phase for d in c.first_diffs} == {"optimizer"}  # gradients equal at step 1


_DRAWS = {"calls": 0}


class LeakySampler(nn.Module):
    """Draws a number of random values that depends on state left from earlier repeats."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _DRAWS["calls"] += 1
        torch.rand(int((x > 0).sum()) + _DRAWS["calls"] % 2)
        return x


def test_cause_rng_is_found_by_the_zoom():
    def probe(device):
        model = nn.Sequential(nn.Linear(8, 8), LeakySampler(), nn.Dropout(0.5), nn.Linear(8, 2))
        g = torch.Generator().manual_seed(0)
        data = [torch.randn(4, 8, generator=g) for _ in range(3)]
        return Probe(model=model, batches=data, step=lambda m, b: m(b).pow(2).mean(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    _DRAWS["calls"] = 0
    result = _scan(probe, repeats=2)
    assert result.comparison.first_step == 0
    assert result.summary["cause"]["kind"] == "rng"
    assert result.verdict.first["module"] == "1" and result.verdict.first["phase"] == "forward"


@pytest.mark.alone  # a real race must fire
def test_a_real_race_ends_with_its_origin_or_an_honest_intermittent(two_threads):
    result = _scan(gather_probe, repeats=3)
    if result.comparison.first_step is None:
        pytest.skip("the race did not fire in any repeat this time")
    zoom = result.investigations["zoom"]
    assert zoom["status"] in ("found", "intermittent")
    if zoom["status"] == "found":
        assert (result.verdict.first["module"], result.verdict.first["phase"]) == (
            "gather", "backward")
        assert result.investigations["ops"]["ops"][0]["op"] == "aten.index_put"
    else:
        assert len(zoom["attempts"]) == 3 and "zoomed" not in result.verdict.headline
        assert "did not part when replayed" in result.verdict.headline


_RUNS = {"built": 0}


def _built_probe(change):
    """A probe whose step's loss is `change(built, step, loss)`: `built` counts the probes
    built before it and itself (the scan's repeats first, then the replays)."""
    def probe(device):
        _RUNS["built"] += 1
        built, base = _RUNS["built"], small_cnn_probe(device)

        def step(model, batch):
            loss = change(built, step.calls, base.step(model, batch)["mse"])
            step.calls += 1
            return {"mse": loss}

        step.calls = 0
        return Probe(model=base.model, batches=base.batches, step=step, optimizer=base.optimizer)

    return probe


def _parts_at(step_of_build):
    """A probe whose repeats part at a step that depends on how many were built before."""
    return _built_probe(lambda built, step, loss: loss * (1 + 2**-20)
                        if step == step_of_build(built) else loss)


def test_a_replay_that_parts_earlier_moves_the_zoom_there():
    # the scanned runs part at step 3; every replay's second repeat parts at step 1
    _RUNS["built"] = 0
    result = _scan(_parts_at(lambda n: {2: 3}.get(n, 1 if n % 2 == 0 else -1)), repeats=2,
                   steps=4)
    zoom = result.investigations["zoom"]
    assert result.comparison.first_step == 3
    assert zoom["status"] == "found" and zoom["step"] == 1
    assert zoom["attempts"][0]["outcome"].startswith("parted earlier, at step 1")
    # the headline's step (the zoom's) and the scan's loss curves are told apart
    assert result.verdict.headline.endswith(
        "zoomed in on step 1 after a scan, where a replay parted first (the runs first parted "
        "at step 3: a race fires at different steps; the loss and step lines below are those of "
        "the first runs)")


def test_a_step_that_never_parts_again_is_intermittent():
    _RUNS["built"] = 0
    result = _scan(_parts_at(lambda n: 2 if n == 2 else -1), repeats=2, steps=4)
    zoom = result.investigations["zoom"]
    assert result.comparison.first_step == 2 and zoom["status"] == "intermittent"
    assert [a["outcome"] for a in zoom["attempts"]] == ["did not part this time"] * 3
    assert result.verdict.kind == "divergent"  # the scan's finding stands, and says so
    assert ("intermittent: step 2 did not part when replayed (3 tries), so the module and op "
            "are not named (the cause is the scan's)") in result.verdict.headline
    assert result.summary["headline"] == result.verdict.headline  # the reports say it too
    # the scan's loss alone cannot tell a forward op from the step function's own code
    assert "unconfirmed from the step's state alone" in result.summary["cause"]["text"]


def test_a_zoom_whose_replay_fails_says_so_not_that_the_step_did_not_part():
    """A replay that fails (the module-level recording broke the user's step, as a print
    once broke FSDP's) concludes nothing: the verdict gives its error, and the scan's
    finding stands; it is not a step that "did not part when replayed"."""
    _RUNS["built"] = 0

    def change(built, step, loss):
        if step == 2 and built == 2:  # the scan's second repeat parts at step 2
            return loss * (1 + 2**-20)
        if step == 2 and built > 2:  # every replay fails there
            raise RuntimeError("Trying to resize storage that is not resizable")
        return loss

    probe = _built_probe(change)
    result = _scan(probe, repeats=2, steps=4)
    zoom = result.investigations["zoom"]
    assert result.comparison.first_step == 2
    assert (zoom["status"], zoom["step"], len(zoom["attempts"])) == ("replay failed", 2, 1)
    assert result.verdict.kind == "divergent"
    assert "the zoom's replay of step 2 failed (RuntimeError in step 2" in result.verdict.headline
    assert "Trying to resize storage that is not resizable" in result.verdict.headline
    assert "did not part" not in result.verdict.headline


def test_a_replay_that_parts_earlier_and_then_fails_moves_the_zoom_there():
    """Where the replay parted comes before its failure: the zoom moves to that step."""
    _RUNS["built"] = 0

    def change(built, step, loss):
        if built == 4 and step == 2:  # a replay fails after it parted
            raise RuntimeError("loss spiked")
        if (step == 3 and built == 2) or (step == 1 and built == 4):
            return loss * (1 + 2**-20)  # the scan parts at step 3, a replay at step 1
        return loss

    probe = _built_probe(change)
    result = _scan(probe, repeats=2, steps=5)
    zoom = result.investigations["zoom"]
    assert result.comparison.first_step == 3
    assert zoom["attempts"][0]["outcome"].startswith("parted earlier, at step 1")
    assert zoom["step"] == 1 and "failed" not in result.verdict.headline


@pytest.mark.parametrize(("parted", "said"), [
    # the scanned runs part at step 3, the first replay at step 2, the second at step 0; the
    # one replay of step 0 that is left agrees
    ({2: 3, 4: 2, 6: 0}, ("replays parted earlier, at step 2, then step 0 (the runs do differ "
                          "from run to run); step 0 did not part when replayed (1 try)")),
    # every replay parts earlier: none is left for the step they reached
    ({2: 3, 4: 2, 6: 1, 8: 0}, ("replays parted earlier, at step 2, then step 1, then step 0 (the "
                                "runs do differ from run to run); the tries ran out before step 0 "
                                "was replayed")),
])
def test_an_intermittent_zoom_says_where_its_replays_parted_earlier(parted, said):
    _RUNS["built"] = 0
    result = _scan(_parts_at(lambda n: parted.get(n, -1)), repeats=2, steps=4)
    zoom = result.investigations["zoom"]
    assert result.comparison.first_step == 3
    assert (zoom["status"], zoom["step"]) == ("intermittent", 0)
    assert result.verdict.headline.endswith(
        f"intermittent: {said}, so the module and op are not named (the cause is the scan's)")


def _stray_draw(draws_in: Callable[[int], bool]):
    """A probe whose step function draws from the torch RNG, outside any module, before the
    model (which has a dropout) runs at its second step, in the builds `draws_in` picks."""
    def probe(device):
        _RUNS["built"] += 1
        draws = draws_in(_RUNS["built"])
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
        g = torch.Generator().manual_seed(0)
        data = [torch.randn(4, 8, generator=g) for _ in range(3)]

        def step(model, x):
            step.calls += 1
            if step.calls == 2 and draws:
                torch.rand(1)
            return model(x).pow(2).mean()

        step.calls = 0
        return Probe(model=model, batches=data, step=step,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    return probe


def test_a_stray_draw_outside_any_module_is_found_there_after_a_scan_too():
    results = []
    for granularity in ("module", "scan"):
        _RUNS["built"] = 0  # every second build draws, in the runs and in the replays
        results.append(audit(_stray_draw(lambda n: n % 2 == 0), repeats=2,
                             granularity=granularity))
    assert results[1].investigations["zoom"]["status"] == "found"  # the scan's
    for result in results:
        assert result.summary["cause"]["kind"] == "rng"
        assert result.verdict.first["outside"] == (
            "outside any module, between the start of step 1 and (model)")


def test_a_stray_draw_the_zoom_cannot_replay_is_an_rng_cause_never_a_forward_one():
    _RUNS["built"] = 0  # only the second build draws: the replays never part
    result = _scan(_stray_draw(lambda n: n == 2), repeats=2)
    assert result.investigations["zoom"]["status"] == "intermittent"
    assert "cause: rng; intermittent" in result.verdict.headline
    cause = result.summary["cause"]
    assert cause["kind"] == "rng"
    assert ("step 1 began alike in every repeat, yet the torch RNG state differs as the next "
            "step begins: the step reseeded it from a source that differs between runs "
            "(torch.seed(), a seed from the clock or the process id) or drew a different amount "
            "of randomness") in cause["text"]


def test_a_zoomed_run_folder_renders_the_same_again(tmp_path):
    first = _scan(small_cnn_probe, repeats=2, steps=4, fault=PLANTED[0], out=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("zoom-*")) == ["zoom-0.json.gz", "zoom-1.json.gz"]
    again = api.render_folder(tmp_path)
    assert again == first.summary
    assert again["origins"][0]["module"] == "head"


def test_scan_map_is_the_modules_whose_parameter_gradients_differ_by_step():
    """Without a zoom, a scanned run still maps where: the modules whose parameter gradients
    differ, step by step, with the parameters named (here every batch differs: unseeded)."""
    from detaudit.report import render_html, render_markdown

    result = audit(unseeded_probe, repeats=2, granularity="scan", drill_down=False)
    assert result.comparison.cause == "data"
    cells = [(c["step"], c["module"], c["params"]) for c in result.summary["map"]
             if c["role"] == "gradients differ"]
    assert cells == [(step, module, ["weight", "bias"]) for step in range(3) for module in "02"]
    assert "parameter gradients differ at scanned steps" in render_markdown(result.summary)
    assert ">gradients differ</text>" in render_html(result.summary)


def test_module_level_map_has_no_scanned_column():
    from detaudit.report import render_markdown

    result = audit(small_cnn_probe, repeats=2, steps=3, granularity="module",
                   fault=Fault("head", "backward", 1))
    assert result.summary["map"] and all(
        c["role"] != "gradients differ" for c in result.summary["map"])
    assert "(scanned)" not in render_markdown(result.summary)


def test_diff_zoom_replays_two_scanned_runs_and_names_the_module_and_op(tmp_path, capsys):
    """diff of two scan-level runs names the step; --zoom replays both to it and names the
    module and op where they part (B differs from A by a 1-ULP fault in one conv's backward)."""
    from test_cli import PROBES

    from detaudit.cli import main

    def cli(*args: str) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().out

    common = ["--probe", str(PROBES / "tiny_cnn.py"), "--repeats", "1", "--epochs", "2",
              "--steps", "2", "--no-census", "--stress", "0", "--quiet"]
    # one repeat each: recorded for the diff, and not compared (exit 2, never a pass)
    assert cli("run", *common, "--out", str(tmp_path / "a"))[0] == 2
    assert cli("run", *common, "--out", str(tmp_path / "b"),
               "--inject-fault", "2/aten.convolution_backward@backward:2")[0] == 2
    code, plain = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1
    assert "at step 2" in plain and "diff --zoom" in plain
    code, zoomed = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--zoom")
    assert code == 1
    assert ("replayed to step 2: origin 2 (backward); op aten.convolution_backward in 2 "
            "(backward)") in zoomed
    # a run whose probe file changed since: its replay cannot reproduce the step where it
    # parted from A, and that is said, not "the difference did not recur"
    edited = tmp_path / "edited.py"
    source = (PROBES / "tiny_cnn.py").read_text()
    edited.write_text(source.replace("lr=0.1,", "lr=0.2,"))
    common_edited = [str(edited) if c.endswith("tiny_cnn.py") else c for c in common]
    assert cli("run", *common_edited, "--out", str(tmp_path / "c"))[0] == 2
    edited.write_text(source)
    code, changed = cli("diff", str(tmp_path / "a"), str(tmp_path / "c"), "--zoom")
    assert code == 1 and "did not recur" not in changed
    assert "the replay of B does not reproduce what B recorded at step 0: its probe" in changed
    # a run this machine cannot replay (recorded by watch, exec or a Python callable) is said so
    (tmp_path / "b" / "run.json").write_text(
        (tmp_path / "b" / "run.json").read_text().replace('"kind": "file"', '"kind": "command"'))
    code, refused = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--zoom")
    assert code == 1
    assert "zoom (not possible): B was recorded from command" in refused


_SCANNED_ONCE = ["--repeats", "1", "--epochs", "1", "--steps", "2", "--no-census",
                 "--stress", "0", "--quiet"]


def _cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str]]:
    from detaudit.cli import main

    def cli(*args: str) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().out

    return cli


def test_diff_of_runs_no_replay_can_rebuild_does_not_suggest_a_zoom(tmp_path):
    """Two runs recorded by watch (a loop detaudit cannot replay) part at step 0: diff names
    the step and record, and does not suggest --zoom, which could only refuse; it takes the
    folders watch wrote, or their trace files."""
    import detaudit
    from detaudit.analysis.diff import diff_traces

    traces = []
    for name, lr in (("a", 0.1), ("b", 0.2)):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        with detaudit.watch(model, opt, out=tmp_path / name) as w:
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        traces.append(w.trace)
    said = diff_traces(*traces).message
    assert "at step 0" in said and "optimizer" in said
    assert "--zoom" not in said
    # diff takes what watch wrote as it takes run folders: a folder of traces, a trace file
    trace_b = next((tmp_path / "b").glob("trace-*.json.gz"))
    gate = api.diff(tmp_path / "a", trace_b)
    assert gate.exit_code == 1
    assert gate.first is not None and (gate.first.step, gate.first.phase) == (0, "optimizer")
    assert api.diff(tmp_path / "a", tmp_path / "a").exit_code == 0


def test_probe_files_each_import_the_helpers_beside_them(tmp_path, capsys):
    """Two probe folders, each with its own helpers.py (B's scales by 1 + 1e-7): B's run and
    its zoom replay import B's helpers, not those A's brought in (B's run matched A's, and its
    replay then 'did not reproduce' it)."""
    cli = _cli(capsys)
    for name, factor in (("A", "1.0"), ("B", "1.0000001")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "helpers.py").write_text(
            "from torch import nn\n\n\nclass Scale(nn.Module):\n"
            f"    def forward(self, x):\n        return x * {factor}\n")
        (folder / "probe.py").write_text(
            "import torch\nfrom torch import nn\n\nimport detaudit\nfrom helpers import Scale\n"
            "\n\ndef probe(device):\n    torch.manual_seed(0)\n"
            "    model = nn.Sequential(nn.Linear(4, 8), Scale(), nn.Linear(8, 1))\n"
            "    batches = [torch.randn(16, 4) for _ in range(2)]\n"
            "    return detaudit.Probe(model=model, batches=batches,\n"
            "                          step=lambda m, b: m(b).pow(2).mean(),\n"
            "                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))\n")
        assert cli("run", "--probe", str(folder / "probe.py"), *_SCANNED_ONCE,
                   "--out", str(tmp_path / name.lower()))[0] == 2
    code, zoomed = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--zoom")
    assert code == 1 and "MISMATCH" in zoomed
    assert "replayed to step 0: origin 1 (forward)" in zoomed


_TOTAL_PROBE = '''
import torch
from torch import nn

import detaudit


class Total(nn.Module):
    def forward(self, x):
        return x.sum()


def probe(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 1), nn.Flatten(0), Total())
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(1 << 20, 1, generator=g) for _ in range(2)]
    return detaudit.Probe(model=model, batches=batches,
                          step=lambda m, b: m(b) ** 2 * 1e-6,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
'''


def test_diff_zoom_replays_each_run_at_the_thread_count_it_recorded(tmp_path, capsys):
    """A run on 1 thread and one on 2 part where a CPU reduction over a million elements
    splits its work (the bias gradient): each replay runs at its run's thread count, so the
    zoom names that op (the replays reproduced neither run, and blamed their code or data).
    A setting no replay can restore (another torch) is named where a replay does not
    reproduce its run."""
    cli = _cli(capsys)
    probe = tmp_path / "total.py"
    probe.write_text(_TOTAL_PROBE)
    before = torch.get_num_threads()
    try:
        for name, threads in (("a", 1), ("b", 2)):
            torch.set_num_threads(threads)
            assert cli("run", "--probe", str(probe), *_SCANNED_ONCE,
                       "--out", str(tmp_path / name))[0] == 2
    finally:
        torch.set_num_threads(before)
    code, zoomed = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--zoom")
    assert code == 1 and "threads: 1 -> 2" in zoomed
    # the weight's or the bias's gradient, whichever reduction the CPU's kernels split first
    assert any(f"replayed to step 0: origin 0 (backward); op {op} in 0 (backward)" in zoomed
               for op in ("aten.sum", "aten.mm"))
    # B "recorded" by another torch on 1 thread: its replay (at 1 thread) parts from it
    from detaudit.trace import Trace

    trace_path = next((tmp_path / "b").glob("trace-*.json.gz"))
    trace = Trace.load(trace_path)
    trace.env.update(torch="0.0.1", threads=1)
    trace.save(trace_path)
    code, zoomed = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--zoom")
    assert code == 1
    assert "B was recorded in another environment than this machine replays it in " \
           "(torch '0.0.1' -> " in zoomed


def test_runs_that_part_only_between_processes_depend_on_per_process_state(
        tmp_path, capsys, monkeypatch):
    """Loss weights zipped with a set: every repeat in its own process parts from the others,
    replays in one process agree; the zoom replays them as they ran and says what that means."""
    from test_cli import PROBES

    from detaudit.cli import main

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # each process draws its own
    code = main(["run", "--probe", str(PROBES / "set_order_loss_weights.py"), "--isolation",
                 "process", "--repeats", "2", "--epochs", "1", "--steps", "1", "--stress", "0",
                 "--no-census", "--out", str(tmp_path), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == summary.pop("exit_code") == 1
    assert [a["outcome"] for a in summary["zoom"]["attempts"]] == [
        "did not part this time (replayed in this process)",
        "did not part this time (replayed in this process)",  # twice: a race might, once
        "parted again (each repeat replayed in its own process)"]
    assert summary["cause"]["kind"] == "process" and "cause: process" in summary["headline"]
    assert "PYTHONHASHSEED" in summary["cause"]["text"]
    assert "iterate sorted(...) rather than a set" in summary["cause"]["text"]
    assert api.render_folder(tmp_path) == summary  # the zoomed traces keep what they showed


class _Tiny(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e-8


class _Absorbing(nn.Module):
    """`tiny`'s input gradient is 1e-8 of the main path's, with which it is summed: 1 ULP
    planted there rounds away before any parameter gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.tiny, self.head = nn.Linear(4, 4), _Tiny(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(h + self.tiny(h))


def test_a_planted_fault_that_rounding_absorbs_is_still_found_where_it_was_planted():
    def probe(device):
        torch.manual_seed(0)
        model = _Absorbing()
        return Probe(model=model, batches=[torch.randn(8, 4), torch.randn(8, 4)],
                     step=lambda m, b: m(b).pow(2).mean(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    result = _scan(probe, repeats=2, epochs=2, steps=2, stress=0,
                   fault=Fault("tiny", "backward", 2))
    c = result.comparison
    # every repeat records the fault's step at module level: the planted change is seen there
    assert [(o.module, o.phase, o.step) for o in c.origins] == [("tiny", "backward", 2)]
    # ... though nothing the training keeps changed: no loss, gradient or parameter differs
    assert c.loss.first_step is None and c.param_drift_step is None
    assert "the planted fault, found where it was planted" in result.verdict.headline
    # and the headline says so (it read as any divergence)
    assert ("; the training stayed bit-identical: no loss, gradient or parameter differs, in "
            "that step or after (the difference rounded away") in result.verdict.headline


class _AbsorbsInside(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x * 1e-8  # 1 ULP of the small product vanishes in the sum


def test_a_planted_fault_that_changes_nothing_recorded_is_an_error_never_a_pass():
    def probe(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), _AbsorbsInside(), nn.Linear(4, 1))
        return Probe(model=model, batches=[torch.randn(8, 4), torch.randn(8, 4)],
                     step=lambda m, b: m(b).pow(2).mean(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    with pytest.raises(api.DetauditError, match="fired .op aten.mul in 1, forward, step 2. but "
                       "no recorded value differs"):
        _scan(probe, repeats=2, epochs=2, steps=2, stress=0,
              fault=Fault("1", "forward", 2, op="aten.mul"))


def test_a_long_divergence_keeps_its_first_steps_in_detail_and_counts_the_rest(monkeypatch):
    import copy

    from detaudit.analysis import compare as compare_module

    traces = audit(small_cnn_probe, repeats=2, epochs=2, steps=4, granularity="module",
                   drill_down=False).traces
    parted = copy.deepcopy(traces[1])  # head's output differs from step 1 to the end
    r = parted.records
    for i, (step, phase, module, slot) in enumerate(zip(r["step"], r["phase"], r["module"], r["slot"])):
        if step >= 1 and phase == "forward" and module == "head" and slot.startswith("out"):
            r["fp"][i] = "0" * 16
    whole = compare_module.compare([traces[0], parted])
    monkeypatch.setattr(compare_module, "DETAIL_STEPS", 3)
    windowed = compare_module.compare([traces[0], parted])
    assert whole.detailed_steps is None and windowed.detailed_steps == 3
    assert windowed.first_step == whole.first_step == 1
    assert [(f.step, f.phase, f.module, f.role) for f in windowed.origins] == [
        (1, "forward", "head", "origin")]
    assert windowed.cause == whole.cause == "forward"
    assert windowed.first_diffs == whole.first_diffs
    # the first 3 divergent steps in detail, every later one still counted
    assert {f.step for f in whole.findings} == set(range(1, 8))
    assert windowed.findings == [f for f in whole.findings if f.step <= 3]
    assert windowed.differing_by_step == whole.differing_by_step
    assert list(windowed.differing_by_step) == list(range(1, 8))
    assert windowed.differing_records == whole.differing_records


@pytest.mark.parametrize("fault", PLANTED[:2], ids=lambda f: f"{f.module}@{f.phase}")
def test_a_planted_module_fault_adds_no_ops_to_the_zoomed_step(fault, tmp_path):
    """The hook that plants a module fault runs tensor ops of its own: they are not the
    model's, so the faulted repeat's op records line up with the others'."""
    from detaudit.trace import OP_PHASES, open_trace

    result = _scan(small_cnn_probe, repeats=2, steps=4, fault=fault, out=tmp_path)
    assert result.investigations["zoom"]["status"] == "found"
    ops = []
    for path in sorted(tmp_path.glob("zoom-*.json.gz")):
        r = open_trace(path).records
        ops.append([(m, c, s) for st, p, m, c, s in zip(
            r["step"], r["phase"], r["module"], r["call"], r["slot"])
            if st == 2 and p in OP_PHASES])
    assert len(ops) == 2 and ops[0] and ops[0] == ops[1]
