"""Regression gate: bitwise (or tolerant) diffs of two runs.

``diff_traces`` compares run B against run A -- a stored baseline against a new run
(``detaudit check``), or any two saved runs (``detaudit diff``) -- and says where they part.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..config import REBUILT_KINDS, SCAN
from ..trace import (
    BACKWARD,
    FORWARD,
    OP_PHASES,
    OPTIMIZER,
    OUTPUT,
    PROBE_CONFIG,
    PROBE_RECORD_SET,
    PROBE_SPEC,
    STATE,
    UNINITIALIZED_READ,
    AnyTrace,
    Trace,
)
from ..words import counted, rates_text
from .compare import FAILED, Comparison, aligned_steps, compare
from .verdict import MATCH, MISMATCH, exit_code

# Environment keys that can change a run's numbers (PyTorch promises no bit-exactness
# across versions, devices, thread counts or these flags).
ENV_KEYS = (
    "torch", "torchvision", "cuda", "cudnn", "device", "devices", "threads",
    "deterministic_algorithms", "deterministic_warn_only", "cudnn_deterministic",
    "cudnn_benchmark", "tf32_matmul", "tf32_cudnn",
)
_FLOAT_PREFIXES = ("float", "bfloat", "complex")
# Configuration keys that change what a run computes (not how many repeats or what is recorded).
CONFIG_KEYS = ("mode", "device", "seed", "deterministic", "epochs", "steps", "fault")
STEPS_LISTED = 50  # steps that differ listed one by one (the count says how many in all)
STEPS_SAID = 5  # of them, in the one-screen message


@dataclass
class FirstDifference:
    """The first record (execution order) that differs beyond tolerance."""

    step: int
    phase: str
    module: str
    call: int
    slot: str
    norm: tuple[float | None, float | None]  # (a, b)
    absmax: tuple[float | None, float | None]
    missing: bool  # present in only one of the runs
    unmeasured: bool = False  # a tolerance diff, but no stats were stored to measure it by
    # the sums under fixed signs (see `_signed_within`); None where a run stored none
    signed: tuple[float | None, float | None] = (None, None)
    # a tolerance diff whose norm and absmax agree within it, and only that sum does not
    reordered: bool = False

    @property
    def where(self) -> str:
        name = self.module or "(model)"
        return f"{name}{f'[{self.call}]' if self.call else ''} {self.slot}"


@dataclass
class GateResult:
    """The verdict of comparing run B against run A (a baseline or another run)."""

    ok: bool
    env_differences: dict[str, tuple[Any, Any]]
    first: FirstDifference | None
    origin_module: str | None
    origin_phase: str | None
    differing_records: int
    total_records: int
    tolerance: bool  # compared by stats within rtol/atol rather than bitwise
    within_tolerance: int  # records that differ bitwise but were accepted by tolerance
    headline: str
    message: str
    labels: tuple[str, str] = ("A", "B")
    failures: list[str] = field(default_factory=list)
    not_comparable: int = 0  # differing records tolerance cannot judge: never a match
    # records only A (only B) has, of a kind the other run's granularity does not keep
    # (module calls, ops, a scan's optimizer state between epoch ends): not compared
    finer_only: tuple[int, int] = (0, 0)
    zoom: dict[str, Any] | None = None  # diff --zoom: both runs replayed to the first step
    scan_level: bool = False  # a run was recorded at scan level (no module records to name)
    replayable: bool = False  # both runs are of probes a replay rebuilds (built-in or file)
    config_differences: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    planted_apart: list[str] = field(default_factory=list)  # labels: a fault not in repeat 0
    # each run's number of steps, where they first part because one had ended (cause: length)
    lengths: tuple[int, int] | None = None
    # each run's learning rates at the first divergent step, where only its update parts
    # them and the rates differ: the update read a different rate
    learning_rates: tuple[list[float | None], list[float | None]] | None = None
    # every step where records differ, in order (at most STEPS_LISTED): its step, epoch
    # (1-based), records that differ and the loss's relative difference
    steps_apart: list[dict[str, Any]] = field(default_factory=list)
    steps_apart_total: int = 0  # how many steps differ in all

    @property
    def verdict(self) -> str:
        """MATCH; MISMATCH where a record differs; FAILED where none does but a run
        stopped early (a crash is never a divergence)."""
        if self.ok:
            return MATCH
        return FAILED if self.first is None and self.failures else MISMATCH

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)


# -- diffs ----------------------------------------------------------------------------------
def env_differences(a_env: dict[str, Any], b_env: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The numerics-relevant environment keys whose values differ: key -> (a, b); none
    where a run captured no environment (it failed before its first step)."""
    if not a_env or not b_env:
        return {}
    return {k: (a_env.get(k), b_env.get(k)) for k in ENV_KEYS if a_env.get(k) != b_env.get(k)}


def config_differences(a: AnyTrace, b: AnyTrace, audited_alike: bool = False
                       ) -> dict[str, tuple[Any, Any]]:
    """What the two runs audited (``audited``: the command, probe file or model), where it
    differs (unless `audited_alike`: a baseline and the run that checks it, which runs what
    the baseline names), and the configuration keys (CONFIG_KEYS) whose values differ: key
    -> (a, b); none where either run does not say."""
    said = {}
    audited = _audited(a), _audited(b)
    if not audited_alike and None not in audited and audited[0] != audited[1]:
        said["audited"] = audited
    said.update(_option_differences(a, b))
    ca, cb = (t.probe.get(PROBE_CONFIG) for t in (a, b))
    if not isinstance(ca, dict) or not isinstance(cb, dict):
        return said
    return {**said, **{k: (ca.get(k), cb.get(k)) for k in CONFIG_KEYS
                       if k in ca and k in cb and ca[k] != cb[k]}}


def _option_differences(a: AnyTrace, b: AnyTrace) -> dict[str, tuple[Any, Any]]:
    """The built-in recipe options (``--image-size``, ...) whose values differ, keyed
    ``option <name>`` (a default left unsaid stands as None)."""
    options = [spec.get("options") if isinstance(spec := t.probe.get(PROBE_SPEC), dict) else None
               for t in (a, b)]
    if not all(isinstance(o, dict) for o in options):
        return {}
    oa, ob = options
    return {f"option {k}": (oa.get(k), ob.get(k)) for k in sorted({*oa, *ob})
            if oa.get(k) != ob.get(k)}


def _audited(trace: AnyTrace) -> str | None:
    """What a run audited, in words: ``command python train.py --lr 0.1``, ``file
    probe.py``, ``builtin maskrcnn`` (None where its trace does not say)."""
    spec = trace.probe.get(PROBE_SPEC)
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        return None
    what = spec.get("source") or spec.get("name")
    return f"{spec['kind']} {what}" if isinstance(what, str) and what else spec["kind"]


def _planted_after_repeat_0(trace: AnyTrace) -> bool:
    """Whether the run planted a fault, in a repeat after its first (which diff compares)."""
    config = trace.probe.get(PROBE_CONFIG)
    if not isinstance(config, dict) or not config.get("fault"):
        return False
    repeats, planted = config.get("repeats"), config.get("fault_repeat", -1)
    if not isinstance(repeats, int) or not isinstance(planted, int) or repeats < 1:
        return False  # (a damaged configuration says nothing of where)
    return planted % repeats != 0


def fingerprint_algorithm(env: dict[str, Any]) -> str | None:
    """The fingerprint scheme of a trace (None when unknown); traces from before the
    environment named it used xxh3 on CPU and the first wsum elsewhere, for every dtype."""
    if env.get("fingerprint"):
        return str(env["fingerprint"])
    device = env.get("device")
    if not device:
        return None
    return "xxh3" if str(device).split(":")[0] == "cpu" else "wsum"


# fingerprint.AS_LOADED: the batch as loaded, printed by xxh3 on the CPU (that module needs
# torch, which the analysis of saved runs does not)
_AS_LOADED = "state-xxh3"


def _integers_by(scheme: str | None) -> str | None:
    """The algorithms a scheme prints integers and bools with (the batch as loaded may have
    its own)."""
    if not scheme or "wsum2" not in scheme:
        return scheme
    return "wsum2" + (f"+{_AS_LOADED}" if _AS_LOADED in scheme else "")


def diff_traces(
    a: list[AnyTrace] | AnyTrace,
    b: list[AnyTrace] | AnyTrace,
    rtol: float = 0.0,
    atol: float = 0.0,
    labels: tuple[str, str] = ("A", "B"),
    zoom: Callable[[int], dict[str, Any]] | None = None,
    audited_alike: bool = False,
) -> GateResult:
    """Compare run B against run A (repeat 0 of each), bitwise or within rtol/atol. `zoom`,
    given the first step where they part, returns what a replay of both at that step found;
    `audited_alike`: see config_differences."""
    whole_a, whole_b = (t[0] if isinstance(t, list) else t for t in (a, b))
    ta, tb = _AtCommonLevel(whole_a, whole_b), _AtCommonLevel(whole_b, whole_a)
    algorithms = fingerprint_algorithm(ta.env), fingerprint_algorithm(tb.env)
    mixed = None not in algorithms and algorithms[0] != algorithms[1]
    tolerance = mixed or rtol > 0 or atol > 0
    accepted = unjudged = 0
    if tolerance:
        exact_ints = _integers_by(algorithms[0]) == _integers_by(algorithms[1])
        common = min(len(t.steps) for t in (ta, tb)) if ta.failure or tb.failure else None
        within = _WithinTolerance(ta, tb, rtol, atol, not exact_ints, mixed, common)
        comparison = compare([ta, within])
        accepted, unjudged = within.accepted, within.unjudged
    else:
        comparison = compare([ta, tb])
    envs = env_differences(ta.env, tb.env)
    failures = [f"{name} stopped early: {t.failure}" for name, t in zip(labels, (ta, tb)) if t.failure]
    first = _first(comparison, tolerance, rtol, atol)
    origin = comparison.origins[0] if comparison.origins else None
    result = GateResult(
        ok=first is None and ta.failure == tb.failure, env_differences=envs, first=first,
        origin_module=origin.module if origin else None,
        origin_phase=origin.phase if origin else None,
        differing_records=comparison.differing_records, total_records=comparison.total_records,
        tolerance=tolerance, within_tolerance=accepted, headline="", message="", labels=labels,
        failures=failures, not_comparable=unjudged, finer_only=(ta.left_out, tb.left_out),
        scan_level=SCAN in (recorded_granularity(whole_a), recorded_granularity(whole_b)),
        replayable=all(t.probe.get(PROBE_SPEC, {}).get("kind") in REBUILT_KINDS
                       for t in (whole_a, whole_b)),
        config_differences=config_differences(whole_a, whole_b, audited_alike),
        planted_apart=[label for label, t in zip(labels, (whole_a, whole_b))
                       if _planted_after_repeat_0(t)],
        lengths=(len(ta.steps), len(tb.steps)) if comparison.cause == "length" else None,
        learning_rates=tuple(comparison.lr_by_repeat) if comparison.lr_by_repeat else None,
        steps_apart=_steps_apart(comparison)[:STEPS_LISTED],
        steps_apart_total=sum(1 for n in comparison.differing_by_step.values() if n),
    )
    if zoom is not None and first is not None:
        result.zoom = zoom(first.step)
    result.headline = _headline(result, len(comparison.steps), rtol, atol)
    result.message = _message(result, algorithms if mixed else None, atol)
    return result


def recorded_granularity(trace: AnyTrace) -> str | None:
    """The granularity a trace was recorded at (None: not said)."""
    config = trace.probe.get(PROBE_CONFIG)
    return config.get("granularity") if isinstance(config, dict) else None


def granularity_keeps(granularity: str | None, phase: str, slot: str) -> bool:
    """Whether a run recorded at `granularity` keeps a record of this kind at every step: a
    scan keeps the step state (batch, RNGs, losses, gradients, parameters after the update)
    but no module call, and the optimizer's own state (momentum, lr) only at epoch ends;
    module keeps every module call; op every op too. Unknown: everything."""
    if granularity not in (SCAN, "module"):
        return True
    if phase in OP_PHASES:
        return False
    if granularity == SCAN:
        return phase not in (FORWARD, BACKWARD) and not (
            phase == OPTIMIZER and slot.startswith(("state.", "lr.")))
    return True


class _AtCommonLevel:
    """One run of two as the comparison reads it (:meth:`by_step` and its steps, failure,
    repeat and stress), a step at a time beside the other run: without the records the
    other run lacks because its granularity does not keep them (recorded by this run alone,
    at a finer level). A record the other run's granularity keeps, missing there, stays: a
    run that is shorter or skipped something differs. How many were left out is known once
    every step was read."""

    def __init__(self, trace: AnyTrace, other: AnyTrace) -> None:
        self.trace, self.other = trace, other
        self.other_granularity = recorded_granularity(other)
        # an older trace lacks the kinds of records added since (see _newer_kind)
        self.other_set = other.probe.get(PROBE_RECORD_SET, 1)
        self.steps, self.failure, self.repeat = trace.steps, trace.failure, trace.repeat
        self.env = trace.env
        self.stress_rows = trace.stress_rows
        self.left_out = 0

    def by_step(self) -> Iterator[tuple[int, Trace]]:
        self.left_out = 0
        keys = ("step", "phase", "module", "call", "slot")
        for step, (cut, other) in aligned_steps([self.trace, self.other], None):
            theirs = set(zip(*(other.records[c] for c in keys)))
            r = cut.records
            kept = [i for i, key in enumerate(zip(*(r[c] for c in keys))) if key in theirs
                    or (granularity_keeps(self.other_granularity, key[1], key[4])
                        and not _newer_kind(key[1], key[4], r["dtype"][i], self.other_set))]
            if len(kept) < len(cut):
                self.left_out += len(cut) - len(kept)
                cut = replace(cut, records={c: [r[c][i] for i in kept] for c in r})
            if len(cut) or cut.calls["step"]:  # else a step only the other run has
                yield step, cut


def _newer_kind(phase: str, slot: str, dtype: str, other_set: int) -> bool:
    """A record of a kind a trace of record set `other_set` lacks: a buffer or a plain
    output value (since set 2), an op's plain arguments (since set 3)."""
    if other_set < 2 and ((phase == STATE and slot.startswith("buffer."))
                          or (phase == OUTPUT and dtype == "bytes")):
        return True
    return phase in OP_PHASES and ((other_set < 3 and slot.endswith("/in.args")) or (
        other_set < 4 and slot.endswith(f"/{UNINITIALIZED_READ}")))


class _WithinTolerance:
    """Run B as the comparison reads it (:meth:`by_step` and B's steps, failure, repeat and
    stress), a step at a time beside A: the records tolerance accepts, and those it cannot
    judge, carry A's print (so the comparison passes over them); how many of each is known
    once every step was read. Steps from `common` on, which the comparison leaves out, are
    not read."""

    def __init__(self, a: AnyTrace, b: AnyTrace, rtol: float, atol: float,
                 ints_unjudged: bool, floats_unjudged: bool, common: int | None) -> None:
        self.a, self.b = a, b
        self.tolerance = rtol, atol, ints_unjudged, floats_unjudged
        self.common = common
        self.steps, self.failure, self.repeat = b.steps, b.failure, b.repeat
        self.stress_rows = b.stress_rows
        self.accepted = self.unjudged = 0

    def by_step(self) -> Iterator[tuple[int, Trace]]:
        self.accepted = self.unjudged = 0
        for step, (cut_a, cut_b) in aligned_steps([self.a, self.b], self.common):
            if not len(cut_b) and not cut_b.calls["step"]:
                continue  # a step only A has
            cut_b, accepted, unjudged = _accept_within(cut_a, cut_b, *self.tolerance)
            self.accepted += accepted
            self.unjudged += unjudged
            yield step, cut_b


def _accept_within(
    a: Trace, b: Trace, rtol: float, atol: float, ints_unjudged: bool, floats_unjudged: bool,
) -> tuple[Trace, int, int]:
    """A copy of `b` in which the records tolerance accepts, and those it cannot judge, carry
    `a`'s fingerprint (so the comparison passes over them); how many of each."""
    ra, rb = a.records, b.records
    keys = ("step", "phase", "module", "call", "slot")
    row_a = {k: i for i, k in enumerate(zip(*(ra[c] for c in keys)))}
    fps = list(rb["fp"])
    accepted = unjudged = 0
    for j, key in enumerate(zip(*(rb[c] for c in keys))):
        i = row_a.get(key)
        if i is None or fps[j] == ra["fp"][i]:
            continue
        judged = _within(ra, i, rb, j, rtol, atol, ints_unjudged, floats_unjudged)
        if judged is not False:
            fps[j] = ra["fp"][i]
            accepted += judged is True
            unjudged += judged is None
    return replace(b, records={**rb, "fp": fps}), accepted, unjudged


def _within(
    ra: dict[str, list[Any]], i: int, rb: dict[str, list[Any]], j: int,
    rtol: float, atol: float, ints_unjudged: bool, floats_unjudged: bool,
) -> bool | None:
    """Whether record i of A and record j of B agree within tolerance by their stored stats;
    None where tolerance cannot say because the prints came from two algorithms (a float
    stored without stats, an integer) -- such a record is reported, never counted as a
    match. A float without stats whose prints, made alike, differ is a difference: nothing
    measures it within tolerance."""
    if ra["shape"][i] != rb["shape"][j] or ra["dtype"][i] != rb["dtype"][j]:
        return False
    if ra["nonfinite"][i] != rb["nonfinite"][j]:
        return False
    stats = [(ra[c][i], rb[c][j]) for c in ("norm", "absmax")]
    dtype = str(ra["dtype"][i])
    if all(x is not None and y is not None for x, y in stats):
        return all(_close(x, y, rtol, atol) for x, y in stats) and _signed_within(
            _signed(ra, i), _signed(rb, j), max(stats[0]), math.prod(ra["shape"][i]), dtype,
            rtol, atol)
    if dtype.startswith(_FLOAT_PREFIXES):
        return None if floats_unjudged else False
    return None if ints_unjudged and dtype != "bytes" else False  # integers compare exactly


def _steps_apart(c: Comparison) -> list[dict[str, Any]]:
    """Each step where records differ: where it is, how many differ and the loss's
    relative difference (after the first, each step also carries what the ones before
    changed, so where it parts is the first step's to say)."""
    epochs = {step: epoch for step, epoch, _ in c.steps}
    loss = {step: rel for step, _, rel in c.loss.per_step}
    return [{"step": step, "epoch": epochs[step] + 1 if step in epochs else None,
             "records": n, "loss": loss.get(step)}
            for step, n in c.differing_by_step.items() if n]


def _close(x: float, y: float, rtol: float, atol: float) -> bool:
    """A stat of run A within tolerance of run B's."""
    return abs(x - y) <= atol + rtol * abs(y)


def _signed(records: dict[str, list[Any]], i: int) -> float | None:
    column = records.get("signed")
    return column[i] if column else None


def _signed_within(a: float | None, b: float | None, norm: float, n: int, dtype: str,
                   rtol: float, atol: float) -> bool:
    """Whether two sums of a record's elements under fixed signs agree as records within
    tolerance do (True where a run stored none). Elements that trade places (a flipped
    image, a shuffled batch) keep norm and absmax but move this sum by about the norm;
    elements that each move within tolerance move it by about the norm of their
    differences, at most rtol * norm + atol * sqrt(n): 8 times that is allowed (a
    random-sign sum passes 8 of its standard deviations about once in 1e15), and the
    rounding of the sums themselves (float32 accumulation but for float64 data)."""
    if a is None or b is None:
        return True
    rounding = (2.0**-53 if dtype == "float64" else 2.0**-24) * math.sqrt(n) * norm
    return abs(a - b) <= 8 * (rtol * norm + atol * math.sqrt(n)) + rounding


def _first(comparison: Comparison, tolerance: bool, rtol: float = 0.0, atol: float = 0.0
           ) -> FirstDifference | None:
    """The first differing record of the first divergent step."""
    if not comparison.first_diffs:
        return None
    d = comparison.first_diffs[0]
    norm = (d.ref.get("norm"), d.other.get("norm"))
    stats = [(d.ref.get(c), d.other.get(c)) for c in ("norm", "absmax", "signed")]
    reordered = tolerance and not d.missing and all(
        None not in pair for pair in stats) and all(
        _close(x, y, rtol, atol) for x, y in stats[:2])
    return FirstDifference(
        d.step, d.phase, d.module, d.call, d.slot, norm=norm,
        absmax=(d.ref.get("absmax"), d.other.get("absmax")),
        missing=bool(d.missing), unmeasured=tolerance and not d.missing and None in norm,
        signed=stats[2], reordered=reordered,
    )


def _message(result: GateResult, algorithms: tuple[str | None, str | None] | None,
             atol: float = 0.0) -> str:
    """One screen: environment differences first, then the verdict and where it breaks."""
    la, lb = result.labels
    lines = []
    if result.env_differences:
        lines.append(
            f"environment differs between {la} and {lb} (PyTorch does not promise bit-identical "
            "results across versions, devices, thread counts or these flags):"
        )
        lines += [f"  {k}: {x!r} -> {y!r}" for k, (x, y) in result.env_differences.items()]
    if result.config_differences:
        lines.append(f"configuration differs between {la} and {lb} (they ran different "
                     "trainings; steps are compared by number):")
        lines += [f"  {k}: {x!r} -> {y!r}" for k, (x, y) in result.config_differences.items()]
    for label in result.planted_apart:
        lines.append(f"note: {label} planted its fault in its last repeat; diff compares "
                     "repeat 0 of each run, where none was planted")
    if algorithms:
        lines.append(
            f"fingerprints were made by different algorithms ({algorithms[0]} vs {algorithms[1]}), "
            "so records are compared by shape, dtype and stats instead of bitwise"
        )
    if result.verdict != FAILED:  # (its headline names them)
        lines += result.failures
    lines.append(result.headline)
    for label, other, count in ((la, lb, result.finer_only[0]), (lb, la, result.finer_only[1])):
        if count:
            lines.append(f"not compared: {count} records only {label} recorded (module calls, "
                         f"ops or optimizer state that {other}'s granularity does not keep, or "
                         f"buffers and plain output values an older {other} did not record)")
    first = result.first
    if first is None:
        return "\n".join(lines)
    missing = " (present in only one run)" if first.missing else ""
    if result.lengths is not None:
        lines.append(f"first difference: step {first.step}, {_ended(result)}")
    else:
        lines.append(f"first difference: step {first.step}, {first.phase}, {first.where}{missing}")
    for name, (x, y) in (("norm", first.norm), ("absmax", first.absmax)):
        if x is not None and y is not None:
            lines.append(f"  {name}: {la} {x:.9g}  {lb} {y:.9g}  (abs. diff {abs(x - y):.3g})")
    if first.reordered:
        x, y = first.signed
        lines.append(f"  sum under fixed signs: {la} {x:.9g}  {lb} {y:.9g}: norm and absmax "
                     "agree within tolerance, but elements moved or traded places (a flip, a "
                     "shuffled batch, a transpose)")
    if first.unmeasured:
        lines.append("  it differs bitwise, and a run stored no stats to measure it within "
                     "tolerance by (a run at scan level stores none; one at module level, "
                     "as a baseline is, stores them)")
    elif result.tolerance and not atol and max(
            (abs(v) for v in (*first.norm, *first.absmax) if v is not None),
            default=float("inf")) < 1e-6:
        lines.append("  (with --atol 0, a value this close to zero fails any --rtol: give an "
                     "--atol)")
    if first.phase == "state" and first.slot.startswith("param.") and first.missing:
        # (a module renamed, added or removed: its values may all agree)
        lines.append(f"origin: the model's modules differ: {first.module or '(model)'} "
                     f"{first.slot.removeprefix('param.')} is a parameter of one run only (a "
                     "module renamed, added or removed)")
    elif first.phase == "state" and first.slot.startswith("param."):
        # no computation: the model differs as built (or loaded) before this step
        lines.append(f"origin: the parameters of {first.module or '(model)'}, different before "
                     f"step {first.step} (as built, loaded or carried over; its forward only "
                     "shows it)")
    elif first.phase == STATE and first.slot.startswith("batch") and not first.missing:
        lines.append(f"origin: the batch of step {first.step}, different before the model ran "
                     "(the data changed: its files, loading, order or augmentation)")
    elif result.learning_rates is not None:
        lines.append(f"origin: the learning rate differs ({_learning_rates(result)}), so "
                     "every parameter the update wrote differs: a schedule changed, or a rate "
                     "set from something that differs between the runs")
    elif result.origin_module is not None:
        lines.append(f"origin: {result.origin_module or '(model)'} ({result.origin_phase})")
    elif result.zoom is None and result.scan_level and result.replayable and first.phase not in (
            "forward", "backward"):
        lines.append("(recorded at scan level: `detaudit diff --zoom` replays both runs to that "
                     "step at module and op level, where this machine can run them)")
    if result.steps_apart_total > 1:
        lines.append(steps_apart_line(result))
    if result.zoom is not None:
        lines.append(zoom_line(result.zoom, la, lb))
    return "\n".join(lines)


def steps_apart_line(result: GateResult) -> str:
    """The steps where the runs differ, the first few with their counts."""
    said = [f"{row['step']} ({counted(row['records'], 'record')})"
            for row in result.steps_apart[:STEPS_SAID]]
    more = result.steps_apart_total - len(said)
    return (f"records differ at {counted(result.steps_apart_total, 'step')}: "
            + ", ".join(said) + (f" and {more} more" if more > 0 else ""))


def zoom_line(zoom: dict[str, Any], la: str, lb: str) -> str:
    """What ``diff --zoom`` found, in one line."""
    step = zoom.get("step")
    if zoom.get("status") != "found":
        return f"zoom ({zoom.get('status')}): {zoom.get('why')}"
    where = f"{zoom.get('module') or '(model)'} ({zoom.get('phase')})" if zoom.get(
        "phase") else "no module call (the step state or the optimizer)"
    op = (f"; op {zoom['op']} in {zoom.get('op_module') or '(model)'} ({zoom.get('op_phase')})"
          if zoom.get("op") else "")
    return f"zoom: {la} and {lb} replayed to step {step}: origin {where}{op}"


def _ended(result: GateResult) -> str:
    """Where two runs of different lengths part: the first step one never reached."""
    (la, lb), (na, nb) = result.labels, result.lengths or (0, 0)
    return f"where a run had ended ({la} ran {counted(na, 'step')}, {lb} ran {nb})"


def _learning_rates(result: GateResult) -> str:
    """Each run's learning rates, one per parameter group: "A 0.1, B 0.11"."""
    return ", ".join(f"{label} {rates_text(rates)}"
                     for label, rates in zip(result.labels, result.learning_rates or ()))


def _headline(result: GateResult, steps: int, rtol: float, atol: float) -> str:
    """The one-line verdict."""
    la, lb = result.labels
    limits = f"rtol={rtol:g}, atol={atol:g}"
    mode = f"within {limits}" if result.tolerance else "bitwise"
    if result.ok:
        inexact = f" ({result.within_tolerance} not bitwise)" if result.within_tolerance else ""
        unjudged = (
            f"; {result.not_comparable} differing records not comparable within tolerance "
            "(floats stored without stats, or integers printed by another algorithm)"
            if result.not_comparable else ""
        )
        compared = result.total_records - result.not_comparable
        return (
            f"MATCH: {lb} agrees with {la} {mode} on {counted(compared, 'record')}{inexact} "
            f"over {counted(steps, 'step')}{unjudged}"
        )
    if result.first is None:
        if result.failures:  # a crash, never a divergence
            return (f"FAILED: {'; '.join(result.failures)}; the records of the steps both "
                    "completed agree")
        return f"MISMATCH: {lb} and {la} did not run to the same end"
    first = result.first
    # an origin is a place; without one, the first record that differs is only that
    if result.lengths is not None:
        where = _ended(result)
    elif first.phase == STATE and first.slot.startswith("param."):
        where = f"in the parameters of {first.module or '(model)'}, before the step"
    elif result.learning_rates is not None:
        where = f"in the learning rate its update read ({_learning_rates(result)})"
    elif result.origin_module is not None:
        where = f"in {result.origin_module or '(model)'} ({result.origin_phase})"
    else:
        where = f"(its first differing record: {first.phase} {first.where})"
    mode = f"beyond {limits}" if result.tolerance else mode
    return (
        f"MISMATCH: {lb} differs from {la} {mode} at step {first.step} {where}; "
        f"{result.differing_records} of {result.total_records} records differ"
    )
