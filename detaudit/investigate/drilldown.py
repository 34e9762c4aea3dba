"""Op-level drill-down: replay the first divergent step op by op and name the op.

The module-level pass says which module call diverged first. The drill-down replays every
repeat up to that step (same seeds, same planted fault) with the op-level recorder on at
that step only, finds the first op whose inputs agree and whose outputs do not, and
measures the difference of that op's outputs: elements differing, max |a - b|, max ULP
distance, relative error -- from the copies the replays kept (a risky op's, a planted
one's), or else by replaying two repeats once more to capture just that op's outputs.

It imports torch only to replay a probe: `exec`'s own process drills into its command's
replays, whose processes measured what they kept, without it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..analysis.causes import BUILT_APART
from ..analysis.compare import ORIGIN, Comparison, OpFinding, compare, compare_ops
from ..analysis.knowledge import lookup
from ..analysis.stress import stressed_ops
from ..config import AuditConfig, Fault, ProbeSpec
from ..planting import plants_at
from ..trace import OP_PHASES, Trace, within

if TYPE_CHECKING:
    import torch

    from ..drivers.runner import ProbeFactory

# per repeat, how far the op outputs its replay kept are from the first repeat's, by op key
# (phase, module, call, op): see record.difference.differences_from (the first repeat's: {})
Measured = list[dict[tuple[str, str, int, str], dict[str, Any] | None]]

MAX_OPS_REPORTED = 20  # the origin ops first, then the first propagated ones


def drill_down(
    factory: ProbeFactory | None, config: AuditConfig, comparison: Comparison,
    spec: ProbeSpec | None = None, traces: list[Trace] | None = None,
    host_draws: set[tuple[str, int]] | None = None, measured: Measured | None = None,
) -> dict[str, Any] | None:
    """Plain data for the report: the differing ops of the first divergent step, the
    measured difference of the first origin op, and what is known about it. `traces`
    that already hold op-level records (``granularity="op"``, a zoom) spare the replay;
    `host_draws` are the module calls of their step where Python's or numpy's RNG advanced.
    `measured`: how far the op outputs those traces' replays kept (see OpPlan.keep_risky) are
    apart: an origin among them is measured so, as the traces compared it, with no replay;
    otherwise by replaying, and without a `factory` (a command's runs, which cannot be
    rebuilt here) its difference is not measured."""
    step = comparison.first_step
    if step is None:
        return None
    config = replace(config, granularity="module")
    replayed = comparison  # given traces are the ones `comparison` compared
    draws = set(host_draws or ())
    if traces is None:
        assert factory is not None, "a drill-down without traces replays the probe"
        from ..drivers.runner import OpPlan, run_repeat

        plan = OpPlan(steps=frozenset({step}), last_step=step, stress=frozenset({step}))
        traces = [run_repeat(factory, config, r, spec, ops=plan)[0]
                  for r in range(config.repeats)]
        replayed = compare(traces)
        draws |= plan.host_draws.get(step, set())
    findings = [f for f in compare_ops(traces) if f.step == step]
    origins = [f for f in findings if f.role == ORIGIN]
    unrecorded = _ops_not_recorded(replayed, step, traces)
    outside = None if unrecorded else _outside_dispatcher(replayed, step, origins, draws,
                                                          config.fault)
    out: dict[str, Any] = {
        "step": step,
        "reproduced": bool(findings) or outside is not None or unrecorded is not None,
        "outside_dispatcher": outside,
        "ops_not_recorded": unrecorded,
        # the risky ops of the step, re-executed in the last repeat's replay
        "stress": [op.to_dict() for op in stressed_ops(traces)],
        "ops": [_op_row(f) for f in (origins + [f for f in findings if f.role != ORIGIN])
                [:MAX_OPS_REPORTED]],
        "origin_ops": len(origins),
        "differing_ops": len(findings),
        "difference": None,
        "knowledge": [],
    }
    if origins:
        first = origins[0]
        out["difference"] = _kept_difference(first, measured) or (
            _capture_difference(factory, config, first, spec) if factory is not None else None)
        planted = _is_planted(config.fault, first)
        # the device the runs recorded the model on: exec's configuration knows none
        device = traces[0].env.get("device") or config.device
        # a planted fault's remedy is to stop planting it, not the op's known remedies
        out["knowledge"] = [] if planted else [
            {"op": first.op, **k.to_dict()} for k in lookup(first.op, first.phase, device)
        ]
        out["ops"][0].update(out["difference"] or {})
        out["ops"][0]["planted"] = planted
    return out


def _is_planted(fault: Fault | None, op: OpFinding) -> bool:
    """Whether `op` is where an op-level fault was planted."""
    return plants_at(fault, op.step, op.module, op.phase, op.op)


def _ops_not_recorded(modules: Comparison, step: int, traces: list[Trace]
                      ) -> dict[str, Any] | None:
    """The origin, a model the loop calls apart (see Comparison.side_models) that ran before
    the step began, whose ops were not recorded: what can be said instead (None when its
    ops were recorded, or it is no such model)."""
    origin = next((o for o in modules.origins if o.step == step), None)
    if origin is None or origin.module.split(".")[0] not in modules.side_models:
        return None
    r = traces[0].records
    if any(s == step and p in OP_PHASES and within(m, origin.module)
           for s, p, m in zip(r["step"], r["phase"], r["module"])):
        return None
    return {"module": origin.module, "text": (
        f"the ops of {origin.module} were not recorded: it is a model the loop calls apart, "
        "and it ran before the step began (its inputs and outputs are recorded, its ops are "
        "not), so the op is not named")}


def _outside_dispatcher(
    modules: Comparison, step: int, op_origins: list[OpFinding],
    host_draws: set[tuple[str, int]], fault: Fault | None = None,
) -> dict[str, Any] | None:
    """A module the replay shows as an origin again, with no op inside it differing on equal
    inputs: its difference comes from code the dispatcher does not see. With the module
    calls in which Python's or numpy's RNG advanced, the detectable such code; a module
    fault planted there (``--inject-fault`` without an op) is that code, and said so. An
    origin op of the same phase in another module claims nothing: the module records then
    place the difference where the op records do not, and the op is the evidence."""
    origin = next((o for o in modules.origins if o.step == step), None)
    if origin is None or any(within(op.module, origin.module) or op.phase == origin.phase
                             for op in op_origins):
        return None
    draws = sorted({m or "(model)" for m, _ in host_draws if within(m, origin.module)})
    # (a backward fault in a module that sends no gradient back to its input lands in the
    # gradient of a parameter inside it: that parameter's module is the origin)
    if fault is not None and not fault.op and (fault.phase, fault.step) == (
            origin.phase, step) and (origin.module == fault.module or (
                fault.phase == "backward" and within(origin.module, fault.module))):
        where = origin.module or "(model)"
        inside = "" if origin.module == fault.module else (
            f" (a parameter's gradient: {fault.named}'s input needs none)")
        return {
            "module": where, "phase": origin.phase, "host_rng_draws": draws,
            "planted": True,
            "text": f"the planted 1-ULP fault, added to {where}'s {origin.phase} result{inside} "
            "by a hook (outside any op), found where it was planted",
        }
    # (a buffer as built that differs is read, if anywhere, from step 0 on)
    built = [b for b in modules.built_buffers if within(b, origin.module)] if step == 0 else []
    return {
        "module": origin.module or "(model)", "phase": origin.phase,
        "host_rng_draws": draws, "built_buffers": built,
        "text": f"no op inside {origin.module or '(model)'} differs on equal inputs, yet its "
        f"{origin.phase} result does: the difference comes from code outside PyTorch's "
        "dispatcher (a C++/CUDA extension called directly, a Python-side random draw, a "
        "host-side computation)" + (
            f"; Python or numpy random draws ran in {', '.join(draws)}" if draws else "") + (
            f"; its buffers {', '.join(built)} differ as the model was built: where an op "
            f"reads them, that op's inputs differ, so none differs on equal inputs ({BUILT_APART})"
            if built else ""),
    }



def _op_row(f: OpFinding) -> dict[str, Any]:
    return {
        "op": f.op, "module": f.module or "(model)", "call": f.call, "phase": f.phase,
        "index": f.index, "role": f.role, "outputs": f.slots, "differing": f.differing,
        "repeats": f.repeats, **({"site": f.site} if f.site else {}),
        **({"uninitialized": True} if f.uninitialized else {}),
    }


def _kept_difference(origin: OpFinding, measured: Measured | None) -> dict[str, Any] | None:
    """How far apart the origin op's outputs are in the replays that kept them (None where
    they did not keep them, or they agree)."""
    key = origin.key[1:]
    if not measured:
        return None
    return next((found for repeat in _others_first(origin, len(measured))
                 if (found := measured[repeat].get(key))), None)


def _others_first(origin: OpFinding, repeats: int) -> list[int]:
    """The repeats besides 0 to measure the origin op in: the one that differed first."""
    return [origin.other_repeat] + [r for r in range(1, repeats) if r != origin.other_repeat]


def _capture_difference(
    factory: ProbeFactory, config: AuditConfig, origin: OpFinding,
    spec: ProbeSpec | None,
) -> dict[str, Any] | None:
    """Replay repeat 0 and then the differing repeats, keeping only the origin op's outputs,
    and measure how far apart they are. An intermittent difference may not show again: the
    other repeats are tried in turn, and None means none of them differed this time."""
    from ..record.difference import first_difference

    reference = _capture(factory, config, origin, 0, spec)
    if reference is None:
        return None
    for repeat in _others_first(origin, config.repeats):  # (each replayed only if needed)
        found = first_difference(reference, _capture(factory, config, origin, repeat, spec) or [])
        if found is not None:
            return found
    return None


def _capture(
    factory: ProbeFactory, config: AuditConfig, origin: OpFinding, repeat: int,
    spec: ProbeSpec | None,
) -> list[torch.Tensor] | None:
    from ..drivers.runner import OpPlan, run_repeat

    plan = OpPlan(steps=frozenset(), last_step=origin.step, capture=origin.key[1:])
    run_repeat(factory, config, repeat, spec, ops=plan)
    return next((m.captured for m in plan.modes if m.captured is not None), None)
