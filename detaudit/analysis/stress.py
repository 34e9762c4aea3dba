"""What the stress re-executions proved, over every stressed step of a run's traces.

Rows come from the traces (``trace.stress``, written by :mod:`detaudit.record.stress`); an
op is *proven* nondeterministic when one of its calls gave two or more distinct results on
identical inputs. Epochs here are 0-based, like the traces'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..trace import Trace
from ..words import counted, op_place
from .knowledge import lookup


@dataclass
class StressedOp:
    """One risky op in one module and phase, over every stressed step."""

    phase: str
    module: str
    op: str
    calls: int = 0
    stressed: int = 0
    runs: int = 0
    distinct: int = 1
    first_epoch: int = 0  # the first epoch whose stressed step ran it
    steps: list[int] = field(default_factory=list)
    proof: dict[str, Any] | None = None  # the first row that proved it, with the difference
    site: str = ""  # outside the model: the user's line (the proving call's; in backward, its forward op's)

    @property
    def proven(self) -> bool:
        return self.distinct > 1

    @property
    def base_op(self) -> str:
        """The op without its argument note: aten.index_put(accumulate=True) -> aten.index_put."""
        return self.op.partition("(")[0]

    def line(self) -> str:
        """One line saying what the re-executions showed."""
        where = op_place({"module": self.module or "(model)", "site": self.site})
        if not self.proven:
            return (f"{self.op} in {where} ({self.phase}) gave one result in {counted(self.runs, 'run')} "
                    f"on identical inputs")
        step, epoch = ((self.proof["step"], self.proof["epoch"]) if self.proof
                       else (self.steps[0], self.first_epoch))
        return (f"{self.base_op} in {where} ({self.phase}, step {step}, epoch {epoch + 1}) gave "
                f"{self.distinct} different results in {self.runs} runs on identical inputs")

    def to_dict(self) -> dict[str, Any]:
        known = lookup(self.base_op, self.phase)
        return {
            "phase": self.phase, "module": self.module or "(model)", "op": self.op,
            "calls": self.calls, "stressed": self.stressed, "runs": self.runs,
            "distinct": self.distinct, "proven": self.proven, "epoch": self.first_epoch + 1,
            "steps": self.steps, "proof": self.proof, "line": self.line(),
            **({"site": self.site} if self.site else {}),
            "what": known[0].what if known else "",
            "remedy": known[0].remedy if known else "",
        }


def stressed_ops(traces: list[Trace]) -> list[StressedOp]:
    """Every stressed op of the traces: the proven ones first (earliest step first), then the
    rest in the order they were first seen."""
    found: dict[tuple[str, str, str], StressedOp] = {}
    for trace in traces:
        for row in trace.stress_rows():
            key = (row["phase"], row["module"], row["op"])
            op = found.get(key)
            if op is None:
                op = found[key] = StressedOp(*key, first_epoch=row["epoch"])
            op.calls += row["calls"]
            op.stressed += row["stressed"]
            op.first_epoch = min(op.first_epoch, row["epoch"])
            if row["step"] not in op.steps:
                op.steps.append(row["step"])
            if row["distinct"] > 1 and op.proof is None:
                op.proof = {k: row[k] for k in ("step", "epoch", "elements", "differing",
                                                 "max_abs", "max_ulp", "rel_err")}
                op.site = row["site"] or op.site
                # (the proving step's own counts: another step's runs are no part of it)
                op.runs, op.distinct = row["runs"], row["distinct"]
            elif op.proof is None:
                op.runs = max(op.runs, row["runs"])
            op.site = op.site or row["site"]
    ops = list(found.values())
    proven = sorted((o for o in ops if o.proven), key=lambda o: o.proof["step"])
    return proven + [o for o in ops if not o.proven]
