"""`detaudit run` as a user runs it: built-in models, probe files, faults, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detaudit.cli import main

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

PROBES = Path(__file__).parent / "probe_files"


def run_cli(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "detaudit", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600, check=False)


@pytest.mark.slow
def test_maskrcnn_planted_fault_is_named(tmp_path):
    """The default run scans every step, then zooms into the one where the runs part: a
    1-ULP change in ROIAlign's backward in epoch 2 (step 1: one step an epoch) is named by
    module, phase, step and op, measured (a forward fault at step 2, by scan and zoom:
    tests/test_audit.py)."""
    module, phase = "roi_heads.mask_roi_pool", "backward"
    done = run_cli("run", "--model", "maskrcnn", "--image-size", "64", "--epochs", "2",
                   "--steps", "1", "--inject-fault", f"{module}/torchvision.roi_align@{phase}:1",
                   "--out", str(tmp_path), "--json", "--no-census",
                   "--stress", "0")  # both: tested on their own
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"], first["epoch"]) == (
        module, phase, 1, 2)
    assert first["role"] == "origin"
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["config"]["granularity"] == "scan"
    assert (run["extra"]["zoom"]["status"], run["extra"]["zoom"]["step"]) == ("found", 1)
    ops = run["extra"]["ops"]
    origin = ops["ops"][0]
    assert (origin["op"], origin["module"], origin["role"]) == (
        "torchvision._roi_align_backward", module, "origin")
    assert ops["origin_ops"] == 1
    assert origin["elements"] == 1 and origin["max_ulp"] == 1  # the 1 ULP, measured
    assert (tmp_path / "run.json").exists() and (tmp_path / "trace-1.json.gz").exists()
    headline = f"first at step 1 (epoch 2), {phase}"
    for name, shown in (("report.html", module), ("report.github.html", module),
                        ("report.md", module.replace("_", r"\_"))):
        text = (tmp_path / name).read_text()
        assert headline in text and shown in text, name
    shown = run_cli("report", str(tmp_path))  # (the console report, rendered again)
    assert shown.returncode == 1, shown.stderr
    assert f"op: torchvision._roi_align_backward in {module} (backward)" in shown.stdout


@pytest.mark.slow
def test_maskrcnn_without_fault_is_deterministic(tmp_path):
    done = run_cli("run", "--model", "maskrcnn", "--image-size", "64", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DETERMINISTIC" in done.stdout
    census = json.loads((tmp_path / "summary.json").read_text())["census"]
    ran = {(c["module"], c["op"]) for c in census}
    assert {("rpn", "torchvision.nms"), ("roi_heads", "aten.randperm")} <= ran
    assert "preset: cpu: 2 repeats × 2 epochs × 2 steps" in done.stdout
    for name in ("report.html", "report.github.html", "report.md"):
        assert "DETERMINISTIC" in (tmp_path / name).read_text(), name


@pytest.mark.alone  # a real race must fire
def test_user_probe_file_with_real_nondeterminism(tmp_path, capsys):
    code = main(["run", "--probe", str(PROBES / "centre_gather.py"), "--out", str(tmp_path),
                 "--json", "--epochs", "1", "--steps", "2", "--repeats", "4"])
    assert code == 1
    summary = json.loads(capsys.readouterr().out)
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"], first["role"]) == (
        "centre_head", "backward", 0, "origin")
    assert summary["cause"]["kind"] == "backward"


@pytest.mark.alone  # a real race must fire (its probe sets 2 threads)
def test_epoch_two_drift_is_reported_at_its_first_step(tmp_path, capsys):
    code = main(["run", "--probe", str(PROBES / "unfreeze_at_epoch_2.py"), "--out", str(tmp_path),
                 "--json", "--epochs", "3", "--steps", "2", "--repeats", "3"])
    assert code == 1
    summary = json.loads(capsys.readouterr().out)
    first = summary["first_divergence"]
    assert (first["epoch"], first["index"], first["step"]) == (2, 0, 2)
    assert first["module"] == "centre_head" and first["phase"] == "backward"
    assert summary["loss"]["per_epoch"][0]["max_rel_diff"] == 0.0  # epoch 1 identical


def test_process_isolation_finds_hash_seed_dependence(tmp_path):
    probe = str(PROBES / "hash_order_labels.py")
    inproc = run_cli("run", "--probe", probe, "--out", str(tmp_path / "a"), "--repeats", "2",
                     "--quiet")
    assert inproc.returncode == 0, inproc.stdout + inproc.stderr
    isolated = run_cli("run", "--probe", probe, "--out", str(tmp_path / "b"), "--repeats", "2",
                       "--isolation", "process", "--json")
    assert isolated.returncode == 1, isolated.stdout + isolated.stderr
    summary = json.loads(isolated.stdout)
    assert summary["cause"]["kind"] == "data"  # the labels in the batch differ
    assert summary["first_divergence"]["step"] == 0


@pytest.mark.parametrize("args,message", [
    (["run", "--model", "nosuchnet"], "unknown model 'nosuchnet'; known models: fasterrcnn"),
    (["run", "--model", "fasterrcnn_mobilenet", "--weights", "/nonexistent/w.pth"], "/nonexistent/w.pth"),
    (["run", "--probe", "/nonexistent/probe.py"], "does not exist"),
    (["run", "--model", "maskrcnn", "--inject-fault", "a@sideways:1"], "--inject-fault"),
    (["run", "--probe", str(PROBES)], "probe_files is a folder"),
    (["run", "--model", "maskrcnn", "--nproc", "2", "--verify-fix"],
     "--verify-fix re-runs one process"),  # (it was dropped without a word)
    (["run", "--probe", str(PROBES / "tiny_cnn.py"), "--epochs", "1", "--steps", "1",
      "--no-census", "--inject-fault", "op:torchvision.nms"],
     ("never fired: op 'torchvision.nms' did not run forward in any module at step 0 of 1 "
      "recorded step (the ops that ran forward there: ")),
    # an op the module does not run: the ops it did run are named (op names vary by version)
    (["run", "--probe", str(PROBES / "tiny_cnn.py"), "--epochs", "1", "--steps", "1",
      "--no-census", "--inject-fault", "6/aten.convolution"],
     ("did not run forward at step 0 of 1 recorded step (an op fault names the innermost "
      "module the op runs in, not a parent of it; the ops it ran forward there: aten.addmm)")),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    assert main([*args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize("args,message", [
    (["run", "--model", "maskrcnn", "--repeats", "x"],
     "detaudit run: error: argument --repeats: takes a whole number, not 'x'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["exec", "--seed"], "detaudit exec: error: argument --seed: expected one argument"),
    (["exec", "--seed", "-1", "--", "python"], "argument --seed: takes 0 to 4294967295, not -1"),
    (["run", "--model", "maskrcnn", "--seed", str(2**32)], f"not {2**32} (numpy and"),
    (["exec", "--step-timeout", "0", "--", "python", "t.py"],
     "argument --step-timeout: takes a number of seconds above 0, not 0"),
    (["exec", "--step-timeout", "1m", "--", "python", "t.py"],
     "argument --step-timeout: takes a number of seconds, not '1m'"),
])
def test_a_malformed_command_line_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_a_fault_at_the_model_itself_is_named_as_the_reports_name_it(tmp_path, capsys):
    """A model with no submodules (one nn.Linear): `(model)` plants at it, in forward and in
    backward; a name it lacks says how to name it."""
    probe = tmp_path / "linear.py"
    probe.write_text("import torch\nfrom torch import nn\nimport detaudit\n\n\n"
                     "def probe(device):\n    torch.manual_seed(0)\n    model = nn.Linear(4, 1)\n"
                     "    return detaudit.Probe(model=model, batches=[torch.randn(8, 4)] * 2,\n"
                     "        step=lambda m, x: m(x).pow(2).mean(),\n"
                     "        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))\n")
    common = ["run", "--probe", str(probe), "--epochs", "1", "--steps", "2", "--no-census",
              "--quiet", "--overwrite", "--out", str(tmp_path / "run")]
    for phase in ("forward", "backward"):
        assert main([*common, "--inject-fault", f"(model)@{phase}:1"]) == 1
        assert capsys.readouterr().out.startswith(
            f"DIVERGENT: first at step 1 (epoch 1), {phase}, (model) (origin); cause: {phase}; "
            "the planted fault, found where it was planted")
    assert main([*common, "--inject-fault", "linear:1"]) == 2
    assert "it has no submodules: name the model itself, (model)" in capsys.readouterr().err


def test_a_probe_that_raises_is_a_crash_named_in_one_line(tmp_path, capsys):
    assert main(["run", "--probe", str(PROBES / "broken.py"), "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.py:8" in err


def test_malformed_coco_json_is_one_line(tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    ann = tmp_path / "ann.json"
    ann.write_text("{ this is not json")
    code = main(["run", "--model", "fasterrcnn_mobilenet", "--data", f"coco:{images}:{ann}",
                 "--out", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ann.json" in err


def test_models_lists_every_probe(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("maskrcnn", "maskrcnn_v1", "fasterrcnn_mobilenet", "retinanet_v2", "ssdlite"):
        assert name in out


def test_baseline_check_round_trip_through_the_cli(tmp_path):
    import xml.etree.ElementTree as ET

    project = tmp_path / "project"  # the probe file lives in the project that checks it
    project.mkdir()
    (tmp_path / "ci").mkdir()
    probe = project / "tiny_cnn.py"
    probe.write_text((PROBES / "tiny_cnn.py").read_text())
    base = tmp_path / "base.json"
    made = run_cli("baseline", "--probe", str(probe), "--out", str(base), cwd=project)
    assert made.returncode == 0, made.stderr
    checked = run_cli("check", str(base), "--junit", str(tmp_path / "j.xml"), cwd=project)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"the baseline runs the probe file {probe}" in checked.stderr
    elsewhere = run_cli("check", str(base), cwd=tmp_path / "ci")  # the probe is outside ci/
    assert elsewhere.returncode == 2 and "--allow-external-probe" in elsewhere.stderr
    allowed = run_cli("check", str(base), "--allow-external-probe", "--out", str(tmp_path / "c"),
                      "--json", cwd=tmp_path / "ci")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    said = json.loads(allowed.stdout)  # --json: stdout holds the result alone
    assert (said["verdict"], said["exit_code"], said["first"]) == ("match", 0, None)
    assert said["folder"] == str(tmp_path / "c") and said["headline"].startswith("MATCH")
    case = ET.parse(tmp_path / "j.xml").getroot().find(".//testcase")
    assert case is not None and case.find("failure") is None
    base.write_text("{broken")
    broken = run_cli("check", str(base), cwd=project)
    assert broken.returncode == 2 and len(broken.stderr.strip().splitlines()) == 1


def test_report_command_rerenders_a_saved_run(tmp_path, capsys):
    folder = tmp_path / "run"
    assert main(["run", "--probe", str(PROBES / "tiny_cnn.py"), "--out", str(folder),
                 "--quiet"]) == 0
    first = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").unlink()
    capsys.readouterr()
    assert main(["report", str(folder), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["headline"] == first["headline"]
    assert said["exit_code"] == 0  # (as run --json gives it: the README says --json does)
    for name in ("report.html", "report.md", "report.github.html", "summary.json"):
        assert (folder / name).exists()
    (folder / "trace-1.json.gz").write_bytes(b"\x1f\x8b garbage")
    assert main(["report", str(folder)]) == 2
    assert "trace-1.json.gz" in capsys.readouterr().err
    for given, said in ((folder / "summary.json", "a file"), (tmp_path / "none", "no such")):
        assert main(["report", str(given)]) == 2
        assert f"{given} is not a run folder ({said}" in capsys.readouterr().err


def test_the_reports_command_runs_the_same_audit_into_a_new_folder(tmp_path):
    folder = tmp_path / "run"
    assert main(["run", "--probe", str(PROBES / "tiny_cnn.py"), "--out", str(folder),
                 "--overwrite", "--epochs", "1", "--steps", "1", "--quiet"]) == 0
    command = json.loads((folder / "run.json").read_text())["command"]
    assert command.startswith("detaudit run --probe ") and command.endswith(
        "--epochs 1 --steps 1 --quiet")
    assert "--out" not in command and "--overwrite" not in command


@pytest.mark.parametrize("steps,noted", [("5", True), ("2", False)])
def test_steps_beyond_the_probe_s_data_are_noted(tmp_path, capsys, steps, noted):
    """tiny_cnn has 2 batches an epoch: --steps 5 records those 2, and says so."""
    assert main(["run", "--probe", str(PROBES / "tiny_cnn.py"), "--out", str(tmp_path),
                 "--epochs", "1", "--steps", steps]) == 0
    out = capsys.readouterr().out
    note = "note: --steps 5 asked for 5 steps per epoch; the probe's data had 2 in epoch 1"
    assert (note in out) is noted, out
    assert (note[6:] in (tmp_path / "report.md").read_text()) is noted


def test_junit_calls_a_crash_and_a_run_compared_with_nothing_errors_not_divergences(tmp_path):
    import xml.etree.ElementTree as ET

    cases = {}
    for name, options, code in (
            ("crash", ["--probe", str(PROBES / "crash_second_repeat.py")], 3),
            ("alone", ["--probe", str(PROBES / "tiny_cnn.py"), "--repeats", "1"], 2)):
        junit = tmp_path / f"{name}.xml"
        assert main(["run", *options, "--out", str(tmp_path / name), "--epochs", "1",
                     "--steps", "3", "--quiet", "--junit", str(junit)]) == code
        cases[name] = ET.parse(junit).getroot().find("testsuite")
    for suite, kind in ((cases["crash"], "failed"), (cases["alone"], "not compared")):
        assert (suite.get("failures"), suite.get("errors")) == ("0", "1")
        case = suite.find("testcase")
        assert case.find("failure") is None and case.find("error").get("type") == kind


def test_a_crashed_repeat_is_reported_and_the_others_kept(tmp_path, capsys):
    code = main(["run", "--probe", str(PROBES / "crash_second_repeat.py"), "--out", str(tmp_path),
                 "--epochs", "1", "--steps", "3"])
    out = capsys.readouterr().out
    assert code == 3  # a crash, not a divergence: the step all repeats completed agrees
    assert out.startswith("FAILED: repeat 1 stopped: RuntimeError in step 1 at")
    assert "repeat 1 failed: RuntimeError in step 1 at" in out and "crash_second_repeat.py" in out
    assert "\npreset: cpu: 2 repeats × 1 epoch × 3 steps, train\n" in out
    assert (tmp_path / "trace-0.json.gz").exists() and (tmp_path / "trace-1.json.gz").exists()


def test_a_probe_file_that_is_not_python_or_breaks_the_contract_is_bad_input(tmp_path, capsys):
    """Exit 2 (usage), one line naming the file and line: not a crash (3), never a verdict."""
    bad = tmp_path / "syntax.py"
    bad.write_text("def probe(device)\n    return None\n")
    assert main(["run", "--probe", str(bad), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "syntax.py:1" in err and "SyntaxError" in err
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def probe(device):\n    return 3\n")
    assert main(["run", "--probe", str(wrong), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "returned int, not detaudit.Probe" in err


def test_a_probe_function_that_does_not_take_the_device_is_bad_input(tmp_path, capsys):
    """Exit 2, one line naming the file, the line and the contract; not a crash in detaudit."""
    probe = tmp_path / "no_device.py"
    probe.write_text("import detaudit\n\n\ndef probe():\n    return None\n")
    assert main(["run", "--probe", str(probe), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{probe}:4: probe() does not take the device" in err and "probe(device)" in err


def test_a_probe_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """As `python probe.py` would: in this process and in a fresh one per repeat."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the probe's folder joins it
    (tmp_path / "tiny_cnn_beside.py").write_text((PROBES / "tiny_cnn.py").read_text())
    (tmp_path / "uses_beside.py").write_text("from tiny_cnn_beside import probe  # noqa: F401\n")
    for isolation in ("inprocess", "process"):
        assert main(["run", "--probe", str(tmp_path / "uses_beside.py"), "--isolation",
                     isolation, "--out", str(tmp_path / isolation), "--epochs", "1",
                     "--no-census", "--stress", "0", "--quiet"]) == 0, isolation


def test_a_failed_run_keeps_its_error_for_the_report(tmp_path, capsys):
    """The error that stopped a run (here a usage error found once recording ended) is in
    run.json, and `detaudit report` says it, with the run's exit code."""
    folder = tmp_path / "run"
    assert main(["run", "--probe", str(PROBES / "tiny_cnn.py"), "--inject-fault", "0:5",
                 "--epochs", "1", "--out", str(folder), "--quiet"]) == 2
    said = capsys.readouterr().err.strip().removeprefix("detaudit: error: ")
    assert said.startswith("the planted fault never fired")
    state = json.loads((folder / "run.json").read_text())["state"]
    assert state == f"refused during recording: {said}"
    assert main(["report", str(folder)]) == 2  # as the run itself exited (it was 3, a crash)
    rendered = capsys.readouterr().out
    assert f"REFUSED (refused during recording: {said})" in rendered
    # the last repeat's streamed trace is kept and listed (it was left as a partial file),
    # and the report gives no advice about --repeats, which was 2
    assert not list(folder.glob("partial-*"))
    assert sorted(json.loads((folder / "run.json").read_text())["traces"]) == [
        "trace-0.json.gz", "trace-1.json.gz"]
    assert "needs --repeats 2" not in rendered
    # what it recorded only served to check the fault: the corrected command takes the
    # folder without --overwrite (it said "already holds a run"), and that run is kept
    fixed = ["run", "--probe", str(PROBES / "tiny_cnn.py"), "--inject-fault", "0:1",
             "--epochs", "1", "--out", str(folder), "--quiet"]
    assert main(fixed) == 1
    assert json.loads((folder / "run.json").read_text())["state"] == "complete"
    assert main(fixed) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_exec_plants_an_op_fault_in_any_module_and_names_the_op_and_its_module(tmp_path):
    """`op:OP` names no module: exec's check of the fault's target lets it through, and the
    op fires in the first module that runs it (the stem's convolution)."""
    script = Path(__file__).parent / "scripts" / "train_plain.py"
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--seed", "0", "--max-steps", "3",
                   "--inject-fault", "op:aten.convolution@forward:1", "--", sys.executable,
                   str(script), "--workers", "0", "--accumulate", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "op: aten.convolution in stem" in done.stdout
    assert "no module ''" not in done.stdout + done.stderr


def test_a_module_name_with_no_near_match_is_answered_with_the_outermost_modules():
    from detaudit.config import nearest_modules

    names = ["backbone", "backbone.body", "backbone.body.conv1", "transformer",
             "transformer.decoder", "bbox_embed", "bbox_embed.layers.0", "class_embed",
             "query_embed", "input_proj", "transformer.encoder"]
    assert nearest_modules("nosuchmodule", names, "modules that ran") == (
        "modules that ran: backbone, transformer, bbox_embed, class_embed, query_embed, "
        "input_proj, backbone.body, transformer.decoder, ... (11 in all)")
    assert nearest_modules("bbox_embd", names, "modules").startswith("did you mean bbox_embed,")


def test_a_module_name_some_modules_end_with_is_answered_with_those():
    """A LoRA layer named as `lora_A` listed the 8 outermost of PEFT's 66 modules, none of
    them a LoRA layer."""
    from detaudit.config import nearest_modules

    names = ["base_model", "base_model.model"] + [
        f"base_model.model.layer.{i}.{part}" for i in range(4)
        for part in ("query", "query.lora_A", "query.lora_B", "value")]
    assert nearest_modules("lora_A", names, "modules that ran") == (
        "did you mean base_model.model.layer.0.query.lora_A, base_model.model.layer.1.query."
        "lora_A, base_model.model.layer.2.query.lora_A, base_model.model.layer.3.query.lora_A?")


def test_a_backward_fault_that_never_fired_says_a_frozen_layer_runs_no_backward():
    from detaudit.config import Fault, fault_not_fired

    said = fault_not_fired(Fault("backbone.body.conv1", "backward", 2), 3)
    assert said.startswith("module 'backbone.body.conv1' did not run backward at step 2 of 3 ")
    assert "frozen layer, runs no backward: plant @forward" in said
    assert "frozen" not in fault_not_fired(Fault("backbone.body.conv1", "forward", 2), 3)
    # an op fault in a module that ran no backward op says so too (it said only "did not
    # run backward"); one whose module ran other ops lists them
    said = fault_not_fired(Fault("conv1.aggr", "backward", 2, "aten.gather"), 3)
    assert "frozen layer, runs no backward: plant @forward" in said, said
    said = fault_not_fired(Fault("conv1", "backward", 2, "aten.gather"), 3, ran=["aten.mm"])
    assert "the ops it ran backward there: aten.mm" in said and "frozen" not in said, said


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.strip() == f"detaudit {version('detaudit')}"
