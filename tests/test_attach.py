"""Auditing training detaudit does not drive: `detaudit exec -- python train.py` (the user's
script, unmodified) and `detaudit.watch(...)` around the user's own loop."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import importlib.util
import inspect
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
import types
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from conftest import module_audit
from test_cli import run_cli
from torch import nn

import detaudit
from detaudit.analysis.causes import cause_of, cause_text
from detaudit.analysis.compare import compare as compare_traces
from detaudit.analysis.diff import diff_traces
from detaudit.analysis.ranks import _rank_row
from detaudit.analysis.verdict import judge
from detaudit.config import (
    FAILED_AFTER_UPDATE,
    FIRST_PASS_UNFINISHED,
    LOADED_FROM_EARLIER_RUNS,
    OP_SITES,
)
from detaudit.drivers.attach import Attachment
from detaudit.drivers.attach_process import _loading_noted
from detaudit.execution import _is_launcher, _script_name
from detaudit.planting import check_side_fault
from detaudit.record.recorder import printed_now
from detaudit.record.structure import next_ulp
from detaudit.report import render_console
from detaudit.trace import OUTSIDE_MODEL, Trace

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

SCRIPT = Path(__file__).parent / "scripts" / "train_plain.py"


def _exec(tmp_path, *options, script_args=(), script=SCRIPT, env=None):
    return run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", *options, "--",
                   sys.executable, str(script), *script_args, env=env)


# exec's own process, with `import torch` failing in it (not in the command it runs)
WITHOUT_TORCH = ("import sys\nsys.modules['torch'] = sys.modules['torchvision'] = None\n"
                 "from detaudit.cli import main\nsys.exit(main(sys.argv[1:]))\n")


# -- exec ------------------------------------------------------------------------------------
def test_exec_of_a_seeded_script_is_deterministic_with_steps_and_epochs_as_the_script_runs(tmp_path):
    # DataLoader workers started by spawn run the bootstrap again: they must neither record
    # nor disturb the run (forked ones, the default, are in the other tests); a step timeout
    # far above its steps' time is no false alarm, and leaves nothing of its watch behind
    done = _exec(tmp_path, "--seed", "0", "--step-timeout", "300", script_args=("--spawn",))
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.suffix != ".json") == [
        "report.github.html", "report.html", "report.md", "trace-0.json.gz", "trace-1.json.gz"]
    assert "DETERMINISTIC" in done.stdout
    assert done.stdout.count("trained 4 steps") == 2  # the script ran to its end, twice
    traces = [Trace.load(tmp_path / "run" / f"trace-{r}.json.gz") for r in (0, 1)]
    # 4 batches per epoch, accumulation 2: 2 optimizer steps per epoch; the evaluation call
    # between epochs is not a step; the DataLoader's 2 workers recorded nothing
    assert sorted(p.name for p in (tmp_path / "run").glob("*.json.gz")) == [
        "trace-0.json.gz", "trace-1.json.gz"]
    assert [(s.step, s.epoch, s.index) for s in traces[0].steps] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert all(s.optimizer_stepped for s in traces[0].steps)
    records = traces[0].frame()
    step0 = records[records.step == 0]
    assert {"loss", "loss.1"} <= set(traces[0].steps[0].losses)  # both accumulated backwards
    batches = step0[(step0.phase == "state") & step0.slot.str.startswith("batch")]
    assert set(batches.call) == {0, 1}  # each accumulated call's batch
    assert {"param.weight", "param.bias"} <= set(step0[step0.phase == "grad"].slot)
    assert set(step0[step0.phase == "optimizer"].module) == {"stem", "head"}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["verdict"] == "deterministic"
    # which object was taken for the model, by its class (a script's: its __main__)
    assert summary["model_class"] == "__main__.Net"
    assert "; model __main__.Net; " in (tmp_path / "run" / "report.html").read_text()


def _planted_and_zoomed(tmp_path: Path, done: subprocess.CompletedProcess, fault: str,
                        ) -> dict[str, Any]:
    """What every exec audit of a planted fault shows (its first divergence at the planted
    module, phase and step, zoomed into; the reports' command): the run's run.json."""
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    module, step = fault.split("/")[0].split("@")[0], int(fault[-1])
    phase = fault.split("@")[1].split(":")[0]
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"], first["role"]) == (
        module, phase, step, "origin")
    cells = [json.dumps(cell, sort_keys=True) for cell in summary["map"]]
    assert cells and len(cells) == len(set(cells))  # the planted step is in the zoom too: once
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (run["extra"]["zoom"]["status"], run["extra"]["zoom"]["step"]) == ("found", step)
    assert f"planted fault {fault}" in (tmp_path / "run" / "report.md").read_text()  # its op too
    # the reports' command runs the same audit again: detaudit's options, the whole command
    ours, theirs = run["command"].split(" -- ")
    assert f"--inject-fault {fault}" in ours and "--seed 0" in ours and "--out" not in ours
    assert theirs.endswith("--workers 0 --accumulate 1")
    return run


def test_exec_names_a_planted_fault_by_module_phase_step(tmp_path):
    """(A planted op is named in the tied-weight test below.)"""
    # without accumulation: 1 ULP in one of two accumulated gradients can round away
    fault = "head@backward:2"
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "3", "--json", "--inject-fault", fault,
                 script_args=("--workers", "0", "--accumulate", "1"))
    run = _planted_and_zoomed(tmp_path, done, fault)
    # a module's planted change is no op's doing: it is the planted one, and said so
    assert run["extra"]["ops"]["outside_dispatcher"]["module"] == "head"
    assert run["extra"]["ops"]["outside_dispatcher"]["planted"] is True



def test_a_fault_in_the_backward_of_a_layer_whose_weight_is_tied_names_that_layer(tmp_path):
    """nanoGPT ties its embedding's weight to its output layer's: the weight is recorded
    under its first name (classes.weight here), and a fault planted in the output layer's
    weight-gradient op was headlined at the embedding. The op names the layer. (Also what
    any planted op fault shows under exec: the op named, its difference measured; and that
    exec's own process, scan, zoom and measure, runs without torch.)"""
    fault = "head/aten.mm@backward:1"
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "exec", "--out", str(tmp_path / "run"), "--quiet",
         "--seed", "0", "--max-steps", "3", "--json", "--inject-fault", fault, "--",
         sys.executable, str(SCRIPT), "--tied", "--workers", "0", "--accumulate", "1"],
        capture_output=True, text=True, timeout=600, check=False,
        env={k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"})
    run = _planted_and_zoomed(tmp_path, done, fault)
    origin = run["extra"]["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["role"]) == ("aten.mm", "head", "origin")
    # the zoom's replays kept the planted op's outputs: its 1 ULP is measured by the later
    # replay against the first's (it was not, for a command's runs, which are not rebuilt to
    # capture it), and what they left for the audit is gone
    assert (origin["elements"], origin["max_ulp"]) == (1, 1)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "| elements differing |" in report
    assert "not for a command's runs" not in report
    assert not [p.name for p in (tmp_path / "run").iterdir()
                if p.name.endswith((".kept.pt", ".measured.json"))]
    # (the later replay's reading of the first one's outputs is not the script's loading)
    assert not Trace.load(tmp_path / "run" / "zoom-1.json.gz").probe.get(LOADED_FROM_EARLIER_RUNS)
    summary = json.loads(done.stdout)
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"], first["slots"]) == (
        "head", "backward", 1, ["param.weight"])
    assert "head (origin; its weight is tied to classes.weight)" in summary["headline"]
    report = (tmp_path / "run" / "report.md").read_text()
    listed = report.split("modules with parameters")[1].split("\n\n")[1]
    assert [row.strip("| ") for row in listed.splitlines()[2:]] == ["stem", "classes", "head"]


@pytest.mark.alone  # a real race must fire
@pytest.mark.parametrize("update", ["optimizer", "by-hand"])
def test_exec_finds_a_real_race_in_the_script_and_names_its_op(tmp_path, update):
    # by hand: the gradients are recorded as an optimizer's, so the race is a backward
    # divergence, zoomed, not "cause: optimizer"
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "2", "--repeats", "3", "--json",
                 script_args=("--workers", "0", "--race")
                 + (("--by-hand",) if update == "by-hand" else ()))
    summary = json.loads(done.stdout)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    if done.returncode == 0:  # the race did not fire in any run: nothing to name
        assert summary["verdict"] == "deterministic"
        return
    assert done.returncode == 1, done.stderr
    zoom = run["extra"]["zoom"]
    if zoom["status"] == "intermittent":  # it did not fire again in the replays: said so
        assert len(zoom["attempts"]) == 3
        return
    origin = run["extra"]["ops"]["ops"][0]
    assert (origin["module"], origin["op"]) == ("gather", "aten.index_put")
    assert origin["elements"] >= 1  # measured from the outputs the replays kept
    assert summary["first_divergence"]["module"] == "gather"
    assert summary["cause"]["kind"] == "backward"


INFER_SCRIPT = Path(__file__).parent / "scripts" / "infer_plain.py"


def test_exec_of_an_inference_script_has_a_step_per_call_of_the_model(tmp_path):
    """No optimizer, the model in eval mode: each top-level call is a step, its batch and
    outputs recorded (it was 'ended before its first training step', exit 2)."""
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--max-steps", "4",
                   "--inject-fault", "body@forward:2", "--", sys.executable, str(INFER_SCRIPT))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "first at step 2 (epoch 1), forward, body (origin)" in done.stdout
    traces = [Trace.load(tmp_path / "run" / f"trace-{r}.json.gz") for r in (0, 1)]
    assert [len(t.steps) for t in traces] == [4, 4]  # --max-steps: model calls
    records = traces[0].frame()
    assert set(records[records.slot == "output"].step) == {0, 1, 2, 3}
    assert set(records[records.slot.str.startswith("batch")].step) == {0, 1, 2, 3}


@pytest.mark.alone  # a real race must fire
def test_exec_of_an_inference_script_finds_a_real_race_in_its_forward(tmp_path):
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--json", "--repeats",
                   "3", "--", sys.executable, str(INFER_SCRIPT), "--race")
    summary = json.loads(done.stdout)
    if done.returncode == 0:  # the race did not fire in any run: nothing to name
        assert summary["verdict"] == "deterministic"
        return
    assert done.returncode == 1, done.stderr
    assert (summary["first_divergence"]["module"], summary["cause"]["kind"]) == (
        "splat", "forward")


def test_watch_of_inference_records_each_call_of_the_model(tmp_path):
    def infer(out, nudge_at=None, **options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        with detaudit.watch(model, out=out, **options) as w, torch.no_grad():
            for call in range(5):
                model(x if call != nudge_at else torch.nextafter(x, x + 1))
        return w

    assert len(infer(tmp_path / "a").trace.steps) == 5
    infer(tmp_path / "a", nudge_at=3)
    c = detaudit.compare(tmp_path / "a").comparison
    assert (c.first_step, c.cause) == (3, "data")
    # (every RNG agrees: a source that seeds itself, a reinforcement learning environment,
    # is among what the text names, with its fix; it named a data pipeline's only)
    assert "env.reset(seed=...)" in cause_text(c), cause_text(c)
    # with an optimizer about (a script that also trains: its evaluation is no step),
    # inference is asked for
    trains = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    assert infer(tmp_path / "b").steps == 0
    assert len(infer(tmp_path / "b", mode="infer", max_steps=2).trace.steps) == 2
    del trains


def _unseeded_runs(folder: Path, loop: Callable[[], None]) -> None:
    """`loop` attached twice, into `folder`'s trace-0 and trace-1, each from an unseeded
    torch RNG state of its own, as a new process has."""
    with torch.random.fork_rng():
        for run in range(2):
            torch.seed()
            _attached(folder / f"trace-{run}.json.gz", loop)


def _attached(path: Path, loop: Callable[[], None], **options: Any) -> Trace:
    """`loop` run as exec attaches (no model given; `options` of Attachment), and its
    trace."""
    attachment = Attachment(path, {}, **options).install()
    try:
        loop()
        attachment.finish()
    finally:
        attachment.uninstall()
    return Trace.load(path)


def test_where_a_shorter_run_ended_is_no_fork_whatever_parted_the_runs_first(tmp_path):
    """A run resumed from another's checkpoint ran a step fewer, and the runs part at step 0
    (init): the step where it had ended was said to be a control-flow fork ("batch.0.0.image
    is missing in 1 repeat")."""
    lengths = iter([4, 3])

    def loop():
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(next(lengths)):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    _unseeded_runs(tmp_path, loop)
    result = detaudit.compare(tmp_path)
    assert (result.comparison.first_step, result.comparison.cause) == (0, "init")
    assert result.comparison.fork is None and result.summary["fork"] is None


def test_a_step_that_takes_more_of_the_loaders_batches_in_one_run_is_a_fork_said_so(tmp_path):
    """The fork was named by the record one run lacks, `batch.loader`, which says nothing
    to a user: it is a batch the DataLoader yielded, which that run's step did not take."""
    takes = iter([1, 2])

    def loop():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = iter(torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=2))
        extra = next(takes)
        for step in range(3):
            x = next(batches)
            if step == 1 and extra == 2:  # (a batch it skips)
                x = next(batches)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

    for run in range(2):
        _attached(tmp_path / f"trace-{run}.json.gz", loop)
    result = detaudit.compare(tmp_path)
    fork = result.summary["fork"]
    assert fork["step"] == 1 and fork["slot"].startswith("batch.loader"), fork
    said = render_console(result.summary)
    assert ("control flow forked at step 1: (model) batch.loader, call 1, is missing in 1 "
            "repeat (a batch the DataLoader yielded: the repeats' steps took other numbers of "
            "its batches)") in said, said


@pytest.mark.parametrize("foreach", [True, False])
def test_a_stressed_step_recorded_module_by_module_records_the_gradients_after_clipping(
        tmp_path, foreach):
    """The stress (a dispatch mode) left the gradients' version counters where clipping's
    in-place `_foreach_mul_` found them: at a step it stressed that was also recorded module
    by module (a planted fault's, in the run that goes without it), the gradients the
    optimizer received were taken for those backward left, unclipped, and differed from
    the planted run's: "gradients diverged" for a fault that changed no gradient."""
    def loop():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            (model(torch.randn(4, 8)) * 10).square().sum().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
            opt.step()
            opt.zero_grad()

    def grads(trace):
        records = trace.frame()
        return records[(records.phase == "grad") & (records.step == 0)].set_index("slot").fp

    stressed = _attached(tmp_path / "stressed.json.gz", loop, planted_step=0, stress=16)
    plain = _attached(tmp_path / "plain.json.gz", loop, planted_step=0)
    received = grads(stressed)[lambda fp: ~fp.index.str.startswith("left.")]
    assert len(received) == 4 and received.equals(
        grads(plain)[lambda fp: ~fp.index.str.startswith("left.")])
    left = grads(stressed)[lambda fp: fp.index.str.startswith("left.")]
    assert set(left.values).isdisjoint(received.values)  # (clipped: other values)


class _Noisy(torch.utils.data.Dataset):
    """Samples with noise drawn from numpy's global RNG in the worker, as a detectron2
    DatasetMapper draws its flips and resizes."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.full((4,), float(index)) + torch.from_numpy(np.random.rand(4)).float()


class _NoisyOwnRng(_Noisy):
    """Noise drawn from a generator the dataset makes without a seed."""

    def __init__(self):
        self.rng = np.random.default_rng()

    def __getitem__(self, index):
        return torch.full((4,), float(index)) + torch.from_numpy(self.rng.random(4)).float()


def _reseeds_from_urandom(worker_id):
    """detectron2's worker_init_reset_seed: seed_all_rng(None) seeds from the clock,
    os.urandom and the process id."""
    np.random.seed(int.from_bytes(os.urandom(4), "big") + worker_id)


@pytest.mark.parametrize("init, dataset, cause", [
    (_reseeds_from_urandom, _Noisy, "data"), (detaudit.seed_worker, _Noisy, "none"),
    (None, _NoisyOwnRng, "data")], ids=["reseeds", "fixed", "none"])
def test_a_data_cause_names_the_worker_init_fn_its_workers_ran(tmp_path, init, dataset, cause):
    """Workers that reseed from the clock in their worker_init_fn make each run's batches
    differ while every RNG of the loop's process agrees: the cause named the loader's
    generator and a dataset's default_rng, whose fixes do not help, never the function
    that reseeds. The fix it gives makes the runs agree; a loader without one gets no word
    of it."""
    import random

    def loop():
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(
            dataset(), batch_size=4, num_workers=2, worker_init_fn=init,
            multiprocessing_context="fork")
        for x in loader:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    with torch.random.fork_rng():
        for run in range(2):
            random.seed(0)
            np.random.seed(0)
            torch.manual_seed(0)
            _attached(tmp_path / f"trace-{run}.json.gz", loop)
    c = detaudit.compare(tmp_path).comparison
    said = cause_text(c)
    named = ("; its 2 worker processes each run the loader's worker_init_fn "
             f"(_reseeds_from_urandom at {__file__}:")
    assert c.cause == cause, said
    if cause == "data":
        assert c.first_step == 0
        assert (named in said) is (init is not None), said
        assert ("torch.initial_seed() % 2**32" in said) is (init is not None), said


class _MeasuredAsBuilt(nn.Module):
    """Calls its layers as it is built, each a top-level call (``self.forward`` is no module
    call): in training mode, as Ultralytics' YOLO measures its strides, then without
    gradients in eval mode, as it counts its FLOPs."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 1)])
        self.forward(torch.zeros(1, 4))
        self.eval()
        with torch.no_grad():
            self.forward(torch.zeros(1, 4))
        self.train()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_calls_a_model_makes_as_it_is_built_are_neither_steps_nor_batches(tmp_path):
    """They were taken for inference steps (with a step limit the run ended before the
    optimizer was made: a pass over no training) or, in training mode, for step 0's batch;
    and the settings the script made after building are those the steps ran under."""
    def loop():
        torch.manual_seed(0)
        model = _MeasuredAsBuilt()
        torch.use_deterministic_algorithms(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    try:
        trace = _attached(tmp_path / "t.json.gz", loop, max_steps=2, on_limit=lambda: None)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(trace.steps) == 2 and not trace.probe.get("inferred")
    records = trace.frame()
    batches = records[(records.step == 0) & (records.phase == "state")
                      & records.slot.str.startswith("batch")]
    assert [tuple(s) for s in batches["shape"]] == [(3, 4)], batches
    assert trace.env["deterministic_algorithms"] is True


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("dry_run", ["meta device", "lazy modules"])
def test_a_dry_run_is_neither_a_step_nor_a_batch(tmp_path, dry_run, grad):
    """A dry run on the meta device sizes the layers (Keras's symbolic build on torch does
    so): under no_grad, before any optimizer, it was taken for an inference step, whose
    outputs (no data) crashed the recording; with gradients on, in training mode, it was
    taken for step 0's batch. One that makes lazy modules' parameters (PyTorch's docs ask
    for it before the optimizer is built; torchrl's MLP is lazy) crashed the recording on
    the parameters not made yet."""
    def loop():
        torch.manual_seed(0)
        if dry_run == "lazy modules":
            model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
            with torch.set_grad_enabled(grad):
                model(torch.zeros(1, 4))
        else:
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            with torch.set_grad_enabled(grad):
                model.to("meta")(torch.empty(1, 4, device="meta"))
            model = model.to_empty(device="cpu")
            for p in model.parameters():
                nn.init.normal_(p, std=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(3):
            model(torch.full((2, 4), float(i))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    trace = _attached(tmp_path / "t.json.gz", loop)
    assert len(trace.steps) == 3 and not trace.probe.get("inferred"), trace.failure
    records = trace.frame()
    batches = records[(records.phase == "state") & records.slot.str.startswith("batch")]
    assert sorted(batches.step) == [0, 1, 2]
    assert [tuple(s) for s in batches["shape"]] == [(2, 4)] * 3


class _OlderNamedParameters(nn.Module):
    """Overrides ``named_parameters`` with the signature of older torch, as torchrl's
    LossModule does (no ``remove_duplicate``)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def named_parameters(self, prefix="", recurse=True):
        yield from super().named_parameters(prefix=prefix, recurse=recurse)

    def forward(self, x):
        return self.net(x)


def test_a_model_overriding_named_parameters_with_an_older_signature_is_recorded(tmp_path):
    """The recording asked it for ``remove_duplicate=False`` and crashed, blamed on the
    script ("exited with code 1 before its first step")."""
    def loop():
        torch.manual_seed(0)
        model = _OlderNamedParameters()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    trace = _attached(tmp_path / "t.json.gz", loop)
    assert len(trace.steps) == 2 and trace.failure is None


def test_an_evaluation_before_the_optimizer_is_made_is_no_inference_run(tmp_path):
    """A baseline evaluation first, then the optimizer and training: the run is training
    (taken for inference, its training was never recorded)."""
    def loop():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                model(torch.ones(2, 4))
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    trace = _attached(tmp_path / "t.json.gz", loop)
    assert [(s.step, s.optimizer_stepped) for s in trace.steps] == [(0, True), (1, True), (2, True)]
    assert trace.probe["config"]["mode"] == "train" and not trace.probe["inferred"]


def test_epochs_are_seen_in_a_run_that_evaluates_before_it_makes_its_optimizer(tmp_path):
    """The evaluation, taken for an inference step before training began, had no loader
    pass: "--max-epochs had no effect" was said of it, and kept once training counted its
    epochs."""
    def loop():
        model = nn.Linear(4, 1)
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 4))
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            for (x,) in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
                    torch.ones(4, 4)), batch_size=2):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()

    trace = _attached(tmp_path / "t.json.gz", loop, max_epochs=3)
    assert [s.epoch for s in trace.steps] == [0, 0, 1, 1]
    assert "epochs_unseen" not in trace.probe


def test_inference_records_every_model_called_and_one_left_in_training_mode(tmp_path):
    """Calls without gradients and no optimizer are inference even in training mode (a
    script that forgot eval()); an ensemble's or a pipeline's second model is recorded too
    (only the first was, so a difference in the second passed)."""
    def loop():
        torch.manual_seed(0)
        backbone, head = nn.Linear(4, 8), nn.Linear(8, 2)
        with torch.no_grad():
            for _ in range(2):
                head(backbone(torch.ones(2, 4)))

    trace = _attached(tmp_path / "t.json.gz", loop)
    records = trace.frame()
    outputs = records[records.slot == "output"]
    assert list(zip(outputs.step, outputs.module)) == [(0, ""), (1, "Linear"), (2, ""), (3, "Linear")]
    assert trace.probe["config"]["mode"] == "infer" and trace.probe["inferred"]


@pytest.mark.parametrize("op", [None, "aten.tanh"])
def test_a_fault_in_an_ensemble_members_own_forward_is_named_there(tmp_path, op):
    """Each call of a model is a step, its hooks set inside that call: the member's own call
    is entered all the same, so a fault at its output, or in an op of its own forward (not
    of a submodule), fires there and is recorded under its name (not the first model's)."""
    from detaudit.analysis.compare import compare
    from detaudit.config import Fault

    class Member(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 2)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    def run(path, fault=None):
        def loop():
            torch.manual_seed(0)
            first, member = nn.Linear(4, 8), Member()
            with torch.no_grad():
                for _ in range(2):
                    member(first(torch.ones(2, 4)))

        attachment = Attachment(path, {}, fault=fault, planted_step=3, zoom=3).install()
        try:
            loop()
            attachment.finish()
        finally:
            attachment.uninstall()
        return Trace.load(path)

    plain = run(tmp_path / "a.json.gz")
    faulted = run(tmp_path / "b.json.gz", Fault("Member", "forward", 3, op))
    assert faulted.probe["fault_fired"]
    c = compare([plain, faulted])
    assert (c.first_step, c.cause) == (3, "forward")
    assert [(o.module, o.phase) for o in c.origins] == [("Member", "forward")]
    ops = plain.frame()
    assert set(ops[ops.phase == "op.forward"].module) == {"Member", "Member.fc"}


@pytest.mark.parametrize("fault", ["a@forward", "b@backward", "b/aten.mm@backward"])
def test_gradients_clipping_rescales_are_no_origins_of_the_modules_they_belong_to(
        tmp_path, fault):
    """``clip_grad_norm_`` that always clips (Ultralytics') scales every gradient by a norm
    the planted fault made differ: each module whose own backward agreed was an origin of
    its own ("its inputs agree"). The gradients are also recorded as backward left them,
    before the loop's code: a difference made after is no module's; one a module's
    backward made, with clipping after it, is still that module's."""
    from detaudit.analysis.compare import compare

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(32, 8)

        def forward(self, x):
            h = torch.relu(self.stem(x))
            return self.a(h), self.b(h.detach())  # (b's gradient does not depend on a's)

    def loop():
        torch.manual_seed(0)
        model = Heads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            ya, yb = model(torch.randn(64, 16))
            # (a's loss magnifies a 1-ULP change: the norm every gradient is clipped by
            # differs in its last bits)
            ((ya * 1e5).sin().mean() + yb.square().mean()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            opt.zero_grad()

    def run(path, planted=None):
        return _attached(path, loop, fault=planted, planted_step=1, zoom=1)

    module, phase = fault.split("@")[0].split("/")[0], fault.split("@")[1]
    op = fault.split("@")[0].split("/")[1] if "/" in fault else None
    plain = run(tmp_path / "plain.json.gz")
    faulted = run(tmp_path / "faulted.json.gz", detaudit.Fault(module, phase, 1, op))
    c = compare([plain, faulted])
    assert (c.first_step, c.cause) == (1, phase)
    assert [(o.module, o.phase) for o in c.origins] == [(module, phase)]
    if phase == "forward":  # (the clipping made every gradient the update took differ)
        assert {m for _, m, _ in c.grad_diffs} == {"a", "b", "stem"}


def test_a_parametrized_layer_in_inference_leaves_one_model_and_a_step_per_call(tmp_path):
    """Reading a parametrized weight calls its parametrizations: the layers after it are
    no top-level calls (each was taken for another model, its output a step of its own)."""
    def loop():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        nn.utils.parametrizations.weight_norm(model[0])
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                model(torch.ones(2, 4))

    records = _attached(tmp_path / "t.json.gz", loop).frame()
    outputs = records[records.slot == "output"]
    assert list(zip(outputs.step, outputs.module)) == [(0, ""), (1, ""), (2, "")]


def test_inference_outputs_in_a_dataclass_are_compared(tmp_path):
    """A model returning a dataclass (a detection library's result type): its tensors and
    labels are the step's outputs (none was recorded, so any difference passed)."""
    from dataclasses import dataclass

    @dataclass
    class Detections:
        scores: torch.Tensor
        label: str

    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return Detections(self.fc(x), "cat")

    def loop():
        model = Detector().eval()
        with torch.no_grad():
            model(torch.ones(1, 4))

    records = _attached(tmp_path / "t.json.gz", loop).frame()
    assert set(records[records.phase == "output"].slot) == {"output.scores", "output.label"}


def test_two_models_trained_in_turn_are_one_step_per_iteration(tmp_path):
    """Co-teaching: both forwards, then each model's backward and update: one step (each
    iteration was two, so faults and limits landed in the wrong place)."""
    def loop():
        torch.manual_seed(0)
        nets = [nn.Linear(4, 1), nn.Linear(4, 1)]
        opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
        for _ in range(3):
            losses = [n(torch.ones(2, 4)).sum() for n in nets]
            for loss, opt in zip(losses, opts):
                loss.backward()
                opt.step()
                opt.zero_grad()

    trace = _attached(tmp_path / "t.json.gz", loop)
    assert len(trace.steps) == 3
    assert all(set(s.losses) == {"loss", "loss.1"} for s in trace.steps)


@pytest.mark.alone  # a real race must fire
def test_a_real_divergence_before_a_planted_fault_is_the_verdict(tmp_path):
    """The race parts the runs at step 0, before the fault planted at step 1: the zoom's
    replays stop at step 0, where the fault is not reached (that was 'the planted fault
    never fired', exit 2, and no report)."""
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "2", "--json", "--inject-fault",
                 "head@forward:1", script_args=("--workers", "0", "--race"))
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    first = summary["first_divergence"]
    if first["step"] == 0:  # the race fired (else the planted fault is what was found)
        assert first["module"] == "gather"
    else:
        assert (first["step"], first["module"]) == (1, "head")
    assert (tmp_path / "run" / "report.html").exists()


_HIDDEN_RACE = """\
import sys
import torch
torch.set_num_threads(2)
torch.manual_seed(0)
g = torch.Generator().manual_seed(3)
votes = torch.randn(40_000, 4, generator=g)
cells = torch.randint(0, 64, (40_000,), generator=g)

def splat():
    return votes.new_zeros(64, 4).index_put_((cells,), votes, accumulate=True)

class Splat(torch.nn.Module):
    def forward(self, x):
        return x + 0 * splat().sum()  # (the race's result weighs nothing)

inside = sys.argv[1] == "inside"
model = torch.nn.Sequential(torch.nn.Linear(4, 1), *[Splat()] * inside)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
    (loss if inside else loss + 0 * splat().sum()).backward()
    opt.step()
    opt.zero_grad()
"""


_SPLAT_LINE = next(n for n, line in enumerate(_HIDDEN_RACE.splitlines(), 1)
                   if "index_put_(" in line)


@pytest.mark.parametrize("where, stress, module", [
    # outside the model, with the line of the script's code that ran it (the stressed runs
    # alone: the race must fire, on both cores)
    pytest.param("outside", "16", f"(outside the model) at hidden_race.py:{_SPLAT_LINE}",
                 marks=pytest.mark.alone),
    pytest.param("inside", "16", "1", marks=pytest.mark.alone), ("outside", "0", None)])
def test_exec_proves_a_race_whose_result_the_runs_never_showed(tmp_path, where, stress, module):
    """A splat whose result weighs nothing in the loss: the runs agree bit for bit, and
    exec said DETERMINISTIC (a Mask R-CNN script's race that rounded away did so twice);
    its first run re-executes the risky ops at each epoch's first step, as run does, and
    names the module each ran in (`--stress 0`: not, and the runs agree)."""
    script = tmp_path / "hidden_race.py"
    script.write_text(_HIDDEN_RACE)
    done = _exec(tmp_path, "--seed", "0", "--stress", stress, script=script,
                 script_args=(where,))
    if module is None:
        assert done.returncode == 0 and done.stdout.startswith("DETERMINISTIC"), done.stdout
        assert not Trace.load(tmp_path / "run" / "trace-0.json.gz").stress["step"]
        return
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith(
        f"NONDETERMINISTIC OP: aten.index_put_ in {module} (forward, step 0, epoch 1) gave ")
    assert done.stdout.rstrip().endswith("(the 2 repeats agreed this time)")
    trace = Trace.load(tmp_path / "run" / "trace-0.json.gz")
    assert set(trace.stress["step"]) == {0} and not Trace.load(
        tmp_path / "run" / "trace-1.json.gz").stress["step"]  # (the first run's alone)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "At the first step of every epoch the first run re-ran each op" in report
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["stress"] == 16
    # the re-executions' time, as run gives it (the README said exec did; it did not)
    seconds = [t.get("stress_seconds") for t in run["timings"]]
    assert seconds[0] > 0 and seconds[1] is None, seconds
    assert " (re-executions: " in report


@pytest.mark.parametrize("form", ["wrapper", "in-place"])
def test_exec_of_a_compiled_model_names_a_planted_fault_by_the_users_names(tmp_path, form):
    # torch.compile would trace the global hooks into its graph (and the recorder's module
    # hooks at a step recorded module by module): they stay out of it, that step runs eagerly
    # (the planted step is one in every run; the wrapper's is zoomed too)
    zoom = () if form == "wrapper" else _NAMED_BY_THE_SCAN
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "3", "--json", *zoom, "--inject-fault",
                 "head@forward:1",
                 script_args=("--workers", "0", "--accumulate", "1", "--compile", form))
    assert done.returncode == 1, done.stderr
    first = json.loads(done.stdout)["first_divergence"]
    assert (first["module"], first["phase"], first["step"], first["role"]) == (
        "head", "forward", 1, "origin")
    records = Trace.load(tmp_path / "run" / "trace-0.json.gz").frame()
    assert {"stem", "head", ""} == set(records[records.phase == "optimizer"].module)  # ("":
    # the learning rates, at the planted step)
    assert not records.module.str.contains("_orig_mod").any()
    assert "global hooks" not in done.stderr  # torch's warning about detaudit's own hooks


@pytest.mark.parametrize("form", ["function", "step"])
def test_exec_of_a_compiled_training_function_records_its_steps_and_zooms_eagerly(
        tmp_path, form):
    """The model runs inside a compiled function, where no module hook runs: the model is
    found from what the optimizer updates, the steps are recorded from their losses,
    gradients and parameters, and the planted step runs eagerly, module by module. A
    function that calls backward too runs it eagerly, detaudit's recording kept out of its
    graph (it broke the graph and recompiled it).
    `function` runs a script that seeds torch only: numpy's and Python's RNG differ from
    the start, unused. The scan steps (no call seen) record the RNG states too, so the
    zoomed step's cause is the planted backward, not "the numpy, python RNG state already
    differs" (the zoom saw those states first, at that step)."""
    seeding = ("--seed-self",) if form == "function" else ()
    done = _exec(tmp_path, *(() if seeding else ("--seed", "0")), "--max-steps", "3",
                 "--json", "--inject-fault", "head@backward:1",
                 script_args=("--workers", "0", "--accumulate", "1", "--compile", form,
                              *seeding))
    assert done.returncode == 1, done.stderr
    assert "Graph break" not in done.stderr and "recompile" not in done.stderr
    summary = json.loads(done.stdout)
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"], first["role"]) == (
        "head", "backward", 1, "origin")
    assert summary["cause"]["kind"] == "backward", summary["cause"]
    assert summary["calls_unseen"]
    assert "inside a compiled function" in (tmp_path / "run" / "report.md").read_text()
    if seeding:
        assert {"numpy", "python"} <= set(summary["idle_rng"])
    trace = Trace.load(tmp_path / "run" / "trace-0.json.gz")
    assert [sorted(s.losses) for s in trace.steps] == [["loss"]] * 3
    records = trace.frame()
    assert {"stem", "head", ""} == set(records[records.phase == "optimizer"].module)  # ("":
    # the learning rates, at the planted step)
    assert set(records[records.step == 0].phase) == {"state", "output", "grad",
                                                     "optimizer"}
    assert {"stem", "head"} <= set(records[(records.step == 1)
                                           & (records.phase == "forward")].module)


_RESEEDS_FROM_THE_CLOCK = """
import time, torch
from torch import nn
torch.manual_seed(time.time_ns() % (1 << 31))
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.ones(8, 4)
for _ in range(2):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_exec_with_seed_of_a_script_that_reseeds_from_the_clock_says_it_reseeds(tmp_path):
    """--seed was given: the advice is not to give it, but that the code reseeds."""
    script = tmp_path / "clock.py"
    script.write_text(_RESEEDS_FROM_THE_CLOCK)
    done = _exec(tmp_path, "--seed", "3", "--json", script=script)
    assert done.returncode == 1, done.stderr
    cause = json.loads(done.stdout)["cause"]
    assert cause["kind"] == "init"
    # the values each run drew and the line that seeds with them
    assert cause["text"].startswith("the code seeds torch with a different value in each run (")
    assert f"; at {script}:4) although detaudit seeded every RNG (3) before the code ran" in (
        cause["text"])
    assert "--seed" not in cause["text"]


def test_exec_with_seed_of_a_script_that_reseeds_then_draws_noise_says_it_reseeds(tmp_path):
    """--seed was given, and the script reseeds torch from the clock after building its
    model, then adds noise to each batch in its loop: the first batch differs, and the
    cause said the torch RNG was "not seeded", with the fix to seed it."""
    script = tmp_path / "noise.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch import nn
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.seed()
        for _ in range(2):
            x = torch.ones(8, 4) + 0.1 * torch.randn(8, 4)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        """))
    done = _exec(tmp_path, "--seed", "3", "--json", script=script)
    assert done.returncode == 1, done.stderr
    cause = json.loads(done.stdout)["cause"]
    assert cause["kind"] == "data"
    assert cause["text"].startswith("the torch RNG state differs before the first step "
                                    "although detaudit seeded every RNG (3)"), cause["text"]
    assert "whose batch draws from it and differs" in cause["text"]


def test_exec_without_seed_of_set_ordered_loss_terms_points_at_the_hash_seed(tmp_path):
    """Loss weights zipped with a set of names: each run of the command, a process with its
    own hash seed, weighs the terms differently; the cause says to rule that out, the zoom
    that no op is nondeterministic, and --seed (which fixes PYTHONHASHSEED) makes the runs
    agree."""
    script = tmp_path / "set_order.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "TERMS = ['cls', 'box', 'objectness', 'rpn_box', 'mask', 'keypoint', 'aux', 'centre']\n"
        "torch.manual_seed(0)\nmodel = nn.Linear(8, len(TERMS))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "for _ in range(2):\n    out = model(torch.ones(4, 8))\n"
        "    loss = sum((i + 1) * out[:, TERMS.index(n)].pow(2).mean()\n"
        "               for i, n in enumerate(set(TERMS)))\n"
        "    loss.backward()\n    opt.step()\n    opt.zero_grad()\n")
    done = _exec(tmp_path, "--json", script=script)
    assert done.returncode == 1, done.stderr
    said = json.loads(done.stdout)["cause"]["text"]
    assert "each run had a hash seed of its own (no --seed)" in said
    # the zoom's op records: the loss's first op takes other inputs, and no op is to blame
    assert "replayed op by op, the first op that differs, aten." in said
    assert ("in (outside the model) (forward), already takes other inputs, and no op differs "
            "on equal inputs: no op is nondeterministic") in said
    assert "unconfirmed" not in said
    shutil.rmtree(tmp_path / "run")
    assert _exec(tmp_path, "--seed", "0", script=script).returncode == 0


def test_an_inference_run_has_no_loss_to_hide_a_difference(tmp_path):
    """Two inference runs of differently initialised models: outputs and parameters differ,
    and no loss 'stayed bit-identical' (inference has none)."""
    for n in range(2):
        torch.manual_seed(n)
        model = nn.Linear(4, 2).eval()
        with torch.no_grad(), detaudit.watch(model, out=tmp_path, mode="infer"):
            model(torch.ones(3, 4))
    result = detaudit.compare(tmp_path)
    assert result.verdict.kind == "divergent" and result.comparison.cause == "init"
    assert not result.verdict.loss_hidden
    assert "bit-identical" not in result.verdict.headline


def test_exec_without_seed_finds_the_unseeded_initialisation(tmp_path):
    done = _exec(tmp_path, "--max-steps", "2", "--json")
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    assert summary["exit_code"] == 1 and summary["cause"]["kind"] == "init"
    assert summary["first_divergence"]["step"] == 0
    assert "seed" in summary["cause"]["text"]
    # torch's state no longer moves once the workers load the data, but it was drawn from
    # before the first step (the initialisation): never called unused
    assert summary["idle_rng"] == []
    assert "note: the RNG state" not in done.stderr
    report = (tmp_path / "run" / "report.md").read_text()
    assert "device cpu; not seeded by detaudit;" in report and "cpu; seed 0" not in report
    assert "device" not in summary["config"]  # the script chose it: the traces say which
    # a script that seeds itself needs no --seed, and is said to seed itself, where (it was
    # labelled "unseeded")
    done = _exec(tmp_path, "--max-steps", "2", "--overwrite", script_args=("--seed-self",))
    assert done.returncode == 0, done.stdout + done.stderr
    line = SCRIPT.read_text().splitlines().index("        torch.manual_seed(0)") + 1
    report = (tmp_path / "run" / "report.md").read_text().replace("\\_", "_")
    assert f"device cpu; seeded by the code (0 at {SCRIPT}:{line});" in report
    assert "run without --seed" not in report  # (audited without it: nothing to say)
    # with --seed as well: the runs agree, and what --seed fixed for the script is said
    # (a hash-seed-dependent draw the script's users get was hidden by it without a word)
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "2", "--overwrite",
                 script_args=("--seed-self",))
    assert done.returncode == 0, done.stdout + done.stderr
    report = (tmp_path / "run" / "report.md").read_text().replace("\\_", "_")
    assert (f"Note: the script seeds torch itself (0 at {SCRIPT}:{line}), and --seed also "
            "fixed what its seeding leaves to each run") in report


# A loader that fetches one batch ahead of the loop, as accelerate's does (to know which
# batch is the last), and a trainer that takes a step's every micro-batch before its first
# (the Hugging Face Trainer's get_batch_samples), compiled as library code (installed under
# the Python's packages) is.
_LIBRARY_CODE = (
    "class FetchingAhead(torch.utils.data.DataLoader):\n"
    "    def __iter__(self):\n"
    "        batches = super().__iter__()\n"
    "        current = next(batches)\n"
    "        for upcoming in batches:\n"
    "            yield current\n"
    "            current = upcoming\n"
    "        yield current\n"
    "def micro_batches(batches, n):\n"
    "    while taken := [b for _, b in zip(range(n), batches)]:\n"
    "        yield taken\n")


def _library(path: Path) -> dict[str, Any]:
    """The library code above, compiled as the module at `path`."""
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(_LIBRARY_CODE, str(path), "exec"), namespace)  # noqa: S102
    return namespace


_LIBRARY_NAMESPACE = _library(Path(sysconfig.get_paths()["purelib"]) / "fetching" / "loader.py")
_FetchingAhead = _LIBRARY_NAMESPACE["FetchingAhead"]
_micro_batches = _LIBRARY_NAMESPACE["micro_batches"]


def _installed_on_pythonpath(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The library code as a package pip installed into a folder on PYTHONPATH (`pip
    install --target`): a distribution, outside the Python's own packages."""
    site = tmp_path / "site"
    info = site / "fetching_elsewhere-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fetching-elsewhere\n"
                                   "Version: 1.0\n")
    (info / "top_level.txt").write_text("fetching_elsewhere\n")
    (site / "fetching_elsewhere").mkdir()
    monkeypatch.syspath_prepend(str(site))
    return _library(site / "fetching_elsewhere" / "loader.py")


class _ShiftedAt(torch.utils.data.Dataset):
    """8 samples, sample `at` shifted by `shift` (a run's own noise)."""

    def __init__(self, at: int | None, shift: float):
        self.x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        self.at, self.shift = at, shift

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.x[i] + (self.shift if i == self.at else 0.0)


def _in_a_thread(loader: Any) -> Iterator[Any]:
    """The loader's batches, fetched by a thread of their own (a prefetching pipeline)."""
    fetched: queue.Queue = queue.Queue(maxsize=2)
    thread = threading.Thread(target=lambda: [*map(fetched.put, loader), fetched.put(None)])
    thread.start()
    while (batch := fetched.get()) is not None:
        yield batch
    thread.join()


# the loop; the step fed sample 5 (where the noise is); the loader batches of each step
_FEEDS = {
    "fetching ahead": (2, [1] * 4), "two batches a step": (2, [2] * 4),
    "fetching ahead, installed on PYTHONPATH": (2, [1] * 4),
    "mixed in place": (2, [1] * 4), "micro-batches fetched first": (1, [2] * 2),
    "accumulated while fetching ahead": (1, [2] * 2), "fetched in a thread": (2, []),
}


@pytest.mark.parametrize("loop", _FEEDS)
def test_each_loader_batch_is_recorded_in_the_step_it_feeds(tmp_path, loop, monkeypatch):
    """A loader that fetches ahead of the loop (accelerate's) yields the next step's batch
    during this one: it was filed there, and a difference in it was reported a step early.
    A loop that takes two batches a step keeps both in it; so does a step of two micro-
    batches, taken before its first with one more fetched ahead (the Hugging Face Trainer
    through accelerate; the look-ahead was taken for 2), or one by one (accumulation by the
    loop). A batch the loop changes in place (a Mixup) is recorded as the loader yielded
    it. A loader a thread of its own iterates is not followed: when the loop takes a batch
    is a race, and filing it by that gave runs that differ. A library installed in a folder
    on PYTHONPATH is a library too (the loop's own code was thought to fetch ahead)."""
    fetching_ahead = (_installed_on_pythonpath(tmp_path, monkeypatch)["FetchingAhead"]
                      if loop.endswith("PYTHONPATH") else _FetchingAhead)

    def train(noise: float) -> None:  # in sample 5: the third batch of 2
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = _ShiftedAt(None if loop == "mixed in place" else 5, noise)
        if loop == "two batches a step":
            pairs = iter(torch.utils.data.DataLoader(data, batch_size=1))
            steps = ([torch.cat([x, next(pairs)])] for x in pairs)
        elif loop == "micro-batches fetched first":
            steps = _micro_batches(iter(_FetchingAhead(data, batch_size=2)), 2)
        elif loop == "accumulated while fetching ahead":
            ahead = iter(_FetchingAhead(data, batch_size=2))
            steps = ([x, next(ahead)] for x in ahead)  # (the pair's second: the loop's)
        elif loop == "fetched in a thread":
            steps = ([x] for x in _in_a_thread(torch.utils.data.DataLoader(data, batch_size=2)))
        else:
            steps = ([x] for x in (fetching_ahead if loop.startswith("fetching ahead") else
                                   torch.utils.data.DataLoader)(data, batch_size=2))
        for step, micro in enumerate(steps):
            for x in micro:
                if loop == "mixed in place" and step == 2:
                    x.add_(noise)
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    for run, noise in enumerate((0.0, 0.25)):
        _attached(tmp_path / f"trace-{run}.json.gz", functools.partial(train, noise))
    fed, per_step = _FEEDS[loop]
    c = detaudit.compare(tmp_path).comparison
    assert c.first_step == fed and c.cause == "data", (c.first_step, c.cause)
    records = Trace.load(tmp_path / "trace-0.json.gz").frame()
    loaded = records[records.slot.str.startswith("batch.loader")]
    assert loaded.groupby("step").call.nunique().tolist() == per_step
    differing = {d.slot for d in c.first_diffs}
    if loop == "mixed in place":  # the loader's batch agrees; the model's input does not
        assert "batch.0" in differing and not any(
            slot.startswith("batch.loader") for slot in differing), differing
        assert "changed them after loading" in cause_text(c)
    elif per_step:
        assert any(slot.startswith("batch.loader") for slot in differing), differing
    assert Trace.load(tmp_path / "trace-0.json.gz").probe.get("loader_in_a_thread") is (
        True if loop == "fetched in a thread" else None)


def test_a_loader_in_a_thread_beside_an_evaluation_loader_in_the_loops_follows_neither(
        tmp_path):
    """Training batches prefetched in a thread (MONAI's ThreadDataLoader), an evaluation
    loader iterated by the loop itself after each epoch: the evaluation loader was taken
    for the one that feeds the steps, its pass counted as the next epoch (a step late, so
    --max-epochs 1 ran a step of epoch 2) and, as its workers' timing fell, its batch filed
    in a training step (a false DIVERGENT, cause: data)."""
    def train() -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        training = torch.utils.data.DataLoader(_ShiftedAt(None, 0.0), batch_size=4)
        evaluation = torch.utils.data.DataLoader(_ShiftedAt(None, 0.0), batch_size=2)
        for _ in range(2):
            for x in _in_a_thread(training):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            with torch.no_grad():
                for x in evaluation:
                    model.eval()(x)
            model.train()

    trace = _attached(tmp_path / "t.json.gz", train, max_epochs=1, on_limit=lambda: None)
    assert trace.probe.get("loader_in_a_thread") is True
    assert [s.epoch for s in trace.steps] == [0] * 4  # (passes not counted: the limit never fires)
    records = trace.frame()
    assert not records.slot.str.startswith("batch.loader").any()


class _RepeatSampler:
    """A batch sampler that never ends."""

    def __init__(self, sampler: Any):
        self.sampler = sampler

    def __iter__(self):
        while True:
            yield from iter(self.sampler)


class _InfiniteLoader(torch.utils.data.DataLoader):
    """Ultralytics' InfiniteDataLoader (timm's MultiEpochsDataLoader alike): one iterator
    serves every pass, so that the workers live on; made as the loader is (older versions)
    or at its first pass, by ``_get_iterator`` (newer)."""

    def __init__(self, *args: Any, lazy: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "batch_sampler", _RepeatSampler(self.batch_sampler))
        self.iterator = None if lazy else super().__iter__()

    def __len__(self):
        return len(self.batch_sampler.sampler)

    def __iter__(self):
        if self.iterator is None:
            self.iterator = self._get_iterator()
        for _ in range(len(self)):
            yield next(self.iterator)


class _ResettingLoader(torch.utils.data.DataLoader):
    """Serves each pass from one iterator, reset by the loader itself once exhausted (as
    torchdata's StatefulDataLoader does with persistent workers)."""

    def __init__(self, *args: Any, lazy: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.iterator = None

    def __iter__(self):
        if self.iterator is None:
            self.iterator = self._get_iterator()
        else:
            self.iterator._reset(self)
        return self.iterator


@pytest.mark.parametrize(("kind", "lazy"), [
    (_InfiniteLoader, False), (_InfiniteLoader, True), (_ResettingLoader, True)])
def test_a_loader_whose_one_iterator_serves_every_pass_still_has_epochs(tmp_path, kind, lazy):
    """Each pass begins where the loader's own __iter__ is called, or where it resets its
    iterator: every step was in epoch 0, and the epoch limit never ended the run (an
    iterator made by _get_iterator was not followed at all). Nested attachments leave the
    loader's class as it was."""
    own_iter = vars(kind)["__iter__"]

    def loop():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = kind(_ShiftedAt(None, 0.0), batch_size=2, lazy=lazy)
        with contextlib.suppress(_Limit):
            for _ in range(4):
                for x in loader:
                    model(x).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()

    def _raise():
        raise _Limit

    outer = Attachment(tmp_path / "outer.json.gz", {}).install()
    try:
        trace = _attached(tmp_path / "t.json.gz", loop, max_epochs=2, on_limit=_raise)
        assert vars(kind)["__iter__"] is not own_iter  # (followed while one is installed)
    finally:
        outer.uninstall()
    assert [s.epoch for s in trace.steps] == [0] * 4 + [1] * 4
    assert [s.index for s in trace.steps] == [0, 1, 2, 3] * 2
    assert vars(kind)["__iter__"] is own_iter


def test_the_batches_of_an_inference_loop_are_recorded_in_its_steps(tmp_path):
    """Each call of the model, a step, is filed the batch the loader yielded for it."""
    def infer(noise: float) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1).eval()
        with torch.no_grad():
            for x in torch.utils.data.DataLoader(_ShiftedAt(5, noise), batch_size=2):
                model(x)

    for run, noise in enumerate((0.0, 0.25)):
        _attached(tmp_path / f"trace-{run}.json.gz", functools.partial(infer, noise))
    records = Trace.load(tmp_path / "trace-0.json.gz").frame()
    loaded = records[records.slot.str.startswith("batch.loader")]
    assert loaded.groupby("step").call.nunique().tolist() == [1] * 4
    c = detaudit.compare(tmp_path).comparison
    assert c.first_step == 2 and c.cause == "data", (c.first_step, c.cause)
    assert any(d.slot.startswith("batch.loader") for d in c.first_diffs)


class _GraphBatch:
    """A batch object as PyTorch Geometric's loaders yield (``Batch``): its attributes read
    through ``to_dict()``, no mapping, sequence or dataclass."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"x": self.x, "y": self.y}


class _PlainBatch:
    """A batch class of the loop's own: attributes, nothing else."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y


@pytest.mark.parametrize("batch_type", [_GraphBatch, _PlainBatch, collections.UserDict])
def test_labels_in_a_batch_object_a_loss_takes_outside_the_model_are_step_state(
        tmp_path, batch_type):
    """The labels of a PyTorch Geometric ``Batch``, of a batch class of the loop's own, or
    of a mapping that is no dict (Hugging Face's ``BatchEncoding``) went unrecorded: noise in
    them was found as a forward difference "outside the model", with advice about loss terms
    summed in a set's order."""
    def train(noise: float) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [(torch.full((4,), float(i)), torch.tensor([i + (noise if i == 5 else 0.0)]))
                for i in range(8)]
        def collate(items):
            x, y = torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])
            return batch_type(x=x, y=y)
        for batch in torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate):
            x, y = (batch["x"], batch["y"]) if isinstance(batch, (dict, collections.UserDict)) \
                else (batch.x, batch.y)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    for run, noise in enumerate((0.0, 0.25)):
        _attached(tmp_path / f"trace-{run}.json.gz", functools.partial(train, noise))
    c = detaudit.compare(tmp_path).comparison
    assert c.first_step == 2 and c.cause == "data", (c.first_step, c.cause)
    assert [d.slot for d in c.first_diffs if d.slot.startswith("batch.loader")] == [
        "batch.loader.y"]


def test_labels_a_loss_takes_outside_the_model_are_step_state(tmp_path):
    # the model sees equal images; the labels the DataLoader's workers yield differ run to
    # run (an unseeded generator; all 8 labels of step 0 agree by chance once in 4**8 runs):
    # the cause is the data, not a forward computation
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "2", "--json",
                 script_args=("--label-noise",))
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    assert summary["cause"]["kind"] == "data"
    first = summary["first_divergence"]
    assert (first["step"], first["phase"]) == (0, "state")
    assert summary["zoom"] is None  # nothing to zoom into: the step state decides it
    trace = Trace.load(tmp_path / "run" / "trace-0.json.gz").frame()
    loaded = trace[(trace.step == 0) & trace.slot.str.startswith("batch.loader")]
    # each of the step's 2 accumulated batches: (images, labels)
    assert sorted(zip(loaded.call, loaded.slot)) == [
        (0, "batch.loader.0"), (0, "batch.loader.1"), (1, "batch.loader.0"),
        (1, "batch.loader.1")]


def test_max_steps_stops_a_script_that_would_run_forever_and_swallows_exits(tmp_path):
    started = time.monotonic()
    # (a folder of a short path: a DataLoader worker sends its batch's shared memory through
    # a socket made in the TMPDIR, and past 107 bytes of path its batch is lost and the loop
    # waits for it forever, as tmp_path/"tmp" made it once pytest numbered its runs past 99)
    temporary = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR")))
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "3", "--repeats", "1",
                 script_args=("--forever", "--workers", "2"), env={"TMPDIR": str(temporary)})
    # one run, stopped cleanly; nothing to compare it with, which is no pass
    assert done.returncode == 2 and "NOT COMPARED" in done.stdout, done.stdout + done.stderr
    assert time.monotonic() - started < 60
    trace = Trace.load(tmp_path / "run" / "trace-0.json.gz")
    assert len(trace.steps) == 3 and trace.failure is None
    # 2 steps per epoch: the configuration says the 2 epochs the command ran, not a stand-in
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["epochs"] == 2
    # its DataLoader workers were ended as a loop's end ends them, not killed: each removed
    # the temporary folder it made to pass batches (killed, each left a pymp-* folder)
    assert not list(temporary.glob("pymp-*"))
    assert "temporary folder" not in done.stderr  # (short enough: see the next test)


def test_a_temporary_folder_too_long_for_a_dataloader_workers_socket_is_said(tmp_path):
    """The loop of a script whose DataLoader workers send batches waits forever for them
    when the temporary folder leaves too little room for their socket's path: said first."""
    long = tmp_path / ("x" * 60)
    long.mkdir()
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--", sys.executable, "-c",
                   "print()", env={"TMPDIR": str(long)})
    assert done.returncode == 2  # (it made no step)
    assert "is a long path: a DataLoader worker's socket there would pass the 107 bytes" in (
        done.stderr)


def test_a_run_that_hangs_is_stopped_at_the_step_timeout_saying_where(tmp_path):
    """A real hang: DataLoader workers whose socket path is too long (a long TMPDIR) lose
    every batch, and the loop waits for the first forever. With --step-timeout the run is
    stopped, FAILED (never a pass, never a divergence), naming the loop's line and the
    loader's function it waited in, and the stacks of its threads are kept; no second run
    is started, as none could be compared."""
    long = tmp_path / ("x" * 60)
    long.mkdir()
    script = tmp_path / "workers.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch.utils.data import DataLoader

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in DataLoader(torch.ones(8, 4), batch_size=2, num_workers=2):
            model(x).sum().backward()
            opt.step()
    """))
    done = _exec(tmp_path, "--step-timeout", "15", "--json", script=script,
                 env={"TMPDIR": str(long)})
    assert done.returncode == 3, done.stdout + done.stderr
    headline = json.loads(done.stdout)["headline"]
    assert headline.startswith(
        f"FAILED: repeat 0 stopped: no step ended within the --step-timeout (15 s); it was at "
        f"{script}:6, in _try_get_data of torch/utils/data/dataloader.py:"), headline
    assert ("(before its first step completed); the stacks of its threads: stacks-0.txt; "
            "repeat 1 was not run (no step to compare)") in headline
    stacks = (tmp_path / "run" / "stacks-0.txt").read_text()
    assert stacks.startswith("process ") and "Thread MainThread (most recent call last):" in (
        stacks)
    assert f'File "{script}", line 6, in <module>' in stacks
    assert "_stopped_by_the_timeout" not in stacks  # (the handler's own frames left out)
    # nothing of the watch is left beside the run's traces
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "trace" in p.name
                  or "attach" in p.name) == ["trace-0.json.gz"]


def test_the_step_timeout_stops_each_rank_under_a_thin_launcher_saying_where_each_was(
        tmp_path):
    """Rank 1 hangs as step 2 begins, rank 0 waits in its backward for it (the all-reduce):
    the script's own process, a thin launcher with no torch, ends at once on SIGTERM, and
    each rank is still asked to stop and given the time to say where it was."""
    script = tmp_path / "ddp_hang.py"
    script.write_text(textwrap.dedent("""\
        import os, subprocess, sys, threading
        if "LOCAL_RANK" not in os.environ:
            sys.exit(subprocess.run([sys.executable, "-m", "torch.distributed.run",
                                     "--standalone", "--nproc-per-node", "2", *sys.argv]
                                    ).returncode)
        import torch
        import torch.distributed as dist
        from torch import nn

        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            if step == 2 and dist.get_rank() == 1:
                threading.Event().wait()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
    """))
    # (the clock counts from the start: room for torchrun and its ranks to start on a busy
    # machine before their first step ends)
    done = _exec(tmp_path, "--seed", "0", "--repeats", "1", "--step-timeout", "20", "--json",
                 script=script)
    assert done.returncode == 3, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["headline"].startswith(  # (rank 0's run, the ranks' verdicts are rank 0's)
        f"FAILED: repeat 0 stopped: no step ended within the --step-timeout (20 s); it was at "
        f"{script}:16, in _engine_run_backward of torch/autograd/graph.py:"), summary
    assert "(the last step it completed: 1)" in summary["headline"]
    stacks = (tmp_path / "run" / "stacks-0.txt").read_text()
    wheres = sorted(line.split(", stopped at ")[1].rsplit(":", 1)[0]  # (as each rank said it)
                    for line in stacks.splitlines()
                    if line.startswith("process ") and ", stopped at " in line)
    assert wheres == [f"{script}:15, in wait of threading.py",
                      f"{script}:16, in _engine_run_backward of torch/autograd/graph.py"], stacks


def test_a_sigterm_that_comes_as_the_first_begins_says_where_the_first_found_the_script(
        monkeypatch, tmp_path):
    """exec's SIGTERM and the one a launcher passes on can come a bytecode apart: the
    second handler then runs in the first's frame before the first has noted anything,
    and says where the first found the script, never "in handler"."""
    from detaudit.drivers import attach_process

    class Ended(Exception):
        pass

    def end_process(code: int = 0) -> None:
        raise Ended(code)

    said: list[str] = []
    monkeypatch.setattr(attach_process, "timed_out", lambda trace: True)
    monkeypatch.setattr(attach_process, "_end_process", end_process)
    monkeypatch.setattr(attach_process, "stopped_by_the_timeout",
                        lambda path, frame, seconds, finish: said.append(frame.f_code.co_name))
    attachment = types.SimpleNamespace(finishing=False, path=tmp_path / "attach-0.json.gz",
                                       end_updated_step=lambda: None, finish=lambda why: None)
    handler = attach_process._on_terminate(attachment, {"trace": "t", "step_timeout": 5})

    def second_as_the_first_begins(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is handler.__code__:
            sys.setprofile(None)
            handler(signal.SIGTERM, frame)

    def where_the_script_waits() -> None:
        sys.setprofile(second_as_the_first_begins)
        try:
            handler(signal.SIGTERM, sys._getframe())
        finally:
            sys.setprofile(None)

    with pytest.raises(Ended):
        where_the_script_waits()
    assert said == ["where_the_script_waits"]


def test_the_step_timeout_waits_on_steps_and_kills_what_does_not_end_when_asked(
        tmp_path, monkeypatch):
    """The clock restarts at each step's end, so a run longer than the timeout whose steps
    keep ending is not stopped; a process that ignores SIGTERM is killed after the grace.
    The steps ended are shown as they end, with a timeout or without."""
    from detaudit.drivers import stopping

    trace = tmp_path / "attach-0.json.gz"
    beats = textwrap.dedent(f"""\
        import pathlib, sys, time
        for step in range(int(sys.argv[1])):
            time.sleep(0.25)
            pathlib.Path({str(trace) + ".progress"!r}).write_text(str(step + 1))
    """)
    for timeout, steps in ((1.0, 8), (None, 5)):
        stepping = subprocess.Popen([sys.executable, "-c", beats, str(steps)],
                                    start_new_session=True)
        started, shown = time.monotonic(), []
        assert stopping.wait_watching(stepping, trace, timeout, grace=10.0,
                                      on_steps=shown.append) == (0, None)
        assert time.monotonic() - started > 1.0  # (it ran past the timeout, stepping)
        # (seen once a second: a step or more between)
        assert shown and shown == sorted(set(shown)) and set(shown) <= set(range(1, steps + 1))
    deaf = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open({str(tmp_path / "attach-1.json.gz.pids")!r}, "a") as pids:  # (attached)
            pids.write(f"{{os.getpid()}}\\n")
        time.sleep(60)
    """)], start_new_session=True)
    assert stopping.wait_watching(deaf, tmp_path / "attach-1.json.gz", 1.0, grace=0.5) == (
        -signal.SIGKILL, stopping.KILLED)
    assert (tmp_path / "attach-1.json.gz.timed-out").exists()  # (the mark the run reads)


@pytest.mark.parametrize("handler", ["detaudit's", "the script's own"])
def test_a_run_stopped_by_the_step_timeout_between_steps_keeps_the_step_it_completed(
        tmp_path, handler):
    """A hang after a step's update, before the next batch (where a loop waits for data), is
    not in that step: the step is kept, not dropped as the one that failed; also where the
    script's own SIGTERM handler takes the signal (it exits), where the place comes from the
    stacks the process wrote from C."""
    from detaudit import execution
    from detaudit.config import ExecJob

    script = tmp_path / "sleeps.py"
    script.write_text(textwrap.dedent("""\
        import signal, sys, time
        import torch
        if sys.argv[1:] == ["own"]:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                time.sleep(120)
    """))
    own = handler == "the script's own"
    result = execution.exec_command([sys.executable, str(script), *(["own"] if own else [])],
                                    ExecJob(step_timeout=15.0, repeats=1), out=tmp_path / "run",
                                    output=subprocess.DEVNULL)
    assert result.verdict.exit_code == 3
    said = ": stopped (SIGTERM); it was at" if own else "; it was at"
    assert (f"no step ended within the --step-timeout (15 s){said} {script}:12") in (
        result.verdict.headline)
    assert "(the last step it completed: 1)" in result.verdict.headline
    assert len(Trace.load(tmp_path / "run" / "trace-0.json.gz").steps) == 2
    stacks = (tmp_path / "run" / "stacks-0.txt").read_text()
    if own:  # (as a process stuck in C code would: the stacks it wrote from C)
        assert "its stacks as it wrote them from C when the time ran out" in stacks
        assert f'File "{script}", line 12 in <module>' in stacks
    else:
        assert f'File "{script}", line 12, in <module>' in stacks
    assert not list((tmp_path / "run").glob("*.dump-*"))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_process_of_the_run_in_a_session_of_its_own_is_ended_too(tmp_path):
    """torchrun starts each rank in a session of its own: killing the command's process
    group left a rank that ignored SIGTERM running after the audit ended (and writing into
    its folder later). Each process that attached is asked, then killed."""
    from detaudit.drivers import stopping

    trace = tmp_path / "attach-0.json.gz"
    rank = textwrap.dedent(f"""\
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        started = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]
        with open({str(trace) + ".pids"!r}, "a") as pids:
            pids.write(f"{{os.getpid()}} {{started}}\\n")
        time.sleep(60)
    """)
    launcher = textwrap.dedent(f"""\
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {rank!r}], start_new_session=True)
        time.sleep(60)
    """)
    command = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "attach-0.json.gz.pids").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int((tmp_path / "attach-0.json.gz.pids").read_text().split()[0])
    assert os.getpgid(pid) != command.pid  # (outside the command's process group)
    assert stopping.stop_run(command, trace, grace=0.5) is False  # (it would not end)
    command.wait(timeout=10)
    deadline = time.monotonic() + 10
    while stopping._stat(pid)[0] not in ("", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stopping._stat(pid)[0] in ("", "Z")  # killed (reaped, or waiting to be)


def test_exec_shows_each_runs_steps_as_they_end_in_its_scans_and_its_zoom(
        tmp_path, monkeypatch):
    """A long command's runs show their steps as progress, and the zoom's replays which
    step they replay and when they record the zoomed one in detail (looked at often here:
    each step of this script is short)."""
    from detaudit import api, execution
    from detaudit.config import ExecJob, Fault
    from detaudit.drivers import stopping

    class Shown(api.Progress):
        def __init__(self):
            self.said: list[str] = []

        def status(self, description: str) -> None:
            self.said.append(description)

    monkeypatch.setattr(stopping, "WATCH_INTERVAL_S", 0.02)
    shown = Shown()
    result = execution.exec_command(
        [sys.executable, str(SCRIPT), "--workers", "0", "--accumulate", "1"],
        ExecJob(seed=0, max_steps=2, fault=Fault.parse("head@backward:1")),
        out=tmp_path / "run", output=subprocess.DEVNULL, progress=shown)
    assert result.exit_code == 1 and result.verdict.first["module"] == "head"
    said = list(dict.fromkeys(shown.said))
    # (a step's end is written as the next begins, the last step's as the run ends: a
    # short step may end before it is seen)
    scans = [s for s in said if not s.startswith("zoom")]
    assert scans == sorted(scans) and {s[:8] for s in scans} == {"run 1/2:", "run 2/2:"}
    assert set(scans) <= {f"run {r}/2: {n}/2 steps" for r in (1, 2) for n in (1, 2)}
    assert [s for s in said if s.startswith("zoom")] == [
        "zoom: step 1, run 1/2: replaying the steps before it",
        "zoom: step 1, run 1/2: recording step 1 at module and op level",
        "zoom: step 1, run 2/2: replaying the steps before it",
        "zoom: step 1, run 2/2: recording step 1 at module and op level"]


@pytest.mark.parametrize("every", [0.0, 60.0])
def test_the_recording_process_marks_the_end_of_its_steps_for_exec_to_watch(tmp_path, every):
    """What exec's watch reads: the file beside the trace, written as steps end, at most
    every so often (a short step pays for no write)."""
    from detaudit.drivers.stopping import step_end_notes

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = Attachment(tmp_path / "t.json.gz", {}).install()
    attachment.on_step_end = step_end_notes(attachment.path, every)
    beat = tmp_path / "t.json.gz.progress"
    ends, said = [], []
    try:
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            ends.append(beat.stat().st_mtime_ns if beat.exists() else None)
            said.append(beat.read_text() if beat.exists() else None)
            time.sleep(0.02)
    finally:
        attachment.finish()
        attachment.uninstall()
    # a step ends as the next begins: the first update leaves no mark, each later one does,
    # with the steps ended (exec shows them as its progress), or the first one only within
    # the time between writes
    if every == 0:
        assert ends[0] is None and None not in ends[1:] and ends[1] < ends[2]
        assert said == [None, "1", "2"]
    else:
        assert ends[0] is None and ends[1] == ends[2]
        assert said == [None, "1", "1"] and beat.read_text() == "1"  # (the run's end too)
    assert len(Trace.load(tmp_path / "t.json.gz").steps) == 3


def test_a_run_killed_for_its_step_timeout_before_recording_anything_fails(
        tmp_path, monkeypatch):
    """A script that ignores SIGTERM and hangs before it imports torch leaves no trace: the
    audit still ends FAILED (exit 3) with a report, saying how far it got."""
    from detaudit import execution
    from detaudit.config import ExecJob

    monkeypatch.setattr(execution, "STOP_GRACE_S", 1.0)
    script = tmp_path / "deaf.py"
    script.write_text("import signal, threading\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "threading.Event().wait()\n")
    result = execution.exec_command([sys.executable, str(script)],
                                    ExecJob(step_timeout=2.0), out=tmp_path / "run",
                                    output=subprocess.DEVNULL)
    assert result.verdict.exit_code == 3
    assert result.verdict.headline == (
        "FAILED: repeat 0 stopped: no step ended within the --step-timeout (2 s), which counts "
        "from the start: no process of the command had imported torch yet (before its first "
        "step completed); repeat 1 was not run (no step to compare); only 1 repeat was "
        "recorded (0 steps), so nothing could be compared")
    assert (tmp_path / "run" / "report.html").exists()


def test_the_step_limit_runs_the_scripts_exit_hooks(tmp_path):
    """--max-steps ended the process without its exit hooks: a temporary folder a script
    (Composer's checkpoint saver) removes at exit was left behind by every run. (A script
    that prints nothing, as this one, leaves no line open: --quiet printed a blank line per
    run before the verdict; lines a script leaves open are in the next test.)"""
    temporary = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR")))  # (short: see above)
    script = tmp_path / "cleans_up.py"
    script.write_text(textwrap.dedent("""\
        import atexit, shutil, tempfile
        import torch
        scratch = tempfile.mkdtemp()
        atexit.register(shutil.rmtree, scratch)
        kept = tempfile.TemporaryDirectory()  # (removed at exit by its finalizer)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        while True:
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        """))
    done = subprocess.run(
        [sys.executable, "-m", "detaudit", "exec", "--out", str(tmp_path / "run"), "--quiet",
         "--seed", "0", "--max-steps", "2", "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, check=False,
        env={**os.environ, "TMPDIR": str(temporary)})
    assert done.returncode == 0, done.stdout
    assert not list(temporary.glob("tmp*"))  # (torch's own caches may be there)
    assert done.stdout.startswith("DETERMINISTIC: 2 repeats"), done.stdout


# A planted fault's module, phase and step are named from the scan alone (its step is
# recorded module by module in every run); the zoom's re-runs add its op. Tests of naming
# that assert nothing of the op spare those re-runs.
_NAMED_BY_THE_SCAN = ("--no-zoom",)


def _found_fault(tmp_path: Path, script: Path, fault: str, *options: str) -> dict[str, Any]:
    """The summary of `script`'s exec audit with `fault` planted, which found a divergence."""
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--json", *options,
                   "--inject-fault", fault, "--", sys.executable, str(script))
    assert done.returncode == 1, done.stdout + done.stderr
    return json.loads(done.stdout)


_POLICY = """\
import torch
from torch import nn

class Extractor(nn.Module):
    def __init__(self):
        super().__init__()
        self.policy_net = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.value_net = nn.Sequential(nn.Linear(4, 16), nn.Tanh())

    def forward(self, x):
        return self.policy_net(x), self.value_net(x)

class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp_extractor = Extractor()
        self.action_net = nn.Linear(16, 2)
        self.value_net = nn.Linear(16, 1)

    def forward(self, x):  # the rollout's, under no_grad in eval mode
        pi, vf = self.mlp_extractor(x)
        return self.action_net(pi).argmax(-1), self.value_net(vf)

    def evaluate_actions(self, x):  # training's: the parts, called one by one
        pi, vf = self.mlp_extractor(x)
        return self.action_net(pi), self.value_net(vf)

torch.manual_seed(0)
policy = Policy()
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
for rollout in range(2):
    policy.eval()
    with torch.no_grad():
        obs = torch.randn(16, 4)
        actions, _ = policy(obs)
    policy.train()
    for epoch in range(2):
        logits, values = policy.evaluate_actions(obs)
        loss = nn.functional.cross_entropy(logits, actions) + values.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


@pytest.mark.parametrize("fault", ["action_net@backward:2", "mlp_extractor.policy_net.0@forward:3"])
def test_a_model_whose_training_calls_its_parts_is_the_module_that_holds_them(tmp_path, fault):
    """Stable-Baselines3's policies train through ``evaluate_actions``, which calls their
    feature extractor and heads, never the policy itself: the extractor was taken for the
    model and the heads for other models named by class (``Linear``, ``Linear2``), so
    ``action_net`` could not take a fault, and ``value_net`` took the extractor's."""
    script = tmp_path / "policy.py"
    script.write_text(_POLICY)
    summary = _found_fault(tmp_path, script, fault, *_NAMED_BY_THE_SCAN)
    first = summary["first_divergence"]
    module, phase, step = fault.replace("@", ":").split(":")
    assert (first["module"], first["phase"], first["step"]) == (module, phase, int(step))
    assert summary["steps_per_repeat"] == [4, 4]  # (the rollouts' calls are no steps)


def test_an_actor_trained_apart_through_its_parts_is_named_as_the_module_holding_them(
        tmp_path):
    """SAC's actor (Stable-Baselines3's): its `action_log_prob` calls its parts, and its
    optimizer is another than the critic's, the model: its parts were recorded as other
    models named by class (`Sequential.0`, `Linear`, `Linear2`)."""
    script = tmp_path / "sac.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch import nn

        class Actor(nn.Module):
            def __init__(self):
                super().__init__()
                self.latent_pi = nn.Sequential(nn.Linear(3, 16), nn.ReLU())
                self.mu = nn.Linear(16, 1)
                self.log_std = nn.Linear(16, 1)

            def action_log_prob(self, obs):
                h = self.latent_pi(obs)
                mu, log_std = self.mu(h), self.log_std(h).clamp(-5, 2)
                return torch.tanh(mu + log_std.exp() * torch.randn_like(mu)), -log_std.sum(-1)

        class Critic(nn.Module):
            def __init__(self):
                super().__init__()
                self.qf0 = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

            def forward(self, obs, act):
                return self.qf0(torch.cat([obs, act], -1))

        torch.manual_seed(0)
        actor, critic = Actor(), Critic()
        actor_opt = torch.optim.Adam(actor.parameters(), 1e-3)
        critic_opt = torch.optim.Adam(critic.parameters(), 1e-3)
        for _ in range(3):
            obs, act, reward = torch.randn(16, 3), torch.rand(16, 1), torch.randn(16, 1)
            pi, log_prob = actor.action_log_prob(obs)
            critic_loss = (critic(obs, act) - reward).pow(2).mean()
            critic_opt.zero_grad()
            critic_loss.backward()
            critic_opt.step()
            actor_loss = (0.1 * log_prob - critic(obs, pi).squeeze(-1)).mean()
            actor_opt.zero_grad()
            actor_loss.backward()
            actor_opt.step()
        """))
    summary = _found_fault(tmp_path, script, "Actor.latent_pi.0@forward:2", "--seed", "0",
                           *_NAMED_BY_THE_SCAN)
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"]) == ("Actor.latent_pi.0", "forward", 2)
    assert {"qf0.0", "Actor.mu", "Actor.log_std"} <= set(summary["modules"]), summary["modules"]


def test_an_update_by_in_place_foreach_ops_is_read_anew_after_each_of_them(tmp_path):
    """A loop's own Adam-like update through in-place foreach ops (``_foreach_add_``: Keras's
    optimizers on torch do so, and torch's with ``foreach=True``), which return nothing and,
    under a dispatch mode, move no version counter: the tensors they wrote kept their prints
    from before, so the next op reading them had "equal inputs" and a differing output, and
    the zoom headlined it (``op: aten._foreach_div in (outside the model)``) over a fault
    planted in a gradient by a hook."""
    script = tmp_path / "foreach_update.py"
    script.write_text(textwrap.dedent("""\
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        params = list(model.parameters())
        m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        for i in range(3):
            torch.nn.functional.mse_loss(model(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4]).backward()
            with torch.no_grad():
                grads = [p.grad for p in params]
                torch._foreach_mul_(m, 0.9)
                torch._foreach_add_(m, grads, alpha=0.1)
                torch._foreach_mul_(v, 0.99)
                torch._foreach_add_(v, torch._foreach_mul(grads, grads), alpha=0.01)
                denom = torch._foreach_sqrt(v)
                torch._foreach_add_(denom, 1e-8)
                torch._foreach_add_(params, torch._foreach_div(m, denom), alpha=-0.01)
                for p in params:
                    p.grad = None
        """))
    summary = _found_fault(tmp_path, script, "(model)@backward:1", "--seed", "0")
    assert "the planted fault, found where it was planted" in summary["headline"], (
        summary["headline"])
    assert "op: aten._foreach" not in summary["headline"], summary["headline"]
    assert all(op["role"] != "origin" for op in summary["ops"]), summary["ops"]


def test_a_call_torchvisions_model_builder_makes_is_no_step(tmp_path):
    """torchvision's SSDLite builder calls its backbone in eval mode, without gradients, to
    measure its output channels: that call was taken for an inference step, which
    --max-steps 1 ended the run at, before any training, and a fault planted at step 0
    never reached the training step."""
    script = tmp_path / "ssdlite.py"
    script.write_text(textwrap.dedent("""\
        import torch, torchvision
        model = torchvision.models.detection.ssdlite320_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        images = [torch.rand(3, 64, 64) for _ in range(2)]
        targets = [{"boxes": torch.tensor([[4.0, 4.0, 40.0, 40.0]]), "labels": torch.tensor([1])}] * 2
        model.train()
        for step in range(3):
            loss = sum(model(images, targets).values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        """))
    summary = _found_fault(tmp_path, script, "head.classification_head@forward:0",
                           "--seed", "0", "--max-steps", "1", *_NAMED_BY_THE_SCAN)
    assert not summary["inferred"] and summary["steps_per_repeat"] == [1, 1]
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"]) == (
        "head.classification_head", "forward", 0)


def test_the_update_that_makes_an_optimizers_state_for_a_checkpoint_is_no_step(tmp_path):
    """Distributed checkpointing's get_state_dict (what a DCP resume calls before loading)
    makes a fresh optimizer's state by a step on zero gradients at lr 0: no training step,
    so the script's first step is step 0 and a fault planted there fires."""
    script = tmp_path / "dcp.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        get_state_dict(model, optimizer)
        x = torch.randn(32, 8)
        for i in range(4):
            model(x[i * 8:(i + 1) * 8]).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        """))
    summary = _found_fault(tmp_path, script, "2@forward:0", "--seed", "0", *_NAMED_BY_THE_SCAN)
    assert summary["steps_per_repeat"] == [4, 4], summary["headline"]
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"]) == ("2", "forward", 0)
    assert not summary["updates_without_backward"] and not summary["calls_unseen"]


@pytest.mark.parametrize("drawn", ["tqdm", "carriage returns"])
def test_a_progress_line_the_limit_cuts_short_leaves_the_verdict_on_a_line_of_its_own(
        tmp_path, drawn):
    """A progress line (a tqdm bar on stderr, or a line the script redraws on stdout with
    carriage returns) has no line end while its loop runs; --max-steps ends the process
    mid-loop, so the bar is closed as the loop's end would close it and the line ended: the
    next run's output, and the verdict (stdout, the same log in CI), begin lines of their own.
    (A script that leaves no line open: the step-limit test above.)"""
    script = tmp_path / "bar.py"
    script.write_text(
        "import sys, torch, tqdm\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 2)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        + {"tqdm": "for _ in tqdm.tqdm(range(1000), mininterval=0):\n",
           "carriage returns": "for i in range(1000):\n"
                               "    print(f'\\r{i}/1000 [', end='', flush=True)\n",
           "nothing": "for _ in range(1000):\n"}[drawn]
        + "    optimizer.zero_grad()\n"
        "    model(torch.ones(3, 4)).sum().backward()\n"
        "    optimizer.step()\n")
    done = subprocess.run(
        [sys.executable, "-m", "detaudit", "exec", "--out", str(tmp_path / "run"), "--quiet",
         "--max-steps", "3", "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, check=False)
    output = done.stdout.decode()  # (not as text: that splits lines at the bar's returns)
    lines = output.split("\n")
    assert done.returncode == 0, output
    assert sum("/1000 [" in line for line in lines) == 2, output  # a line in each run
    assert any(line.startswith("DETERMINISTIC") for line in lines), output


def test_ops_a_dataloader_runs_to_deliver_a_batch_are_not_the_zoomed_steps(tmp_path):
    """Which fetch unpickles a worker's batch is a race, so the ops a DataLoader runs as it
    delivers a batch vary in number from run to run; inside a step (the second batch of an
    accumulated one) they shifted the loss's op records of one zoomed run against the
    other's, listed as differing. Here the dataset runs an extra op in every other run, and
    the step's loss ops must agree, as they do."""
    script = tmp_path / "fetching.py"
    script.write_text(textwrap.dedent(f"""\
        import pathlib, torch
        runs = pathlib.Path({str(tmp_path / "runs")!r})
        runs.write_text(str(int(runs.read_text()) + 1) if runs.exists() else "0")
        extra = int(runs.read_text()) % 2 == 0

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                x = torch.full((4,), float(i))
                return x.flip(0).flip(0) if extra else x

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, x in enumerate(torch.utils.data.DataLoader(Data(), batch_size=2)):
            (model(x) ** 2).mean().backward()
            if i % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
        """))
    summary = _found_fault(tmp_path, script, "1@backward:1", "--max-steps", "3")
    assert summary["first_divergence"]["module"] == "1", summary["headline"]
    ops = [(o["module"], o["phase"], o["op"]) for o in summary["ops"]]
    assert ("0", "backward", "aten.mm") in ops  # (the layer below the fault)
    assert not [o for o in ops if o[:2] == (OUTSIDE_MODEL, "forward")], ops


@pytest.mark.parametrize("saved", ["weights", "progress"])
def test_a_script_that_resumes_from_what_an_earlier_run_saved_is_told_so(tmp_path, saved):
    """The script saves a checkpoint after each epoch and resumes from it when it finds one
    (as PyTorch's DDP tutorial does): the second run begins at epoch 2, from the first run's
    weights (cause init), or, with only the epoch saved, from the seeded weights with the
    same batches, so it agrees step for step until it ends early (cause length, which said
    no more than that). Either way the file it loaded is named."""
    checkpoint = tmp_path / "ck.pt"
    done = _exec(tmp_path, "--seed", "0", "--max-epochs", "2", "--json", script_args=(
        "--workers", "0", "--epochs", "3", "--resume", str(checkpoint),
        *(["--resume-progress-only"] if saved == "progress" else [])))
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    cause = summary["cause"]
    assert cause["kind"] == ("init" if saved == "weights" else "length"), cause
    assert f"repeat 1 loaded {checkpoint} (torch.load), written by an earlier run" in cause["text"]
    assert summary["first_divergence"]["step"] == (0 if saved == "weights" else 2)
    if saved == "progress":
        return  # (what follows is the same audit for both)
    # a checkpoint written before the audit began is the script's input, loaded alike by
    # every run (stopped before an epoch's end, none saves one), and not noted
    torch.save({"epoch": 1}, checkpoint)
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "1", "--overwrite", script_args=(
        "--workers", "0", "--epochs", "3", "--resume", str(checkpoint)))
    assert done.returncode == 0, done.stdout + done.stderr
    traces = [Trace.load(tmp_path / "run" / f"trace-{r}.json.gz") for r in (0, 1)]
    assert [t.steps[0].epoch for t in traces] == [0, 0]  # (the script's epoch 1 is their first)
    assert not any(LOADED_FROM_EARLIER_RUNS in t.probe for t in traces)


def test_a_checkpoint_loaded_through_a_link_is_noted_as_the_file_it_points_to(tmp_path):
    """Composer resumes through a temporary link to the checkpoint, which it deletes once
    loaded: the link was named as the file the run loaded. Only a file an earlier run of the
    audit wrote is noted (written after the audit began and before this run did)."""
    checkpoint = tmp_path / "ep1.pt"
    torch.save({"epoch": 1}, checkpoint)
    written = checkpoint.stat().st_mtime_ns
    link = tmp_path / "tmp" / "latest.pt"
    link.parent.mkdir()
    link.symlink_to(checkpoint)
    attachment = types.SimpleNamespace(trace=types.SimpleNamespace(probe={}))
    loading = _loading_noted(attachment, torch.load, written - 1, written + 1)
    assert loading(str(link)) == {"epoch": 1}
    link.unlink()
    assert attachment.trace.probe[LOADED_FROM_EARLIER_RUNS] == [os.path.realpath(checkpoint)]
    # written before the audit began: the script's own input, not noted
    later = types.SimpleNamespace(trace=types.SimpleNamespace(probe={}))
    _loading_noted(later, torch.load, written + 1, written + 2)(checkpoint)
    assert later.trace.probe == {}


def test_a_run_that_fails_after_resuming_from_an_earlier_runs_checkpoint_is_told_so(
        tmp_path):
    """A script that resumes from the checkpoint it finds and refuses when nothing is left
    to train (Composer's autoresume): the second run failed before its first step with no
    word of the checkpoint the first run wrote, though its trace noted the load."""
    script = tmp_path / "resumes.py"
    checkpoint = tmp_path / "ckpt.pt"
    script.write_text(textwrap.dedent(f"""\
        import os, torch
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if os.path.exists({str(checkpoint)!r}):
            model.load_state_dict(torch.load({str(checkpoint)!r}))
            raise ValueError("the elapsed duration is the training's: no training would occur")
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.save(model.state_dict(), {str(checkpoint)!r})
        """))
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--json", "--seed", "0", "--",
                   sys.executable, str(script))
    assert done.returncode == 3, done.stdout + done.stderr
    failure = json.loads(done.stdout)["failures"]["1"]
    assert failure.startswith("ValueError while running at ") and failure.endswith(
        f"; it loaded {checkpoint}, written by an earlier run of this audit (a checkpoint it "
        "resumed from?)"), failure


def test_a_run_that_fails_on_what_an_earlier_run_wrote_is_told_so(tmp_path):
    """A script that refuses to write into an output folder that exists (Ignite's
    ModelCheckpoint with require_empty): the second run fails on the folder the first wrote,
    a FAILED run (exit 3) that now says where the folder came from."""
    script = tmp_path / "refuses.py"
    out = tmp_path / "checkpoints"
    script.write_text(textwrap.dedent(f"""\
        import os, torch
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        os.makedirs({str(out)!r})  # (exist_ok=False: a folder of an earlier training refused)
        """))
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--json", "--seed", "0", "--",
                   sys.executable, str(script))
    assert done.returncode == 3, done.stdout + done.stderr
    failure = json.loads(done.stdout)["failures"]["1"]
    assert failure.startswith("FileExistsError while running at ") and failure.endswith(
        f"; {out} named there was written by an earlier run of this audit (each run is the "
        "command as it is, writing where the one before wrote)"), failure
    assert not json.loads(done.stdout)["failures"].get("0")


def test_a_run_that_resumes_with_nothing_left_to_train_is_a_run_of_no_steps(tmp_path):
    """Original DETR, resumed from its own output folder: the second run loads the first
    run's checkpoint at the last epoch and makes no step. That ended the audit as a usage
    error (exit 2, "ended before its first step"), the first run's trace dropped and the
    checkpoint not named: the runs differ in length, and the file is why."""
    checkpoint = tmp_path / "ck.pt"
    done = _exec(tmp_path, "--seed", "0", "--json", script_args=(
        "--workers", "0", "--epochs", "1", "--resume", str(checkpoint)))
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["cause"]["kind"] == "length"
    assert summary["cause"]["text"].startswith("repeat 1 made no step")
    assert (f"repeat 1 loaded {checkpoint} (torch.load), written by an earlier run"
            in summary["cause"]["text"])
    traces = [Trace.load(tmp_path / "run" / f"trace-{r}.json.gz") for r in (0, 1)]
    assert [len(t.steps) for t in traces] == [2, 0]
    assert not list((tmp_path / "run").glob("*.loaded"))
    # the first run making no step is still the command's failure to train: exit 2
    done = _exec(tmp_path, "--seed", "0", "--overwrite", script_args=(
        "--workers", "0", "--epochs", "1", "--resume", str(checkpoint)))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "repeat 0:" in done.stderr and "before its first step" in done.stderr


CLIPPED_SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
body, head = nn.Linear(8, 32), nn.Linear(32, 10, bias=False)
model = nn.Sequential(body, nn.Tanh(), head)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    x, y = torch.randn(16, 8), torch.randint(0, 10, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.0)  # (whatever backward did)
    opt.step()
"""


def test_a_backward_fault_that_clipping_rounds_away_is_said_to_be(tmp_path):
    """minGPT clips its gradients: a fault planted at the output layer's weight-gradient op
    rounded away in the clipping, and the refusal advised planting "nearer the
    parameters", where it already was. The gradients are recorded as backward left them,
    before the clipping, at the planted step: the fault is found where it was planted, and
    the headline says the training stayed bit-identical. (Clipped to norm 0 here, so that
    it always rounds away.)"""
    script = tmp_path / "clipped.py"
    script.write_text(CLIPPED_SCRIPT)
    done = _exec(tmp_path, "--seed", "0", "--inject-fault", "2/aten.mm@backward:1",
                 script=script)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "op: aten.mm in 2 (the planted fault, found where it was planted)" in done.stdout
    assert ("; the training stayed bit-identical: no loss, gradient or parameter differs, in "
            "that step or after") in done.stdout


ENDLESS_SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = DataLoader(data, batch_size=4,
                    sampler=RandomSampler(data, replacement=True, num_samples=10**6))
model = nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, (x, y) in enumerate(loader):  # minGPT's Trainer: ended by max_iters
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 3:
        break
"""


def test_max_epochs_that_an_endless_sampler_never_lets_fire_is_said_to(tmp_path):
    """minGPT's loader samples with replacement, 10**10 samples: its first pass never ends,
    so --max-epochs never fires (without max_iters the run goes on until killed), and
    nothing said so. A run that ends after whole passes gets no such note."""
    script = tmp_path / "endless.py"
    script.write_text(ENDLESS_SCRIPT)
    done = _exec(tmp_path, "--seed", "0", "--max-epochs", "1", "--json", script=script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["first_pass_unfinished"] == {"batches": 250_000}
    report = (tmp_path / "run" / "report.md").read_text()
    assert ("--max-epochs did not end the runs: they ended within their first pass over the "
            "training DataLoader, which is 250,000 batches long, by a step count") in report
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)

    def one_whole_pass():
        for (x,) in loader:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    trace = _attached(tmp_path / "whole.json.gz", one_whole_pass, max_epochs=3)
    assert len(trace.steps) == 2 and FIRST_PASS_UNFINISHED not in trace.probe


class _Endless(torch.utils.data.Sampler):
    """detectron2's TrainingSampler: indices drawn forever, and no len()."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        while True:
            yield from torch.randperm(8, generator=generator).tolist()


class _Streamed(torch.utils.data.IterableDataset):
    """A stream of 8 samples whose length is not told."""

    def __iter__(self):
        return iter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("sampled, told", [("endless", True), ("streamed", False)])
def test_max_epochs_is_said_not_to_fire_on_a_loader_of_no_length_whose_pass_never_ended(
        tmp_path, sampled, told):
    """A loader of no length (detectron2's endless sampler, an iterable dataset) ended by
    the loop's own count within its first pass: --max-epochs never fired, and nothing said
    so (the note needed the pass's length); one whose pass ran out needs no note."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    loader = (torch.utils.data.DataLoader(data, batch_size=2, sampler=_Endless())
              if sampled == "endless" else
              torch.utils.data.DataLoader(_Streamed(), batch_size=2))

    def loop():
        for step, batch in zip(range(6), loader):  # detectron2: iterations, not epochs
            x = batch[0] if isinstance(batch, list) else batch
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    trace = _attached(tmp_path / "t.json.gz", loop, max_epochs=3)
    assert len(trace.steps) == (6 if told else 4)
    assert (FIRST_PASS_UNFINISHED in trace.probe) is told
    if told:
        assert trace.probe[FIRST_PASS_UNFINISHED] is None


SWA_SCRIPT = """
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,)))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
swa_model = AveragedModel(model)
for epoch in range(2):
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    swa_model.update_parameters(model)
update_bn(loader, swa_model)  # a pass over the training loader that feeds no step
print("evaluated the averaged model:", swa_model.eval()(data.tensors[0]).sum().item() != 0)
"""


def test_max_epochs_of_the_scripts_own_epochs_lets_its_tail_run(tmp_path):
    """PyTorch's documented SWA recipe ends with update_bn's pass over the training loader:
    `--max-epochs 2` of a 2-epoch script took that pass for a third epoch and ended each
    run there, before the averaged model was evaluated, and said nothing."""
    script = tmp_path / "swa.py"
    script.write_text(SWA_SCRIPT)
    done = _exec(tmp_path, "--seed", "0", "--max-epochs", "2", "--json", script=script)
    assert done.returncode == 0, done.stdout + done.stderr
    # (under --json, the command's output goes to stderr)
    assert done.stderr.count("evaluated the averaged model: True") == 2
    assert json.loads(done.stdout)["steps_per_repeat"] == [4, 4]
    # (a limit below the script's own epochs: test_max_epochs_stops_as_the_next_epochs_first_step_begins)


LSTM_SCRIPT = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 8, 1)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(5, 4, 8), torch.randn(5, 4, 1)
for _ in range(3):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
"""


def test_the_scratch_memory_of_a_fused_lstm_is_not_taken_for_a_result(tmp_path):
    """On CPU, nn.LSTM's oneDNN kernel returns a workspace, part of it never written, which
    differs from run to run: every zoom named that op (aten.mkldnn_rnn_layer) as the
    origin, in forward, wherever the runs parted."""
    script = tmp_path / "lstm.py"
    script.write_text(LSTM_SCRIPT)
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "3", "--json", "--inject-fault",
                 "head/aten.mm@backward:1", script=script)
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert [(o["op"], o["module"], o["phase"], o.get("planted")) for o in summary["ops"]
            if o["role"] == "origin"] == [("aten.mm", "head", "backward", True)]


HOGWILD = """
import torch
import torch.multiprocessing as mp
from torch import nn


def train(model):
    torch.seed()  # (each run's updates differ, as Hogwild's interleaving makes them)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()


if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model.share_memory()
    trainer = mp.get_context("spawn").Process(target=train, args=(model,))
    trainer.start()
    trainer.join()
    model.eval()
    with torch.no_grad():
        print(model(torch.ones(2, 3)))
"""


def test_a_model_trained_by_other_processes_through_shared_memory_is_told_so(tmp_path):
    """PyTorch's Hogwild example: child processes train the model in shared memory, the
    script's own process evaluates it. The recording process saw parameters that differ
    before its first call; that read as an unseeded model ("the numpy, python RNG state
    differs"), while the script seeds and the children trained it."""
    script = tmp_path / "hogwild.py"
    script.write_text(HOGWILD)
    done = _exec(tmp_path, script=script)
    assert done.returncode == 1, done.stdout + done.stderr
    cause = json.loads((tmp_path / "run" / "summary.json").read_text())["cause"]
    assert cause["kind"] == "init"
    assert "they are in shared memory (share_memory()): other processes write them" in cause["text"]
    assert "RNG state differs" not in cause["text"]
    trace = Trace.load(tmp_path / "run" / "trace-0.json.gz")  # the evaluation, not the child
    assert len(trace.steps) == 1 and trace.probe["inferred"]


def test_a_file_an_earlier_run_wrote_is_said_beside_an_unseeded_model_not_instead(tmp_path):
    """An unseeded script that also loads a cache the first run wrote (a vocabulary): the
    seeding fix stays, the file is named beside it (it replaced the whole diagnosis)."""
    from detaudit.analysis.compare import compare

    def loop() -> None:
        model = nn.Linear(4, 1)
        model(torch.ones(2, 4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()

    _unseeded_runs(tmp_path, loop)
    traces = [Trace.load(tmp_path / f"trace-{run}.json.gz") for run in range(2)]
    traces[1].probe[LOADED_FROM_EARLIER_RUNS] = ["vocab.pt"]
    c = compare(traces)
    assert c.cause == "init" and "unseeded" in cause_text(c)
    assert cause_text(c).endswith("; repeat 1 loaded vocab.pt (torch.load), written by an earlier run")


@pytest.mark.parametrize("update", ["optimizer", "by hand"])
def test_the_run_ends_at_an_evaluation_after_the_last_steps_update(tmp_path, update):
    """--max-steps 1 with one step per epoch (4 batches accumulated): how many optimizers
    update in a step is not known at step 0, so its end was seen only at the next training
    call, after the script's evaluation (and checkpointing) had run; and a loop's own update
    (fastai's optimizer is no torch.optim one) is seen only at the model's next call. An
    evaluation call of the model after the update ends it."""
    marker = tmp_path / "evaluated.txt"
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "1", "--repeats", "1", script_args=(
        "--workers", "0", "--accumulate", "4", "--evaluated", str(marker),
        *(["--by-hand"] if update == "by hand" else [])))
    assert done.returncode == 2 and "NOT COMPARED" in done.stdout, done.stdout + done.stderr
    assert not marker.exists()
    trace = Trace.load(tmp_path / "run" / "trace-0.json.gz")
    assert len(trace.steps) == 1 and trace.steps[0].optimizer_stepped
    assert "optimizer" in set(next(trace.by_step())[1].records["phase"])  # (the update's)


def test_ctrl_c_ends_the_process_tree_and_keeps_what_was_recorded(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "detaudit", "exec", "--out", str(out), "--quiet", "--seed",
               "0", "--", sys.executable, str(SCRIPT), "--forever", "--workers", "2"]
    # every process of the tree inherits the mark (another test may run the same script)
    mark = f"DETAUDIT_TEST_TREE={tmp_path}"
    audit = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "DETAUDIT_TEST_TREE": str(tmp_path)})
    deadline = time.monotonic() + 60
    while not any(out.glob("attach-*.json.gz")) and time.monotonic() < deadline:
        time.sleep(0.5)  # the command's recording has begun (its first save)
    time.sleep(2)
    audit.send_signal(signal.SIGINT)
    _, err = audit.communicate(timeout=60)
    assert audit.returncode == 130, err
    run = json.loads((out / "run.json").read_text())
    assert run["state"].startswith("interrupted during recording")
    trace = Trace.load(out / "trace-0.json.gz")
    assert trace.steps and "interrupted" in trace.failure
    summary = json.loads((out / "summary.json").read_text())
    assert "only 1 repeat was recorded" in summary["headline"], summary["headline"]
    assert summary["config"]["seed"] == 0 and not summary["loss"]["per_epoch"]
    assert not _running(mark)  # the script and its DataLoader workers


def test_ctrl_c_in_the_zoom_is_interrupted_never_a_verdict(tmp_path):
    """The scan found the planted fault; Ctrl-C while the zoom replays: exit 130, live and
    when the folder is rendered again (it rendered DIVERGENT, exit 1), no replay left."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "detaudit", "exec", "--out", str(out), "--quiet", "--seed",
               "0", "--max-steps", "4", "--inject-fault", "head@forward:2", "--", sys.executable,
               str(SCRIPT), "--workers", "0", "--accumulate", "1", "--step-seconds", "0.5"]
    audit = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and audit.poll() is None and not (
            any(out.glob("attach-*")) and "zoom" in (out / "run.json").read_text()):
        time.sleep(0.1)  # the zoom's first replay is recording
    audit.send_signal(signal.SIGINT)
    _, err = audit.communicate(timeout=60)
    assert audit.returncode == 130, err
    assert not list(out.glob("attach-*"))
    report = run_cli("report", str(out), "--json")
    assert report.returncode == 130, report.stdout + report.stderr
    summary = json.loads(report.stdout)
    assert summary["verdict"] == "interrupted"
    assert summary["headline"].startswith("INTERRUPTED (interrupted during investigating: zoom")
    assert "what was recorded: DIVERGENT: first at step 2" in summary["headline"]


def _running(variable: str) -> list[str]:
    """The processes whose environment holds `variable` ("NAME=value"; read from /proc, where
    there is one), by pid."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if variable.encode() in environ.read_bytes().split(b"\0"):
                found.append(environ.parent.name)
        except OSError:
            continue
    return found


def test_max_epochs_stops_as_the_next_epochs_first_step_begins(tmp_path):
    done = _exec(tmp_path, "--seed", "0", "--max-epochs", "1", "--repeats", "1",
                 script_args=("--epochs", "5", "--workers", "0"))
    assert done.returncode == 2, done.stdout + done.stderr  # one run: not compared
    trace = Trace.load(tmp_path / "run" / "trace-0.json.gz")
    assert [s.epoch for s in trace.steps] == [0, 0]


class _Limit(Exception):
    """Raised by an attachment's `on_limit` to end a loop."""


def _epochs_loop(path: Path, rebuilt: bool, evaluate: str, **limits) -> Trace:
    """3 epochs of 2 steps over a DataLoader, `rebuilt` anew each epoch, after a peek at one
    batch of it; with `evaluate`, the model is called without gradients after each epoch:
    still in training mode (eval() forgotten) over a validation "loader" or on "tensors", or
    in eval mode over the "training" loader."""
    data = torch.utils.data.TensorDataset(torch.randn(4, 4, generator=torch.Generator(
        ).manual_seed(1)))
    val = torch.utils.data.DataLoader(data, batch_size=2)

    def _raise():
        raise _Limit

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = Attachment(path, {}, on_limit=_raise, **limits).install()
    try:
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        next(iter(loader))  # (a peek: its pass feeds no step)
        with contextlib.suppress(_Limit):
            for _ in range(3):
                if rebuilt:
                    loader = torch.utils.data.DataLoader(data, batch_size=2)
                for (x,) in loader:
                    model(x).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                with torch.no_grad():
                    for (x,) in val if evaluate == "loader" else ():
                        model(x)
                    if evaluate == "tensors":
                        model(data.tensors[0])
                    model.eval()
                    for (x,) in loader if evaluate == "training" else ():
                        model(x)
                    model.train()
        attachment.finish()
    finally:
        attachment.uninstall()
    return Trace.load(path)


@pytest.mark.parametrize("rebuilt", [False, True], ids=["one-loader", "rebuilt"])
@pytest.mark.parametrize("evaluate", ["", "loader", "tensors", "training"])
def test_epochs_are_counted_over_loaders_built_anew_and_evaluations_are_no_steps(
        tmp_path, rebuilt, evaluate):
    """A DataLoader built anew each epoch is the next epoch (the epoch stayed 0, and
    --max-epochs never stopped it); calls without gradients over a validation loader, in
    training mode, are an evaluation, not a step (they began one, whose extra batches made
    a false divergence when only one run evaluated); a pass that feeds no step (a peek at
    one batch, an evaluation over the training data) is no epoch (each was one)."""
    trace = _epochs_loop(tmp_path / "t.json.gz", rebuilt, evaluate)
    assert [s.epoch for s in trace.steps] == [0, 0, 1, 1, 2, 2]
    records = trace.frame()
    batches = records[records.slot.str.startswith("batch.")]
    assert sorted(batches.groupby("step").size()) == [2] * 6  # the model's, the loader's
    limited = _epochs_loop(tmp_path / "l.json.gz", rebuilt, evaluate, max_epochs=2)
    assert [s.epoch for s in limited.steps] == [0, 0, 1, 1]


@pytest.mark.parametrize("ending", ["kill", "os_exit"])
def test_a_run_that_ends_without_its_exit_hook_is_kept_whole_or_failed(tmp_path, ending):
    """os._exit (distributed scripts end so, to avoid a hang at shutdown) saves the trace
    first: every step kept. A kill cannot: the steps since the last save are lost, so that
    run is a failure, never a divergence of its lost steps (it was DIVERGENT)."""
    end = ("os.kill(os.getpid(), signal.SIGKILL)" if ending == "kill" else "os._exit(0)")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal, sys, torch\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "second = os.path.exists(sys.argv[1])\n"
        "open(sys.argv[1], 'w').close()\n"
        "for step in range(6):\n"
        "    model(torch.ones(2, 4)).pow(2).mean().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        f"if second or '{ending}' == 'os_exit':\n"
        f"    {end}\n")
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--seed", "0", "--json",
                   "--", sys.executable, str(script), str(tmp_path / "marker"))
    summary = json.loads(done.stdout)
    if ending == "kill":
        assert done.returncode == 3, done.stdout + done.stderr
        assert summary["verdict"] == "failed"
        assert "without detaudit's exit hook running (os._exit, or killed)" in (
            summary["headline"])
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert summary["steps_per_repeat"] == [6, 6]


@pytest.mark.parametrize(("ending", "said"), [
    ("sys.exit(1)", "exited with code 1 after step 2 (sys.exit(1) at {}:9)"),
    # argparse exits inside the standard library: the user's call of it is named
    ("argparse.ArgumentParser().parse_args(['--oops'])",
     "exited with code 2 after step 2 (sys.exit(2) at {}:9)"),
])
def test_a_command_that_exits_with_an_error_after_its_steps_says_where(tmp_path, ending, said):
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse, sys, torch\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(3):\n"
        "    model(torch.ones(2, 4)).pow(2).mean().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        f"{ending}\n")
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--seed", "0", "--json",
                   "--repeats", "1", "--", sys.executable, str(script))
    assert done.returncode == 3, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["verdict"] == "failed"
    assert said.format(script) in summary["headline"], summary["headline"]


def test_exec_of_a_launcher_records_the_script_it_starts(tmp_path):
    """`accelerate launch` on one process is a Python program that trains nothing and runs
    the script in a child with no rank set: the child records (nothing did, and the
    command was said to end before its first step)."""
    launcher = tmp_path / "bin" / "accelerate"
    launcher.parent.mkdir()
    launcher.write_text(f"#!{sys.executable}\n"
                        "import subprocess, sys\n"
                        "assert sys.argv[1] == 'launch'\n"
                        "sys.exit(subprocess.call([sys.executable, *sys.argv[2:]]))\n")
    launcher.chmod(0o755)
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--seed", "0",
                   "--max-steps", "2", "--", str(launcher), "launch", str(SCRIPT),
                   "--workers", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DETERMINISTIC" in done.stdout
    assert len(Trace.load(tmp_path / "run" / "trace-0.json.gz").steps) == 2


def test_exec_of_a_front_end_records_the_kernel_it_runs_the_training_in(tmp_path):
    """`jupyter nbconvert --execute` and papermill are Python programs that never import
    torch: the notebook runs in a kernel they start (in the notebook's folder), which they
    end with SIGTERM once its last cell is done. Here a front-end runs the training in a
    Python console, from another folder, then ends it. The kernel records (the front-end
    claimed the recording and nothing was recorded), its trace is the run's (it went to a
    folder relative to the kernel's), its last step is kept and the run is no failure (it
    was "interrupted"); `random` and numpy, drawn from before torch is imported, are seeded
    by --seed all the same."""
    kernel_folder = tmp_path / "notebooks"
    kernel_folder.mkdir()
    cells = ("import random, numpy as np\n"
             "noise = random.random() + float(np.random.rand())\n"
             "import torch\n"
             "model = torch.nn.Linear(4, 1)\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "for step in range(3):\n"
             "    model(torch.full((2, 4), noise)).sum().backward()\n"
             "    opt.step()\n"
             "    opt.zero_grad()\n"
             "\n"
             "print('cells done', flush=True)\n")
    front_end = tmp_path / "front_end.py"
    front_end.write_text(
        "import subprocess, sys, time\n"
        f"kernel = subprocess.Popen([sys.executable, '-m', 'code'], cwd={str(kernel_folder)!r},\n"
        "                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        f"kernel.stdin.write({cells!r})\n"
        "kernel.stdin.flush()\n"
        "assert 'cells done' in kernel.stdout.readline()\n"
        "shown = ''\n"
        "while not shown.endswith('>>> '):  # the prompt: idle, waiting for the next cell\n"
        "    shown += kernel.stdout.read(1)\n"
        "kernel.terminate()\n"
        "while kernel.poll() is None:  # (a signal another thread took waits for the main\n"
        "    try:  # one to run Python code: an empty line wakes it)\n"
        "        kernel.stdin.write('\\n')\n"
        "        kernel.stdin.flush()\n"
        "    except BrokenPipeError:\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "kernel.wait()\n")
    done = run_cli("exec", "--out", "run", "--quiet", "--json", "--seed", "0", "--",
                   sys.executable, str(front_end), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["verdict"] == "deterministic" and summary["failures"] == {}
    assert len(Trace.load(tmp_path / "run" / "trace-1.json.gz").steps) == 3
    assert not (kernel_folder / "run").exists()


def test_exec_records_the_script_that_trains_whatever_comes_before_torch(tmp_path):
    """Before it imports torch, the script asks whether torch is installed (as transformers
    does: a spec found and thrown away), imports detaudit's seeding, and starts a helper
    that imports torch and trains nothing (a monitor): the script's own steps are recorded,
    all of them, once (the helper does not record over them)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import importlib.util, subprocess, sys\n"
        "assert importlib.util.find_spec('torch') is not None\n"
        "from detaudit import seed_everything\n"
        "monitor = subprocess.Popen([sys.executable, '-c',\n"
        "                            'import time, torch; time.sleep(120)'])\n"
        "import torch\n"
        "seed_everything(0)\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(4):\n"
        "    model(torch.randn(2, 4)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "monitor.terminate()\n"
        "monitor.wait()\n")
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--json", "--",
                   sys.executable, str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["verdict"] == "deterministic"
    assert [len(Trace.load(tmp_path / "run" / f"trace-{r}.json.gz").steps)
            for r in (0, 1)] == [4, 4]


@pytest.mark.parametrize(("command", "launcher"), [
    ("accelerate launch train.py", True), ("uv run accelerate launch train.py", True),
    ("accelerate-launch train.py", True), ("python -m accelerate.commands.launch t.py", True),
    ("python train.py accelerate launch", False),  # (the script's own arguments)
    ("torchrun --nproc-per-node 2 train.py", False), ("python train.py", False),
])
def test_a_launcher_is_told_from_the_script_it_runs(command, launcher):
    assert _is_launcher(command.split()) is launcher


@pytest.mark.parametrize(("command", "name"), [
    (["python", "train.py", "--lr", "1"], "train.py"), (["python", "-m", "pkg.train"], "pkg.train"),
    (["torchrun", "--nproc-per-node", "2", "tools/train.py"], "train.py"),
    (["bash", "-c", "cd detr && python main.py --epochs 2"], "main.py"),  # (was "bash")
    (["sh", "-c", "python -m pkg.train"], "pkg.train"), (["bash", "-c", "echo 'x"], "bash"),
    (["bash", "-c", "python train.py"], "train.py"),
    (["./run.sh"], "run.sh"),
])
def test_the_reports_name_the_script_a_command_runs(command, name):
    assert _script_name(command) == name


@pytest.mark.parametrize(("env", "records_as"), [
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "rank 1"),  # a worker torch's
    # elastic agent started from a process that claimed nothing (accelerate launch)
    ({"RANK": "0", "WORLD_SIZE": "2"}, "owner"),  # torchrun's own process on a cluster that
    # sets RANK for each node: it must leave rank 0 to its worker
    ({}, "owner"),
])
def test_which_process_of_a_command_records(tmp_path, env, records_as):
    job = {"trace": str(tmp_path / "trace.json.gz"), "probe": {}}
    code = ("import json, os\n"
            "from detaudit.drivers.attach_process import activate_from_environment\n"
            "a = activate_from_environment()\n"
            "print(json.dumps([None if a.rank is None else a.rank.rank,\n"
            "                  os.environ.get('DETAUDIT_ATTACH_RANK')]))\n"
            "a.uninstall()\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DETAUDIT_ATTACH")
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, **env, "DETAUDIT_ATTACH": json.dumps(job)}, check=True)
    rank, claimed = json.loads(done.stdout.strip().splitlines()[-1])
    assert (f"rank {rank}" if rank is not None else "owner") == records_as
    assert claimed == (None if rank is None else str(rank))


def test_a_crash_in_the_script_is_kept_and_named_never_a_pass(tmp_path):
    """The script raises in its third step's backward, before the update: steps 0 and 1
    were completed, and the headline says so. Its traceback is shown as it is without
    detaudit: the wrapper of ``backward`` it passed through is left out."""
    done = _exec(tmp_path, "--seed", "0", "--json", script_args=("--crash-at", "2",
                                                                 "--workers", "0"))
    assert done.returncode == 3, done.stdout + done.stderr
    frames = [line for line in done.stderr.splitlines() if line.startswith('  File "')]
    assert frames[0].startswith(f'  File "{SCRIPT}"') and f"{SCRIPT}\", line " in frames[-1]
    assert any(f"torch{os.sep}_tensor.py" in f for f in frames), done.stderr
    assert not [f for f in frames if f"{os.sep}detaudit{os.sep}" in f], done.stderr
    summary = json.loads(done.stdout)
    assert summary["verdict"] == "failed"
    headline = summary["headline"]
    assert headline.startswith("FAILED: repeat 0 stopped: RuntimeError while running at ")
    assert headline.endswith(
        "the script's own bug (the last step it completed: 1); 2 of 2 repeats did not finish; "
        "the repeats agree over the 2 steps every repeat completed"), headline
    trace = Trace.load(tmp_path / "run" / "trace-0.json.gz")
    assert len(trace.steps) == 2  # the steps before the crash are kept
    assert "RuntimeError" in trace.failure and "the script's own bug" in trace.failure
    assert "train_plain.py" in trace.failure


def test_exec_refuses_an_op_pytorch_does_not_have_at_its_first_runs_first_step(tmp_path):
    """A misspelt op was refused only after every run (the fault never fired); exec's own
    process never imports torch, so its first run checks the name, and ends after its
    first step."""
    done = _exec(tmp_path, "--seed", "0", "--inject-fault", "op:roi_algin@backward:2")
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("detaudit: error: --inject-fault: no op 'roi_algin' in PyTorch or "
                           "torchvision (did you mean roi_align"), said
    assert len(Trace.load(tmp_path / "run" / "trace-0.json.gz").steps) == 1
    assert not (tmp_path / "run" / "trace-1.json.gz").exists()


def test_a_divergence_before_a_crash_is_zoomed_into(tmp_path):
    """The runs part at step 1, and crash in step 3: the zoom was skipped whenever a repeat
    had failed, and the module was named only by the scan's gradients; the replays end at
    the zoomed step, before the crash."""
    done = _exec(tmp_path, "--seed", "0", "--json", "--inject-fault", "head@backward:1",
                 script_args=("--crash-at", "3", "--workers", "0"))
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["headline"].startswith(
        "DIVERGENT: first at step 1 (epoch 1), backward, head (origin)"), summary["headline"]
    assert "zoomed in on step 1 after a scan" in summary["headline"]
    assert "then repeat 0 stopped: RuntimeError" in summary["headline"]
    zoom = json.loads((tmp_path / "run" / "run.json").read_text())["extra"]["zoom"]
    assert (zoom["status"], zoom["step"]) == ("found", 1), zoom


def test_a_script_that_crashes_before_its_first_step_is_run_once(tmp_path):
    """A run that fails before its first step leaves nothing to compare, and the verdict
    is FAILED whatever the others do: they were run all the same (a script that loads its
    data for minutes, then fails on its configuration, failed once per repeat)."""
    script = tmp_path / "early.py"
    script.write_text("import torch\nraise ValueError('no such class: dog')\n")
    done = _exec(tmp_path, "--repeats", "3", "--json", script=script)
    assert done.returncode == 3, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["headline"].startswith(
        f"FAILED: repeat 0 stopped: ValueError while running at {script}:2: no such class: "
        "dog (before its first step completed); repeats 1 to 2 were not run (no step to "
        "compare)"), summary["headline"]
    assert sorted(p.name for p in (tmp_path / "run").glob("trace-*")) == ["trace-0.json.gz"]
    assert done.stderr.count("Traceback") == 1


@pytest.mark.parametrize("where", ["the next batch taken", "after the update",
                                   "after the pass"])
def test_a_failure_after_an_update_is_the_next_steps_once_the_loop_took_its_batch(
        tmp_path, where):
    """A script that fails at the top of an iteration, having taken the next batch (its own
    check of that batch), had completed the step before: that step was dropped as the one
    that failed ("the last step it completed: 3" after the script printed step 4); so was
    the last step of a script that fails once its pass over the training data is over (in
    its evaluation, saving its results). One that fails after the update but before it
    takes a batch (its scheduler's step, a w.step naming the losses) is still not kept
    half-recorded."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.ones(8, 4), batch_size=2)
    attachment = Attachment(tmp_path / "t.json.gz", {}).install()
    try:
        for i, x in enumerate(loader):
            if i == 2 and where == "the next batch taken":
                raise RuntimeError("a check of the batch")
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 1 and where == "after the update":
                raise RuntimeError("the scheduler")
        with torch.no_grad():
            model.eval()(torch.ones(1, 4))
        raise RuntimeError("the results")
    except RuntimeError as exc:
        attachment.finish(failure=str(exc))
    finally:
        attachment.uninstall()
    trace = Trace.load(tmp_path / "t.json.gz")
    assert len(trace.steps) == {"the next batch taken": 2, "after the update": 1,
                                "after the pass": 4}[where]
    assert trace.failure in ("a check of the batch", "the scheduler", "the results")
    # (the step whose update ran is said: "after step 1's update, before that step ended")
    assert trace.probe.get(FAILED_AFTER_UPDATE) == (1 if where == "after the update" else None)


@pytest.mark.parametrize(("fault", "message"), [
    ("haed@backward:1", "no module 'haed' ran at step 1; did you mean head?"),
    ("head@backward:3", "plants at step 3, past --max-steps 3 (steps 0 to 2)"),
])
def test_a_fault_at_a_module_or_step_the_run_never_reaches_is_refused_early(
        tmp_path, fault, message):
    started = time.perf_counter()
    done = _exec(tmp_path, "--seed", "0", "--max-steps", "3", "--repeats", "3",
                 "--inject-fault", fault, script_args=("--workers", "0"))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    recorded = sorted(p.name for p in (tmp_path / "run").glob("trace-*.json.gz"))
    assert recorded == (["trace-0.json.gz"] if "haed" in fault else [])  # one run, not three
    if "haed" in fault:  # and that run ended at the step after the fault's, not at its end
        assert len(Trace.load(tmp_path / "run" / "trace-0.json.gz").steps) == 2
    assert time.perf_counter() - started < 60


_UNUSED_LAYER = (
    "import torch\n"
    "class Net(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.used, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)\n"
    "    def forward(self, x):\n"
    "        return self.used(x)\n"
    "torch.manual_seed(0)\n"
    "model = Net()\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "for _ in range(3):\n"
    "    model(torch.ones(2, 4)).sum().backward()\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n")
_BARE_MODEL = (
    "import torch\n"
    "fc = torch.nn.Linear(4, 1)\n"
    "opt = torch.optim.SGD(fc.parameters(), lr=0.1)\n"
    "for _ in range(3):\n"
    "    fc(torch.ones(2, 4)).sum().backward()\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n")
_GAN = (
    "import torch\n"
    "from torch import nn\n"
    "torch.manual_seed(0)\n"
    "gen = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))\n"
    "disc = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))\n"
    "opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)\n"
    "opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)\n"
    "g = torch.Generator().manual_seed(1)\n"
    "for _ in range(3):\n"
    "    z, real = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)\n"
    "    d_loss = (disc(real) - 1).pow(2).mean() + disc(gen(z).detach()).pow(2).mean()\n"
    "    opt_d.zero_grad(); d_loss.backward(); opt_d.step()\n"
    "    g_loss = (disc(gen(z)) - 1).pow(2).mean()\n"
    "    opt_g.zero_grad(); g_loss.backward(); opt_g.step()\n")


@pytest.mark.parametrize(("script", "fault", "message"), [
    # a layer the model has but never calls (it was met with a guess at another name)
    (_UNUSED_LAYER, "unused@forward:1", ("the model has a module 'unused', but it was not "
                                         "seen running at step 1 (a layer the forward never "
                                         "calls")),
    # a GAN's generator, a model of its own from the first update on, at step 0 (it was
    # said only not to run, which was false)
    (_GAN, "Sequential.2@forward:0", ("'Sequential.2', but it was not seen running at step 0 "
                                      "(at step 0 only the model the first update trains is "
                                      "known before it runs; another model, trained by an "
                                      "optimizer of its own, is known from that update on: "
                                      "plant at step 1 or later)")),
    # a TorchScript module, which takes no hooks (hooking it crashed every zoom)
    (_UNUSED_LAYER.replace("self.used, self.unused = torch.nn.Linear(4, 1)",
                           "self.used, self.unused = torch.jit.script(torch.nn.Linear(4, 1))"),
     "used@forward:1", ("module 'used' is a TorchScript module (torch.jit.script), which takes "
                        "no hooks: plant at the module that calls it, '(model)'")),
    # an op the module does not run: the ops it ran are named (their names vary by version)
    (_UNUSED_LAYER, "used/aten.convolution@backward:1",
     ("(an op fault names the innermost module the op runs in, not a parent of it; the ops it "
      "ran backward there: aten.mm, aten.sum)")),
    # a model with no submodules, named by the variable that holds it (it ran every run,
    # then said the fault never fired, with no word of "(model)")
    (_BARE_MODEL,
     "fc@forward:1", ("no module 'fc' ran at step 1; the model ran no submodule there (it has "
                     "none, or calls none): name the model itself, (model)")),
], ids=["unused-layer", "model-known-later", "torchscript", "op-not-run", "bare-model"])
def test_a_fault_in_a_module_that_exists_but_was_not_seen_says_why(tmp_path, script, fault,
                                                                   message):
    path = tmp_path / "train.py"
    path.write_text(script)
    done = _exec(tmp_path, "--seed", "0", "--inject-fault", fault, script=path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


@pytest.mark.parametrize(("command", "message"), [
    (["no-such-command-here"], "cannot run 'no-such-command-here'"),
    ([sys.executable, "-c", "print('no training here')"],
     "before its first step (no optimizer step was seen, nor a model called for inference"),
    # a command that fails at once (its own argparse error): said first, not buried after an
    # explanation of what a step is
    ([sys.executable, "-c", "import sys; sys.exit(2)"],
     "exited with code 2 before its first step, and nothing was recorded: the command failed"),
    ([], "needs the command to audit"),
    (["{no_shebang}"], "Exec format error"),  # an executable script without #!
])
def test_exec_refuses_clearly(tmp_path, command, message):
    """... and leaves no run folder of its own making where nothing was recorded."""
    script = tmp_path / "train.py"
    script.write_text("import torch\n")
    script.chmod(0o755)
    command = [str(script) if c == "{no_shebang}" else c for c in command]
    done = run_cli("exec", "--", *command, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2
    assert not list(tmp_path.glob("reports/*")), list(tmp_path.glob("reports/*/*"))


def test_exec_with_a_python_that_cannot_import_detaudit_says_so(tmp_path):
    """The command's Python imports torch but lacks detaudit: said in one line, with the
    Python to use, not "no optimizer step was seen"."""
    fake = tmp_path / "fake" / "detaudit"  # shadows the real one, first after the bootstrap
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'detaudit'\")\n")
    script = tmp_path / "train.py"
    script.write_text("import torch\nprint('training')\n")
    shell = (f'PYTHONPATH="${{PYTHONPATH%%:*}}:{fake.parent}:$PYTHONPATH" '
             f"exec {sys.executable} {script}")
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--", "sh", "-c", shell)
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("detaudit: error: repeat 0: ") and "ran unaudited: " in said
    assert "cannot import detaudit (No module named 'detaudit'); run it with the Python " in said
    assert not list((tmp_path / "run").glob("*.unattached"))


# -- watch -----------------------------------------------------------------------------------
def _train(out: Path, *, nudge_at: int | None = None, steps: int = 6,
           max_steps: int | None = None) -> detaudit.watch:
    """A hand-written loop under watch: 2 epochs over a DataLoader of 3 batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(12, 6, generator=g),
                                       torch.randn(12, 2, generator=g)), batch_size=4)
    with detaudit.watch(model, opt, out=out, max_steps=max_steps) as w:
        for _ in range(steps // 3 if max_steps is None else 1000):
            for x, y in data:
                loss = (model(x) - y).pow(2).mean()
                if w.steps == nudge_at:
                    loss = loss + loss.detach() * torch.finfo(loss.dtype).eps  # 1 ULP
                loss.backward()
                opt.step()
                opt.zero_grad()
                w.step({"mse": loss})
    return w



def test_a_warning_aimed_at_the_caller_of_a_wrapped_function_names_the_users_line(
        tmp_path, monkeypatch):
    """torch's warnings with a stacklevel (torch.load's, a DataLoader's) name the line that
    called the function: detaudit's wrapper in between must not take that place."""
    zero_grad = torch.optim.Optimizer.zero_grad

    def warning_zero_grad(self, *args, **kwargs):  # a library function warning its caller
        warnings.warn("zero_grad called", UserWarning, stacklevel=2)
        return zero_grad(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", warning_zero_grad)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught, \
            detaudit.watch(model, opt, out=tmp_path, max_steps=1):
        warnings.simplefilter("always")
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        line = inspect.currentframe().f_lineno + 1
        opt.zero_grad()
        warnings.warn("the user's own", UserWarning)
    shown = [(w.filename, w.lineno) for w in caught if "zero_grad called" in str(w.message)]
    assert shown == [(__file__, line)]
    own = [w for w in caught if "the user's own" in str(w.message)]
    assert [(w.filename, w.lineno) for w in own] == [(__file__, line + 1)]


def _ema_loop(out: Path, decay: float) -> detaudit.watch:
    """Two epochs of 2 steps; an EMA copy of the model, updated after each step, evaluated
    after each epoch; the model itself evaluated once before training (a sanity check)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    ema = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with detaudit.watch(model, opt, out=out) as w:
        with torch.no_grad():
            model.eval()(x)
        model.train()
        for epoch in range(2):
            w.epoch(epoch)
            for i in range(2):
                model(x[4 * i:4 * i + 4]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters()):
                        e.mul_(decay).add_(p, alpha=1 - decay)
            with torch.no_grad():
                ema.eval()(x)
    return w


def _evaluate(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)


def test_a_model_called_apart_is_named_as_the_outermost_code_holding_it(tmp_path,
                                                                       monkeypatch):
    """timm passes its EMA copy to `validate(model, ...)`: it was named `model`, read as
    the trained model's name; Stable-Baselines3 calls its target network in library code
    (`self.q_net_target` in DQN.train): it was named by its class."""
    def loop(agent_class: type | None = None) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model_ema = copy.deepcopy(model).requires_grad_(False) if agent_class is None else None
        # (the agent's train alone: the loop holds no name for the agent or its target)
        train = agent_class(copy.deepcopy(model).requires_grad_(False)).train if (
            agent_class) else None
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if model_ema is not None:
                _evaluate(model_ema, torch.ones(2, 4))
            else:
                train()

    timm = _attached(tmp_path / "timm.json.gz", loop)
    assert timm.probe["side_models"] == ["model_ema"]

    def wrapped() -> None:  # (timm's own EMA wrapper, whose `module` validate is given)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model_ema = nn.Module()
        model_ema.module = copy.deepcopy(model).requires_grad_(False)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            _evaluate(model_ema.module, torch.ones(2, 4))

    assert _attached(tmp_path / "wrapped.json.gz", wrapped).probe["side_models"] == [
        "model_ema.module"]
    library = tmp_path / "agent.py"
    library.write_text(textwrap.dedent("""\
        import torch

        class Agent:
            def __init__(self, target):
                self.q_net_target = target

            def train(self):
                with torch.no_grad():
                    self.q_net_target(torch.ones(2, 4))
        """))
    spec = importlib.util.spec_from_file_location("agent", library)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    from detaudit.drivers import attach_models
    in_a_library = attach_models.in_a_library  # (and the agent's file, as if installed)
    monkeypatch.setattr(attach_models, "in_a_library",
                        lambda f: f == str(library) or in_a_library(f))
    sb3 = _attached(tmp_path / "sb3.json.gz", functools.partial(loop, agent.Agent))
    assert sb3.probe["side_models"] == ["q_net_target"]


class _ModelEMA:
    """An EMA helper that is no module (as YOLOv5's ModelEMA): its copy is `ema.ema`."""

    def __init__(self, model: nn.Module) -> None:
        self.ema = copy.deepcopy(model).requires_grad_(False)


def test_a_model_called_apart_held_by_a_plain_object_is_named_through_it(tmp_path,
                                                                        monkeypatch):
    """YOLOv5 keeps its EMA copy in a ModelEMA object (no module), in its own training code
    (a library's): the copy was named by its class, the trained model's too."""
    def loop() -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = _ModelEMA(model)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            _evaluate(ema.ema, torch.ones(2, 4))

    assert _attached(tmp_path / "user.json.gz", loop).probe["side_models"] == ["ema.ema"]
    from detaudit.drivers import attach_models
    in_a_library = attach_models.in_a_library  # (this file, as if installed: YOLOv5's train)
    monkeypatch.setattr(attach_models, "in_a_library",
                        lambda f: f == __file__ or in_a_library(f))
    assert _attached(tmp_path / "library.json.gz", loop).probe["side_models"] == ["ema.ema"]


def test_a_model_no_optimizer_trains_is_recorded_once_the_loop_calls_it(tmp_path):
    """An EMA copy evaluated between epochs, whose update differs between runs while the
    training agrees: its parameters are step state from the step after its first call, so
    the runs part there, cause params, said to be a model no optimizer trains (the verdict
    was DETERMINISTIC). The model evaluated before it trains is not taken for one."""
    first = _ema_loop(tmp_path / "same", 0.9)
    _ema_loop(tmp_path / "same", 0.9)
    same = detaudit.compare(tmp_path / "same")
    assert same.verdict.kind == "deterministic", same.verdict.headline
    records = first.trace.frame()
    side = records[records.module.str.startswith("ema")]
    # from the step after the EMA's first call, after each update, named as the loop calls
    # it; the model evaluated first is no side model (it would be recorded from step 0)
    assert set(side.step) == {2, 3} and first.trace.probe["side_models"] == ["ema"]
    _ema_loop(tmp_path / "nudged", 0.9)
    _ema_loop(tmp_path / "nudged", 0.9 + 2**-20)
    nudged = detaudit.compare(tmp_path / "nudged")
    assert (nudged.comparison.first_step, nudged.comparison.cause) == (2, "params")
    assert nudged.summary["cause"]["text"].startswith(
        "the parameters of ema, called by the loop but trained by no optimizer")


class _Teacher(nn.Module):
    """A frozen teacher whose outputs the student's loss takes; `nudge` changes them."""

    def __init__(self, nudge: float) -> None:
        super().__init__()
        self.lin, self.nudge = nn.Linear(4, 1), nudge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (1 + self.nudge)


def _train_beside_a_background_evaluation(path: Path, in_a_thread: bool,
                                          fault: detaudit.Fault | None = None) -> None:
    """3 epochs of 6 steps recorded into `path`; each epoch starts a thread that evaluates
    a copy of the model 200 times meanwhile. With `in_a_thread`, the loop itself runs in a
    thread of its own."""
    def train() -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.randn(64, 32)

        def evaluate(copy_of_model: nn.Module) -> None:
            with torch.no_grad():
                for _ in range(200):
                    copy_of_model(data)

        evaluations = []
        # (the planted step is recorded module by module in every run, as exec does)
        attachment = Attachment(path, {}, fault=fault, planted_step=13)
        attachment.install()
        try:
            for _ in range(3):
                evaluations.append(threading.Thread(
                    target=evaluate, args=(copy.deepcopy(model).eval(),)))
                evaluations[-1].start()
                for _ in range(6):
                    loss = model(data).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            for evaluation in evaluations:
                evaluation.join()
            attachment.finish()
        finally:
            attachment.uninstall()

    if not in_a_thread:
        train()
        return
    loop = threading.Thread(target=train)
    loop.start()
    loop.join()


@pytest.mark.parametrize("in_a_thread", [False, True])
def test_an_evaluation_in_another_thread_is_no_call_of_the_loop(tmp_path, in_a_thread):
    """Calls in another thread than the loop's interleave with its steps at random: they
    made a false DIVERGENT (a side model "m" seen at step 0 or 1). They are not the loop's,
    whichever thread the loop runs in; a planted fault is still found at its step."""
    for run in range(3):
        _train_beside_a_background_evaluation(
            tmp_path / "clean" / f"trace-{run}.json.gz", in_a_thread)
    result = detaudit.compare(tmp_path / "clean")
    assert result.verdict.kind == "deterministic", result.verdict.headline
    assert len(result.comparison.steps) == 18
    for run, planted in enumerate((None, detaudit.Fault("0", "backward", 13))):
        _train_beside_a_background_evaluation(
            tmp_path / "planted" / f"trace-{run}.json.gz", in_a_thread, planted)
    first = detaudit.compare(tmp_path / "planted").summary["first_divergence"]
    assert (first["step"], first["phase"], first["module"], first["role"]) == (
        13, "backward", "0", "origin")


@pytest.mark.parametrize("nudge", [0.0, 2**-20])
@pytest.mark.parametrize("called_apart", ["frozen teacher", "target network"])
def test_a_model_the_loop_calls_apart_is_named_where_its_outputs_differ(
        tmp_path, called_apart, nudge):
    """Distillation: a frozen teacher, called before the student in each step, computes
    differently in one run. Its call is recorded (inputs, output) in the step its outputs
    feed, so it is the origin (it was "head (first record); cause: backward"). A DQN's
    target network as PyTorch's tutorial writes it: a copy of the policy, never put in eval
    mode, called under no_grad and loaded from the policy every other step. It was not
    recorded at all: a fault named at it was refused, and a difference in it was headlined
    outside the model."""
    for run_nudge in (0.0, nudge):
        torch.manual_seed(0)
        student, teacher = nn.Linear(4, 1), _Teacher(run_nudge)
        if called_apart == "frozen teacher":
            teacher.eval().requires_grad_(False)
        else:
            teacher.lin.load_state_dict(student.state_dict())
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        with detaudit.watch(student, opt, out=tmp_path):
            for i in range(4):
                with torch.no_grad():
                    target = teacher(x)
                (student(x) - target).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if called_apart == "target network" and i % 2:
                    teacher.lin.load_state_dict(student.state_dict())
    result = detaudit.compare(tmp_path)
    if not nudge:
        assert result.verdict.kind == "deterministic", result.verdict.headline
        return
    first = result.summary["first_divergence"]
    assert (first["step"], first["phase"], first["module"], first["role"]) == (
        0, "forward", "teacher", "origin")


def test_a_teacher_called_before_the_step_has_its_ops_recorded_for_that_step(tmp_path):
    """The zoom replays the step op by op; a teacher called before the step began has its
    ops recorded aside for the step (they were not recorded at all): a difference it makes
    from a number computed on the host is said to come from outside the dispatcher, and an
    op fault planted in it before the step is named at its op."""
    script = tmp_path / "distill.py"
    script.write_text(
        "import os, sys, torch\n"
        "torch.manual_seed(0)\n"
        "runs = open(sys.argv[1]).read() if os.path.exists(sys.argv[1]) else ''\n"
        "open(sys.argv[1], 'a').write('.')\n"
        "second = len(runs) % 2 if sys.argv[2] == 'nudge' else 0  # the scan's, the zoom's\n"
        "class Teacher(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 1)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x) * (1 + 2**-20 * second)\n"
        "student, teacher = torch.nn.Linear(4, 1), Teacher().eval()\n"
        "opt = torch.optim.SGD(student.parameters(), lr=0.1)\n"
        "for step in range(3):\n"
        "    with torch.no_grad():\n"
        "        target = teacher(torch.ones(2, 4))\n"
        "    (student(torch.ones(2, 4)) - target).pow(2).mean().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n")
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--json", "--",
                   sys.executable, str(script), str(tmp_path / "marker"), "nudge")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["first_divergence"]["module"] == "teacher"
    drill = summary["op_drill_down"]
    assert drill["ops_not_recorded"] is None
    assert drill["outside_dispatcher"]["module"] == "teacher"
    zoomed = Trace.load(tmp_path / "run" / "zoom-0.json.gz").frame()
    assert "op0/aten.addmm/out" in set(zoomed[(zoomed.module == "teacher")
                                              & (zoomed.phase == "op.forward")].slot)
    planted = run_cli("exec", "--out", str(tmp_path / "planted"), "--quiet", "--json",
                      "--inject-fault", "teacher/addmm@forward:1", "--",
                      sys.executable, str(script), str(tmp_path / "marker"), "same")
    assert planted.returncode == 1, planted.stdout + planted.stderr
    summary = json.loads(planted.stdout)
    first = summary["first_divergence"]
    assert (first["step"], first["module"], first["role"]) == (1, "teacher", "origin")
    op = summary["ops"][0]
    assert (op["op"], op["module"], op["role"], op["planted"]) == (
        "aten.addmm", "teacher", "origin", True)
    # measured from the outputs its replays kept aside (it was not measured at all)
    assert (op["elements"], op["max_ulp"]) == (1, 1), op
    assert not list((tmp_path / "planted").glob("*.kept.pt"))


def test_the_zoomed_step_places_each_op_outside_the_model_at_the_users_line(tmp_path):
    """An op the loop runs outside the model (a loss term) is recorded with the line of the
    user's code that ran it, so that an origin op there is named with its line; an op of its
    backward, which the autograd engine runs with no frame of the user's, with the line of
    the forward op whose autograd node it runs, and never another: nodes made where no op of
    the zoom ran (a view's, those a backward with create_graph makes, those an in-place op on
    a view adds) get none (told by sequence numbers, they took the line of the next op that
    made no node: a mask, a target made with torch.ones). The model's own ops have none."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(3, 4)

    def loop():
        for _ in range(2):
            out = model(x)
            penalty = out.sigmoid().sum()  # the line each op outside the model is placed at
            spread = out.expand(3, 2)
            mask = torch.ones(3, 2) > 0  # no node
            twice = out * 2
            twice[:1].mul_(3)
            zeros = torch.zeros(3, 1)  # no node
            slope, = torch.autograd.grad((twice * twice).sum(), out, create_graph=True)
            target = torch.ones(3, 1)  # no node
            (out.square().mean() + penalty + (spread * mask).sum() + (twice + zeros).sum()
             + ((slope - target) ** 2).sum()).backward()
            opt.step()
            opt.zero_grad()

    trace = _attached(tmp_path / "t.json.gz", loop, zoom=1)
    lines = {text.split("=")[0].strip(" ,"): n + loop.__code__.co_firstlineno
             for n, text in enumerate(inspect.getsource(loop).splitlines()) if " = " in text}
    sites = trace.probe[OP_SITES]
    assert sites["1:op0/aten.sigmoid"] == f"{__file__}:{lines['penalty']}"
    assert all(key.startswith("1:") for key in sites)  # the zoomed step only
    records = trace.frame()
    outside = records[records.module == OUTSIDE_MODEL]
    forward = set(outside[outside.phase == "op.forward"].slot.str.rpartition("/")[0])
    assert {f"1:{prefix}" for prefix in forward} == {k for k in sites if ":backward:" not in k}
    backward = {prefix.partition("/")[2]: f"1:backward:{prefix}" for prefix in set(
        outside[outside.phase == "op.backward"].slot.str.rpartition("/")[0])}
    assert sites[backward["aten.sigmoid_backward"]] == f"{__file__}:{lines['penalty']}"
    placed = {int(site.rpartition(":")[2]) for key, site in sites.items()
              if ":backward:" in key and site}
    assert not placed & {lines["mask"], lines["zeros"], lines["target"]}, (placed, lines)
    assert {lines["twice"], lines["slope"]} <= placed  # (their nodes' ops: placed)


def test_an_op_detaudits_driver_runs_in_an_installed_probe_has_no_users_line():
    """A built-in probe installed with detaudit is library code: an op its step runs under
    `detaudit run` has no line of the user's (it was the console script's, `detaudit:8`)."""
    from detaudit.record import sites

    installed = os.path.join(sysconfig.get_paths()["purelib"], "detaudit", "probes", "m.py")
    namespace: dict[str, Any] = {"sys": sys, "site": sites.user_call_site}
    exec(compile("def step():\n    return site(sys._getframe())\n", installed, "exec"),  # noqa: S102
         namespace)
    exec(compile("def run_step():\n    return step()\n",  # noqa: S102
                 os.path.join(sites.PACKAGE_DIR, "drivers", "runner.py"), "exec"), namespace)
    assert namespace["run_step"]() == ""
    line = inspect.currentframe().f_lineno + 1
    assert namespace["step"]() == f"{__file__}:{line}"  # (called from the user's code)


class _ScaledTeacher(nn.Module):
    """A teacher called with a keyword input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, *, scale):
        return self.lin(x) * scale


def _distill() -> None:
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 1), _ScaledTeacher().eval()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(8, 4)
        with torch.no_grad():
            target = teacher(x, scale=torch.full((1,), 2.0))
        (student(x) - target).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_fault_planted_at_a_teachers_output_is_found_there(tmp_path):
    """A model the loop calls apart is recorded by its calls: a fault is planted at its
    output (called before the step it works for begins), one inside it is refused at once
    with the form that works, and the Reproduce list names it, not its layers."""
    # (the planted step is recorded module by module in every run, as exec does)
    for run, fault in enumerate((None, detaudit.Fault("teacher", "forward", 2))):
        trace = _attached(tmp_path / "runs" / f"trace-{run}.json.gz", _distill, fault=fault,
                          planted_step=2)
    summary = detaudit.compare(tmp_path / "runs").summary
    first = summary["first_divergence"]
    assert (first["step"], first["phase"], first["module"], first["role"]) == (
        2, "forward", "teacher", "origin")
    assert "teacher" in summary["modules"] and "teacher.lin" not in summary["modules"]
    records = trace.frame()
    teacher_inputs = set(records[(records.module == "teacher") & (records.phase == "forward")
                                 & (records.step == 0)].slot)
    keywords_seen = "with_kwargs" in inspect.signature(
        nn.modules.module.register_module_forward_hook).parameters
    assert teacher_inputs == {"in.0", "out", *(["in.scale"] if keywords_seen else [])}
    script = tmp_path / "distill.py"
    script.write_text("import torch\nfrom torch import nn\n"
                      + inspect.getsource(_ScaledTeacher) + inspect.getsource(_distill)
                      + "_distill()\n")
    refused = _exec(tmp_path, "--seed", "0", "--inject-fault", "teacher.lin@forward:1",
                    script=script)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "a model the loop calls apart" in refused.stderr
    assert "--inject-fault teacher@forward:1" in refused.stderr
    with pytest.raises(detaudit.DetauditError, match=r"plant at its output \(--inject-fault "
                       r"teacher@forward:1\)"):
        check_side_fault(detaudit.Fault("teacher", "backward", 1), ["teacher"])


def _probe_gradients_loop(out: Path, jitter: float, fault: detaudit.Fault | None = None
                          ) -> Trace:
    """Two epochs of 2 steps; after each epoch, a backward on a validation batch for a
    gradient norm (its loss `jitter`ed), thrown away by zero_grad with no update. Run as
    exec attaches (with `fault` planted), or in a watch when none is."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1))), batch_size=4)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 4)),
                                      batch_size=4)

    def loop() -> None:
        for _ in range(2):
            for (x,) in train:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            (xv,) = next(iter(val))
            opt.zero_grad()
            (model(xv).pow(2).mean() + jitter).backward()
            sum(p.grad.norm() for p in model.parameters())  # logged
            opt.zero_grad()

    if fault is None:
        with detaudit.watch(model, opt, out=out) as w:
            loop()
        return w.trace
    attachment = Attachment(out / "planted.json.gz", {}, fault=fault).install()
    try:
        loop()
        attachment.finish()
    finally:
        attachment.uninstall()
    return Trace.load(out / "planted.json.gz")


def test_a_backward_whose_gradients_are_thrown_away_is_no_step(tmp_path):
    """A gradient norm taken on a validation batch after each epoch (backward, then
    zero_grad, no update) was a step: its loss, with a constant that differs between runs,
    made a false DIVERGENT; its loader's pass counted as an epoch; and a fault planted at
    the next step fired in it. Such a backward is dropped when the next training call
    comes."""
    first = _probe_gradients_loop(tmp_path / "runs", 0.0)
    _probe_gradients_loop(tmp_path / "runs", 1e-3)
    assert [(s.step, s.epoch, s.index) for s in first.steps] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert first.probe["dropped_steps"] == 2
    result = detaudit.compare(tmp_path / "runs")
    assert result.verdict.kind == "deterministic", result.verdict.headline
    planted = _probe_gradients_loop(tmp_path, 0.0, detaudit.Fault("", "backward", 2))
    assert planted.probe["fault_fired"]


def test_gradients_combined_by_hand_after_zero_grad_stay_one_step(tmp_path):
    """PCGrad-like: backward of one task's loss, its gradients kept aside, zero_grad, the
    other task's backward, then the update: one step, both losses (not dropped)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    with detaudit.watch(model, opt, out=tmp_path) as w:
        for _ in range(3):
            out = model(x)
            out[:, 0].sum().backward(retain_graph=True)
            kept = [p.grad.clone() for p in model.parameters()]
            opt.zero_grad()
            out[:, 1].sum().backward()
            for p, g in zip(model.parameters(), kept):
                p.grad += g
            opt.step()
            opt.zero_grad()
    trace = w.trace
    assert len(trace.steps) == 3 and "dropped_steps" not in trace.probe
    assert all(sorted(s.losses) == ["loss", "loss.1"] for s in trace.steps)


def test_models_called_apart_are_named_as_the_loop_holds_them_whatever_their_order(tmp_path):
    """Two EMA copies of one class in a dict, evaluated in an order that alternates between
    runs: named by their keys (emas.fast.0), not by class and first call (MLP, MLP2), which
    swapped between the runs and made a false DIVERGENT. A deepcopy of the model while its
    modules carry the recorder's hooks (a planted step) copies no hook: it failed with
    "cannot pickle '_thread.lock' object". A module traced by torch.jit is no call."""
    import copy

    for run in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        emas = {"fast": (copy.deepcopy(model).requires_grad_(False), 0.5),
                "slow": (copy.deepcopy(model).requires_grad_(False), 0.9)}
        attachment = Attachment(tmp_path / f"trace-{run}.json.gz", {},
                                fault=detaudit.Fault("0", "forward", 5) if run else None)
        attachment.install()
        try:
            for step in range(6):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                copied = copy.deepcopy(model)  # (its hooks: the recorder's, at a planted step)
                with torch.no_grad():
                    for e, decay in emas.values():
                        for pe, p in zip(e.parameters(), copied.parameters()):
                            pe.mul_(decay).add_(p, alpha=1 - decay)
                    for name in ("fast", "slow") if (step + run) % 2 else ("slow", "fast"):
                        e = emas[name][0]
                        e.eval()(x)
                    torch.jit.trace(copied.eval(), x, check_trace=False)
            attachment.finish()
        finally:
            attachment.uninstall()
    traces = [Trace.load(tmp_path / f"trace-{r}.json.gz") for r in range(2)]
    assert sorted(traces[0].probe["side_models"]) == ["emas.fast.0", "emas.slow.0"]
    assert traces[1].probe["fault_fired"]
    # the runs agree until the planted step (the EMAs' records under the same names)
    result = detaudit.compare(*traces)
    assert result.summary["first_divergence"]["step"] == 5, result.verdict.headline


class _NumpyNoisy(torch.utils.data.Dataset):
    """Samples with noise from numpy's global RNG (not seeded by the loop)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i)) + float(np.random.rand())


@pytest.mark.parametrize("where", ["loop", "dataset"])
def test_a_batch_that_differs_says_where_it_changed_and_which_rng(tmp_path, where):
    """Noise added in the loop after the DataLoader (its batches agree): the loop changed
    the input, not the data pipeline. Noise from numpy's unseeded RNG in the dataset: the
    numpy RNG is named beside the batch (both read "the data pipeline ... is not
    reproducible", and nothing more)."""
    for run in range(2):
        torch.manual_seed(0)
        np.random.seed(run)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        noise = torch.Generator().manual_seed(run)
        data = (_NumpyNoisy() if where == "dataset" else
                torch.utils.data.TensorDataset(torch.arange(32.0).view(8, 4)))
        with detaudit.watch(model, opt, out=tmp_path):
            for batch in torch.utils.data.DataLoader(data, batch_size=4):
                x = batch if where == "dataset" else batch[0] + torch.rand(4, 4, generator=noise)
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    cause = detaudit.compare(tmp_path).summary["cause"]
    assert cause["kind"] == "data"
    if where == "loop":
        assert cause["text"].startswith("the model's input differs while the batches the "
                                        "DataLoader yielded agree: the training loop changed")
    else:
        assert cause["text"].startswith("the batch differs: the data pipeline")
        assert "the numpy RNG state differs as well as the step begins" in cause["text"]


_WATCHING = """\
import sys
import torch
import detaudit

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [torch.randn(4, 8) for _ in range(3)]
with detaudit.watch(model, opt, out=sys.argv[1]) as w:
    for epoch in range(2):
        w.epoch(epoch)
        for x in data:
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step({"loss": loss})
"""


def test_a_script_that_watches_its_loop_is_recorded_by_exec_alone(tmp_path):
    """`detaudit compare` of a watched folder suggests exec to replay the step; under exec,
    every run and replay wrote a trace of its own into the watch's folder too (the replays'
    unclosed), and comparing that folder then failed."""
    script, watched = tmp_path / "watching.py", tmp_path / "watched"
    script.write_text(_WATCHING)
    done = _exec(tmp_path, "--seed", "0", "--inject-fault", "0@forward:2", script=script,
                 script_args=(str(watched),))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "first at step 2 (epoch 1), forward, 0 (origin)" in done.stdout
    assert "the watch records nothing" in done.stderr
    assert not watched.exists() or not any(watched.iterdir())
    assert len(Trace.load(tmp_path / "run" / "trace-0.json.gz").steps) == 6


def test_compare_of_watched_runs_names_the_script_exec_would_replay(tmp_path):
    script, watched = tmp_path / "watching.py", tmp_path / "watched"
    script.write_text(_WATCHING.replace("            loss.backward()\n", (
        "            loss.backward()\n"
        "            if len(sys.argv) > 2 and w.steps == 2:\n"
        "                model[0].bias.grad[0] += 1e-3\n")))
    for nudge in ((), ("nudge",)):
        subprocess.run([sys.executable, str(script), str(watched), *nudge], check=True,
                       cwd=tmp_path, capture_output=True)
    headline = detaudit.compare(watched, out=tmp_path / "compared").verdict.headline
    assert headline.startswith("DIVERGENT: first at step 2 (epoch 1), grad"), headline
    # (the Python the script ran in: a `python` on the PATH may have no torch)
    assert headline.endswith(f"(`detaudit exec -- {sys.executable} watching.py {watched}` "
                             "replays that step module by module)"), headline


def test_a_loader_shuffling_from_a_generator_seeded_by_the_os_is_said_to(tmp_path):
    """Every RNG state agrees, yet the DataLoader's batches differ: its own generator, seeded
    from the OS. The text named an environment reset and default_rng, not the loader."""
    from detaudit.analysis.compare import compare

    def loop() -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.randn(16, 4))
        generator = torch.Generator()
        generator.seed()  # from the OS: another order in every run
        for (x,) in torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                                generator=generator):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

    c = compare([_attached(tmp_path / f"{k}.json.gz", loop) for k in "ab"])
    assert (c.first_step, c.cause) == (0, "data")
    assert cause_text(c).startswith(
        "the batch the DataLoader yielded differs while every RNG state agrees as the step "
        "begins: the loader draws its order or its augmentation from a generator of its own")


def test_watch_twice_in_one_process_compares_deterministic(tmp_path):
    first, second = _train(tmp_path), _train(tmp_path)
    assert first.path != second.path
    assert [(s.epoch, s.index) for s in first.trace.steps] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert first.trace.steps[0].losses.keys() == {"loss", "mse"}
    result = detaudit.compare(tmp_path)
    assert result.exit_code == 0 and result.verdict.kind == "deterministic"
    # the loss curve is the loss backward was called on; the named term is a part of it
    # (it was drawn as their sum, twice the loss)
    losses = first.trace.steps[0].loss_values()
    assert result.summary["loss"]["curves"]["0"][0]["loss"] == losses["loss"] == losses["mse"]
    assert repr(result) == ("<detaudit.Compared DETERMINISTIC: 2 repeats bit-identical over 6 "
                            "steps (exit 0)>")  # not a dump of every field
    shown = result._repr_html_()
    assert "DETERMINISTIC" in shown
    # in a frame of its own: the report's page styles would restyle the notebook around it
    assert shown.startswith('<iframe srcdoc="&lt;!DOCTYPE html&gt;') and "<style" not in shown


def test_runs_of_different_lengths_compare_their_losses_over_the_steps_all_ran(tmp_path):
    """A run one epoch shorter (a script that reads what the run before left): its missing
    steps were counted as identical losses, "bit-identical in every step", steps 0-5."""
    _train(tmp_path, steps=6), _train(tmp_path, steps=3)
    result = detaudit.compare(tmp_path)
    assert (result.verdict.kind, result.comparison.cause) == ("divergent", "length")
    loss = result.summary["loss"]
    assert [p["step"] for p in loss["per_step"]] == [0, 1, 2]
    assert [e["epoch"] for e in loss["per_epoch"]] == [1]
    assert "loss: bit-identical in the 3 steps every repeat ran (steps 3–5 ran in some only)" \
        in render_console(result.summary)


def _bn_loop(out: Path, momentum: float) -> None:
    """A model with BatchNorm, trained 3 steps under watch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model[1].momentum = momentum
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    with detaudit.watch(model, opt, out=out):
        for i in range(3):
            model(x[4 * i:4 * i + 4]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def test_batchnorm_running_statistics_are_recorded_though_their_version_never_moves(tmp_path):
    """The batch-norm kernel writes running_mean and running_var in place without moving
    their version counters: only num_batches_tracked was recorded, and running statistics
    that differ (they decide what the model computes in eval mode) passed unseen."""
    _bn_loop(tmp_path / "same", 0.1), _bn_loop(tmp_path / "same", 0.1)
    same = detaudit.compare(tmp_path / "same")
    assert same.verdict.kind == "deterministic"
    records = same.traces[0].frame()
    stats = records[records.slot.isin(["buffer.running_mean", "buffer.running_var"])]
    # as built (step 0), then as each training step left them
    assert sorted(set(stats.step)) == [0, 1, 2] and set(stats.module) == {"1"}
    _bn_loop(tmp_path / "apart", 0.1), _bn_loop(tmp_path / "apart", 0.1 + 1e-4)
    apart = detaudit.compare(tmp_path / "apart")
    assert (apart.verdict.kind, apart.comparison.first_step) == ("divergent", 1)
    assert "the model's buffers (1.running_mean, 1.running_var) differ" in (
        cause_text(apart.comparison))


def test_an_optimizer_made_for_another_model_is_refused_at_once(tmp_path):
    """A notebook: the cell that builds the model run again, the optimizer's not: the
    watched model never trains (compare called the two runs different models)."""
    model = nn.Linear(4, 1)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    model = nn.Linear(4, 1)
    with pytest.raises(detaudit.DetauditError, match="an optimizer made for this one"):
        detaudit.watch(model, stale, out=tmp_path)
    assert not list(tmp_path.iterdir())
    with pytest.warns(UserWarning, match="recorded no step"), detaudit.watch(
            model, torch.optim.SGD(model.parameters(), lr=0.1), out=tmp_path):
        pass  # (the optimizer made for it: taken)


@pytest.mark.parametrize("named", ["before backward", "before the update", "after it"])
def test_w_step_anywhere_in_the_iteration_ends_one_step(tmp_path, named):
    """w.step(losses) called before loss.backward() counted each iteration as two steps
    (the forward, then the update); before the update or after it, one."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with detaudit.watch(model, opt, out=tmp_path) as w:
        for i in range(3):
            loss = model(torch.ones(3, 4) * i).pow(2).mean()
            if named == "before backward":
                w.step({"mse": loss})
            loss.backward()
            if named == "before the update":
                w.step({"mse": loss})
            opt.step()
            opt.zero_grad()
            if named == "after it":
                w.step({"mse": loss})
    steps = w.trace.steps
    assert [s.step for s in steps] == [0, 1, 2]
    assert all("mse" in s.losses for s in steps)


def test_what_w_step_logs_beside_the_loss_is_compared_too(tmp_path):
    """A number or a tensor of any size logged with the loss is recorded (numbers were
    dropped unsaid): equal in every run, no false alarm; one that differs, at its step.
    What holds nothing to record is warned about, once."""
    def train(folder: str, accuracy_drift: float) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with detaudit.watch(model, opt, out=tmp_path / folder) as w:
            for i in range(3):
                out = model(torch.ones(2, 4))
                per_class = out.pow(2).mean(0)
                per_class.sum().backward()
                opt.step()
                opt.zero_grad()
                w.step({"loss": per_class.sum(), "per_class": per_class,
                        "accuracy": 0.5 + (accuracy_drift if i == 2 else 0.0),
                        "seen": np.int64(2 * (i + 1)), "confusion": np.eye(3),
                        "writer": object()})

    for folder, drift in (("same", 0.0), ("same", 0.0), ("drift", 0.0), ("drift", 2**-40)):
        with pytest.warns(UserWarning, match="w.step got 'writer'") as said:
            train(folder, drift)
        assert len([w for w in said if "w.step got" in str(w.message)]) == 1
    assert detaudit.compare(tmp_path / "same").verdict.kind == "deterministic"
    c = detaudit.compare(tmp_path / "drift").comparison
    assert (c.first_step, [d.slot for d in c.first_diffs]) == (2, ["loss.accuracy"])
    records = Trace.load(next((tmp_path / "same").glob("*.json.gz"))).frame()
    logged = set(records[(records.step == 0) & records.slot.str.startswith("loss.")].slot)
    assert {"loss.loss", "loss.per_class", "loss.accuracy", "loss.seen",
            "loss.confusion"} <= logged


def test_watch_finds_a_planted_difference_at_its_step(tmp_path):
    _train(tmp_path)
    _train(tmp_path, nudge_at=4)
    result = detaudit.compare(tmp_path, out=tmp_path / "report")
    assert result.exit_code == 1
    assert (result.comparison.first_step, result.comparison.first_epoch) == (4, 1)
    # of the runs compared (it said "1 repeat, 1 epoch": each trace's own stand-in)
    assert (result.summary["config"]["repeats"], result.summary["config"]["epochs"]) == (2, 2)
    html = result._repr_html_()
    assert "DIVERGENT" in html and "step 4" in html
    assert (tmp_path / "report" / "report.html").exists()
    assert "seed 0" not in (tmp_path / "report" / "report.md").read_text()  # watch seeds nothing
    assert "device" not in result.summary["config"]  # nor picks a device: the loop does
    # and the CLI says the same of the same traces
    done = run_cli("compare", str(tmp_path / "trace-0.json.gz"), str(tmp_path / "trace-1.json.gz"),
                   "--out", str(tmp_path / "cli"), "--json", "--junit", str(tmp_path / "j.xml"))
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["first_divergence"]["step"] == 4
    case = ET.parse(tmp_path / "j.xml").getroot().find("testsuite/testcase")
    assert case.find("failure") is not None and float(case.get("time")) > 0  # the command's


def test_rng_streams_that_nothing_draws_from_are_a_note_never_the_divergence(tmp_path):
    import random

    import numpy as np

    _train(tmp_path / "same")
    random.random(), np.random.rand()  # python and numpy never seeded: their states differ
    _train(tmp_path / "same")
    same = detaudit.compare(tmp_path / "same")
    assert same.comparison.deterministic and same.comparison.idle_rng == ["numpy", "python"]
    # said to be unseeded, not unused: runs whose draws happened to agree (a coin flip) are
    # luck, and were told that nothing uses the stream
    said = render_console(same.summary)
    assert ("the RNG state of numpy, python differs between the repeats (unseeded), and "
            "nothing drawn from it changed the runs this time: seed it") in said, said
    assert "unused" not in said
    _train(tmp_path / "nudged")
    random.random(), np.random.rand()
    _train(tmp_path / "nudged", nudge_at=4)  # and a real difference at step 4
    nudged = detaudit.compare(tmp_path / "nudged").comparison
    assert (nudged.first_step, nudged.cause) == (4, "forward")  # not "rng" at step 0
    assert nudged.idle_rng == ["numpy", "python"]
    _train(tmp_path / "first")
    random.random(), np.random.rand()
    _train(tmp_path / "first", nudge_at=0)  # a difference at the first step, not in its state
    first = detaudit.compare(tmp_path / "first").comparison
    assert (first.first_step, first.cause, first.idle_rng) == (0, "forward", ["numpy", "python"])


def _clipped(out, nudge: bool) -> None:
    """A loop that clips the weights in place after every update (as WGAN's critic does);
    with `nudge`, one weight is also changed after the update of step 1."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with detaudit.watch(model, opt, out=out):
        for step in range(4):
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model.weight.clamp_(-0.3, 0.3)
                if nudge and step == 1:
                    model.weight[0, 0] += 1e-3


def test_a_parameter_changed_between_steps_outside_the_optimizer_is_the_cause(tmp_path):
    _clipped(tmp_path / "same", False)
    _clipped(tmp_path / "same", False)
    assert detaudit.compare(tmp_path / "same").verdict.kind == "deterministic"
    _clipped(tmp_path / "nudged", False)
    _clipped(tmp_path / "nudged", True)
    c = detaudit.compare(tmp_path / "nudged").comparison
    assert (c.first_step, c.cause) == (2, "params")  # not a forward difference at step 2
    first = c.first_by_phase["state"]
    assert first.slot == "param.weight" and first.module == ""


def test_only_the_training_loaders_batches_are_step_state(tmp_path):
    # an evaluation loader read between steps, shuffled in an order that differs run to run,
    # is not the training data: neither recorded nor a divergence
    def train(out, order_seed):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
        train_loader = torch.utils.data.DataLoader(data, batch_size=4)
        held_out = torch.utils.data.DataLoader(
            data, batch_size=2, shuffle=True,
            generator=torch.Generator().manual_seed(order_seed))
        with detaudit.watch(model, opt, out=out) as w:
            for _ in range(2):
                for x, y in train_loader:
                    (model(x) - y).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    with torch.no_grad():
                        for x_val, _ in held_out:
                            model.eval()(x_val)
                    model.train()
        return w

    first, _ = train(tmp_path, 1), train(tmp_path, 2)
    assert detaudit.compare(tmp_path).verdict.kind == "deterministic"
    records = Trace.load(first.path).frame()
    loaded = records[records.slot.str.startswith("batch.loader")]
    assert sorted(loaded.groupby("step").size().items()) == [(s, 2) for s in range(4)]


def test_an_unseeded_rng_that_the_loop_draws_from_later_is_named_unseeded(tmp_path):
    import random

    def train(python_seed):
        random.seed(python_seed)  # as if never seeded: another state in each run
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(2, 4)
        with detaudit.watch(model, opt, out=tmp_path) as w:
            for step in range(3):
                jitter = random.random() if step == 2 else 1.0  # drawn from at step 2 only
                model(x * jitter).sum().backward()
                opt.step()
                opt.zero_grad()
        return w

    train(1), train(2)
    c = detaudit.compare(tmp_path).comparison
    assert (c.first_step, c.cause, c.loss.first_step) == (0, "rng", 2)
    assert cause_text(c).startswith("the python RNG state differs before the first step: it "
                                   "is not seeded")


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpoint_recomputing_in_backward_is_no_second_batch(tmp_path, reentrant):
    # checkpoint_sequential calls the Sequential's children, never the Sequential: the
    # first child is the top-level call, and its recompute in backward is no new batch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4, requires_grad=True)

    def loop():
        for _ in range(2):
            torch.utils.checkpoint.checkpoint_sequential(
                model, 2, x, use_reentrant=reentrant).sum().backward()
            opt.step()
            opt.zero_grad()

    records = _attached(tmp_path / "trace.json.gz", loop).frame()
    batches = records[(records.phase == "state") & records.slot.str.startswith("batch")]
    assert sorted(set(zip(batches.step, batches.call))) == [(0, 0), (1, 0)]


def test_parametrized_layers_and_a_part_called_first_are_not_taken_for_the_model(tmp_path):
    """spectral_norm's parametrization is called as the model is built, and the loop calls
    the backbone alone first: the model is still the module the optimizer trains (the
    ParametrizationList was, so modules were named Net.conv and no batch was recorded)."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = spectral_norm(nn.Linear(4, 8))
            self.head = weight_norm(nn.Linear(8, 1))

        def forward(self, x):
            return self.head(torch.relu(self.backbone(x)))

    def loop():
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.backbone(torch.ones(2, 4))  # a sanity check of one part
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    records = _attached(tmp_path / "trace.json.gz", loop).frame()
    params = set(records[records.slot.str.startswith("param.")].module)
    assert params == {"backbone", "backbone.parametrizations.weight", "head",
                      "head.parametrizations.weight"}
    batches = records[(records.phase == "state") & records.slot.str.startswith("batch")]
    assert sorted(set(batches.step)) == [0, 1]


def test_a_model_built_anew_to_resume_in_the_same_process_takes_the_models_place(tmp_path):
    """A loop that saves, builds the model and optimizer again and loads them (a restart
    after a NaN): the new model is the model, under the same names, its batches recorded
    (it was a second model 'Sequential.0', and its first step had no batch)."""
    def build():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def loop():
        torch.manual_seed(0)
        model, opt = build()
        for step in range(4):
            if step == 2:  # resume from what was saved
                saved = {"model": model.state_dict(), "opt": opt.state_dict()}
                model, opt = build()
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    records = _attached(tmp_path / "trace.json.gz", loop).frame()
    assert set(records.module) == {"", "0", "2"}
    batches = records[(records.phase == "state") & records.slot.str.startswith("batch")]
    assert sorted(set(batches.step)) == [0, 1, 2, 3]
    state = records[(records.phase == "state") & records.slot.str.startswith("param.")]
    assert sorted(set(state.step)) == [0, 2]  # the resumed model's parameters, as it begins


def test_a_failure_inside_detaudits_own_hook_is_never_blamed_on_the_users_code(
        tmp_path, monkeypatch):
    from detaudit.record import recorder

    monkeypatch.setattr(recorder, "rng_states", lambda: {"torch": None})  # a bug, planted
    model = nn.Linear(4, 1)
    with pytest.raises(TypeError), detaudit.watch(model, out=tmp_path) as w:
        model(torch.ones(2, 4)).sum().backward()
    failure = Trace.load(w.path).failure
    assert failure.startswith("detaudit's own recording failed in step 0 at ")
    assert "(TypeError at fingerprint.py:" in failure and "a bug in detaudit" in failure
    # and the user's own error stays the user's, raised through the same hooks
    monkeypatch.undo()
    with pytest.raises(RuntimeError), detaudit.watch(model, out=tmp_path) as w:
        model(torch.ones(2, 3))  # the wrong width: torch raises inside the module's call
    assert Trace.load(w.path).failure.startswith("RuntimeError in step 0 at ")


def test_watch_warns_when_the_model_given_is_never_called(tmp_path):
    """The loop calls a module that holds the model given (never called on its own); an
    optimizer that trains another model than the one given is refused at once, and one
    found stepping is said to."""
    trained, other = nn.Linear(4, 1), nn.Linear(4, 1)
    holder = nn.Sequential(trained)
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)

    def train_watching(given, called, optimizer=opt):
        with detaudit.watch(given, optimizer, out=tmp_path):
            called(torch.ones(2, 4)).sum().backward()
            opt.step()

    with pytest.warns(UserWarning, match=r"model given \(Linear\) was never called"):
        train_watching(trained, holder)
    with pytest.raises(detaudit.DetauditError, match="give watch the model it trains"):
        train_watching(nn.Linear(4, 2), trained)  # (another live module's)
    with pytest.warns(UserWarning, match=r"updated no parameter of the model given"):
        train_watching(other, trained, None)  # (no optimizer given: the one found steps)
    with warnings.catch_warnings():  # and never when it was
        warnings.simplefilter("error")
        train_watching(trained, trained)


def test_watch_of_a_loop_whose_optimizer_updates_master_copies_is_no_error(tmp_path):
    """Mixed precision by hand: the optimizer updates float32 copies of a bfloat16 model's
    parameters, which the loop copies back: watched with a warning (it was refused as an
    optimizer made for another model), and its runs compared."""
    def train() -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1).to(torch.bfloat16)
        masters = [p.detach().float().requires_grad_() for p in model.parameters()]
        opt = torch.optim.SGD(masters, lr=0.1)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with detaudit.watch(model, opt, out=tmp_path):
                for _ in range(3):
                    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
                    for master, p in zip(masters, model.parameters()):
                        master.grad = p.grad.float()
                        p.grad = None
                    opt.step()
                    with torch.no_grad():
                        for master, p in zip(masters, model.parameters()):
                            p.copy_(master)
        assert [str(w.message).split(":")[1] for w in said] == [(
            " the optimizer given updates copies of the parameters of the model given (Linear), "
            "not them (float32 master weights, a flattened buffer)")]

    train(), train()
    result = detaudit.compare(tmp_path)
    assert result.verdict.kind == "deterministic" and len(result.traces[0].steps) == 3


def test_the_modules_a_fault_takes_are_listed_in_the_models_order(tmp_path):
    """model.2 before model.12 (they were sorted as text)."""
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(12)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with detaudit.watch(model, opt, out=tmp_path):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    assert detaudit.compare(tmp_path).summary["modules"] == [str(i) for i in range(12)]


def test_watch_max_steps_ends_the_loop_and_leaves_torch_as_it_was(tmp_path):
    backward = torch.Tensor.backward
    w = _train(tmp_path, max_steps=2)
    assert len(w.trace.steps) == 2
    assert torch.Tensor.backward is backward  # every patch undone
    assert Trace.load(w.path).steps[-1].step == 1


def test_watch_keeps_the_steps_before_an_error_in_the_loop(tmp_path):
    """The step the error comes in is not kept, after its update too: what the loop does
    after the update (naming its losses in w.step) never ran, and its missing records made
    a crashed run's comparison with good ones DIVERGENT, exit 1."""
    def train(crash_at: int | None) -> detaudit.watch:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with contextlib.suppress(ValueError), detaudit.watch(model, opt, out=tmp_path) as w:
            for step in range(5):
                loss = model(torch.ones(2, 3)).sum()
                loss.backward()
                opt.step()
                if step == crash_at:
                    raise ValueError("the loop's own bug")
                w.step({"loss": loss})
        return w

    trace = Trace.load(train(crash_at=2).path)
    assert len(trace.steps) == 2 and "ValueError in step 2 at " in trace.failure
    train(crash_at=None), train(crash_at=None)
    result = detaudit.compare(tmp_path)
    assert (result.verdict.kind, result.exit_code) == ("failed", 3), result.verdict.headline
    assert "the repeats agree over the 2 steps every repeat completed" in (
        result.verdict.headline)


@pytest.mark.parametrize("apart", ["in the batch", "nowhere"])
def test_backward_passes_a_run_ends_without_applying_are_its_last_step(tmp_path, apart):
    """A loop that ends after backward, before the update that would apply it (passes
    accumulated toward a nominal batch larger than the data: Ultralytics' at nbs 64), keeps
    them as its last step, without an update. Runs that differed only there, in the batch,
    its loss and the BatchNorm statistics it left, were DETERMINISTIC."""
    def train(run: int) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with detaudit.watch(model, opt, out=tmp_path / "runs"):
            for i in range(5):  # accumulating 2 batches: the last is never applied
                x = torch.arange(32.0).reshape(8, 4) / (i + 1)
                if i == 4 and apart == "in the batch":
                    x[0, 0] += run  # (the second run's last batch)
                model(x).square().mean().backward()
                if i % 2 == 1:
                    opt.step()
                    opt.zero_grad()

    train(0), train(1)
    result = detaudit.compare(tmp_path / "runs")
    steps = result.traces[0].steps
    assert [s.optimizer_stepped for s in steps] == [True, True, False]
    assert len(steps[2].losses) == 1  # (the pass it holds)
    records = result.traces[0].frame()
    assert {"param.weight", "param.bias"} <= set(
        records[(records.step == 2) & (records.phase == "grad")].slot)  # the gradients left
    if apart == "nowhere":
        assert result.verdict.headline == (
            "DETERMINISTIC: 2 repeats bit-identical over 3 steps"), result.verdict.headline
        return
    assert result.exit_code == 1, result.verdict.headline
    assert result.verdict.headline.startswith("DIVERGENT: first at step 2 (epoch 1), state, ")
    assert result.comparison.cause == "data"
    assert ("; step 2 is the backward passes the run ended without applying (no update "
            "followed them)") in result.verdict.headline


def test_exec_keeps_the_steps_before_an_error_between_two_updates(tmp_path):
    """As watch does: in exec the error reaches the trace through the process's excepthook
    (the failure is the trace's, not finish's argument), and the step it came in, half
    updated, was kept: compared with good runs, DIVERGENT."""
    def run(path: Path, crash_at: int | None) -> Trace:
        torch.manual_seed(0)
        first, second = nn.Linear(3, 4), nn.Linear(4, 1)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
        attachment = Attachment(path, {}).install()
        try:
            for step in range(4):
                second(first(torch.ones(2, 3))).sum().backward()
                opts[0].step()
                if step == crash_at:
                    attachment.trace.failure = "ValueError in step 2 (as exec's excepthook)"
                    break
                opts[1].step()
                for opt in opts:
                    opt.zero_grad()
            attachment.finish()
        finally:
            attachment.uninstall()
        return Trace.load(path)

    assert len(run(tmp_path / "crashed.json.gz", crash_at=2).steps) == 2
    good = [run(tmp_path / f"good-{i}.json.gz", crash_at=None) for i in range(2)]
    assert len(good[0].steps) == 4
    result = detaudit.compare(*sorted(tmp_path.glob("*.json.gz")))
    assert (result.verdict.kind, result.exit_code) == ("failed", 3), result.verdict.headline


def test_watch_records_an_optimizer_that_steps_with_a_closure(tmp_path):
    """step(closure) runs forward and backward inside the optimizer step (LBFGS, Lightning):
    the gradients are recorded as the update used them, each closure call's loss kept;
    the step's loss is the first evaluation's, which step() returns (it was their sum)."""
    returned = []

    def train() -> detaudit.watch:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        with detaudit.watch(model, out=tmp_path) as w:  # the optimizer found by its hooks
            for _ in range(3):
                def closure():
                    opt.zero_grad()
                    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
                    loss.backward()
                    return loss
                returned.append(opt.step(closure).item())
        return w

    w = train()
    records = w.trace.frame()
    assert len(w.trace.steps) == 3
    assert set(w.trace.steps[0].losses) == {"loss", "loss@1"}  # two closure calls
    assert [s.loss_total() for s in w.trace.steps] == returned
    assert set(records[records.phase == "grad"].step) == {0, 1, 2}
    train()
    assert detaudit.compare(tmp_path).verdict.kind == "deterministic"


def _lbfgs_run(path: Path, fault: detaudit.Fault | None = None) -> Trace:
    """3 LBFGS steps of 4 evaluations each (the parameters change between them), recorded
    into `path` as exec records them; step 2 module by module in every run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(32, 6), torch.randn(32, 1)

    def loop() -> None:
        for _ in range(3):
            def closure():
                opt.zero_grad()
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                return loss
            opt.step(closure)

    return _attached(path, loop, fault=fault, planted_step=2)


def test_a_backward_difference_in_one_evaluation_of_lbfgs_is_no_forward_of_the_next(
        tmp_path):
    """LBFGS updates the parameters between the evaluations of one step: the next
    evaluation's forward differs from equal inputs because the gradients before it did. Each
    evaluation's gradients are recorded, and what ran after a differing one is downstream
    of it (it was "forward, 0 (origin); cause: forward")."""
    clean = _lbfgs_run(tmp_path / "trace-0.json.gz")
    grads = clean.frame()
    grads = grads[(grads.step == 2) & (grads.phase == "grad")]
    assert sorted(set(grads.call)) == [0, 1, 2, 3]  # one per evaluation
    _lbfgs_run(tmp_path / "trace-1.json.gz", detaudit.Fault("0", "backward", 2))
    result = detaudit.compare(tmp_path)
    first = result.summary["first_divergence"]
    assert (first["step"], first["phase"], first["module"], first["role"]) == (
        2, "backward", "0", "origin")
    assert result.comparison.cause == "backward"
    assert [f"{o.phase} {o.module}" for o in result.comparison.origins] == ["backward 0"]


def test_watch_records_a_step_the_grad_scaler_skipped_as_a_step_without_update(tmp_path):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with detaudit.watch(model, opt, out=tmp_path) as w:
        for step in range(3):
            x = torch.full((2, 3), float("inf") if step == 1 else 1.0)  # step 1: inf gradients
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    steps = w.trace.steps
    assert [s.optimizer_stepped for s in steps] == [True, False, True]
    assert [s.scale for s in steps] == [4.0, 2.0, 2.0]  # halved after the skipped step
    assert [len(s.losses) for s in steps] == [1, 1, 1]  # three steps, not two merged


def test_a_loss_a_grad_scaler_scaled_is_said_to_be_the_scaled_one(tmp_path):
    """The size table showed the loss backward was called on, 65,536 times the script's
    own, without a word of the scale."""
    for run in range(2):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        with detaudit.watch(model, opt, out=tmp_path):
            for step in range(2):
                x = torch.full((2, 3), 2.0 if step == 1 and run == 1 else 1.0)
                scaler.scale(model(x).sum()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    result = detaudit.compare(tmp_path, out=tmp_path / "report")
    assert result.summary["loss_scale"] == 4.0
    assert ("A loss is what backward was called on: under a GradScaler, the scaled loss (its "
            "scale after that step: 4).") in (tmp_path / "report" / "report.md").read_text()


def test_a_run_that_trains_on_the_model_of_the_run_before_is_told_apart_from_unseeded(tmp_path):
    # a notebook's training cell run twice, the cell that builds the model once
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with detaudit.watch(model, opt, out=tmp_path):
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    c = detaudit.compare(tmp_path).comparison
    assert (c.first_step, c.cause, c.continued_from) == (0, "init", (1, 0, 1, True))
    assert "repeat 1 began with the parameters repeat 0 ended with" in cause_text(c)
    # built anew from an unseeded RNG instead: the seeding fix; where its batches are drawn
    # from that RNG too, that is said beside the initialisation
    for folder, batch in (("unseeded", torch.ones), ("unseeded-data", torch.randn)):
        for _ in range(2):
            model = nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with detaudit.watch(model, opt, out=tmp_path / folder):
                model(batch(2, 4)).sum().backward()
                opt.step()
        result = detaudit.compare(tmp_path / folder)
        c = result.comparison
        assert (c.cause, c.continued_from) == ("init", None) and "unseeded RNG" in cause_text(c)
        assert ("the first batch differs as well" in cause_text(c)) == (folder == "unseeded-data")
        assert "seeded_loader_kwargs" not in cause_text(c)  # (no DataLoader: no workers to seed)
        # the parameters are named first, not the batch the step then sees
        assert result.summary["first_divergence"]["slots"][0].startswith("param."), folder


@pytest.mark.parametrize("reference_first", [True, False])
def test_a_frozen_copy_built_unseeded_is_no_forward_origin(tmp_path, reference_first):
    """TRL's DPO: a reference copy of the model, frozen, called in each step, both built
    before the code seeds. The copy's call (recorded whole: its inputs and output) was
    headlined as a forward origin, "its inputs agree", though its parameters differ; called
    after the model, its parameters were not even recorded until the next step."""
    def loop() -> None:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        torch.manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            x = torch.randn(8, 8)
            if not reference_first:
                log_probs = model(x).log_softmax(-1)
            with torch.no_grad():
                reference = ref(x).log_softmax(-1)
            if reference_first:
                log_probs = model(x).log_softmax(-1)
            loss = (log_probs - reference).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    _unseeded_runs(tmp_path, loop)
    c = detaudit.compare(tmp_path).comparison
    assert (c.first_step, c.cause) == (0, "init")
    assert [(f.module, f.phase) for f in c.findings if f.step == 0 and f.role == "origin"] == []
    assert ("ref", "forward") in [(f.module, f.phase) for f in c.findings if f.step == 0]


def test_a_dataset_that_seeds_each_sample_is_not_taken_for_the_seeding_of_the_model(tmp_path):
    """torchvision's FakeData seeds torch with each sample's index, then puts the RNG state
    back: in an unseeded script (an unseeded sampler: other indices, so other seeds each
    run) that was said to be the code seeding at random, with a fix for the seed's source.
    A seed after the model is built did not build it: the unseeded initialisation is the
    cause, and its fix to seed first."""
    def loop() -> None:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            index = int(torch.randint(0, 10**6, ()))  # an unseeded sampler's
            state = torch.get_rng_state()
            torch.manual_seed(index)  # FakeData.__getitem__
            x = torch.randn(8, 4)
            torch.set_rng_state(state)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    _unseeded_runs(tmp_path, loop)
    c = detaudit.compare(tmp_path).comparison
    assert (c.first_step, c.cause) == (0, "init") and c.seeded_late is not None
    said = cause_text(c)
    assert "a different value in each run" not in said
    assert "fixes it only where the seed is drawn" not in said
    assert "initialised from an unseeded RNG (fix: seed every RNG before building" in said, said


def test_a_model_built_before_the_code_seeds_is_told_so_with_where_it_seeds(tmp_path):
    """The model built from the unseeded RNG, then torch seeded (Hugging Face's Trainer
    seeds in its __init__): every RNG agrees as the first step begins, the parameters do
    not. Said with the line that seeded (it read as weights loaded from elsewhere)."""
    def loop() -> None:
        model = nn.Linear(4, 1)
        torch.manual_seed(42)  # the line named
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()

    _unseeded_runs(tmp_path, loop)
    c = detaudit.compare(tmp_path).comparison
    line = inspect.getsourcelines(loop)[1] + 2
    assert c.cause == "init" and c.seeded_late == f"{__file__}:{line}"
    assert f"the code seeded it only after that, at {__file__}:{line}" in cause_text(c)
    # (the fix is not one framework's alone: it was "transformers.set_seed first" for all)
    assert "or the framework's own: transformers.set_seed, composer" in cause_text(c)
    # seeded before the model is built: nothing to say, and nothing differs
    def seeded_first() -> None:
        torch.manual_seed(42)
        model = nn.Linear(4, 1)
        torch.manual_seed(42)  # (again, after: the weights came from the seeded RNG)
        model(torch.ones(2, 4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()

    with torch.random.fork_rng():
        for run in range(2):
            _attached(tmp_path / "first" / f"trace-{run}.json.gz", seeded_first)
    assert detaudit.compare(tmp_path / "first").verdict.kind == "deterministic"

    # seeded first, its weights then moved by a source of its own, and a seed for fixed
    # noise after: no late seeding is blamed (the model was built seeded)
    def moved(run: int) -> None:
        torch.manual_seed(42)
        model = nn.Linear(4, 1)
        with torch.no_grad():
            model.weight.add_(run * 1e-3)
        with torch.random.fork_rng():
            torch.manual_seed(7)
            noise = torch.randn(2, 4)
        model(noise).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()

    with torch.random.fork_rng():
        for run in range(2):
            _attached(tmp_path / "moved" / f"trace-{run}.json.gz", functools.partial(moved, run))
    c = detaudit.compare(tmp_path / "moved").comparison
    assert c.cause == "init" and c.seeded_late is None, cause_text(c)


def test_max_epochs_is_said_not_to_fire_where_a_step_spans_passes_of_the_loader(tmp_path):
    """Ultralytics accumulates to a nominal batch of 64: on a small data set one step takes
    the batches of several passes, so `--max-epochs 1` never found a step beginning in
    epoch 2, and the run trained to its end without a word."""
    def loop() -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)
        taken = 0
        for _ in range(3):  # epochs of 2 batches: a step of 1 (a warm-up's), then one of 5
            for x in loader:
                model(x).pow(2).mean().backward()
                taken += 1
                if taken in (1, 6):
                    opt.step()
                    opt.zero_grad()

    for run in range(2):
        _attached(tmp_path / f"trace-{run}.json.gz", loop, max_epochs=1)
    result = detaudit.compare(tmp_path)
    assert result.summary["epochs_spanned"] == 3
    assert ("note: --max-epochs did not end the runs: they made 3 passes over the training "
            "DataLoader, as their steps spanned passes") in render_console(result.summary)


def test_a_model_built_again_after_a_seed_drawn_each_run_is_said_to_be_seeded_apart(tmp_path):
    """YOLO builds a model, then its trainer seeds torch (from the clock, where the user
    asks for it) and builds the model it trains: the seed came after the first model, so
    the unseeded initialisation was blamed, with `--seed` as its fix, which does not help.
    The model it trains was built after the seed: the seed, different in each run, is the
    cause."""
    def loop() -> None:
        nn.Linear(4, 1)  # YOLO("yolov8n.yaml")
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # seed=time
        model = nn.Linear(4, 1)  # the trainer's own
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()

    _unseeded_runs(tmp_path, loop)
    c = detaudit.compare(tmp_path).comparison
    assert (c.first_step, c.cause, c.seeded_late) == (0, "init", None)
    assert "the code seeds torch with a different value in each run" in cause_text(c)


def test_an_evaluation_without_gradients_in_a_loop_with_no_loader_begins_no_step(tmp_path):
    """PyTorch's time-sequence example trains on tensors, then predicts under no_grad
    without eval(): that call began the next step, its input taken for the step's batch and
    a fault planted in the step's forward put into it (the loss never differed)."""
    from detaudit.analysis.compare import compare
    from detaudit.config import Fault

    def loop() -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y, x_test = torch.randn(16, 4), torch.randn(16, 1), torch.randn(3, 4)
        for _ in range(3):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            with torch.no_grad():
                model(x_test)  # (still in training mode)

    plain = _attached(tmp_path / "a.json.gz", loop, planted_step=2)
    faulted = _attached(tmp_path / "b.json.gz", loop, fault=Fault("0", "forward", 2),
                        planted_step=2)
    batches = plain.frame().query("slot == 'batch.0'")
    assert list(batches.step) == [0, 1, 2] and {tuple(s) for s in batches["shape"]} == {(16, 4)}
    c = compare([plain, faulted])
    assert [(o.module, o.phase, o.step) for o in c.origins] == [("0", "forward", 2)]
    outs = faulted.frame().query("step == 2 and phase == 'forward' and module == '0' "
                                 "and slot == 'out'")
    assert [tuple(s) for s in outs["shape"]] == [(16, 8)]  # the training forward's, alone


@pytest.mark.parametrize("loader", [False, True])
def test_max_epochs_without_a_loader_to_count_them_by_says_it_had_no_effect(tmp_path, loader):
    """PyTorch's word-language-model example batches a tensor by hand: `--max-epochs 1` ran
    both its epochs, and the report said "1 epoch", with no word."""
    def loop() -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(8, 4)
        batches = torch.utils.data.DataLoader(data, batch_size=4) if loader else data.split(4)
        for _ in range(2):  # epochs
            for x in batches:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()

    for run in range(2):
        _attached(tmp_path / f"trace-{run}.json.gz", loop, max_epochs=1)
    result = detaudit.compare(tmp_path)
    assert result.summary["epochs_unseen"] is not loader
    assert ("--max-epochs had no effect" in render_console(result.summary)) is not loader
    assert len(result.traces[0].steps) == (2 if loader else 4)
    # the model holds its parameters itself: a fault is planted at "(model)" (the list of
    # modules a fault may name was empty)
    assert result.summary["modules"] == ["(model)"]


def test_a_seed_drawn_at_random_in_each_run_is_told_so_with_its_values(tmp_path):
    """PyTorch's DCGAN example seeds torch with `random.randint(1, 10000)` when given no
    seed: each run seeds, with a value of its own. That read as a model initialised from an
    unseeded RNG ("fix: seed every RNG"), which the script does."""
    def loop(seed: int) -> None:
        torch.manual_seed(seed)  # the line named
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()

    line = inspect.getsourcelines(loop)[1] + 1
    with torch.random.fork_rng():
        for run, seed in enumerate((4014, 9916)):
            _attached(tmp_path / f"trace-{run}.json.gz", functools.partial(loop, seed))
    c = detaudit.compare(tmp_path).comparison
    assert c.cause == "init"
    assert cause_text(c).startswith(
        "the parameters differ before the first step: the code seeds torch with a different "
        f"value in each run (4014 in repeat 0, 9916 in repeat 1; at {__file__}:{line})")
    # --seed is offered as a fix of a seed drawn from an RNG only, not from the clock: the
    # run cannot tell which it was (detectron2's seed_all_rng(None) draws from the clock)
    assert ("`detaudit exec --seed 0`, which seeds python's random, numpy and torch before the "
            "code runs, fixes it only where the seed is drawn from one of those, not from the "
            "clock") in cause_text(c)
    # under `exec --seed`, which seeds every RNG first, such a seed comes from the clock (or
    # os.urandom): --seed is no fix, the line and the values are named
    cause, text = cause_of(c, None, seed=0)
    assert (cause, text.split(" although")[0]) == ("init", (
        "the code seeds torch with a different value in each run (4014 in repeat 0, 9916 in "
        f"repeat 1; at {__file__}:{line})"))
    assert "--seed" not in text and "the clock" in text
    # the same seed in each run: nothing differs, nothing to say
    with torch.random.fork_rng():
        for run in range(2):
            _attached(tmp_path / "same" / f"trace-{run}.json.gz", functools.partial(loop, 7))
    assert detaudit.compare(tmp_path / "same").verdict.kind == "deterministic"


def test_a_script_that_resumes_from_the_checkpoint_of_the_run_before_is_told_so(tmp_path):
    """Each run saves a checkpoint every step and loads one when it finds it: the second run
    starts where the first was two steps in, not from the seeded initialisation."""
    checkpoint = tmp_path / "last.pt"
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if checkpoint.exists():
            model.load_state_dict(torch.load(checkpoint))
        with detaudit.watch(model, opt, out=tmp_path / "runs"):
            for step in range(3):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                if step < 2:  # (the last step's save never happens: a limit stopped it)
                    torch.save(model.state_dict(), checkpoint)
    c = detaudit.compare(tmp_path / "runs").comparison
    assert (c.cause, c.continued_from) == ("init", (1, 0, 1, False))
    assert "repeat 1 began with the parameters repeat 0 had after its step 1" in cause_text(c)
    assert "checkpoint" in cause_text(c) and "unseeded" not in cause_text(c)
    # weights that differ from run to run while every RNG agrees: not the seeding fix
    for k in range(2):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        with torch.no_grad():
            model.bias.fill_(float(k))  # from somewhere else: a file, another process
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with detaudit.watch(model, opt, out=tmp_path / "loaded"):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    c = detaudit.compare(tmp_path / "loaded").comparison
    assert (c.cause, c.continued_from) == ("init", None)
    assert "every RNG state agrees" in cause_text(c) and "unseeded" not in cause_text(c)
    # (or the model was built, unseeded, before the code seeded: Hugging Face's Trainer)
    assert "built before the code seeded its RNGs" in cause_text(c)


def test_a_step_the_loop_ends_in_before_its_update_is_not_counted(tmp_path):
    """A script that stops on a NaN loss before backward: the forward it began is no step."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with detaudit.watch(model, opt, out=tmp_path) as w:
        for i in range(3):
            loss = model(torch.ones(2, 3)).pow(2).mean()
            if i == 2:
                break  # (the loss "is NaN": the script gives up)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert [(s.step, s.optimizer_stepped) for s in w.trace.steps] == [(0, True), (1, True)]


def _train_by_hand(out: Path, nudge_at: int | None = None,
                   nudged: str = "update", through_data: bool = False) -> detaudit.watch:
    """SGD the loop does itself (no torch.optim), 2 epochs of 3 batches; `nudge_at`: one
    `nudged` ("update", or "grad": the gradient backward starts from) is 1 ULP off;
    `through_data`: written as ``p.data -= step``, which bumps no version counter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(3)
    x_all, y_all = torch.randn(12, 6, generator=g), torch.randn(12, 2, generator=g)
    with detaudit.watch(model, out=out) as w:
        for update in range(6):
            x, y = x_all[update % 3 * 4:][:4], y_all[update % 3 * 4:][:4]
            out = model(x)
            if update == nudge_at and nudged == "grad":
                out.register_hook(lambda g: torch.nextafter(g, torch.full_like(g, math.inf)))
            (out - y).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    step = 0.1 * p.grad
                    if update == nudge_at and nudged == "update":
                        step = torch.nextafter(step, torch.full_like(step, math.inf))
                    if through_data:
                        p.data -= step
                    else:
                        p -= step
                    p.grad = None
    return w


@pytest.mark.parametrize("through_data", [False, True])
def test_a_loop_that_updates_by_hand_has_a_step_per_update(tmp_path, through_data):
    """No optimizer: an update the loop makes in place after backward ends the step (the
    whole run was one step, and a difference in the updates could pass unseen), also one
    written through ``p.data``, which bumps no version counter (its steps were taken for
    gradients thrown away, and the run was one step)."""
    if through_data:
        same = _train_by_hand(tmp_path / "same", through_data=True)
        _train_by_hand(tmp_path / "same", through_data=True)
        assert [(s.step, s.optimizer_stepped) for s in same.trace.steps] == [
            (k, True) for k in range(6)]
        assert detaudit.compare(tmp_path / "same").exit_code == 0
        _train_by_hand(tmp_path / "nudged", through_data=True)
        _train_by_hand(tmp_path / "nudged", nudge_at=4, through_data=True)
        c = detaudit.compare(tmp_path / "nudged").comparison
        assert (c.first_step, c.cause) == (4, "optimizer")
        return
    same = _train_by_hand(tmp_path / "same")
    _train_by_hand(tmp_path / "same")
    assert [(s.step, s.optimizer_stepped) for s in same.trace.steps] == [
        (k, True) for k in range(6)]
    records = same.trace.frame()
    assert set(records[records.phase == "optimizer"].step) == set(range(6))
    # the gradients each update used, as an optimizer's are recorded
    assert set(records[records.phase == "grad"].step) == set(range(6))
    assert detaudit.compare(tmp_path / "same").exit_code == 0
    _train_by_hand(tmp_path / "nudged")
    _train_by_hand(tmp_path / "nudged", nudge_at=4)
    c = detaudit.compare(tmp_path / "nudged").comparison
    assert (c.first_step, c.cause) == (4, "optimizer")
    # a gradient that differs is the backward's, not the update's (it was "optimizer")
    _train_by_hand(tmp_path / "grad")
    _train_by_hand(tmp_path / "grad", nudge_at=4, nudged="grad")
    result = detaudit.compare(tmp_path / "grad")
    c = result.comparison
    assert (c.first_step, c.cause) == (4, "backward")
    assert {(step, module) for step, module, _ in c.grad_diffs} >= {(4, "0"), (4, "2")}
    # a scanned step's gradients cannot say backward from a forward too small to change
    # the loss, nor which module: said so, with the module backward reaches first
    assert cause_text(c).startswith("the gradients differ while the loss and everything")
    assert ("grad, 2 (nearest the output of the gradients that differ)"
            in result.verdict.headline)
    assert "compare cannot replay them, so the module and op are not named" in (
        result.verdict.headline)
    # and a folder compare wrote renders the same again
    from detaudit.api import render_folder

    detaudit.compare(tmp_path / "grad", out=tmp_path / "compared")
    assert render_folder(tmp_path / "compared")["headline"] == result.verdict.headline


class _DataSGD(torch.optim.Optimizer):
    """SGD as older code writes it, through ``p.data`` (which bumps no version counter);
    `nudged`: its updates are 1 ULP off."""

    def __init__(self, params, lr: float, nudged: bool = False):
        super().__init__(params, {"lr": lr})
        self.nudged = nudged

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                update = p.grad * group["lr"]
                if self.nudged:
                    update = torch.nextafter(update, torch.full_like(update, math.inf))
                p.data.sub_(update)


class _Averaged(torch.optim.Optimizer):
    """A wrapper optimizer (as Lookahead, ZeroRedundancyOptimizer are): its step runs the
    inner optimizer's, then changes the parameters again."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.param_groups = inner.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        self.inner.step()
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(0.5)


def _train_with(out: Path, make_optimizer: Callable[[list], torch.optim.Optimizer],
                given: Callable[[Any], torch.optim.Optimizer | None] = lambda opt: None,
                ) -> tuple[detaudit.watch, list[list[torch.Tensor]]]:
    """3 steps of a small model under watch (given `given(optimizer)`, or the optimizer
    found by its hooks), and the parameters after each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = make_optimizer(list(model.parameters()))
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(3))
    after = []
    with detaudit.watch(model, given(opt), out=out) as w:
        for i in range(3):
            model(x[4 * i:4 * i + 4]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            after.append([p.detach().clone() for p in model.parameters()])
    return w, after


def test_an_update_through_p_data_is_recorded_as_it_left_the_parameters(tmp_path):
    """An optimizer that writes ``p.data`` bumps no version counter: the parameters after
    its update at step 0 were recorded by their print from before it, so a difference in
    that update was first seen at step 1, in the forward."""
    _train_with(tmp_path / "run", lambda params: _DataSGD(params, 0.1))
    _train_with(tmp_path / "run", lambda params: _DataSGD(params, 0.1, nudged=True))
    c = detaudit.compare(tmp_path / "run").comparison
    assert (c.first_step, c.cause) == (0, "optimizer")


def test_the_inner_optimizer_of_a_wrapper_is_no_update_of_its_own(tmp_path):
    """A wrapper optimizer's step runs its inner optimizer's: the step is the wrapper's,
    with the parameters it leaves (ZeroRedundancyOptimizer's inner one updates one rank's
    partition, before the wrapper broadcasts the others: ranks were found out of sync)."""
    w, after = _train_with(tmp_path / "run",
                           lambda params: _Averaged(torch.optim.SGD(params, lr=0.1)))
    assert [(s.step, s.optimizer_stepped) for s in w.trace.steps] == [(k, True) for k in range(3)]
    records = w.trace.frame()
    for step, params in enumerate(after):
        expected = [print_.fp for _, print_ in printed_now(params)]
        recorded = records.query(f"step == {step} and phase == 'optimizer'")
        assert list(recorded.fp) == expected
    # the inner optimizer given to watch is the one recorded, wrapped or not
    w, _ = _train_with(tmp_path / "inner", lambda params: _Averaged(torch.optim.SGD(params, lr=0.1)),
                       given=lambda wrapper: wrapper.inner)
    assert [(s.step, s.optimizer_stepped) for s in w.trace.steps] == [(k, True) for k in range(3)]


def test_in_place_changes_in_an_optimizer_script_are_no_updates_by_hand(tmp_path):
    """SAM perturbs the parameters in place between its two forwards, and an embedding with
    max_norm renormalises its weight in every forward: with an optimizer holding them, the
    steps are its updates (step 0 was split where the parameters changed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Flatten(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 10, (6, 2), generator=torch.Generator().manual_seed(1))
    with detaudit.watch(model, out=tmp_path) as w:  # the optimizer found by its hooks
        for _ in range(3):
            for micro in range(2):  # accumulation: two forwards a step
                model(tokens[micro * 3:][:3]).pow(2).mean().backward()
            climb = [0.01 * p.grad for p in model.parameters()]
            with torch.no_grad():  # SAM: climb, forward and backward there, step back
                for p, d in zip(model.parameters(), climb):
                    p.add_(d)
            model(tokens).pow(2).mean().backward()
            with torch.no_grad():
                for p, d in zip(model.parameters(), climb):
                    p.sub_(d)
            opt.step()
            opt.zero_grad()
    assert [(s.step, s.optimizer_stepped) for s in w.trace.steps] == [(k, True) for k in range(3)]
    assert all(s.lr == [0.1] for s in w.trace.steps)


def test_a_fault_planted_in_a_loop_that_updates_by_hand_fires_at_its_step(tmp_path):
    """The step ends inside the next call (where hooks cannot be set): the planted step's
    module hooks are set after the backward before it."""
    from detaudit.config import Fault
    from detaudit.drivers.attach import Attachment

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    attachment = Attachment(tmp_path / "trace-0.json.gz", {}, model=model,
                            fault=Fault("2", "backward", 2)).install()
    try:
        for _ in range(4):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    finally:
        attachment.uninstall()
    attachment.finish()
    assert attachment.fault_fired
    records = Trace.load(tmp_path / "trace-0.json.gz").frame()
    assert set(records[records.phase == "backward"].step) == {2}


def _train_with_batchnorm(out: Path, scale_running_var_at: int | None = None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(12, 6), torch.randn(12, 2)
    with detaudit.watch(model, opt, out=out):
        for step in range(5):
            if step == scale_running_var_at:  # between steps, outside anything recorded
                with torch.no_grad():
                    model[1].running_var *= 1 + 2 ** -20
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def test_a_weight_changed_between_steps_in_one_run_is_its_state_not_a_fork(tmp_path):
    """The changed weight is recorded again in that run only: the headline named the update
    after it, and a 'control flow forked' note blamed the record the other run lacks."""
    for nudged in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        with detaudit.watch(model, opt, out=tmp_path):
            for step in range(5):
                if nudged and step == 3:
                    with torch.no_grad():
                        model[2].weight[0, 0] = torch.nextafter(model[2].weight[0, 0],
                                                                torch.tensor(math.inf))
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    result = detaudit.compare(tmp_path)
    assert result.comparison.fork is None
    assert result.verdict.headline.startswith(
        "DIVERGENT: first at step 3 (epoch 1), state, 2.weight (first record); cause: params")
    # changed by a checkpoint an earlier run wrote (a resume between epochs): named, with
    # the fix, as at step 0 (it was not, mid-run)
    c = result.comparison
    c.loaded_earlier = {1: ["ckpts/ckpt_e3.pt"]}
    assert cause_text(c).endswith(
        "; repeat 1 loaded ckpts/ckpt_e3.pt (torch.load), written by an earlier run (fix: "
        "remove what an earlier run left before each run, or give each run its own output "
        "folder)"), cause_text(c)


def test_buffers_are_the_models_state_too(tmp_path):
    """BatchNorm's running statistics change what the model computes in eval mode: a run
    whose buffers differ is no bit-identical run (it passed as one)."""
    _train_with_batchnorm(tmp_path / "same")
    _train_with_batchnorm(tmp_path / "same")
    assert detaudit.compare(tmp_path / "same").exit_code == 0
    _train_with_batchnorm(tmp_path / "changed")
    _train_with_batchnorm(tmp_path / "changed", scale_running_var_at=3)
    c = detaudit.compare(tmp_path / "changed").comparison
    assert (c.first_step, c.cause) == (3, "params")
    first = c.first_diffs[0]
    assert (first.phase, first.module, first.slot) == ("state", "1", "buffer.running_var")
    assert "buffers (1.running_var) differ before the step" in cause_text(c)


class _Scratch(nn.Module):
    """Buffers made by torch.empty: one never used, one overwritten before it is read."""

    def __init__(self, garbage: float):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("unused", torch.full((8,), garbage))
        self.register_buffer("scratch", torch.full((4,), garbage))

    def forward(self, x):
        self.scratch.copy_(x.mean(0))
        return self.fc(x - self.scratch)


def test_buffers_never_written_or_overwritten_before_use_are_no_divergence(tmp_path):
    """torch.empty leaves other bytes in each process: what a buffer held before anything
    wrote it is not compared (it was a false 'init' divergence)."""
    for garbage in (0.0, 1.0):
        torch.manual_seed(0)
        model = _Scratch(garbage)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with detaudit.watch(model, opt, out=tmp_path):
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    result = detaudit.compare(tmp_path)
    assert result.exit_code == 0, result.verdict.headline


class _Positions(nn.Module):
    """A buffer of positions the model adds to its input, drawn as it is built from a
    generator seeded with `seed` (the clock, in the script this stands for)."""

    def __init__(self, seed: int):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("pos", torch.randn(4, generator=torch.Generator().manual_seed(
            seed)))

    def forward(self, x):
        return self.fc(x + self.pos)


def _watched(out: Path, model_of: Callable[[], nn.Module], data_seed: int = 0) -> None:
    torch.manual_seed(0)
    model = model_of()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(data_seed))
    with detaudit.watch(model, opt, out=out):
        for i in range(3):
            model(x[2 * i:2 * i + 2]).sum().backward()
            opt.step()
            opt.zero_grad()


def test_a_buffer_set_differently_as_the_model_was_built_is_named_as_the_likely_source(
        tmp_path):
    """A buffer no step writes, drawn differently in each run as the model is built: its
    prints were not taken (a buffer is recorded once written), so the runs parted in the
    model's forward at step 0 "outside the dispatcher", with a hint at the hash seed and
    none at the buffer. Its print as built is evidence, never a difference by itself: a
    scratch buffer torch.empty made differs too (test_buffers_never_written_...)."""
    for seed in (1, 2):
        _watched(tmp_path / "apart", lambda seed=seed: _Positions(seed))
    result = detaudit.compare(tmp_path / "apart")
    c = result.comparison
    assert (result.exit_code, c.first_step, c.cause) == (1, 0, "forward")
    assert c.built_buffers == ["pos"]
    assert not any(d.slot.startswith("buffer.") for d in c.first_diffs)
    assert "; the model's buffers (pos) differ as built, before the first step" in (
        cause_text(c))
    # the zoom's drill-down, which finds no op to blame, names them
    seeds = iter((1, 2, 1, 2))  # (the runs, then the zoom's replays of them)

    def probe(device):
        torch.manual_seed(0)
        model = _Positions(next(seeds))
        return detaudit.Probe(model=model, batches=[torch.ones(2, 4)] * 2,
                              step=lambda m, b: m(b).sum(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    zoomed = detaudit.audit(probe, repeats=2, steps=2, stress=0)
    outside = zoomed.investigations["ops"]["outside_dispatcher"]
    assert (outside["module"], outside["built_buffers"]) == ("(model)", ["pos"])
    assert "its buffers pos differ as the model was built: where an op reads them" in (
        outside["text"])
    for seed in (1, 1):
        _watched(tmp_path / "same", lambda seed=seed: _Positions(seed))
    same = detaudit.compare(tmp_path / "same")
    assert same.exit_code == 0 and not same.comparison.built_buffers
    # a trace recorded before buffers as built were (a baseline of an older detaudit) has
    # none at step 0: missing there is no difference
    newer = sorted((tmp_path / "same").glob("*.json.gz"))[1]
    older = Trace.load(newer)
    kept = [i for i, (step, slot) in enumerate(zip(older.records["step"], older.records["slot"]))
            if not (step == 0 and slot.startswith("buffer."))]
    assert len(kept) < len(older.records["step"])
    older.records = {name: [column[i] for i in kept] for name, column in older.records.items()}
    older.save(newer)
    assert detaudit.compare(tmp_path / "same").exit_code == 0


def test_a_scratch_buffer_that_differs_as_built_is_never_the_cause(tmp_path):
    """Runs whose batches differ (unseeded data) or whose step 0 has a 1-ULP planted
    difference, beside a scratch buffer whose bytes as built differ too: the cause is the
    data, or the forward, never the buffer."""
    for n, garbage in enumerate((0.0, 1.0)):
        _watched(tmp_path / "data", lambda garbage=garbage: _Scratch(garbage), data_seed=n)
    c = detaudit.compare(tmp_path / "data").comparison
    assert (c.first_step, c.cause, c.first_diffs[0].slot) == (0, "data", "batch.0")
    result = module_audit(lambda device: _scratch_probe(), repeats=2, steps=2,
                          fault=detaudit.Fault("fc", "forward", 0))
    c = result.comparison
    assert (c.first_step, c.cause) == (0, "forward")
    assert [(o.module, o.phase) for o in c.origins] == [("fc", "forward")]


_SCRATCH_BUILDS = iter(range(10**6))


def _scratch_probe() -> detaudit.Probe:
    """_Scratch with other bytes in its buffers each time it is built."""
    torch.manual_seed(0)
    model = _Scratch(float(next(_SCRATCH_BUILDS)))
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(n)) for n in range(2)]
    return detaudit.Probe(model=model, batches=batches, step=lambda m, b: m(b).sum(),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_sparse_embedding_trains_under_watch_and_its_gradients_are_compared(tmp_path):
    """nn.Embedding(sparse=True) with SparseAdam: the sparse gradient crashed the loop."""
    def train(out, nudge_at=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Flatten(), nn.Linear(8, 1))
        opts = [torch.optim.SparseAdam(model[0].parameters(), lr=0.01),
                torch.optim.SGD(model[2].parameters(), lr=0.01)]
        tokens = torch.randint(0, 20, (6, 2), generator=torch.Generator().manual_seed(1))
        with detaudit.watch(model, out=out):
            for step in range(3):
                out = model(tokens)
                if step == nudge_at:
                    out.register_hook(lambda g: torch.nextafter(g, torch.full_like(g, 1.0)))
                out.pow(2).mean().backward()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()

    train(tmp_path / "same"), train(tmp_path / "same")
    assert detaudit.compare(tmp_path / "same").exit_code == 0
    train(tmp_path / "nudged"), train(tmp_path / "nudged", nudge_at=1)
    c = detaudit.compare(tmp_path / "nudged").comparison
    assert (c.first_step, c.cause) == (1, "backward")
    assert (1, "0", "weight") in c.grad_diffs  # the sparse gradient, compared


KILLED_WATCH = """
import os, signal, sys, torch
from torch import nn
import detaudit
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with detaudit.watch(model, opt, out=sys.argv[1]):
    for step in range(5):
        if step == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # preempted: nothing can save
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
"""


def test_a_watched_run_that_was_killed_is_a_failed_run(tmp_path):
    """Its trace holds the steps of its last save only: compared as whole, two killed runs
    passed as bit-identical, and a killed run beside a whole one was a divergence."""
    def train(killed_at):
        subprocess.run([sys.executable, "-c", KILLED_WATCH, str(tmp_path), str(killed_at)],
                       check=False, timeout=120)

    train(killed_at=3), train(killed_at=3)
    result = detaudit.compare(tmp_path)
    assert (result.verdict.kind, result.exit_code) == ("failed", 3)
    assert "without its recording closing (killed" in result.verdict.headline
    assert "(its trace: trace-0.json.gz)" in result.verdict.headline  # the one to leave out
    train(killed_at=99)  # whole
    result = detaudit.compare(tmp_path / "trace-2.json.gz", tmp_path / "trace-0.json.gz")
    assert (result.verdict.kind, result.exit_code) == ("failed", 3)
    train(killed_at=99)  # a second whole run: how to compare the two that finished is said
    finished = [tmp_path / "trace-2.json.gz", tmp_path / "trace-3.json.gz"]
    headline = detaudit.compare(tmp_path).verdict.headline
    assert ("the 2 runs that finished compare alone: detaudit compare "
            f"{finished[0]} {finished[1]}") in headline
    assert detaudit.compare(*finished).verdict.kind == "deterministic"


def test_watch_says_when_the_optimizer_given_is_not_the_one_the_loop_steps(tmp_path):
    """A notebook that made a new optimizer after giving watch the old one: one step was
    recorded for the whole loop, without a word."""
    model = nn.Linear(4, 1)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        with detaudit.watch(model, stale, out=tmp_path):
            fresh = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                fresh.step()
                fresh.zero_grad()

    with pytest.warns(UserWarning, match="the optimizer given never stepped while another"):
        train()


def test_a_watch_inside_another_on_the_same_model_is_refused(tmp_path):
    model = nn.Linear(4, 1)
    outer = detaudit.watch(model, out=tmp_path)
    with outer, pytest.raises(detaudit.DetauditError, match="already watched"), \
            detaudit.watch(model, out=tmp_path):
        pass
    with detaudit.watch(model, out=tmp_path):  # one after the other: each its own run
        pass


def test_runs_of_models_whose_parameters_differ_in_shape_are_refused(tmp_path):
    """A notebook's class edited between two runs: not 'unseeded initialisation'."""
    for hidden in (8, 16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with detaudit.watch(model, opt, out=tmp_path):
            model(torch.ones(3, 6)).sum().backward()
            opt.step()
    with pytest.raises(detaudit.DetauditError, match=r"different models: parameter 0.bias is "
                       r"\[8\] in trace-0.json.gz and \[16\] in trace-1.json.gz"):
        detaudit.compare(tmp_path)


@pytest.mark.parametrize("optimizer_given", [True, False])
def test_w_step_before_the_update_leaves_the_step_to_the_update(tmp_path, optimizer_given):
    """A loop that names its losses between backward and opt.step(): each iteration was
    two steps, and a difference at iteration 3 was reported at step 6."""
    def train(out, nudge_at=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        with detaudit.watch(model, opt if optimizer_given else None, out=out) as w:
            for iteration in range(5):
                loss = model(x).pow(2).mean()
                if iteration == nudge_at:
                    loss = loss + loss.detach() * torch.finfo(loss.dtype).eps
                loss.backward()
                w.step({"mse": loss})
                opt.step()
                opt.zero_grad()
        return w

    assert [s.step for s in train(tmp_path / "a").trace.steps] == [0, 1, 2, 3, 4]
    train(tmp_path / "a", nudge_at=3)
    assert detaudit.compare(tmp_path / "a").comparison.first_step == 3


def test_runs_of_different_lengths_are_said_so(tmp_path):
    _train(tmp_path / "runs", steps=6)
    _train(tmp_path / "runs", steps=3)
    result = detaudit.compare(tmp_path / "runs", out=tmp_path / "report")
    assert "2 repeats: 6 steps in 2 epochs and 3 steps in 1 epoch (the runs differ in length)" in (
        tmp_path / "report" / "report.md").read_text()
    # the shorter run's missing steps are no divergence of data or parameters
    assert (result.comparison.first_step, result.comparison.cause) == (3, "length")
    # named as where a run had ended, not as the shorter run's missing batch
    assert ("first at step 3 (epoch 2), where a run had ended (repeat 0 ran 6 steps, repeat 1 "
            "ran 3); cause: length") in result.verdict.headline
    assert "batch" not in result.verdict.headline
    # nor in the JSON a CI job reads: no phase, module or record differs where a run ended
    first = result.summary["first_divergence"]
    assert (first["phase"], first["module"], first["slots"], first["role"]) == (
        None, None, [], "a run had ended")
    console = render_console(result.summary)
    assert "steps run          repeat 0 ran 6 steps, repeat 1 ran 3" in console
    assert not any(line.startswith(("phase", "records", "role")) for line in console.splitlines())
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| steps run | repeat 0 ran 6 steps, repeat 1 ran 3 |" in report
    assert "Size of the difference" not in report  # (of records the shorter run lacks)
    assert "a run had ended" in (tmp_path / "report" / "report.html").read_text()
    assert "parameters diverged" not in result.verdict.headline
    # nor is the end of the shorter run a fork ("control flow forked at step 3: batch.0 is
    # missing in 1 repeat", the console and the report said)
    assert result.summary["fork"] is None
    assert "forked" not in (tmp_path / "report" / "report.md").read_text()
    # the RNG states the shorter run never reached are missing, not different
    assert result.comparison.idle_rng == []
    # the shorter run first: the step's epoch is the longer run's (it was "epoch None")
    runs = tmp_path / "runs"
    shorter_first = detaudit.compare(runs / "trace-1.json.gz", runs / "trace-0.json.gz")
    assert "first at step 3 (epoch 2)" in shorter_first.verdict.headline
    assert shorter_first.summary["first_divergence"]["index"] == 0
    assert "(repeat 0 ran 3 steps, repeat 1 ran 6)" in shorter_first.verdict.headline
    # a run by its own repeat number, not its place among those compared (a repeat between
    # them that failed to record is left out)
    traces = [Trace.load(runs / f"trace-{n}.json.gz") for n in (0, 1)]
    traces[1].repeat = 2
    assert "(repeat 0 ran 6 steps, repeat 2 ran 3)" in judge(compare_traces(traces)).headline
    # a rank's row, and a diff of the two runs, say so too
    assert _rank_row(0, result.comparison).role == "a run had ended"
    diffed = diff_traces(*(Trace.load(runs / f"trace-{n}.json.gz") for n in (0, 1)),
                         labels=("long", "short"))
    assert ("MISMATCH: short differs from long bitwise at step 3 where a run had ended "
            "(long ran 6 steps, short ran 3)") in diffed.headline
    assert "first difference: step 3, where a run had ended" in diffed.message


def test_compare_needs_two_runs(tmp_path):
    _train(tmp_path, steps=3)
    with pytest.raises(detaudit.DetauditError, match="at least two runs"):
        detaudit.compare(tmp_path)
    # refused from the command line, it leaves no empty report folder behind
    (tmp_path / "cwd").mkdir()
    refused = run_cli("compare", str(tmp_path), cwd=tmp_path / "cwd")
    assert refused.returncode == 2 and "at least two runs" in refused.stderr
    assert not list((tmp_path / "cwd").glob("reports/*"))
    # a run of another training (another model) in the same folder is refused, not compared
    model = nn.Linear(6, 2)
    with detaudit.watch(model, out=tmp_path / "other"):
        model(torch.ones(1, 6)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(detaudit.DetauditError, match=r"different trainings \(Sequential, Linear\)"):
        detaudit.compare(tmp_path, tmp_path / "other")
    # one run given twice (by its file and its folder) agrees with itself whatever it did
    with pytest.raises(detaudit.DetauditError, match="given twice"):
        detaudit.compare(tmp_path / "trace-0.json.gz", tmp_path)


# -- ranks: torchrun and torch.multiprocessing.spawn ----------------------------------------
DDP_SCRIPT = Path(__file__).parent / "scripts" / "train_ddp.py"


def _exec_ddp(tmp_path, *options, script_args=()):
    return run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--seed", "0", *options,
                   "--", sys.executable, str(DDP_SCRIPT), *script_args)


def _verdict(done: subprocess.CompletedProcess) -> str:
    """The verdict line exec printed after the command's own output (--quiet)."""
    return done.stdout.lstrip("\n").splitlines()[0]


def _checks(run: Path) -> dict[str, str]:
    summary = json.loads((run / "summary.json").read_text())
    return {c["key"]: c["status"] for c in summary["ranks"]["checks"]}


@pytest.mark.parametrize("launch", ["torchrun", "accelerate"])
def test_exec_of_a_script_that_starts_torchrun_records_each_rank_in_sync(tmp_path, launch):
    """The script starts torchrun on itself; or a launcher runs torch's elastic agent in
    its own process, as `accelerate launch --multi_gpu` does (its ranks recorded into one
    rank-less trace, each over the other)."""
    if launch == "torchrun":  # (torch imported before torchrun starts, as most scripts do)
        done = _exec_ddp(tmp_path, "--max-steps", "3", script_args=(
            "--launch", "torchrun", "--import-torch-first"))
    else:
        launcher = tmp_path / "bin" / "accelerate"
        launcher.parent.mkdir()
        launcher.write_text(f"#!{sys.executable}\n"
                            "import sys\n"
                            "from torch.distributed.run import main\n"
                            "assert sys.argv[1] == 'launch'\n"
                            "main(['--standalone', '--nproc-per-node', '2', *sys.argv[2:]])\n")
        launcher.chmod(0o755)
        done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--seed", "0",
                       "--max-steps", "3", "--", str(launcher), "launch", str(DDP_SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DETERMINISTIC" in done.stdout and "2 ranks in sync" in done.stdout
    run = tmp_path / "run"
    for rank in (0, 1):
        traces = [Trace.load(run / f"trace-r{rank}-{r}.json.gz") for r in (0, 1)]
        assert all(len(t.steps) == 3 for t in traces)
        assert {t.probe["distributed"]["rank"] for t in traces} == {rank}
        assert traces[0].probe["distributed"]["backend"] == "gloo"
        assert len(traces[0].probe["distributed"]["init"]) == 4  # parameters before DDP
    assert not list(run.glob("attach-*"))  # the launcher recorded nothing of its own
    checks = _checks(run)
    assert checks["params"] == checks["grads"] == checks["init"] == checks["shards"] == "ok"


def test_a_fault_named_without_ddps_prefix_is_planted_in_the_module_inside_ddp(tmp_path):
    """The report names a DDP model's layers with DDP's `module.` prefix; --inject-fault
    takes them with or without it. (One rank: the names are no rank's; the faults planted
    in ranks are in the FSDP and tensor-parallel tests.)"""
    script = tmp_path / "ddp_alone.py"
    script.write_text(textwrap.dedent("""\
        import socket
        import torch
        import torch.distributed as dist
        from torch import nn
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(12, 8), torch.randint(0, 3, (12,))
        for step in range(3):
            optimizer.zero_grad()
            batch = slice(4 * step, 4 * step + 4)
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
        dist.destroy_process_group()
        """))
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--json", "--seed", "0",
                   "--inject-fault", "2@backward:1", "--", sys.executable, str(script))
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"]) == ("module.2", "backward", 1)
    # (the zoom knew the fault by its name as given: "outside the dispatcher", it said)
    assert "; the planted fault, found where it was planted;" in summary["headline"], (
        summary["headline"])


def test_a_fault_named_as_in_the_users_model_is_planted_inside_lightning_fabrics_wrapper(
        tmp_path):
    """Lightning Fabric holds the model as `_forward_module` of its own wrapper, which the
    report's names keep; --inject-fault takes the user's names too."""
    pytest.importorskip("lightning.fabric")
    script = tmp_path / "fabric.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from lightning.fabric import Fabric
        fabric = Fabric(accelerator="cpu", devices=1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = fabric.setup(model, optimizer)
        x = torch.randn(16, 8)
        for step in range(3):
            fabric.backward(model(x[4 * step:4 * step + 4]).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        """))
    first = _found_fault(tmp_path, script, "2@forward:1", "--seed", "0",
                         *_NAMED_BY_THE_SCAN)["first_divergence"]
    assert (first["module"], first["phase"], first["step"]) == ("_forward_module.2", "forward", 1)


# a script's start under Fabric's DDP, 2 processes on the CPU: then its model's optimizer
FABRIC_DDP = """\
import torch
from lightning.fabric import Fabric
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
"""


def test_ranks_lightning_fabric_starts_as_copies_of_the_command_each_record(tmp_path):
    """Lightning's and Fabric's DDP on one machine: the command's own process is rank 0 and
    starts the other ranks as copies of the command (LOCAL_RANK and WORLD_SIZE set, no
    RANK). Only rank 0 was recorded, and a difference on rank 1 was blamed on rank 0."""
    pytest.importorskip("lightning.fabric")
    script = tmp_path / "fabric_ddp.py"
    script.write_text(FABRIC_DDP + textwrap.dedent("""\
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
        data = torch.utils.data.TensorDataset(torch.arange(128.0).reshape(16, 8) / 128)
        loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=2))
        model, optimizer = fabric.setup(model, optimizer)
        for epoch in range(2):
            for (x,) in loader:
                if fabric.global_rank == 1 and epoch == 1:  # unseeded noise, rank 1 only
                    x = x + torch.rand(x.shape, generator=torch.Generator().manual_seed(
                        torch.seed())) * 1e-3
                fabric.backward(model(x).square().mean())
                optimizer.step()
                optimizer.zero_grad()
        """))
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--json", "--seed", "0",
                   "--max-steps", "6", "--", sys.executable, str(script))
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["first_divergence"]["step"] == 4 and summary["cause"]["kind"] == "data"
    rows = {row["rank"]: row for row in summary["ranks"]["per_rank"]}
    assert rows[1]["source"] == "local" and summary["ranks"]["primary_rank"] == 1
    for rank in (0, 1):
        traces = [Trace.load(tmp_path / "run" / f"trace-r{rank}-{r}.json.gz") for r in (0, 1)]
        assert [len(t.steps) for t in traces] == [6, 6]
        assert {t.probe["distributed"]["backend"] for t in traces} == {"gloo"}


def test_the_zoom_measures_an_op_on_the_rank_the_commands_own_process_becomes(tmp_path):
    """Fabric's DDP: the command's own process attaches before it knows it is rank 0. Its
    zoom replay in the later run measured its kept op outputs against the first run's file of
    no rank, which did not exist (rank 0's was beside its rank trace): not measured."""
    pytest.importorskip("lightning.fabric")
    script = tmp_path / "fabric_ddp.py"
    script.write_text(FABRIC_DDP + textwrap.dedent("""\
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 8)
        for step in range(3):
            fabric.backward(model(x[4 * step:4 * step + 4]).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        """))
    summary = _found_fault(tmp_path, script, "2/aten.addmm@forward:1", "--seed", "0")
    first = summary["first_divergence"]
    assert (first["module"], first["phase"], first["step"]) == ("2", "forward", 1)
    assert summary["ranks"]["primary_rank"] == 0
    origin = json.loads((tmp_path / "run" / "run.json").read_text())["extra"]["ops"]["ops"][0]
    assert (origin["op"], origin["module"], origin["planted"]) == ("aten.addmm", "2", True)
    assert (origin["elements"], origin["max_ulp"]) == (1, 1)


@pytest.mark.parametrize("parent_imports_torch", [False, True])
def test_workers_a_launcher_of_its_own_starts_each_record_their_rank(
        tmp_path, parent_imports_torch):
    """Ray Train starts its workers from processes of its own, not as torchrun or spawn
    does: where the script had imported torch first, no worker recorded (each inherited
    its claim); where not, the first worker to begin a step claimed the run, so one run
    recorded rank 0 and the other rank 1 -- "DETERMINISTIC: 1 repeats bit-identical; 2
    ranks in sync", exit 0. Ray ends its workers without their exit hooks (here: killed
    once trained), which lost every step after the first: each is saved at every step,
    and the run says how to end each cleanly."""
    script = tmp_path / "own_launcher.py"
    script.write_text(textwrap.dedent(f"""\
        import os, signal, socket, subprocess, sys
        if len(sys.argv) == 1:
            if {parent_imports_torch}:
                import torch
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            workers = [subprocess.Popen([sys.executable, __file__, str(r), str(port)])
                       for r in (0, 1)]
            for worker in workers:
                worker.wait()  # (killed once trained, as Ray ends its workers)
            sys.exit(0)
        import torch
        import torch.distributed as dist
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{sys.argv[2]}}",
                                rank=rank, world_size=2)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.full((2, 4), float(10 * rank + step))).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        dist.destroy_process_group()
        os.kill(os.getpid(), signal.SIGKILL)
        """))
    killed = run_cli("exec", "--out", str(tmp_path / "killed"), "--quiet", "--seed", "0",
                     "--", sys.executable, str(script))
    assert killed.returncode == 3, killed.stdout + killed.stderr
    assert ("a worker the command's launcher started, ended without detaudit's exit hook "
            "running (its launcher ends its workers so, as Ray does) after step 1, the last "
            "step saved") in killed.stdout, killed.stdout
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--seed", "0",
                   "--max-steps", "3", "--", sys.executable, str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    assert _verdict(done).startswith(
        "DETERMINISTIC: 2 repeats bit-identical over 3 steps; 2 ranks in sync"), done.stdout
    assert sorted(p.name for p in (tmp_path / "run").glob("trace-r*")) == [
        "trace-r0-0.json.gz", "trace-r0-1.json.gz", "trace-r1-0.json.gz", "trace-r1-1.json.gz"]


def test_ranks_that_never_join_a_process_group_are_said_to_train_alone(tmp_path):
    """torchrun starting a script that does not distribute (or `accelerate launch
    --multi_gpu` falling back where no GPU is found): each rank trains alone on all the
    data. That read "DIVERGENT ACROSS RANKS: ranks 0 and 1 share 16 samples", with its
    gradients "identical after all-reduce", where nothing was all-reduced."""
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--seed", "0", "--",
                   sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", str(SCRIPT), "--workers", "0", "--epochs", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks that never joined a process group (each trains a model of its own" \
        in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ranks"]["backend"] == "no process group"
    checks = _checks(tmp_path / "run")
    assert checks["grads"] == checks["shards"] == checks["params"] == checks["init"] == (
        "not checked")


def test_rank_traces_beside_a_trained_process_of_no_rank_are_one_clear_error(tmp_path):
    """A process of no rank that trains, and a child of it that records as a rank (its
    launcher's variables set, as a rank of a group it never joined): no known launcher
    does this, but where one does the rank-less trace must not be dropped without a word."""
    script = tmp_path / "both.py"
    script.write_text(textwrap.dedent("""\
        import os, subprocess, sys
        import torch
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        if len(sys.argv) == 1:
            env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
            subprocess.run([sys.executable, __file__, "child"], env=env, check=True)
        """))
    done = run_cli("exec", "--out", str(tmp_path / "run"), "--quiet", "--seed", "0", "--",
                   sys.executable, str(script))
    assert done.returncode == 2, done.stdout + done.stderr
    assert ("repeat 0 recorded ranks (1) and a process of no rank that trained"
            in done.stderr), done.stderr
    assert sorted(p.name for p in (tmp_path / "run").glob("attach-*")) == [
        "attach-0-r1.json.gz", "attach-0.json.gz"]  # both kept


def test_exec_of_a_script_that_spawns_its_ranks_finds_unsharded_data(tmp_path):
    # torch.multiprocessing.spawn; every rank shuffles all the data with the same seed
    done = _exec_ddp(tmp_path, "--max-steps", "3",
                     script_args=("--launch", "spawn", "--shared-data"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "DIVERGENT ACROSS RANKS" in done.stdout
    assert "not sharded per rank" in done.stdout
    checks = _checks(tmp_path / "run")
    assert checks["shards"] == "flagged"
    assert checks["params"] == checks["grads"] == "ok"  # DDP keeps them in sync regardless
    assert sorted(p.name for p in (tmp_path / "run").glob("trace-r*")) == [
        "trace-r0-0.json.gz", "trace-r0-1.json.gz", "trace-r1-0.json.gz", "trace-r1-1.json.gz"]


@pytest.mark.parametrize("sharding,said,sharded", [
    ("--fsdp1", ("2 ranks, their parameters not compared (no parameter records to compare: 1 "
                 "parameter sharded"), ["_fsdp_wrapped_module._flat_param"]),
    ("--zero", "2 ranks in sync", []),
])
def test_exec_of_a_script_sharding_its_model_or_optimizer_across_ranks_is_no_false_alarm(
        tmp_path, sharding, said, sharded):
    """FSDP1 (``FullyShardedDataParallel``) holds the model's parameters as one flat
    parameter, each rank a shard of it; a ZeroRedundancyOptimizer's inner optimizer updates
    one rank's partition, then the wrapper broadcasts it. Both deterministic scripts were
    reported `DIVERGENT ACROSS RANKS` (the flat parameter "differs between ranks 0 and 1
    before the first step"; the parameters "after the optimizer step", as the inner one left
    them)."""
    done = _exec_ddp(tmp_path, "--max-steps", "3", script_args=("--launch", "torchrun", sharding))
    assert done.returncode == 0, done.stdout + done.stderr
    assert _verdict(done).startswith(
        f"DETERMINISTIC: 2 repeats bit-identical over 3 steps; {said}"), done.stdout
    for rank in (0, 1):
        trace = Trace.load(tmp_path / "run" / f"trace-r{rank}-0.json.gz")
        assert trace.probe["distributed"]["sharded"] == sharded


def test_exec_of_an_fsdp2_script_compares_each_rank_with_itself_not_with_other_shards(tmp_path):
    """FSDP2's parameters and gradients are DTensors, each rank holding a shard: they are
    printed by that shard (they crashed the recording), compared run to run on each rank
    but not across ranks (where they differ by design), and the zoomed step runs with them
    (its prints no longer keep FSDP from freeing the all-gathered parameters, and the
    collectives' outputs, which land after their ops return, are not taken for an op's)."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needed")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (fully_shard)")
    done = _exec_ddp(tmp_path / "plain", "--max-steps", "3",
                     script_args=("--launch", "torchrun", "--fsdp"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert _verdict(done).startswith(
        "DETERMINISTIC: 2 repeats bit-identical over 3 steps; 2 ranks, their parameters not "
        "compared (no parameter records to compare: 4 parameters sharded, each rank holding "
        "its own shard)"), done.stdout
    run = tmp_path / "plain" / "run"
    for rank in (0, 1):
        trace = Trace.load(run / f"trace-r{rank}-0.json.gz")
        assert trace.probe["distributed"]["sharded"] == ["0.bias", "0.weight", "2.bias",
                                                        "2.weight"]
        grads = trace.frame().query("phase == 'grad' and module == '0'")
        assert set(grads.slot) == {"param.weight", "param.bias"}
        weights = grads[grads.slot == "param.weight"]["shape"]
        assert {tuple(shape) for shape in weights} == {(8, 8)}  # its half of the 16 rows
    summary = json.loads((run / "summary.json").read_text())
    checks = {c["key"]: c for c in summary["ranks"]["checks"]}
    assert checks["params"]["status"] == checks["grads"]["status"] == "not checked"
    assert "4 parameters sharded" in checks["params"]["detail"]
    assert checks["shards"]["status"] == "ok"

    done = _exec_ddp(tmp_path / "fault", "--max-steps", "3", "--inject-fault", "2@backward:1",
                     script_args=("--launch", "torchrun", "--fsdp"))
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = _verdict(done)
    assert "first at step 1 (epoch 1), backward, 2 (origin)" in verdict, verdict
    assert "the planted fault, found where it was planted" in verdict, verdict
    assert "zoomed in on step 1" in verdict and "all_gather" not in done.stdout



def test_exec_of_a_tensor_parallel_script_expects_its_ranks_to_share_batches(tmp_path):
    """Tensor parallelism (DTensor shards outside FSDP): every rank works on the same batch by
    design, so the data-shards check does not apply; a planted fault is planted in each
    rank's part of a DTensor (an op on the whole one would be a collective) and named."""
    pytest.importorskip("torch.distributed.tensor.parallel")
    script = ("--launch", "torchrun", "--tp", "--shared-data")
    done = _exec_ddp(tmp_path / "plain", "--max-steps", "3", script_args=script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _verdict(done).startswith(
        "DETERMINISTIC: 2 repeats bit-identical over 3 steps; 2 ranks in sync"), done.stdout
    checks = {c["key"]: c for c in json.loads(
        (tmp_path / "plain" / "run" / "summary.json").read_text())["ranks"]["checks"]}
    assert checks["shards"]["status"] == "not checked"
    assert "tensor parallel" in checks["shards"]["detail"]
    # 0.weight, 0.bias and 2.weight are split; 2.bias is replicated, and compared
    assert checks["params"]["status"] == "ok" and "3 sharded" in checks["params"]["detail"]

    done = _exec_ddp(tmp_path / "fault", "--max-steps", "3", "--inject-fault",
                     "2/aten.mm@backward:1", script_args=script)
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = _verdict(done)
    assert verdict.startswith("DIVERGENT: first at step 1 (epoch 1), backward, 2 (origin)"), verdict
    assert "op: aten.mm in 2 (the planted fault, found where it was planted)" in verdict

def test_a_difference_one_tensor_parallel_rank_makes_is_found_on_that_rank(tmp_path):
    """Rank 1's first layer adds unseeded noise to its part of the output at step 1; the
    second layer's all-reduce in forward hands it to rank 0, whose losses differ as rank
    1's do. The zoom was made on rank 0, where the difference arrives at the collective
    ("outside the dispatcher" in layer 2); the replays show it began on rank 1, in layer 0."""
    pytest.importorskip("torch.distributed.tensor.parallel")
    done = _exec_ddp(tmp_path, "--max-steps", "3", "--json", script_args=(
        "--launch", "torchrun", "--tp", "--shared-data", "--noise-on-rank", "1"))
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    first = summary["first_divergence"]
    assert (first["step"], first["phase"], first["module"]) == (1, "forward", "0"), first
    assert summary["ranks"]["primary_rank"] == 1
    rows = {row["rank"]: row["source"] for row in summary["ranks"]["per_rank"]}
    assert rows == {0: "all-reduce (from rank 1)", 1: "local"}


def test_a_first_step_whose_forward_runs_inside_the_closure_records_its_gradients(tmp_path):
    """Lightning calls optimizer.step(closure) before the model was ever called: the step
    begins inside the closure, and its gradients are still recorded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        return loss

    def loop():  # no model given: found
        for _ in range(2):
            opt.step(closure)

    records = _attached(tmp_path / "t.json.gz", loop).frame()
    grads = records[records.phase == "grad"]
    assert sorted(set(grads.step)) == [0, 1]
    assert set(grads[grads.step == 0].module) == {"0", "1"}


def _two_optimizers(out: Path, nudge_at: int | None = None, max_steps: int | None = None,
                    steps: int = 4) -> detaudit.watch:
    """A model whose body and head have their own optimizers, both stepped each iteration."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.Adam(model[2].parameters(), lr=0.01)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    updates = iter(range(steps))

    def nudge(optimizer, args, kwargs):  # inside the head's update, as if it differed
        if next(updates) == nudge_at:
            with torch.no_grad():
                model[2].bias[0] = torch.nextafter(model[2].bias[0], torch.tensor(9.0))

    head.register_step_post_hook(nudge)
    with detaudit.watch(model, out=out, max_steps=max_steps) as w:
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            body.step()
            head.step()
            body.zero_grad()
            head.zero_grad()
    return w


def test_the_updates_of_several_optimizers_between_two_forwards_are_one_step(tmp_path):
    w = _two_optimizers(tmp_path)
    steps, records = w.trace.steps, w.trace.frame()
    assert len(steps) == 4 and all(s.lr == [0.1, 0.01] for s in steps)
    for phase in ("grad", "optimizer"):  # each parameter once, by its optimizer
        assert _parameter_records(records, 2, phase) == [
            ("0", "param.bias"), ("0", "param.weight"), ("2", "param.bias"), ("2", "param.weight")]
    _two_optimizers(tmp_path, nudge_at=2)
    result = detaudit.compare(tmp_path)
    assert (result.comparison.first_step, result.comparison.cause) == (2, "optimizer")
    # the step limit waits for the second optimizer of the last step
    for limit in (1, 2):
        limited = _two_optimizers(tmp_path / f"limited{limit}", max_steps=limit)
        last = limited.trace.frame()
        assert len(limited.trace.steps) == limit
        assert set(last[(last.phase == "optimizer") & (last.step == limit - 1)].module) == {
            "0", "2"}


def _parameter_records(records, step: int, phase: str) -> list[tuple[str, str]]:
    """(module, slot) of the parameter records of one phase at one step, sorted."""
    mine = records[(records.step == step) & (records.phase == phase)
                   & records.slot.str.startswith("param.")]
    return sorted(zip(mine.module, mine.slot))


def _backbone_and_head(out: Path, nudge_at: int | None = None) -> detaudit.watch:
    """A backbone and a head called one after the other by the loop, one optimizer for both;
    `nudge_at`: the head's weight gradient 1 ULP off at that step."""
    torch.manual_seed(0)
    backbone, head = nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 2)
    opt = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.1)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    with detaudit.watch(backbone, out=out) as w:
        for step in range(4):
            if step == nudge_at:
                handle = head.weight.register_hook(next_ulp)
            head(backbone(x)).pow(2).mean().backward()
            if step == nudge_at:
                handle.remove()
            opt.step()
            opt.zero_grad()
    return w


def test_a_model_called_apart_from_the_first_is_recorded_under_its_class_name(tmp_path):
    w = _backbone_and_head(tmp_path)
    records = w.trace.frame()
    for phase in ("state", "grad", "optimizer"):
        assert _parameter_records(records, 0, phase) == [
            ("0", "param.bias"), ("0", "param.weight"),
            ("Linear", "param.bias"), ("Linear", "param.weight")]
    _backbone_and_head(tmp_path, nudge_at=2)
    comparison = detaudit.compare(tmp_path).comparison
    assert (comparison.first_step, comparison.cause) == (2, "backward")
    assert [(d.phase, d.module, d.slot) for d in comparison.first_diffs] == [
        ("grad", "Linear", "param.weight")]


LIGHTNING = Path(__file__).parent / "scripts" / "train_lightning.py"


def test_exec_of_a_lightning_trainer_script(tmp_path):
    """Lightning steps the optimizer with a closure and validates after every epoch: a step
    is its optimizer step (accumulated batches within it), validation and the sanity check
    are not steps, and a planted fault is named as in any script."""
    pytest.importorskip("lightning")
    command = ["--", sys.executable, str(LIGHTNING), "--root", str(tmp_path / "lightning")]
    done = run_cli("exec", "--out", str(tmp_path / "plain"), "--quiet", "--json",
                   "--max-epochs", "1", *command)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["verdict"] == "deterministic"
    assert [(s["epoch"], s["index"]) for s in summary["steps"]] == [(1, i) for i in range(8)]
    done = run_cli("exec", "--out", str(tmp_path / "fault"), "--quiet", "--json",
                   "--max-steps", "3", "--inject-fault", "net.4@backward:2",
                   *_NAMED_BY_THE_SCAN, *command, "--accumulate", "2")
    assert done.returncode == 1, done.stderr
    first = json.loads(done.stdout)["first_divergence"]
    assert (first["module"], first["phase"], first["step"], first["role"]) == (
        "net.4", "backward", 2, "origin")
    trace = Trace.load(tmp_path / "fault" / "trace-0.json.gz")
    assert [sorted(s.losses) for s in trace.steps] == [["loss", "loss.1"]] * 3  # 2 batches each


def test_an_optimizer_that_steps_twice_on_the_same_gradients_is_noted(tmp_path):
    """The bug of a script that calls ``scaler.step(opt)`` and then ``opt.step()``: the
    second update has no backward of its own. A step each, and the report says so."""
    def train(twice: bool) -> detaudit.watch:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with detaudit.watch(model, opt, out=tmp_path / str(twice)) as w:
            for _ in range(3):
                model(torch.ones(2, 3)).sum().backward()
                opt.step()
                if twice:
                    opt.step()
                opt.zero_grad()
        return w

    assert len(train(twice=True).trace.steps) == 6
    train(twice=True)
    result = detaudit.compare(tmp_path / "True")
    assert result.summary["updates_without_backward"] == [1, 3, 5]
    assert "updated with no backward pass in the step" in result._repr_html_()
    train(twice=False)
    train(twice=False)
    assert detaudit.compare(tmp_path / "False").summary["updates_without_backward"] == []


def test_recording_a_script_that_never_imports_torchvision_does_not_import_it():
    """Importing torchvision takes seconds (its ops, its models): the environment reads its
    version without it, the same string as its ``__version__``."""
    code = ("import sys, torch\n"
            "from detaudit.record.environment import capture_environment\n"
            "env = capture_environment(torch.device('cpu'))\n"
            "assert 'torchvision' not in sys.modules, 'imported'\n"
            "import torchvision\n"
            "assert env['torchvision'] == torchvision.__version__, env['torchvision']\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_a_loss_given_to_autograd_backward_in_a_list_is_the_steps_loss(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with detaudit.watch(model, opt, out=tmp_path) as w:
        for _ in range(2):
            out = model(torch.ones(2, 3))
            torch.autograd.backward([out.pow(2).mean()])
            opt.step()
            out = model(torch.ones(2, 3))
            out.sum(1).backward(torch.ones(2))  # a loss of two values
            opt.step()
            opt.zero_grad()
    steps = w.trace.steps
    assert [sorted(s.losses) for s in steps] == [["loss"], [], ["loss"], []]
    records = w.trace.frame()
    assert len(records[(records.phase == "output") & (records.step == 1)]) == 1  # recorded


def test_a_step_that_begins_at_another_modules_call_keeps_its_batch_rng_and_parameters(tmp_path):
    """A frozen teacher called before the model: the model is only known at the first
    update, by then the step's state was taken at the teacher's call."""
    torch.manual_seed(0)
    teacher = nn.Linear(4, 2).requires_grad_(False)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop():
        for _ in range(2):
            x = torch.randn(8, 4)
            target = teacher(x)  # called first
            loss = (model(x) - target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

    records = _attached(tmp_path / "trace-0.json.gz", loop).frame()
    state = records[(records.step == 0) & (records.phase == "state")]
    assert {"batch.0", "rng.torch"} <= set(state.slot)
    assert {(m, sl) for m, sl in zip(state.module, state.slot) if sl.startswith("param.")} == {
        ("0", "param.weight"), ("0", "param.bias"), ("2", "param.weight"), ("2", "param.bias")}


def test_a_model_that_trains_in_eval_mode_is_found_from_what_its_optimizer_updates(tmp_path):
    """Fine-tuning with model.eval() (frozen BatchNorm statistics): no training-mode call is
    seen, so the model is the module owning the optimizer's parameters; its steps keep their
    losses, gradients and parameters, and the trace says its calls were not seen."""
    from detaudit.config import CALLS_UNSEEN, Fault
    from detaudit.drivers.attach import Attachment

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)).eval()
    critic = nn.Linear(2, 1).eval()  # a second model, its own optimizer
    models = nn.ModuleDict({"model": model, "critic": critic})  # never called: not the model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_critic = torch.optim.SGD(critic.parameters(), lr=0.1)
    attachment = Attachment(tmp_path / "trace-0.json.gz", {},
                            fault=Fault("2", "forward", 2)).install()
    try:
        for _ in range(4):
            critic(model(torch.randn(8, 4))).pow(2).mean().backward()
            opt.step()
            opt_critic.step()
            opt.zero_grad()
            opt_critic.zero_grad()
            with torch.no_grad():  # an evaluation: no step
                model(torch.randn(8, 4))
    finally:
        attachment.uninstall()
    attachment.finish()
    assert models is not None and attachment.fault_fired  # at step 2's call of the model
    trace = Trace.load(tmp_path / "trace-0.json.gz")
    assert trace.probe[CALLS_UNSEEN]
    assert [(s.step, sorted(s.losses), s.optimizer_stepped) for s in trace.steps] == [
        (k, ["loss"], True) for k in range(4)]
    records = trace.frame()
    grads = records[records.phase == "grad"]
    assert {"0", "1", "2", "Linear"} == set(grads.module)  # named as in the model; the critic
    assert set(grads.step) == {0, 1, 2, 3}
    forward = records[(records.phase == "forward")]
    assert set(forward.step) == {2} and {"0", "1", "2"} <= set(forward.module)
    # the models' calls with gradients are the step's (from step 1: the models are known
    # at step 0's update): the model's batch, then the critic's (the model's output)
    batches = records[(records.phase == "state") & (records.slot == "batch.0")]
    assert list(zip(batches.step, batches.call)) == [(k, c) for k in (1, 2, 3) for c in (0, 1)]


def test_a_model_called_inside_torch_func_transforms_is_recorded_not_broken(tmp_path):
    """Per-sample gradients by vmap(grad(functional_call)): the calls inside the transforms
    see wrapper tensors without storage (printing them crashed the user's loop); they are
    no training call, and the steps are recorded from the optimizer's updates."""
    from torch.func import functional_call, grad, vmap

    from detaudit.config import CALLS_UNSEEN

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of(params, x, y):
        return nn.functional.mse_loss(functional_call(model, params, (x[None],)), y[None])

    with detaudit.watch(model, opt, out=tmp_path) as w:
        for _ in range(3):
            x, y = torch.randn(5, 4), torch.randn(5, 2)
            params = {k: v.detach() for k, v in model.named_parameters()}
            per_sample = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
            for k, p in model.named_parameters():
                p.grad = per_sample[k].mean(0)
            opt.step()
            opt.zero_grad()
    assert [(s.step, s.optimizer_stepped) for s in w.trace.steps] == [(k, True) for k in range(3)]
    assert w.trace.probe[CALLS_UNSEEN]
    records = w.trace.frame()
    assert set(records[records.phase == "grad"].step) == {0, 1, 2}


def test_the_backward_that_checkpointing_runs_inside_backward_is_not_a_loss(tmp_path):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=True)  # backward inside backward

    model, x = Checkpointed(), torch.randn(3, 4, requires_grad=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with detaudit.watch(model, opt, out=tmp_path) as w:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert [sorted(s.losses) for s in w.trace.steps] == [["loss"], ["loss"]]
    records = w.trace.frame()
    assert len(records[records.phase == "output"]) == 2


def test_a_reader_that_closes_the_pipe_early_leaves_the_exit_code_the_verdicts(tmp_path):
    # `detaudit compare ... | head -1`: the rest of the output goes nowhere, and exit 1 still
    # means a divergence was found (it was an internal error, exit 3)
    _train(tmp_path)
    _train(tmp_path, nudge_at=4)
    for closed in ("stdout", "stderr"):
        process = subprocess.Popen(
            [sys.executable, "-m", "detaudit", "compare", str(tmp_path), "--out",
             str(tmp_path / closed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        getattr(process, closed).close()
        other = process.stderr if closed == "stdout" else process.stdout
        rest = other.read().decode()
        assert process.wait(timeout=120) == 1, rest
        assert "internal error" not in rest and "Exception ignored" not in rest


def _gan(path: Path, fault=None, planted_step=2, reuse_fakes=False, no_grad_fakes=False
         ) -> Trace:
    """A GAN's loop: each iteration a discriminator update (on the generator's detached
    fakes), then a generator update; the generator is called first in both, or, with
    `reuse_fakes`, only in the first, its update going through the fakes that made (as
    PyTorch's DCGAN example does), or, with `no_grad_fakes`, the discriminator's fakes made
    without gradients. The step a `fault` is planted at is recorded module by module (in
    the run without it too)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    disc = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    attachment = Attachment(path, {}, fault=fault, planted_step=planted_step).install()
    try:
        for _ in range(3):
            z, real = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
            with torch.no_grad() if no_grad_fakes else contextlib.nullcontext():
                fake = gen(z)
            d_loss = (disc(real) - 1).pow(2).mean() + disc(fake.detach()).pow(2).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = (disc(fake if reuse_fakes else gen(z)) - 1).pow(2).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
        attachment.finish()
    finally:
        attachment.uninstall()
    return Trace.load(path)


def test_a_generator_called_before_the_discriminator_belongs_to_the_step_it_starts(tmp_path):
    """Its calls at a discriminator step are that step's: a fault planted in the generator's
    last layer at step 2 (a discriminator update) is found there, in the generator."""
    from detaudit.analysis.compare import compare
    from detaudit.config import Fault

    for no_grad in (False, True):  # (the fakes made without gradients: the same)
        plain = _gan(tmp_path / "a.json.gz", no_grad_fakes=no_grad)
        faulted = _gan(tmp_path / "b.json.gz", Fault("Sequential.2", "forward", 2),
                       no_grad_fakes=no_grad)
        assert len(plain.steps) == len(faulted.steps) == 6  # one per update
        c = compare([plain, faulted])
        assert (c.first_step, c.cause) == (2, "forward")
        assert [(o.module, o.phase) for o in c.origins] == [("Sequential.2", "forward")]


def test_the_loss_of_a_gan_step_that_began_at_the_generator_is_recorded_at_step_0(tmp_path):
    """At step 0 the model is known only at the discriminator's update, after its loss's
    backward: the step began at the generator's call, and only its batch and RNG states
    were carried over to the discriminator's step. Its loss value was kept (the loss curve
    showed it differ) and its record dropped: a loss that differed there read as agreeing
    ("cause: backward ... while the loss agrees"; a WGAN-GP gradient penalty whose backward
    raced)."""
    trace = _gan(tmp_path / "t.json.gz")
    records = trace.frame()
    for step in trace.steps:
        at = records[(records.step == step.step) & (records.phase == "output")]
        assert list(at.slot) == ["loss"], (step.step, list(at.slot))


def _two_backward_passes(path: Path, fault=None) -> Trace:
    """Two losses of one forward, each with a backward of its own through the same graph
    (`retain_graph=True`), the step at fault recorded module by module."""
    def loop() -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(),
                              nn.Linear(32, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 20, generator=g), torch.randint(0, 3, (8,), generator=g)
            out = model(x)
            nn.functional.cross_entropy(out, y).backward(retain_graph=True)
            (out.pow(2).mean() * 0.01).backward()
            opt.step()
            opt.zero_grad()

    return _attached(path, loop, fault=fault, planted_step=2)


def test_a_backward_fault_under_two_backward_passes_of_one_forward_is_found_where_planted(
        tmp_path):
    """The second pass ran the first's hooks again, under the same records' names, and
    hooked the graph once more: the first pass's records were hidden, and the fault was
    named in the module below, "outside the dispatcher". Each later pass's records are
    `slot@n`."""
    from detaudit.analysis.compare import compare
    from detaudit.config import Fault

    plain = _two_backward_passes(tmp_path / "a.json.gz")
    faulted = _two_backward_passes(tmp_path / "b.json.gz", Fault("1", "backward", 2))
    c = compare([plain, faulted])
    assert (c.first_step, c.cause) == (2, "backward")
    assert [(o.module, o.phase) for o in c.origins] == [("1", "backward")]
    records = plain.frame()
    slots = list(records[(records.step == 2) & (records.module == "1")
                         & (records.phase == "backward")].slot)
    assert sorted(slots) == ["grad_in.0", "grad_in.0@1", "grad_out", "grad_out@1"], slots


def test_a_generator_update_through_the_fakes_of_the_step_before_is_downstream_of_it(tmp_path):
    """The generator's update goes through fakes it made in the discriminator's step: the
    generator runs no call in its own step. A fault in the discriminator's backward there
    changes the generator's gradients too, which were named as further origins (no call of
    the step led to them)."""
    from detaudit.analysis.compare import compare
    from detaudit.config import Fault

    plain = _gan(tmp_path / "a.json.gz", planted_step=3, reuse_fakes=True)
    faulted = _gan(tmp_path / "b.json.gz", Fault("0", "backward", 3), reuse_fakes=True)
    c = compare([plain, faulted])
    assert (c.first_step, c.cause) == (3, "backward")
    assert {m for s, m, _ in c.grad_diffs if s == 3} == {"Sequential.0", "Sequential.2"}
    assert [(o.module, o.phase) for o in c.origins] == [("0", "backward")]


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_model_whose_first_update_comes_later_is_recorded_from_its_first_step(tmp_path, phase):
    """The generator first trains at step 1, after the discriminator's update: its call
    then begins step 1 (an optimizer holds its parameters), so a fault planted in it at its
    first step fires there and is named, as at any later step."""
    from detaudit.analysis.compare import compare
    from detaudit.config import Fault

    plain = _gan(tmp_path / "a.json.gz", planted_step=1)
    faulted = _gan(tmp_path / "b.json.gz", Fault("Sequential.2", phase, 1))
    assert faulted.probe["fault_fired"]
    assert len(plain.steps) == len(faulted.steps) == 6
    c = compare([plain, faulted])
    assert (c.first_step, c.cause) == (1, phase)
    assert [(o.module, o.phase) for o in c.origins] == [("Sequential.2", phase)]


@pytest.mark.parametrize("weight, cause, what", [
    (1.7, "forward", "the loss computed from them differs"),
    (1.5 + 2**-20, "backward", "the gradient the loss sends into them differs"),
])
def test_a_loss_whose_class_weights_differ_is_said_to_differ_outside_the_model(
        tmp_path, weight, cause, what):
    """Class weights made in the loop differ from step 1: the zoomed step's model computes
    the same outputs, so the difference entered outside it (it was "a forward computation
    gave different results from equal inputs", or the backward's equivalent)."""
    from detaudit.analysis.compare import compare

    def run(path, second):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        attachment = Attachment(path, {}, zoom=1).install()
        try:
            for step in range(3):
                w = torch.tensor([1.0, second if step else 1.5, 1.0])
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
                y = torch.tensor([0, 1, 2, 0, 1])
                nn.functional.cross_entropy(model(x), y, weight=w).backward()
                opt.step()
                opt.zero_grad()
            attachment.finish()
        finally:
            attachment.uninstall()
        return Trace.load(path)

    plain = run(tmp_path / "a.json.gz", 1.5)
    c = compare([plain, run(tmp_path / "b.json.gz", weight)])
    assert (c.first_step, c.cause) == (1, cause)
    assert cause_text(c).startswith(f"the model's outputs agree in every repeat, yet {what}")
    ops = plain.frame()
    ops = ops[ops.phase.str.startswith("op.")]  # the loss's ops: not the model's own
    assert {m for m, s in zip(ops.module, ops.slot) if "nll_loss" in s} == {OUTSIDE_MODEL}
    assert set(ops[ops.slot.str.contains("addmm")].module) == {""}



def test_the_zoomed_step_records_the_optimizers_state_after_its_update(tmp_path):
    """As docs/exec.md says: Adam's moments and step count, and each group's learning
    rate, at the zoomed step only (a scan records the parameters after each update)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    attachment = Attachment(tmp_path / "t.json.gz", {}, zoom=1).install()
    try:
        for step in range(3):
            model(torch.full((3, 4), float(step))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        attachment.finish()
    finally:
        attachment.uninstall()
    frame = Trace.load(tmp_path / "t.json.gz").frame()
    state = frame[(frame.phase == "optimizer") & ~frame.slot.str.startswith("param.")]
    assert set(state.step) == {1}
    assert set(state.slot) == {"lr.0", *(f"state.{p}.{key}" for p in ("weight", "bias")
                                          for key in ("exp_avg", "exp_avg_sq", "step"))}
    # with their sizes, and the parameters' there (the report's size of the difference)
    updated = frame[(frame.phase == "optimizer") & frame.slot.str.startswith("param.")]
    assert set(updated[updated.norm.notna()].step) == {1} and state.norm.notna().all()


@pytest.mark.parametrize("zoom", [None, 3])
def test_each_epochs_last_step_records_the_state_of_the_optimizers_that_updated_in_it(
        tmp_path, zoom):
    """As a scan of `run` does: the moments of both of a loop's optimizers as each pass over
    the training data ends (the zoomed step has them already: once), none in between."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    first = torch.optim.Adam(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    attachment = Attachment(tmp_path / "t.json.gz", {}, zoom=zoom).install()
    try:
        for _ in range(2):
            for x in loader:
                model(x).pow(2).mean().backward()
                first.step()
                second.step()
                first.zero_grad()
                second.zero_grad()
        attachment.finish()
    finally:
        attachment.uninstall()
    frame = Trace.load(tmp_path / "t.json.gz").frame()
    state = frame[(frame.phase == "optimizer") & frame.slot.str.startswith("state.")]
    assert set(state.step) == {3, 7}
    assert not state.duplicated(["step", "module", "call", "slot"]).any()
    at_the_end = state[state.step == 7]
    assert set(zip(at_the_end.module, at_the_end.call, at_the_end.slot)) == {
        *(("0", 0, f"state.{p}.{key}") for p in ("weight", "bias")
          for key in ("exp_avg", "exp_avg_sq", "step")),
        *(("1", 1, f"state.{p}.momentum_buffer") for p in ("weight", "bias"))}


@pytest.mark.parametrize("change", ["lr", "reseed"])
def test_a_change_between_steps_is_said_for_what_it_is(tmp_path, change):
    """A learning rate set differently at step 2 is named with its values; an RNG reseeded
    differently after step 1 is said to differ as step 2 begins (both were a generic text)."""
    from detaudit.analysis.compare import compare

    def loop(second: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            if step == 2 and second:
                if change == "lr":
                    opt.param_groups[0]["lr"] = 0.11
                else:
                    torch.manual_seed(1)
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    c = compare([_attached(tmp_path / "a.json.gz", lambda: loop(False)),
                 _attached(tmp_path / "b.json.gz", lambda: loop(True))])
    if change == "lr":
        assert (c.first_step, c.cause) == (2, "optimizer")
        assert "the learning rate differs (0.1 in repeat 0 and 0.11 in repeat 1)" in cause_text(c)
    else:
        assert (c.first_step, c.cause) == (2, "rng")
        assert cause_text(c).startswith("the torch RNG state already differs as step 2 begins")
        # exec without --seed: an evaluation between steps that draws once per item of a set
        # of strings draws differently in each run, as their hash seeds order it (the note
        # was left out wherever an RNG state differed, which is this case)
        assert "each run had a hash seed of its own" in cause_of(c, None, own_hash_seeds=True)[1]


def test_backward_called_by_keyword_is_seen(tmp_path):
    """torch.autograd.backward(tensors=loss): the loss is recorded (it raised a TypeError
    in the user's loop)."""
    def loop():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            torch.autograd.backward(tensors=model(torch.ones(2, 4)).sum())
            opt.step()
            opt.zero_grad()

    trace = _attached(tmp_path / "t.json.gz", loop)
    assert [sorted(s.losses) for s in trace.steps] == [["loss"], ["loss"]]


def test_parameters_that_differ_while_torchs_rng_agrees_say_which_rng_differs(tmp_path):
    """A script that seeds torch alone and changes one weight in one run: numpy's state
    differs too, so the text says which RNG agrees and which does not, and that the weights
    may come from elsewhere (it said, as fact, "initialised from an unseeded RNG")."""
    import numpy as np

    from detaudit.analysis.compare import compare

    def loop(second: bool):
        np.random.seed(1 + second)  # (differs, never drawn from)
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        if second:
            with torch.no_grad():
                model.bias.copy_(next_ulp(model.bias))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    c = compare([_attached(tmp_path / "a.json.gz", lambda: loop(False)),
                 _attached(tmp_path / "b.json.gz", lambda: loop(True))])
    assert (c.first_step, c.cause) == (0, "init")
    assert cause_text(c).startswith("the parameters differ before the first step; torch's RNG "
                                   "state agrees, the numpy RNG state differs (not seeded)")



def test_a_loss_that_is_infinite_at_one_step_only_is_not_a_divergence_of_training(tmp_path):
    """A GradScaler skips the update of a step whose loss is infinite, and training goes on:
    the report says the loss is finite again (it said "the training diverged numerically")."""
    from detaudit.analysis.compare import compare
    from detaudit.report.sections import nonfinite_line

    def scaled(loss_of: Callable[[torch.Tensor, int], torch.Tensor], steps: int):
        def loop():
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu")
            for step in range(steps):
                scaler.scale(loss_of(model(torch.ones(2, 4)).sum(), step)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        return loop

    loop = scaled(lambda out, step: out * (math.inf if step == 1 else 1.0), 4)
    c = compare([_attached(tmp_path / "a.json.gz", loop), _attached(tmp_path / "b.json.gz", loop)])
    assert c.first_step is None and len(c.steps) == 4
    assert (c.loss.nonfinite, c.loss.finite_again) == ((1, 0, "inf"), 2)
    line = nonfinite_line({"step": 1, "epoch": 1, "value": "inf", "finite_again": 2})
    assert line.startswith("loss is infinite at step 1 (epoch 1), finite again from step 2")
    # the skipped step the last recorded (a step limit right after it): the trace says the
    # GradScaler skipped its update ("the training diverged numerically", it said)
    c = compare([_attached(tmp_path / f"{r}.json.gz", loop, max_steps=2, on_limit=lambda: None)
                 for r in "cd"])
    assert (c.loss.nonfinite, c.loss.finite_again, c.loss.skipped) == ((1, 0, "inf"), None, True)
    line = nonfinite_line({"step": 1, "epoch": 1, "value": "inf", "finite_again": None,
                           "skipped": True})
    assert line.endswith("the last step recorded, whose update a GradScaler skipped: not a "
                         "training that diverged"), line

    # a loss never finite again after a skipped step that was not the last: not said to be
    # the last step recorded (it was said of step 0 of 4): step 0's gradients infinite (its
    # update skipped), the later ones finite under an infinite loss
    never_again = scaled(lambda out, step: out * math.inf if step == 0 else out + math.inf, 3)
    c = compare([_attached(tmp_path / f"{r}.json.gz", never_again) for r in "ef"])
    assert c.loss.nonfinite[0] == 0 and c.loss.finite_again is None, c.loss
    assert not c.loss.skipped
