"""Repeats a probe N times under the recorder, each time from identically seeded RNGs."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import (
    ANY_MODULE,
    MODEL_CLASS,
    OP_SITES,
    ROOT_NAME,
    SCAN,
    SCRIPTED,
    TIED_PARAMETERS,
    AuditConfig,
    Fault,
    ProbeSpec,
    fault_not_fired,
    nearest_modules,
)
from ..errors import DetauditError, FaultRefused, ProbeError
from ..probe import Probe
from ..record.environment import capture_environment
from ..record.fingerprint import Fingerprinter, widest_float
from ..record.oprecorder import OpRecorder
from ..record.recorder import (
    WATCH_CALLS,
    WATCH_MODULE,
    WATCH_NONE,
    Recorder,
    module_call_names,
)
from ..record.sites import PACKAGE_DIR, in_a_library
from ..record.stress import StressMode
from ..runfolder import partial_path, trace_probe
from ..seeding import seed_everything
from ..trace import (
    OPTIMIZER,
    OUTPUT,
    STATE,
    AnyTrace,
    StepInfo,
    Trace,
    TraceStream,
    open_trace,
)
from ..words import counted
from .memory import PeakMemory

ProbeFactory = Callable[[torch.device], Probe]


@dataclass
class OpPlan:
    """Extra work for one repeat: which steps to record op by op, which to record at module
    level in a scanned run (the zoom), where to stop, and whether to take the census (op
    counts and deterministic-algorithms alerts)."""

    steps: frozenset[int] | None = None  # None: every step
    last_step: int | None = None  # stop after this global step
    census: bool = False  # at the first step of every epoch up to last_step
    capture: tuple[str, str, int, str] | None = None  # (op phase, module, call, op prefix)
    zoom: frozenset[int] = frozenset()  # steps of a scanned run recorded at module level
    stress: frozenset[int] = frozenset()  # steps whose risky ops the last repeat re-executes
    modes: list[OpRecorder] = field(default_factory=list)  # the census modes, once run
    # where ops are recorded: keep the outputs of risky ops, and of the op a fault planted
    # in any repeat names (see OpRecorder)
    keep_risky: bool = False
    keep_planted: Fault | None = None
    # step -> module calls during which Python's or numpy's RNG advanced (op-recorded steps
    # of every repeat run with this plan)
    host_draws: dict[int, set[tuple[str, int]]] = field(default_factory=dict)

    def records(self, step: int) -> bool:
        return not self.census and (self.steps is None or step in self.steps)


@dataclass
class StressPlan:
    """The stress of one repeat: at the first step of every epoch, risky ops (or every op)
    re-run `runs` times on identical inputs; the rows go into the trace."""

    runs: int
    every_op: bool
    device: str
    env: dict[str, Any]
    seconds: float = 0.0

    def mode(self, recorder: Recorder, step: int, epoch: int) -> StressMode:
        return StressMode(recorder, step, epoch, self.runs, every_op=self.every_op,
                          device=self.device, env=self.env)


@dataclass
class RepeatTiming:
    """Wall time and peak memory of one repeat, kept out of the trace (they would change
    its bytes). Peak memory: CUDA max_memory_allocated, else the process's peak RSS."""

    repeat: int
    seconds: float
    steps: int
    peak_bytes: int | None = None
    steady_seconds: float | None = None  # the steps after the first (no build, no warm-up)
    stress_seconds: float = 0.0  # re-executing risky ops (see detaudit.record.stress)

    @property
    def steady_step_seconds(self) -> float | None:
        """Seconds per step once the probe is built and the first step has warmed up."""
        if self.steady_seconds is None or self.steps < 2:
            return None
        return self.steady_seconds / (self.steps - 1)


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; a CUDA request without CUDA is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DetauditError(f"unknown device {name!r} (use auto, cpu or cuda[:i])") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DetauditError("CUDA was requested but torch.cuda.is_available() is False")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DetauditError(f"there is no device {device}: {counted(count, 'CUDA device')}, "
                                f"cuda:0 to cuda:{count - 1}")
    return device


def _settable(owner: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _global_settings() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """Torch's process-wide settings a probe may change: name -> (read, write). TF32 goes
    through the fp32_precision API where torch has it (the legacy flags raise once a script
    has used the new API)."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    settings = {
        "threads": (torch.get_num_threads, torch.set_num_threads),
        "deterministic": (
            lambda: (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled()),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
        "fill_uninitialized_memory": _settable(torch.utils.deterministic,
                                               "fill_uninitialized_memory"),
        "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "cudnn.enabled": _settable(cudnn, "enabled"),
        "cudnn.benchmark": _settable(cudnn, "benchmark"),
        "cudnn.deterministic": _settable(cudnn, "deterministic"),
    }
    if hasattr(matmul, "fp32_precision"):
        settings["matmul.fp32_precision"] = _settable(matmul, "fp32_precision")
        settings["cudnn.fp32_precision"] = _settable(cudnn, "fp32_precision")
    else:  # torch before the fp32_precision API
        settings["matmul_precision"] = (torch.get_float32_matmul_precision,
                                        torch.set_float32_matmul_precision)
        settings["matmul.allow_tf32"] = _settable(matmul, "allow_tf32")
        settings["cudnn.allow_tf32"] = _settable(cudnn, "allow_tf32")
    return settings


@contextlib.contextmanager
def global_settings_restored() -> Iterator[None]:
    """Torch's process-wide settings as they were, after whatever a repeat changed: threads,
    deterministic algorithms, default dtype, matmul precision, cuDNN and TF32 flags. Each
    in-process repeat then starts from the same settings. Only what changed is set back."""
    settings = _global_settings()
    saved = {}
    for name, (read, _) in settings.items():
        with contextlib.suppress(Exception):
            saved[name] = read()
    try:
        yield
    finally:
        for name, value in saved.items():
            read, write = settings[name]
            with contextlib.suppress(Exception):
                if read() != value:
                    write(value)


@contextlib.contextmanager
def threads_as_recorded(env: dict[str, Any]) -> Iterator[None]:
    """Torch's thread counts as a trace's environment recorded them, for the duration: CPU
    reductions and convolutions round differently at another count. The inter-op count can
    only be set before a process's first inter-op work (a replay in a fresh process)."""
    before = torch.get_num_threads()
    interop = env.get("interop_threads")
    if interop and interop != torch.get_num_interop_threads():
        with contextlib.suppress(RuntimeError):  # this process has used its inter-op pool
            torch.set_num_interop_threads(interop)
    if env.get("threads"):
        torch.set_num_threads(env["threads"])
    try:
        yield
    finally:
        torch.set_num_threads(before)


def loss_copy(loss: torch.Tensor) -> torch.Tensor:
    """An exact copy of a scalar loss (float64, or float32 where the device has no float64),
    to read once the step is over: made on its device without waiting, and safe from the
    loss's own storage being reused before then (a CUDA graph's replay writes the next
    micro-batch's loss into it)."""
    return loss.detach().to(widest_float(loss.device), copy=True)


@contextlib.contextmanager
def mask_targets_by_kernel() -> Iterator[None]:
    """torchvision's Mask R-CNN mask targets computed with deterministic algorithms off, for
    the duration. Under them torchvision's roi_align takes a pure-PyTorch path that, with the
    adaptive sampling the targets use, materialises K x 28 x 28 x H x W floats (37.4 GiB for
    20 positive RoIs at 800 px); its CUDA forward kernel is deterministic (only its backward
    adds atomically), and the targets need no gradient."""
    try:
        from torchvision.models.detection import roi_heads
    except ImportError:  # an older torchvision without the module: nothing to change
        yield
        return
    original = roi_heads.project_masks_on_boxes

    def project_masks_on_boxes(*args: Any, **kwargs: Any) -> torch.Tensor:
        mode = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(False)
        try:
            return original(*args, **kwargs)
        finally:
            torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])

    roi_heads.project_masks_on_boxes = project_masks_on_boxes
    try:
        yield
    finally:
        roi_heads.project_masks_on_boxes = original


@contextlib.contextmanager
def deterministic_settings(enabled: bool) -> Iterator[None]:
    """PyTorch's deterministic settings for the duration, restored afterwards."""
    if not enabled:
        yield
        return
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        with mask_targets_by_kernel():
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        torch.utils.deterministic.fill_uninitialized_memory = saved[5]
        if saved[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def run_repeat(
    factory: ProbeFactory,
    config: AuditConfig,
    repeat: int,
    spec: ProbeSpec | None = None,
    on_step: Callable[[int, int, int], None] | None = None,
    ops: OpPlan | None = None,
    run_id: str = "",
    stream_to: Path | None = None,
    amend: Callable[[Trace], None] | None = None,
) -> tuple[AnyTrace, RepeatTiming]:
    """Run one repeat from freshly seeded RNGs and return its trace: held in memory, or with
    `stream_to`, written as the steps complete (a long repeat's memory stays flat) to its
    partial name (:func:`~detaudit.runfolder.partial_path`), renamed to `stream_to` when the
    repeat ends, and returned as the :class:`~detaudit.trace.TraceFile` that reads it.
    `amend(trace)` may add to the trace's probe before it is finished (what a rank noted).

    `ops` adds op-level work (see :class:`OpPlan`); without it, ``config.granularity``
    decides whether every step is recorded op by op.

    An exception while building the probe (or ``sys.exit`` in it) is raised as
    :class:`ProbeError`; one during the steps ends the repeat early and is stored in
    ``trace.failure`` (records up to it kept). The last repeat of an audit (not a replay
    with `ops`, unless its plan names steps to stress) stresses the risky ops
    (``config.stress``, see :class:`StressPlan`).
    Torch's global settings are restored
    afterwards; the trace's environment is the one the steps ran in (after the probe was
    built, with the audit's own settings applied).
    """
    import time

    device = resolve_device(config.device)
    fault_repeat = config.fault_repeat % config.repeats
    fault = config.fault if repeat == fault_repeat else None
    trace = Trace(probe=trace_probe(spec, config, run_id), repeat=repeat, env={})
    stream = TraceStream(trace, partial_path(stream_to)) if stream_to is not None else None
    if ops is None and config.granularity == "op":
        ops = OpPlan()
    started = time.perf_counter()
    steps_done = 0
    peak = PeakMemory(device)
    # cuda:N is the current device for the repeat: per-module RNG tracking reads its generator
    current = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with global_settings_restored(), current, peak, deterministic_settings(config.deterministic):
        seed_everything(config.seed)
        try:
            probe = factory(device)
        except DetauditError:
            raise
        except (Exception, SystemExit) as exc:  # the user's code: report it as theirs
            raise ProbeError(describe_user_error(exc, "while building the probe")) from exc
        trace.env = capture_environment(device)
        if not isinstance(probe, Probe):
            raise DetauditError(  # the file's contract broken: bad input, not a crash
                f"the probe function returned {type(probe).__name__}, not detaudit.Probe")
        if isinstance(probe.model, torch.nn.DataParallel):
            raise DetauditError(
                "nn.DataParallel runs replicas on several threads and devices at once, which "
                "a run-to-run audit cannot attribute; return the bare model, or audit "
                "DistributedDataParallel on N ranks (detaudit run --nproc N)"
            )
        if config.fault is not None:
            _check_fault_module(config.fault, probe.model)
        train = config.mode == "train"
        probe.model.train(train)
        fingerprinter = Fingerprinter()
        ends: list[float] = []
        stress = (StressPlan(config.stress, config.stress_every_op, str(device), trace.env)
                  if config.stress and repeat == config.repeats - 1
                  and (ops is None or ops.stress) else None)

        def step_ended(epoch: int, index: int, step: int) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a step has ended when its kernels have
            ends.append(time.perf_counter())
            if on_step:
                on_step(epoch, index, step)

        watch = WATCH_NONE if config.granularity == SCAN else WATCH_MODULE
        with Recorder(probe.model, fingerprinter, fault=fault, watch=watch) as recorder:
            trace.probe[MODEL_CLASS] = recorder.model_class()
            if scripted := recorder.scripted_modules():
                trace.probe[SCRIPTED] = scripted
            if tied := recorder.tied_parameters():
                trace.probe[TIED_PARAMETERS] = tied
            try:
                steps_done = _run_steps(probe, config, recorder, trace, train, step_ended, fault,
                                        ops, stress, stream)
            except DetauditError:
                raise
            except (Exception, SystemExit) as exc:  # noqa: BLE001 -- the user's step
                done = stream.steps if stream is not None else len(trace.steps)
                trace.failure = describe_user_error(exc, f"in step {done}")
                if raised_in_detaudit(exc):  # the traceback the failure asks to report
                    traceback.print_exception(exc, file=sys.stderr)
        if recorder.op_sites:
            trace.probe[OP_SITES] = recorder.op_sites
        if (fault is not None and not recorder.fault_fired and trace.failure is None
                and not _replay_stops_before(ops, fault.step)):
            raise FaultRefused(
                "the planted fault never fired: "
                + fault_not_fired(fault, steps_done, recorder.scripted_modules(),
                                  recorder.ops_at_fault, recorder.fault_met_zeros))
    steady = ends[-1] - ends[0] if len(ends) >= 2 else None
    timing = RepeatTiming(repeat, time.perf_counter() - started, steps_done, peak.peak_bytes,
                          steady, stress.seconds if stress is not None else 0.0)
    if amend is not None:
        amend(trace)
    if stream is not None:
        os.replace(stream.flush(), stream_to)
        return open_trace(stream_to), timing
    return trace, timing


def _run_steps(
    probe: Probe,
    config: AuditConfig,
    recorder: Recorder,
    trace: Trace,
    train: bool,
    on_step: Callable[[int, int, int], None] | None,
    fault: Fault | None,
    ops: OpPlan | None,
    stress: StressPlan | None = None,
    stream: TraceStream | None = None,
) -> int:
    step = 0
    for epoch in range(config.epochs):
        epoch_start = step
        for index, batch in enumerate(probe.epoch_batches(epoch)):
            if config.steps is not None and index >= config.steps:
                break
            if ops is not None and ops.last_step is not None and step > ops.last_step:
                return step
            due = index == 0 if ops is None else step in ops.stress
            stressing = stress.mode(recorder, step, epoch) if stress and due else None
            scope = _op_scope(recorder, step, fault, ops, stressing, epoch_start=index == 0,
                              env=trace.env)
            watch = _watch(config, step, ops, scope)
            recorder.begin_step(step, watch)
            recorder.watch_host_rng = ops is not None and ops.records(step)
            info = StepInfo(step=step, epoch=epoch, index=index)
            recorder.record_state(batch, as_loaded=True)
            if step == 0:
                recorder.record_parameters(STATE, stats=watch == WATCH_MODULE)
            losses = {}
            if train:
                losses = _train_step(probe, batch, recorder, info, step, scope,
                                     watch == WATCH_MODULE)
            else:
                with torch.no_grad(), scope:
                    outputs = probe.step(probe.model, batch)
                recorder.record(OUTPUT, "", 0, "detections", outputs, plain=True)
            store_records(trace, step, recorder.end_step())
            info.keep_losses(losses)
            trace.steps.append(info)
            if ops is not None and recorder.host_draws:
                ops.host_draws.setdefault(step, set()).update(recorder.host_draws)
                recorder.host_draws = set()
            if stressing is not None:
                for row in stressing.rows():
                    trace.add_stress(row)
                stress.seconds += stressing.seconds
            if stream is not None and stream.due():
                stream.flush()
            step += 1
            if on_step:
                on_step(epoch, index, step)
        if config.granularity == SCAN and train and probe.optimizer is not None and step:
            # a scan keeps optimizer state at epoch ends only (and at zoomed steps)
            recorder.begin_step(step - 1, WATCH_NONE)
            recorder.record_optimizer(probe.optimizer)
            store_records(trace, step - 1, recorder.end_step())
        if (train and probe.scheduler is not None and probe.scheduler_interval == "epoch"
                and step > epoch_start):
            probe.scheduler.step()
    return step


def _watch(
    config: AuditConfig, step: int, ops: OpPlan | None, scope: contextlib.AbstractContextManager,
) -> str:
    """How the recorder watches the modules at `step`: every call recorded (module and op
    granularity, a scanned run's zoomed steps, and the step of a planted fault in every
    repeat, so that the planted change is compared where it is planted even when rounding
    absorbs it further on); calls followed but not recorded (a scanned step where the op
    level runs, which needs to know the call); or not at all (step state only)."""
    planted = config.fault is not None and config.fault.step == step
    if config.granularity != SCAN or planted or (ops is not None and step in ops.zoom):
        return WATCH_MODULE
    return WATCH_CALLS if not isinstance(scope, contextlib.nullcontext) else WATCH_NONE


def _op_scope(
    recorder: Recorder, step: int, fault: Fault | None, ops: OpPlan | None,
    stressing: StressMode | None = None, epoch_start: bool = True,
    env: dict[str, Any] | None = None,
) -> contextlib.AbstractContextManager:
    """The op-level modes for this step, or nothing when no op-level work is due. The stress
    mode sits below the op recorder, so it sees each op as it really ran (before a planted
    op fault) and the recorder never records the re-executions."""
    record = ops is not None and ops.records(step)
    census = ops is not None and ops.census and epoch_start
    capture = ops.capture if ops is not None and ops.last_step == step else None
    if not (record or census or capture or (fault is not None and fault.op and fault.step == step)):
        return stressing if stressing is not None else contextlib.nullcontext()
    mode = OpRecorder(recorder, step, record=record, fault=fault, census=census, capture=capture,
                      keep_risky=record and ops is not None and ops.keep_risky,
                      keep_planted=ops.keep_planted if record and ops is not None else None,
                      env=env)
    if ops is not None:
        ops.modes.append(mode)
    return mode if stressing is None else _Stacked(stressing, mode)


class _Stacked:
    """Dispatch modes entered in order (the last one on top), as one re-usable scope."""

    def __init__(self, *modes: contextlib.AbstractContextManager) -> None:
        self.modes = modes
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> _Stacked:  # noqa: PYI034
        self._stack = contextlib.ExitStack()
        for mode in self.modes:
            self._stack.enter_context(mode)
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)


def _train_step(
    probe: Probe, batch: Any, recorder: Recorder, info: StepInfo, step: int,
    scope: contextlib.AbstractContextManager, modules: bool = True,
) -> dict[str, torch.Tensor]:
    """One training step; returns copies of its loss terms (read once the step is over). At
    module level the parameter gradients are recorded as backward left them (what the
    backward origin analysis reads); in a scanned step as the optimizer receives them, after
    unscaling and clipping, and the optimizer state not at all."""
    with scope:
        losses = probe.step(probe.model, batch)
    terms = losses if isinstance(losses, dict) else {"loss": losses}
    if not terms or not all(isinstance(v, torch.Tensor) for v in terms.values()):
        raise ProbeError(f"in train mode the step ({_where(probe.step)}) must return a loss "
                         "tensor or a dict of loss tensors")
    shaped = {name: tuple(v.shape) for name, v in terms.items() if v.numel() != 1}
    if shaped:
        name, shape = next(iter(shaped.items()))
        raise ProbeError(f"the loss must be a scalar: the step ({_where(probe.step)}) returned "
                         f"{name!r} of shape {shape} (reduce it, e.g. .mean())")
    recorder.record(OUTPUT, "", 0, "loss", terms)
    losses = {name: loss_copy(value) for name, value in terms.items()}
    total = sum(terms.values())
    accumulate = max(1, probe.accumulate)
    if accumulate > 1:
        total = total / accumulate
    recorder.before_backward(total)
    scaler = probe.scaler
    with scope:
        (scaler.scale(total) if scaler is not None else total).backward()
    optimizer = probe.optimizer
    if modules or optimizer is None:
        recorder.record_param_grads()
    if optimizer is None or (step + 1) % accumulate:
        return losses
    if scaler is not None:
        scaler.unscale_(optimizer)
    if probe.clip_grad_norm:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, probe.clip_grad_norm)
    if not modules:
        recorder.record_param_grads(stats=False)
    stepped = True
    if scaler is not None:
        scale_before = float(scaler.get_scale())
        scaler.step(optimizer)
        stepped = not _skipped(scaler, optimizer, scale_before)
        scaler.update()
        scale = float(scaler.get_scale())
        info.scale = _finite(scale)
        recorder.record(OPTIMIZER, "", 0, "scale", torch.tensor(scale, dtype=torch.float64))
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    info.optimizer_stepped = stepped
    info.lr = [_finite(float(group["lr"])) for group in optimizer.param_groups]  # what it used
    recorder.record_parameters(OPTIMIZER, stats=modules)
    if modules:  # (before the scheduler's step: the learning rates the update used)
        recorder.record_optimizer(optimizer, stats=True)
    if probe.scheduler is not None and probe.scheduler_interval == "step":
        probe.scheduler.step()
    return losses


def _skipped(scaler: Any, optimizer: Any, scale_before: float) -> bool:
    """Whether GradScaler skipped the optimizer step (inf/NaN gradients). Read before
    ``update()``, which forgets it; a scaler without that state is judged by its scale."""
    found = getattr(scaler, "_found_inf_per_device", None)
    if found is not None:
        try:
            return any(float(v) for v in found(optimizer).values())
        except (KeyError, RuntimeError, AssertionError):
            pass
    return float(scaler.get_scale()) < scale_before


def store_records(trace: Trace, step: int, records: Any) -> None:
    """Append one step's records and module calls to `trace`."""
    for key, print_ in zip(records.keys, records.prints):
        trace.add_record(step, key, print_)
    for call in records.calls:
        trace.add_call(step, call.module, call.index, call.parent, call.reads)


def _check_fault_module(fault: Fault, model: torch.nn.Module) -> None:
    """A fault planted in a module the model does not have is refused before any step runs
    (it ran the whole audit, then said the module did not run), with the names nearest."""
    names = [name for name in module_call_names(model) if name]
    if fault.module in ("", ANY_MODULE) or fault.module in names:
        return
    hint = nearest_modules(fault.module, names, "its modules") if names else (
        f"it has no submodules: name the model itself, {ROOT_NAME}")
    raise FaultRefused(f"--inject-fault: the model has no module {fault.module!r}; {hint}")


def _replay_stops_before(ops: OpPlan | None, step: int) -> bool:
    """Whether an op-level replay ends before `step` (a fault there cannot fire)."""
    return ops is not None and ops.last_step is not None and ops.last_step < step


def _finite(value: float) -> float | None:
    """A float a trace can hold (strict JSON): None where it is NaN or infinite."""
    return value if math.isfinite(value) else None


def _where(fn: Any) -> str:
    """`file:line` of a user's function, for messages about what it returned."""
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def describe_user_error(exc: BaseException, when: str) -> str:
    """One line naming the exception, `when` it was raised (``"in step 3"``, ``"while
    importing x.py"``) and the innermost frame outside detaudit and torch."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"SyntaxError {when} at {exc.filename}:{exc.lineno}: {exc.msg}"
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not in_a_library(f.filename)]
    frame = (user or frames or [None])[-1]
    where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
    if (in_worker := _raised_in_a_worker(exc)) is not None:
        return f"{in_worker[0]} {when} in {in_worker[1]} (the loop received it{where})"
    if raised_in_detaudit(exc):
        inner = frames[-1]
        return (f"detaudit's own recording failed {when}{where} ({type(exc).__name__} "
                f"at {os.path.basename(inner.filename)}:{inner.lineno}: "
                f"{_first_line(exc)}): a bug in detaudit, please report it")
    if isinstance(exc, SystemExit):
        return f"the audited code called sys.exit({exc.code!r}) {when}{where}"
    return f"{type(exc).__name__} {when}{where}: {_first_line(exc)}".rstrip(": ")


def _raised_in_a_worker(exc: BaseException) -> tuple[str, str] | None:
    """An error a DataLoader worker raised, as the loop raises it again (torch's
    ExceptionWrapper: "Caught ValueError in DataLoader worker process 0.", then the worker's
    traceback as text), named as the worker raised it: ("ValueError", "DataLoader worker
    process 0 at data.py:98: bad image 3"), the innermost frame outside the libraries; None
    for any other error."""
    said = _WORKER_ERROR.match(_TERMINAL_CODES.sub("", str(exc)).strip())
    if said is None:
        return None
    kind, worker, lines = said[1], said[2], said[3].splitlines()
    files = [n for n, line in enumerate(lines) if line.startswith('  File "')]
    sites = [_FRAME_LINE.match(lines[n]) for n in files]
    user = [m for m in sites if m is not None and not in_a_library(m[1])]
    site = (user or [m for m in sites if m is not None] or [None])[-1]
    error = next((line for line in lines[files[-1] + 1 if files else 0:]
                  if line and not line.startswith(" ")), "")
    name, _, message = error.partition(": ")
    return (name or kind, f"{worker}{f' at {site[1]}:{site[2]}' if site else ''}"
            + (f": {message}" if message else ""))


_WORKER_ERROR = re.compile(r"Caught (\S+) in (.+?)\.\nOriginal Traceback \(most recent call "
                           r"last\):\n(.*)", re.DOTALL)
_FRAME_LINE = re.compile(r'  File "(.+)", line (\d+), in ')


def raised_in_detaudit(exc: BaseException) -> bool:
    """Whether `exc` was raised in detaudit's own hooks, not in the code they watch. An
    error of the device or of the tensors' data (a CUDA error raised at the next sync, which
    is often detaudit's first read of the step's tensors; out of memory; a meta tensor's
    missing data) is the step's, wherever it surfaced."""
    if isinstance(exc, _DEVICE_ERRORS) or any(m in str(exc) for m in _DEVICE_MESSAGES):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    inner_user = max((i for i, f in enumerate(frames) if not in_a_library(f.filename)),
                     default=-1)
    inner_hook = max((i for i, f in enumerate(frames) if f.name in _HOOK_ENTRIES
                      and os.path.abspath(f.filename).startswith(PACKAGE_DIR)), default=-1)
    return inner_hook > inner_user


def _first_line(exc: BaseException) -> str:
    """The message's first line, without terminal colour codes (torch.load's has some)."""
    text = _TERMINAL_CODES.sub("", str(exc)).strip()
    return text.splitlines()[0] if text else ""


_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# Where detaudit's code is entered from torch's hooks around the user's code: an exception
# whose innermost frame outside torch is one of these (or below one) is detaudit's own.
_DEVICE_ERRORS = tuple(getattr(torch, name) for name in ("OutOfMemoryError", "AcceleratorError")
                       if hasattr(torch, name))
_DEVICE_MESSAGES = ("CUDA error", "device-side assert", "out of memory", "meta tensor",
                    "HIP error", "XPU error", "MPS backend")
_HOOK_ENTRIES = frozenset({
    # Recorder (a hook on a tensor or an autograd node; a module hook's wrapper, _Hook)
    "_pre_hook", "_post_hook", "hook", "__call__",
    "_global_pre", "_global_post", "on_backward", "_before_update", "_after_update",
    "on_loader_pass", "on_loader_iter", "on_loader_batch", "on_scaler_update",  # Attachment
    "on_manual_seed", "on_parameter_made",
    # the Recorder's entry points the runner calls between the user's calls
    "begin_step", "end_step", "before_backward", "record", "record_optimizer",
    "record_param_grads", "record_parameters", "record_state",
})
