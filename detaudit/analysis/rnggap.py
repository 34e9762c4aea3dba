"""RNG draws outside any module: the torch RNG moved between two module calls.

A module that draws (dropout, a sampler's randperm) records the torch RNG state as it
starts (``rng.in``) and ends (``rng.out``). Walked in time order (the call tree, depth
first), the step's RNG states agree up to some point. When the first state that differs is
a call's *start*, and every state before it agreed, no submodule drew the difference: the
step function, a hook or a logger drew from the global RNG in between (or, inside a
module's call, that module's own code). That is the origin, not the next module that
draws (which only starts from another state).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

from ..trace import FORWARD, STATE, Trace

RNG_IN, RNG_OUT = "rng.in", "rng.out"


@dataclass(frozen=True)
class RngGap:
    """Where the torch RNG moved outside any module in one step."""

    step: int
    before: str  # the last agreeing point: "the start of step k", "<module>" (after it ended)...
    after: tuple[str, int]  # the call that started from a different RNG state
    inside: tuple[str, int] | None = None  # the call whose own code drew (None: no module's)

    @property
    def module(self) -> str:
        return self.after[0]

    def where(self) -> str:
        between = f"between {self.before} and {_name(self.after)}"
        if self.inside is None:
            return f"outside any module, {between}"
        return f"in {_name(self.inside)}'s own code, outside its submodules, {between}"


def rng_gap(trace: Trace, differing: Collection[tuple], step: int) -> RngGap | None:
    """The RNG gap of `step` in `trace` (repeat 0), given the keys (step, phase, module,
    call, slot) that differ across repeats; None when the first RNG difference of the step
    is inside a module, or the step has no module-level RNG records."""
    if any(k[0] == step and k[1] == STATE and k[4].startswith("rng.") for k in differing):
        return None  # the step started from another RNG state: the state says so
    rng = {
        (m, c, s) for st, p, m, c, s in zip(*(trace.records[k] for k in (
            "step", "phase", "module", "call", "slot")))
        if st == step and p == FORWARD and s in (RNG_IN, RNG_OUT)
    }
    if not rng:
        return None
    before = f"the start of step {step}"
    for call, slot, parent in _events(trace, step):
        if (call[0], call[1], slot) not in rng:
            continue
        if (step, FORWARD, call[0], call[1], slot) in differing:
            return RngGap(step, before, call, parent) if slot == RNG_IN else None
        before = f"the start of {_name(call)}" if slot == RNG_IN else _name(call)
    return None


def _events(
    trace: Trace, step: int
) -> list[tuple[tuple[str, int], str, tuple[str, int] | None]]:
    """The step's module calls as (call, rng.in, parent) at their start and (call, rng.out,
    parent) at their end, in time order: the call tree walked depth first."""
    c = trace.calls
    calls = [(m, i, p) for s, m, i, p in zip(c["step"], c["module"], c["index"], c["parent"])
             if s == step]
    children: dict[int, list[int]] = defaultdict(list)
    for position, (_, _, parent) in enumerate(calls):
        children[parent].append(position)
    out: list[tuple[tuple[str, int], str, tuple[str, int] | None]] = []
    stack: list[tuple[int, bool]] = [(p, False) for p in reversed(children[-1])]
    while stack:
        position, ended = stack.pop()
        module, index, parent = calls[position]
        call, enclosing = (module, index), calls[parent][:2] if parent >= 0 else None
        if ended:
            out.append((call, RNG_OUT, enclosing))
            continue
        out.append((call, RNG_IN, enclosing))
        stack.append((position, True))
        stack.extend((p, False) for p in reversed(children[position]))
    return out


def _name(call: tuple[str, int]) -> str:
    module, index = call
    return f"{module or '(model)'}" + (f" (call {index})" if index else "")
