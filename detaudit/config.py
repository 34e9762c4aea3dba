"""What to audit and how, as typed plain data: built once (by the CLI or the API), then
passed down. Nothing here imports torch, so a configuration can be read, stored in a trace
and rebuilt in another process or next month."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import DetauditError
from .trace import BACKWARD, FORWARD
from .words import counted

# Augmentation libraries whose draws seeding python's, numpy's and torch's RNGs may not
# reach (albumentations 2 gives each Compose a generator of its own): the version of each
# one a run imported is in its environment, for the cause of a batch that differs to name.
AUGMENTATION_LIBRARIES = ("albumentations",)

TRAIN, INFER = "train", "infer"
AUTO = "auto"  # exec and watch: inference if the model's first call is in eval mode, no optimizer
ATTACH_MODES = (AUTO, TRAIN, INFER)
SCAN = "scan"  # step state only, every step; module and op level at the zoomed step
GRANULARITIES = (SCAN, "module", "op")
SEED_RANGE = (-(2**63), 2**64)  # what torch.manual_seed accepts
ISOLATIONS = ("inprocess", "process")
_FAULT = re.compile(
    r"^(?P<module>[^@:/]*)(/(?P<op>[\w.]+))?(@(?P<phase>forward|backward))?(:(?P<step>\d+))?$"
)
FAULT_GRAMMAR = "MODULE[/OP][@forward|@backward][:STEP] or op:OP[@phase][:STEP]"


ROOT_NAME = "(model)"  # the model itself, as reports (and --inject-fault) name it
ANY_MODULE = "*"  # an op fault's module where `op:OP` names none: the op in any module
# Said when an op fault never fired: where the op is looked for.
OP_FAULT_MODULE = "an op fault names the innermost module the op runs in, not a parent of it"


def scripted_fault(module: str, scripted: Iterable[str]) -> str | None:
    """What to say of a fault planted in (or inside) one of the TorchScript modules
    `scripted` (see Recorder.scripted_modules); None where `module` is in none of them."""
    inside = next((name for name in scripted if module == name
                   or module.startswith(f"{name}.")), None)
    if inside is None:
        return None
    caller = inside.rpartition(".")[0] or ROOT_NAME
    where = "" if module == inside else f"inside {inside!r}, "
    return (f"module {module!r} is {where}a TorchScript module (torch.jit.script), which takes "
            f"no hooks: plant at the module that calls it, {caller!r}, or at an op in that "
            f"one ('{caller}/OP')")


SCRIPTED = "scripted"  # the TorchScript modules of a trace's model (see scripted_fault)
# where a loop has several top-level models: the names their modules are recorded under
# ("" the first model's, a class name another's)
MODELS = "models"
# the ops a planted op fault's module ran in its phase at its step, where the fault's op
# never ran (see Recorder.ops_at_fault)
OPS_AT_FAULT = "ops_at_fault"
# a backward fault's module ran backward at its step, sending only all-zero gradients
FAULT_MET_ZEROS = "fault_met_zeros"


def nearest_modules(name: str, names: list[str], listed: str) -> str:
    """What to say of a module name that is not among `names`: those it ends (a LoRA layer's
    `lora_A` is `base_model.model.encoder.layer.0.attention.self.query.lora_A`), the nearest
    ones, or the outermost few of them (in their order) and how many there are, under
    `listed` ("modules that ran")."""
    ending = [n for n in names if n.endswith(f".{name}")]
    if ending:
        more = f", ... ({len(ending)} in all)" if len(ending) > 5 else ""
        return f"did you mean {', '.join(ending[:5])}{more}?"
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    if close:
        return f"did you mean {', '.join(close)}?"
    outermost = sorted(names, key=lambda n: n.count("."))[:8]
    more = f", ... ({len(names)} in all)" if len(names) > len(outermost) else ""
    return f"{listed}: {', '.join(outermost)}{more}"


_OPS_LISTED = 30  # of the ops an op fault's module ran, where its op did not run


def fault_not_fired(fault: Fault, steps: int, scripted: list[str] | None = None,
                    ran: Iterable[str] = (), met_zeros: bool = False) -> str:
    """Why a planted fault never fired in a run of `steps` steps (after "the planted fault
    never fired: "); `scripted`: the TorchScript modules of the model (see
    Recorder.scripted_modules); `ran`: the ops an op fault's module ran in its phase at its
    step (see Recorder.ops_at_fault); `met_zeros`: the module ran backward there, every
    gradient it sent to its inputs all zero."""
    if steps <= fault.step:
        return f"the run has only {steps} steps (0 to {steps - 1})"
    said = scripted_fault(fault.module, scripted or ())
    if said is not None:
        return said
    of = f"at step {fault.step} of {counted(steps, 'recorded step')}"
    if met_zeros and not fault.op:
        return (f"module {fault.named!r} ran backward {of}, but every gradient it sent to its "
                "inputs was all zero (nothing reached them, as where a layer's input is the "
                "same in every row and its softmax's backward cancels), and a zero gradient "
                "cannot carry 1 ULP: plant it @forward, or at another step")
    ran = sorted(ran)
    listed = (f"{', '.join(ran[:_OPS_LISTED])}"
              + (f" and {len(ran) - _OPS_LISTED} more" if len(ran) > _OPS_LISTED else ""))
    if fault.module == ANY_MODULE:
        return (f"op {fault.op!r} did not run {fault.phase} in any module {of}"
                + (f" (the ops that ran {fault.phase} there: {listed})" if ran else ""))
    ops = f"; the ops it ran {fault.phase} there: {listed}" if ran else ""
    where = f"op {fault.op!r} in " if fault.op else ""
    return (f"{where}module {fault.named!r} did not run {fault.phase} {of}"
            + (f" ({OP_FAULT_MODULE}{ops})" if fault.op else "")
            + (" (a module that needs no gradient, for its parameters or its inputs, as a "
               "frozen layer, runs no backward: plant @forward; nor is a backward seen module "
               "by module in a later step than its module's forward, as an actor's is whose "
               "forward runs before a critic's update, in Stable-Baselines3's SAC: plant it "
               "@forward)"
               if fault.phase == BACKWARD and not ran else ""))


@dataclass(frozen=True)
class Fault:
    """A planted change in one run: 1 ULP at `module`'s output (forward: its first element)
    or input gradient (backward: the largest element of the first gradient that is not all
    zero); with `op`, in the first output of the first such op run inside `module` (any
    module when it is ANY_MODULE; the model's own ops, in none of its submodules, when it is
    empty) that is not all zero -- 1 ULP for floats, two elements
    swapped for integers (e.g. nms's kept indices)."""

    module: str
    phase: str = FORWARD
    step: int = 0
    op: str | None = None

    def __post_init__(self) -> None:
        if self.phase not in (FORWARD, BACKWARD):
            raise DetauditError(f"fault phase must be forward or backward, not {self.phase!r}")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """`MODULE[/OP][@forward|@backward][:STEP]`, or `op:OP...` for an op in any module;
        ``(model)``, as reports name it, is the model itself."""
        if text.startswith("op:"):
            text = "/" + text[3:]
        m = _FAULT.match(text)
        if not m or not (m.group("module") or m.group("op")):
            raise DetauditError(f"fault {text!r} is not {FAULT_GRAMMAR}")
        module = {ROOT_NAME: "", "": ANY_MODULE}.get(m.group("module"), m.group("module"))
        return cls(module, m.group("phase") or FORWARD, int(m.group("step") or 0),
                   m.group("op"))

    @property
    def named(self) -> str:
        """Its module as reports name it: ``(model)`` for the model itself."""
        return {"": ROOT_NAME, ANY_MODULE: "any module"}.get(self.module, self.module)

    def in_wrapper(self, prefix: str = "module") -> Fault:
        """The same fault with its module named inside a wrapper (DDP's ``module.``)."""
        if self.module in ("", ANY_MODULE) or self.module.split(".")[0] == prefix:
            return self
        return replace(self, module=f"{prefix}.{self.module}")


# re-runs of each risky op on identical inputs at a stressed step (see record.stress)
STRESS_RUNS = 16


@dataclass(frozen=True)
class AuditConfig:
    """How to run an audit; stored in every trace so a run can be repeated exactly."""

    repeats: int = 2
    epochs: int = 1
    steps: int | None = None  # per epoch; None runs each epoch's batches to the end
    mode: str = TRAIN  # "train" or "infer"
    device: str = "cpu"
    seed: int = 0
    deterministic: bool = False  # PyTorch's deterministic settings on for the run
    fault: Fault | None = None  # planted in one repeat only (`fault_repeat`)
    fault_repeat: int = -1  # -1: the last repeat
    granularity: str = SCAN  # "module": every module call of every step; "op": op by op too
    # The last repeat re-runs each risky op this many times on identical inputs at the first
    # step of every epoch (0: off); `stress_every_op`: every op of those steps, not only risky ones.
    stress: int = STRESS_RUNS
    stress_every_op: bool = False

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise DetauditError("repeats must be at least 1")
        if self.epochs < 1 or (self.steps is not None and self.steps < 1):
            raise DetauditError("epochs and steps must be at least 1")
        if self.mode not in (TRAIN, INFER):
            raise DetauditError(f"mode must be train or infer, not {self.mode!r}")
        if self.mode == INFER and self.fault is not None and self.fault.phase == BACKWARD:
            raise DetauditError("--inject-fault plants in backward, but inference runs no "
                                "backward: plant @forward, or audit training")
        if self.granularity not in GRANULARITIES:
            raise DetauditError(f"granularity must be one of {', '.join(GRANULARITIES)}, "
                                f"not {self.granularity!r}")
        if self.stress < 0:
            raise DetauditError(f"stress must be 0 (off) or a number of runs, not {self.stress}")
        if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise DetauditError(f"seed {self.seed} is outside torch's range "
                                f"[{SEED_RANGE[0]}, {SEED_RANGE[1] - 1}]")

    @property
    def train(self) -> bool:
        return self.mode == TRAIN

    @property
    def total_steps(self) -> int | None:
        """Steps over all repeats, when the steps per epoch are fixed."""
        return self.repeats * self.epochs * self.steps if self.steps else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the trace."""
        data = asdict(self)
        data["fault"] = asdict(self.fault) if self.fault else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditConfig:
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        if data.get("fault"):
            data["fault"] = Fault(**data["fault"])
        return cls(**data)


# the probe kinds a replay rebuilds from their description (not a command, watch or a
# Python callable, which detaudit did not run itself)
REBUILT_KINDS = ("builtin", "file")


@dataclass(frozen=True)
class ProbeSpec:
    """What to build for each repeat, as plain data: a built-in probe and its recipe
    options, a probe file and the function in it, or (API only) a Python callable, which
    cannot leave this process and is described by its qualified name."""

    kind: str  # builtin | file | python
    name: str
    options: dict[str, Any] = field(default_factory=dict)  # built-in recipe options
    source: str | None = None  # the probe file (absolute) or the callable's module
    func: str = "probe"  # the function in the probe file

    def to_dict(self) -> dict[str, Any]:
        """Plain data, keys as stored in traces and run folders (empty fields left out)."""
        data: dict[str, Any] = {"kind": self.kind, "name": self.name}
        if self.kind == "builtin":
            data["options"] = dict(self.options)
        elif self.kind == "file":
            data.update(source=self.source, func=self.func)
        else:
            data["source"] = self.source
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeSpec:
        """Inverse of :meth:`to_dict`; one clear error for a damaged description."""
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            raise DetauditError("the probe description is damaged (no kind)")
        return cls(
            kind=data["kind"], name=str(data.get("name", "?")),
            options=dict(data.get("options") or {}), source=data.get("source"),
            func=data.get("func") or "probe",
        )


@dataclass(frozen=True)
class Preset:
    """Default sizes for a device type: small on CPU, realistic on CUDA."""

    name: str
    repeats: int
    epochs: int
    steps: int
    image_size: int
    batch_size: int
    num_images: int

    def describe(self, config: AuditConfig, spec: ProbeSpec, ranks: int | None = None) -> str:
        """One line: what the run does, as the banner and the reports show it."""
        options = spec.options
        size = f", {options['image_size']} px, batch {options['batch_size']}" if options else ""
        on_ranks = f", {ranks} ranks" if ranks else ""
        steps = counted(config.steps, "step") if config.steps else "all steps"
        return (f"{self.name}: {counted(config.repeats, 'repeat')} × "
                f"{counted(config.epochs, 'epoch')} × {steps}{size}, {config.mode}{on_ranks}")


CPU_PRESET = Preset("cpu", repeats=2, epochs=2, steps=2, image_size=128, batch_size=1,
                    num_images=2)
CUDA_PRESET = Preset("cuda", repeats=3, epochs=2, steps=5, image_size=800, batch_size=2,
                     num_images=10)


def preset_for(device_type: str) -> Preset:
    """The preset of a device type (``cuda`` or anything else)."""
    return CUDA_PRESET if device_type == "cuda" else CPU_PRESET


@dataclass(frozen=True)
class Investigations:
    """What to run after the audit: the op drill-down (after a divergence), the census of
    known-nondeterministic ops, and the verification of the fix."""

    drill_down: bool = True  # at scan granularity: the zoom
    census: bool = False
    verify_fix: bool = False
    zoom_tries: int = 3  # replays of the zoomed step before it is called intermittent


@dataclass(frozen=True)
class Launch:
    """How the repeats run: in this process or one interpreter each, on one rank or N."""

    isolation: str = "inprocess"
    nproc: int | None = None

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise DetauditError(f"isolation must be inprocess or process, not {self.isolation!r}")
        if self.nproc is not None and self.nproc < 1:
            raise DetauditError("the number of ranks must be at least 1")


# `detaudit exec`: the job variable a bootstrapped process reads (JSON), the variable that
# names the process that records (its children, which inherit the job, do not), and the key
# of the trace's probe that says whether a planted fault fired.
JOB_VARIABLE = "DETAUDIT_ATTACH"
OWNER_VARIABLE = "DETAUDIT_ATTACH_PID"
CLAIM_SUFFIX = ".claim"  # beside a run's trace: the process of the command that records it
# Beside a run's trace (or a rank's; see drivers/stopping.py): touched by the recording process
# as each step ends (--step-timeout); the processes of the run that attached (a pid and its
# start time a line), which exec asks to stop; the mark it leaves before it stops a run for
# its step timeout; and where each process was when stopped so
PROGRESS_SUFFIX = ".progress"
PIDS_SUFFIX = ".pids"
TIMED_OUT_SUFFIX = ".timed-out"
STACKS_SUFFIX = ".stacks"
RANK_OWNER_VARIABLE = "DETAUDIT_ATTACH_RANK"  # the rank whose first process records
FAULT_FIRED = "fault_fired"
ENDED = "ended"  # a trace's recording ended as it should (its loop ended, failed or hit a limit)
# a trace saved at the end of every step: a worker its launcher ends without exit hooks
# (Ray ends its workers so) loses only the step it was in
FLUSHED_EACH_STEP = "flushed_each_step"
EXIT_CALL = "exit_call"  # where the command last called sys.exit, and with what
# the step a run failed in after its update, before the step ended (not kept: see attach)
FAILED_AFTER_UPDATE = "failed_after_update"
CALLS_UNSEEN = "calls_unseen"  # a trace's model ran where module hooks do not (compiled code)
LOADER_IN_A_THREAD = "loader_in_a_thread"  # a DataLoader was iterated outside the loop's thread
DROPPED_STEPS = "dropped_steps"  # backward passes whose gradients were zeroed unused: no steps
RECORDED_BY = "recorded_by"  # exec: the pid of the process that recorded a trace
MODEL_CLASS = "model_class"  # the class of the model a trace recorded (Recorder.model_class)
PROBE_FILE_MODULE = "detaudit_probe_"  # how a probe file's module is named as it is imported
SIDE_MODELS = "side_models"  # models a trace recorded that no optimizer trains (an EMA copy)
# where in the user's code each op recorded outside the model ran ("file:line"; a backward
# op, that of the forward op whose autograd node it runs), by op_site_key
OP_SITES = "op_sites"


def op_site_key(step: int, backward: bool, prefix: str) -> str:
    """The key of OP_SITES for an op: "STEP:op<k>/<name>" (the slot prefix of its records)
    in forward, "STEP:backward:op<k>/<name>" in backward."""
    return f"{step}:backward:{prefix}" if backward else f"{step}:{prefix}"


# the probe key of a watched run: the script it ran in, with its arguments (not in a notebook)
WATCHED_SCRIPT = "watched_script"
INFERRED = "inferred"  # a trace recorded as inference because auto mode took it for one
# a step limit in epochs was given, and no DataLoader fed the steps: no epoch to count
EPOCHS_UNSEEN = "epochs_unseen"
# a step limit in epochs was given, and the run ended within its first pass over the
# training DataLoader: that pass's length in batches (None where the loader has no len)
FIRST_PASS_UNFINISHED = "first_pass_unfinished"
# --max-epochs E was given, and the run, never stopped by it, made more passes over the
# training DataLoader than E: its steps spanned passes (a step accumulating more batches
# than a pass holds), and a run ends only as a step begins. The number of passes
EPOCHS_SPANNED = "epochs_spanned"
# why the first run of an exec audit refused its fault's op, a name neither PyTorch nor
# torchvision has (see planting.check_op_known: exec's own process never imports torch)
UNKNOWN_OP = "unknown_op"
# the seconds a run spent re-executing risky ops (see record.stress)
STRESS_SECONDS = "stress_seconds"
# the training DataLoader's worker processes, and the worker_init_fn each runs as it starts
# ({"workers": n, "worker_init_fn": "name at file:line" or None}): what reseeds their RNGs,
# which a recording in the loop's process does not see
TRAIN_LOADER_WORKERS = "train_loader_workers"
# where the code seeded torch's RNG after parameters were made, before the first step (a
# model built, then seeded: Hugging Face's Trainer seeds in its __init__)
SEEDED_AFTER_PARAMETERS = "seeded_after_parameters"
# the first seed the code gave torch before the first step, and where ([value, "file:line"]):
# a seed drawn at random differs from run to run
FIRST_SEED = "first_seed"
# files an exec run loaded with torch.load that an earlier run of the same audit wrote (a
# checkpoint the script resumes from), as the script named them
LOADED_FROM_EARLIER_RUNS = "loaded_from_earlier_runs"
# beside a run's trace: those files, loaded by a process of the run that made no step (a
# script that resumed from what an earlier run saved, with nothing left to train), a line each
STEPLESS_LOADS = ".loaded"
# the model's parameters were in shared memory as its first step began (share_memory():
# other processes may write them, as Hogwild training in child processes does)
SHARED_PARAMETERS = "shared_parameters"
# parameters the model holds under more than one name (tied weights: an embedding and the
# output layer), by the name records go under -> its other names
TIED_PARAMETERS = "tied_parameters"
UNJOINED = "unknown"  # the backend of a rank that has joined no process group (yet)


def written_by_an_earlier_run(path: str | os.PathLike, since_ns: int, began_ns: int) -> bool:
    """Whether `path` was last written after the audit began (`since_ns`) and before this
    run of the command did (`began_ns`): by an earlier run of the audit. Raises OSError where
    there is no such path."""
    return since_ns <= os.stat(path).st_mtime_ns < began_ns


def kept_path(trace: str | Path) -> Path:
    """Where the op outputs the first run's zoom replay of a command kept lie, beside its
    trace, for the later runs' replays to measure theirs against (see OpRecorder.kept)."""
    return Path(f"{trace}.kept.pt")


def measured_path(trace: str | Path) -> Path:
    """Where a later run's zoom replay of a command writes how far the op outputs it kept
    are from the first run's (see record.difference.differences_from), beside its trace: the
    audit reads it without torch."""
    return Path(f"{trace}.measured.json")


def zoom_outputs(trace: str | Path) -> tuple[Path, Path]:
    """What a zoom replay of a command may leave beside its trace for the audit."""
    return kept_path(trace), measured_path(trace)


def rank_trace_path(path: str | Path, rank: int) -> Path:
    """Where rank `rank` of a distributed command writes the trace the job names `path`."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".json.gz") + f"-r{rank}.json.gz")


@dataclass(frozen=True)
class ExecJob:
    """What each run of the command records, as the bootstrap reads it from the job
    variable."""

    repeats: int = 2
    seed: int | None = None  # seed every RNG before the user's code (None: leave unseeded)
    max_steps: int | None = None
    max_epochs: int | None = None
    fault: Fault | None = None  # planted in the last run (and in the last run of each replay)
    # a step is an optimizer step (train) or a call of the model (infer); auto: infer if the
    # model's first call is in eval mode and no optimizer exists
    mode: str = AUTO
    zoom: bool = True  # after a forward or backward divergence, re-run to record that step
    zoom_tries: int = 3
    # the first run re-runs each risky op this many times at the first step of every epoch
    # (0: off; `stress_every_op`: every op of those steps)
    stress: int = STRESS_RUNS
    stress_every_op: bool = False
    # a run in which no step ends for this many seconds is stopped (None: no limit)
    step_timeout: float | None = None
