"""Cross-rank checks of a distributed audit, from saved traces only (no model needed).

Every rank's traces are compared run to run as usual (:func:`compare_ranks`); then the
traces of one repeat are compared across ranks (:func:`analyse`): parameters and
all-reduced gradients must be identical on every rank, data shards disjoint within an
epoch and reordered between epochs, randomness distinct per rank where it feeds
augmentation or module draws, and equal where it builds the model. The result is plain
data; epochs in it are 1-based and steps 0-based global step numbers, as in the summary.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..config import UNJOINED
from ..trace import BACKWARD, FORWARD, GRAD, OPTIMIZER, PROBE_DISTRIBUTED, STATE, AnyTrace, Trace
from ..words import counted, joined, one_based
from .compare import DIVERGENT, ORIGIN, RUN_ENDED, Comparison, aligned_steps, compare

OK, FLAGGED, NOT_CHECKED = "ok", "flagged", "not checked"
NOTED = "noted"  # seen, and harmless as the run went: said, not flagged
EXAMPLES = 5  # shared sample indices listed in a finding
RankTraces = list[tuple[int, AnyTrace]]  # (rank, trace) of one repeat, by rank
CheckResult = tuple[str, str, list[dict[str, Any]]]  # status, detail, findings


@dataclass
class RankRow:
    """One rank's run-to-run verdict and first divergence."""

    rank: int
    verdict: str  # deterministic, divergent or failed
    repeats: int
    first_step: int | None
    first_epoch: int | None  # 1-based
    phase: str | None
    module: str | None
    role: str | None
    cause: str
    source: str | None  # local, or "all-reduce (from rank k)"
    failures: dict[str, str]


@dataclass
class RankCheck:
    """One cross-rank check over every repeat: flagged if any repeat is."""

    key: str
    title: str
    status: str  # ok, flagged or not checked
    detail: str
    findings: list[dict[str, Any]]  # the first flagged (or checked) repeat's findings
    repeats: list[int]  # the repeats it was flagged in


@dataclass
class RankAnalysis:
    """Per-rank verdicts side by side and every cross-rank check."""

    world_size: int
    backend: str | None
    primary_rank: int  # whose run-to-run analysis the report details
    per_rank: list[RankRow]
    checks: list[RankCheck]
    crash: dict[str, Any] | None = None  # rank, repeat, message, kept
    launch: str = ""  # the launcher command line
    traces: dict[str, list[str]] = field(default_factory=dict)  # rank -> trace file names

    @property
    def flagged(self) -> list[RankCheck]:
        return [c for c in self.checks if c.status == FLAGGED]

    @property
    def divergent_ranks(self) -> list[RankRow]:
        return [r for r in self.per_rank if r.verdict == DIVERGENT]

    def to_dict(self) -> dict[str, Any]:
        """Plain data, as stored in run.json and the summary."""
        return {**asdict(self), "flagged": [c.key for c in self.flagged]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankAnalysis:
        """Inverse of :meth:`to_dict`."""
        return cls(
            world_size=data["world_size"], backend=data.get("backend"),
            primary_rank=data["primary_rank"],
            per_rank=[RankRow(**row) for row in data["per_rank"]],
            checks=[RankCheck(**check) for check in data["checks"]],
            crash=data.get("crash"), launch=data.get("launch", ""),
            traces=data.get("traces") or {},
        )


def compare_ranks(traces_by_rank: dict[int, list[AnyTrace]]) -> dict[int, Comparison]:
    """The run-to-run comparison of each rank's finished repeats; failed ones are listed."""
    out = {}
    for rank, traces in sorted(traces_by_rank.items()):
        comparison = compare(finished(traces))
        comparison.failures.update({t.repeat: t.failure for t in traces if t.failure})
        out[rank] = comparison
    return out


def finished(traces: list[AnyTrace]) -> list[AnyTrace]:
    """The repeats that ran to the end (all of them when none did)."""
    return [t for t in traces if not t.failure] or traces


def analyse(
    traces_by_rank: dict[int, list[AnyTrace]],
    comparisons: dict[int, Comparison],
    crash: dict[str, Any] | None = None,
) -> RankAnalysis:
    """Per-rank verdicts side by side and every cross-rank check."""
    ranks = sorted(traces_by_rank)
    rows = [_rank_row(rank, comparisons[rank]) for rank in ranks]
    _mark_all_reduce(rows, comparisons)
    repeats = min(len(traces) for traces in traces_by_rank.values())
    backends = [_distributed(t).get("backend") for ts in traces_by_rank.values() for t in ts]
    # (a trace that names no backend, from a run before exec noted it, is taken as joined)
    joined = not backends or any(b != UNJOINED for b in backends)
    # ranks that failed, every one, before its first step: not ranks that train alone
    unjoined = FAILED_UNJOINED if all(t.failure and not t.steps for ts in traces_by_rank.values()
                                      for t in ts) else NO_GROUP
    results: dict[str, list[CheckResult]] = {key: [] for key, _, _ in CHECKS}
    for k in range(repeats):
        items = [(r, traces_by_rank[r][k]) for r in ranks]
        seen = RankRecords.read(items)
        for key, _, check in CHECKS:
            results[key].append(
                (NOT_CHECKED, "one rank: nothing to compare it with", [])
                if len(ranks) < 2 and key not in ALONE else
                (NOT_CHECKED, unjoined, []) if not joined and key in GROUP_CHECKS else
                check(items, seen))
    checks = [_merge(key, title, results[key]) for key, title, _ in CHECKS]
    backend = NO_PROCESS_GROUP if not joined and len(ranks) > 1 else next(
        (b for b in backends if b and b != UNJOINED), None)
    return RankAnalysis(
        world_size=len(ranks), backend=backend,
        primary_rank=_primary(rows, comparisons), per_rank=rows, checks=checks, crash=crash,
    )


# -- per-rank comparisons ------------------------------------------------------------------


def _rank_row(rank: int, c: Comparison) -> RankRow:
    row = RankRow(
        rank=rank, verdict=c.verdict, repeats=c.repeats, first_step=c.first_step,
        first_epoch=one_based(c.first_epoch), phase=None, module=None, role=None,
        cause=c.cause, source=None, failures={str(k): v for k, v in c.failures.items()},
    )
    if c.first_step is not None and c.cause == "length":  # (its records are missing there)
        row.role, row.source = RUN_ENDED, "local"
    elif c.first_step is not None:
        origin = c.origins[0] if c.origins else None
        first = c.first_diffs[0]
        row.phase = origin.phase if origin else first.phase
        row.module = origin.module if origin else first.module
        row.role = ORIGIN if origin else "first record"
        row.source = "local"
    return row


def _mark_all_reduce(rows: list[RankRow], comparisons: dict[int, Comparison]) -> None:
    """A rank whose own part of the first divergent step began less far upstream than
    another's got the difference from it, through a collective: its gradients alone differ
    (DDP's all-reduce), or its loss too where the other rank's data, RNG or parameters
    differed before the step (a tensor-parallel layer's all-reduce in forward)."""
    for row in rows:
        step = row.first_step
        if step is None:
            continue
        own = _started(comparisons[row.rank], step)
        senders = [other.rank for other in rows
                   if other is not row and _started(comparisons[other.rank], step) > own]
        if senders:
            row.source = _received(senders)


def mark_received(analysis: RankAnalysis, source: int, later: list[int]) -> None:
    """A zoom found the first divergent step parting first on rank `source`, and on the
    ranks `later` further on: the report details `source`, and `later` received it."""
    analysis.primary_rank = source
    for row in analysis.per_rank:
        if row.rank == source:
            row.source = "local"
        elif row.rank in later:
            row.source = _received([source])


def _received(senders: list[int]) -> str:
    return f"all-reduce (from rank {joined(senders)})"


def _started(c: Comparison, step: int) -> int:
    """How far upstream a rank's own run-to-run difference began by `step`: 2, in what the
    step began with (its data, RNG or parameters, state records) or at a module origin in
    its forward or backward; 1, in its loss (at scan level, no module records); 0, in its
    gradients and updates alone, or not at all."""
    if c.first_step is None or c.first_step > step:
        return 0
    if any(f.step == step and f.role == ORIGIN and f.phase in (FORWARD, BACKWARD)
           for f in c.findings):
        return 2
    phases = {d.phase for d in c.first_diffs}
    return 2 if STATE in phases else 1 if phases - {GRAD, OPTIMIZER} else 0


def _primary(rows: list[RankRow], comparisons: dict[int, Comparison]) -> int:
    """The rank whose run-to-run analysis the report details: the first to diverge locally,
    the furthest upstream."""
    divergent = [r for r in rows if r.first_step is not None]
    if divergent:
        return min(divergent, key=lambda r: (
            r.first_step, r.source != "local", -_started(comparisons[r.rank], r.first_step),
            r.rank)).rank
    failed = [r for r in rows if r.failures]
    return (failed or rows)[0].rank


# -- cross-rank checks (one repeat: every rank's trace) -----------------------------------


@dataclass
class RankRecords:
    """What the record-based checks need of one repeat's traces on every rank, read in one
    pass a step at a time (the traces of a long run are never held whole): the first
    cross-rank disagreement per parameter (as built and after each update) and per
    gradient, each step's batch prints, and the RNG draws of module calls."""

    params: list[dict[str, Any]] = field(default_factory=list)
    params_compared: int = 0
    grads: list[dict[str, Any]] = field(default_factory=list)
    grads_compared: int = 0
    batches: dict[int, dict[int, tuple[str, ...]]] = field(default_factory=dict)  # rank, step
    module_draws: list[dict[str, Any]] = field(default_factory=list)
    drew_in_modules: bool = False  # a module call's RNG draw was recorded
    module_level: bool = False  # forward records exist (module calls were recorded)
    # parameters some rank holds its own shard of (FSDP2): neither they nor their
    # gradients are the same on every rank, so they are not compared
    sharded: list[str] = field(default_factory=list)
    # parameters whose gradients some rank holds as a partial sum (SequenceParallel's norms)
    partial: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, items: RankTraces) -> RankRecords:
        ranks = [rank for rank, _ in items]
        sharded = sorted({name for _, trace in items
                          for name in _distributed(trace).get("sharded") or ()})
        partial = sorted({name for _, trace in items
                          for name in _distributed(trace).get("partial_grads") or ()}
                         - set(sharded))
        seen = cls(batches={rank: {} for rank in ranks}, sharded=sharded, partial=partial)
        params: dict[str, dict[str, Any]] = {}
        grads: dict[str, dict[str, Any]] = {}
        draws: dict[str, dict[str, Any]] = {}
        epochs: dict[int, int] = {}  # 1-based
        for info in items[0][1].steps:
            epochs.setdefault(info.step, info.epoch + 1)
        for step, cuts in aligned_steps([trace for _, trace in items], None):
            cut = [_StepPrints(step, c) for c in cuts]
            epoch = epochs.get(step)
            seen.params_compared += _disagreements(
                step, epoch, ranks, [c.params for c in cut], params, set(sharded))
            seen.grads_compared += _disagreements(
                step, epoch, ranks, [c.grads for c in cut], grads, {*sharded, *partial})
            _module_draws(step, epoch, ranks, [c.draws for c in cut], draws)
            for rank, c in zip(ranks, cut):
                if c.batch:
                    seen.batches[rank][step] = tuple(c.batch)
                seen.drew_in_modules |= c.drew
                seen.module_level |= c.forward
        seen.params, seen.grads = list(params.values()), list(grads.values())
        seen.module_draws = list(draws.values())
        return seen


class _StepPrints:
    """One rank's records of one step, by what each check reads (execution order kept)."""

    def __init__(self, step: int, cut: Trace) -> None:
        r = cut.records
        self.params: dict[tuple[str, str, str], str] = {}
        self.grads: dict[tuple[str, str, str], str] = {}
        self.draws: dict[tuple[str, int], str] = {}
        self.batch: list[str] = []
        self.drew = self.forward = False
        for phase, module, call, slot, fp in zip(
            r["phase"], r["module"], r["call"], r["slot"], r["fp"]
        ):
            if slot.startswith("param.") and (
                    phase == OPTIMIZER or (phase == STATE and step == 0)):
                self.params[(phase, module, slot)] = fp
            elif phase == GRAD and slot.startswith("param."):
                self.grads[(phase, module, slot)] = fp
            elif phase == STATE and slot.startswith("batch"):
                self.batch.append(fp)
            self.drew |= slot == "rng.in"
            self.forward |= phase == FORWARD
            if phase == FORWARD and slot == "rng.in":
                self.draws[(module, call)] = fp


def _check_params(items: RankTraces, seen: RankRecords) -> CheckResult:
    findings, compared = seen.params, seen.params_compared
    if not compared:
        return NOT_CHECKED, _none_common("parameter", seen), []
    if not findings:
        return OK, f"{compared} parameter records identical on every rank{_apart(seen)}", []
    first = findings[0]
    when = "before the first step" if first["phase"] == STATE else "after the optimizer step"
    return FLAGGED, (
        f"desync at step {first['step']} (epoch {first['epoch']}): parameter "
        f"{first['parameter']} differs between ranks {_groups(first['groups'])} {when}; "
        f"{counted(len(findings), 'parameter')} out of sync"
    ), findings


def _check_grads(items: RankTraces, seen: RankRecords) -> CheckResult:
    findings, compared = seen.grads, seen.grads_compared
    if not compared:
        return NOT_CHECKED, _none_common("gradient", seen), []
    if not findings:
        return OK, (f"{compared} all-reduced gradient records identical on every rank"
                    f"{_apart(seen, grads=True)}"), []
    first = findings[0]
    return FLAGGED, (
        f"the gradient of {first['parameter']} differs between ranks "
        f"{_groups(first['groups'])} after all-reduce at step {first['step']} (epoch "
        f"{first['epoch']}): it is not averaged by DDP, or the step bypasses the DDP wrapper; "
        f"{len(findings)} gradient(s) differ"
    ), findings


def _none_common(kind: str, seen: RankRecords) -> str:
    if not seen.sharded:
        return f"no {kind} records common to every rank"
    return (f"no {kind} records to compare: {counted(len(seen.sharded), 'parameter')} "
            "sharded, each rank holding its own shard")


def _apart(seen: RankRecords, grads: bool = False) -> str:
    """What the parameter (`grads`: gradient) check leaves out: the parameters each rank
    holds a shard of, and the gradients each holds a partial sum of."""
    parts = [counted(len(seen.sharded), "sharded parameter")] if seen.sharded else []
    if grads and seen.partial:
        parts.append(counted(len(seen.partial), "partial-sum gradient"))
    return f" ({' and '.join(parts)} not compared: each rank holds its own part)" if parts else ""


def _disagreements(
    step: int, epoch: int | None, ranks: list[int],
    prints: list[dict[tuple[str, str, str], str]], first: dict[str, dict[str, Any]],
    left_out: set[str],
) -> int:
    """Note in `first` each parameter whose print at `step` is not the same on every rank
    (its first such record only; rank 0's order); how many records every rank has. The
    parameters `left_out` (each rank holds its own part of them) are not compared."""
    named = {key: f"{key[1]}.{key[2][len('param.'):]}" if key[1] else key[2][len("param."):]
             for key in prints[0]}
    common = [key for key in prints[0]
              if named[key] not in left_out and all(key in p for p in prints[1:])]
    for key in common:
        fps = [p[key] for p in prints]
        if len(set(fps)) == 1:
            continue
        phase, name = key[0], named[key]
        if name not in first:
            first[name] = {"step": step, "epoch": epoch, "phase": phase, "parameter": name,
                           "groups": _rank_groups(ranks, fps)}
    return len(common)


def _check_shards(items: RankTraces, seen: RankRecords) -> CheckResult:
    if any(_distributed(trace).get("tensor_parallel") for _, trace in items):
        return NOT_CHECKED, (
            "the model is split across ranks (tensor parallel: DTensor shards without FSDP, "
            "or on a second mesh dimension), whose groups load the same batches by design"), []
    samplers = _samplers(items)
    if samplers is None:
        return _check_shards_by_batch(items, seen)
    findings = []
    for epoch in sorted(set.intersection(*(set(s) for s in samplers.values()))):
        counts: Counter[int] = Counter()
        holders: dict[int, set[int]] = defaultdict(set)
        for rank, by_epoch in samplers.items():
            for index in by_epoch[epoch]["indices"]:
                counts[index] += 1
                holders[index].add(rank)
        repeated = sum(c - 1 for c in counts.values())
        padding = max(by_epoch[epoch].get("padding", 0) for by_epoch in samplers.values())
        if repeated > padding:
            shared = sorted(i for i, c in counts.items() if c > 1)
            findings.append({
                "epoch": epoch + 1, "shared": repeated, "padding": padding,
                "examples": shared[:EXAMPLES],
                "ranks": sorted(set().union(*(holders[i] for i in shared))),
            })
    if not findings:
        return OK, "every rank's sampler indices are disjoint in every epoch (beyond padding)", []
    first = findings[0]
    return FLAGGED, (
        f"ranks {joined(first['ranks'])} share {first['shared']} samples in epoch "
        f"{first['epoch']} (indices {joined(first['examples'])}, ...): "
        + _unsharded_why({r: by_epoch[first["epoch"] - 1] for r, by_epoch in samplers.items()})
    ), findings


def _unsharded_why(samplers: dict[int, dict[str, Any]]) -> str:
    """Why ranks' DistributedSamplers overlap: each shuffles with a seed of its own (each
    takes its part of a different order), or their ranks are not the process group's."""
    seeds = {rank: s.get("seed") for rank, s in samplers.items()}
    shards = {(s.get("num_replicas"), s.get("rank")) for s in samplers.values()}
    if (len(set(seeds.values())) > 1 and len(shards) == len(samplers)
            and all(s.get("shuffle") for s in samplers.values())):
        return ("each rank takes its own part of the samples, but of an order it shuffles "
                f"with a seed of its own ({', '.join(f'rank {r}: {v}' for r, v in seeds.items())}"
                "): every rank's DistributedSampler needs the same seed, so that their parts "
                "of one shared order are disjoint")
    return ("each rank needs its own shard, e.g. DistributedSampler(dataset, "
            "num_replicas=world_size, rank=rank)")


def _check_shards_by_batch(items: RankTraces, seen: RankRecords) -> CheckResult:
    """Without sampler indices: identical batches on two ranks in one epoch mean shared data
    (up to world size - 1 of them, which a padding sampler can repeat)."""
    batches: dict[int, dict[tuple[str, ...], set[int]]] = defaultdict(lambda: defaultdict(set))
    for rank, trace in items:
        epochs: dict[int, int] = {}
        for info in trace.steps:
            epochs.setdefault(info.step, info.epoch + 1)
        for step, prints in seen.batches[rank].items():
            if step in epochs:
                batches[epochs[step]][prints].add(rank)
    if not batches:
        return NOT_CHECKED, "no batch records and no sampler indices", []
    allowed = len(items) - 1
    findings = []
    for epoch, by_prints in sorted(batches.items()):
        shared = [ranks for ranks in by_prints.values() if len(ranks) > 1]
        if len(shared) > allowed:
            findings.append({"epoch": epoch, "shared": len(shared), "padding": allowed,
                             "examples": [], "ranks": sorted(set().union(*shared))})
    if not findings:
        return OK, "no batch is loaded by two ranks in one epoch (by batch fingerprints)", []
    first = findings[0]
    return FLAGGED, (
        f"ranks {joined(first['ranks'])} load {first['shared']} identical batches in epoch "
        f"{first['epoch']}: the data is not sharded per rank"
    ), findings


def _check_epochs(items: RankTraces, seen: RankRecords) -> CheckResult:
    samplers = _samplers(items)
    if samplers is None:
        return NOT_CHECKED, "no DistributedSampler or SequentialSampler seen in a DataLoader", []
    epochs = sorted(set.intersection(*(set(s) for s in samplers.values())))
    if len(epochs) < 2:
        return NOT_CHECKED, "one epoch only", []
    if not any(s[e]["shuffle"] for s in samplers.values() for e in epochs):
        return NOT_CHECKED, "the sampler does not shuffle: the same order every epoch by design", []
    findings = []
    for previous, epoch in zip(epochs, epochs[1:]):
        repeating = [
            rank for rank, s in samplers.items() if s[epoch]["indices"] == s[previous]["indices"]
        ]
        if repeating:
            stuck = all(
                samplers[r][epoch].get("epoch") == samplers[r][previous].get("epoch")
                for r in repeating
            )
            findings.append({
                "epoch": epoch + 1, "previous_epoch": previous + 1, "ranks": repeating,
                "sampler_epoch": samplers[repeating[0]][epoch].get("epoch") if stuck else None,
            })
    if not findings:
        return OK, "every rank's sample order changes from epoch to epoch", []
    first = findings[0]
    why = (
        f": the sampler's epoch stayed {first['sampler_epoch']} (set_epoch(epoch) was not called)"
        if first["sampler_epoch"] is not None else ""
    )
    return FLAGGED, (
        f"epoch {first['epoch']} repeats the sample order of epoch {first['previous_epoch']} "
        f"on ranks {joined(first['ranks'])}{why}"
    ), findings


def _check_rng(items: RankTraces, seen: RankRecords) -> CheckResult:
    findings = _shared_loading_draws(items) + seen.module_draws
    drew = any(f["drew"] for _, t in items for f in _distributed(t).get("fetches", [])) or (
        seen.drew_in_modules)
    loading = any(_distributed(t).get("fetches") for _, t in items)
    if not findings and not loading and not seen.module_level:
        return NOT_CHECKED, (
            "the draws of data loading and modules were not recorded (a scan records the "
            "RNG states at each step only)"), []
    if not findings:
        # (exec records no data loading's draws: only modules', at a zoomed step)
        where = ("while loading data or in a module" if loading else
                 "in a module at the steps recorded module by module (data loading's draws "
                 "were not recorded)")
        if not drew:
            return OK, f"no rank drew randomness {where}", []
        return OK, ("every rank draws its own randomness (data loading and module draws)"
                    if loading else f"every rank draws its own randomness {where}"), []
    findings.sort(key=lambda f: f["step"])
    first = findings[0]
    where = "while loading its batch" if first["where"] == "data loading" else (
        f"in {first['where']}"
    )
    return FLAGGED, (
        f"ranks {_groups(first['groups'], shared_only=True)} draw identical {first['stream']} "
        f"randomness {where} at step {first['step']} (epoch {first['epoch']}): augmentations "
        "repeat across ranks; seed each rank differently after building the model"
    ), findings


def _shared_loading_draws(items: RankTraces) -> list[dict[str, Any]]:
    fetches = [
        {(f["epoch"], f["index"]): f for f in _distributed(trace).get("fetches", [])}
        for _, trace in items
    ]
    ranks = [rank for rank, _ in items]
    found: dict[str, dict[str, Any]] = {}
    for key in sorted(set.intersection(*(set(f) for f in fetches)) if fetches else ()):
        streams = {s for f in fetches for s in f[key]["drew"]}
        for stream in sorted(streams - set(found)):
            drawing = [(r, f[key]["before"].get(stream)) for r, f in zip(ranks, fetches)
                       if stream in f[key]["drew"]]
            groups = _rank_groups([r for r, _ in drawing], [p for _, p in drawing])
            if any(len(g) > 1 for g in groups):
                step = _step_of(items[0][1], key[0], key[1])
                found[stream] = {
                    "step": step, "epoch": key[0] + 1, "index": key[1], "where": "data loading",
                    "stream": stream, "groups": groups,
                }
    return list(found.values())


def _module_draws(
    step: int, epoch: int | None, ranks: list[int],
    prints: list[dict[tuple[str, int], str]], found: dict[str, dict[str, Any]],
) -> None:
    """Note in `found` each module whose call at `step` drew the same torch randomness on
    two ranks (its first such step only)."""
    for key in sorted(set.intersection(*(set(p) for p in prints))):
        module, _ = key
        groups = _rank_groups(ranks, [p[key] for p in prints])
        if module not in found and any(len(g) > 1 for g in groups):
            found[module] = {
                "step": step, "epoch": epoch, "index": None,
                "where": module or "(model)", "stream": "torch", "groups": groups,
            }


def _check_init(items: RankTraces, seen: RankRecords) -> CheckResult:
    inits = [_distributed(trace).get("init") for _, trace in items]
    if any(init is None for init in inits):
        return NOT_CHECKED, (
            "the parameters as built were not recorded on every rank (they are recorded as "
            "DistributedDataParallel is built: none was, as with FSDP or tensor parallelism, "
            "or a probe file wrapped its model in DDP itself)"
        ), []
    names = [n for n in inits[0] if all(n in init for init in inits)]
    ranks = [rank for rank, _ in items]
    findings = []
    for name in names:
        groups = _rank_groups(ranks, [init[name] for init in inits])
        if len(groups) > 1:
            findings.append({"parameter": name, "groups": groups})
    if not findings:
        return OK, f"{len(names)} parameters identical on every rank as built", []
    first = findings[0]
    return NOTED, (
        f"{len(findings)} of {len(names)} parameters differ between ranks as built (first: "
        f"{first['parameter']}, ranks {_groups(first['groups'])}): the ranks build it from "
        "different random states (seeded per rank, as timm's recipe does on purpose, or not "
        "seeded); DDP's broadcast from rank 0 makes them equal before training (without "
        "it, init_sync=False, the parameters check flags them)"
    ), findings


CHECKS: tuple[tuple[str, str, Callable[[RankTraces, RankRecords], CheckResult]], ...] = (
    ("params", "parameters identical across ranks after every optimizer step", _check_params),
    ("grads", "gradients identical across ranks after all-reduce", _check_grads),
    ("shards", "data shards disjoint within each epoch", _check_shards),
    ("epochs", "sample order different in every epoch", _check_epochs),
    ("rng", "randomness distinct per rank (augmentation, module draws)", _check_rng),
    ("init", "initialisation identical across ranks (noted only: DDP broadcasts it)", _check_init),
)


ALONE = {"epochs"}  # the checks that apply to a rank by itself (one rank: the others do not)
NO_PROCESS_GROUP = "no process group"  # the backend of ranks that never joined one
# the checks of ranks that train one model together (each rank of a launch that never joins
# a process group trains its own, which may be seeded, built and fed apart by design)
GROUP_CHECKS = {"params", "grads", "shards", "init"}
NO_GROUP = ("the ranks never joined a process group: each trains a model of its own (built, "
            "seeded and fed as it likes), nothing is all-reduced (a script that does not "
            "distribute, or a launcher that fell back to one process per device, e.g. "
            "`accelerate launch --multi_gpu` where no GPU is found)")
FAILED_UNJOINED = "no rank joined a process group: each failed before (see the failures)"


def _merge(key: str, title: str, results: list[CheckResult]) -> RankCheck:
    """One check over every repeat: flagged if any repeat is, with the first one's findings."""
    flagged = [k for k, (status, _, _) in enumerate(results) if status == FLAGGED]
    checked = [k for k, (status, _, _) in enumerate(results) if status == OK]
    pick = (flagged or checked or list(range(len(results))) or [None])[0]
    status, detail, findings = results[pick] if pick is not None else (NOT_CHECKED, "no traces", [])
    return RankCheck(key, title, status, detail, findings, flagged)


# -- small helpers -------------------------------------------------------------------------


def _distributed(trace: AnyTrace) -> dict[str, Any]:
    return trace.probe.get(PROBE_DISTRIBUTED) or {}


def _samplers(items: RankTraces) -> dict[int, dict[int, dict[str, Any]]] | None:
    """rank -> epoch -> sampler snapshot, or None unless every rank has one for every epoch."""
    out = {}
    for rank, trace in items:
        epochs = _distributed(trace).get("epochs") or []
        if not epochs or any(e.get("sampler") is None for e in epochs):
            return None
        out[rank] = {e["epoch"]: e["sampler"] for e in epochs}
    return out or None


def _step_of(trace: AnyTrace, epoch: int, index: int) -> int | None:
    return next((s.step for s in trace.steps if s.epoch == epoch and s.index == index), None)


def _rank_groups(ranks: list[int], prints: list[Any]) -> list[list[int]]:
    """Ranks grouped by equal print, groups in order of their lowest rank."""
    groups: dict[Any, list[int]] = {}
    for rank, print_ in zip(ranks, prints):
        groups.setdefault(print_, []).append(rank)
    return list(groups.values())


def _groups(groups: list[list[int]], shared_only: bool = False) -> str:
    """`0 and 1` for two single ranks; `0, 2 | 1` for groups of equal values."""
    if shared_only:
        return " | ".join(joined(g) for g in groups if len(g) > 1)
    if all(len(g) == 1 for g in groups):
        return joined([g[0] for g in groups])
    return " | ".join(", ".join(map(str, g)) for g in groups)


