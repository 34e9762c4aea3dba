"""The analysis and every renderer against a checked-in run folder, without running a model.

`golden/planted/` holds two traces of a tiny CNN with a 1-ULP fault planted in the head's
addmm at step 1 (see `golden/make_run.py`); `golden/expected/` holds what every renderer
makes of it. After an intended change to a report, refresh the expected files with
``DETAUDIT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py`` and review the diff.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from detaudit import api
from detaudit.analysis.compare import ORIGIN, compare
from detaudit.analysis.diff import diff_traces
from detaudit.analysis.ranks import analyse, compare_ranks
from detaudit.analysis.verdict import judge
from detaudit.report import (
    render_console,
    render_github,
    render_html,
    render_markdown,
    summary_json,
)
from detaudit.report.junit import junit_case, junit_xml
from detaudit.runfolder import load_run

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

HERE = Path(__file__).parent / "golden"
RUN = HERE / "planted"
EXPECTED = HERE / "expected"
UPDATE = os.environ.get("DETAUDIT_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("golden") / "run"
    shutil.copytree(RUN, folder)
    return api.render_folder(folder)


def test_the_analysis_finds_the_planted_op() -> None:
    info, traces = load_run(RUN)
    c = compare(traces)
    assert (c.first_step, c.first_epoch, c.cause) == (1, 0, "forward")
    assert [(o.module, o.phase, o.role) for o in c.origins] == [("head", "forward", ORIGIN)]
    verdict = judge(c, info.extra["ops"])
    assert verdict.kind == "divergent" and verdict.exit_code == 1
    assert "op: aten.addmm in head" in verdict.headline
    assert judge(compare([traces[0], traces[0]])).kind == "deterministic"


def test_the_diff_of_the_two_repeats_names_the_step_and_module() -> None:
    _, traces = load_run(RUN)
    gate = diff_traces(traces[0], traces[1])
    assert not gate.ok and gate.exit_code == 1
    assert (gate.first.step, gate.origin_module, gate.origin_phase) == (1, "head", "forward")
    assert diff_traces(traces[0], traces[0]).ok


def test_the_same_traces_as_two_ranks_share_their_data() -> None:
    _, traces = load_run(RUN)
    by_rank = {0: traces, 1: traces}
    ranks = analyse(by_rank, compare_ranks(by_rank))
    assert [r.first_step for r in ranks.per_rank] == [1, 1]
    assert [c.key for c in ranks.flagged] == ["shards"]  # both ranks load the same batches
    verdict = judge(compare(traces), None, ranks)
    assert verdict.kind == "divergent"
    assert "(2 of 2 ranks diverge); 1 cross-rank check flagged" in verdict.headline


RENDERS = {
    "summary.json": summary_json,
    "console.txt": render_console,
    "report.md": render_markdown,
    "report.html": render_html,
    "report.github.html": render_github,
    "junit.xml": lambda s: junit_xml([junit_case("tiny", "detaudit.run", 0.0, False,
                                                 s["headline"], render_console(s))]),
}


@pytest.mark.parametrize("name", sorted(RENDERS))
def test_every_renderer_matches_its_golden_file(summary: dict, name: str) -> None:
    text = RENDERS[name](summary)
    gold = EXPECTED / name
    if UPDATE:
        gold.parent.mkdir(exist_ok=True)
        gold.write_text(text, encoding="utf-8")
    assert gold.exists(), f"no golden file {gold}: run with DETAUDIT_UPDATE_GOLDEN=1"
    assert text == gold.read_text(encoding="utf-8"), (
        f"{name} differs from {gold}; if the change is intended, refresh it with "
        "DETAUDIT_UPDATE_GOLDEN=1 and review the diff"
    )


def test_render_folder_writes_what_the_renderers_make(summary: dict, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    shutil.copytree(RUN, folder)
    again = api.render_folder(folder)
    assert again == summary
    for name in ("summary.json", "report.md", "report.html", "report.github.html"):
        assert (folder / name).read_text(encoding="utf-8") == RENDERS[name](again)
