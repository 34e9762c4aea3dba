"""The content every report shows, in reading order, as plain text blocks (renderers escape)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

from ..analysis.compare import FAILED, GRADIENTS_DIFFER, RUN_ENDED
from ..analysis.verdict import INTERRUPTED, LAST_GRADIENT, OP_OUTSIDE, crash_line
from ..trace import BACKWARD, FORWARD, GRAD, LOADER_BATCH, OPTIMIZER
from ..words import counted, op_place

FORWARD_BACKWARD = (FORWARD, BACKWARD)

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 120
CLIP = 2000  # characters kept of one free-text value (failure messages, env values)
FINDINGS_SHOWN = 20  # rows of one cross-rank check's findings in a report
MAP_ROLES = {  # a map cell's role -> its column in the table
    "origin": "origin at steps", "contains-origin": "contains an origin at steps",
    "propagated": "propagated at steps",
    GRADIENTS_DIFFER: "parameter gradients differ at scanned steps (a zoomed step: the "
    "columns before)",
}
ROLE_TEXT = {
    "origin": "origin: the difference starts in this call (its inputs agree)",
    "contains-origin": "contains an origin further down its calls",
    "propagated": "propagated: it only passes on a difference that started earlier",
    "first record": "first differing record (no single origin call was found)",
    LAST_GRADIENT: "of the parameters whose gradients differ (a scanned step: no module "
    "records), the one nearest the output in the model's order: backward reaches it first, so "
    "the difference begins there or nearer the output",
    OP_OUTSIDE: "the op-level replay found where the difference began: in an op of the "
    "loop's own code, outside the model (a loss term), named here; the modules only saw "
    "what it made",
    "rng draw outside any module": "the torch RNG moved outside any module (the step "
    "function, a hook, a logger): the next module that draws only starts from another state",
}


@dataclass
class Text:
    """A paragraph; `strong` for the verdict line."""

    text: str
    strong: bool = False


@dataclass
class Code:
    """Preformatted text: a command line or a sparkline."""

    text: str


@dataclass
class Table:
    """A table of plain strings; `key` names it for truncation, `omitted` counts rows cut."""

    caption: str
    headers: list[str]
    rows: list[list[str]]
    key: str = ""
    fold: bool = False  # long: folded (or scrolled) where the format can
    omitted: int = 0


@dataclass
class Figure:
    """A plot drawn by formats that can draw; the others show `fallback`."""

    kind: str  # loss, drift or map
    fallback: list[Block] = field(default_factory=list)


Block = Union[Text, Code, Table, Figure]


@dataclass
class Section:
    """One titled part of a report."""

    key: str
    title: str
    blocks: list[Block]


def sections(summary: dict[str, Any], limits: dict[str, int] | None = None) -> list[Section]:
    """The report's sections in the order a reader needs them; `limits` caps tables by key."""
    limits = limits or {}
    builders = (
        _verdict, _reproduce, _failures, _ranks, _first, _cause, _loss, _size, _stress, _census,
        _verify,
        _map, _env, _modules,
    )
    found = [build(summary) for build in builders]
    out = [s for s in found if s is not None and s.blocks]
    for section in out:
        for block in _tables(section.blocks):
            if block.key in limits:
                _cap(block, limits[block.key])
    return out


def title(summary: dict[str, Any]) -> str:
    """The report's title: the probe's name."""
    return f"detaudit report: {summary.get('probe', {}).get('name') or 'run'}"


def omitted(parts: list[Section]) -> list[str]:
    """Captions of the tables that lost rows to a limit, with how many."""
    tables = [t for s in parts for t in _tables(s.blocks)]
    return [f"{t.caption} ({t.omitted} rows)" for t in tables if t.omitted]


def num(value: Any, digits: int = 4) -> str:
    """A number for people: `digits` significant digits, '–' for none."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "missing" if math.isinf(value) else f"{value:.{digits}g}"
    return str(value)


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """One block character per value (per bucket past `width`), log-scaled; ▁ is exactly 0."""
    if len(values) > width:
        size = math.ceil(len(values) / width)
        values = [max(values[i:i + size]) for i in range(0, len(values), size)]
    logs = [math.log10(v) for v in values if 0 < v < math.inf]
    low, high = (min(logs), max(logs)) if logs else (0.0, 0.0)
    span = high - low or 1.0

    def spark(v: float) -> str:
        if v <= 0:
            return SPARKS[0]
        if math.isinf(v):
            return SPARKS[-1]
        return SPARKS[1 + round((math.log10(v) - low) / span * (len(SPARKS) - 2))]

    return "".join(spark(v) for v in values)


def epoch_starts(summary: dict[str, Any]) -> list[tuple[int, int]]:
    """(epoch, first global step) of every epoch."""
    seen: dict[int, int] = {}
    for s in summary.get("steps", []):
        seen.setdefault(s["epoch"], s["step"])
    return sorted(seen.items())


# how near the origin a call's role is (of a module's calls in a step, the map shows the
# nearest)
ROLE_RANK = {"propagated": 0, GRADIENTS_DIFFER: 0, "contains-origin": 1, "origin": 2}


def map_rows(summary: dict[str, Any]) -> dict[str, dict[int, dict[str, str]]]:
    """module -> step -> phase -> role, modules in order of first appearance; of a module
    called several times in a step (an RNN's cell), the role nearest the origin."""
    grid: dict[str, dict[int, dict[str, str]]] = {}
    for cell in summary.get("map", []):
        phases = grid.setdefault(cell["module"], {}).setdefault(cell["step"], {})
        had = phases.get(cell["phase"])
        if had is None or ROLE_RANK.get(cell["role"], 0) > ROLE_RANK.get(had, 0):
            phases[cell["phase"]] = cell["role"]
    return grid


def clip(text: str, size: int = CLIP) -> str:
    """`text`, cut to `size` characters with a marker."""
    return text if len(text) <= size else text[:size] + f" … ({len(text) - size} more characters)"


# -- sections ------------------------------------------------------------------------------


def _verdict(s: dict[str, Any]) -> Section:
    blocks = [Text(s["headline"], strong=True), Text(_run_line(s))]
    if s.get("check"):  # a baseline check: the run's own verdict gives way to the check's
        details = [line for line in s["check"]["message"].splitlines() if line != s["headline"]]
        blocks.append(Text(f"baseline {s['check']['baseline']}" + (
            f": {' '.join(details)}" if details else "")))
        apart = s["check"].get("steps_apart") or []
        if len(apart) > 1:
            total = s["check"].get("steps_apart_total", len(apart))
            shown = f"the first {len(apart)} of {total}" if total > len(apart) else str(total)
            blocks.append(Table(
                f"steps where the baseline and this run differ ({shown})",
                ["step", "epoch", "records that differ", "loss, relative difference"],
                [[str(r["step"]), num(r["epoch"]), str(r["records"]), num(r["loss"], 3)]
                 for r in apart], key="steps_apart", fold=True))
    if s.get("updates_without_backward"):
        blocks.append(Text(f"Note: {updates_note(s['updates_without_backward'])}"))
    if s.get("short_epochs"):
        blocks.append(Text(f"Note: {short_epochs_note(s['short_epochs'])}"))
    if s.get("calls_unseen"):
        blocks.append(Text(f"Note: {CALLS_UNSEEN_NOTE}"))
    if s.get("loader_in_a_thread"):
        blocks.append(Text(f"Note: {LOADER_IN_A_THREAD_NOTE}"))
    if s.get("inferred"):
        blocks.append(Text(f"Note: {INFERRED_NOTE}"))
    if s.get("epochs_unseen"):
        blocks.append(Text(f"Note: {EPOCHS_UNSEEN_NOTE}"))
    if s.get("first_pass_unfinished"):
        blocks.append(Text(f"Note: {first_pass_note(s)}"))
    if s.get("epochs_spanned"):
        blocks.append(Text(f"Note: {epochs_spanned_note(s)}"))
    if seeded_over := seeded_over_note(s):
        blocks.append(Text(f"Note: {seeded_over}"))
    if planted_after := planted_after_note(s):
        blocks.append(Text(f"Note: {planted_after}"))
    return Section("verdict", "Verdict", blocks)


CALLS_UNSEEN_NOTE = (
    "no call of the model was seen as the loop's training call: it runs inside a compiled "
    "function or a torch.func transform, trains in eval mode, or is run by calling its "
    "forward() directly (model.forward(x), which runs no hooks, rather than model(x)). It "
    "was found at its "
    "optimizer's first update, as the module holding the parameters it updates; its steps are "
    "recorded from the batches the training DataLoader yields, the losses, the gradients and "
    "the parameters, and a zoomed step module by module where its calls can be seen "
    "(compiled code runs eagerly there; calls inside a torch.func transform are not seen).")


LOADER_IN_A_THREAD_NOTE = (
    "a DataLoader was iterated in another thread than the training loop's (a prefetching "
    "thread): when the loop takes its batches is a race, and which loader feeds the steps "
    "cannot be told, so no loader's batches are recorded as the batches of steps (the "
    "model's inputs are) and no pass is counted as an epoch (--max-epochs does not stop the "
    "run: use --max-steps).")


INFERRED_NOTE = (
    "recorded as inference, a step per call of the model: its first call was in eval mode or "
    "without gradients and no optimizer existed (a run that trains after it is recorded as "
    "training from there, unless a step limit ended it first: give --mode train, or "
    "watch(mode='train'), to record only training).")


EPOCHS_UNSEEN_NOTE = (
    "--max-epochs had no effect: no DataLoader fed the training steps (an epoch is a pass "
    "over the DataLoader whose batches the steps train on), so every step is in epoch 1 and "
    "the run went on (use --max-steps).")


def seeded_over_note(s: dict[str, Any]) -> str | None:
    """exec with --seed found nothing, in a script that seeds itself: --seed fixed what the
    script's own seeding leaves to each run (the hash seed above all), so say how to audit
    that (a sentence to put after "note: "); None otherwise."""
    code = s.get("code_seed")
    exec_seeded = ((s.get("probe") or {}).get("kind") == "command"
                   and (s.get("config") or {}).get("seed") is not None)
    if not (exec_seeded and s.get("verdict") == "deterministic" and code):
        return None
    return (f"the script seeds torch itself ({code[0]} at {code[1] or 'a library call'}), and "
            "--seed also fixed what its seeding leaves to each run (PYTHONHASHSEED, and any RNG "
            "it does not seed): run without --seed to audit the script's own seeding")


def planted_after_note(s: dict[str, Any]) -> str | None:
    """A fault planted at a step after the one where the runs first part: what was found
    there is not the fault, and the fault's own effect, mixed with it, was not located (a
    sentence to put after "note: "); None otherwise."""
    fault = (s.get("config") or {}).get("fault")
    first = (s.get("first_divergence") or {}).get("step")
    if not fault or first is None or not isinstance(fault.get("step"), int) \
            or fault["step"] <= first:
        return None
    return (f"the fault planted at step {fault['step']} ({planted_where(fault)}) comes after "
            f"step {first}, where the runs already part, so it is not what was found there; "
            "its own effect, mixed with that divergence's, is not located (plant it at step "
            f"{first} or before to see it found, or fix this divergence first)")


def planted_where(fault: dict[str, Any]) -> str:
    """A planted fault as --inject-fault names it: MODULE[/OP]@PHASE:STEP."""
    op = f"/{fault['op']}" if fault.get("op") else ""
    return f"{fault.get('module')}{op}@{fault.get('phase')}:{fault.get('step')}"


def fork_text(fork: dict[str, Any]) -> str:
    """Where the repeats first took other paths (after "control flow forked "): the record
    some repeats lack, and what its lack means where it is a DataLoader's batch."""
    call = f", call {fork['call']}," if fork.get("call") else ""
    loader = (" (a batch the DataLoader yielded: the repeats' steps took other numbers of its "
              "batches)" if fork["slot"].startswith(LOADER_BATCH) else "")
    return (f"at step {fork['step']}: {fork['module'] or '(model)'} {fork['slot']}{call} is "
            f"missing in {counted(fork['missing'], 'repeat')}{loader}")


def epochs_spanned_note(s: dict[str, Any]) -> str:
    """That ``--max-epochs`` never fired: the runs' steps spanned passes over the training
    DataLoader (a sentence to put after "note: ")."""
    return (f"--max-epochs did not end the runs: they made {s['epochs_spanned']} passes over the "
            "training DataLoader, as their steps spanned passes (a step that accumulates more "
            "batches than a pass holds, as Ultralytics' nominal batch of 64 does on a small "
            "data set), and a run ends only as a step begins: bound it with --max-steps")


def first_pass_note(s: dict[str, Any]) -> str:
    """That ``--max-epochs`` never fired: the runs ended in their first pass over the
    training DataLoader (a sentence to put after "note: ")."""
    length = s["first_pass_unfinished"]["batches"]
    long = (f", which is {length:,} batches long" if isinstance(length, int) else
            ", which has no length (its sampler or dataset has no len(): an endless sampler, "
            "as detectron2's TrainingSampler, never ends a pass)")
    return ("--max-epochs did not end the runs: they ended within their first pass over the "
            f"training DataLoader{long}, by a step count of the script's own, or their pass "
            "never ends (a sampler that draws with replacement, RandomSampler(replacement="
            "True, num_samples=...), makes one as long as num_samples: --max-steps bounds "
            "such a run).")


def short_epochs_note(short: dict[str, Any]) -> str:
    """That the probe's data ran out before ``--steps`` (a sentence to put after "note: ")."""
    had = sorted({n for n in short["had"].values()})
    return (f"--steps {short['asked']} asked for {short['asked']} steps per epoch; the probe's "
            f"data had {' or '.join(map(str, had))} in "
            f"{'epoch' if len(short['had']) == 1 else 'epochs'} "
            f"{', '.join(short['had'])}, and those were all recorded")


def updates_note(steps: list[int]) -> str:
    """What optimizer updates with no backward pass in their step mean (a sentence to put
    after "note: ")."""
    shown = ", ".join(str(k) for k in steps[:5]) + (f", ... ({len(steps)} in all)"
                                                    if len(steps) > 5 else "")
    return (f"at {'step' if len(steps) == 1 else 'steps'} {shown} the optimizer updated with no backward pass in the "
            "step: it stepped again on the gradients it had already used (e.g. "
            "scaler.step(optimizer) followed by optimizer.step()), unless the script sets "
            "gradients without backward.")


def _run_line(s: dict[str, Any]) -> str:
    probe = s.get("probe", {})
    config = s.get("config", {})
    parts = [f"probe {probe.get('name', '?')} ({probe.get('kind', '?')})"]
    if probe.get("preset"):
        parts.append(f"preset {probe['preset']}")
    if s.get("model_class"):
        parts.append(f"model {s['model_class']}")
    steps = s.get("steps", [])
    lengths = s.get("steps_per_repeat") or [len(steps)]
    epochs = s.get("epochs_per_repeat") or [len({x["epoch"] for x in steps})]
    repeats = s.get("repeats")
    runs = counted(repeats, "repeat") if isinstance(repeats, int) else "? repeats"
    if len(set(lengths)) == 1 and len(set(epochs)) == 1:
        parts.append(f"{runs}, {counted(epochs[0], 'epoch')}, {counted(lengths[0], 'step')} each")
    else:
        parts.append(f"{runs}: " + " and ".join(
            f"{counted(n, 'step')} in {counted(e, 'epoch')}" for n, e in zip(lengths, epochs))
            + (" (not every run ran to its end)" if s.get("verdict") in (INTERRUPTED, FAILED)
               else " (the runs differ in length)"))
    # the device the model was on, as the runs recorded it (exec and watch choose none)
    device = (s.get("env") or {}).get("device") or config.get("device")
    for key, value in (("mode", config.get("mode")), ("device", device),
                       ("seed", config.get("seed"))):
        if value is not None:
            parts.append(f"{key} {value}")
    if "seed" in config and config["seed"] is None:  # (exec without --seed, watch)
        code = s.get("code_seed")
        parts.append(f"seeded by the code ({code[0]} at {code[1] or 'a library call'})"
                     if code else "not seeded by detaudit")
    if "deterministic" in config:
        parts.append(f"deterministic algorithms {'on' if config['deterministic'] else 'off'}")
    fault = config.get("fault")
    if fault:
        parts.append(f"planted fault {planted_where(fault)}")
    return "; ".join(parts)


def _reproduce(s: dict[str, Any]) -> Section | None:
    if not s.get("command"):
        return None
    return Section("reproduce", "Reproduce", [Code(s["command"])])


def _modules(s: dict[str, Any]) -> Section | None:
    """What a planted fault, `--inject-fault MODULE@...`, may name: last, as a model's
    modules may run to hundreds of rows."""
    if not s.get("modules"):
        return None
    return Section("modules", "Modules", [Table(
        "modules with parameters (for --inject-fault MODULE@forward|backward:STEP)",
        ["module"], [[m] for m in s["modules"]], key="modules", fold=True)])


def _failures(s: dict[str, Any]) -> Section | None:
    rows = [[r, clip(str(m))] for r, m in s.get("failures", {}).items()]
    if not rows:
        return None
    # (a repeat cut short, by Ctrl-C or by the others' end, is listed too: it failed nothing)
    table = Table("repeats that did not finish", ["repeat", "why"], rows)
    return Section("failures", "Repeats that did not finish", [table])


def _ranks(s: dict[str, Any]) -> Section | None:
    return ranks_section(s) if s.get("ranks") else None


def calls_matter(s: dict[str, Any]) -> bool:
    """Whether a module the first divergence or its origins name was called more than once
    in the step (say, once per accumulated batch): then the origins say which call."""
    return any(o.get("call") for o in [s.get("first_divergence") or {}, *s.get("origins", [])])


def ended(s: dict[str, Any]) -> bool:
    """Whether the runs first part where one had ended (cause: length): the step's records
    are missing in it, not different, so no phase, module or record is named."""
    return s["first_divergence"]["role"] == RUN_ENDED


def first_module(s: dict[str, Any]) -> str:
    """The first divergence's module, with its call where that module's calls differ in
    the step (a module of the model, in forward or backward)."""
    first = s["first_divergence"]
    module = first.get("outside") or first["module"] or "(model)"
    calls = [o.get("call") for o in [first, *s.get("origins", [])]
             if o.get("module") == first["module"]]
    if (first.get("outside") or not first["module"] or first["phase"] not in FORWARD_BACKWARD
            or not any(calls)):
        return module
    return f"{module} (call {first.get('call', 0)})"


def other_origins(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The origins of the first divergent step besides the one the first divergence names."""
    first = s.get("first_divergence") or {}
    where = (first.get("phase"), first.get("module"), first.get("call", 0))
    return [o for o in s.get("origins", [])
            if (o.get("phase"), o.get("module"), o.get("call", 0)) != where]


def _first(s: dict[str, Any]) -> Section | None:
    first = s.get("first_divergence")
    if not first:
        return None
    records = s.get("records", {})
    rows = [
        ["epoch", (f"{first['epoch']} (counted from 1; step {num(first.get('index'))} of "
                   "the epoch, counted from 0)")],
        ["step", f"{first['step']} (global, counted from 0)"],
        *([["steps run", first["steps_run"]]] if ended(s) else [
            ["phase", first["phase"]],
            ["module", first_module(s)],
            ["role", ROLE_TEXT.get(first["role"], first["role"])],
            ["records", ", ".join(first["slots"])]]),
        ["repeats differing", f"{first['differing']} of {first['repeats'] - 1} (against repeat 0)"],
        ["records differing in the run",
         f"{records.get('differing', '?')} of {records.get('total', '?')}"],
    ]
    blocks: list[Block] = [Table("", ["", ""], rows)]
    fork = s.get("fork")
    if fork:
        blocks.append(Text(f"Control flow forked {fork_text(fork)}."))
    origins = _origins(s)
    if origins.rows:
        blocks.append(origins)
    ops = s.get("ops")
    if ops:
        headers = ["op", "module", "phase", "role", "elements differing", "max |Δ|", "max ULP",
                   "relative error"]
        keys = ("op", "module", "phase", "role", "elements", "max_abs_diff", "max_ulp",
                "rel_error")
        measured = any(o.get("elements") is not None for o in ops)
        if not measured:  # (a command's op that its zoom did not keep: not measured)
            headers, keys = headers[:4], keys[:4]
        if any(o.get("call") for o in ops):  # a module called more than once in the step
            headers, keys = [*headers[:2], "call", *headers[2:]], (*keys[:2], "call", *keys[2:])
        blocks.append(Table(
            "ops of the first divergent step (op-level replay)", headers,
            [[op_place(o) if k == "module" else num(o.get(k)) for k in keys] for o in ops],
            key="ops", fold=len(ops) > 10,
        ))
        if not measured:
            blocks.append(Text(
                "How much each op's outputs differ is measured where detaudit builds the runs "
                "itself (detaudit run); for a command's runs, only where the zoom kept the op's "
                "outputs: an op known to be possibly nondeterministic, or a planted one."))
    drill = s.get("op_drill_down") or {}
    if drill.get("error"):
        blocks.append(Text(f"The op-level replay failed: {drill['error']}"))
    elif drill and not drill.get("reproduced"):
        blocks.append(Text(
            f"The op-level replay of step {drill.get('step')} did not reproduce the divergence: "
            "it is intermittent; run again, or with more --repeats."
        ))
    elif isinstance(drill.get("ops_not_recorded"), dict):
        text = str(drill["ops_not_recorded"]["text"])
        blocks.append(Text(f"{text[0].upper()}{text[1:]}."))
    elif isinstance(drill.get("outside_dispatcher"), dict):
        outside = drill["outside_dispatcher"]
        text = str(outside.get("text"))
        blocks.append(Text(f"{text[0].upper()}{text[1:]}." if outside.get("planted") else
                           f"Outside the dispatcher: {text}."))
    return Section("first", "First divergence", blocks)


def _origins(s: dict[str, Any]) -> Table:
    rows = [
        [o["phase"], o["module"] or "(model)", str(o.get("call", 0)), ", ".join(o["slots"]),
         f"{o['differing']} of {o['repeats'] - 1}", "yes" if o.get("rng") else "no"]
        for o in s.get("origins", [])
    ]
    step = s["first_divergence"]["step"]
    headers = ["phase", "module", "call", "records", "repeats differing", "RNG draw differs"]
    return Table(f"origins in step {step}", headers, rows, key="origins", fold=len(rows) > 10)


def _cause(s: dict[str, Any]) -> Section | None:
    cause = s.get("cause", {})
    if cause.get("kind", "none") == "none":
        return None
    blocks: list[Block] = [Text(f"{cause['kind']}: {cause['text']}.")]
    knowledge = s.get("knowledge") or []
    if knowledge:
        keys = ("op", "what", "why", "remedy")
        blocks.append(Table(
            "known causes and remedies", list(keys),
            [[num(k.get(x)) for x in keys] for k in knowledge],
        ))
    return Section("cause", "Cause", blocks)


def identical_loss(s: dict[str, Any]) -> str:
    """"bit-identical in every step", and over which steps where the runs differ in
    length (a step only some ran is not compared)."""
    lengths = s.get("steps_per_repeat") or []
    if len(set(lengths)) < 2:
        return "bit-identical in every step"
    only = (f"step {min(lengths)}" if max(lengths) - min(lengths) == 1 else
            f"steps {min(lengths)}–{max(lengths) - 1}")
    return f"bit-identical in the {counted(min(lengths), 'step')} every repeat ran ({only} ran in some only)"


def loss_first_differs(s: dict[str, Any]) -> str:
    """"loss first differs at step k (epoch e)", and how long after the runs parted where
    the loss hid the first steps that differ (a difference in the gradients only); at the
    next step after one that parted after its loss was computed, nothing was hidden."""
    loss = s["loss"]
    said = f"loss first differs at step {loss['first_step']} (epoch {loss['first_epoch']})"
    first = s.get("first_divergence") or {}
    if first.get("step") is not None and first["step"] < loss["first_step"]:
        gap = loss["first_step"] - first["step"]
        said += (f", {counted(gap, 'step')} after the runs part (step {first['step']}, epoch "
                 f"{first['epoch']}")
        if gap == 1 and first.get("phase") in (BACKWARD, GRAD, OPTIMIZER):
            said += f", in {first['phase']}, after that step's loss was computed)"
        else:
            said += "): the loss hid the difference until then"
    return said


def _loss(s: dict[str, Any]) -> Section | None:
    loss = s.get("loss", {})
    if not loss.get("per_epoch"):
        return None
    if loss.get("first_step") is None:
        lead = f"The loss was {identical_loss(s)}."
    else:
        lead = f"The {loss_first_differs(s)}."
    blocks: list[Block] = [Text(lead)]
    if loss.get("nonfinite"):
        blocks.append(Text(nonfinite_line(loss["nonfinite"]), strong=True))
    if s.get("loss_hidden"):
        blocks.append(Text(
            f"{s.get('param_drift_what', 'parameters').capitalize()} diverged from step "
            f"{s['param_drift_step']} while the loss stayed "
            "bit-identical: the loss alone hides this."
        ))
    values = [p["rel_diff"] for p in loss["per_step"]]
    blocks.append(Figure("loss"))
    blocks.append(Figure("drift", [
        Text(f"Relative |Δloss| per step, steps {loss['per_step'][0]['step']}–"
             f"{loss['per_step'][-1]['step']} (log scale; ▁ = identical):"),
        Code(sparkline(values)),
    ]))
    blocks.append(Table(
        "loss drift per epoch", ["epoch", "max relative |Δloss|"],
        [[str(e["epoch"]), _loss_diff(e["max_rel_diff"])]
         for e in loss["per_epoch"]],
    ))
    differing = _per_step(s)
    if differing.rows:  # (none in a deterministic run)
        blocks.append(differing)
    return Section("loss", "Loss drift", blocks)


def _per_step(s: dict[str, Any]) -> Table:
    by_step = s.get("records", {}).get("by_step", {})
    rows = [
        [str(p["step"]), str(p["epoch"]), _loss_diff(p["rel_diff"]),
         str(by_step.get(str(p["step"]), 0))]
        for p in s["loss"]["per_step"]
        if p["rel_diff"] or by_step.get(str(p["step"]))
    ]
    headers = ["step", "epoch", "relative |Δloss|", "records differing"]
    return Table("steps that differ", headers, rows, key="per_step", fold=True)


def nonfinite_line(nonfinite: dict[str, Any]) -> str:
    """The finding that the loss stopped being a number."""
    value = "NaN" if nonfinite["value"] == "nan" else "infinite"
    again = nonfinite.get("finite_again")
    if again is not None:
        return (f"loss is {value} at step {nonfinite['step']} (epoch {nonfinite['epoch']}), "
                f"finite again from step {again}: a step whose update a GradScaler skipped, "
                "or a bad batch, not a training that diverged")
    if nonfinite.get("skipped"):  # (the last step recorded: nothing after it says more)
        return (f"loss is {value} at step {nonfinite['step']} (epoch {nonfinite['epoch']}), "
                "the last step recorded, whose update a GradScaler skipped: not a training "
                "that diverged")
    return (f"loss is {value} from step {nonfinite['step']} (epoch {nonfinite['epoch']}): "
            "the training diverged numerically")


def _loss_diff(value: float) -> str:
    return "identical" if value == 0 else num(value, 3)


def _size(s: dict[str, Any]) -> Section | None:
    if s.get("first_divergence") and ended(s):  # (the shorter run's records are missing)
        return None
    rows = []
    for phase, d in s.get("first_by_phase", {}).items():
        ref, other = d.get("ref", {}), d.get("other", {})
        call = f"[{d['call']}]" if d["call"] else ""
        where = f"{d['module'] or '(model)'}{call} {d['slot']}"
        rows.append([
            phase, where, str(d["step"]), "×".join(map(str, ref.get("shape", []))) or "–",
            num(ref.get("dtype")), num(ref.get("norm"), 9), num(other.get("norm"), 9),
            num(_rel(ref.get("norm"), other.get("norm")), 3),
            num(ref.get("absmax"), 9), num(other.get("absmax"), 9),
        ])
    if not rows:
        return None
    headers = [
        "phase", "record", "step", "shape", "dtype", "norm (repeat 0)", "norm (other)",
        "relative Δnorm", "absmax (repeat 0)", "absmax (other)",
    ]
    unsized = any(row[5] == "–" for row in rows)
    scale = s.get("loss_scale")
    scaled = scale is not None and any(
        d["slot"].startswith("loss") for d in s.get("first_by_phase", {}).values())
    return Section("size", "Size of the difference", [
        Text("The first differing record of each phase: repeat 0 against the first repeat that "
             "differs. A relative Δnorm of 0 means the values differ below what the norm shows."
             + (" A dash: no size was recorded (a scanned step keeps each tensor's print "
                "alone; a zoomed step, or one recorded module by module, keeps sizes too)."
                if unsized else "")
             + (" A loss is what backward was called on: under a GradScaler, the scaled loss "
                f"(its scale after that step: {num(scale)})." if scaled else "")),
        Table("first differing record per phase", headers, rows),
    ])


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _stress(s: dict[str, Any]) -> Section | None:
    stress = s.get("stress") or []
    if not stress:
        return None
    runs = max(op.get("runs") or 0 for op in stress)
    cost = s.get("stress_seconds")
    blocks: list[Block] = [Text(
        # (exec's first run re-runs them; run's last repeat, and its replay of a step)
        "At the first step of every epoch " + (
            "the first run" if (s.get("probe") or {}).get("kind") == "command" else
            "(and at the first divergent step, "
            "when it was replayed) the last repeat")
        + " re-ran each op known to be possibly nondeterministic on this device up to "
        f"{runs} times on identical copies of its inputs: two or more distinct results prove "
        "the op nondeterministic, whether or not the repeats happened to agree" + (
            "" if cost is None else f" (re-executions: {num(cost, 3)} s)") + "."
    )]
    rows = []
    for op in stress:
        proof = op.get("proof") or {}
        rows.append([
            num(op.get("module")), num(op.get("phase")), num(op.get("op")),
            f"epoch {num(op.get('epoch'))}", num(op.get("calls")),
            f"{num(op.get('distinct'))} of {num(op.get('runs'))}",
            num(proof.get("max_ulp")), num(proof.get("max_abs")), num(proof.get("rel_err")),
            (f"{num(proof.get('differing'))} of {num(proof.get('elements'))}"
             if proof else "–"),
        ])
    blocks.append(Table(
        "risky ops re-executed on identical inputs",
        ["module", "phase", "op", "first seen", "calls", "distinct results", "max ULP",
         "max |Δ|", "rel. error", "differing elements"], rows, key="stress",
        fold=len(rows) > 10))
    for op in stress:
        if op.get("proven") and op.get("remedy"):
            blocks.append(Text(f"{op.get('line')}: {op.get('what')}. Fix: {op.get('remedy')}."))
    return Section("stress", "Proof by re-execution", blocks)


def _census(s: dict[str, Any]) -> Section | None:
    census = s.get("census") or []
    alerts = s.get("census_alerts") or []
    errors = s.get("census_errors") or []
    seconds = s.get("census_seconds")
    if not census and not alerts and not errors:
        if not isinstance(seconds, (int, float)):
            return None  # no census ran
        return Section("census", "Census", [Text(
            "The census found no known-nondeterministic op and no alert under "
            "torch.use_deterministic_algorithms(True, warn_only=True) at the first step of "
            f"every epoch (census: {num(seconds, 3)} s).")])
    blocks: list[Block] = [Text(
        "Known-nondeterministic ops your model ran on this device at the first step of every "
        "epoch (whether or not the repeats happened to agree; first seen: the first epoch "
        "that ran it), and the alerts raised there under "
        "torch.use_deterministic_algorithms(True, warn_only=True)"
        + ("" if not isinstance(seconds, (int, float)) else f" (census: {num(seconds, 3)} s)")
        + "."
    )]
    blocks += [Text(clip(e), strong=True) for e in errors]
    if census:
        rows = [[num(c.get("module")), num(c.get("phase")), num(c.get("op")), num(c.get("count")),
                 f"epoch {num(c.get('epoch'))}", num(c.get("what"))] for c in census]
        blocks.append(Table("known-nondeterministic ops per module",
                            ["module", "phase", "op", "count", "first seen", "what"], rows,
                            key="census", fold=len(rows) > 10))
    if alerts:
        rows = [[num(a.get("module")), num(a.get("phase")), num(a.get("op")),
                 f"epoch {num(a.get('epoch', 1))}", num(a.get("message"))] for a in alerts]
        blocks.append(Table("deterministic-algorithms alerts",
                            ["module", "phase", "op", "epoch", "message"], rows, key="alerts",
                            fold=len(rows) > 10))
    return Section("census", "Census", blocks)


def _verify(s: dict[str, Any]) -> Section | None:
    verify = (s.get("extra") or {}).get("verify")
    if not verify:
        return None
    if verify.get("error"):
        return Section("verify", "Fix verification", [Text(f"failed: {verify['error']}")])
    seconds = verify.get("step_seconds") or {}
    peaks = verify.get("peak_bytes") or {}
    rows = [
        ["deterministic with the fix", num(verify.get("deterministic"))],
        ["step time", (f"{num(verify.get('step_time_ratio'), 3)}× the original "
         f"({num(seconds.get('fixed'), 3)} s vs {num(seconds.get('original'), 3)} s per step)")],
        ["peak memory", (f"{num(verify.get('peak_memory_ratio'), 3)}× the original "
         f"({_mib(peaks.get('fixed'))} vs {_mib(peaks.get('original'))} MiB, "
         f"{verify.get('peak_memory_kind', '')})")],
    ]
    blocks: list[Block] = [Text(str(verify.get("headline", ""))), Table("", ["", ""], rows)]
    if verify.get("remedies"):
        blocks.append(Code("\n".join(verify["remedies"])))
    if verify.get("code"):
        blocks.append(Code(verify["code"]))
    if verify.get("planted_fault_dropped"):
        blocks.append(Text("The planted fault was left out of the fixed run (it is not a bug to fix)."))
    return Section("verify", "Fix verification", blocks)


def _mib(value: Any) -> str:
    return "?" if value is None else f"{value / 2**20:.0f}"


def _map(s: dict[str, Any]) -> Section | None:
    grid = map_rows(s)
    if not grid:
        return None
    rows = []
    for module, steps in grid.items():
        by_role: dict[str, list[int]] = {role: [] for role in MAP_ROLES}
        for step, phases in steps.items():
            for role in set(phases.values()):
                by_role.setdefault(role, []).append(step)
        rows.append([module, *(_ranges(by_role[r]) for r in MAP_ROLES)])
    headers = ["module", *MAP_ROLES.values()]
    if not any(row[-1] != "–" for row in rows):  # no scanned step differs: no such column
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    table = Table("divergence map", headers, rows, key="map", fold=True)
    blocks: list[Block] = [Figure("map", [table])]
    if s.get("map_truncated"):
        blocks.append(Text(f"{s['map_truncated']} more differing calls are not in the summary."))
    detailed = s.get("records", {}).get("detailed_steps")
    if detailed:
        blocks.append(Text(f"The map holds the first {detailed} divergent steps; later steps "
                           "differ too, counted per step in summary.json (records.by_step)."))
    return Section("map", "Where records diverge", blocks)


def _ranges(steps: list[int]) -> str:
    """Sorted steps as compact ranges: 1, 3–7, 9."""
    out: list[str] = []
    for step in sorted(set(steps)):
        if out and out[-1].split("–")[-1] == str(step - 1):
            out[-1] = f"{out[-1].split('–')[0]}–{step}"
        else:
            out.append(str(step))
    return ", ".join(out) or "–"


def _env(s: dict[str, Any]) -> Section | None:
    env, diffs = s.get("env", {}), s.get("env_differences", {})
    blocks: list[Block] = []
    if diffs:
        repeats = max(len(v) for v in diffs.values())
        blocks.append(Table(
            "environment differences between repeats",
            ["setting", *(f"repeat {i}" for i in range(repeats))],
            [[k, *(_value(v) for v in values)] for k, values in diffs.items()],
        ))
    flagged = s.get("env_risks") or {}
    if flagged:
        blocks.append(Table(
            "risky settings (as `detaudit env` flags them)", ["setting", "value", "why"],
            [[k, _value(env.get(k)), clip(why)] for k, why in flagged.items()],
        ))
    if env:
        blocks.append(Table(
            "environment", ["setting", "value"], [[k, _value(v)] for k, v in env.items()],
            fold=True,
        ))
    return Section("env", "Environment", blocks) if blocks else None


def _value(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "(none)"
    return clip(num(value, 6))


def _tables(blocks: list[Block]) -> list[Table]:
    out: list[Table] = []
    for block in blocks:
        if isinstance(block, Table):
            out.append(block)
        elif isinstance(block, Figure):
            out.extend(_tables(block.fallback))
    return out


def _cap(table: Table, limit: int) -> None:
    if len(table.rows) > limit:
        table.omitted += len(table.rows) - limit
        del table.rows[limit:]


# -- a distributed audit's ranks ----------------------------------------------------------
def ranks_section(summary: dict[str, Any]) -> Section:
    """The "Ranks" section: ranks side by side, then the cross-rank checks and findings."""
    ranks = summary["ranks"]
    blocks: list[Block] = [Text(
        f"{ranks['world_size']} ranks ({ranks.get('backend') or '?'}); the sections below detail "
        f"rank {ranks['primary_rank']}."
    )]
    if ranks.get("crash"):
        blocks.append(Text(crash_line(ranks["crash"]), strong=True))
    blocks.append(Table("ranks side by side", SIDE_HEADERS, side_rows(ranks)))
    blocks.append(Table(
        "cross-rank checks", ["check", "result", "detail"],
        [[c["title"], c["status"], clip(c["detail"])] for c in ranks["checks"]],
    ))
    for check in ranks["checks"]:
        if check["findings"]:
            blocks.append(_rank_findings(check))
    return Section("ranks", "Ranks", blocks)


SIDE_HEADERS = ["rank", "verdict", "first step", "epoch", "phase", "module", "role", "cause",
                "source", "failed repeats"]


def side_rows(ranks: dict[str, Any]) -> list[list[str]]:
    """One row per rank: its run-to-run verdict and first divergence."""
    return [
        [str(r["rank"]), r["verdict"], num(r["first_step"]), num(r["first_epoch"]),
         num(r["phase"]), "–" if r["module"] is None else (r["module"] or "(model)"),
         num(r["role"]), r["cause"], num(r["source"]), ", ".join(r["failures"]) or "–"]
        for r in ranks["per_rank"]
    ]


def _rank_findings(check: dict[str, Any]) -> Table:
    findings = check["findings"]
    keys = [k for k in findings[0] if k != "groups"]
    rows = [[_cell(f[k]) for k in keys] + ([_cell(f["groups"])] if "groups" in f else [])
            for f in findings[:FINDINGS_SHOWN]]
    headers = keys + (["ranks by equal value"] if "groups" in findings[0] else [])
    repeats = f" (repeats {', '.join(map(str, check['repeats']))})" if check["repeats"] else ""
    table = Table(f"{check['title']}: findings{repeats}", headers, rows, key=f"ranks.{check['key']}",
                  fold=len(rows) > 10)
    table.omitted = max(0, len(findings) - FINDINGS_SHOWN)
    return table


def _cell(value: Any) -> str:
    if isinstance(value, list):
        if value and isinstance(value[0], list):
            return " | ".join(", ".join(map(str, g)) for g in value)
        return ", ".join(map(str, value)) or "–"
    return num(value)
