"""Proof by re-execution: risky ops re-run on identical inputs prove a race even when the
repeats happen to agree, name the op and module, and never perturb the audited run."""

from __future__ import annotations

import gzip
import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import gather_probe, module_audit, small_cnn_probe
from torch import nn

from detaudit import Fault, Probe, audit
from detaudit.analysis.verdict import PROVEN
from detaudit.cli import main
from detaudit.errors import EXIT_DIVERGED, EXIT_OK, TraceError
from detaudit.investigate import drilldown
from detaudit.report import render_console, render_markdown
from detaudit.trace import Trace

# under pytest-xdist (conftest): the race tests take two_threads, which runs them alone
pytestmark = pytest.mark.shares_cores

CELLS, VOTES = 64, 40_000  # 40,000 votes x 4 channels: well past torch's parallel grain


class VoteHead(nn.Module):
    """Splats per-point votes into a grid: index_put_ with accumulate over duplicates."""

    def forward(self, votes: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        grid = votes.new_zeros(CELLS, votes.shape[1])
        return grid.index_put_((cells,), votes, accumulate=True)


class VoteNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.vote_head = VoteHead()
        self.out = nn.Linear(4, 1)

    def forward(self, points: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        return self.out(self.vote_head(self.embed(points), cells))


def vote_probe(device: torch.device) -> Probe:
    model = VoteNet().to(device)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(VOTES, 4, generator=g), torch.randint(0, CELLS, (VOTES,), generator=g))]

    def step(m: nn.Module, batch):
        points, cells = (t.to(device) for t in batch)
        return m(points, cells).pow(2).mean()

    return Probe(model=model, batches=batches, step=step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def test_forward_splat_ends_nonzero_every_time_and_names_op_and_module(two_threads):
    for _ in range(10):
        result = audit(vote_probe, repeats=2)
        assert result.verdict.exit_code == EXIT_DIVERGED, result.verdict.headline
        proven = result.comparison.proven
        assert [(p.module, p.phase, p.base_op) for p in proven][:1] == [
            ("vote_head", "forward", "aten.index_put_")]
        assert "aten.index_put_ in vote_head (forward, step 0, epoch 1)" in result.verdict.headline


def test_an_op_the_step_runs_outside_the_model_is_proven_there_not_in_the_model(two_threads):
    """A target splatted in the step function, outside every module call of the model: the
    proof names it outside the model (it said "(model)", the model's own forward)."""
    def probe(device: torch.device) -> Probe:
        model = nn.Linear(4, 1).to(device)
        g = torch.Generator().manual_seed(3)
        votes, cells = torch.randn(VOTES, 1, generator=g), torch.randint(0, CELLS, (VOTES,),
                                                                        generator=g)

        def step(m: nn.Module, x: torch.Tensor):
            target = votes.new_zeros(CELLS, 1).index_put_((cells,), votes, accumulate=True)
            return (m(x) - target).pow(2).mean()

        return Probe(model=model, batches=[torch.ones(CELLS, 4)], step=step,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.01))

    result = audit(probe, repeats=2, epochs=1, steps=1)
    assert [(p.module, p.phase, p.base_op) for p in result.comparison.proven] == [
        ("(outside the model)", "forward", "aten.index_put_")]
    # with the line of the step function that ran it
    splat = next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                 if "target = votes.new_zeros(CELLS, 1).index_put_(" in line)
    assert result.comparison.proven[0].site == f"{__file__}:{splat}"
    assert (f"aten.index_put_ in (outside the model) at test_stress.py:{splat} (forward, "
            "step 0, epoch 1)") in result.verdict.headline


@pytest.mark.parametrize("term, phase, op", [
    ("splat", "forward", "aten.index_put_"), ("gather", "backward", "aten.index_put")])
def test_a_loss_term_racing_outside_the_model_is_the_first_divergence_not_a_module(
        two_threads, monkeypatch, term, phase, op):
    """The loop adds a loss term that races: a splat of the model's loss (its forward), or
    a penalty gathering the last layer's weight at duplicate indices (its backward). The
    modules only see a gradient that differs: the headline named the first of them
    ("backward, roi_heads (first record)", "roi_heads.box_predictor.cls_score (origin)" in
    a Mask R-CNN script) before the op."""
    def probe(device: torch.device) -> Probe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).to(device)
        g = torch.Generator().manual_seed(3)
        votes, cells = torch.randn(VOTES, 4, generator=g), torch.randint(0, CELLS, (VOTES,),
                                                                        generator=g)

        def step(m: nn.Module, x: torch.Tensor):
            loss = m(x).pow(2).mean()
            if term == "gather":
                weight = m[2].weight.reshape(-1)
                return loss + (weight[cells % weight.numel()] * votes[:, 0]).pow(2).sum()
            spread = votes.new_zeros(CELLS, 4).index_put_((cells,), votes * loss,
                                                          accumulate=True)
            return loss + spread.std()

        return Probe(model=model, batches=[torch.randn(8, 4, generator=g)] * 2, step=step,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.01))

    def replayed(*args, **kwargs):
        raise AssertionError("the repeats were replayed again to capture the op's outputs")

    # the zoom's replays kept the racing op's outputs: its difference is the one they saw
    monkeypatch.setattr(drilldown, "_capture", replayed)
    for _ in range(6):  # (the race fires in most runs of 2 repeats, and in most replays)
        result = audit(probe, repeats=2, epochs=1)
        if (result.investigations.get("zoom") or {}).get("status") == "found":
            break
    first = result.verdict.first
    assert (first["phase"], first["module"], first["slots"]) == (
        phase, "(outside the model)", [op]), result.verdict.headline
    # an op outside the model is placed at the line of the loop's code that ran it (in
    # backward, at the line of the forward op whose autograd node ran it: the gather's)
    line = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if ("index_put_((cells,), votes * loss" if phase == "forward"
                    else "weight[cells % weight.numel()]") in text)
    site = f" at test_stress.py:{line}"
    assert (f", {phase}, (outside the model) (origin op); cause: {phase}; op: {op} in "
            f"(outside the model){site}") in result.verdict.headline
    assert result.summary["ops"][0].get("site", "").endswith(site.removeprefix(" at "))
    assert result.summary["ops"][0]["elements"] >= 1  # measured
    # the replay parted again and named the op: the cause is no longer unconfirmed
    assert "unconfirmed" not in result.summary["cause"]["text"]


def test_duplicate_index_gather_backward_ends_nonzero_every_time(two_threads):
    for _ in range(10):
        result = audit(gather_probe, repeats=2, epochs=1, steps=1)
        assert result.verdict.exit_code == EXIT_DIVERGED, result.verdict.headline
        assert [(p.module, p.phase, p.base_op) for p in result.comparison.proven] == [
            ("gather", "backward", "aten.index_put")]


def test_agreeing_repeats_with_a_proven_op_are_not_deterministic(two_threads):
    result = audit(gather_probe, repeats=1, epochs=1, steps=1)  # one repeat: nothing to compare
    assert result.comparison.first_step is None
    assert result.verdict.kind == PROVEN and result.verdict.exit_code == EXIT_DIVERGED
    assert result.verdict.headline.startswith(
        "NONDETERMINISTIC OP: aten.index_put in gather (backward, step 0, epoch 1) gave ")
    proof = result.comparison.proven[0].proof
    assert proof["differing"] > 0 and proof["max_ulp"] >= 1 and proof["max_abs"] > 0
    text = render_console(result.summary)
    assert "proven nondeterministic: aten.index_put in gather" in text
    assert "fix: torch.use_deterministic_algorithms(True)" in text
    assert "risky ops re-executed on identical inputs" in render_markdown(result.summary)


def test_stress_off_or_one_thread_is_deterministic(two_threads):
    alone = audit(gather_probe, repeats=1, epochs=1, steps=1, stress=0).verdict
    assert (alone.kind, alone.exit_code) == ("not compared", 2)  # one run: no pass either
    torch.set_num_threads(1)
    result = audit(gather_probe, repeats=2, epochs=1, steps=1)
    assert result.verdict.exit_code == EXIT_OK, result.verdict.headline
    (op,) = result.comparison.stress
    assert (op.module, op.distinct, op.runs, op.stressed) == ("gather", 1, 16, 1)
    assert ("proof by re-execution at step 0: 1 risky op re-run 16 times on identical inputs "
            "each gave one result") in render_console(result.summary)


class Sampler(nn.Module):
    """Draws from the global RNG (randperm: a risky op), then drops out (dropout: not)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.randperm(x.shape[0])[: x.shape[0] // 2]
        return self.drop(x[keep])


def sampling_probe(device: torch.device) -> Probe:
    model = nn.Sequential(nn.Linear(8, 8), Sampler(), nn.Linear(8, 1)).to(device)
    batches = [torch.randn(32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    return Probe(model=model, batches=batches, step=lambda m, b: m(b.to(device)).pow(2).mean(),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_stress_does_not_perturb_the_run_random_ops_included():
    """Repeat 1 is stressed, repeat 0 is not: every record, RNG states included, agrees."""
    result = audit(sampling_probe, repeats=2, epochs=2)
    assert result.comparison.deterministic and result.verdict.exit_code == EXIT_OK
    stressed = {(s.module, s.op): s for s in result.comparison.stress}
    randperm = stressed[("1", "aten.randperm")]  # re-run from its own RNG state: one result
    assert randperm.distinct == 1 and randperm.stressed == 2 and randperm.steps == [0, 3]
    assert [t.stress_rows() != [] for t in result.traces] == [False, True]


def test_planted_op_fault_is_not_mistaken_for_a_racy_op():
    """The stress sees the op as it really ran, below the planted 1-ULP change."""
    fault = Fault("stem", "forward", 0, op="aten.convolution")
    result = module_audit(small_cnn_probe, repeats=2, steps=2, fault=fault, stress_every_op=True,
                   stress=4)
    assert result.comparison.first_step == 0 and not result.comparison.proven
    conv = [s for s in result.comparison.stress if s.module == "stem"]
    assert conv and all(s.distinct == 1 for s in conv)


class LateBranch(nn.Module):
    """A gather branch that only trains from epoch 2 (frozen before)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(64, 16))

    def forward(self, cells: torch.Tensor) -> torch.Tensor:
        return self.table[cells]


class LateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.late = LateBranch()

    def forward(self, x: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.late(cells)


def late_probe(device: torch.device) -> Probe:
    model = LateNet().to(device)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4000, 16, generator=g), torch.randint(0, 64, (4000,), generator=g),
             torch.randn(4000, 16, generator=g)) for _ in range(2)]

    def batches(epoch: int):
        model.late.requires_grad_(epoch >= 1)  # unfrozen at epoch 2
        return iter(data)

    def step(m: nn.Module, batch):
        x, cells, y = (t.to(device) for t in batch)
        return (m(x, cells) - y).pow(2).mean()

    return Probe(model=model, batches=batches, step=step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def test_risky_op_that_only_runs_from_epoch_2_is_found_and_proven(two_threads):
    result = audit(late_probe, repeats=1, epochs=2)
    ops = {(s.module, s.phase, s.base_op): s for s in result.comparison.stress}
    late = ops[("late", "backward", "aten.index_put")]
    assert late.first_epoch == 1 and late.steps == [2] and late.proven
    assert result.verdict.exit_code == EXIT_DIVERGED
    assert "| late | backward | aten.index\\_put(accumulate=True) | epoch 2 |" in render_markdown(
        result.summary)


def test_stress_rows_survive_the_trace_file_and_damage_is_one_error(tmp_path, two_threads):
    result = audit(gather_probe, repeats=1, epochs=1, steps=1, out=tmp_path / "run")
    path = tmp_path / "run" / "trace-0.json.gz"
    assert Trace.load(path).stress_rows() == result.traces[0].stress_rows() != []
    data = Trace.load(path).to_dict()  # (streamed as it was recorded; rewritten whole here)
    data["stress"]["distinct"] = ["three"]
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(TraceError, match=r"stress.distinct\[0\]"):
        Trace.load(path)


@pytest.mark.parametrize("value,message", [
    ("1", "at least 2 runs"), ("-3", "at least 2 runs"), ("some", "a number of runs"),
    ("all:x", "a number of runs"),
])
def test_bad_stress_values_are_usage_errors(value, message, capsys):
    assert main(["run", "--model", "maskrcnn", "--stress", value]) == 2
    assert message in capsys.readouterr().err


def test_stress_all_parses(monkeypatch):
    from detaudit.cli import _stress

    assert _stress("all") == {"stress": 16, "stress_every_op": True}
    assert _stress("all:4") == {"stress": 4, "stress_every_op": True}
    assert _stress("0") == {"stress": 0, "stress_every_op": False}


BUILDS = itertools.count()  # probes built so far: each repeat builds its own


def timing_draw_probe(device: torch.device) -> Probe:
    """The step draws a timing-dependent number of values from the global torch RNG, outside
    any module, before a model with dropout runs."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1)).to(device)
    batches = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    draws = next(BUILDS) % 2 + 1  # what a clock or a queue length would give: differs per repeat

    def step(m: nn.Module, batch):
        if batch is batches[1]:
            torch.randint(0, 10, (draws,))  # e.g. a logger sampling a few examples
        return m(batch.to(device)).pow(2).mean()

    return Probe(model=model, batches=batches, step=step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_rng_draw_outside_any_module_is_located_between_modules():
    result = module_audit(timing_draw_probe, repeats=2)
    c = result.comparison
    assert c.first_step == 1 and c.cause == "rng"
    assert c.rng_gap is not None and c.rng_gap.after == ("", 0)
    assert not any(o.phase == "forward" and o.module == "1" for o in c.origins)
    first = result.verdict.first
    assert first["outside"] == "outside any module, between the start of step 1 and (model)"
    assert "outside any module, between the start of step 1 and (model)" in result.verdict.headline
    assert "cause: rng" in result.verdict.headline


class _Shifted(nn.Linear):
    """A linear layer that adds `offset`: built with another, it differs from equal inputs."""

    def __init__(self, offset: float) -> None:
        super().__init__(8, 8)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.offset


class _DrawsAfterItsPart(nn.Module):
    """`part` differs on its own in every second build; the model's own code then draws
    from the torch RNG as many values as the part's output says, before a dropout: the draw
    follows from the part's difference."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.part = _Shifted(offset)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.part(x)
        torch.rand(1 + int(h.mean().item() > 0.5))
        return self.drop(h).sum(1)


def test_an_rng_draw_that_follows_a_module_differing_on_its_own_leaves_the_cause_forward():
    offsets = itertools.cycle([0.0, 1.0])

    def probe(device: torch.device) -> Probe:
        torch.manual_seed(0)
        model = _DrawsAfterItsPart(next(offsets)).to(device)
        batches = [torch.zeros(4, 8) for _ in range(2)]
        return Probe(model=model, batches=batches, step=lambda m, x: m(x).pow(2).mean(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.0))

    result = module_audit(probe, repeats=2)
    first = result.verdict.first
    assert (first["module"], first["phase"], first["role"]) == ("part", "forward", "origin")
    assert result.comparison.cause == "forward"
    assert "part (origin); cause: forward" in result.verdict.headline


def test_rng_draw_between_two_submodules_names_both_and_the_enclosing_module():
    class TwoPasses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encode = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.5)
            self.draws = next(BUILDS) % 2 + 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.encode(x)
            torch.rand(self.draws)  # inside the model's forward, but in no submodule
            return self.drop(y)

    def probe(device):
        model = TwoPasses()
        return Probe(model=model, batches=[torch.randn(4, 8)],
                     step=lambda m, b: m(b).pow(2).mean())

    result = module_audit(probe, repeats=2)
    assert result.comparison.cause == "rng"
    assert result.verdict.first["outside"] == (
        "in (model)'s own code, outside its submodules, between the start of (model) and drop")


class HostNoise(nn.Module):
    """Adds a value computed on the host from Python's RNG, drawn a timing-dependent number
    of times: no PyTorch op inside differs on equal inputs, the dispatcher never sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = next(BUILDS) % 2 + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value = [random.random() for _ in range(self.draws)][-1]
        return x + torch.tensor(value)


class NumpyCube(torch.autograd.Function):
    """A custom autograd Function computing its forward in numpy, off by 1 ULP in one repeat."""

    @staticmethod
    def forward(ctx, x, bump):
        out = np.power(x.detach().numpy(), 3)
        if bump:
            out.flat[0] = np.nextafter(out.flat[0], np.inf)
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Cube(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bump = next(BUILDS) % 2 == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NumpyCube.apply(x, self.bump)


@pytest.mark.parametrize("inner", [HostNoise, Cube])
def test_difference_outside_the_dispatcher_is_named_in_its_module(inner):
    def probe(device):
        model = nn.Sequential(nn.Linear(4, 4), inner(), nn.Linear(4, 1))
        return Probe(model=model, batches=[torch.randn(8, 4)],
                     step=lambda m, b: m(b).pow(2).mean(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    result = module_audit(probe, repeats=2, drill_down=True)
    assert [(o.module, o.phase) for o in result.comparison.origins][:1] == [("1", "forward")]
    drill = result.investigations["ops"]
    outside = drill["outside_dispatcher"]
    assert outside["module"] == "1" and drill["origin_ops"] == 0
    assert outside["host_rng_draws"] == (["1"] if inner is HostNoise else [])
    assert "outside the dispatcher: no op in 1 differs on equal inputs" in result.verdict.headline
    assert "code outside PyTorch's dispatcher" in render_console(result.summary)


def test_an_op_origin_is_not_called_outside_the_dispatcher():
    fault = Fault("block1.conv", "forward", 1, op="aten.convolution")
    result = module_audit(small_cnn_probe, repeats=2, steps=2, fault=fault, drill_down=True)
    assert result.investigations["ops"]["outside_dispatcher"] is None
    assert "op: aten.convolution in block1.conv" in result.verdict.headline


@pytest.mark.parametrize("stress", [0, 16])
def test_census_marks_ops_first_seen_in_a_later_epoch_and_shows_its_cost(stress, two_threads):
    """Counted by the census's own run (no stress) or by the audit's stressed steps."""
    result = audit(late_probe, repeats=1, epochs=2, census=True, stress=stress)
    late = [o for o in result.summary["census"] if o["module"] == "late"]
    assert [(o["phase"], o["op"], o["epoch"]) for o in late] == [
        ("backward", "aten.index_put(accumulate=True)", 2)]
    assert result.investigations["census"]["steps"] == [0, 2]  # each epoch's first step
    assert result.summary["census_seconds"] > 0
    text = render_console(result.summary)
    assert "late      backward  aten.index_put(accumulate=True)" in text and "epoch 2" in text
    assert "(census: " in render_markdown(result.summary)


def mid_epoch_vote_probe(device: torch.device) -> Probe:
    """The splat runs at step 1 only, mid-epoch: the epochs' first steps never see it."""
    model = VoteNet().to(device)
    g = torch.Generator().manual_seed(3)
    points, cells = torch.randn(VOTES, 4, generator=g), torch.randint(0, CELLS, (VOTES,), generator=g)
    batches = [(points[:8], cells[:8]), (points, cells), (points[:8], cells[:8])]

    def step(m: nn.Module, batch):
        return m(*(t.to(device) for t in batch)).pow(2).mean()

    return Probe(model=model, batches=batches, step=step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


@pytest.mark.parametrize("granularity", ["scan", "module"])
def test_the_replayed_divergent_step_is_stressed_too(granularity, two_threads):
    fault = Fault("out", "forward", 1)  # the runs part at step 1, where the splat runs
    result = audit(mid_epoch_vote_probe, repeats=2, steps=3, fault=fault,
                   granularity=granularity, drill_down=True)
    assert result.comparison.first_step == 1
    assert not any(op.module == "vote_head" and op.proven  # step 0: 8 votes, no race
                   for op in result.comparison.stress)
    vote = [op for op in result.summary["stress"] if op["module"] == "vote_head"]
    assert vote and vote[0]["proven"] and vote[0]["steps"] == [1]
    assert "proven by re-execution: aten.index_put_ in vote_head (forward, step 1, epoch 1)" in (
        result.verdict.headline)


class LateRace:
    """aten.add, except that from its 21st call on it adds 1 ULP more: a race that only shows
    once the threads are hot."""

    _schema = torch.ops.aten.add.Tensor._schema

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, a, b):
        self.calls += 1
        out = torch.ops.aten.add.Tensor(a, b)
        return torch.nextafter(out, out + 1) if self.calls > 20 else out


@pytest.mark.parametrize("limit,distinct,runs", [(16, 1, 16), (64, 2, 21)])
def test_a_parallel_op_whose_runs_agree_runs_on_until_it_parts(limit, distinct, runs):
    from detaudit.record.stress import OpStress, _re_execute

    entry = OpStress(0, 0, "forward", "m", "aten.add")
    _re_execute(entry, LateRace(), ((torch.ones(4), torch.ones(4)), {}), [], [], 16, limit)
    assert (entry.distinct, entry.runs) == (distinct, runs)
    assert (entry.differing, entry.max_ulp) == ((4, 1) if distinct > 1 else (0, None))


def test_a_proof_counts_the_runs_of_the_step_that_proved_it():
    """Stressed at two steps: one result in 64 runs at step 4, 16 in 16 at step 8. The line
    said "16 different results in 64 runs", the largest of each from other steps."""
    from detaudit.analysis.stress import stressed_ops

    trace = Trace(probe={}, repeat=0, env={})
    for step, runs, distinct in ((4, 64, 1), (8, 16, 16)):
        trace.add_stress({
            "step": step, "epoch": step // 4, "phase": "backward", "module": "head",
            "op": "aten.index_put(accumulate=True)", "calls": 1, "stressed": 1, "runs": runs,
            "distinct": distinct, "elements": 8, "differing": 0 if distinct == 1 else 3,
            "max_abs": None if distinct == 1 else 1e-9, "max_ulp": None if distinct == 1 else 2,
            "rel_err": None if distinct == 1 else 1e-8, "site": ""})
    [op] = stressed_ops([trace])
    assert op.line() == ("aten.index_put in head (backward, step 8, epoch 3) gave 16 different "
                         "results in 16 runs on identical inputs"), op.line()
