"""One run's record, in a versioned plain-data format that every later stage reads.

A trace holds no timestamps, host names or absolute paths (those live in the run folder's
``run.json``): the same run writes the same bytes. This module owns the format's
vocabulary; the recorders write it and the analysis reads it, and neither defines it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import TraceError
from .storage import atomic_write, check_format, dump_json, read_json

# History:
#   1: first format: steps, columnar records and module calls, environment, probe config.
FORMAT_VERSION = 1
FORMAT_NAME = "detaudit-trace"

# The format, version 1 (gzip-compressed JSON, keys sorted):
#
#   probe     what ran: PROBE_SPEC (the probe description, detaudit.config.ProbeSpec as a
#             dict), PROBE_CONFIG (detaudit.config.AuditConfig as a dict) and, in a
#             distributed audit, PROBE_DISTRIBUTED (the rank's sampler indices, loading
#             RNG states and parameters as built).
#   repeat    which repeat of the audit this is (0-based).
#   env       the determinism-relevant environment (versions, device, threads, flags).
#   steps     one StepInfo per step: global step, epoch, index in epoch, exact losses.
#   records   columnar: one row per fingerprinted tensor, RECORD_COLUMNS; a row's key is
#             (step, phase, module, call, slot).
#   calls     columnar: the module call tree of every step, CALL_COLUMNS.
#   failure   why the repeat stopped early (null when it ran to the end).
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
OP_PHASES = (OP_FORWARD, OP_BACKWARD)
PHASES = (STATE, FORWARD, BACKWARD, GRAD, OPTIMIZER, OUTPUT, *OP_PHASES)
PROBE_SPEC, PROBE_CONFIG, PROBE_DISTRIBUTED = "info", "config", "distributed"

RECORD_COLUMNS = (
    "step", "phase", "module", "call", "slot", "fp", "shape", "dtype", "norm", "absmax", "nonfinite",
)
CALL_COLUMNS = ("step", "module", "index", "parent")


@dataclass
class StepInfo:
    """What happened at one step besides the records: where it is, its exact losses."""

    step: int
    epoch: int
    index: int  # step within its epoch
    losses: dict[str, str] = field(default_factory=dict)  # name -> float.hex, exact
    optimizer_stepped: bool = False
    lr: list[float] = field(default_factory=list)
    scale: float | None = None  # GradScaler scale after the step

    def loss_values(self) -> dict[str, float]:
        """The exact loss values as floats."""
        return {name: float.fromhex(v) for name, v in self.losses.items()}


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

    # -- building ------------------------------------------------------------------------
    def add_record(self, step: int, key: tuple[str, str, int, str], print_: Any) -> None:
        """Append one record (key = phase, module, call, slot)."""
        phase, module, call, slot = key
        cols = self.records
        for name, value in (
            ("step", step), ("phase", phase), ("module", module), ("call", call), ("slot", slot),
            ("fp", print_.fp), ("shape", list(print_.shape)), ("dtype", print_.dtype),
            ("norm", _finite(print_.norm)), ("absmax", _finite(print_.absmax)),
            ("nonfinite", print_.nonfinite),
        ):
            cols[name].append(value)

    def add_call(self, step: int, module: str, index: int, parent: int) -> None:
        """Append one module call (parent = position of the enclosing call in its step)."""
        for name, value in (("step", step), ("module", module), ("index", index), ("parent", parent)):
            self.calls[name].append(value)

    # -- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records["fp"])

    def frame(self):
        """The records as a pandas DataFrame (one row per record, in execution order)."""
        import pandas as pd

        return pd.DataFrame({c: self.records[c] for c in RECORD_COLUMNS})

    # -- plain data ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The trace as JSON-able plain data."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "probe": self.probe,
            "repeat": self.repeat,
            "env": self.env,
            "steps": [vars(s) for s in self.steps],
            "records": self.records,
            "calls": self.calls,
            "failure": self.failure,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "trace") -> Trace:
        """Rebuild a trace; one clear error for anything that is not a trace we can read."""
        check_format(data, FORMAT_NAME, FORMAT_VERSION, source,
                     "upgrade detaudit or re-run the audit")
        try:
            records = {c: list(data["records"][c]) for c in RECORD_COLUMNS}
            calls = {c: list(data.get("calls", {}).get(c, [])) for c in CALL_COLUMNS}
            if len({len(v) for v in records.values()}) > 1:
                raise ValueError("record columns of different lengths")
            steps = [StepInfo(**s) for s in data["steps"]]
            return cls(
                probe=dict(data.get("probe", {})), repeat=int(data.get("repeat", 0)),
                env=dict(data.get("env", {})), steps=steps, records=records, calls=calls,
                failure=data.get("failure"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{source} is damaged: {exc}") from None

    def save(self, path: str | Path) -> Path:
        """Write the trace as gzip-compressed JSON (deterministic bytes); return the path."""
        return atomic_write(path, dump_json(self.to_dict(), compress=True))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace written by :meth:`save`."""
        path = Path(path)
        data = read_json(path, "trace")
        return cls.from_dict(data, source=f"trace {path}")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
