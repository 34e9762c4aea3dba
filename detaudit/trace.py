"""One run's record, in a versioned plain-data format that every later stage reads.

A trace holds no timestamps, host names or absolute paths (those live in the run folder's
``run.json``): the same run writes the same bytes.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import TraceError

# History:
#   1: first format: steps, columnar records and module calls, environment, probe config.
FORMAT_VERSION = 1
FORMAT_NAME = "detaudit-trace"

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
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise TraceError(f"{source} is not a detaudit trace")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise TraceError(
                f"{source} has trace format version {version!r}; this detaudit reads version "
                f"{FORMAT_VERSION} (upgrade detaudit or re-run the audit)"
            )
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
        path = Path(path)
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        buffer = io.BytesIO()
        with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as gz:
            gz.write(text.encode())
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(buffer.getvalue())
        tmp.replace(path)  # never leave a half-written trace under the real name
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace written by :meth:`save`."""
        path = Path(path)
        data = read_json(path, "trace")
        return cls.from_dict(data, source=f"trace {path}")


def read_json(path: Path, what: str) -> Any:
    """Parse a JSON file, gzip-compressed or not; one clear error naming it otherwise."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, EOFError, ValueError):
        raise TraceError(f"{what} {path} is truncated or corrupt") from None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
