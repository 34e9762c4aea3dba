"""Verdicts a CI gate can trust: exit codes, crashes, interruptions, run-folder integrity,
outputs checked before the work, JSON and console output that stay clean."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from conftest import small_cnn_probe

from detaudit import Probe, api, audit
from detaudit.cli import main
from detaudit.config import AuditConfig, Fault
from detaudit.errors import DetauditError, TraceError
from detaudit.planting import check_op_known
from detaudit.runfolder import LOCK_FILE, RunFolder, RunInfo, load_run, new_folder
from detaudit.seeding import seed_everything
from detaudit.trace import open_trace

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

PROBES = Path(__file__).parent / "probe_files"


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detaudit", *args], capture_output=True,
                          text=True, timeout=300, check=False, **kwargs)


def _probe_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "user_probe.py"
    path.write_text("import sys\nimport torch\nimport detaudit\n\n" + body)
    return path


# -- exit codes -----------------------------------------------------------------------------
def test_sys_exit_in_a_step_is_a_crash_not_a_pass(tmp_path, capsys):
    code = main(["run", "--probe", str(PROBES / "exits_in_step.py"), "--out", str(tmp_path),
                 "--no-census", "--quiet"])
    out = capsys.readouterr().out
    assert code == 3
    assert out.startswith("FAILED: repeat 0 stopped: the audited code called sys.exit(0) "
                          "in step 1 at ") and "exits_in_step.py:16" in out
    assert main(["report", str(tmp_path)]) == 3  # the folder holds the verdict


def test_sys_exit_while_building_the_probe_is_a_crash(tmp_path, capsys):
    probe = _probe_file(tmp_path, "def probe(device):\n    sys.exit(0)\n")
    assert main(["run", "--probe", str(probe), "--out", str(tmp_path / "run")]) == 3
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "sys.exit(0)" in err and "user_probe.py:6" in err


def test_a_run_that_ends_before_its_verdict_still_gives_json_and_junit(tmp_path):
    """A crash at the first step leaves nothing to compare (exit 3, no summary): --json
    still prints an object, and --junit still writes an error case (both were missing)."""
    probe = _probe_file(tmp_path, "def probe(device):\n"
                        "    model = torch.nn.Linear(4, 1)\n"
                        "    return detaudit.Probe(model=model, batches=[torch.ones(2, 4)] * 2,\n"
                        "                          step=lambda m, b: 1 / 0)\n")
    junit = tmp_path / "j.xml"
    done = run_cli("run", "--probe", str(probe), "--out", str(tmp_path / "run"),
                   "--json", "--junit", str(junit), "--no-census")
    assert done.returncode == 3, done.stderr
    said = json.loads(done.stdout)
    assert (said["verdict"], said["exit_code"]) == ("failed", 3)
    assert "ZeroDivisionError in step 0" in said["headline"]
    error = ET.parse(junit).getroot().find("testsuite/testcase/error")
    assert error is not None and error.get("type") == "failed"
    assert "ZeroDivisionError" in error.get("message")


@pytest.mark.parametrize("wrong", [["--repeats", "0"], ["--no-such-option"]])
def test_a_command_line_the_parser_refuses_still_gives_json_and_junit(tmp_path, capsys, wrong):
    """A mistake the parser finds (a value out of range, an unknown option) ended with its
    line alone: no --json object, no --junit case, where a CI job looks for them."""
    junit = tmp_path / "j.xml"
    code = main(["run", "--model", "maskrcnn", "--json", "--junit", str(junit), *wrong,
                 "--", "--junit", str(tmp_path / "not-ours.xml")])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith(("detaudit run: error: ", "detaudit: error: ")) and err.count("\n") == 1
    said = json.loads(out)
    assert (said["verdict"], said["exit_code"]) == ("usage", 2)
    assert said["headline"] == err.strip()
    error = ET.parse(junit).getroot().find("testsuite/testcase")
    assert error.get("name") == "maskrcnn" and error.find("error").get("type") == "usage"
    assert not (tmp_path / "not-ours.xml").exists()


def test_a_probe_files_model_is_named_by_the_file(tmp_path, capsys):
    """A model class the probe file defines was named by the module detaudit imported the
    file as (``detaudit_probe_3358152465494179932.Net``)."""
    probe = _probe_file(tmp_path, "class Net(torch.nn.Linear):\n    pass\n\n\n"
                        "def probe(device):\n"
                        "    model = Net(4, 1)\n"
                        "    return detaudit.Probe(model=model, batches=[torch.ones(2, 4)] * 2,\n"
                        "                          step=lambda m, b: m(b).sum())\n")
    assert main(["run", "--probe", str(probe), "--out", str(tmp_path / "run"), "--json",
                 "--no-census", "--stress", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["model_class"] == "user_probe.Net"


def test_an_internal_error_is_exit_3_in_one_line(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in detaudit")

    monkeypatch.setattr(api, "run", broken)
    code = main(["run", "--probe", str(PROBES / "tiny_cnn.py"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 3
    assert err.strip() == ("detaudit: internal error: RuntimeError: a bug in detaudit "
                           "(run with --debug for the traceback)")


def _crashing(at_step: int, in_build: int | None = None):
    """A probe whose step `at_step` raises the user's own error: in the `in_build`-th probe
    built (counting from 1), or in every one."""
    built = {"n": 0}

    def probe(device):
        built["n"] += 1
        crashing = in_build in (None, built["n"])
        base = small_cnn_probe(device)

        def step(model, batch):
            if crashing and step.calls == at_step:
                raise RuntimeError("out of memory")
            step.calls += 1
            return base.step(model, batch)

        step.calls = 0
        return Probe(model=base.model, batches=base.batches, step=step, optimizer=base.optimizer)

    return probe


def test_a_crashed_repeat_is_a_failure_compared_over_the_steps_all_completed():
    result = audit(_crashing(at_step=2, in_build=2), repeats=2, steps=4)
    assert result.comparison.common_steps == 2 and result.comparison.first_step is None
    assert result.verdict.kind == "failed" and result.verdict.exit_code == 3
    assert result.verdict.headline.startswith("FAILED: repeat 1 stopped: RuntimeError in "
                                              "step 2 at ")
    assert "the repeats agree over the 2 steps every repeat completed" in result.verdict.headline



def test_a_module_hook_torch_calls_with_other_arguments_fails_as_detaudits():
    """A module hook of detaudit's called with arguments it does not take fails at its
    wrapper's call, before any frame of the hook: that is detaudit's failure too, not the
    user's line that called the module."""
    from detaudit.drivers.runner import raised_in_detaudit
    from detaudit.record.recorder import _Hook

    with pytest.raises(TypeError) as failed:
        _Hook(lambda module, args, kwargs: None)(torch.nn.Linear(1, 1), ())
    assert raised_in_detaudit(failed.value)


def test_a_bug_in_detaudits_recording_is_reported_as_one_with_its_traceback(
        monkeypatch, capsys):
    """A failure in the recording the runner drives (not in the user's step) says it is
    detaudit's and prints the traceback it asks to be reported with; a user's error does not."""
    from detaudit.errors import ProbeError
    from detaudit.record import recorder

    monkeypatch.setattr(recorder, "rng_states", lambda: {"torch": None})  # a bug, planted
    with pytest.raises(ProbeError) as failed:  # (in the first step of the first repeat)
        audit(small_cnn_probe, repeats=2, steps=2)
    assert str(failed.value).startswith("detaudit's own recording failed in step 0")
    assert "(TypeError at fingerprint.py:" in str(failed.value)
    assert str(failed.value).endswith("a bug in detaudit, please report it")
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "TypeError" in err
    # a device's error surfaces at the next sync, often detaudit's first read: the step's
    # (raised by torch itself, with no Python frame of its own, as a CUDA error would be)
    device_error = functools.partial(torch.ops.aten._assert_async.msg, torch.tensor(False),
                                     "CUDA error: device-side assert triggered")
    monkeypatch.setattr(recorder, "rng_states", device_error)
    with pytest.raises(ProbeError) as failed:
        audit(small_cnn_probe, repeats=2, steps=2)
    assert str(failed.value).startswith("RuntimeError in step 0")
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.undo()

    result = audit(_crashing(at_step=1), repeats=2, steps=2)
    assert result.verdict.headline.startswith("FAILED: repeat 0 stopped: RuntimeError in step 1")
    assert "Traceback" not in capsys.readouterr().err


# -- run folders ----------------------------------------------------------------------------
def test_a_folder_holding_a_run_is_refused_unless_overwritten(tmp_path, capsys):
    args = ["run", "--probe", str(PROBES / "tiny_cnn.py"), "--out", str(tmp_path), "--epochs",
            "1", "--steps", "1", "--no-census", "--quiet"]
    assert main(args) == 0
    first = json.loads((tmp_path / "run.json").read_text())["run_id"]
    assert main(args) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] == first
    assert main([*args, "--overwrite"]) == 0
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] != first
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_folder_whose_run_recorded_nothing_is_taken_without_overwrite(tmp_path, capsys):
    """A command that failed before its first step leaves run.json and no trace (a probe
    that failed in it, a trace of no step): running it again, fixed, into the same --out
    needs no --overwrite (nothing would be lost)."""
    out = tmp_path / "run"
    args = ["exec", "--out", str(out), "--quiet", "--", sys.executable, "-c", "pass"]
    assert main(args) == 2  # no step: one line, exit 2
    assert (out / "run.json").exists() and not list(out.glob("trace-*"))
    assert main(args) == 2
    assert "already holds a run" not in capsys.readouterr().err
    # a probe that crashes in its first step: reports of the failure, a trace of no step
    probe = _probe_file(tmp_path, "def probe(device):\n"
                        "    model = torch.nn.Linear(4, 1)\n"
                        "    return detaudit.Probe(model=model, batches=[torch.ones(2, 4)] * 2,\n"
                        "                          step=lambda m, b: 1 / 0)\n")
    args = ["run", "--probe", str(probe), "--out", str(out), "--no-census", "--quiet"]
    assert main(args) == 3
    assert "ZeroDivisionError in step 0" in (out / "report.md").read_text()
    assert list(out.glob("trace-*"))
    assert main(args) == 3
    assert "already holds a run" not in capsys.readouterr().err
    # one that recorded a step is kept
    assert main([*args[:2], str(PROBES / "exits_in_step.py"), *args[3:]]) == 3
    assert main([*args[:2], str(PROBES / "exits_in_step.py"), *args[3:]]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_bad_input_found_before_anything_is_recorded_leaves_no_folder(tmp_path, capsys):
    """A module --inject-fault names that the model lacks is found once the probe is built:
    the --out folder this run made is removed again (it held only run.json); one that was
    there before is left, without run.json."""
    args = ["run", "--probe", str(PROBES / "tiny_cnn.py"), "--inject-fault", "nosuch:0",
            "--no-census", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "new")]) == 2
    assert "no module 'nosuch'" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    assert main([*args, "--out", str(tmp_path / "kept")]) == 2
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["notes.txt"]


def test_a_folder_in_use_is_refused_and_a_stale_lock_taken_over(tmp_path):
    info = RunInfo(probe={}, config={}, command="", traces=[])
    (tmp_path / LOCK_FILE).write_text(str(os.getppid()))  # a live process holds it
    with pytest.raises(TraceError, match="in use by another detaudit run"):
        RunFolder(tmp_path, info).open()
    (tmp_path / LOCK_FILE).write_text("999999999")  # no such process
    with RunFolder(tmp_path, info):
        assert (tmp_path / LOCK_FILE).read_text() == str(os.getpid())
    assert not (tmp_path / LOCK_FILE).exists()


def test_default_folders_are_created_exclusively(tmp_path):
    folders = {new_folder(tmp_path, "maskrcnn") for _ in range(3)}
    assert len(folders) == 3 and all(f.is_dir() for f in folders)


def test_a_folder_mixing_two_runs_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        audit(small_cnn_probe, repeats=2, steps=1, out=folder)
    (a / "trace-1.json.gz").write_bytes((b / "trace-1.json.gz").read_bytes())
    with pytest.raises(TraceError, match="mixes runs: trace-1.json.gz belongs to"):
        api.render_folder(a)


@pytest.mark.parametrize("args", [
    ["--out", "{tmp}/file.txt"],
    ["--out", "/proc/detaudit-run"],
    ["--junit", "/proc/detaudit.xml"],
    ["--junit", "{tmp}"],
])
def test_unwritable_outputs_are_refused_before_the_first_repeat(tmp_path, capsys, args):
    (tmp_path / "file.txt").write_text("not a folder")
    args = [a.format(tmp=tmp_path) for a in args]
    # this probe calls sys.exit in its second step: reaching it would give exit 3, not 2
    code = main(["run", "--probe", str(PROBES / "exits_in_step.py"), *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_junit_into_a_missing_folder_is_created(tmp_path):
    junit = tmp_path / "ci" / "results" / "detaudit.xml"
    assert main(["run", "--probe", str(PROBES / "tiny_cnn.py"), "--out", str(tmp_path / "r"),
                 "--epochs", "1", "--steps", "1", "--no-census", "--quiet",
                 "--junit", str(junit)]) == 0
    assert junit.exists() and "testcase" in junit.read_text()


# -- interruptions --------------------------------------------------------------------------
def _listed(folder: Path) -> list[str]:
    try:
        return json.loads((folder / "run.json").read_text())["traces"]
    except (OSError, ValueError, KeyError):
        return []


def _state(folder: Path) -> str:
    try:
        return json.loads((folder / "run.json").read_text())["state"]
    except (OSError, ValueError, KeyError):
        return ""


INTERRUPTIONS = [
    ("recording", signal.SIGTERM, "interrupted during recording"),
    ("recording", signal.SIGINT, "interrupted during recording"),
    ("recording", signal.SIGKILL, "recording"),
    ("investigating: census", signal.SIGINT, "interrupted during investigating: census"),
    ("investigating: census", signal.SIGKILL, "investigating: census"),
    ("investigating: fix verification", signal.SIGTERM,
     "interrupted during investigating: fix verification"),
]


@pytest.mark.parametrize("stage, sig, want", INTERRUPTIONS)
def test_an_interrupted_audit_leaves_a_folder_that_reports_it(tmp_path, stage, sig, want):
    folder = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "detaudit", "run", "--probe", str(PROBES / "slow_steps.py"),
         "--out", str(folder), "--repeats", "3", "--epochs", "1", "--steps", "3", "--quiet",
         "--verify-fix", "--junit", str(tmp_path / "junit.xml")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DETAUDIT_TEST_STEP_SECONDS": "0.4"},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        # in recording, once run.json lists the first repeat's trace (its file is renamed
        # into place a moment before)
        if _state(folder) == stage and (stage != "recording" or _listed(folder)):
            break
        time.sleep(0.05)
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    info = json.loads((folder / "run.json").read_text())
    assert info["state"] == want
    assert info["traces"] and all((folder / t).exists() for t in info["traces"])
    if sig != signal.SIGKILL:
        assert process.returncode == 130 and "interrupted" in err, err[-3000:]
        assert f"kept in {folder} (`detaudit report {folder}`" in err, err[-3000:]
        assert not list(folder.glob("*.part")) and not list(folder.glob("job-*"))
        # what a CI job reads: an error of its kind, never a pass or a divergence
        error = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite/testcase/error")
        assert error is not None and error.get("type") == "interrupted"
    report = run_cli("report", str(folder))
    assert report.returncode == 130, report.stdout + report.stderr
    # in recording, the repeats done so far: one (nothing to compare it with) or more
    recorded = ("DETERMINISTIC", "NOT COMPARED") if stage == "recording" else ("DETERMINISTIC",)
    assert report.stdout.startswith(tuple(f"INTERRUPTED ({want}); what was recorded: {r}"
                                          for r in recorded)), report.stdout


def test_an_interrupt_that_lands_in_string_compiled_code_still_exits_130(tmp_path):
    """Ctrl-C while code compiled from a string runs (a dataclass being made in some import)
    leaves CPython's "uncaught KeyboardInterrupt" flag set although `run` caught it, and
    `python -m detaudit` then died by SIGINT (-2) instead of returning 130."""
    probe = _probe_file(tmp_path, "def probe(device):\n    exec('raise KeyboardInterrupt')\n")
    result = run_cli("run", "--probe", str(probe), "--out", str(tmp_path / "run"), "--quiet")
    assert result.returncode == 130 and "interrupted" in result.stderr, result.stderr


def _slow_audit(folder: Path, steps: int, pause: float) -> subprocess.Popen:
    """`detaudit run` of 2 repeats of a probe whose every step pauses `pause` seconds, into
    `folder`, started in the background (to be interrupted)."""
    return subprocess.Popen(
        [sys.executable, "-m", "detaudit", "run", "--probe", str(PROBES / "slow_steps.py"),
         "--out", str(folder), "--repeats", "2", "--epochs", "1", "--steps", str(steps),
         "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DETAUDIT_TEST_STEP_SECONDS": str(pause)},
    )


def test_an_audit_interrupted_before_its_first_step_promises_no_report(tmp_path):
    """Ctrl-C before the first step was recorded: the message said `detaudit report FOLDER`
    renders it, and report refused the folder (it lists no traces)."""
    folder = tmp_path / "run"
    process = _slow_audit(folder, steps=2, pause=60)
    deadline = time.monotonic() + 120
    while (time.monotonic() < deadline and process.poll() is None
           and _state(folder) != "recording"):
        time.sleep(0.05)
    time.sleep(1.0)  # (inside the first step, which sleeps a minute)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    assert f"interrupted before a step was recorded ({folder}/run.json" in err, err[-3000:]
    assert "renders it" not in err
    assert run_cli("report", str(folder)).returncode == 2


def test_an_audit_interrupted_in_its_first_repeat_keeps_what_that_repeat_recorded(tmp_path):
    """Ctrl-C before any repeat ended: the steps the first repeat flushed are kept as its
    trace (marked interrupted), so `report` renders the folder rather than refusing it."""
    folder = tmp_path / "run"
    process = _slow_audit(folder, steps=3, pause=0.5)
    partial = folder / "partial-trace-0.json.gz"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None and not (
            partial.exists() and partial.stat().st_size):
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "interrupted" in err
    assert _listed(folder) == ["trace-0.json.gz"] and not partial.exists()
    report = run_cli("report", str(folder))
    assert report.returncode == 130, report.stdout + report.stderr
    assert report.stdout.startswith("INTERRUPTED (interrupted during recording)"), report.stdout
    headline = report.stdout.splitlines()[0]
    assert "only 1 repeat was recorded" in headline and "agree" not in headline, headline
    # the repeat cut short did not fail: no "what was recorded: FAILED: repeat 0 stopped"
    assert "FAILED" not in headline, headline
    assert "bit-identical" not in report.stdout  # one run's loss is compared with nothing


# -- output that stays clean ---------------------------------------------------------------
def test_json_stays_json_when_the_audited_code_prints(tmp_path):
    probe = _probe_file(tmp_path, (
        "def probe(device):\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    def step(m, batch):\n"
        "        print('loss is going down!')\n"
        "        return m(batch).pow(2).mean()\n"
        "    batches = [torch.ones(2, 4)] * 2\n"
        "    return detaudit.Probe(model=model, batches=batches, step=step,\n"
        "                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))\n"
    ))
    done = run_cli("run", "--probe", str(probe), "--out", str(tmp_path / "run"), "--json",
                   "--epochs", "1", "--no-census")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verdict"] == "deterministic"
    assert "loss is going down!" in done.stderr


def test_control_characters_from_the_user_are_escaped_on_the_console(tmp_path, capsys):
    probe = _probe_file(tmp_path, (
        "def probe(device):\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    def step(m, batch):\n"
        "        raise RuntimeError('\\x1b]0;owned\\x07\\x1b[31mred')\n"
        "    return detaudit.Probe(model=model, batches=[torch.ones(2, 4)], step=step)\n"
    ))
    main(["run", "--probe", str(probe), "--out", str(tmp_path / "run"), "--no-census"])
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err
    # a terminal's colour codes are dropped (torch.load's message has some); the rest shown
    assert "\\x1b]0;owned\\x07red" in out + err


# -- state between in-process repeats ------------------------------------------------------
def test_global_settings_a_probe_changes_are_restored_between_repeats():
    seen = []

    def probe(device):
        seen.append((torch.get_num_threads(), torch.get_default_dtype()))
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float64)
        return small_cnn_probe(device)

    before = (torch.get_num_threads(), torch.get_default_dtype())
    try:
        result = audit(probe, repeats=3, steps=1)
    finally:
        torch.set_default_dtype(torch.float32)
    assert seen == [before] * 3
    assert (torch.get_num_threads(), torch.get_default_dtype()) == before
    assert [t.env["threads"] for t in result.traces] == [1, 1, 1]  # as the repeats ran


def _step_lr_probe(**interval):
    """A linear model trained under StepLR(step_size=1, gamma=0.5), 2 batches an epoch."""
    def probe(device):
        model = torch.nn.Linear(4, 1)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randn(3, 4, generator=g) for _ in range(2)]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return Probe(model=model, batches=batches, step=lambda m, x: m(x).pow(2).mean(),
                     optimizer=optimizer, scheduler=scheduler, **interval)
    return probe


def test_the_scheduler_steps_as_the_probe_says_and_each_step_records_the_lr_it_used():
    def lrs(result):
        return [s.lr for s in result.traces[0].steps]

    per_step = audit(_step_lr_probe(), repeats=1, epochs=2, stress=0)
    assert lrs(per_step) == [[0.1], [0.05], [0.025], [0.0125]]  # the default, as before
    per_epoch = audit(_step_lr_probe(scheduler_interval="epoch"), repeats=1, epochs=2,
                      stress=0)
    assert lrs(per_epoch) == [[0.1], [0.1], [0.05], [0.05]]
    # what was audited is the user's own loop with a per-epoch scheduler
    seed_everything(0)
    own = _step_lr_probe(scheduler_interval="epoch")("cpu")
    losses = []
    for _ in range(2):
        for x in own.batches:
            loss = own.step(own.model, x)
            losses.append(loss.item())
            loss.backward()
            own.optimizer.step()
            own.optimizer.zero_grad()
        own.scheduler.step()
    assert [s.loss_values()["loss"] for s in per_epoch.traces[0].steps] == losses
    with pytest.raises(DetauditError, match="scheduler_interval is 'epochs'"):
        _step_lr_probe(scheduler_interval="epochs")("cpu")


def test_api_run_without_a_folder_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = api.run(api.describe_callable(small_cnn_probe), AuditConfig(steps=1),
                     factory=small_cnn_probe)
    assert result.folder is None and result.info.state == "complete"
    assert list(tmp_path.iterdir()) == []


# -- smaller guards -------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--probe", str(PROBES / "tiny_cnn.py"), "--image-size", "64"], "--image-size"),
    (["--probe", str(PROBES / "tiny_cnn.py"), "--inject-fault", "2:99"],
     "never fired: the run has only 4 steps"),
    (["--probe", str(PROBES / "tiny_cnn.py"), "--mode", "infer", "--inject-fault",
      "2@backward:1"], "inference runs no backward"),
    # a module the model lacks is refused before any step, with the names nearest
    (["--probe", str(PROBES / "tiny_cnn.py"), "--inject-fault", "stem:1"],
     "--inject-fault: the model has no module 'stem'; its modules: 0, 1, 2"),
    # an unset variable in a CI script ("--inject-fault $FAULT") was no fault at all, exit 0
    (["--probe", str(PROBES / "tiny_cnn.py"), "--inject-fault", " "], "--inject-fault is empty"),
])
def test_more_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert main(["run", *args, "--out", str(tmp_path), "--no-census"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_an_op_pytorch_does_not_have_is_refused_before_any_run(tmp_path, capsys):
    """(exec: by its first run, at its first step: see test_attach)"""
    code = main(["run", "--inject-fault", "1/aten.convolutoin", "--out", str(tmp_path / "out"),
                 "--probe", str(PROBES / "tiny_cnn.py")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "in PyTorch or torchvision (did you mean aten.convolution" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fault", ["x/aten.index_put_", "x/torchvision.roi_align@backward",
                                   "op:nms", "x/mylib.an_op_its_code_registers"])
def test_an_op_pytorch_torchvision_or_a_library_of_its_own_has_is_planted(fault):
    assert check_op_known(Fault.parse(fault)) is None


_RECIPE_SIZES = ("--image-size", "--batch-size", "--num-images", "--instances", "--num-classes",
                 "--workers", "--accumulate")


@pytest.mark.parametrize("command, option, least", [
    ("run", "--repeats", 1), ("run", "--epochs", 1), ("run", "--steps", 1), ("run", "--nproc", 1),
    ("run", "--zoom-tries", 1), ("baseline", "--repeats", 1), ("exec", "--repeats", 1),
    ("exec", "--max-steps", 1), ("exec", "--max-epochs", 1), ("exec", "--zoom-tries", 1),
    # the built-in recipe's sizes, named by their flags (the recipe's own check names fields)
    ("run", "--image-size", 32), ("run", "--batch-size", 1), ("run", "--num-images", 1),
    ("run", "--instances", 1), ("run", "--num-classes", 2), ("run", "--workers", 0),
    ("run", "--accumulate", 1),
])
def test_every_count_below_its_least_is_refused_alike(tmp_path, capsys, command, option, least):
    target = (["--", "python", "train.py"] if command == "exec" else
              ["--model", "maskrcnn"] if option in _RECIPE_SIZES else
              ["--probe", str(PROBES / "tiny_cnn.py")])
    code = main([command, option, str(least - 1), "--out", str(tmp_path / "out"), *target])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"argument {option}: must be at least {least}, not {least - 1}" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_tolerances_must_be_finite_and_not_negative(tmp_path, capsys, value):
    assert main(["diff", str(tmp_path), str(tmp_path), "--rtol", value]) == 2
    assert "--rtol" in capsys.readouterr().err


def test_a_non_scalar_loss_names_the_users_step(tmp_path, capsys):
    probe = _probe_file(tmp_path, (
        "def probe(device):\n"
        "    model = torch.nn.Linear(4, 3)\n"
        "    def step(m, batch):\n"
        "        return m(batch).pow(2)\n"
        "    return detaudit.Probe(model=model, batches=[torch.ones(2, 4)], step=step)\n"
    ))
    assert main(["run", "--probe", str(probe), "--out", str(tmp_path / "run"), "--no-census"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "the loss must be a scalar" in err and "user_probe.py:7" in err and "(2, 3)" in err


def test_coco_field_types_name_the_file_and_the_field(tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png"}], "annotations": [
        {"image_id": 1, "bbox": [0, 0, "10", 10], "category_id": 1}]}))
    code = main(["run", "--model", "fasterrcnn_mobilenet", "--data", f"coco:{images}:{ann}",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert str(ann) in err and "annotations[0].bbox" in err


# -- values JSON cannot hold ---------------------------------------------------------------
def _strict(text: str):
    def refuse(name: str):
        raise AssertionError(f"bare {name} in JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_losses_and_learning_rates_are_stored_and_reported(tmp_path, capsys):
    probe = _probe_file(tmp_path, (
        "def probe(device):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    def step(m, batch):\n"
        "        return m(batch).pow(2).mean()\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=float('inf'))\n"
        "    return detaudit.Probe(model=model, batches=[torch.ones(2, 4)] * 3, step=step,\n"
        "                          optimizer=optimizer, clip_grad_norm=float('inf'))\n"
    ))
    folder = tmp_path / "run"
    code = main(["run", "--probe", str(probe), "--out", str(folder), "--epochs", "1",
                 "--no-census", "--json"])
    summary = _strict(capsys.readouterr().out)
    assert code == 0, summary["headline"]  # NaN in every repeat alike: deterministic
    assert summary["loss"]["nonfinite"] == {"step": 1, "epoch": 1, "value": "inf",
                                           "finite_again": None, "skipped": False}
    assert summary["headline"].endswith("; loss is infinite from step 1")
    for name in ("summary.json", "run.json"):
        _strict((folder / name).read_text())
    trace = load_run(folder)[1][0]
    assert trace.steps[0].lr == [None] and trace.steps[1].losses["loss"] == "inf"
    assert "loss is infinite from step 1 (epoch 1)" in (folder / "report.md").read_text()


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_loss_non_finite_in_one_repeat_only_is_an_infinite_loss_difference(bad):
    factors = iter([1.0, float(bad)])

    def probe(device: torch.device) -> Probe:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        factor = next(factors)  # the second repeat's loss is non-finite at its second step

        def step(m, batch):
            return m(batch).pow(2).mean() * (factor if batch[0, 0] == 2 else 1.0)

        return Probe(model=model, batches=[torch.ones(2, 4), torch.full((2, 4), 2.0)],
                     step=step, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))

    drift = audit(probe, repeats=2, granularity="module", drill_down=False).comparison.loss
    assert drift.first_step == 1
    assert drift.per_step[1][2] == float("inf")


def test_an_infinite_recipe_option_survives_the_trace(tmp_path):
    from detaudit.probes.options import RecipeOptions

    from detaudit.config import ProbeSpec
    from detaudit.runfolder import trace_probe
    from detaudit.trace import PROBE_SPEC, Trace

    spec = ProbeSpec("builtin", "maskrcnn", options={"clip_grad_norm": float("inf")})
    trace = Trace(probe=trace_probe(spec, AuditConfig()), repeat=0, env={})
    loaded = Trace.load(trace.save(tmp_path / "t.json.gz"))
    options = RecipeOptions.from_dict(loaded.probe[PROBE_SPEC]["options"])
    assert options.clip_grad_norm == float("inf")


@pytest.mark.parametrize("field, value, message", [
    ("traces", ["../elsewhere/trace-0.json.gz"], "not a trace file name in its own folder"),
    ("traces", ["/etc/passwd"], "not a trace file name in its own folder"),
    ("traces", "trace-0.json.gz", "traces is 'trace-0.json.gz', not a list"),
    ("extra", [], "extra is a list, not a dict"),
    ("command", None, "it has no command"),
])
def test_run_json_is_checked_field_by_field(tmp_path, field, value, message):
    folder = tmp_path / "run"
    audit(small_cnn_probe, repeats=2, steps=1, out=folder)
    data = json.loads((folder / "run.json").read_text())
    if value is None:
        del data[field]
    else:
        data[field] = value
    (folder / "run.json").write_text(json.dumps(data))
    with pytest.raises(TraceError, match=message):
        api.render_folder(folder)
    assert main(["report", str(folder)]) == 2


def test_a_repeat_killed_in_its_own_process_keeps_what_it_flushed(tmp_path):
    marker = tmp_path / "built"
    probe = _probe_file(tmp_path, f"""
import os
from pathlib import Path
from conftest import small_cnn_probe

def probe(device):
    second = Path({str(marker)!r}).exists()
    Path({str(marker)!r}).touch()
    base = small_cnn_probe(device)

    def step(model, batch):
        step.calls += 1
        if second and step.calls == 3:
            os._exit(9)  # killed hard, as by the OOM killer: no exception, no clean-up
        return base.step(model, batch)

    step.calls = 0
    return detaudit.Probe(model=base.model, batches=base.batches, step=step,
                          optimizer=base.optimizer)
""")
    out = tmp_path / "run"
    done = run_cli("run", "--probe", str(probe), "--out", str(out), "--isolation", "process",
                   "--steps", "4", "--no-census", "--quiet",
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert done.returncode == 3, done.stdout + done.stderr
    assert "repeat 1 crashed (exit code 9)" in done.stdout
    _, traces = load_run(out)
    assert traces[1].failure.startswith("repeat 1 crashed (exit code 9)")
    # its first step was flushed as it ended: kept, and compared with repeat 0's
    assert [s.step for s in traces[1].steps] == [0] and traces[1].records["step"]
    assert "agree over the 1 step every repeat completed" in done.stdout
    assert not list(out.glob("partial-*"))


@pytest.mark.parametrize("listed", [["trace-0.json.gz"], []])
def test_a_run_killed_before_listing_its_traces_still_reports_them(tmp_path, listed):
    """A repeat's trace takes its own name a moment before run.json lists it (and a killed
    run's repeat process may go on to finish): the folder's report reads the complete
    traces of its own run that run.json does not list yet, never another run's."""
    folder = tmp_path / "run"
    done = run_cli("run", "--probe", str(PROBES / "slow_steps.py"), "--out", str(folder),
                   "--repeats", "3", "--epochs", "1", "--steps", "2", "--quiet", "--no-census")
    assert done.returncode == 0, done.stderr
    foreign = open_trace(folder / "trace-2.json.gz")
    foreign.probe["run"] = "another-run"
    foreign.save(folder / "trace-2.json.gz")
    info = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**info, "traces": listed,
                                                 "state": "recording"}))
    report = run_cli("report", str(folder), "--json")
    assert report.returncode == 130, report.stdout + report.stderr
    summary = json.loads(report.stdout)
    assert summary["repeats"] == 2
    assert summary["headline"].startswith("INTERRUPTED (recording); what was recorded: "
                                          "DETERMINISTIC")


def test_a_folder_whose_investigation_failed_renders_failed_never_a_verdict(tmp_path):
    """The audit found a divergence, then detaudit failed in an investigation: rendered
    again, the folder is FAILED (exit 3) with what was recorded, not DIVERGENT."""
    folder = tmp_path / "run"
    done = run_cli("run", "--probe", str(PROBES / "tiny_cnn.py"), "--out", str(folder),
                   "--epochs", "1", "--steps", "2", "--quiet", "--no-census",
                   "--inject-fault", "2@forward:1")  # (the planted fault is the divergence)
    assert done.returncode == 1, done.stderr
    info = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps(
        {**info, "state": "failed during investigating: zoom: DetauditError"}))
    report = run_cli("report", str(folder))
    assert report.returncode == 3, report.stdout + report.stderr
    assert report.stdout.startswith("FAILED (failed during investigating: zoom: DetauditError);"
                                    " what was recorded: DIVERGENT: first at step 1")


def test_an_op_fault_named_on_a_parent_module_says_to_name_the_innermost(tmp_path, capsys):
    probe = _probe_file(tmp_path, (
        "def probe(device):\n"
        "    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)),\n"
        "                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))\n"
        "    return detaudit.Probe(model=model, batches=[torch.ones(1, 3, 8, 8)] * 2,\n"
        "                          step=lambda m, b: m(b).sum(),\n"
        "                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))\n"
    ))
    args = ["run", "--probe", str(probe), "--out", str(tmp_path / "run"), "--no-census",
            "--epochs", "1"]
    assert main([*args, "--inject-fault", "0/aten.convolution@forward:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "names the innermost module the op runs in" in err
    assert main([*args, "--overwrite", "--inject-fault", "0.0/aten.convolution@forward:1"]) == 1


class _UnreadableImages(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        raise ValueError(f"image {index} could not be read\n(a second line)")


def test_an_error_in_a_dataloader_worker_is_named_where_the_worker_raised_it():
    """The loop raises it again as "Caught ValueError in DataLoader worker process 0.": the
    failure names the worker's error, message and line in the user's dataset, and the
    line of the loop that received it."""
    from detaudit.drivers.runner import describe_user_error

    loader = torch.utils.data.DataLoader(_UnreadableImages(), num_workers=1)
    try:
        next(iter(loader))
    except ValueError as exc:
        said = describe_user_error(exc, "while running")
    lines = Path(__file__).read_text().splitlines()
    raised = lines.index('        raise ValueError(f"image {index} could not be read\\n(a second line)")')
    received = lines.index("        next(iter(loader))")
    assert said == (f"ValueError while running in DataLoader worker process 0 at {__file__}:"
                    f"{raised + 1}: image 0 could not be read (the loop received it at "
                    f"{__file__}:{received + 1})")


def test_a_users_error_is_one_line_without_terminal_colour_codes():
    """torch.load's error text is coloured for a terminal; the reports show it as text."""
    from detaudit.drivers.runner import describe_user_error

    try:
        raise RuntimeError("\x1b[1mWeights only load failed.\x1b[0m Re-running may work\nmore")
    except RuntimeError as exc:
        said = describe_user_error(exc, "in step 0")
    assert said.startswith("RuntimeError in step 0 at ")
    assert said.endswith(": Weights only load failed. Re-running may work")
