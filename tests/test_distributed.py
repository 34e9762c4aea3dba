"""`detaudit run --nproc 2`: DDP on gloo, 2 ranks on this machine, and the cross-rank checks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from detaudit.analysis.compare import compare
from detaudit.analysis.ranks import analyse, compare_ranks
from detaudit.analysis.verdict import judge
from detaudit.cli import main
from detaudit.config import ANY_MODULE, Fault
from detaudit.drivers.rankprobe import is_rank_aware, sampler_snapshot, shard_loader
from detaudit.errors import DetauditError
from detaudit.record.fingerprint import TensorPrint
from detaudit.trace import StepInfo, Trace

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

PROBE = Path(__file__).parent / "probe_files" / "ddp_tiny.py"
CHECKS = ("params", "grads", "shards", "epochs", "rng", "init")


def audit(variant: str, out: Path, capsys, monkeypatch) -> tuple[int, dict, str]:
    """Run the 2-rank audit of one variant of ddp_tiny.py; (exit code, summary, stderr)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    target = f"{PROBE}:{variant}" if variant else str(PROBE)
    code = main(["run", "--probe", target, "--nproc", "2", "--epochs", "2", "--steps", "2",
                 "--repeats", "2", "--out", str(out), "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def checks(summary: dict) -> dict[str, dict]:
    return {c["key"]: c for c in summary["ranks"]["checks"]}


def test_correct_ddp_probe_is_deterministic_in_sync_and_disjoint(tmp_path, capsys, monkeypatch):
    code, summary, _ = audit("", tmp_path, capsys, monkeypatch)
    assert code == 0, summary["headline"]
    assert summary["verdict"] == "deterministic"
    assert {k: c["status"] for k, c in checks(summary).items()} == dict.fromkeys(CHECKS, "ok")
    assert [r["verdict"] for r in summary["ranks"]["per_rank"]] == ["deterministic"] * 2
    traces = {(r, k): Trace.load(tmp_path / f"trace-r{r}-{k}.json.gz") for r in (0, 1) for k in (0, 1)}
    assert all(t.failure is None and len(t.steps) == 4 for t in traces.values())
    shards = [
        [e["sampler"]["indices"] for e in traces[(r, 0)].probe["distributed"]["epochs"]] for r in (0, 1)
    ]
    for epoch in (0, 1):
        assert not set(shards[0][epoch]) & set(shards[1][epoch])
        assert sorted(shards[0][epoch] + shards[1][epoch]) == list(range(8))
    assert shards[0][0] != shards[0][1]  # set_epoch reshuffles
    losses = [[s.losses for s in traces[(r, 0)].steps] for r in (0, 1)]
    assert losses[0] != losses[1]  # each rank trained on its own shard
    assert "Ranks" in (tmp_path / "report.md").read_text()


def test_missing_set_epoch_is_flagged_with_the_epoch(tmp_path, capsys, monkeypatch):
    code, summary, _ = audit("no_set_epoch", tmp_path, capsys, monkeypatch)
    assert code == 1
    found = checks(summary)
    assert found["epochs"]["status"] == "flagged"
    first = found["epochs"]["findings"][0]
    assert (first["epoch"], first["previous_epoch"], first["ranks"], first["sampler_epoch"]) == (
        2, 1, [0, 1], 0)
    assert "set_epoch" in summary["headline"] and "epoch 2" in summary["headline"]
    assert all(found[k]["status"] == "ok" for k in CHECKS if k != "epochs")
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--json"]) == 1  # re-rendered from the run folder alone
    assert json.loads(capsys.readouterr().out)["headline"] == summary["headline"]


def test_augmentation_seeded_alike_on_every_rank_is_flagged(tmp_path, capsys, monkeypatch):
    code, summary, _ = audit("same_augment_seed", tmp_path, capsys, monkeypatch)
    assert code == 1
    found = checks(summary)
    assert found["rng"]["status"] == "flagged"
    first = found["rng"]["findings"][0]
    assert (first["where"], first["stream"], first["step"], first["epoch"]) == (
        "data loading", "torch", 0, 1)
    assert first["groups"] == [[0, 1]]
    assert found["init"]["status"] == "ok"  # the model itself is built alike, as it must be
    assert found["shards"]["status"] == "ok"


def test_planted_desync_is_named_by_parameter_and_step(tmp_path, capsys, monkeypatch):
    code, summary, _ = audit("desync", tmp_path, capsys, monkeypatch)
    assert code == 1
    found = checks(summary)
    params = found["params"]
    assert params["status"] == "flagged" and params["repeats"] == [0, 1]
    assert [(f["parameter"], f["step"], f["epoch"], f["phase"]) for f in params["findings"]] == [
        ("module.head.weight", 2, 2, "optimizer")]
    assert "module.head.weight" in summary["headline"] and "step 2" in summary["headline"]
    assert found["grads"]["status"] == "ok"  # all-reduce still averages the gradients
    assert [r["verdict"] for r in summary["ranks"]["per_rank"]] == ["deterministic"] * 2


def test_a_crashed_rank_is_named_and_the_other_traces_kept(tmp_path, capsys, monkeypatch):
    code, summary, err = audit("crash", tmp_path, capsys, monkeypatch)
    assert code == 3  # a crash, not a divergence
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("detaudit: rank 1 crashed in repeat 1: RuntimeError in step 1")
    assert "ddp_tiny.py" in lines[0] and "rank 1 lost its device" in lines[0]
    assert summary["verdict"] == "failed" and summary["ranks"]["crash"]["rank"] == 1
    for rank in (0, 1):
        kept = Trace.load(tmp_path / f"trace-r{rank}-0.json.gz")
        assert kept.failure is None and len(kept.steps) == 4
    crashed = Trace.load(tmp_path / "trace-r1-1.json.gz")
    assert "rank 1 lost its device" in crashed.failure and len(crashed.steps) == 1
    assert "trace-r0-0.json.gz" in summary["ranks"]["crash"]["kept"]


def test_rank_aware_form_is_told_by_its_signature():
    assert is_rank_aware(lambda device, rank, world_size: None)
    assert not is_rank_aware(lambda device: None)
    assert not is_rank_aware(lambda device, steps=4: None)


def test_a_planted_fault_names_its_module_inside_the_ddp_wrapper():
    assert Fault("roi_heads.box_roi_pool", "backward", 2).in_wrapper() == Fault(
        "module.roi_heads.box_roi_pool", "backward", 2)
    assert Fault("module.head").in_wrapper().module == "module.head"
    assert Fault(ANY_MODULE, op="nms").in_wrapper().module == ANY_MODULE


def test_shard_loader_splits_a_single_process_loader_per_rank():
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True)
    shards = {}
    for rank in (0, 1):
        epochs = shard_loader(loader, rank, 2, seed=0)
        shards[rank] = [[int(i) for (b,) in epochs(e) for i in b] for e in (0, 1)]
    for epoch in (0, 1):
        assert sorted(shards[0][epoch] + shards[1][epoch]) == list(range(10))
    assert shards[0][0] != shards[0][1]
    with pytest.raises(DetauditError, match="probe\\(device, rank, world_size\\)"):
        shard_loader([torch.zeros(2)], 0, 2, seed=0)


# -- the analysis alone, on hand-made traces ----------------------------------------------


def _trace(rank: int, grad_fp: str, indices: list[int], fetch_state: str,
           draw: str = "r") -> Trace:
    trace = Trace(probe={"distributed": {
        "rank": rank, "world_size": 2, "backend": "gloo", "init": {"module.fc.weight": "aa"},
        "epochs": [{"epoch": 0, "sampler": {"kind": "SequentialSampler", "shuffle": False,
                                             "padding": 0, "indices": indices}}],
        "fetches": [{"epoch": 0, "index": 0, "before": {"numpy": fetch_state}, "drew": ["numpy"]}],
    }}, repeat=0, env={})
    trace.steps.append(StepInfo(step=0, epoch=0, index=0, losses={"loss": (1.0).hex()}))
    for phase, slot, fp in (("state", "batch.0", f"b{rank}"), ("forward", "rng.in", draw),
                            ("grad", "param.weight", grad_fp), ("optimizer", "param.weight", "pp")):
        trace.add_record(0, (phase, "module.fc", 0, slot), TensorPrint(fp, (2,), "float32",
                                                                        1.0, 1.0, 0))
    return trace


def test_analysis_names_gradient_desync_shared_shards_and_shared_draws():
    by_rank = {0: [_trace(0, "g0", [0, 1, 2, 3], "s")], 1: [_trace(1, "g1", [0, 1, 2, 3], "s")]}
    found = {c.key: c for c in analyse(by_rank, compare_ranks(by_rank)).checks}
    assert found["params"].status == "ok"
    grads = found["grads"].findings
    assert [(f["parameter"], f["step"], f["groups"]) for f in grads] == [
        ("module.fc.weight", 0, [[0], [1]])]
    shards = found["shards"].findings[0]
    assert (shards["epoch"], shards["shared"], shards["examples"]) == (1, 4, [0, 1, 2, 3])
    assert [(f["where"], f["stream"], f["groups"]) for f in found["rng"].findings] == [
        ("data loading", "numpy", [[0, 1]]), ("module.fc", "torch", [[0, 1]])]
    assert found["epochs"].status == "not checked"
    assert found["init"].status == "ok"


def _records_trace(repeat: int, records: list[tuple[str, str, str]]) -> Trace:
    trace = Trace(probe={}, repeat=repeat, env={})
    trace.steps.append(StepInfo(step=0, epoch=0, index=0))
    for phase, slot, fp in records:
        trace.add_record(0, (phase, "module.fc", 0, slot), TensorPrint(fp, (2,), "float32",
                                                                        1.0, 1.0, 0))
    return trace


def _received_from_rank_1(phase: str, slot: str):
    """Two repeats of two ranks: one record of `phase`/`slot` differs run to run on rank 1
    only, and the all-reduced gradient differs on both. Returns the rank analysis and its
    rows by rank, after checking rank 0 received the difference from rank 1."""
    by_rank = {rank: [_records_trace(k, [(phase, slot, f"{rank}-{k}" if rank else "same"),
                                         ("grad", "param.weight", f"g{k}")]) for k in (0, 1)]
               for rank in (0, 1)}
    ranks = analyse(by_rank, compare_ranks(by_rank))
    rows = {r.rank: r for r in ranks.per_rank}
    assert rows[0].source == "all-reduce (from rank 1)" and rows[1].source == "local"
    assert ranks.primary_rank == 1
    return rows


def test_a_difference_received_through_all_reduce_points_at_the_rank_it_came_from():
    rows = _received_from_rank_1("backward", "grad_in.0")
    assert (rows[1].phase, rows[1].module, rows[1].role) == ("backward", "module.fc", "origin")


def test_a_scanned_rank_whose_data_differs_is_where_the_all_reduced_difference_came_from():
    """At scan level there are no module origins: rank 1's batch differing run to run is
    where the difference began, and rank 0, whose gradients alone differ, received it."""
    rows = _received_from_rank_1("state", "batch.0")
    assert rows[1].cause == "data"


def test_a_rank_whose_loss_alone_differs_received_it_from_one_whose_rng_did():
    """Tensor parallelism all-reduces inside forward: noise drawn unseeded on rank 1 makes
    both ranks' losses differ run to run, but only rank 1's RNG differed as the step began.
    Rank 1 is the source (the report details it), rank 0 received the difference."""
    def trace(rank, k):
        return _records_trace(k, [
            ("state", "rng.torch", f"{rank}-{k}" if rank == 1 else "same"),
            ("output", "loss", f"loss-{k}"), ("grad", "param.weight", f"g{k}")])

    by_rank = {rank: [trace(rank, k) for k in (0, 1)] for rank in (0, 1)}
    ranks = analyse(by_rank, compare_ranks(by_rank))
    assert [(r.rank, r.source) for r in ranks.per_rank] == [
        (0, "all-reduce (from rank 1)"), (1, "local")]
    assert ranks.primary_rank == 1


def test_ranks_that_each_start_their_own_difference_are_each_its_source():
    """Unseeded, each rank builds different weights run to run: both ranks' own parameters
    differ before their first step (and so do the all-reduced gradients), so each is where
    its difference began, not a receiver of the other's."""
    by_rank = {rank: [_records_trace(k, [("state", "param.weight", f"{rank}-{k}"),
                                         ("grad", "param.weight", f"g{k}")]) for k in (0, 1)]
               for rank in (0, 1)}
    rows = analyse(by_rank, compare_ranks(by_rank)).per_rank
    assert [(r.rank, r.source) for r in rows] == [(0, "local"), (1, "local")]


@pytest.mark.parametrize("seeded", ["per rank", "alike"])
def test_samplers_that_shuffle_with_a_seed_per_rank_are_said_to_need_one_seed(seeded):
    """Each rank's DistributedSampler takes its own part (num_replicas and rank are right)
    of an order shuffled with its own seed: the parts overlap, and the advice is the seed,
    not the num_replicas and rank the script already passes."""
    data = TensorDataset(torch.arange(64))
    by_rank = {}
    for rank in (0, 1):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True,
                                     seed=rank if seeded == "per rank" else 0)
        trace = _records_trace(0, [("grad", "param.weight", "g")])
        trace.probe["distributed"] = {"rank": rank, "epochs": [
            {"epoch": 0, "sampler": sampler_snapshot(DataLoader(data, sampler=sampler))}]}
        by_rank[rank] = [trace]
    shards = {c.key: c for c in analyse(by_rank, compare_ranks(by_rank)).checks}["shards"]
    if seeded == "alike":
        assert shards.status == "ok", shards.detail
        return
    assert shards.status == "flagged"
    assert "shuffles with a seed of its own (rank 0: 0, rank 1: 1)" in shards.detail
    assert "num_replicas" not in shards.detail


@pytest.mark.parametrize("failed", ["before its first step", "after its steps", "no"])
def test_ranks_that_failed_before_joining_a_group_are_not_said_to_train_alone(failed):
    """Ranks that never joined a process group train alone by design (a script that does
    not distribute), unless each failed before it could (a script that asks for NCCL on
    a machine without a GPU): the group checks then say so, not that the ranks train apart.
    Ranks that trained, then failed, trained alone all the same."""
    by_rank = {}
    for rank in (0, 1):
        trace = (Trace(probe={}, repeat=0, env={}) if failed == "before its first step" else
                 _records_trace(0, [("grad", "param.weight", "g")]))
        trace.probe["distributed"] = {"rank": rank, "backend": "unknown"}
        trace.failure = None if failed == "no" else "RuntimeError: Found no NVIDIA driver"
        by_rank[rank] = [trace]
    checks = {c.key: c for c in analyse(by_rank, compare_ranks(by_rank)).checks}
    said = ("each failed before" if failed == "before its first step" else
            "each trains a model of its own")
    assert all(said in checks[key].detail for key in ("params", "grads", "shards", "init"))


@pytest.mark.parametrize("model", ["tensor parallel", "ddp", "no process group"])
def test_the_zoom_details_the_tensor_parallel_rank_whose_step_parts_first(model):
    """Both ranks' layer `w2` parts run to run, rank 1's `w1` before it: with collectives in
    forward (tensor parallelism) rank 1 is where it began and rank 0 received it. DDP has
    none there (each rank's forward is its own), and ranks that never joined a group none at
    all: the rank the scan chose stays."""
    from detaudit.execution import _furthest_upstream

    def trace(rank, k):
        t = Trace(probe={"distributed": {
            "rank": rank, "backend": "unknown" if model == "no process group" else "gloo",
            "tensor_parallel": model == "tensor parallel"}}, repeat=k, env={})
        t.steps.append(StepInfo(step=0, epoch=0, index=0))
        for module, fp in (("w1", f"{k}" if rank == 1 else "a"), ("w2", f"{k}")):
            t.add_record(0, ("forward", module, 0, "out"),
                         TensorPrint(fp, (2,), "float32", 1.0, 1.0, 0))
        return t

    runs = [{rank: trace(rank, k) for rank in (0, 1)} for k in (0, 1)]
    by_rank = {rank: [run[rank] for run in runs] for rank in (0, 1)}
    ranks = analyse(by_rank, compare_ranks(by_rank))
    assert ranks.primary_rank == 0  # (each rank has an origin of its own in its records)
    assert _furthest_upstream(runs, 0, ranks, 0, ()) == (
        (1, [0]) if model == "tensor parallel" else (0, []))


def _print_of(label: str) -> str:
    """A print, as a trace file holds one (16 hex digits), standing for `label`'s value."""
    return hashlib.blake2b(label.encode(), digest_size=8).hexdigest()


def _steps_trace(rank: int, steps: int, desync_at: int) -> Trace:
    """A rank's trace of `steps` steps whose parameter goes out of sync at `desync_at`."""
    trace = Trace(probe={}, repeat=0, env={})
    for step in range(steps):
        trace.steps.append(StepInfo(step=step, epoch=step // 2, index=step % 2))
        param = f"p{step}" + (f"-r{rank}" if step >= desync_at else "")
        for phase, slot, fp in (("state", "batch.0", f"b{rank}-{step}"),
                                ("grad", "param.weight", f"g{step}"),
                                ("optimizer", "param.weight", param),
                                ("optimizer", "param.bias", f"q{step}")):
            trace.add_record(step, (phase, "module.fc", 0, slot),
                             TensorPrint(_print_of(fp), (2,), "float32", 1.0, 1.0, 0))
    return trace


def test_the_cross_rank_checks_read_streamed_traces_a_step_at_a_time(tmp_path, monkeypatch):
    from conftest import stream_trace

    from detaudit.trace import TraceFile, open_trace

    in_memory = {r: [_steps_trace(r, 6, desync_at=3)] for r in (0, 1)}
    streamed = {r: [open_trace(stream_trace(ts[0], tmp_path / f"r{r}.json.gz").path)]
                for r, ts in in_memory.items()}
    assert all(isinstance(ts[0], TraceFile) for ts in streamed.values())

    def whole(self):
        raise AssertionError("the cross-rank checks loaded a trace whole")

    monkeypatch.setattr(TraceFile, "whole", whole)
    found = analyse(streamed, compare_ranks(streamed))
    assert found == analyse(in_memory, compare_ranks(in_memory))
    checks = {c.key: c for c in found.checks}
    assert checks["params"].status == "flagged"
    assert [(f["parameter"], f["step"], f["epoch"], f["phase"])
            for f in checks["params"].findings] == [("module.fc.weight", 3, 2, "optimizer")]
    assert checks["params"].detail.startswith("desync at step 3 (epoch 2): parameter "
                                              "module.fc.weight differs between ranks 0 and 1")
    assert (checks["grads"].status, checks["grads"].detail) == (
        "ok", "6 all-reduced gradient records identical on every rank")
    assert checks["shards"].status == "ok"  # every rank loads its own batches


def test_a_batch_sampler_that_holds_no_sampler_leaves_the_order_unchecked():
    """accelerate's BatchSamplerShard is a BatchSampler with no `sampler`: reading it was
    an AttributeError in detaudit's loader hook, which ended the audited run."""
    from detaudit.drivers.rankprobe import sampler_snapshot

    class Sharded(torch.utils.data.BatchSampler):
        def __init__(self, inner):
            self.inner = inner  # (BatchSampler.__init__ not called: no .sampler)

        def __iter__(self):
            return iter(self.inner)

        def __len__(self):
            return len(self.inner)

    data = list(range(8))
    plain = torch.utils.data.DataLoader(data, batch_size=2)
    assert sampler_snapshot(plain)["indices"] == data
    sharded = torch.utils.data.DataLoader(data, batch_sampler=Sharded(plain.batch_sampler))
    assert sampler_snapshot(sharded) is None


def test_the_randomness_check_says_only_what_was_recorded():
    """exec records no data loading's draws: a zoomed step's module records alone said "no
    rank drew randomness while loading data or in a module", of loading it never saw."""
    def zoomed(rank: int) -> Trace:
        trace = Trace(probe={"distributed": {"rank": rank, "world_size": 2, "backend": "gloo"}},
                      repeat=0, env={})
        trace.steps.append(StepInfo(step=0, epoch=0, index=0, losses={"loss": (1.0).hex()}))
        for phase, slot in (("state", "batch.0"), ("forward", "out")):
            trace.add_record(0, (phase, "module.fc", 0, slot),
                             TensorPrint(f"{slot}{rank}", (2,), "float32", 1.0, 1.0, 0))
        return trace

    by_rank = {0: [zoomed(0)], 1: [zoomed(1)]}
    rng = {c.key: c for c in analyse(by_rank, compare_ranks(by_rank)).checks}["rng"]
    assert rng.status == "ok"
    assert rng.detail == ("no rank drew randomness in a module at the steps recorded module by "
                          "module (data loading's draws were not recorded)")


def test_one_rank_is_compared_with_no_other():
    """A script that spawns one rank (PyTorch's ImageNet example with --world-size 1) and
    no DDP on CPU: the cross-rank checks said "gradients identical across ranks after
    all-reduce: ok", of an all-reduce that never ran; only the sampler's epochs apply."""
    one = {0: [_trace(0, "g0", [0, 1, 2, 3], "s")]}
    checks = {c.key: c for c in analyse(one, compare_ranks(one)).checks}
    assert {k for k, c in checks.items() if c.status == "not checked"} >= {
        "params", "grads", "shards", "rng", "init"}
    assert checks["grads"].detail == "one rank: nothing to compare it with"


def test_ranks_each_recorded_in_one_run_only_are_not_compared():
    """A launcher whose workers begin in another order in each run (Ray Train's) had rank 0
    recorded in one run and rank 1 in the other: "DETERMINISTIC: 1 repeats bit-identical;
    2 ranks in sync", exit 0, of ranks never compared run to run."""
    by_rank = {rank: [_records_trace(rank, [("grad", "param.weight", "g")])] for rank in (0, 1)}
    verdict = judge(compare(by_rank[0]), ranks=analyse(by_rank, compare_ranks(by_rank)))
    assert (verdict.kind, verdict.exit_code) == ("not compared", 2), verdict.headline
    assert verdict.headline.startswith("NOT COMPARED: ranks 0 and 1 recorded in one run only")



def _built_per_rank(rank: int, repeat: int, failure: str | None = None) -> Trace:
    """A rank's trace whose parameters as built are its own (seeded with seed + rank, as
    timm's recipe does), the same after DDP's broadcast; `failure`: the run crashed."""
    trace = _trace(rank, "g", [rank], f"s{rank}", draw=f"r{rank}")
    trace.repeat, trace.failure = repeat, failure
    trace.probe["distributed"]["init"] = {"module.fc.weight": f"built{rank}"}
    return trace


def test_parameters_built_apart_on_each_rank_are_noted_not_a_divergence():
    """timm seeds each rank with seed + rank on purpose, and DDP's broadcast from rank 0
    makes the parameters equal: every check passed, yet the audit was `DIVERGENT ACROSS
    RANKS`, exit 1, for the parameters as built."""
    by_rank = {rank: [_built_per_rank(rank, k) for k in (0, 1)] for rank in (0, 1)}
    ranks = analyse(by_rank, compare_ranks(by_rank))
    init = {c.key: c for c in ranks.checks}["init"]
    assert init.status == "noted" and "makes them equal" in init.detail, init.detail
    verdict = judge(compare(by_rank[0]), ranks=ranks)
    assert (verdict.kind, verdict.exit_code) == ("deterministic", 0), verdict.headline


def test_runs_that_all_failed_are_failed_whatever_a_check_flagged_in_them():
    """Every run crashed (inside DDP's constructor, timm's on CPU) after a cross-rank check
    had something to flag: the audit was `DIVERGENT ACROSS RANKS`, exit 1, not `FAILED`."""
    by_rank = {rank: [_trace(rank, "g", [rank], "shared") for _ in (0, 1)] for rank in (0, 1)}
    for traces in by_rank.values():
        for k, trace in enumerate(traces):
            trace.repeat, trace.failure = k, "ValueError while running at train.py:571"
    ranks = analyse(by_rank, compare_ranks(by_rank))
    assert ranks.flagged
    verdict = judge(compare(by_rank[0]), ranks=ranks)
    assert (verdict.kind, verdict.exit_code) == ("failed", 3), verdict.headline
