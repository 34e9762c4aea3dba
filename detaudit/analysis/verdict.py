"""The verdict of an audit, computed once: its kind, its headline and its exit code.

Every command, the JUnit case, summary.json and every report take the verdict from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import EXIT_CRASH, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from ..runfolder import INTERRUPTED as CUT_SHORT
from ..runfolder import REFUSED
from ..trace import GRAD, MODEL_STATE, OPTIMIZER, OUTSIDE_MODEL, STATE, state_name
from ..words import counted, joined, one_based, op_place, steps_run
from .causes import cause_of, first_op, outside_origin_op
from .compare import (
    DETERMINISTIC,
    DIVERGENT,
    FAILED,
    ORIGIN,
    RUN_ENDED,
    CallFinding,
    Comparison,
)
from .ranks import NO_PROCESS_GROUP, NOT_CHECKED, RankAnalysis

MATCH, MISMATCH = "match", "mismatch"  # a run against a baseline or another run
INTERRUPTED = "interrupted"  # the run was stopped before its end (the headline: what it recorded)
PROVEN = "nondeterministic op"  # the repeats agreed, but re-execution proved an op is not
# a scanned step whose gradients alone differ: the parameter nearest the output among them
LAST_GRADIENT = "nearest the output of the gradients that differ"
# a step no module call began to differ in, whose op-level replay found the origin op in the
# loop's own code (a loss term): that op is the first divergence
OP_OUTSIDE = "origin op"
NOT_COMPARED = "not compared"  # one run, nothing to compare it with: neither pass nor divergence
EXIT_CODES = {
    DETERMINISTIC: EXIT_OK, MATCH: EXIT_OK,
    DIVERGENT: EXIT_DIVERGED, MISMATCH: EXIT_DIVERGED, PROVEN: EXIT_DIVERGED, FAILED: EXIT_CRASH,
    INTERRUPTED: EXIT_INTERRUPTED, NOT_COMPARED: EXIT_USAGE, REFUSED: EXIT_USAGE,
}


# The steps in which a freshly scripted module may still run unoptimized (TorchScript's
# profiling executor profiles its first calls, then optimizes).
SCRIPTED_WARM_UP_STEPS = 3


def exit_code(kind: str) -> int:
    """The process exit code of a verdict."""
    return EXIT_CODES[kind]


@dataclass
class Verdict:
    """What an audit concluded, in one word and one line."""

    kind: str  # deterministic, divergent, nondeterministic op, failed, interrupted, not compared
    headline: str
    first: dict[str, Any] | None  # the first divergence, 1-based epoch (None: none)
    loss_hidden: bool  # parameters (or gradients) diverged, the loss bit-identical

    @property
    def exit_code(self) -> int:
        return exit_code(self.kind)

    @property
    def passed(self) -> bool:
        return self.exit_code == EXIT_OK


def judge(
    c: Comparison, ops: dict[str, Any] | None = None, ranks: RankAnalysis | None = None,
    interrupted: str | None = None, zoom: Comparison | None = None,
    zoom_found: dict[str, Any] | None = None,
) -> Verdict:
    """The verdict of a comparison, naming the origin op when the drill-down found one and
    counting the ranks of a distributed audit. A run `interrupted` (its state, where it
    stopped) never passes and is no divergence: it is failed if detaudit failed there,
    refused if bad input was found once recording had begun, else interrupted, and its
    headline says what was recorded. A scanned
    run's `zoom` (its first divergent step replayed at module level) names the module; a zoom
    whose replays did not part where it ended (`zoom_found`, the zoom's status) is said to be,
    with what its replays did. An op
    that re-execution proved nondeterministic (``c.proven``) makes agreeing repeats a
    divergence found all the same; after a divergence it confirms the origin."""
    located = zoom if zoom is not None and zoom.first_step is not None else c
    first = _held_where_op_ran(first_divergence(located), located.tied, ops or {})
    first = _at_an_op_outside_the_model(first, ops or {}, located.origins)
    kind = c.verdict
    # what diverged while the loss stayed bit-identical, if anything did (parameters of a
    # run that ended are missing, not diverged; inference has no loss to hide it)
    hidden = c.drifted if (
        c.param_drift_step is not None and c.loss.first_step is None and c.first_step is not None
        and c.cause != "length" and bool(c.loss.per_step)
    ) else None
    headline = _headline(kind, located, first, hidden, ops or {}, c)
    if _rounded_away(c):
        headline += ("; the training stayed bit-identical: no loss, gradient or parameter "
                     "differs, in that step or after (the difference rounded away, or went "
                     "nowhere the training reads)")
    if c.proven and kind == DETERMINISTIC:
        kind, headline = PROVEN, _proven_headline(c)
    elif kind == DIVERGENT and (proofs := [p for p in stressed_op_rows(c, zoom, ops)
                                           if p.get("proven")]):
        headline += f"; proven by re-execution: {_confirming(proofs, first)['line']}"
    if zoom is None and (zoom_found or {}).get("status") == "intermittent":
        headline += f"; intermittent: {_intermittent(zoom_found)}"
    elif zoom is None and (zoom_found or {}).get("status") == "replay failed":
        headline += (f"; the zoom's replay of step {zoom_found.get('step')} failed "
                     f"({zoom_found.get('why')}), so the module and op are not named (the "
                     "cause is the scan's)")
    if ((zoom_found or {}).get("status") == "intermittent" and c.scripted
            and (c.first_step or 0) < SCRIPTED_WARM_UP_STEPS):
        headline += (f"; the model holds TorchScript modules ({', '.join(c.scripted)}), whose "
                     "first calls in a process run unoptimized: repeats sharing a process "
                     "part in their first steps (--isolation process compares separate ones)")
    if located is zoom:
        headline += f"; zoomed in on step {zoom.first_step} after a scan"
        if c.first_step is not None and zoom.first_step != c.first_step:  # a race fired sooner
            headline += (f", where a replay parted first (the runs first parted at step "
                         f"{c.first_step}: a race fires at different steps; the loss and step "
                         "lines below are those of the first runs)")
    if c.loss.nonfinite is not None:
        step, _, value = c.loss.nonfinite
        again = c.loss.finite_again
        headline += (f"; loss is {'NaN' if value == 'nan' else 'infinite'} "
                     + (f"at step {step}, finite again from step {again}" if again is not None
                        else f"at step {step}, whose update a GradScaler skipped"
                        if c.loss.skipped else f"from step {step}"))
    if ranks is not None:
        kind, headline = _with_ranks(kind, headline, ranks)
    elif kind == DETERMINISTIC and c.repeats < 2:
        kind = NOT_COMPARED
        headline = (f"NOT COMPARED: 1 run recorded over {_steps(c)}, and nothing to compare "
                    "it with" + ("" if interrupted else  # (stopped before the next repeat)
                                 " (an audit needs --repeats 2 or more; the trace is kept)"))
    if interrupted:  # no verdict on what was recorded: the headline says what it was
        stopped = (FAILED if interrupted.startswith("failed") else
                   REFUSED if interrupted.startswith(REFUSED) else INTERRUPTED)
        if kind == FAILED and c.failures and all(why == CUT_SHORT
                                                 for why in c.failures.values()):
            headline = _common(c)  # (the repeat it cut short did not fail)
        kind = stopped
        headline = f"{stopped.upper()} ({interrupted}); what was recorded: {headline}"
    return Verdict(kind, headline, first, hidden is not None)


def _intermittent(zoom_found: dict[str, Any]) -> str:
    """What the replays of an intermittent zoom did: where they parted before the step the
    zoom ended at (each such step is where a replay moved it), then how often that step was
    replayed without parting."""
    step = zoom_found.get("step")
    attempts = zoom_found.get("attempts") or []
    moved_to = list(dict.fromkeys([*(a["step"] for a in attempts), step]))[1:]
    tries = sum(1 for a in attempts if a["step"] == step and a.get("replayed", True))
    said = []
    if moved_to:
        said.append(f"replays parted earlier, at step {', then step '.join(map(str, moved_to))} "
                    "(the runs do differ from run to run)")
    said.append(f"step {step} did not part when replayed ({tries} {'try' if tries == 1 else 'tries'})"
                if tries else f"the tries ran out before step {step} was replayed")
    return "; ".join(said) + ", so the module and op are not named (the cause is the scan's)"


def junit_error(kind: str) -> str | None:
    """The JUnit error type of a verdict that is neither a pass nor a divergence (a crash,
    an interruption, a run compared with nothing); None for the others."""
    return None if EXIT_CODES.get(kind) in (EXIT_OK, EXIT_DIVERGED) else kind


def first_divergence(c: Comparison) -> dict[str, Any] | None:
    """Where the first divergent step parts: the RNG drawn outside any module where that
    leads; else its first origin call (unless the batch differs: the modules only see it);
    else its first state record (the parameters, for cause init); else, in a scanned step
    whose gradients alone differ, the gradient nearest the output; else its first record."""
    if c.first_step is None:
        return None
    step_index = next((i for s, _, i in (*c.steps, *c.later_steps) if s == c.first_step), None)
    epoch = one_based(c.epoch_of(c.first_step))
    gap = c.rng_gap
    if gap is not None:
        d = next((d for d in c.first_diffs
                  if (d.module, d.call, d.slot) == (*gap.after, "rng.in")), c.first_diffs[0])
        return {
            "step": gap.step, "epoch": epoch, "index": step_index, "phase": d.phase,
            "module": gap.module, "call": gap.after[1], "slots": [d.slot],
            "role": "rng draw outside any module", "outside": gap.where(),
            "differing": d.differing, "repeats": d.repeats,
        }
    state = [d for d in c.first_diffs if d.phase == STATE]
    # (data: the modules only see it; length: a run had ended, its records are missing)
    if c.origins and not (c.cause in ("data", "length") and state):
        o = c.origins[0]
        return {
            "step": o.step, "epoch": epoch, "index": step_index, "phase": o.phase,
            "module": o.module, "call": o.call, "slots": o.slots, "role": ORIGIN,
            "differing": o.differing, "repeats": o.repeats,
        }
    # the step's state comes before anything it computes (a parameter changed between steps
    # in one run only is that run's record alone, listed after repeat 0's)
    if c.cause == "init":  # the parameters are the finding, not the batch they then see
        state = [d for d in state if d.slot.startswith(MODEL_STATE)] or state
    d = state[0] if state else c.first_diffs[0]
    role = "first record"
    grads = [d for d in c.first_diffs if d.phase == GRAD]
    if grads and all(d.phase in (GRAD, OPTIMIZER) for d in c.first_diffs):
        # gradients (and the update made from them) in a scanned step: backward reaches the
        # parameters nearest the output first, so the last in the model's order is where
        # the difference can begin
        d, role = grads[-1], LAST_GRADIENT
    if c.cause == "length":  # (no record differs there: the shorter run's are missing)
        return {"step": d.step, "epoch": epoch, "index": step_index, "phase": None,
                "module": None, "call": None, "slots": [], "role": RUN_ENDED,
                "differing": d.differing, "repeats": d.repeats,
                "steps_run": steps_run(c.lengths)}
    return {
        "step": d.step, "epoch": epoch, "index": step_index, "phase": d.phase,
        "module": d.module, "call": d.call, "slots": [d.slot], "role": role,
        "differing": d.differing, "repeats": d.repeats,
    }


def _held_where_op_ran(first: dict[str, Any] | None, tied: dict[str, list[str]],
                       ops: dict[str, Any]) -> dict[str, Any] | None:
    """A tied parameter (an embedding's weight that is the output layer's too) is recorded
    under its first name: where its gradient is the first divergence and the drill-down's
    origin op ran in a module that holds it under another name, that module is named (its
    gradient sums what each holder's backward adds: the op tells whose differs). `tied`
    (the first name -> its others) is said in the first divergence either way."""
    if first is None or not tied or not first["slots"] or not all(
            s.startswith("param.") for s in first["slots"]):
        return first
    names = [state_name(first["module"], s) for s in first["slots"]]
    aliases = [(n, a) for n in names for a in tied.get(n, ())]
    if not aliases:
        return first
    op = first_op(ops)
    for name, alias in aliases if op.get("role") == ORIGIN else ():
        module, _, local = alias.rpartition(".")
        if module == op.get("module"):
            return {**first, "module": module, "slots": [f"param.{local}"],
                    "tied": [f"its {local} is tied to {name}"]}
    return {**first, "tied": [f"its {s.removeprefix('param.')} is also {', '.join(tied[n])}"
                              for s, n in zip(first["slots"], names) if n in tied]}


def _rounded_away(c: Comparison) -> bool:
    """Whether the runs part in a forward or backward record of one step only, and no loss,
    gradient or parameter differs (1 ULP in a place the training cannot feel: the
    difference rounded away before anything the training keeps)."""
    return (c.verdict == DIVERGENT and c.cause in ("forward", "backward")
            and c.param_drift_step is None and c.loss.first_step is None
            and bool(c.loss.per_step) and set(c.differing_by_step) == {c.first_step})


def _at_an_op_outside_the_model(first: dict[str, Any] | None, ops: dict[str, Any],
                                origins: list[CallFinding]) -> dict[str, Any] | None:
    """Where the drill-down's origin op ran outside the model, in a loss term, that op is
    the first divergence: no module call began the difference (each only saw the gradient
    entering the model's outputs), or only the gradient of a weight the loop also reads
    itself did (`w[idx]` in a penalty: its backward runs before the model's). A module
    call that began a difference the op cannot have made stays the origin (see
    outside_origin_op)."""
    op = outside_origin_op(ops, origins)
    if first is None or op is None:
        return first
    return {**first, "phase": op["phase"], "module": OUTSIDE_MODEL, "call": 0,
            "slots": [op["op"]], "role": OP_OUTSIDE}


def crash_line(crash: dict[str, Any]) -> str:
    """One line naming the crashed rank."""
    repeat = "" if crash.get("repeat") is None else f" in repeat {crash['repeat']}"
    return f"rank {crash['rank']} crashed{repeat}: {crash['message']}"


def _steps(c: Comparison) -> str:
    return counted(len(c.steps), "step")


def _headline(
    kind: str, c: Comparison, first: dict[str, Any] | None, hidden: str | None,
    ops: dict[str, Any], whole: Comparison) -> str:
    """`c` locates the first divergence (the zoom's comparison, where one was made); `whole`
    is the scan's, of every step compared: where the runs ended and which failed."""
    if kind == FAILED:
        return f"FAILED: {_stopped(c)}; {_common(c)}"
    if first is None:
        return f"DETERMINISTIC: {c.repeats} repeats bit-identical over {_steps(c)}"
    where = first.get("outside") or first["module"] or (
        first["slots"][0] if first["phase"] == STATE else "(model)")  # (the batch, an RNG)
    if first["phase"] == STATE and first["module"] and first["slots"][0].startswith(
            ("param.", "buffer.")):  # (a parameter by its name: `2.weight`, not `2`)
        where = state_name(first["module"], first["slots"][0])
    tied = "".join(f"; {said}" for said in first.get("tied") or ())
    part = (f"where {RUN_ENDED} ({first['steps_run']})" if first["role"] == RUN_ENDED
            else f"{first['phase']}, {where} ({first['role']}{tied})")
    text = (f"DIVERGENT: first at step {first['step']} (epoch {first['epoch']}), {part}; "
            f"cause: {cause_of(c, ops)[0]}")
    origin_op = first_op(ops)
    outside = ops.get("outside_dispatcher")
    if origin_op.get("role") == ORIGIN:
        text += f"; op: {origin_op['op']} in {op_place(origin_op)}"
        if origin_op.get("planted"):
            text += " (the planted fault, found where it was planted)"
    elif outside and outside.get("planted"):
        text += "; the planted fault, found where it was planted"
    elif outside:
        text += (f"; outside the dispatcher: no op in {outside['module']} differs on equal "
                 "inputs")
    if hidden:
        text += f"; the loss stayed bit-identical while {hidden} diverged"
    if first["step"] == whole.unapplied_step:
        text += (f"; step {first['step']} is the backward passes the run ended without "
                 "applying (no update followed them)")
    if whole.failures:
        text += f"; then {_stopped(whole)}"
    return text


def _proven_headline(c: Comparison) -> str:
    proven = c.proven
    more = f" (+{len(proven) - 1} more ops proven)" if len(proven) > 1 else ""
    agreed = (f"the {c.repeats} repeats agreed this time" if c.repeats > 1
              else "one repeat, so nothing to compare")
    return f"NONDETERMINISTIC OP: {proven[0].line()} ({agreed}){more}"


def stressed_op_rows(
    c: Comparison, zoom: Comparison | None = None, ops: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every stressed op (as StressedOp.to_dict() gives them), once per phase, module and op,
    the proven ones first: the run's stressed steps, then the zoomed step and the drill-down's
    replay."""
    rows = [op.to_dict() for op in c.stress + (zoom.stress if zoom is not None else [])]
    rows += [op for op in (ops or {}).get("stress") or [] if isinstance(op, dict)]
    unique: dict[tuple, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: not r.get("proven")):
        unique.setdefault((row.get("phase"), row.get("module"), row.get("op")), row)
    return list(unique.values())


def _confirming(proofs: list[dict[str, Any]], first: dict[str, Any] | None) -> dict[str, Any]:
    """The proven op in the module where the runs first parted, else the earliest proven."""
    where = (first["module"] or "(model)") if first else None
    return next((p for p in proofs if p.get("module") == where), proofs[0])


def _stopped(c: Comparison) -> str:
    """Which repeats stopped early, and why the first one did."""
    repeat, why = min(c.failures.items())
    more = f"; {len(c.failures)} of {c.repeats} repeats did not finish" if len(c.failures) > 1 else ""
    return f"repeat {repeat} stopped: {why}{more}"


def _common(c: Comparison) -> str:
    if c.repeats < 2:
        return f"only 1 repeat was recorded ({_steps(c)}), so nothing could be compared"
    if not c.common_steps:
        return "no step was completed by every repeat, so nothing could be compared"
    return f"the repeats agree over the {counted(c.common_steps, 'step')} every repeat completed"


def _with_ranks(kind: str, headline: str, ranks: RankAnalysis) -> tuple[str, str]:
    """The verdict of a distributed audit: a crash, then local divergences, then checks."""
    flagged = ranks.flagged
    if ranks.crash:
        return FAILED, f"FAILED: {crash_line(ranks.crash)}"
    if kind == FAILED:  # (checks flagged in what was recorded first are in the report)
        return kind, headline
    if kind == DIVERGENT:
        headline += (
            f"; on rank {ranks.primary_rank} ({len(ranks.divergent_ranks)} of "
            f"{ranks.world_size} ranks diverge)"
        )
        if flagged:
            headline += f"; {counted(len(flagged), 'cross-rank check')} flagged"
        return kind, headline
    if flagged:
        more = f" (+{len(flagged) - 1} more cross-rank checks flagged)" if len(flagged) > 1 else ""
        return DIVERGENT, f"DIVERGENT ACROSS RANKS: {flagged[0].detail}{more}"
    alone = [row.rank for row in ranks.per_rank if row.repeats < 2]
    if kind == DETERMINISTIC and alone:
        return NOT_COMPARED, (
            f"NOT COMPARED: {'rank' if len(alone) == 1 else 'ranks'} {joined(alone)} recorded in one run only, with nothing to "
            "compare it with run to run (the runs recorded other ranks: a launcher whose "
            "processes begin in another order in each run; the traces are kept)")
    if kind == DETERMINISTIC:
        # (in sync only where their parameters were compared: not an FSDP model's shards)
        apart = next((c for c in ranks.checks if c.key == "params" and c.status == NOT_CHECKED),
                     None)
        ranked = counted(ranks.world_size, "rank")
        headline += ("; 1 rank, nothing to compare across ranks" if ranks.world_size == 1
                     else f"; {ranked} that never joined a process group (each trains a model "
                     "of its own, compared run to run; nothing is all-reduced)"
                     if ranks.backend == NO_PROCESS_GROUP else
                     f"; {ranked} in sync" if apart is None else
                     f"; {ranked}, their parameters not compared ({apart.detail})")
    return kind, headline
