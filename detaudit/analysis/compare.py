"""Aligns N traces by key and says where, when and why they first differ (the why in
words: see `causes`).

Records are paired by (step, phase, module, call, slot), never by position, so when one
repeat keeps more boxes after NMS the rest still pairs up and the fork is reported.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ..config import (
    AUGMENTATION_LIBRARIES,
    FIRST_SEED,
    LOADED_FROM_EARLIER_RUNS,
    MODELS,
    OP_SITES,
    SCRIPTED,
    SEEDED_AFTER_PARAMETERS,
    SHARED_PARAMETERS,
    SIDE_MODELS,
    TIED_PARAMETERS,
    TRAIN_LOADER_WORKERS,
    op_site_key,
)
from ..trace import (
    BACKWARD,
    FORWARD,
    GRAD,
    LEFT_BY_BACKWARD,
    LOADER_BATCH,
    MODEL_STATE,
    OP_BACKWARD,
    OP_FORWARD,
    OP_PHASES,
    OPTIMIZER,
    OUTPUT,
    OUTSIDE_MODEL,
    STATE,
    UNINITIALIZED_READ,
    AnyTrace,
    StepInfo,
    Trace,
    probe_value,
    state_name,
)
from .rnggap import RngGap, rng_gap
from .stress import StressedOp, stressed_ops

Key = tuple[int, str, str, int, str]  # step, phase, module, call, slot

ORIGIN, CONTAINS, PROPAGATED = "origin", "contains-origin", "propagated"
# the role of the first step a run never reached (cause: length): its records are missing
# there, not different
RUN_ENDED = "a run had ended"
GRADIENTS_DIFFER = "gradients differ"  # a scanned step's map cell: no module records there
DETERMINISTIC, DIVERGENT, FAILED = "deterministic", "divergent", "failed"
DETAIL_STEPS = 100  # divergent steps whose differing records are all kept and classified
# a zoomed trace's probe entry: the in-process replay of its step agreed, while the replays
# each in its own process parted (the audited runs ran each in its own process)
PER_PROCESS = "per_process"
class Continued(NamedTuple):
    """Repeat `repeat` began with the parameters repeat `earlier` had after its `step`
    (its `last`, or not)."""

    repeat: int
    earlier: int
    step: int
    last: bool


@dataclass
class RecordDiff:
    """One record whose fingerprint is not the same in every repeat."""

    step: int
    phase: str
    module: str
    call: int
    slot: str
    differing: int  # repeats (besides repeat 0) whose value differs or is missing
    missing: int  # repeats without this record at all
    repeats: int
    ref: dict[str, Any] = field(default_factory=dict)  # shape, dtype, norm, absmax of repeat 0
    other: dict[str, Any] = field(default_factory=dict)  # the same for the first differing repeat

    @property
    def key(self) -> Key:
        return (self.step, self.phase, self.module, self.call, self.slot)

    @property
    def rng_state(self) -> bool:
        """An RNG stream's state as a step begins."""
        return self.phase == STATE and self.slot.startswith("rng.")

    @property
    def where(self) -> str:
        """`module[call] slot`, with `(model)` for the root module."""
        name = self.module or "(model)"
        return f"{name}{f'[{self.call}]' if self.call else ''} {self.slot}"


@dataclass
class CallFinding:
    """A module call that differs in one phase of one step, and its role in the divergence."""

    step: int
    phase: str  # forward or backward
    module: str
    call: int
    role: str  # origin, contains-origin or propagated
    slots: list[str]
    differing: int
    repeats: int
    rng: bool = False  # the call's RNG draw differs


@dataclass
class LossDrift:
    """When the loss stops being bit-identical, and by how much it differs each step."""

    first_step: int | None
    first_epoch: int | None
    per_step: list[tuple[int, int, float]]  # (step, epoch, max relative difference)
    nonfinite: tuple[int, int, str] | None = None  # first (step, epoch, "nan"/"inf") of repeat 0
    finite_again: int | None = None  # the first step after it whose losses are all finite
    skipped: bool = False  # a GradScaler skipped that step's update, the last recorded

    def per_epoch(self) -> list[tuple[int, float]]:
        """(epoch, max relative loss difference in that epoch)."""
        out: dict[int, float] = {}
        for _, epoch, rel in self.per_step:
            out[epoch] = max(out.get(epoch, 0.0), rel)
        return sorted(out.items())


@dataclass
class Comparison:
    """What N repeats of one probe agree and disagree on."""

    repeats: int
    steps: list[tuple[int, int, int]]  # (step, epoch, index in epoch) of repeat 0
    total_records: int
    differing_records: int
    missing_records: int
    first_step: int | None
    first_by_phase: dict[str, RecordDiff]
    findings: list[CallFinding]  # every differing module call, all steps
    cause: str
    loss: LossDrift
    # the first step whose parameters, gradients or optimizer records (its state, learning
    # rates, a GradScaler's scale) differ
    param_drift_step: int | None
    fork: RecordDiff | None
    differing_by_step: dict[int, int]
    failures: dict[int, str]
    first_diffs: list[RecordDiff] = field(default_factory=list)  # first step, execution order
    common_steps: int | None = None  # with failures: only the steps every repeat completed
    stress: list[StressedOp] = field(default_factory=list)  # risky ops re-executed (proof)
    # the first step's RNG moved outside any module, where no call differing on its own
    # (drawing nothing) leads it
    rng_gap: RngGap | None = None
    # (step, owning module, parameter) of every parameter gradient that differs: what a
    # scanned step can say about where, before any zoom
    grad_diffs: list[tuple[int, str, str]] = field(default_factory=list)
    # RNG streams whose state differs between the repeats when nothing else does: seeded
    # differently (or not at all) but never drawn from in a way that changed the run
    idle_rng: list[str] = field(default_factory=list)
    # with more divergent steps than DETAIL_STEPS: how many were kept in detail (findings,
    # gradients that differ); the later ones are in differing_by_step only
    detailed_steps: int | None = None
    # with cause "init": the first repeat that began with exactly the parameters an earlier
    # one had after one of its steps (the model trained on, or restored from a checkpoint an
    # earlier run wrote, not built anew: a notebook cell re-run, a script that resumes)
    continued_from: Continued | None = None
    # with cause "init": where a run seeded torch's RNG after parameters were made, before
    # its first step ("file:line"), when one did
    seeded_late: str | None = None
    # exec: repeat -> the files it loaded with torch.load that an earlier run of the same
    # audit wrote (a checkpoint the script resumes from)
    loaded_earlier: dict[int, list[str]] = field(default_factory=dict)
    # each repeat's first seed given to torch before its first step, and where ([value,
    # "file:line"], or None where it gave none)
    first_seeds: list[list[Any] | None] = field(default_factory=list)
    # the training DataLoader's workers and their worker_init_fn (see TRAIN_LOADER_WORKERS)
    loader_workers: dict[str, Any] | None = None
    # what differs at param_drift_step: "parameters", or only their "gradients" (an update
    # that rounds a difference in them away); None where nothing does
    drifted: str | None = None
    # the model's parameters were in shared memory as the runs began (another process may
    # write them: Hogwild training in child processes)
    shared_parameters: bool = False
    # parameters held under more than one name (tied weights): the name records go under ->
    # the others
    tied: dict[str, list[str]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)  # each repeat's steps, by repeat
    # with cause "optimizer": each repeat's learning rates at the first divergent step, when
    # they differ (a schedule that depends on something that differs between the runs)
    lr_by_repeat: list[list[float | None]] | None = None
    # (step, epoch, index in epoch) of the steps only a longer repeat ran (runs that differ
    # in length), after repeat 0's `steps`
    later_steps: list[tuple[int, int, int]] = field(default_factory=list)
    # RNG streams (``torch``, ``numpy``...) that agreed as the first divergent step began,
    # as did everything else, and differ as the next one begins: that step drew a different
    # amount of randomness from them
    drawn: list[str] = field(default_factory=list)
    # the first divergent step holds a batch as the DataLoader yielded it (exec, watch)
    loader_batch: bool = False
    side_models: list[str] = field(default_factory=list)  # recorded, trained by no optimizer
    scripted: list[str] = field(default_factory=list)  # the model's TorchScript modules
    # the zoomed step parted only in replays each in its own process (see PER_PROCESS)
    per_process: str | None = None
    # the model's buffers (module.buffer) whose prints as built differ (see `as_built`)
    built_buffers: list[str] = field(default_factory=list)
    # the last step, where it holds backward passes that no update followed: the run ended
    # first (accumulation toward a batch it never reached)
    unapplied_step: int | None = None
    # the AUGMENTATION_LIBRARIES the first repeat imported, with their versions
    augmentation_libraries: dict[str, str] = field(default_factory=dict)

    @property
    def proven(self) -> list[StressedOp]:
        """The ops re-execution proved nondeterministic, whatever the repeats did."""
        return [s for s in self.stress if s.proven]

    @property
    def deterministic(self) -> bool:
        return self.first_step is None and not self.failures

    @property
    def verdict(self) -> str:
        """deterministic, divergent, or failed (a repeat did not finish and nothing differs
        before it stopped)."""
        if self.failures and self.first_step is None:
            return FAILED
        return DETERMINISTIC if self.deterministic else DIVERGENT

    @property
    def first_epoch(self) -> int | None:
        return self.epoch_of(self.first_step)

    def epoch_of(self, step: int | None) -> int | None:
        """The (0-based) epoch of a global step."""
        for s, epoch, _ in (*self.steps, *self.later_steps):
            if s == step:
                return epoch
        return None

    @property
    def origins(self) -> list[CallFinding]:
        """Origin calls of the first divergent step, forward before backward."""
        return [f for f in self.findings if f.step == self.first_step and f.role == ORIGIN]

    @property
    def unseeded_at_start(self) -> list[str]:
        """The RNGs whose state differs before the first step, where that is the cause
        (the model initialised from them, the first batch drawn from them, or nothing drawn
        yet): empty otherwise."""
        if (self.first_step != 0 or self.cause not in ("init", "rng", "data")
                or self.continued_from is not None):
            return []
        return sorted({d.slot.removeprefix("rng.") for d in self.first_diffs if d.rng_state})

class _Index:
    """One trace's records of one granularity: key -> (fp, row) and the execution order."""

    def __init__(self, trace: Trace, ops: bool = False, steps: int | None = None) -> None:
        r = trace.records
        self.trace = trace
        self.fp: dict[Key, str] = {}
        self.row: dict[Key, int] = {}
        self.order: list[Key] = []
        for i, key in enumerate(zip(r["step"], r["phase"], r["module"], r["call"], r["slot"])):
            if (key[1] in OP_PHASES) != ops or (steps is not None and key[0] >= steps):
                continue
            if key not in self.fp:
                self.order.append(key)
                self.row[key] = i
            self.fp[key] = r["fp"][i]

    def stats(self, key: Key) -> dict[str, Any]:
        i = self.row.get(key)
        if i is None:
            return {}
        r = self.trace.records
        stats = {c: r[c][i] for c in ("shape", "dtype", "norm", "absmax", "nonfinite")}
        signed = r.get("signed")
        if signed and signed[i] is not None:
            stats["signed"] = signed[i]
        return stats


def as_built(d: RecordDiff | Key) -> bool:
    """A buffer's print as step 0 begins: the buffer as the model was built. One that
    differs is no difference of the runs by itself (a scratch buffer torch.empty made holds
    other bytes in each process, and one never read changes nothing), only evidence where
    the model's forward then parts with no op to blame (a buffer drawn from the clock as
    the model was built: see `built_buffers`)."""
    step, phase, slot = (d[0], d[1], d[4]) if isinstance(d, tuple) else (d.step, d.phase, d.slot)
    return step == 0 and phase == STATE and slot.startswith("buffer.")


def fingerprints_before(trace: Trace, step: int) -> dict[Key, str]:
    """Key -> print of a trace's module-granularity records (no op level) before `step`,
    the buffers as built aside (see `as_built`)."""
    return {key: fp for key, fp in _Index(trace, steps=step).fp.items() if not as_built(key)}


def compare(traces: Iterable[AnyTrace], idle_rng: Iterable[str] = ()) -> Comparison:
    """Align the traces of N repeats and analyse their differences, a step at a time (a
    streamed trace is read one step at a time, so runs of any length compare in flat
    memory). Every differing record of the first DETAIL_STEPS divergent steps is kept and
    classified; later steps are counted. When a repeat stopped early (its trace names a
    failure), only the steps every repeat completed are compared: a crash is a failure,
    not a divergence. `idle_rng`: RNG streams a longer comparison of the same runs found
    never drawn from (a zoom's replays stop at the zoomed step, too soon to tell)."""
    traces = list(traces)
    if not traces:
        raise ValueError("compare() needs at least one trace")
    common = min(len(t.steps) for t in traces) if any(t.failure for t in traces) else None
    seen = _StepDiffs(len(traces), {f"rng.{stream}" for stream in idle_rng})
    for step, cuts in aligned_steps(traces, common):
        seen.add(step, cuts)
    comparison = seen.comparison(traces, common)
    comparison.first_seeds = [probe_value(t, FIRST_SEED) for t in traces]
    comparison.loader_workers = probe_value(traces[0], TRAIN_LOADER_WORKERS)
    comparison.shared_parameters = any(probe_value(t, SHARED_PARAMETERS) for t in traces)
    comparison.tied = probe_value(traces[0], TIED_PARAMETERS) or {}
    comparison.lengths = {t.repeat: len(t.steps) for t in traces}
    comparison.loaded_earlier = {n: files for n, t in enumerate(traces)
                                  if (files := probe_value(t, LOADED_FROM_EARLIER_RUNS))}
    if comparison.cause == "init":
        comparison.continued_from = _continued(traces)
        comparison.seeded_late = next((site for t in traces
                                       if (site := probe_value(t, SEEDED_AFTER_PARAMETERS))), None)
    if comparison.cause == "optimizer" and comparison.first_step is not None:
        comparison.lr_by_repeat = _learning_rates(traces, comparison.first_step)
    return comparison


def _learning_rates(traces: list[AnyTrace], step: int) -> list[list[float | None]] | None:
    """Each trace's learning rates at `step` (as its steps list them), if they differ."""
    rates = [next((i.lr for i in t.steps if i.step == step), []) for t in traces]
    return rates if any(r != rates[0] for r in rates) else None


def _continued(traces: list[AnyTrace]) -> Continued | None:
    """The first repeat whose parameters before its first step are those an earlier repeat
    had after one of its steps, the latest such step (more passes over the traces, in the
    rare case of cause "init")."""
    for n in range(1, len(traces)):
        began = _initial_parameters(traces[n])
        for m in range(n):
            found = _last_step_with(traces[m], began) if began else None
            if found is not None:
                return Continued(n, m, *found)
    return None


def _parameter_records(cut: Trace) -> Iterator[tuple[str, tuple[str, str], str]]:
    r = cut.records
    for phase, module, slot, fp in zip(r["phase"], r["module"], r["slot"], r["fp"]):
        if slot.startswith("param.") and phase in (STATE, OPTIMIZER):
            yield phase, (module, slot), fp


def _initial_parameters(trace: AnyTrace) -> dict[tuple[str, str], str]:
    """A trace's parameter prints before its first step."""
    for _, cut in trace.by_step():
        return {key: fp for phase, key, fp in _parameter_records(cut) if phase == STATE}
    return {}


def _last_step_with(trace: AnyTrace, wanted: dict[tuple[str, str], str]
                    ) -> tuple[int, bool] | None:
    """The last step after which `trace`'s parameters (its initial ones, as each update
    left them) are exactly `wanted`, and whether it is the trace's last step."""
    current: dict[tuple[str, str], str] = {}
    found = step = None
    for step, cut in trace.by_step():
        updated = False
        for phase, key, fp in _parameter_records(cut):
            if phase == STATE:
                current[key] = fp  # (set between steps: a state record of a later step)
            else:
                current[key], updated = fp, True
        if updated and all(current.get(key) == fp for key, fp in wanted.items()):
            found = step
    return None if found is None else (found, found == step)


def aligned_steps(traces: list[AnyTrace], common: int | None
                   ) -> Iterator[tuple[int, list[Trace]]]:
    """(step, each trace cut to that step), in step order; a trace without the step gives
    an empty cut. Steps from `common` on are left out."""
    streams = [t.by_step() for t in traces]
    heads = [next(s, None) for s in streams]
    while any(heads):
        step = min(h[0] for h in heads if h)
        if common is not None and step >= common:
            return
        cuts = []
        for i, head in enumerate(heads):
            if head and head[0] == step:
                cuts.append(head[1])
                heads[i] = next(streams[i], None)
            else:
                cuts.append(Trace(probe={}, repeat=traces[i].repeat, env={}))
        yield step, cuts


class _StepDiffs:
    """What the steps compared so far differ in: every differing record of the first
    DETAIL_STEPS divergent steps, and counts beyond them.

    RNG state records are held apart until the end: a stream that differs between repeats
    but that nothing drew from is no divergence (see :meth:`_never_drawn`), which only all
    the steps can tell. Of those, the first step each stream differs in is kept whole.
    """

    def __init__(self, repeats: int, idle: set[str] | None = None) -> None:
        self.n = repeats
        self.known_idle = idle or set()  # RNG state slots known never drawn from
        self.first_step: int | None = None  # the first step compared
        self.kept: list[RecordDiff] = []  # execution order
        self.findings: list[CallFinding] = []
        self.total = 0
        self.counts: dict[int, int] = {}  # step -> differing records, RNG states aside
        self.missing = 0  # the same, missing in some repeat
        self.rng: dict[int, set[str]] = {}  # step -> RNG state slots that differ
        self.rng_missing: dict[int, set[str]] = {}
        self.rng_first: dict[str, int] = {}  # slot -> first step it differs in
        self.rng_valued: set[str] = set()  # slots whose recorded states differ (not only missing)
        # the first record missing somewhere, RNG states aside (and per RNG stream), ranked
        # as the records come: repeat 0's in their order, then those only other repeats have
        self.fork: tuple[tuple[int, int, int], RecordDiff] | None = None
        self.rng_forks: dict[str, tuple[tuple[int, int, int], RecordDiff]] = {}
        self.param_drift: int | None = None
        self.drifted: str | None = None  # what differs first at param_drift (see Comparison)
        self.detailed = 0  # divergent steps kept in detail
        self.more = False  # divergent steps beyond them
        self.first_cut: tuple[int, Trace, set[Key]] | None = None  # for the RNG gap
        self.previous: dict[tuple[int, str, str, int], list[RecordDiff]] = {}
        self.rng_states: list[dict[str, tuple[str, bool]]] = [{} for _ in range(repeats)]
        self.rng_steps = [0] * repeats  # steps with RNG states, per repeat
        self.built: list[RecordDiff] = []  # the buffers as built that differ (see as_built)

    def add(self, step: int, cuts: list[Trace]) -> None:
        """Compare one step's records across the repeats."""
        if self.first_step is None:
            self.first_step = step
        self._note_rng_states(cuts)
        indexes = [_Index(c) for c in cuts]
        ref, others = indexes[0], indexes[1:]
        keys, origin = list(ref.order), [0] * len(ref.order)  # origin: whose record it is
        known = set(ref.fp)
        for i, idx in enumerate(others, 1):
            for key in idx.order:
                if key not in known:
                    known.add(key)
                    keys.append(key)
                    origin.append(i)
        self.total += len(keys)
        stats = self.detailed < DETAIL_STEPS  # past the window, counts (and forks) only
        found = [(o, j, d) for j, (o, key) in enumerate(zip(origin, keys))
                 if (d := self._diff(key, ref, others, stats))]
        if step == 0:  # the buffers as built: evidence, never a difference (see as_built)
            self.built += [d for _, _, d in found if as_built(d) and not d.missing]
            found = [(o, j, d) for o, j, d in found if not as_built(d)]
        diffs = [d for _, _, d in found]
        run_by_all = all(len(cut) for cut in cuts)  # (else: runs of other lengths, no fork)
        for o, j, d in found:
            # (a parameter or buffer is recorded as a later step begins only where it was
            # changed: missing there is a value that differs, not a fork)
            if d.missing and run_by_all and not (step > 0 and d.phase == STATE
                                                 and d.slot.startswith(MODEL_STATE)):
                self._note_fork((o, step, j), d)
        rng = [d for d in diffs if d.rng_state]
        rest = [d for d in diffs if not d.rng_state]
        for d in rng:
            self.rng.setdefault(step, set()).add(d.slot)
            if d.missing:
                self.rng_missing.setdefault(step, set()).add(d.slot)
            if len({idx.fp[d.key] for idx in indexes if d.key in idx.fp}) > 1:
                self.rng_valued.add(d.slot)
        if rest:
            self.counts[step] = len(rest)
            self.missing += sum(1 for d in rest if d.missing)
            # in the step's order: the parameters it began with, its gradients, the update
            began = any(d.phase == STATE and d.slot.startswith("param.") for d in rest)
            # (as the update took them: one only backward left differing, clipping erased)
            gradients = any(d.phase == GRAD and d.slot.startswith("param.") for d in rest)
            if (began or gradients or any(d.phase == OPTIMIZER for d in rest)) and (
                    self.param_drift is None):
                self.param_drift = step
                self.drifted = "gradients" if gradients and not began else "parameters"
        detail = bool(rest) and self.detailed < DETAIL_STEPS
        if rest and not detail:
            self.more = True
        for d in diffs:
            if not d.rng_state:
                if detail:
                    self.kept.append(d)
            elif d.slot not in self.rng_first or detail:
                self.kept.append(d)
        for d in rng:
            self.rng_first.setdefault(d.slot, step)
        if not detail:
            self.previous = {}
            return
        self.detailed += 1
        if self.first_cut is None:
            self.first_cut = (step, cuts[0], {d.key for d in diffs})
        slots: dict[tuple[int, str, str, int], list[RecordDiff]] = defaultdict(list)
        for d in rest:
            slots[(d.step, d.phase, d.module, d.call)].append(d)
        self.findings += _step_findings(cuts[0], step, {**self.previous, **slots}, self.n)
        self.previous = slots

    def _note_fork(self, rank: tuple[int, int, int], d: RecordDiff) -> None:
        if d.rng_state:
            best = self.rng_forks.get(d.slot)
            if best is None or rank < best[0]:
                self.rng_forks[d.slot] = (rank, d)
        elif self.fork is None or rank < self.fork[0]:
            self.fork = (rank, d)

    def _diff(self, key: Key, ref: _Index, others: list[_Index], stats: bool) -> RecordDiff | None:
        """The record's difference across the repeats (None: the same in all), with the stats
        of repeat 0 and of the first that differs if `stats` or it is missing somewhere."""
        ref_fp = ref.fp.get(key)
        differing = missing = 0
        first_other = None
        for idx in others:
            fp = idx.fp.get(key)
            if fp is None:
                missing += 1
            if fp != ref_fp:
                differing += 1
                first_other = first_other or idx
        if ref_fp is None:
            missing += 1
        if not differing:
            return None
        if not (stats or missing):
            return RecordDiff(*key, differing=differing, missing=missing, repeats=self.n)
        return RecordDiff(*key, differing=differing, missing=missing, repeats=self.n,
                          ref=ref.stats(key), other=first_other.stats(key) if first_other else {})

    def _note_rng_states(self, cuts: list[Trace]) -> None:
        """Per repeat and stream: its first state, and whether it ever moved."""
        for i, (states, cut) in enumerate(zip(self.rng_states, cuts)):
            r = cut.records
            seen = False
            for phase, module, slot, fp in zip(r["phase"], r["module"], r["slot"], r["fp"]):
                if phase == STATE and not module and slot.startswith("rng."):
                    first, moved = states.get(slot, (fp, False))
                    states[slot] = (first, moved or fp != first)
                    seen = True
            self.rng_steps[i] += seen

    def _never_drawn(self) -> set[str]:
        """The RNG state slots (``rng.<stream>``) whose state is the same at the start of
        every step of every repeat, over two steps or more: nothing in the process drew
        from them."""
        if any(steps < 2 for steps in self.rng_steps):
            return set()
        slots = set().union(*self.rng_states)
        return {slot for slot in slots
                if all(slot in states and not states[slot][1] for states in self.rng_states)}

    def comparison(self, traces: list[AnyTrace], common: int | None) -> Comparison:
        """The comparison of every step added."""
        # RNG streams whose state differs but that nothing drew from: the runs agree on
        # them. Known when a stream's state never moved over the steps of any repeat, or
        # when the RNG states are all that differs. When the parameters or the batch already
        # differ at the first step, the streams that differ there may have been drawn before
        # it (the initialisation, the data order): never idle then.
        idle = set(self.rng_first) & self._never_drawn()
        if any(d.step == self.first_step and d.phase == STATE
               and d.slot.startswith(("param.", "batch")) for d in self.kept):
            idle -= {slot for slot, step in self.rng_first.items() if step == self.first_step}
        if not self.counts:
            idle |= set(self.rng_first)
        idle |= self.known_idle & set(self.rng_first)
        by_step = dict(self.counts)
        for step, slots in self.rng.items():
            if slots - idle:
                by_step[step] = by_step.get(step, 0) + len(slots - idle)
        kept = [d for d in self.kept if not (d.rng_state and d.slot in idle)]
        first_step = min(by_step) if by_step else None
        first_diffs = [d for d in kept if d.step == first_step]
        first_by_phase: dict[str, RecordDiff] = {}
        for d in first_diffs:
            first_by_phase.setdefault(d.phase, d)
        forks = [fork for slot, fork in self.rng_forks.items() if slot not in idle]
        if self.fork:
            forks.append(self.fork)
        drawn = self._drawn_during(first_step, first_diffs, traces[0].steps[:common], idle)
        # (the views of traces that diff compares have no probe of their own)
        per_process = probe_value(traces[0], PER_PROCESS)
        per_process = per_process if isinstance(per_process, str) else None
        gap = None
        loader_batch = False
        if self.first_cut is not None and self.first_cut[0] == first_step:
            step, cut, keys = self.first_cut
            gap = rng_gap(cut, {k for k in keys if not (k[1] == STATE and k[4] in idle)}, step)
            loader_batch = any(s.startswith(LOADER_BATCH) for s in cut.records["slot"])
        order = {FORWARD: 0, BACKWARD: 1}
        findings = sorted(self.findings, key=lambda f: (f.step, order[f.phase], f.role != ORIGIN))
        if gap is not None and any(f.step == first_step and f.role == ORIGIN
                                   and f.phase == FORWARD and not f.rng for f in findings):
            gap = None  # a call differing on equal inputs, drawing nothing, leads: what the
            # RNG then draws outside any module follows from what it computed (a count)
        env = getattr(traces[0], "env", None) or {}
        return Comparison(
            repeats=self.n,
            steps=[(s.step, s.epoch, s.index) for s in traces[0].steps[:common]],
            later_steps=[] if common is not None else [
                (s.step, s.epoch, s.index)
                for s in max((t.steps for t in traces), key=len)[len(traces[0].steps):]],
            total_records=self.total,
            differing_records=sum(by_step.values()),
            missing_records=self.missing + sum(
                len(slots - idle) for slots in self.rng_missing.values()),
            first_step=first_step,
            first_by_phase=first_by_phase,
            findings=findings,
            cause=_cause(first_diffs, findings, first_step, gap, ended=common is None and any(
                len(t.steps) <= (first_step or 0) for t in traces), drawn=bool(drawn),
                per_process=bool(per_process)),
            loss=_loss_drift(traces, common),
            param_drift_step=self.param_drift,
            drifted=self.drifted,
            fork=min(forks, key=lambda fork: fork[0])[1] if forks else None,
            differing_by_step=dict(sorted(by_step.items())),
            failures={t.repeat: t.failure for t in traces if t.failure},
            first_diffs=first_diffs,
            common_steps=common,
            stress=stressed_ops(traces),
            rng_gap=gap,
            grad_diffs=[(d.step, d.module, d.slot.removeprefix("param.")) for d in kept
                        if d.phase == GRAD and d.slot.startswith("param.")],
            # a stream only missing where a run ended (runs of different lengths) is no
            # state that differs
            idle_rng=sorted(slot.removeprefix("rng.") for slot in idle & self.rng_valued),
            detailed_steps=self.detailed if self.more else None,
            drawn=drawn,
            per_process=per_process,
            loader_batch=loader_batch,
            side_models=list(probe_value(traces[0], SIDE_MODELS) or []),
            scripted=list(probe_value(traces[0], SCRIPTED) or []),
            built_buffers=sorted({state_name(d.module, d.slot) for d in self.built}),
            unapplied_step=_unapplied(traces[0].steps),
            augmentation_libraries={name: str(env[name]) for name in AUGMENTATION_LIBRARIES
                                    if name in env},
        )

    def _drawn_during(
        self, step: int | None, first_diffs: list[RecordDiff], steps: list[StepInfo],
        idle: set[str],
    ) -> list[str]:
        """The RNG streams `step` drew a different amount from: they differ first as the
        step after it begins, while nothing differed as it began."""
        if step is None or any(d.phase == STATE for d in first_diffs):
            return []
        following = next((s.step for s in steps if s.step > step), None)
        return sorted(slot.removeprefix("rng.") for slot, first in self.rng_first.items()
                      if first == following and slot not in idle)


_Pending = tuple[str, str, int, list[RecordDiff], bool]  # phase, module, call, diffs, propagated


def _step_findings(
    ref: Trace, step: int, slots: dict[tuple[int, str, str, int], list[RecordDiff]], n: int
) -> list[CallFinding]:
    """Classify every differing module call of `step` as origin, contains-origin or
    propagated. `ref` is repeat 0 cut to the step; `slots` holds the step's differing
    records by call, and the step before's (whose parameter updates the step starts from)."""
    return _StepCalls(ref, step, slots).findings(n)


class _StepCalls:
    """The differing module calls of one step, and what tells an origin from a call that
    only passes a difference on: the step's call tree, the parameters entering the step
    that differ, and the order its records were made in."""

    def __init__(self, ref: Trace, step: int,
                 slots: dict[tuple[int, str, str, int], list[RecordDiff]]) -> None:
        self.ref, self.step, self.slots = ref, step, slots
        self.calls = _call_parents(ref).get(step, {})
        # the modules whose parameters entering the step differ, and those a recorded call
        # runs inside of
        self.changed = {m for (at, p, m, _), ds in slots.items()
                        if (at, p) in ((step, STATE), (step - 1, OPTIMIZER))
                        and any(d.slot.startswith("param.") for d in ds)}
        self.holding_calls = {".".join(m.split(".")[:k]) for m, _ in self.calls if m
                              for k in range(m.count(".") + 1)}
        self.position, self.carried = _evaluations(ref, step, slots)
        self.forward_calls = [(m, c) for (s, p, m, c) in slots if s == step and p == FORWARD]
        # the modules whose gradients as backward left them were recorded, and differ
        self.left_by_backward = {key[1] for key in self.position
                                 if key[0] == GRAD and key[3].startswith(LEFT_BY_BACKWARD)}
        self.left_differing = {m for (at, p, m, _), ds in slots.items() if at == step
                               and p == GRAD and any(d.slot.startswith(LEFT_BY_BACKWARD)
                                                     for d in ds)}

    def differs(self, phase: str, module: str, call: int, prefix: str) -> bool:
        return any(d.slot.startswith(prefix)
                   for d in self.slots.get((self.step, phase, module, call), ()))

    def params_differ(self, module: str) -> bool:
        """The parameters entering the step differ: the module's own, or, where no call
        inside it was recorded (a model called apart, recorded by its calls alone), those
        of any module inside it."""
        inside = f"{module}." if module else ""
        return module in self.changed or module not in self.holding_calls and any(
            m.startswith(inside) for m in self.changed)

    def rescaled_after_backward(self, module: str) -> bool:
        """The module's gradients as backward left them were recorded in the step and
        agree: a difference in those the update took was made after backward, by the
        loop's own code over every gradient (clipping by a norm that other gradients made
        differ; unscaling)."""
        return module in self.left_by_backward and module not in self.left_differing

    def first_position(self, phase: str, module: str, call: int) -> int:
        return min((self.position.get((phase, module, call, d.slot), -1)
                    for d in self.slots.get((self.step, phase, module, call), ())), default=-1)

    def after_carried(self, phase: str, module: str, call: int) -> bool:
        """Run after a differing gradient an optimizer's in-step update took (see
        _evaluations): on parameters that update changed."""
        return self.carried is not None and self.first_position(phase, module, call) > self.carried

    def findings(self, n: int) -> list[CallFinding]:
        candidates: dict[str, list[tuple[str, int]]] = {FORWARD: [], BACKWARD: []}
        pending = self._calls(candidates)
        # A scanned step has no forward records, and its parameter gradients alone cannot
        # say which module a backward difference started in.
        if FORWARD in self.ref.records["phase"]:
            pending += self._gradients(candidates)
        made = self._made_by_own_code(pending)
        made_backward = self._made_by_own_backward(pending)
        pending += made + made_backward
        candidates[FORWARD] += [(module, call) for _, module, call, _, _ in made]
        candidates[BACKWARD] += [(module, call) for _, module, call, _, _ in made_backward]
        findings = []
        for phase, module, call, ds, propagated in pending:
            if propagated:
                role = PROPAGATED
            else:
                inner = [c for c in candidates[phase]
                         if c != (module, call) and _is_ancestor((module, call), c, self.calls)]
                role = CONTAINS if inner else ORIGIN
            findings.append(CallFinding(
                self.step, phase, module, call, role, sorted(d.slot for d in ds),
                max(d.differing for d in ds), n, rng=any(d.slot == "rng.out" for d in ds)))
        return findings

    def _calls(self, candidates: dict[str, list[tuple[str, int]]]) -> list[_Pending]:
        """Every differing forward and backward call, propagated where what it began from
        differs (its inputs, parameters or RNG state; in backward, its output gradient or
        its forward); the others are candidates for origin."""
        pending: list[_Pending] = []
        for (s, phase, module, call), ds in self.slots.items():
            if s != self.step or phase not in (FORWARD, BACKWARD):
                continue
            forward_in = (
                self.differs(FORWARD, module, call, "in")
                or self.differs(FORWARD, module, call, "rng.in")
                or self.params_differ(module) or self.after_carried(phase, module, call)
            )
            if phase == FORWARD:
                propagated = forward_in
            else:
                # its forward changed, in its own records or in a call inside it (whose
                # saved activations its backward reuses, even where its outputs agree)
                forward_changed = bool(self.slots.get((self.step, FORWARD, module, call))) or any(
                    _is_ancestor((module, call), inner, self.calls) for inner in self.forward_calls)
                propagated = (self.differs(BACKWARD, module, call, "grad_out") or forward_changed
                              or self.after_carried(phase, module, call))
            pending.append((phase, module, call, ds, propagated))
            if not propagated:
                candidates[phase].append((module, call))
        return pending

    def _gradients(self, candidates: dict[str, list[tuple[str, int]]]) -> list[_Pending]:
        """Backward: a module whose own parameter gradients differ, with nothing upstream.
        They sum over every call of the module in the step (a head shared by FPN levels), so
        any call's changed forward or output gradient is upstream of them. A module never
        called has its gradients made in the calls that read its weight: the call of the
        nearest module that ran around it (attention reads its `out_proj` so), and any call
        that took its parameter as an input (DETR's decoder is passed `query_embed.weight`).
        They are upstream where such a call's backward or forward differs. (Where no call
        but the model's own did, nothing tells its own difference from one that reached it,
        so it stays an origin.) Gradients that backward left equal and the update took
        differing were rescaled after backward by the loop's code (clipping by a norm that
        other gradients made differ): upstream too."""
        step, slots = self.step, self.slots
        called = {m for m, _ in self.calls} | {m for (at, p, m, _) in slots if at == step
                                               and p in (FORWARD, BACKWARD)}
        grads_only = {(m, c) for (at, p, m, c) in slots
                      if at == step and p == GRAD and m not in called}
        readers: dict[str, set[tuple[str, int]]] = defaultdict(set)  # module -> calls taking its weight
        table = self.ref.calls
        for at, module, index, reads in zip(table["step"], table["module"], table["index"],
                                            table.get("reads", ())):
            for read in reads if at == step and module else ():  # (not the model's own call)
                readers[read].add((module, index))
        pending: list[_Pending] = []
        for (s, phase, module, call), ds in slots.items():
            ds = [d for d in ds if not d.slot.startswith(LEFT_BY_BACKWARD)]  # (see below)
            if s != step or phase != GRAD or not ds:
                continue
            mine = self.first_position(GRAD, module, call)
            upstream = self.params_differ(module) or self.after_carried(GRAD, module, call) or (
                self.rescaled_after_backward(module)) or any(
                (p == FORWARD or self.differs(BACKWARD, module, c, "grad_out"))
                and (self.carried is None or self.first_position(p, m, c) < mine)
                for (at, p, m, c) in slots if at == step and m == module
            )
            if (module, call) in grads_only and not upstream:
                around = _nearest_called(module, called)
                # its model ran in no call of the step: the graph its gradient came through
                # was built in an earlier one (a GAN's generator update through the fakes its
                # discriminator step made), reached from this step's calls
                apart = _model_of(module, self.ref.probe.get(MODELS, [""])) not in called
                upstream = any(
                    at == step and p in (FORWARD, BACKWARD)
                    and (apart or m == around or (m, c) in readers[module])
                    and (self.carried is None or self.first_position(p, m, c) < mine)
                    for (at, p, m, c) in slots)
            if not upstream and (module, call) not in candidates[BACKWARD]:
                candidates[BACKWARD].append((module, call))
                pending.append((BACKWARD, module, call, ds, False))
        return pending

    def _made_by_own_code(self, pending: list[_Pending]) -> list[_Pending]:
        """The calls whose own code made a differing input of a call inside them: a call's
        input differs while the call around it began alike (its inputs and parameters) and
        no call inside that one before it gave a differing output. The difference was made
        between its children (an op called as a function, such as ``torch.relu`` or
        ``roi_align``; a TorchScript module, which takes no hooks), even where it then
        vanished in rounding (it was taken for the loop's data)."""
        calls = self.calls
        order = {key: i for i, key in enumerate(calls)}
        seen = {(module, call) for phase, module, call, _, _ in pending if phase == FORWARD}
        differing_out = [(m, c) for phase, m, c, _, _ in pending
                         if phase == FORWARD and self.differs(FORWARD, m, c, "out")]
        made: dict[tuple[str, int], list[RecordDiff]] = {}
        for phase, module, call, ds, propagated in pending:
            parent = calls.get((module, call))
            if (phase != FORWARD or not propagated or parent is None or parent in seen
                    or not self.differs(FORWARD, module, call, "in")):
                continue
            began_apart = (self.differs(FORWARD, *parent, "in")
                           or self.differs(FORWARD, *parent, "rng.in")
                           or self.params_differ(parent[0]))
            before = order.get((module, call), -1)
            sibling = any(_is_ancestor(parent, inner, calls) and order.get(inner, -1) < before
                          for inner in differing_out)
            if not began_apart and not sibling:
                made.setdefault(parent, []).extend(replace(d, slot=f"{d.slot} of {module}")
                                                   for d in ds if d.slot.startswith("in"))
        return [(FORWARD, module, call, ds, False) for (module, call), ds in made.items()]

    def _made_by_own_backward(self, pending: list[_Pending]) -> list[_Pending]:
        """The calls whose own code's backward made a differing output gradient of a call
        inside them: a call's output gradient differs while the call around it got an equal
        one, ran the same forward (its records and those of every call inside it), and no
        call inside it that ran later in forward (earlier in backward) has a differing
        gradient. The backward of an op it calls between its children (an index or scatter,
        as a graph layer's aggregation) made it; no module record is that op's own."""
        calls = self.calls
        order = {key: i for i, key in enumerate(calls)}
        backward = [(m, c) for phase, m, c, _, _ in pending if phase == BACKWARD]
        made: dict[tuple[str, int], list[RecordDiff]] = {}
        for phase, module, call, ds, propagated in pending:
            parent = calls.get((module, call))
            if (phase != BACKWARD or not propagated or parent is None
                    or not self.differs(BACKWARD, module, call, "grad_out")
                    or self.differs(BACKWARD, *parent, "grad_out")
                    or any(inner == parent or _is_ancestor(parent, inner, calls)
                           for inner in self.forward_calls)):
                continue
            before = order.get((module, call), -1)
            if not any(_is_ancestor(parent, inner, calls) and order.get(inner, -1) > before
                       for inner in backward):
                made.setdefault(parent, []).extend(
                    replace(d, slot=f"{d.slot} of {module}") for d in ds
                    if d.slot.startswith("grad_out"))
        return [(BACKWARD, module, call, ds, False) for (module, call), ds in made.items()]


def _evaluations(ref: Trace, step: int,
                 slots: dict[tuple[int, str, str, int], list[RecordDiff]]
                 ) -> tuple[dict[tuple[str, str, int, str], int], int | None]:
    """An optimizer that evaluates several times in one step (LBFGS's closure: gradient
    records under evaluations 0, 1, ...) updates the parameters between evaluations: what
    runs after a differing gradient of an evaluation another follows runs on parameters it
    changed. The step's records' positions in the order they were made, and the position of
    that first differing gradient (None where there is none)."""
    r = ref.records
    position: dict[tuple[str, str, int, str], int] = {}
    last_evaluation = 0
    for i, key in enumerate(zip(r["phase"], r["module"], r["call"], r["slot"])):
        position.setdefault(key, i)
        if key[0] == GRAD and not key[3].startswith(LEFT_BY_BACKWARD):
            last_evaluation = max(last_evaluation, key[2])
    if not last_evaluation:
        return position, None
    carried = [position.get((GRAD, module, call, d.slot), -1)
               for (at, phase, module, call), ds in slots.items()
               if at == step and phase == GRAD and call < last_evaluation for d in ds
               if not d.slot.startswith(LEFT_BY_BACKWARD)]
    return position, min((p for p in carried if p >= 0), default=None)


def _unapplied(steps: list[StepInfo]) -> int | None:
    """The last of `steps` where the run ended after its backward passes, before an update
    (not one a GradScaler skipped) in a run that updated before: None where it did not."""
    if len(steps) < 2 or not any(s.optimizer_stepped for s in steps[:-1]):
        return None
    last = steps[-1]
    return last.step if not last.optimizer_stepped and last.scale is None and last.losses else None


def _model_of(module: str, models: list[str]) -> str:
    """The name of the recorded model `module` belongs to (see MODELS)."""
    return max((m for m in models if not m or module == m or module.startswith(m + ".")),
               key=len, default="")


def _nearest_called(module: str, called: set[str]) -> str | None:
    """The innermost module around `module`, by name, that ran in the step, the model
    itself not counted (None where only it did)."""
    while module:
        module = module.rpartition(".")[0]
        if module and module in called:
            return module
    return None


def _call_parents(trace: Trace) -> dict[int, dict[tuple[str, int], tuple[str, int] | None]]:
    """Per step: (module, call) -> its enclosing (module, call)."""
    c = trace.calls
    out: dict[int, dict[tuple[str, int], tuple[str, int] | None]] = defaultdict(dict)
    per_step: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for step, module, index, parent in zip(c["step"], c["module"], c["index"], c["parent"]):
        calls = per_step[step]
        calls.append((module, index))
        out[step][(module, index)] = calls[parent] if parent >= 0 else None
    return out


def _is_ancestor(
    ancestor: tuple[str, int], call: tuple[str, int], parents: dict[tuple[str, int], Any]
) -> bool:
    if not parents:  # no call tree recorded: fall back to module paths
        return call[0].startswith(ancestor[0] + ".") or (ancestor[0] == "" and call[0] != "")
    node = parents.get(call)
    while node is not None:
        if node == ancestor:
            return True
        node = parents.get(node)
    return False


def _cause(
    first: list[RecordDiff], findings: list[CallFinding], step: int | None,
    gap: RngGap | None = None, ended: bool = False, drawn: bool = False,
    per_process: bool = False,
) -> str:
    """The class of cause, from the first records to differ in the first divergent step
    (and the RNG moving outside any module in it, `gap`). `ended`: a run ended, none
    failing, before that step: its records there are missing, not different. `drawn`: the
    step drew a different amount of randomness (seen as the next step begins).
    `per_process`: the step parted only in replays each in its own process."""
    if step is None:
        return "none"
    if ended:
        return "length"
    if per_process:
        return "process"
    state = [d for d in first if d.phase == STATE]
    if step == 0 and any(d.slot.startswith(MODEL_STATE) for d in state):
        return "init"  # before anything ran: the other differences follow from the same cause
    if any(d.slot.startswith("batch") for d in state):
        return "data"
    if any(d.slot.startswith("rng.") for d in state):
        return "rng"
    if any(d.slot.startswith(MODEL_STATE) for d in state):
        return "params"
    if gap is not None:
        return "rng"
    origins = [f for f in findings if f.step == step and f.role == ORIGIN]
    forward = [f for f in origins if f.phase == FORWARD]
    if forward:
        return "rng" if forward[0].rng else "forward"
    if first and first[0].phase == FORWARD and first[0].slot.startswith("in."):
        return "data"  # a call's input, first to differ: made outside what is recorded
    if drawn and not origins:  # no module call to blame: the draw is the first difference
        return "rng"
    if first and first[0].phase in (BACKWARD, GRAD) and any(
            f.phase == BACKWARD for f in origins):
        return "backward"  # (before the forward of an optimizer's next evaluation: LBFGS)
    # A loss that differs is a forward difference (in a scanned step the loss is the only
    # forward record); gradients alone are backward; parameters alone, the optimizer.
    if any(d.phase in (FORWARD, OUTPUT) for d in first):
        return "forward"
    if any(f.phase == BACKWARD for f in origins) or any(d.phase in (BACKWARD, GRAD) for d in first):
        return "backward"
    if any(d.phase == OPTIMIZER for d in first):
        return "optimizer"
    return "none"


def _loss_drift(traces: list[Trace], common: int | None = None) -> LossDrift:
    """First step where any loss term differs bitwise, and the relative difference per step,
    over the steps every repeat ran (one that only some ran is no step alike)."""
    ref = traces[0]
    first_step = first_epoch = None
    nonfinite = finite_again = None
    per_step = []
    ran = min(len(t.steps) for t in traces)
    for i, info in enumerate(ref.steps[:common]):
        values = info.loss_values()
        bad = next((v for v in values.values() if not math.isfinite(v)), None)
        if bad is not None and nonfinite is None:
            nonfinite = (info.step, info.epoch, "nan" if math.isnan(bad) else "inf")
        elif bad is None and values and nonfinite is not None and finite_again is None:
            finite_again = info.step  # (a step a GradScaler skipped, one bad batch)
        if i >= ran:  # (repeat 0's own steps: non-finite losses are said, not compared)
            continue
        rel = 0.0
        bitwise_differs = False
        for other in traces[1:]:
            theirs = other.steps[i].loss_values()
            for name in set(values) | set(theirs):
                a, b = values.get(name), theirs.get(name)
                if a is None or b is None or info.losses.get(name) != other.steps[i].losses.get(name):
                    bitwise_differs = True
                    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
                        rel = float("inf")  # (NaN against NaN with other bits too)
                    else:
                        rel = max(rel, abs(a - b) / max(abs(a), abs(b), 1e-30))
        if bitwise_differs and first_step is None:
            first_step, first_epoch = info.step, info.epoch
        if values:
            per_step.append((info.step, info.epoch, rel))
    # a GradScaler skipped the update of the step the loss stopped being finite at, the last
    # recorded (nothing after it says more; a loss still not finite later is no skipped step's)
    last = ref.steps[:common][-1] if ref.steps[:common] else None
    skipped = (nonfinite is not None and last is not None and nonfinite[0] == last.step
               and not last.optimizer_stepped and last.scale is not None)
    return LossDrift(first_step, first_epoch, per_step, nonfinite, finite_again, skipped)


@dataclass
class OpFinding:
    """One op call of one step whose outputs differ across repeats."""

    step: int
    phase: str  # forward or backward
    module: str  # the module call it ran in (backward ops: whose forward created the node)
    call: int
    index: int  # its position among that module call's ops
    op: str
    role: str  # origin (inputs equal, outputs differ) or propagated
    differing: int
    repeats: int
    slots: list[str]  # the output slots that differ
    other_repeat: int  # the first repeat whose outputs differ from repeat 0's
    ref: dict[str, Any] = field(default_factory=dict)  # stats of the first differing output
    site: str = ""  # outside the model: where the user's code ran it, or its forward op ("file:line")
    # it read memory an uninitialized op (torch.empty) made that nothing wrote since: what
    # that memory held, which differs between runs, is an input it was not recorded with
    uninitialized: bool = False

    @property
    def key(self) -> tuple[int, str, str, int, str]:
        """(step, op phase, module, call, slot prefix) -- what a capture replay looks for."""
        phase = OP_FORWARD if self.phase == FORWARD else OP_BACKWARD
        return (self.step, phase, self.module, self.call, f"op{self.index}/{self.op}")


_RANDOM_OPS = ("rand", "normal", "bernoulli", "multinomial", "poisson", "uniform", "dropout",
               "exponential", "geometric", "cauchy", "rrelu")


def draws_random_numbers(op: str) -> bool:
    """Whether an op (``aten.rand_like``, ``aten.bernoulli_``, ...) draws from a generator,
    whose state is an input its recorded tensor inputs leave out."""
    return any(word in op for word in _RANDOM_OPS)


def compare_ops(traces: Iterable[Trace]) -> list[OpFinding]:
    """Every op whose outputs differ across the traces' op-level records, in execution
    order of repeat 0: `origin` when all its inputs agree, else `propagated`."""
    traces = list(traces)
    indexes = [_Index(t, ops=True) for t in traces]
    ref, others = indexes[0], indexes[1:]
    groups: dict[tuple[int, str, str, int, str], list[Key]] = {}
    for key in ref.order:
        step, phase, module, call, slot = key
        op_id, _, rest = slot.partition("/")
        name, _, _ = rest.partition("/")
        groups.setdefault((step, phase, module, call, f"{op_id}/{name}"), []).append(key)
    findings = []
    sites = probe_value(ref.trace, OP_SITES) or {}
    for (step, phase, module, call, prefix), keys in groups.items():
        differing_keys = [k for k in keys if any(idx.fp.get(k) != ref.fp[k] for idx in others)]
        outputs = [k for k in differing_keys if k[4].startswith(f"{prefix}/out")]
        if not outputs:
            continue
        inputs_differ = any(k[4].startswith(f"{prefix}/in") for k in differing_keys)
        uninitialized = any(k[4] == f"{prefix}/{UNINITIALIZED_READ}" for k in keys)
        op_index, _, op = prefix.partition("/")
        # An op without tensor inputs that draws no random numbers (arange, zeros, full)
        # takes its arguments from host values made of earlier results: not an origin.
        made_from_host = not any(k[4].startswith(f"{prefix}/in") for k in keys) and not (
            draws_random_numbers(op))
        differ = [idx for idx in others if any(idx.fp.get(k) != ref.fp[k] for k in outputs)]
        findings.append(OpFinding(
            step, FORWARD if phase == OP_FORWARD else BACKWARD, module, call, int(op_index[2:]),
            op, PROPAGATED if inputs_differ or made_from_host or uninitialized else ORIGIN,
            len(differ),
            len(traces), [k[4][len(prefix) + 1:] for k in outputs], differ[0].trace.repeat,
            ref.stats(outputs[0]),
            sites.get(op_site_key(step, phase == OP_BACKWARD, prefix), "")
            if module == OUTSIDE_MODEL else "", uninitialized,
        ))
    return findings
