"""Proof by re-execution: risky ops re-run on identical copies of their inputs.

A race only shows when it fires, so repeats that agree prove little about an op that
accumulates in parallel. At a stressed step, :class:`StressMode` (a dispatch mode) keeps
the inputs of every op the knowledge table marks as nondeterministic on this device (every
op with ``every_op``), lets the model's own call run untouched, then re-runs the op
`runs` times (up to ESCALATION times more for a parallel op whose results all agreed) on
fresh copies of those inputs with this mode off and fingerprints each
result. More than one distinct result proves the op nondeterministic, whatever the repeats
did. Every re-run starts from the generator states the op started from (so an op that draws
random numbers is compared with itself), and the generators are left where the model's own
call left them.

The same pass is the census of risky ops at that step: every call is counted per module,
phase and op, stressed or not. Results are plain rows (``trace.STRESS_COLUMNS``).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..analysis.knowledge import applicable
from ..trace import STRESS_COLUMNS
from .difference import tensor_difference
from .fingerprint import fingerprint
from .oprecorder import (
    PASSTHROUGH_OPS,
    UNINITIALIZED_OPS,
    ModelOpMode,
    accumulate_arg,
    bump_versions,
    collective,
    op_name,
    without_scratch,
    written_arguments,
)
from .recorder import Recorder
from .structure import iter_tensors

CALLS_PER_OP = 4  # stressed calls of one op in one module per step (the rest are counted)
# A parallel op whose first runs all agreed runs on, up to this many times `runs`: CPU worker
# threads that slept through the model's serial ops wake late and add after the main thread
# for the first dozen or so runs (measured: 1 distinct result in the first 16 runs after a
# pause, 13-16 in the next 16), so a race needs its threads hot to show.
ESCALATION = 4
PARALLEL_GRAIN = 32768  # torch's internal GRAIN_SIZE: smaller CPU ops run on one thread


@dataclass
class OpStress:
    """What the stressed step saw of one op in one module call site and phase."""

    step: int
    epoch: int
    phase: str
    module: str
    op: str
    calls: int = 0  # calls of the op at this step
    stressed: int = 0  # of them, re-executed
    runs: int = 0  # re-executions of one call (the most any stressed call got)
    distinct: int = 0  # most distinct results seen for one call (1: all agreed)
    elements: int = 0  # of the first differing pair: elements of the differing output
    differing: int = 0  # elements that differ
    max_abs: float | None = None  # max |a - b| (floats and integers)
    max_ulp: int | None = None  # max distance in units in the last place (floats)
    rel_err: float | None = None  # max |a - b| / max |a|
    site: str = ""  # outside the model: the user's line that ran it (see ModelOpMode.site)
    seconds: float = 0.0  # time spent re-executing (kept out of the trace)

    def row(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in STRESS_COLUMNS}


class StressMode(ModelOpMode):
    """Counts the risky ops of one step and re-runs each `runs` times (0: count only)."""

    def __init__(
        self, recorder: Recorder, step: int, epoch: int, runs: int, *, every_op: bool = False,
        device: str = "cpu", env: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(recorder)
        self.step, self.epoch, self.runs = step, epoch, runs
        self.every_op = every_op
        self.device = device
        self.env = env
        self.ops: dict[tuple[str, str, str], OpStress] = {}

    def rows(self) -> list[dict[str, Any]]:
        return [entry.row() for entry in self.ops.values()]

    @property
    def seconds(self) -> float:
        return sum(entry.seconds for entry in self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if func.is_view or name in PASSTHROUGH_OPS or name in UNINITIALIZED_OPS or collective(func):
            return func(*args, **kwargs)
        phase, call = self.where()
        module, _ = self.located(call)
        site = self.site(phase, module, sys._getframe(1))
        out = self._stressed(func, args, kwargs, name, phase, module, site)
        if func._schema.is_mutable:
            bump_versions(func, args, kwargs)
        self.mark_nodes(phase, module, out, site)
        return out

    def _stressed(self, func: Any, args: tuple, kwargs: dict, name: str, phase: str,
                  module: str, site: str) -> Any:
        """Run the op, and re-run it on copies of its inputs where it may be
        nondeterministic."""
        accumulate = accumulate_arg(func, args, kwargs)
        if not (self.every_op or applicable(name, phase, self.device, self.env, accumulate)):
            return func(*args, **kwargs)
        label = name if accumulate is None else f"{name}(accumulate={accumulate})"
        entry = self.ops.get((phase, module, label))
        if entry is None:
            entry = self.ops[(phase, module, label)] = OpStress(
                self.step, self.epoch, phase, module, label)
        entry.calls += 1
        if self.runs < 2 or entry.stressed >= CALLS_PER_OP or entry.distinct > 1:
            return func(*args, **kwargs)
        with _disable_current_modes():
            pristine = _copies(args, kwargs)
            generators = _generators(func, args, kwargs, self.device)
            before = [g.get_state() for g in generators]
        out = func(*args, **kwargs)
        started = time.perf_counter()
        with _disable_current_modes():
            after = [g.get_state() for g in generators]
            try:
                limit = self.runs * ESCALATION if _parallel(args, kwargs) else self.runs
                _re_execute(entry, func, pristine, generators, before, self.runs, limit)
            finally:
                for g, state in zip(generators, after):
                    g.set_state(state)
        entry.stressed += 1
        entry.seconds += time.perf_counter() - started
        if site and (not entry.site or entry.distinct > 1):
            entry.site = site  # (the first call's, or the proving one's)
        return out


def _re_execute(
    entry: OpStress, func: Any, pristine: tuple[tuple, dict], generators: list[Any],
    before: list[torch.Tensor], runs: int, limit: int,
) -> None:
    """Run `func` `runs` times on copies of `pristine` (on to `limit` while every result
    agrees); record how many results differ."""
    seen: dict[tuple[str, ...], None] = {}
    first: list[torch.Tensor] | None = None
    done = 0
    while done < runs or (done < limit and len(seen) < 2):
        done += 1
        for g, state in zip(generators, before):
            g.set_state(state)
        args, kwargs = _copies(*pristine)
        outputs = _results(func, args, kwargs, func(*args, **kwargs))
        prints = tuple(fingerprint(t, stats=False).fp for t in outputs)
        if first is None:
            first, first_prints = outputs, prints
        elif prints != first_prints and not seen.keys() - {first_prints}:
            _measure(entry, first, outputs, first_prints, prints)  # the first differing pair
        seen[prints] = None
    entry.distinct = max(entry.distinct, len(seen))
    entry.runs = max(entry.runs, done)


def _parallel(args: tuple, kwargs: dict) -> bool:
    """Whether the op may run on several threads at once: on an accelerator, or on CPU with
    2+ threads and a tensor past torch's parallel grain."""
    tensors = [t for _, t in iter_tensors([list(args), kwargs])]
    if any(not t.is_cpu for t in tensors):
        return True
    return torch.get_num_threads() > 1 and any(t.numel() >= PARALLEL_GRAIN for t in tensors)


def _results(func: Any, args: tuple, kwargs: dict, out: Any) -> list[torch.Tensor]:
    """What an op produced: its returned tensors (less its scratch memory), and the
    arguments it wrote in place."""
    produced = [t for _, t in iter_tensors(without_scratch(func, (), {}, out)[2])]
    if func._schema.is_mutable:
        produced.extend(t for _, t in iter_tensors(written_arguments(func, args, kwargs)))
    return produced


def _copies(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with every tensor copied (the same tensor twice stays one copy)."""
    memo: dict[int, torch.Tensor] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = value.clone()
            return memo[id(value)]
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        return value

    return copy(tuple(args)), copy(dict(kwargs))


def _generators(func: Any, args: tuple, kwargs: dict, device: str) -> list[Any]:
    """The generators an op may draw from: any it was given, and the default generators of
    the CPU and (when in use) the current CUDA device. Not every random op names its
    generator in its schema (``aten.randperm.default`` does not), so all are kept."""
    given = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Generator)]
    out = [*given, torch.default_generator]
    if torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        out.append(torch.cuda.default_generators[torch.cuda.current_device()])
    return out


def _measure(
    entry: OpStress, a: list[torch.Tensor], b: list[torch.Tensor],
    a_prints: tuple[str, ...], b_prints: tuple[str, ...],
) -> None:
    """The size of the difference between two results of one op, at the first differing output."""
    i = next((i for i, (x, y) in enumerate(zip(a_prints, b_prints)) if x != y), None)
    if i is None:  # a different number of outputs
        entry.elements = entry.differing = max(len(a), len(b))
        return
    x, y = a[i].detach().cpu(), b[i].detach().cpu()
    if x.dtype.is_complex:
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    found = tensor_difference(x, y)
    entry.elements = max(x.numel(), y.numel())
    entry.differing = entry.elements if found["elements"] is None else found["elements"]
    entry.max_abs = _finite(found.get("max_abs_diff"))
    entry.max_ulp = found.get("max_ulp")
    entry.rel_err = _finite(found.get("rel_error"))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
