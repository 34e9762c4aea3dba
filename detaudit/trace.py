"""One run's record, in a versioned plain-data format that every later stage reads.

A trace holds no timestamps, host names or absolute paths (those live in the run folder's
``run.json``): the same run writes the same bytes, up to the run's id. This module owns the format's
vocabulary; the recorders write it and the analysis reads it, and neither defines it.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Union

from .errors import TraceError
from .storage import (
    atomic_write,
    check_format,
    describe,
    dump_json,
    jsonable,
    open_file,
    read_bytes,
    read_json,
)

# History:
#   1: first format: steps, columnar records and module calls, environment, probe config.
#   2: the same content streamed while recording (TraceStream): a long run's memory stays flat.
FORMAT_VERSION = 1
STREAM_VERSION = 2
FORMAT_NAME = "detaudit-trace"
# A streamed trace is flushed at the end of its first step, then of any step after
# FLUSH_EVERY_S seconds (a hard kill loses little) or with FLUSH_ROWS records held (its
# memory stays flat), whichever comes first.
FLUSH_EVERY_S = 30.0
FLUSH_ROWS = 20_000

# The format, version 1 (gzip-compressed JSON, keys sorted):
#
#   probe     what ran: PROBE_SPEC (the probe description, detaudit.config.ProbeSpec as a
#             dict), PROBE_CONFIG (detaudit.config.AuditConfig as a dict), PROBE_RUN (the
#             run's id, as in run.json: a folder's traces all carry it) and, in a
#             distributed audit, PROBE_DISTRIBUTED (the rank's sampler indices, loading
#             RNG states and parameters as built). Non-finite numbers the user gave (a
#             clip norm of inf) are the strings "nan", "inf", "-inf": the file is strict JSON.
#   repeat    which repeat of the audit this is (0-based).
#   env       the determinism-relevant environment (versions, device, threads, flags).
#   steps     one StepInfo per step: global step, epoch, index in epoch, exact losses.
#   records   columnar: one row per fingerprinted tensor, RECORD_COLUMNS; a row's key is
#             (step, phase, module, call, slot). `signed` (the sum of the elements under
#             fixed signs, see detaudit.record.fingerprint) is absent where no record has
#             one (no stats, or a trace written before it was kept): null in every row.
#   calls     columnar: the module call tree of every step, CALL_COLUMNS; `reads` lists
#             the modules whose parameters the call took as inputs (DETR's decoder is
#             passed `query_embed.weight`); absent where no call read one (and in traces
#             written before it was kept), which reads as [] for every call.
#   failure   why the repeat stopped early (null when it ran to the end).
#   stress    columnar, optional (absent: nothing stressed): STRESS_COLUMNS, one row per op,
#             module and phase at each stressed step (see detaudit.record.stress): how
#             often the op ran, how many of those calls were re-executed `runs` times on
#             identical inputs, the most distinct results one call gave (2+: proven
#             nondeterministic) and the size of the first difference. Its cost in time is
#             in run.json's timings (a trace holds no times).
#
# Version 2, the streamed form (written by TraceStream as the run goes; readers take both):
# gzip members of JSON lines, keys sorted. The first line is {"format", "version": 2}; each
# flush appends one member of two lines: {"steps", "records", "calls"} with what is new since
# the last flush, then {"end": {"probe", "repeat", "env", "failure", "stress"}}. The trace is
# every data line with the last end line; a member cut short at the end of the file (the
# process was killed while writing) is left out, so what was flushed before it is kept.
# Steps are written in order: a data line may add records to the newest step of the line
# before it (a scan's epoch-end optimizer state), never to an older one, so a reader can
# hand out one step at a time (TraceFile.by_step).
#
# A record's phase is one of PHASES:
#   state      at the start of a step: the batch (``batch.<path>``), every RNG
#              (``rng.<stream>``) and, at step 0, the parameters (``param.<name>``).
#   forward    a module call's inputs (``in.<path>``), outputs (``out.<path>``) and the
#              torch RNG before and after it when it drew (``rng.in``, ``rng.out``).
#   backward   the gradient w.r.t. a module call's outputs (``grad_out.<path>``) and the
#              gradient it sends to each input (``grad_in.<path>``).
#   grad       a module's own parameter gradients after backward (``param.<name>``).
#   optimizer  after the update: the parameters (``param.<name>``), the optimizer state
#              (``state.<name>.<key>``) and a GradScaler's scale (``scale``).
#   output     the step's loss terms (``loss.<name>``) or, in inference, its outputs
#              (``detections.<path>``).
#   op.forward / op.backward   op-level records: slots ``op<k>/<namespace.op>/in.<i>``
#              and ``.../out.<i>``, where k counts the ops of one module call in order.
STATE, FORWARD, BACKWARD, GRAD, OPTIMIZER, OUTPUT = (
    "state", "forward", "backward", "grad", "optimizer", "output",
)
OP_FORWARD, OP_BACKWARD = "op.forward", "op.backward"
# the module of an op run outside every module call (a loss the loop computes from the
# model's outputs, and its backward); "" is the model's own call
OUTSIDE_MODEL = "(outside the model)"
MODEL_STATE = ("param.", "buffer.")  # the model's state records' slots, as a step begins
# the slot prefix of a gradient record as a backward left it, before the loop's own code
# could rescale it (at module-level steps; the update's own are "param.<name>")
LEFT_BY_BACKWARD = "left."
LOADER_BATCH = "batch.loader"  # a state record: a batch as the DataLoader yielded it (exec, watch)
OP_PHASES = (OP_FORWARD, OP_BACKWARD)
PHASES = (STATE, FORWARD, BACKWARD, GRAD, OPTIMIZER, OUTPUT, *OP_PHASES)
PROBE_SPEC, PROBE_CONFIG, PROBE_DISTRIBUTED = "info", "config", "distributed"
PROBE_RUN = "run"  # the id of the run the trace belongs to (run.json has the same)
# which records a trace holds: 2 adds the buffers written in a step and plain (non-tensor)
# output values, 3 an op's plain arguments, 4 the mark of an op that read memory an
# uninitialized op made and nothing wrote since (UNINITIALIZED_READ); a trace without it
# (older) has none of them
PROBE_RECORD_SET, RECORD_SET = "record_set", 4
UNINITIALIZED_READ = "in.uninitialized"  # an op record's slot: op<k>/<op>/in.uninitialized

_BACKWARD_LOSS = re.compile(r"loss(\.\d+)?")  # the names of the tensors backward was called on
RECORD_COLUMNS = (
    "step", "phase", "module", "call", "slot", "fp", "shape", "dtype", "norm", "absmax", "nonfinite",
    "signed",
)
CALL_COLUMNS = ("step", "module", "index", "parent", "reads")
STRESS_COLUMNS = (
    "step", "epoch", "phase", "module", "op", "calls", "stressed", "runs", "distinct",
    "elements", "differing", "max_abs", "max_ulp", "rel_err", "site",
)


@dataclass
class StepInfo:
    """What happened at one step besides the records: where it is, its exact losses."""

    step: int
    epoch: int
    index: int  # step within its epoch
    losses: dict[str, str] = field(default_factory=dict)  # name -> float.hex, exact
    optimizer_stepped: bool = False
    lr: list[float | None] = field(default_factory=list)  # None: not finite
    scale: float | None = None  # GradScaler scale after the step (None: not finite)

    def loss_values(self) -> dict[str, float]:
        """The exact loss values as floats."""
        return {name: float.fromhex(v) for name, v in self.losses.items()}

    def loss_total(self) -> float:
        """The loss the step minimised: the sum of what backward was called on (``loss``,
        ``loss.1``, ... under exec and watch, whose named terms are parts of it; not the
        later evaluations of an optimizer's closure, ``loss@1``...), else of every term (a
        probe's loss dict)."""
        values = self.loss_values()
        backward = [v for name, v in values.items() if _BACKWARD_LOSS.fullmatch(name)]
        return sum(backward or values.values())

    def keep_losses(self, values: dict[str, Any]) -> None:
        """Keep the exact values of the scalar loss copies (`runner.loss_copy`). Called
        once the step is over: reading an accelerator's value waits for its queue, which
        inside the step would stall it."""
        self.losses.update({name: float(v).hex() for name, v in values.items()})


@dataclass
class Trace:
    """The record of one repeat of one probe."""

    probe: dict[str, Any]
    repeat: int
    env: dict[str, Any]
    steps: list[StepInfo] = field(default_factory=list)
    records: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in RECORD_COLUMNS})
    calls: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in CALL_COLUMNS})
    failure: str | None = None  # why the run stopped early; records up to then are kept
    stress: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in STRESS_COLUMNS})

    # -- building ------------------------------------------------------------------------
    def add_record(self, step: int, key: tuple[str, str, int, str], print_: Any) -> None:
        """Append one record (key = phase, module, call, slot)."""
        phase, module, call, slot = key
        cols = self.records
        for name, value in (
            ("step", step), ("phase", phase), ("module", module), ("call", call), ("slot", slot),
            ("fp", print_.fp), ("shape", list(print_.shape)), ("dtype", print_.dtype),
            ("norm", _finite(print_.norm)), ("absmax", _finite(print_.absmax)),
            ("nonfinite", print_.nonfinite), ("signed", _finite(print_.signed)),
        ):
            cols[name].append(value)

    def add_call(self, step: int, module: str, index: int, parent: int,
                 reads: list[str] | None = None) -> None:
        """Append one module call (parent = position of the enclosing call in its step;
        reads = the modules whose parameters it took as inputs)."""
        for name, value in (("step", step), ("module", module), ("index", index),
                            ("parent", parent), ("reads", list(reads or ()))):
            self.calls[name].append(value)

    def add_stress(self, row: dict[str, Any]) -> None:
        """Append one stressed op (a dict with the STRESS_COLUMNS keys)."""
        for name in STRESS_COLUMNS:
            self.stress[name].append(row[name])

    def stress_rows(self) -> list[dict[str, Any]]:
        """The stressed ops as one dict per row."""
        return _stress_rows(self.stress)

    # -- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records["fp"])

    def by_step(self) -> Iterator[tuple[int, Trace]]:
        """(step, the trace cut to that step's records and calls), in step order."""
        rows: dict[int, list[int]] = {}
        for i, step in enumerate(self.records["step"]):
            rows.setdefault(step, []).append(i)
        calls: dict[int, list[int]] = {}
        for i, step in enumerate(self.calls["step"]):
            calls.setdefault(step, []).append(i)
        for step in sorted(rows.keys() | calls.keys()):
            yield step, self._cut(rows.get(step, []), calls.get(step, []))

    def _cut(self, rows: list[int], calls: list[int]) -> Trace:
        r, c = self.records, self.calls
        return Trace(probe=self.probe, repeat=self.repeat, env=self.env,
                     records={k: [r[k][i] for i in rows] for k in RECORD_COLUMNS},
                     calls={k: [c[k][i] for i in calls] for k in CALL_COLUMNS},
                     failure=self.failure)

    def frame(self):
        """The records as a pandas DataFrame (one row per record, in execution order)."""
        import pandas as pd

        return pd.DataFrame({c: self.records[c] for c in RECORD_COLUMNS})

    # -- plain data ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The trace as JSON-able plain data (a non-finite value the user gave, e.g. a clip
        norm of inf, becomes a string; the columns hold none)."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "probe": jsonable(self.probe),
            "repeat": self.repeat,
            "env": jsonable(self.env),
            "steps": [vars(s) for s in self.steps],
            "records": _written_records(self.records),
            "calls": _written_calls(self.calls),
            "failure": self.failure,
            **({"stress": self.stress} if self.stress["step"] else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "trace") -> Trace:
        """Rebuild a trace, checking every field (see :func:`_validated`): anything that is
        not a trace we can compare and render is one clear error naming `source`."""
        check_format(data, FORMAT_NAME, FORMAT_VERSION, source,
                     "upgrade detaudit or re-run the audit")
        try:
            return cls(**_validated(data))
        except _Damaged as exc:
            raise TraceError(f"{source} is damaged: {exc}") from None

    def save(self, path: str | Path) -> Path:
        """Write the trace as gzip-compressed JSON (deterministic bytes); return the path."""
        return atomic_write(path, dump_json(self.to_dict(), compress=True))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace written by :meth:`save` or by a :class:`TraceStream`, whole."""
        path = Path(path)
        raw = read_bytes(path, "trace")
        if not _is_stream(raw):
            return cls.from_dict(read_json(path, "trace"), source=f"trace {path}")
        source = f"trace {path}"
        try:
            return cls(**_validated(_stream_data(path, source)))
        except _Damaged as exc:
            raise TraceError(f"{source} is damaged: {exc}") from None


def state_name(module: str, slot: str) -> str:
    """The name a parameter or buffer record stands for, as `named_parameters` gives it:
    ``layer1.0.conv1.weight`` for (``layer1.0.conv1``, ``param.weight``)."""
    return f"{module}.{slot.split('.', 1)[-1]}".lstrip(".")


def within(name: str, module: str) -> bool:
    """Whether the module (or parameter owner) named `name` is `module` or inside it ("" is
    the model: everything is inside it)."""
    return not module or name == module or name.startswith(f"{module}.")


def open_trace(path: str | Path) -> AnyTrace:
    """A trace to analyse: a streamed one (however long its run) as a :class:`TraceFile`,
    read a step at a time; one saved whole, loaded whole."""
    path = Path(path)
    with open_file(path, "trace") as file:
        head = file.read(4096)
    return TraceFile(path) if _is_stream(head) else Trace.load(path)


class TraceFile:
    """A streamed trace read from its file as it is needed, so that comparing runs of
    thousands of steps holds one step of each in memory, not the runs: the steps, probe,
    environment, failure and stress are read when it opens; :meth:`by_step` yields one step's
    records and calls at a time; :attr:`records` and :attr:`calls` load them whole (for
    users' own analyses: :meth:`frame`). Changes to
    `repeat`, `probe` and `failure` are kept in memory and written by :meth:`save`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.source = f"trace {self.path}"
        end, steps = None, []
        for n, item in _stream_items(self.path, self.source):
            if "end" in item:
                end = item["end"]
            else:
                steps += self._checked(lambda item=item, n=n: _listed(item, "steps", n))
        if not isinstance(end, dict):
            raise TraceError(f"{self.source} is truncated: it was cut before its first flush ended")
        data = self._checked(lambda: _validated({**end, "steps": steps, "records": {
            c: [] for c in RECORD_COLUMNS}}))
        self.probe, self.repeat, self.env = data["probe"], data["repeat"], data["env"]
        self.steps, self.failure, self.stress = data["steps"], data["failure"], data["stress"]
        self._saved = self._end()  # as the file says
        self._whole: Trace | None = None

    def _checked(self, read):
        try:
            return read()
        except _Damaged as exc:
            raise TraceError(f"{self.source} is damaged: {exc}") from None

    def _damaged(self, why: str) -> TraceError:
        return TraceError(f"{self.source} is damaged: {why}")

    def by_step(self) -> Iterator[tuple[int, Trace]]:
        """(step, a Trace of that step's records and calls), in step order, reading one flush
        of the file at a time. A streamed trace holds its steps in order (a step is flushed
        whole, at its end); records of an earlier step after a later one are damage."""
        pending: dict[int, tuple[dict[str, list], dict[str, list]]] = {}
        done = -1
        for n, item in _stream_items(self.path, self.source):
            if "end" in item:
                continue
            part = self._checked(lambda item=item, n=n: (
                _columns(f"line {n + 1}: records", item.get("records", {}), _RECORD_CHECKS,
                         required=False, defaults=_RECORD_DEFAULTS),
                _columns(f"line {n + 1}: calls", item.get("calls", {}), _CALL_CHECKS,
                         required=False, defaults=_CALL_DEFAULTS)))
            self._checked(lambda part=part: _check_records(part[0]))
            for table, columns in enumerate(part):
                names = RECORD_COLUMNS if table == 0 else CALL_COLUMNS
                for i, step in enumerate(columns["step"]):
                    if step <= done:
                        raise self._damaged(f"line {n + 1} holds records of step {step}, which "
                                            "ended before it (steps are written in order)")
                    into = pending.setdefault(step, ({c: [] for c in RECORD_COLUMNS},
                                                     {c: [] for c in CALL_COLUMNS}))[table]
                    for name in names:
                        into[name].append(columns[name][i])
            newest = max(pending, default=done)
            for step in sorted(k for k in pending if k < newest):
                yield step, self._step_trace(pending.pop(step))
                done = step
        for step in sorted(pending):
            yield step, self._step_trace(pending.pop(step))

    def _step_trace(self, tables: tuple[dict[str, list], dict[str, list]]) -> Trace:
        records, calls = tables
        self._checked(lambda: _check_calls(calls))
        return Trace(probe=self.probe, repeat=self.repeat, env=self.env, records=records,
                     calls=calls, failure=self.failure)

    def whole(self) -> Trace:
        """The whole trace in memory (read once, then kept)."""
        if self._whole is None:
            self._whole = Trace.load(self.path)
        return replace(self._whole, repeat=self.repeat, probe=self.probe, failure=self.failure)

    @property
    def records(self) -> dict[str, list[Any]]:
        return self.whole().records

    def to_dict(self) -> dict[str, Any]:
        """The whole trace as plain data (see :meth:`Trace.to_dict`)."""
        return self.whole().to_dict()

    def frame(self):
        """The whole trace's records as a pandas DataFrame (see :meth:`Trace.frame`)."""
        return self.whole().frame()

    @property
    def calls(self) -> dict[str, list[Any]]:
        return self.whole().calls

    def __len__(self) -> int:
        return len(self.records["fp"])

    def stress_rows(self) -> list[dict[str, Any]]:
        """The stressed ops as one dict per row."""
        return _stress_rows(self.stress)

    def save(self, path: str | Path) -> Path:
        """Write the trace at `path` (streamed, as it is): the file copied a member at a time,
        with a last end line for what was changed since it was read. It is read from there
        on (the file it came from may go)."""
        path = Path(path)
        changed = self._end() != self._saved
        if path.resolve() == self.path.resolve() and not changed:
            return path
        tmp = path.with_name(path.name + ".part")
        whole = _complete_length(self.path, self.source)  # a member cut short is left behind
        with open(self.path, "rb") as source, open(tmp, "wb") as target:
            while whole > 0 and (chunk := source.read(min(whole, 1 << 20))):
                target.write(chunk)
                whole -= len(chunk)
            if changed:
                target.write(gzip.compress(self._end() + b"\n", mtime=0))
            target.flush()
            os.fsync(target.fileno())
        os.replace(tmp, path)
        self.path, self.source = path, f"trace {path}"
        self._saved = self._end()
        return path

    def _end(self) -> bytes:
        """The end line for the trace as it stands."""
        return dump_json({"end": {
            "probe": jsonable(self.probe), "repeat": self.repeat, "env": jsonable(self.env),
            "failure": self.failure, **({"stress": self.stress} if self.stress["step"] else {}),
        }})


AnyTrace = Union[Trace, TraceFile]  # what the analysis reads: either, the same way


def probe_value(trace: AnyTrace, key: str) -> Any:
    """What the trace's probe description holds under `key` (None if nothing: a trace may
    come without a description)."""
    return (getattr(trace, "probe", None) or {}).get(key)


def _stress_rows(stress: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(STRESS_COLUMNS, values))
            for values in zip(*(stress[c] for c in STRESS_COLUMNS))]


def _complete_length(path: Path, source: str) -> int:
    """The bytes of the file's complete gzip members (what :func:`_stream_items` reads)."""
    length = 0
    for _, length in _members(path, source):
        pass
    return length


def _members(path: Path, source: str) -> Iterator[tuple[bytes, int]]:
    """(text, where it ends in the file) of each complete gzip member, read 1 MiB at a
    time; a last member cut short (the process was killed while appending) is left out."""
    with open_file(path, "trace") as file:
        member, out, read = zlib.decompressobj(31), [], 0
        while chunk := file.read(1 << 20):
            while chunk:
                try:
                    out.append(member.decompress(chunk))
                except zlib.error:
                    raise TraceError(f"{source} is corrupt") from None
                if not member.eof:
                    read += len(chunk)
                    break
                read += len(chunk) - len(member.unused_data)
                yield b"".join(out), read
                chunk, member, out = member.unused_data, zlib.decompressobj(31), []


def _stream_items(path: Path, source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line index, item) of every line of a streamed trace after its header (checked by
    :func:`_is_stream`), one gzip member in memory at a time."""
    n = 0
    for text, _ in _members(path, source):
        lines = text.split(b"\n")
        if lines[-1]:
            raise TraceError(f"{source} is corrupt: a member does not end with a whole line")
        for line in lines[:-1]:
            n += 1
            if n == 1:
                continue
            try:
                item = json.loads(line)
            except (ValueError, RecursionError):
                raise TraceError(f"{source} is corrupt: line {n} is not JSON") from None
            if not isinstance(item, dict):
                raise TraceError(f"{source} is damaged: line {n} is {describe(item)}, not a dict")
            yield n - 1, item


class TraceStream:
    """Writes a trace to its file while it grows: each :meth:`flush` appends the steps,
    records and calls recorded since the last one and empties them in the trace, so that a
    run of any length holds only what is new (format version 2, above). `steps` counts
    every step recorded, flushed or not."""

    def __init__(self, trace: Trace, path: str | Path) -> None:
        self.trace, self.path = trace, Path(path)
        self.flushed_steps = 0
        self.every_step = False  # flush at the end of every step (see due)
        self._started = False
        self._flushed_at = -math.inf

    def due(self) -> bool:
        """Whether to flush at the end of this step (see FLUSH_EVERY_S)."""
        return (self.every_step or not self._started or len(self.trace) >= FLUSH_ROWS
                or time.monotonic() - self._flushed_at > FLUSH_EVERY_S)

    @property
    def steps(self) -> int:
        return self.flushed_steps + len(self.trace.steps)

    def restart(self) -> None:
        """Forget every step recorded so far, flushed or not: the next flush starts the
        file anew."""
        self._started, self.flushed_steps, self._flushed_at = False, 0, -math.inf
        self.trace.steps = []
        self.trace.records = {c: [] for c in RECORD_COLUMNS}
        self.trace.calls = {c: [] for c in CALL_COLUMNS}

    def flush(self) -> Path:
        """Append what is new, and the trace's probe, environment and failure as they stand."""
        t = self.trace
        lines = [] if self._started else [{"format": FORMAT_NAME, "version": STREAM_VERSION}]
        if t.steps or t.records["step"] or t.calls["step"]:
            lines.append({"steps": [vars(s) for s in t.steps],
                          "records": _written_records(t.records),
                          "calls": _written_calls(t.calls)})
        lines.append({"end": {
            "probe": jsonable(t.probe), "repeat": t.repeat, "env": jsonable(t.env),
            "failure": t.failure, **({"stress": t.stress} if t.stress["step"] else {}),
        }})
        text = b"".join(dump_json(line) + b"\n" for line in lines)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab" if self._started else "wb") as file:
                file.write(gzip.compress(text, compresslevel=6, mtime=0))  # 1/3 the time of 9
                file.flush()
                os.fsync(file.fileno())
        except OSError as exc:  # detaudit's own failure, never the audited code's
            raise TraceError(f"cannot write trace {self.path}: {exc.strerror or exc}") from None
        self._started = True
        self._flushed_at = time.monotonic()
        self.flushed_steps += len(t.steps)
        t.steps = []
        t.records = {c: [] for c in RECORD_COLUMNS}
        t.calls = {c: [] for c in CALL_COLUMNS}
        return self.path


_STREAM_HEAD = dump_json({"format": FORMAT_NAME, "version": STREAM_VERSION}) + b"\n"


def holds_steps(path: str | Path) -> bool:
    """Whether the trace at `path` recorded a step (one that is damaged is taken to: it may
    hold some); a streamed one is read only as far as its first step."""
    path = Path(path)
    try:
        if not is_streamed_trace(path):
            return bool(Trace.load(path).steps)
        return any(item.get("steps") for _, item in _stream_items(path, f"trace {path}"))
    except (OSError, TraceError):
        return True


def is_streamed_trace(path: str | Path) -> bool:
    """Whether the file at `path` begins as a streamed trace does (compressed or not)."""
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    return _is_stream(head) or head.startswith(_STREAM_HEAD)


def _is_stream(raw: bytes) -> bool:
    """Whether `raw` is a trace in the streamed form (it starts with its header line)."""
    if raw[:2] != b"\x1f\x8b":
        return False
    try:
        return zlib.decompressobj(31).decompress(raw[:4096], len(_STREAM_HEAD)) == _STREAM_HEAD
    except zlib.error:
        return False


def _stream_data(path: Path, source: str) -> dict[str, Any]:
    """A streamed trace as the plain data of version 1 (see the format above)."""
    steps: list[Any] = []
    records: dict[str, list[Any]] = {c: [] for c in RECORD_COLUMNS}
    calls: dict[str, list[Any]] = {c: [] for c in CALL_COLUMNS}
    end = None
    for n, item in _stream_items(path, source):
        if "end" in item:
            end = item["end"]
            continue
        steps += _listed(item, "steps", n)
        for table, into in (("records", records), ("calls", calls)):
            part = item.get(table, {})
            if not isinstance(part, dict):
                raise _Damaged(f"line {n + 1}: {table} is {describe(part)}, not a dict")
            rows = len(_listed(part, "step", n))
            defaults = _RECORD_DEFAULTS if table == "records" else _CALL_DEFAULTS
            for name, column in into.items():
                if name in defaults and name not in part:
                    column += [defaults[name]() for _ in range(rows)]
                else:
                    column += _listed(part, name, n)
    if not isinstance(end, dict):
        raise TraceError(f"{source} is truncated: it was cut before its first flush ended")
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, **end, "steps": steps,
            "records": records, "calls": calls}


def _listed(item: dict[str, Any], key: str, n: int) -> list[Any]:
    value = item.get(key, [])
    if not isinstance(value, list):
        raise _Damaged(f"line {n + 1}: {key} is {describe(value)}, not a list")
    return value


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


# -- validation of what a file says ---------------------------------------------------------
# A trace read from disk may be damaged or hostile; every field is checked here so that what
# loads can be compared and rendered, and anything else is one TraceError. Unknown keys (at
# the top, among the columns, in a step) are ignored, as the format's readers always have.
_INT_LIMIT = 2**63  # integers are counts and positions: 0 <= n < 2**63
_FLOAT_MAX = sys.float_info.max
_MAX_DEPTH = 64  # nesting of the free-form probe and env values
_OP_SLOT = re.compile(r"op[0-9]+/")  # an op-level record's slot: op<k>/<op>/...


class _Damaged(ValueError):
    """What is wrong with one field (the caller names the file)."""


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < _INT_LIMIT  # type(), not isinstance: no bools


def _number(v: Any) -> bool:
    # finite: NaN fails both comparisons; huge ints that no float can hold fail too
    return (type(v) is float or type(v) is int) and -_FLOAT_MAX <= v <= _FLOAT_MAX


def _stat(v: Any) -> bool:
    return v is None or _number(v)


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _shape(v: Any) -> bool:
    return isinstance(v, list) and all(map(_count, v))


_INTEGER = "an integer >= 0"
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")  # (every print: 64 bits, in hex)
_RECORD_CHECKS = {
    "step": (_count, _INTEGER), "phase": (lambda v: v in PHASES, f"one of {', '.join(PHASES)}"),
    "module": (_text, "a string"), "call": (_count, _INTEGER), "slot": (_text, "a string"),
    "fp": (lambda v: type(v) is str and _FINGERPRINT.fullmatch(v) is not None,
           "16 hexadecimal digits"),
    "shape": (_shape, "a list of integers >= 0"), "dtype": (_text, "a string"),
    "norm": (_stat, "a finite number or null"), "absmax": (_stat, "a finite number or null"),
    "nonfinite": (_count, _INTEGER), "signed": (_stat, "a finite number or null"),
}
_RECORD_DEFAULTS = {"signed": lambda: None}  # a column a trace written before it was kept lacks
_MAYBE_COUNT = (lambda v: v is None or _count(v), "an integer >= 0 or null")
_STRESS_CHECKS = {
    "step": (_count, _INTEGER), "epoch": (_count, _INTEGER), "phase": (_text, "a string"),
    "module": (_text, "a string"), "op": (_text, "a string"), "calls": (_count, _INTEGER),
    "stressed": (_count, _INTEGER), "runs": (_count, _INTEGER), "distinct": (_count, _INTEGER),
    "elements": (_count, _INTEGER), "differing": (_count, _INTEGER),
    "max_abs": (_stat, "a finite number or null"), "max_ulp": _MAYBE_COUNT,
    "rel_err": (_stat, "a finite number or null"),
    # where the user's code ran it, outside the model in forward ("file:line"; "" elsewhere,
    # and in traces written before sites were)
    "site": (_text, "a string"),
}
_CALL_CHECKS = {
    "step": (_count, _INTEGER), "module": (_text, "a string"), "index": (_count, _INTEGER),
    "parent": (lambda v: type(v) is int and -1 <= v < _INT_LIMIT, "an integer >= -1"),
    "reads": (lambda v: type(v) is list and all(map(_text, v)), "a list of strings"),
}
_CALL_DEFAULTS = {"reads": list}  # a column a trace written before it was kept lacks


def _written_calls(calls: dict[str, list]) -> dict[str, list]:
    """The calls as a trace file holds them: `reads` only where a call read a parameter."""
    return calls if any(calls.get("reads", ())) else {k: v for k, v in calls.items()
                                                       if k != "reads"}


def _written_records(records: dict[str, list]) -> dict[str, list]:
    """The records as a trace file holds them: `signed` only where a record has one (a
    trace without stats, as a scan's, or written before it was kept, has none)."""
    return records if any(v is not None for v in records.get("signed", ())) else {
        k: v for k, v in records.items() if k != "signed"}


def _bad(where: str, value: Any, expected: str) -> _Damaged:
    return _Damaged(f"{where} is {describe(value)}, not {expected}")


def _column(where: str, values: Any, check: Any, expected: str) -> list[Any]:
    if not isinstance(values, list):
        raise _bad(where, values, "a list")
    if not all(map(check, values)):
        i = next(i for i, v in enumerate(values) if not check(v))
        raise _bad(f"{where}[{i}]", values[i], expected)
    return list(values)


def _columns(where: str, table: Any, checks: dict[str, Any], required: bool,
             defaults: dict[str, Any] | None = None) -> dict[str, list]:
    """A columnar table: every column a list of the right element type, all one length
    (a column of `defaults` that is missing: that default, made for each row)."""
    if not isinstance(table, dict):
        raise _bad(where, table, "a dict of columns")
    out = {}
    later = []
    for name, (check, expected) in checks.items():
        if name not in table and defaults and name in defaults:
            later.append(name)
            continue
        if name not in table and required:
            raise _Damaged(f"{where}.{name} is missing")
        out[name] = _column(f"{where}.{name}", table.get(name, []), check, expected)
    rows = max((len(v) for v in out.values()), default=0)
    for name in later:
        out[name] = [defaults[name]() for _ in range(rows)]
    lengths = {len(v) for v in out.values()}
    if len(lengths) > 1:
        sizes = ", ".join(f"{name} {len(v)}" for name, v in out.items())
        raise _Damaged(f"{where} columns have different lengths ({sizes})")
    return out


def _check_records(records: dict[str, list]) -> None:
    """An op-level record's slot names its op as compare_ops reads it (op<k>/<op>/...)."""
    for i, (phase, slot) in enumerate(zip(records["phase"], records["slot"])):
        if phase in OP_PHASES and not _OP_SLOT.match(slot):
            raise _bad(f"records.slot[{i}]", slot, f"an op slot (op<k>/<op>/...) in phase {phase}")


def _check_calls(calls: dict[str, list]) -> None:
    """Each call's parent is an earlier call of its step, and no call appears twice in a step
    (so the call tree has no cycles)."""
    seen: dict[int, dict[tuple[str, int], int]] = {}
    for i, (step, module, index, parent) in enumerate(
        zip(calls["step"], calls["module"], calls["index"], calls["parent"])
    ):
        earlier = seen.setdefault(step, {})
        if parent >= len(earlier):
            raise _Damaged(
                f"calls.parent[{i}] is {parent}, not the position of an earlier call of step "
                f"{step} (-1 to {len(earlier) - 1})"
            )
        if (module, index) in earlier:
            raise _Damaged(f"calls[{i}] repeats call {index} of module {module!r} in step {step}")
        earlier[(module, index)] = i


def _step_info(i: int, s: Any) -> StepInfo:
    where = f"steps[{i}]"
    if not isinstance(s, dict):
        raise _bad(where, s, "a dict")
    for key in ("step", "epoch", "index"):
        if key not in s:
            raise _Damaged(f"{where}.{key} is missing")
        if not _count(s[key]):
            raise _bad(f"{where}.{key}", s[key], _INTEGER)
    losses = s.get("losses", {})
    if not isinstance(losses, dict):
        raise _bad(f"{where}.losses", losses, "a dict")
    for name, value in losses.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise _bad(f"{where}.losses[{describe(name)}]", value, "a string")
        try:
            float.fromhex(value)
        except (ValueError, OverflowError):
            raise _bad(f"{where}.losses[{describe(name)}]", value, "a float in hex") from None
    stepped = s.get("optimizer_stepped", False)
    if type(stepped) is not bool:
        raise _bad(f"{where}.optimizer_stepped", stepped, "true or false")
    lr = s.get("lr", [])
    if not isinstance(lr, list) or not all(map(_stat, lr)):
        raise _bad(f"{where}.lr", lr, "a list of finite numbers or nulls")
    scale = s.get("scale")
    if not _stat(scale):
        raise _bad(f"{where}.scale", scale, "a finite number or null")
    return StepInfo(step=s["step"], epoch=s["epoch"], index=s["index"], losses=dict(losses),
                    optimizer_stepped=stepped, lr=list(lr), scale=scale)


def _free_form(where: str, value: Any) -> dict[str, Any]:
    """A dict of plain data (probe, env): string keys, nested at most _MAX_DEPTH deep, no NaN
    or infinity (the writer refuses them, so a trace can always be written again)."""
    if not isinstance(value, dict):
        raise _bad(where, value, "a dict")
    key = next((k for k in value if not isinstance(k, str)), None)
    if key is not None:
        raise _bad(f"a key of {where}", key, "a string")
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise _Damaged(f"{where} is nested more than {_MAX_DEPTH} deep")
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            elif type(child) is float and not -_FLOAT_MAX <= child <= _FLOAT_MAX:
                raise _Damaged(f"{where} holds {child!r}, not a finite number")
    return dict(value)


def _validated(data: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of Trace for `data`, every field checked; _Damaged otherwise."""
    probe = _free_form("probe", data.get("probe", {}))
    for key in (PROBE_SPEC, PROBE_CONFIG, PROBE_DISTRIBUTED):
        if key in probe and not isinstance(probe[key], dict):
            raise _bad(f"probe.{key}", probe[key], "a dict")
    repeat = data.get("repeat", 0)
    if not _count(repeat):
        raise _bad("repeat", repeat, _INTEGER)
    env = _free_form("env", data.get("env", {}))
    if "steps" not in data:
        raise _Damaged("steps is missing")
    steps = data["steps"]
    if not isinstance(steps, list):
        raise _bad("steps", steps, "a list")
    if "records" not in data:
        raise _Damaged("records is missing")
    records = _columns("records", data["records"], _RECORD_CHECKS, required=True,
                       defaults=_RECORD_DEFAULTS)
    _check_records(records)
    calls = _columns("calls", data.get("calls", {}), _CALL_CHECKS, required=False,
                     defaults=_CALL_DEFAULTS)
    _check_calls(calls)
    failure = data.get("failure")
    if failure is not None and not isinstance(failure, str):
        raise _bad("failure", failure, "a string or null")
    stress = _columns("stress", data.get("stress", {}), _STRESS_CHECKS, required=False,
                      defaults={"site": str})
    return {
        "probe": probe, "repeat": repeat, "env": env,
        "steps": [_step_info(i, s) for i, s in enumerate(steps)],
        "records": records, "calls": calls, "failure": failure, "stress": stress,
    }
