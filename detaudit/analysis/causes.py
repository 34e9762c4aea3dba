"""The cause of a comparison in words: what parted the runs, and the fix.

`compare` finds where and when the repeats part and classifies the cause (data, rng, init,
forward, ...); this module says it, from everything the comparison found, the op the zoom's
drill-down blamed and the seed detaudit set (`cause_of`, the line every report prints).
"""

from __future__ import annotations

from typing import Any

from ..trace import (
    BACKWARD,
    FORWARD,
    LOADER_BATCH,
    MODEL_STATE,
    OUTPUT,
    OUTSIDE_MODEL,
    STATE,
    state_name,
)
from ..words import op_place, rates_text
from .compare import ORIGIN, CallFinding, Comparison, draws_random_numbers

_CAUSE_TEXT = {
    "data": "the batch differs: the data pipeline (augmentation, shuffling, workers) is not "
            "reproducible, or the data comes from a source that seeds itself (an environment "
            "reset without a seed, as gymnasium's env.reset() is, or a generator of its own "
            "made without one, np.random.default_rng()): seed it (env.reset(seed=...), "
            "default_rng(seed))",
    "rng": "an RNG stream differs: something drew a different amount of randomness",
    "init": "the parameters differ before the first step: the model is initialised from an "
            "unseeded RNG (fix: seed every RNG before building the model, e.g. "
            "detaudit.seed_everything(0); `detaudit exec --seed 0` does it for a whole script)",
    "params": "the parameters differ before the step (initialisation, an earlier update, or a "
              "change made to them between steps outside the optimizer)",
    "forward": "a forward computation gave different results from equal inputs",
    "backward": "a backward computation gave different gradients from equal upstream gradients",
    "optimizer": "the optimizer update differs while gradients agree",
    "process": "the runs part only between processes: replayed in one process the step agrees "
               "in every repeat, replayed each in a fresh process (as the audited runs ran) it "
               "parts, so the difference depends on per-process state: PYTHONHASHSEED (the "
               "iteration order of a set of strings, or of a dict built from one: loss terms, "
               "class names), process-level randomness (os.urandom, uuid, hash() or id() of "
               "objects) or the environment (fix: set PYTHONHASHSEED to a fixed value, e.g. "
               "PYTHONHASHSEED=0, for training, and iterate sorted(...) rather than a set)",
    "length": "the runs differ in length: a run ended before this step while another went on "
              "(the loop's length is not reproducible: a step count or an early stop that "
              "depends on something that differs between runs)",
    "none": "no divergence",
}


# where a buffer that differs as the model was built came from
BUILT_APART = "set from something that differs between runs: an unseeded generator, the clock"

# A scanned step's forward or backward cause, which its step state alone cannot confirm.
UNCONFIRMED = ("; unconfirmed from the step's state alone (a zoom's module and op records, "
               "when the step parts again, say which)")
_SCANNED_CAUSE_TEXT = {
    "forward": "the loss (or the output) differs while everything the step began with agrees "
               "(the batch, every RNG state, the parameters): a forward computation, or the "
               "step function's own code, gave different results" + UNCONFIRMED,
    "backward": "the gradients differ while the loss and everything before it agree: a "
                "backward computation, or a forward one whose difference was too small to "
                "change the loss (a scanned step: its module records, which a zoom takes, tell "
                "them apart)",
}


# how to seed before the model is built, whatever builds it
_SEED_FIRST = ("seed before building the model (detaudit.seed_everything(0), or the "
               "framework's own: transformers.set_seed, composer.utils.reproducibility."
               "seed_all, lightning.seed_everything; Hugging Face's Trainer(model_init=...) "
               "builds it after seeding), or `detaudit exec --seed 0`")


def cause_text(c: Comparison) -> str:
    """Why the runs part, and the fix: the `cause:` line of the console and the reports."""
    seeded_apart = _seeded_apart(c)
    if seeded_apart is not None:
        return seeded_apart
    text = _cause_text(c)
    if c.cause == "init" and c.loaded_earlier and _loaded_note(c) not in text:
        text += _loaded_note(c)  # (beside an RNG that differs: the files, said too)
    elif c.cause == "params" and c.loaded_earlier:  # (a checkpoint reloaded between epochs)
        text += (_loaded_note(c) + " (fix: remove what an earlier run left before each run, "
                 "or give each run its own output folder)")
    # (a step recorded module by module says more: see the drill-down's outside_dispatcher)
    if (c.built_buffers and c.first_step == 0 and c.cause in ("forward", "backward")
            and not any(f.step == 0 for f in c.findings)):
        text += (f"; the model's buffers ({_listed(c.built_buffers)}) differ as built, before "
                 f"the first step: where the step reads them, they part the runs ({BUILT_APART}; "
                 "fix: compute them the same way in every run)")
    batch_differs = any(d.phase == STATE and d.slot.startswith("batch") for d in c.first_diffs)
    if c.cause == "init" and c.continued_from is None and batch_differs:
        text += ("; the first batch differs as well: the data order or augmentation draws "
                 "from an unseeded RNG too (the same seeding, done before the data is "
                 "drawn, fixes both" + ("; for a DataLoader's workers, e.g. "
                                        "detaudit.seeded_loader_kwargs)" if c.loader_batch
                                        else "; an environment that seeds itself, reset "
                                        "without a seed, needs env.reset(seed=...) too)"))
    if c.cause == "data" or (c.cause == "init" and batch_differs):
        text += _augmentations_of_their_own(c)
    return text


def _augmentations_of_their_own(c: Comparison) -> str:
    """What an augmentation library the run imported needs seeded that no global seed
    reaches (albumentations 2: each Compose's generator), or nothing."""
    version = c.augmentation_libraries.get("albumentations")
    major = (version or "").split(".")[0]
    if not major.isdigit() or int(major) < 2:
        return ""  # (before 2, it drew from python's random and numpy's global RNG)
    return (f"; the run imported albumentations {version}, whose Compose draws its "
            "augmentations from a generator of its own, made without a seed unless given "
            "one, which seeding python, numpy and torch does not reach (fix: "
            "A.Compose([...], seed=0))")


def seeds_apart(c: Comparison) -> str | None:
    """The values the code seeded torch with, where they differ between the runs, and
    where it did ("4014 in repeat 0, 9916 in repeat 1; at main.py:50"); None otherwise."""
    seeds = [s for s in c.first_seeds if s is not None]
    if len(seeds) < 2 or len({value for value, _ in seeds}) < 2:
        return None
    values = ", ".join(f"{s[0]} in repeat {n}" for n, s in enumerate(c.first_seeds)
                       if s is not None)
    return f"{values}; at {seeds[0][1] or 'a library call'}"


def _seeded_apart(c: Comparison) -> str | None:
    """The text for runs whose code seeded torch with a different value each (a seed
    drawn at random where none is given), where that is what parts them at the first
    step; None otherwise."""
    apart = seeds_apart(c)
    if c.cause not in ("init", "rng", "data") or c.first_step != 0 or apart is None:
        return None
    if c.cause == "init" and c.seeded_late is not None:
        # the code's first seed came after the model was built: it did not draw the weights
        # (a dataset that seeds each sample with its index, as torchvision's FakeData does)
        return None
    what = {"init": "the parameters differ before the first step",
            "rng": "an RNG stream differs", "data": "the batch differs"}[c.cause]
    return (f"{what}: the code seeds torch with a different value in each run ({apart}), "
            "a seed drawn at random where none is given (random.randint, the time); fix: "
            "give the script a fixed seed (its own seed option); `detaudit exec --seed 0`, "
            "which seeds python's random, numpy and torch before the code runs, fixes it "
            "only where the seed is drawn from one of those, not from the clock, os.urandom "
            "or the process id (detectron2's seed_all_rng(None))")


def _cause_text(c: Comparison) -> str:
    """The cause's own text, before what `cause_text` adds (files an earlier run wrote, a
    first batch that differs too)."""
    if c.cause in ("init", "params") and c.shared_parameters:
        return ("the parameters differ before the step, and they are in shared memory "
                "(share_memory()): other processes write them, as Hogwild training in "
                "child processes does, whose updates interleave differently in every run "
                "(nondeterministic by design); or the model was built from an unseeded "
                "RNG. detaudit records one process, the first to begin a step, not the "
                "others (to audit the training steps, run the training in the script's "
                "own process)")
    if c.cause == "init" and c.continued_from is not None:
        n, m, step, last = c.continued_from
        had = "ended with" if last else f"had after its step {step}"
        return (f"the parameters differ before the first step: repeat {n} began with the "
                f"parameters repeat {m} {had}, so the model was trained on, or restored "
                "from a checkpoint an earlier run wrote, not built anew (fix: build, and "
                "seed, the model in each run; remove the checkpoints an earlier run left, "
                "or give each run its own output folder; in a notebook, re-run the cell "
                "that builds it)" + _loaded_note(c))
    # the RNG streams whose state differs as the step begins (never drawn: left out)
    differing = sorted({d.slot.removeprefix("rng.") for d in c.first_diffs
                        if d.rng_state})
    stepless = [n for n, steps in c.lengths.items() if steps == 0]
    if c.cause == "length" and stepless:
        return (f"repeat {stepless[0]} made no step: its command ended at once (exit 0), "
                "as a script does that finds what an earlier run left and takes the "
                "training as done (a checkpoint at its last epoch, an output folder it "
                f"takes for finished work){_loaded_note(c)} (fix: remove what an "
                "earlier run left before each run, or give each run its own output "
                "folder)")
    if c.loaded_earlier and (c.cause == "length"
                                or c.cause == "init" and not differing):
        what = ("the parameters differ before the first step while every RNG state agrees"
                if c.cause == "init" else _CAUSE_TEXT["length"].split(" (")[0])
        return (what + _loaded_note(c) + " (a checkpoint the script resumed from, or "
                "its progress: fix: remove what an earlier run left before each run, or "
                "give each run its own output folder)")
    if c.cause == "init" and c.seeded_late and not any(
            s == "torch" or s.startswith("cuda") for s in differing):
        return ("the parameters differ before the first step while torch's RNG state "
                "agrees: the model was built from the unseeded torch RNG, and the code "
                f"seeded it only after that, at {c.seeded_late} (a seed fixes the draws that "
                "follow it, not the weights already drawn; a trainer that takes a seed, "
                "as Hugging Face's and Composer's do, seeds as it is made, after the "
                f"model); fix: {_SEED_FIRST})")
    if c.cause == "init" and not differing:
        return ("the parameters differ before the first step while every RNG state "
                "agrees: the model was built before the code seeded its RNGs (a seed set "
                "after the model is built fixes the draws that follow, not the weights "
                "already drawn: a trainer that takes a seed, as Hugging Face's and "
                "Composer's do, seeds as it is made, after the model), or its weights "
                "were loaded or set from a source that differs between runs (a "
                f"checkpoint a run wrote); fix: {_SEED_FIRST}, and start every run from "
                "the same weights")
    if c.cause == "init" and not any(s == "torch" or s.startswith("cuda")
                                        for s in differing):
        return (f"the parameters differ before the first step; torch's RNG state agrees, "
                f"the {', '.join(differing)} RNG state differs (not seeded): the weights "
                f"come from {'that RNG' if len(differing) == 1 else 'one of those RNGs'}, "
                "or were loaded or set from a source that differs between runs (fix: seed "
                "every RNG before building the model, e.g. detaudit.seed_everything(0); if "
                "nothing draws weights from it, start every run from the same weights)")
    if c.cause == "rng" and differing and c.first_step == 0:
        # before anything ran: nothing drew differently
        return (f"the {', '.join(differing)} RNG state differs before the first step: it is "
                "not seeded (fix: seed every RNG before training, e.g. "
                "detaudit.seed_everything(0); `detaudit exec --seed 0` does it for a whole "
                "script)")
    if c.cause == "rng" and c.drawn and c.rng_gap is None and not any(
            o.rng for o in c.origins):
        return (f"step {c.first_step} began alike in every repeat, yet the "
                f"{', '.join(c.drawn)} RNG state differs as the next step begins: the "
                "step reseeded it from a source that differs between runs (torch.seed(), "
                "a seed from the clock or the process id) or drew a different amount of "
                "randomness (a draw in the step function, a hook, a logger or a module "
                "whose count differs between the runs), or a forward difference changed "
                "how much a sampler draws; where, the step's "
                "state cannot say (a zoom's module records do, when the step parts again)")
    at_step = [f for f in c.findings if f.step == c.first_step]
    if c.lr_by_repeat is not None:
        rates = " and ".join(f"{rates_text(r)} in repeat {n}"
                             for n, r in enumerate(c.lr_by_repeat[:2]))
        return (f"{_CAUSE_TEXT['optimizer']}: the learning rate differs ({rates}), so the "
                "schedule, or whatever sets it, depends on something that differs between "
                "the runs (wall-clock time, a metric of an unseeded evaluation, the order of "
                "a set)")
    if c.cause == "rng" and differing and c.first_step:
        return (f"the {', '.join(differing)} RNG state already differs as step "
                f"{c.first_step} begins, while everything recorded before agrees: after "
                f"step {c.first_step - 1}'s last record something reseeded it or drew a "
                "different amount from it (an evaluation or a logger that ran differently, "
                "a reseed from the clock or the process id, a draw that depends on the "
                "epoch's results)")
    scanned = _SCANNED_CAUSE_TEXT.get(c.cause)
    if scanned and not at_step:
        return scanned  # a step without module records: the step state alone says it
    outside = _outside_the_model(c, at_step)
    if outside:
        return outside
    buffers = sorted({state_name(d.module, d.slot) for d in c.first_diffs if d.phase == STATE
                      and d.slot.startswith("buffer.")})
    # (a buffer as built is never a difference: see compare's `as_built`)
    if c.cause == "params" and buffers and not any(
            d.phase == STATE and d.slot.startswith("param.") for d in c.first_diffs):
        return (f"the model's buffers ({_listed(buffers)}) differ before the step while its "
                "parameters agree: running statistics, counters or averages a module keeps, "
                "changed between steps, or updated by a forward whose recorded results "
                "agreed; they change what the model computes in eval mode")
    if c.cause == "data":
        return _data_text(c, differing)
    side = _side_models_differing(c)
    if c.cause == "params" and side:
        return (f"the parameters of {_listed(side)}, called by the loop but trained by no "
                "optimizer (an EMA copy, a teacher, a model restored for evaluation), "
                "differ before the step while the trained model's agree: changed in place "
                "between steps (an EMA's update: its decay, or what it averages, differs "
                "between runs) or loaded differently")
    return _CAUSE_TEXT[c.cause]


def _side_models_differing(c: Comparison) -> list[str]:
    """The side models (see `side_models`) whose state differs first, when only theirs
    does."""
    owners = {d.module.split(".")[0] for d in c.first_diffs
              if d.phase == STATE and d.slot.startswith(MODEL_STATE)}
    return sorted(owners) if owners and owners <= set(c.side_models) else []


def _data_text(c: Comparison, differing_rng: list[str]) -> str:
    """What a batch that differs says: where it changed (in the DataLoader, or in the
    loop after it, when the batches the loader yielded agree) and which RNG, not seeded,
    may have made it differ."""
    text = _CAUSE_TEXT["data"]
    differing = [d.slot for d in c.first_diffs if d.phase == STATE
                 and d.slot.startswith("batch")]
    entered = next((d for d in c.first_diffs if d.phase == FORWARD), None)
    if not differing and entered is not None:
        text = (f"the input of {entered.module or '(model)'} differs while everything the "
                "step began with agrees (its batch, every RNG state): the loop made it "
                "differently (noise or an augmentation drawn in the loop, a value computed "
                "outside the model)")
    elif c.loader_batch and not any(slot.startswith(LOADER_BATCH) for slot in differing):
        text = ("the model's input differs while the batches the DataLoader yielded agree: "
                "the training loop changed them after loading (an augmentation, noise or a "
                "transform applied in the loop, or a batch mixed with another)")
    elif not differing_rng and any(slot.startswith(LOADER_BATCH) for slot in differing):
        return ("the batch the DataLoader yielded differs while every RNG state agrees as "
                "the step begins: the loader draws its order or its augmentation from a "
                "generator of its own that differs between runs (its generator= or its "
                "sampler's, seeded from the OS by torch.Generator().seed() or from the clock; "
                "a dataset's np.random.default_rng() made without a seed), or it reads data "
                "that differs (fix: seed that generator with a constant, e.g. "
                "DataLoader(..., generator=torch.Generator().manual_seed(0)), "
                "default_rng(seed))" + _reseeded_workers(c))
    if differing_rng:
        text += (f"; the {', '.join(differing_rng)} RNG state differs as well as the step "
                 "begins (not seeded, or reseeded by the code from a source that differs "
                 "between runs: torch.seed(), the clock): a transform that draws from it "
                 "makes the batches differ (fix: seed every RNG once, with a constant, e.g. "
                 "detaudit.seed_everything(0), and the DataLoader's workers, e.g. "
                 "detaudit.seeded_loader_kwargs)")
    return text


def _reseeded_workers(c: Comparison) -> str:
    """What the training loader's worker_init_fn may do to its workers' RNGs, which the
    recording (in the loop's process) does not see; empty without one."""
    workers = c.loader_workers or {}
    if not workers.get("worker_init_fn"):
        return ""
    return (f"; its {workers['workers']} worker processes each run the loader's "
            f"worker_init_fn ({workers['worker_init_fn']}) as they start, whose draws detaudit "
            "does not see: "
            "one that reseeds their RNGs from the clock, os.urandom or the process id "
            "(detectron2's seed_all_rng(None)) makes their augmentations differ in every run, "
            "whatever the loader's generator (fix: seed them from the seed torch gives each "
            "worker, torch.initial_seed() % 2**32, as detaudit.seed_worker does)")


def _loaded_note(c: Comparison) -> str:
    """Which repeats loaded files an earlier run of the audit wrote (empty if none)."""
    loaded = "; ".join(f"repeat {n} loaded {_listed(files)}"
                       for n, files in sorted(c.loaded_earlier.items()))
    return f"; {loaded} (torch.load), written by an earlier run" if loaded else ""


def _outside_the_model(c: Comparison, at_step: list[CallFinding]) -> str | None:
    """The text for a step whose model computed the same forward in every repeat (no
    module's forward differs) while the loss, or the gradient it sends into the model's
    outputs, differs: the difference entered outside the model; None otherwise."""
    if c.cause not in ("forward", "backward") or any(f.phase == FORWARD for f in at_step):
        return None
    if any(d.phase == OUTPUT for d in c.first_diffs):
        what = "the loss computed from them differs"
    elif any(d.phase == BACKWARD and d.module == "" and d.slot.startswith("grad_out")
             for d in c.first_diffs) and not any(
                 f.phase == BACKWARD and f.role == ORIGIN and f.module for f in at_step):
        # (the gradient entering the model's outputs, where no module's backward began the
        # difference: an output the model reads itself too, as DETR returns its encoder's,
        # takes the gradient of what its own backward sent back)
        what = "the gradient the loss sends into them differs"
    else:
        return None
    return (f"the model's outputs agree in every repeat, yet {what}: the loss is computed "
            "outside the model from something else that differs (class weights, targets "
            "or masks made in the training loop rather than loaded, a value drawn on the "
            "host, the outputs of a model called apart such as a frozen teacher), or by "
            "code outside the model, forward or backward")


def _listed(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def first_op(ops: dict[str, Any] | None) -> dict[str, Any]:
    """The first op the drill-down lists (its origin op, where it found one); {} if none."""
    return ((ops or {}).get("ops") or [{}])[0]


def _found_origin_op(ops: dict[str, Any] | None) -> dict[str, Any] | None:
    """The drill-down's origin op, where it found one that is no planted fault."""
    op = first_op(ops)
    return op if op.get("role") == ORIGIN and not op.get("planted") else None


def random_origin_op(ops: dict[str, Any] | None) -> dict[str, Any] | None:
    """The drill-down's origin op when it draws random numbers: its generator's state, an
    input no record holds, is what differs."""
    op = _found_origin_op(ops)
    return op if op is not None and draws_random_numbers(op["op"]) else None


def outside_origin_op(ops: dict[str, Any] | None, origins: list[CallFinding] | None = None
                      ) -> dict[str, Any] | None:
    """The drill-down's origin op when it ran outside the model (in the loop's own code: a
    loss term), planted there or not, and no module call of `origins` (the step's) began a
    difference that op cannot have made: a forward that differs on equal inputs, or a
    backward whose input gradients differ where its output's gradient agrees (an op
    outside the model reaches a module's backward only through that gradient, or through
    the gradient of a weight the loop also reads itself: `w[idx]` in a penalty). Such a
    module call is the first divergence, and an op outside the model that differs too is
    another origin (code that ran after the step's backward: an evaluation, a FLOPs count
    of a tensor torch.empty made)."""
    op = first_op(ops)
    if op.get("role") != ORIGIN or op.get("module") != OUTSIDE_MODEL:
        return None
    if any(f.phase == FORWARD or any(slot.startswith("grad_in") for slot in f.slots)
           for f in origins or ()):
        return None
    return op


def cause_of(c: Comparison, ops: dict[str, Any] | None, seed: int | None = None, *,
             own_hash_seeds: bool = False, planted: bool = False) -> tuple[str, str]:
    """The class of cause and its text: the comparison's, unless the op the drill-down found
    where a forward or backward part (or an input made in the loop) first differs draws
    random numbers (then the RNG is the cause) or ran outside the model (then that op's
    phase: a loss term whose forward op differs, seen by the modules as a backward
    difference, is a forward cause). `seed`: detaudit seeded every RNG with it
    before the audited code ran (an RNG that differs before the first step was reseeded).
    What the drill-down found is added to a forward or backward cause where no op is to
    blame; with `own_hash_seeds` (each run a process with a hash seed of its own: exec
    without --seed), the hash seed is named where nothing more specific (`planted` fault,
    an op, an RNG state) explains the difference."""
    reseeded = c.unseeded_at_start
    apart = seeds_apart(c)
    if seed is not None and reseeded and apart is not None:
        return c.cause, (
            f"the code seeds torch with a different value in each run ({apart}) although "
            f"detaudit seeded every RNG ({seed}) before the code ran: it draws the seed from a "
            "source that differs between runs (the clock, os.urandom, the process id), so "
            + ("the parameters differ before the first step" if c.cause == "init" else
               "the RNG state differs before the first step")
            + " (fix: seed with a constant, e.g. the script's own seed option, or drop that "
            "reseed)")
    if seed is not None and reseeded:
        return c.cause, (
            f"the {', '.join(reseeded)} RNG state differs before the first step although "
            f"detaudit seeded every RNG ({seed}) before the code ran: the code reseeds it from "
            "a source that differs between runs (the clock, os.urandom, the process id, "
            "torch.seed()) before " + {"init": "it builds the model, whose parameters differ",
                                       "data": "its first step, whose batch draws from it "
                                               "and differs"}.get(c.cause, "its first step")
            + " (fix: seed with a constant, e.g. detaudit.seed_everything(0), or drop that "
            "reseed)")
    op = random_origin_op(ops)
    if op is not None and c.cause in ("forward", "backward", "data"):
        return "rng", (
            f"{op['op']} in {op['module']} drew different random numbers from equal inputs: "
            "the state of the generator it draws from differs there, while the global RNG "
            "states agreed as the step began; it is a torch.Generator of its own that is not "
            "seeded, or one reseeded during the step (torch.seed(), a seed from the clock or "
            "os.urandom), or more was drawn from it before this op in one run (fix: seed "
            "every generator once, before training)")
    ops = ops or {}
    text = cause_text(c)
    if ops.get("reproduced"):  # the zoom's op-level replay parted again: its records say which
        text = text.removesuffix(UNCONFIRMED)
    outside = outside_origin_op(ops, c.origins)
    if outside is not None and c.cause in ("forward", "backward"):
        # (its phase: a backward difference its forward op made is a forward cause; what
        # the loss might be computed from, the text's guesses, the op's equal inputs rule out)
        return outside["phase"], (
            f"{outside['op']} in {op_place(outside)}, code outside the model, gave different "
            f"results from equal inputs ({outside['phase']}): the model's outputs agree in "
            "every repeat, and the runs part where the loss is computed from them")
    op = first_op(ops)
    if c.cause == "backward" and op and op.get("role") == ORIGIN and op.get("phase") == FORWARD:
        # (the module's outputs agreed: what its backward saved of the forward did not)
        return FORWARD, (
            f"a forward computation gave different results from equal inputs ({op['op']} in "
            f"{op['module']}), which the module's outputs did not show: its difference shows "
            "first in the gradients, computed from what the forward saved")
    uninitialized = next((o for o in ops.get("ops") or () if o.get("uninitialized")), None)
    # (where a module's difference comes from outside the dispatcher, an extension that
    # writes what torch.empty made without a version bump, that is the cause said below)
    if (c.cause in ("forward", "backward") and ops.get("reproduced") and uninitialized
            and not ops.get("origin_ops") and not ops.get("outside_dispatcher")):
        return c.cause, (
            f"{uninitialized['op']} in {op_place(uninitialized)} ({uninitialized['phase']}) "
            "read memory that torch.empty (or empty_like, new_empty) made and nothing had "
            "written: its result is whatever that memory held, which differs from run to run "
            "(fix: make it with torch.zeros, or write every element before it is read)")
    if (c.cause in ("forward", "backward") and ops.get("reproduced") and op
            and not ops.get("origin_ops") and not ops.get("outside_dispatcher")
            and op.get("role") != ORIGIN):
        text = text.removesuffix(UNCONFIRMED) + (
            f"; replayed op by op, the first op that differs, {op['op']} in "
            f"{op['module']} ({op['phase']}), already takes other inputs, and no "
            "op differs on equal inputs: no op is nondeterministic, the code ran differently "
            "(other ops, or the same ops on other operands or in another order: loss terms "
            "summed in the order of a set or of a dict built from one; fix: fix that order, "
            "e.g. sorted(...))")
    # (an RNG that differs as the first step begins is unseeded; one that parts later, while
    # everything before agreed, may have been drawn from as a set of strings was ordered)
    explained = planted or any(o.get("role") == ORIGIN for o in (ops.get("ops") or [])) or (
        not c.first_step and any(d.phase == STATE and d.slot.startswith("rng.")
                                 for d in c.first_diffs))
    if own_hash_seeds and not explained and c.cause in ("forward", "backward", "data", "rng"):
        text += ("; each run had a hash seed of its own (no --seed): code that iterates a "
                 "set of strings (loss terms, class names, file names) orders it differently "
                 "in each, which `detaudit exec --seed 0` (it fixes PYTHONHASHSEED too) rules "
                 "out")
    return c.cause, text
