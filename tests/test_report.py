"""Tests of the reports: Markdown, standalone HTML, GitHub comment, re-rendering a run folder."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from detaudit import Fault, Probe, api
from detaudit.api import render_folder
from detaudit.config import AuditConfig, Investigations
from detaudit.errors import TraceError
from detaudit.report import render_github, render_html, render_markdown, write_reports
from detaudit.report.github import LIMIT
from detaudit.report.markdown import fence

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

CHROMIUM = Path("/usr/bin/chromium")
EVIL = "<script>alert(1)</script>"
GITHUB_TAGS = {
    "details", "summary", "table", "thead", "tbody", "tr", "th", "td", "code", "pre", "b", "i",
    "sub", "sup", "br", "p", "ul", "ol", "li", "h3", "h4", "a",
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3))).pow(2).mean()


def probe(device: str) -> Probe:
    model = Net()
    batches = [torch.randn(2, 3, 16, 16) for _ in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Probe(model=model, batches=batches, step=lambda m, b: m(b), optimizer=optimizer)


def _run(folder: Path, fault: Fault | None) -> dict[str, Any]:
    """The orchestrator's run, as `detaudit run` makes it (a scan, then a zoom into the
    first divergent step), with the command it would show."""
    config = AuditConfig(repeats=2, epochs=2, fault=fault)
    result = api.run(api.describe_callable(probe), config, factory=probe, out=folder,
                     investigations=Investigations(),
                     command="detaudit run --probe demo.py")
    return result.summary


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("planted")
    return folder, _run(folder, Fault("conv", "backward", 1))


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("clean"), None)


class Tags(HTMLParser):
    """Every start tag with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))


def _tags(text: str) -> list[tuple[str, list[tuple[str, str | None]]]]:
    parser = Tags()
    parser.feed(text)
    parser.close()
    return parser.tags


def _renders(summary: dict[str, Any]) -> dict[str, str]:
    return {
        "md": render_markdown(summary),
        "html": render_html(summary),
        "github": render_github(summary),
    }


def _plain(json_text: str) -> Any:
    return json.loads(json_text)


def test_planted_fault_named_everywhere(planted: tuple[Path, dict[str, Any]]) -> None:
    _, summary = planted
    assert summary["first_divergence"]["module"] == "conv"
    assert "conv" in summary["modules"]  # the names a planted fault takes, listed
    for name, text in _renders(summary).items():
        assert "first at step 1 (epoch 1)" in text, name
        assert "conv" in text and "backward" in text, name
        assert "detaudit run --probe demo.py" in text, name
        assert "modules with parameters (for --inject-fault" in text, name
        # last: a model's modules run to hundreds of rows, not to stand before the findings
        assert text.index("modules with parameters") > text.index("First divergence"), name


def test_deterministic_run_says_so(clean: dict[str, Any]) -> None:
    assert clean["verdict"] == "deterministic"
    for name, text in _renders(clean).items():
        assert "DETERMINISTIC" in text, name
        assert "First divergence" not in text, name
        assert "steps that differ" not in text, name  # no empty table


def test_the_run_line_names_the_device_the_runs_recorded_the_model_on(
        clean: dict[str, Any]) -> None:
    # exec and watch choose no device (the user's code does): their configuration holds
    # none, and a GPU run was said to be on the cpu, the configuration's default
    assert "device cpu;" in render_markdown(clean)
    on_a_gpu = {**copy.deepcopy(clean), "env": {**clean["env"], "device": "cuda:0"}}
    del on_a_gpu["config"]["device"]
    for name, text in _renders(on_a_gpu).items():
        assert "device cuda:0;" in text and "device cpu" not in text, name


def test_github_uses_only_kept_tags(planted: tuple[Path, dict[str, Any]]) -> None:
    text = render_github(planted[1])
    for tag, attrs in _tags(text):
        assert tag in GITHUB_TAGS, tag
        for name, value in attrs:
            assert (tag, name) == ("a", "href") and (value or "").startswith("https://")
    assert "▁" in text  # the sparkline stands in for the drift plot


def test_github_huge_summary_is_shortened(planted: tuple[Path, dict[str, Any]]) -> None:
    summary = copy.deepcopy(planted[1])
    cell, origin = summary["map"][0], summary["origins"][0]
    summary["map"] = [dict(cell, module=f"backbone.m{i}.conv", step=i % 50) for i in range(5000)]
    summary["origins"] = [dict(origin, module=f"roi_heads.box{i}") for i in range(3000)]
    summary["loss"]["per_step"] = [
        {"step": i, "epoch": 1 + i // 1000, "rel_diff": 1e-7 * (i + 1)} for i in range(4000)
    ]
    text = render_github(summary)
    assert len(text) <= LIMIT
    assert "Shortened to fit a GitHub comment" in text
    assert "divergence map" in text
    assert all(tag in GITHUB_TAGS for tag, _ in _tags(text))


def test_html_is_standalone(planted: tuple[Path, dict[str, Any]]) -> None:
    text = render_html(planted[1])
    tags = _tags(text)
    assert sum(tag == "svg" for tag, _ in tags) == 3  # loss curves, drift, divergence map
    for tag, attrs in tags:
        assert tag != "script"
        for name, value in attrs:
            if name in ("src", "href", "xlink:href"):
                assert not re.match(r"\s*(https?:)?//", value or ""), (tag, name, value)
    assert "@import" not in text and "url(" not in text
    assert "@media print" in text


def test_xss_is_inert(planted: tuple[Path, dict[str, Any]]) -> None:
    evil = _plain(json.dumps(planted[1]).replace("conv", json.dumps(EVIL)[1:-1]))
    evil["probe"]["name"] = EVIL
    evil["command"] = f"detaudit run --inject-fault '{EVIL}@backward:1' ```"
    evil["knowledge"] = [{"op": EVIL, "what": EVIL, "why": "|x|", "remedy": "[a](javascript:1)"}]
    out = _renders(evil)
    assert "<script" not in out["html"].lower() and "<script" not in out["github"].lower()
    assert "&lt;script&gt;" in out["html"] and "&lt;script&gt;" in out["github"]
    fences = re.findall(r"^(`{3,})text\n(.*?)\n\1$", out["md"], flags=re.DOTALL | re.MULTILINE)
    assert fences and fences[0][1] == evil["command"]  # verbatim inside a fence it cannot close
    outside = re.sub(r"^(`{3,})text\n.*?\n\1$", "", out["md"], flags=re.DOTALL | re.MULTILINE)
    assert "<script" not in outside and "&lt;script&gt;" in outside
    assert "\\[a\\](javascript:1)" in outside and "\\|x\\|" in outside


def test_fence_outlasts_backticks() -> None:
    assert fence("a ```` b").startswith("`````text\n")


def test_render_folder_reproduces_summary(
    planted: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    folder = tmp_path / "run"
    shutil.copytree(planted[0], folder)
    again = render_folder(folder)
    assert _plain(json.dumps(again, default=str)) == _plain(json.dumps(planted[1], default=str))
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith(("trace-", "zoom-")))
    assert names == ["report.github.html", "report.html", "report.md", "run.json", "summary.json"]
    assert sorted(p.name for p in folder.glob("zoom-*")) == ["zoom-0.json.gz", "zoom-1.json.gz"]


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_render_folder_names_bad_trace(
    planted: tuple[Path, dict[str, Any]], tmp_path: Path, damage: str
) -> None:
    folder = tmp_path / "run"
    shutil.copytree(planted[0], folder)
    trace = folder / "trace-1.json.gz"
    if damage == "missing":
        trace.unlink()
    else:
        trace.write_bytes(trace.read_bytes()[:40])
    with pytest.raises(TraceError, match="trace-1.json.gz"):
        render_folder(folder)


def test_write_reports_leaves_nothing_half_written(
    planted: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from detaudit import report

    def broken(summary: dict[str, Any]) -> str:
        raise RuntimeError("renderer failed")

    monkeypatch.setattr(report, "render_github", broken)
    with pytest.raises(RuntimeError):
        write_reports(tmp_path, planted[1])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium")
def test_html_renders_in_chromium(planted: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from PIL import Image

    page, png = tmp_path / "report.html", tmp_path / "shot.png"
    page.write_text(render_html(planted[1]), encoding="utf-8")
    done = subprocess.run(
        [
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
            "--v=0", f"--screenshot={png}", "--window-size=1280,2000", page.as_uri(),
        ],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert png.exists(), done.stderr[-2000:]
    colours = Image.open(png).convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 20
    errors = [
        line for line in done.stderr.splitlines()
        if ("Uncaught" in line or "ERROR:CONSOLE" in line) and "report.html" in line
    ]
    assert not errors


def test_optional_sections_render_when_present(planted: tuple[Path, dict[str, Any]]) -> None:
    summary = copy.deepcopy(planted[1])
    summary["ops"] = [{
        "op": "aten::index_add_", "module": "conv", "phase": "backward", "role": "origin",
        "elements": 216, "max_abs_diff": 1.2e-9, "max_ulp": 1,
    }]
    summary["knowledge"] = [{
        "op": "aten::index_add_", "what": "atomic adds", "why": "order varies",
        "remedy": "torch.use_deterministic_algorithms(True)",
    }]
    summary["census"] = [{"module": "conv", "op": "aten::index_add_", "count": 3}]
    summary["extra"] = {"verify": {"deterministic": True, "step_time_ratio": 1.25,
                                   "peak_memory_ratio": 1.0}}
    summary["env_differences"] = {"threads": [2, 4]}
    for name, text in _renders(summary).items():
        for expected in (
            "index", "order varies", "Census", "Fix verification", "1.25",
            "environment differences",
        ):
            assert expected in text, (name, expected)


def test_the_proof_by_re_execution_says_which_run_made_it_and_how_often(
        clean: dict[str, Any]) -> None:
    """run's last repeat re-executes the risky ops, exec's first run: report.md said "the
    first run" of every run with a command to reproduce it (all of them). A parallel op
    whose results agreed runs on: the console said every op ran as often as the most."""
    from detaudit.report import render_console

    summary = copy.deepcopy(clean)
    summary["stress"] = [
        {"module": "pool", "phase": "forward", "op": op, "epoch": 1, "calls": 1,
         "distinct": 1, "runs": runs, "steps": [0], "proven": False}
        for op, runs in (("torchvision.roi_align", 16), ("aten.index_put", 64))]
    assert "the last repeat re-ran each op" in render_markdown(summary)
    assert "2 risky ops re-run 16 to 64 times on identical inputs" in render_console(summary)
    summary["probe"] = {**summary["probe"], "kind": "command"}  # (exec's)
    assert "the first run re-ran each op" in render_markdown(summary)


def test_the_map_shows_a_module_called_several_times_by_its_role_nearest_the_origin(
        planted: tuple[Path, dict[str, Any]]) -> None:
    """An RNN's cell, called at every time step: its first call the origin, the later ones
    propagated. The map kept the last call's role, so the origin was never shown in it."""
    from detaudit.report.sections import map_rows

    summary = copy.deepcopy(planted[1])
    summary["map"] = [{"step": 1, "module": "cell", "phase": "forward", "role": role}
                      for role in ("origin", "propagated", "propagated")]
    assert map_rows(summary) == {"cell": {1: {"forward": "origin"}}}
    row = next(line for line in render_markdown(summary).splitlines() if line.startswith("| cell "))
    assert row.replace(" ", "").startswith("|cell|1|–|–|")  # origin at steps: 1


def test_a_loss_that_differs_after_the_runs_part_says_how_long_it_hid_the_difference():
    """A Mask R-CNN script whose gradients differ from step 2 said "loss first differs at
    step 4 (epoch 3)" alone: read as the problem starting in epoch 3."""
    from detaudit.report.sections import loss_first_differs

    summary = {"loss": {"first_step": 4, "first_epoch": 3},
               "first_divergence": {"step": 2, "epoch": 2}}
    assert loss_first_differs(summary) == (
        "loss first differs at step 4 (epoch 3), 2 steps after the runs part (step 2, epoch "
        "2): the loss hid the difference until then")
    summary["first_divergence"] = {"step": 4, "epoch": 3}
    assert loss_first_differs(summary) == "loss first differs at step 4 (epoch 3)"
    # a step's loss is computed before its backward: the next one is the first to show it
    for phase in ("backward", "grad", "optimizer"):
        summary["first_divergence"] = {"step": 3, "epoch": 3, "phase": phase}
        assert loss_first_differs(summary) == (
            f"loss first differs at step 4 (epoch 3), 1 step after the runs part (step 3, "
            f"epoch 3, in {phase}, after that step's loss was computed)")
    summary["first_divergence"] = {"step": 3, "epoch": 3, "phase": "forward"}
    assert loss_first_differs(summary).endswith("the loss hid the difference until then")


class _OneLayerTwice(nn.Module):
    """One layer applied to two inputs in a step, as to each of two accumulated batches."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(a) + self.shared(b))


def test_a_module_called_twice_in_the_step_is_named_with_each_call():
    """Both calls of one layer part the runs (as a race does in the backward of each
    accumulated batch): the console named the layer alone, and its 'other origins' row read
    as the first origin once more."""
    from detaudit.report import render_console

    built = []

    def probe(device):
        torch.manual_seed(0)
        model = _OneLayerTwice()
        if built:  # the second repeat: each call of the layer 1 ULP up
            model.shared.register_forward_hook(
                lambda module, args, out: torch.nextafter(out, torch.full_like(out, 9.0)))
        built.append(model)
        batches = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(2)]
        return Probe(model=model, batches=batches, step=lambda m, b: m(*b).pow(2).mean(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    result = api.audit(probe, granularity="module", drill_down=False, stress=0)
    origins = [(o["phase"], o["module"], o["call"]) for o in result.summary["origins"]]
    assert origins == [("forward", "shared", 0), ("forward", "shared", 1)]
    console = render_console(result.summary)
    assert re.search(r"^module +shared \(call 0\)$", console, re.MULTILINE), console
    assert re.search(r"^phase +module +call +records$", console, re.MULTILINE), console
    assert re.search(r"^forward +shared +1 +out$", console, re.MULTILINE), console
    assert "| module | shared (call 0) |" in render_markdown(result.summary)
    # a first divergence in no module of the model takes no call; its origins keep theirs
    for first, shown in (({"outside": "(outside the model)", "module": "(outside the model)",
                           "phase": "backward"}, "(outside the model)"),
                         ({"module": "", "phase": "state", "slots": ["batch.0"]}, "(model)")):
        summary = copy.deepcopy(result.summary)
        summary["first_divergence"].update(first)
        console = render_console(summary)
        assert re.search(rf"^module +{re.escape(shown)}$", console, re.MULTILINE), console
        assert len(re.findall(r"^forward +shared +[01] +out$", console, re.MULTILINE)) == 2
    # the ops of two calls of one module: told apart by their call
    summary = copy.deepcopy(result.summary)
    summary["ops"] = [{"op": "aten.addmm", "module": "shared", "call": call, "phase": "forward",
                       "role": "origin", "differing": 1, "repeats": 2} for call in (0, 1)]
    markdown = render_markdown(summary)
    assert "| op | module | call | phase | role |" in markdown
    assert "| aten.addmm | shared | 1 | forward | origin |" in markdown


def test_a_size_the_step_did_not_record_is_said_to_be_missing_not_shown_as_a_dash_alone():
    """A scanned step keeps prints without sizes: the table's dashes were left unexplained."""
    from detaudit.report.sections import _size

    record = {"module": "fc", "call": 0, "slot": "param.weight", "step": 2,
              "ref": {"shape": [2, 4], "dtype": "float32"}, "other": {}}
    summary = {"first_divergence": {"role": "origin"}, "first_by_phase": {"grad": record}}
    said = _size(summary).blocks[0].text
    assert "A dash: no size was recorded" in said
    record["ref"]["norm"], record["other"]["norm"] = 1.0, 1.5
    assert "A dash" not in _size(summary).blocks[0].text


def test_runs_of_other_lengths_are_not_said_to_differ_in_length_when_one_stopped_early():
    """An interrupted or failed run is shorter because it stopped: the run line said "the
    runs differ in length", as if that were a finding."""
    from detaudit.report.sections import _run_line

    summary = {"repeats": 2, "steps_per_repeat": [3, 8], "epochs_per_repeat": [1, 2]}
    for verdict, said in (("divergent", "(the runs differ in length)"),
                          ("interrupted", "(not every run ran to its end)"),
                          ("failed", "(not every run ran to its end)")):
        line = _run_line({**summary, "verdict": verdict})
        assert line.endswith(f"2 repeats: 3 steps in 1 epoch and 8 steps in 2 epochs {said}")
