"""Recording a training loop detaudit does not drive: the user's own script (``detaudit
exec``, through a bootstrap that runs before their code) or their own loop
(``detaudit.watch``).

Torch's global hooks stand in for what the runner otherwise knows. A step is one optimizer
step (the updates of several optimizers between two forwards are one): its pre-hook sees the
gradients as the optimizer gets them (after unscaling and clipping), its post-hook the
parameters after the update. The model is the top-level module,
called in training mode, whose parameters the optimizer updates; the batch is what it is
called with (each call of an accumulated step), and what the training DataLoader yielded for
the step (labels a loss takes outside the model are in it); the loss is what backward is
called on. An epoch is a new pass over the data that feeds steps; evaluation passes are not
steps (see :mod:`.attach_epochs`). Every step is recorded at scan level (see
:mod:`detaudit.trace`): batch, RNGs, losses, gradients, parameters after the update. In an
inference script (no optimizer, the model first called in eval mode) a step is one call of
the model, its outputs recorded. The process an exec run records in is set up and ended by
:mod:`.attach_process`.

This module keeps the step bookkeeping: where steps begin (the top-level calls, backward),
limits, inference, saving. Its parts live beside it: :mod:`.attach_patches` (installing the
hooks and the patched torch entry points), :mod:`.attach_updates` (where a step ends: its
update), :mod:`.attach_epochs` (the DataLoader batches and epochs) and :mod:`.attach_models`
(which modules are the models).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter
from torch.nn.utils.parametrize import ParametrizationList

from ..config import (
    ATTACH_MODES,
    AUTO,
    ENDED,
    EPOCHS_SPANNED,
    EPOCHS_UNSEEN,
    FAILED_AFTER_UPDATE,
    FAULT_FIRED,
    FAULT_MET_ZEROS,
    FIRST_PASS_UNFINISHED,
    FIRST_SEED,
    INFER,
    INFERRED,
    LOADED_FROM_EARLIER_RUNS,
    MODEL_CLASS,
    MODELS,
    OP_SITES,
    OPS_AT_FAULT,
    SCRIPTED,
    SEEDED_AFTER_PARAMETERS,
    SHARED_PARAMETERS,
    SIDE_MODELS,
    STEPLESS_LOADS,
    STRESS_SECONDS,
    TIED_PARAMETERS,
    TRAIN,
    TRAIN_LOADER_WORKERS,
    UNKNOWN_OP,
    Fault,
    kept_path,
    measured_path,
    rank_trace_path,
)
from ..errors import DetauditError, FaultRefused
from ..planting import check_op_known, fault_target
from ..record.difference import differences_from
from ..record.environment import capture_environment
from ..record.fingerprint import TensorPrint, storages_of
from ..record.oprecorder import OpRecorder
from ..record.recorder import (
    WATCH_CALLS,
    WATCH_MODULE,
    WATCH_NONE,
    Recorder,
    RecordKey,
    StepRecords,
    module_call_names,
)
from ..record.sites import user_call_site
from ..record.stress import StressMode
from ..record.structure import iter_leaves, iter_tensors
from ..storage import atomic_write
from ..trace import (
    OUTPUT,
    PROBE_CONFIG,
    STATE,
    StepInfo,
    Trace,
    TraceStream,
    open_trace,
)
from .attach_epochs import Epochs, Waiting
from .attach_models import ModelFinder, SideModels, live_objects
from .attach_patches import Installing, transformed
from .attach_side import SideCalls
from .attach_updates import Updates
from .rankprobe import RankWatch
from .runner import loss_copy, store_records

# torch.load as detaudit found it: a process of the command notes what its code loads through
# it (see attach_process._loading_noted), and a zoom replay's own reading is none of that
_TORCH_LOAD = torch.load


def _keep_or_measure(kept: dict[Any, list[torch.Tensor]], trace: Path,
                     reference: Path | None) -> None:
    """The op outputs a zoomed step kept: the first run's replay writes them for the later
    runs' (see kept_path); a later one, given them as `reference`, writes how far its own are
    from them (see measured_path), which the audit reads without torch. A failure to is a
    measurement forgone, never the step's."""
    try:
        if reference is None:
            path = kept_path(trace)
            if not kept:
                path.unlink(missing_ok=True)
                return
            part = path.with_name(path.name + ".part")
            torch.save(kept, part)
            part.replace(path)
            return
        found = differences_from(_TORCH_LOAD(reference, weights_only=True), kept) if (
            kept and reference.exists()) else {}
        # (Python's JSON, not strict JSON: a difference may be infinite)
        atomic_write(measured_path(trace), json.dumps([[list(k), v] for k, v in found.items()]))
    except Exception:  # noqa: BLE001 -- see above
        return


class Attachment(Installing, Updates, Epochs, SideCalls):
    """Records the steps of a loop it does not run, into one trace saved at `path`.

    `model` and `optimizer`, when given, are the ones recorded; otherwise the first top-level
    module called in training mode is taken, and changed at the first optimizer step for the
    one whose parameters that optimizer updates. After `max_steps` steps (or at the start of
    epoch `max_epochs`) the trace is saved and `on_limit` is called to end the loop. Step
    `zoom` is recorded at module and op level (a zoom replay); `fault` is planted at its step.
    `rank`, in one rank of a distributed command, notes what the cross-rank checks need: the
    parameters as built (before DDP broadcasts rank 0's) and the training sampler's order.
    """

    def __init__(
        self, path: str | Path, probe: dict[str, Any], repeat: int = 0, *,
        model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
        max_steps: int | None = None, max_epochs: int | None = None,
        on_limit: Callable[[], None] | None = None, zoom: int | None = None,
        fault: Fault | None = None, rank: RankWatch | None = None,
        planted_step: int | None = None, mode: str = AUTO,
        claim: Callable[[], bool] | None = None, stress: int = 0,
        stress_every_op: bool = False, check_fault: Fault | None = None,
        keep_planted: Fault | None = None, measure_against: Path | None = None,
    ) -> None:
        """`claim`, where other processes may record the same trace: asked as the first step
        begins whether this process records it; where not, it records nothing and detaches
        (see attach_process._first_to_claim). `measure_against`: the trace of the first run's
        zoom replay (of this process's rank, once it is known to record one), whose kept op
        outputs this one's are measured against (see _keep_or_measure)."""
        if mode not in ATTACH_MODES:
            raise ValueError(f"mode must be one of {', '.join(ATTACH_MODES)}, not {mode!r}")
        self.path = Path(path)
        self._claim, self._claimed = claim, claim is None
        self.trace = Trace(probe=probe, repeat=repeat, env={})  # what is not yet flushed
        self.trace.probe[ENDED] = False  # until the loop ends, fails or reaches its limit
        self.stream = TraceStream(self.trace, self.path)
        self.optimizer = optimizer
        self.models = ModelFinder(model, optimizer)  # which modules are the models
        self.max_steps, self.max_epochs = max_steps, max_epochs
        self.on_limit = on_limit
        # exec's watch of the run (its progress, its --step-timeout): given the steps ended
        self.on_step_end: Callable[[int], None] | None = None
        self.finishing = False  # (saving the trace as the run ends)
        self.zoom, self.fault = zoom, fault
        # the step a fault is planted at, in whichever run: recorded at module level in all
        self.planted_step = fault.step if fault is not None else planted_step
        self.recorder: Recorder | None = None
        self._ops: OpRecorder | None = None  # the op-level mode of a zoomed or faulted step
        # re-runs of each risky op at the first step of every epoch (see record.stress)
        self.stress_runs, self.stress_every_op = stress, stress_every_op
        # a fault another run plants: this one ends at the step after it where it cannot
        # fire there (a misspelt module), so that the audit refuses it without a whole run
        self.check_fault = check_fault
        # the fault a run of the audit plants: the zoomed step keeps its op's outputs (and
        # those of risky ops) beside the trace, for the audit to measure (see kept_path)
        self.keep_planted, self.measure_against = keep_planted, measure_against
        self._stress: StressMode | None = None
        self._init_side_calls()
        self._loop_thread = threading.get_ident()  # the first step's (see _no_call_of_the_loop)
        self._loop_thread_known = False
        self.info: StepInfo | None = None  # the open step
        self.epoch = 0
        self.explicit_epoch: int | None = None
        self.index = 0  # step within its epoch
        self._updated = False  # the open step's optimizer has stepped
        self._updated_at = 0  # the autograd sequence number when it did
        # the loop took a batch after the open step's update, or its pass over the training
        # data ended: the step's code is over (a failure now is not the step's: see finish)
        self._moved_on = False
        # the storage of what the open step's top-level training calls returned: a later
        # call given it (a discriminator given the generator's fakes) is given the step's
        # work, not data
        self._step_outputs: list[Any] = []
        # the optimizers that updated in the open step, in their order: id -> the optimizer,
        # weakly (a loop that builds its model and optimizer anew lets the old ones go, and
        # that makes the new model the model: see ModelFinder)
        self._stepped: dict[int, weakref.ref] = {}
        self._optimizers: set[int] = set()  # every optimizer that has updated
        self._carried: StepRecords | None = None  # the open step's state, of another model
        self._grads_pending = False  # step(closure): gradients recorded after the update
        # step(closure): its optimizer, and the closure's evaluations whose gradients were
        # recorded (see _closure_evaluated)
        self._closure_step: tuple[Any, int] = (None, 0)
        self._closure_losses = 0  # the step's losses before its closure's last evaluation
        self._batches = 0  # top-level training calls in the open step
        self._rng_taken = False  # the open step recorded the RNG states as it began
        self._before_step: tuple[Any, ...] = (None, 0, frozenset(), 0, 0)  # see _drop_step
        self._at_backward: list[tuple[torch.Tensor, int]] = []  # see on_zero_grad
        self._discarded = False  # the open step's gradients were zeroed unused (on_zero_grad)
        self.batches_seen = 0  # in all steps
        self._fetched = 0  # training loader batches recorded in the open step
        # batches waiting for the step they feed, and how many batches ahead of the loop
        # its loader is fetched (see _file_loader_batches)
        self._waiting: list[Waiting] = []
        self._fetched_ahead: int | None = None  # (known as the first step takes its batches)
        self._iter_called: dict[int, tuple[Any, int]] = {}  # see on_loader_iter
        self.making_iterator = 0  # see attach_patches._begin_pass_outside_iter
        # each DataLoader iterator's pass: (its loader's id, the loader's pass number)
        self._iterators: weakref.WeakKeyDictionary[Any, tuple[int, int]] = (
            weakref.WeakKeyDictionary())
        self.loader_iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        self._losses = 0
        self._loss_values: dict[str, torch.Tensor] = {}  # read once the step is over
        # losses backward was called on before any model call was seen (the model runs
        # inside a compiled function): recorded once the update names the model
        self._unowned_losses: list[torch.Tensor] = []
        # the model's trainable parameters and their versions after the open step's last
        # backward, in a loop that may update by hand (see _updated_by_hand)
        self._by_hand: list[tuple[torch.Tensor, int]] = []
        self._by_hand_prints: list[str] = []  # their prints then
        self._optimizer_used = False  # an optimizer's step has begun (its closure may run)
        self._by_hand_possible: bool | None = None  # see _updates_by_hand
        self._grads_by_hand: list[tuple[RecordKey, TensorPrint]] = []  # see after_backward
        # each updated parameter's version counter as its update left it: one changed in
        # place between steps (clipping, pruning, a manual edit) is recorded again
        self._versions: dict[int, tuple[torch.Tensor, int]] = {}
        self._depth = 0
        self._adopted = False  # a model built anew took the model's place (see _adopt)
        self._side = SideModels()  # models called but trained by no optimizer (an EMA)
        # the pass that feeds the epoch's steps, and how many passes fed steps before it
        self._train_pass: tuple[int, int] | None = None
        self._epochs_fed = 0
        self._latest_loader: int | None = None  # the last to begin a pass
        self._yielded: tuple[int, int] | None = None  # the pass of the last batch yielded
        # loaders whose batches fed steps, and whether one yielded since the last step began
        # or updated: a call without gradients without such a batch is no step (see
        # _evaluating)
        self._step_loaders: set[int] = set()
        self._fed = False
        self._passes: dict[int, int] = {}
        # with max_epochs: loader -> its len, (loader, pass) -> the batches it yielded, and
        # the passes that ran out
        self._pass_lengths: dict[int, int | None] = {}
        self._pass_batches: dict[tuple[int, int], int] = {}
        self._passes_ended: set[tuple[int, int]] = set()
        self._loader_workers: dict[int, dict[str, Any]] = {}  # loader -> its workers
        self.rank = rank
        self._samplers: dict[int, list[dict[str, Any]]] = {}  # loader -> its passes' orders
        self._handles: list[Any] = []
        self._patches: list[tuple[Any, str, Any]] = []
        self._parameters_made = False  # since the hooks were installed (see on_manual_seed)
        self._seeded_first = False  # torch was seeded before any parameter was made
        self.stopped = False
        self.installed = False
        self.in_backward = False
        self._eager: Any = None  # torch.compile's stance while a step runs eagerly
        # whether a step is a call of the model (inference) rather than an optimizer step:
        # as `mode` says, or (auto) decided at the first top-level call of a module with
        # parameters (see _inference_at)
        self.inferring: bool | None = {TRAIN: False, INFER: True}.get(mode)
        self._auto = mode == AUTO
        self._out_of_graphs = False  # see keep_out_of_graphs

    # -- what the hooks see ----------------------------------------------------------------
    def _no_call_of_the_loop(self, module: nn.Module, args: tuple) -> bool:
        """A module call the loop does not make: one being transformed (see
        attach_patches.transformed), the computing of a parametrized weight (each read of it
        calls its parametrizations), a call made while a model is built (see
        _building_a_model), a dry run (see _dry_run), or a call in another
        thread than the loop's (an evaluation run in the background) but for autograd's (a
        checkpoint recomputing)."""
        if transformed() or isinstance(module, ParametrizationList):
            return True
        in_the_loop = threading.get_ident() == self._loop_thread or (
            torch._C._current_autograd_node() is not None)
        if not in_the_loop and self._loop_thread_known:
            return True
        if self._depth == 0 and (_building_a_model() or _dry_run(module, args)):
            return True  # (asked of top-level calls only)
        # until a step begins, the loop's thread is the one that attached, or the thread
        # of a call that may begin the first step (a loop run in a thread of its own)
        return not in_the_loop and not (module.training and torch.is_grad_enabled())

    def _global_pre(self, module: nn.Module, args: tuple) -> None:
        if self._no_call_of_the_loop(module, args):
            return
        if self._depth == 0:
            hooks_before = set(module._forward_pre_hooks)
            self._top_level_call(module, args)
            if self.recorder is not None:
                self.recorder.join_call(module, args, hooks_before)
            self._side_call_begins(module)
        self._depth += 1

    def _top_level_call(self, module: nn.Module, args: tuple) -> None:
        """A call outside every other module call: it may begin a step (or end the run)."""
        if (self._auto and self.inferring and module.training and torch.is_grad_enabled()
                and any(True for _ in module.parameters())):
            self._trains_after_all()
        # a call inside a backward (a checkpoint recomputing its forward) is no new batch
        if self.stopped or self.in_backward:
            return
        if self._inference_at(module):
            if self._inferred_name(module) is not None:  # a step: this call
                self._on_batch(module, args, {})
            return
        found = self.models.found(module) and torch.is_grad_enabled()
        if (module.training or found) and not self._evaluating(module):
            if self.models.add_candidate(module) and self.models.replaces_model(module):
                self._adopt(module)
            # A step begins at the model's call, or at the first call after an update
            # of another model an optimizer trains (a GAN's generator called before its
            # discriminator): that call's work belongs to the step it starts.
            if module is self.models.current() or found or (
                    self._updated and self.models.is_other(module)):
                self._on_batch(module, args, {})
                return
        elif module is self.models.current() and self._last_step_over():
            self.end_step()  # evaluation after the last step's update: the run is over
            self.stop()
            return
        # an evaluation, or another model called without gradients (in training mode too:
        # a DQN's target network as PyTorch's tutorial calls it, never put in eval mode)
        if not module.training or not torch.is_grad_enabled():
            side = self._side.saw(module, self._recorded_parameters(), self._recorded_names())
            if side is not None:
                self.trace.probe.setdefault(SIDE_MODELS, []).append(side)
                if self.info is not None and not self._updated:  # (first called in a step:
                    self._record_side_state()  # its state, before its call, is the step's)

    def _global_post(self, module: nn.Module, args: tuple, output: Any,
                     kwargs: dict | None = None) -> Any:
        if self._no_call_of_the_loop(module, args):
            return None
        self._depth = max(0, self._depth - 1)
        name = self._inferred_name(module) if self._depth == 0 and self.inferring else None
        if name is not None and self.info is not None and self.recorder is not None:
            replaced = self.recorder.leave_call(module, args, output)
            output = output if replaced is None else replaced
            self.recorder.record(OUTPUT, name, 0, "output", output, plain=True)
            self._updated = True  # the call is the step: it is over
            self.end_step()
            if self.max_steps is not None and self.stream.steps >= self.max_steps:
                self.stop()
            return replaced
        if self._depth == 0 and self.info is not None and module.training:
            self._step_outputs.extend(
                s for _, t in iter_tensors(output) for s in storages_of(t) if s.data_ptr())
        return self._side_call_ends(args, kwargs or {}, output) if self._depth == 0 else None

    def _adopt(self, module: nn.Module) -> None:
        """`module` is the model from now on (see ModelFinder.replaces_model), recorded under
        the same names; the open step is over, and the next records the new model's
        parameters as it begins."""
        if self.info is not None:
            self.end_step()
        if self.recorder is not None:
            self.recorder.__exit__(None, None, None)
            self.recorder = None
        self.models.model = module
        self._versions = {}
        self._by_hand_possible = None  # (asked again of the new model)
        self._adopted = True

    def _inference_at(self, module: nn.Module) -> bool:
        """Whether the loop infers: decided (in auto mode) at the first top-level call of a
        module with parameters. It infers if that call is in eval mode or without gradients
        and no optimizer exists; the model is then that module."""
        if self.inferring is None and any(True for _ in module.parameters()):
            self.inferring = (not module.training or not torch.is_grad_enabled()) and (
                self.optimizer is None and not any(True for _ in live_objects(
                    torch.optim.Optimizer)))
        if self.inferring:  # (what the reports say of the run)
            self.trace.probe.setdefault(PROBE_CONFIG, {})["mode"] = INFER
            self.trace.probe[INFERRED] = self._auto
        return bool(self.inferring)

    def _trains_after_all(self) -> None:
        """The loop, taken for inference (auto), trains: a call in training mode with
        gradients on, a backward or an optimizer step (an evaluation before training, the
        optimizer made after it). The calls recorded as steps are forgotten, and the run is
        recorded from here as training (a limit of steps reached before it had stopped the
        run as inference)."""
        self.inferring = False
        self.trace.probe.setdefault(PROBE_CONFIG, {})["mode"] = TRAIN
        self.trace.probe[INFERRED] = False
        self._end_ops()
        if self.recorder is not None:
            self.recorder.__exit__(None, None, None)
        self.recorder, self.info = None, None
        self.models.forget()
        self._train_pass, self._epochs_fed, self.epoch, self.index = None, 0, 0, 0
        self._updated, self._batches, self._losses, self._moved_on = False, 0, 0, False
        self._loss_values, self._step_outputs = {}, []
        self._fetched, self._by_hand_possible, self._fetched_ahead = 0, None, None
        self.stream.restart()

    def _inferred_name(self, module: nn.Module) -> str | None:
        """The name of the model `module` is a step of, in inference (see
        ModelFinder.inferred_name); another model named now is recorded from now on."""
        name, new = self.models.inferred_name(module)
        if new and self.recorder is not None:
            self.recorder.add_model(name, module)
        return name

    def _record_side_state(self) -> None:
        """The side models' parameters and buffers not recorded yet, or changed since (see
        SideModels.changed), as the open step's state."""
        assert self.recorder is not None
        side_params, side_buffers = self._side.changed(self._recorded_parameters())
        if side_params or side_buffers:
            self.recorder.record_side_state(side_params, side_buffers)

    def _on_batch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A top-level training call: a new step begins if the last one has updated (or
        threw its gradients away: it was none)."""
        if self.info is not None and self._discarded and not self._updated:
            self._drop_step()
        if self.info is not None and not self._updated and self._updated_by_hand():
            self._record_update_by_hand()
        if self._updated:
            self.end_step()
            if self.stopped:
                return
        if self.info is None and not self._begin_step(module, by_call=True):
            return
        assert self.recorder is not None
        batch = {"args": list(args), "kwargs": kwargs} if kwargs else list(args)
        if self._step_outputs:
            batch = _data_only(batch, {s.data_ptr() for s in self._step_outputs})
        if self._batches == 0:
            self.recorder.record_state(batch, rng=not self._rng_taken)
        else:
            self.recorder.record(STATE, "", self._batches, "batch", batch)
        self._batches += 1
        self.batches_seen += 1

    def on_backward(self, tensor: Any) -> None:
        """backward is called on `tensor`: the loss (each one of an accumulated step; a
        tensor of several values too, whose curve is not drawn)."""
        if self._auto and self.inferring and isinstance(tensor, torch.Tensor):
            self._trains_after_all()
        if self.stopped or self.inferring or not isinstance(tensor, torch.Tensor) or (
                tensor.grad_fn is None):
            return
        if self._updated and (self._batches == 0 or tensor.grad_fn._sequence_nr() >= (
                self._updated_at)):
            # a loss computed after the update, by calls not seen (compiled): backward is
            # where the next step begins; one computed before it is the step's (two models'
            # backward and update in turn, as co-teaching does, are one step)
            self.end_step()
        if self.info is None and self.models.current() is None and not self.models.candidates:
            # kept until an update names the model: scalars only, and a bounded number (a
            # script with no optimizer calls backward for other ends)
            if tensor.numel() == 1 and len(self._unowned_losses) < MAX_UNOWNED_LOSSES:
                self._unowned_losses.append(tensor.detach())
            return
        if self.info is None and not self._begin_step(self.models.current()):
            return
        # what the parameters are as backward begins: zeroed gradients with them unchanged
        # since were thrown away (see on_zero_grad)
        self._at_backward = [(p, p._version) for p in self.recorder.trainable_parameters()]
        self._discarded = False
        self._record_loss(tensor)

    def _record_loss(self, tensor: torch.Tensor) -> None:
        """Record one loss backward is called on (in the open step)."""
        assert self.recorder is not None and self.info is not None
        # (a closure evaluated again by its optimizer, LBFGS: its losses are kept apart
        # from the step's own, the first evaluation's, which step() returns)
        evaluation = self._closure_step[1] if self._grads_pending else 0
        n = self._losses - (self._closure_losses if evaluation else 0)
        name = ("loss" if n == 0 else f"loss.{n}") + (f"@{evaluation}" if evaluation else "")
        self._losses += 1
        self.recorder.record(OUTPUT, "", 0, name, tensor.detach())
        if tensor.numel() == 1:
            self._loss_values[name] = loss_copy(tensor)
        if self._watch(self.info.step) != WATCH_NONE:
            self.recorder.before_backward(tensor)  # module-level backward records, faults

    def on_parameter_made(self, module: nn.Module, name: str, param: Any) -> None:
        """A module registered a parameter (a model being built). One built after the code
        seeded late, before the first step, may be the model it trains, built seeded (YOLO
        builds a model, then its trainer seeds and builds the one it trains): the late seed
        is not said to come after the model."""
        self._parameters_made = self._parameters_made or param is not None
        if param is not None and SEEDED_AFTER_PARAMETERS in self.trace.probe \
                and self.info is None and not self.stream.steps:
            del self.trace.probe[SEEDED_AFTER_PARAMETERS]
            self._seeded_first = True

    def on_manual_seed(self, frame: FrameType, seed: Any) -> None:
        """The code seeds torch's RNG with `seed` (called from `frame`): the first seed
        before the first step is kept with where it was given (one drawn at random differs
        from run to run), and where the code first seeded, if that was after parameters were
        made and before the first step (the model may have been built from an unseeded RNG:
        Hugging Face's Trainer seeds in its __init__). A seed before any parameter was made
        built the model seeded: later ones are the code's own (fixed noise drawn under
        fork_rng)."""
        if FIRST_SEED not in self.trace.probe and self.info is None and not self.stream.steps:
            with contextlib.suppress(TypeError, ValueError, RuntimeError):  # (torch says why)
                self.trace.probe[FIRST_SEED] = [int(seed), user_call_site(frame)]
        if not self._parameters_made:
            self._seeded_first = True
        elif (not self._seeded_first and self.info is None and not self.stream.steps
                and SEEDED_AFTER_PARAMETERS not in self.trace.probe):
            self.trace.probe[SEEDED_AFTER_PARAMETERS] = user_call_site(frame)

    def name_losses(self, losses: dict[str, Any]) -> list[str]:
        """The user named the loss terms of the open step (``watch``'s ``w.step(losses)``),
        and what else the loop logs with them (an accuracy, a count, a tensor of per-class
        losses): each recorded, a number's value kept as a loss term's is. The names of the
        values that hold nothing to record (neither tensors nor plain values)."""
        if self.info is None or self.recorder is None:
            return []
        unrecorded = []
        for name, value in losses.items():
            slot = f"loss.{name}"
            if hasattr(value, "__array__") and not isinstance(value, torch.Tensor):
                with contextlib.suppress(TypeError, ValueError, RuntimeError):
                    value = torch.as_tensor(value)  # a numpy number or array
            if isinstance(value, torch.Tensor):
                self.recorder.record(OUTPUT, "", 0, slot, value.detach())
                if value.numel() == 1:
                    self._loss_values[name] = loss_copy(value)
            elif any(True for _ in iter_leaves(value)):
                self.recorder.record(OUTPUT, "", 0, slot, value, plain=True)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._loss_values[name] = torch.tensor(float(value), dtype=torch.float64)
            else:
                unrecorded.append(name)
        return unrecorded

    # -- steps -----------------------------------------------------------------------------
    def _begin_step(self, model: nn.Module | None, by_call: bool = False) -> bool:
        """Open the next step for `model`, begun by its call (`by_call`) or, where its calls
        are not seen (compiled) or come later (a closure's), by a backward or an update;
        False where no step may begin (a limit reached)."""
        if model is None or not self._claimed and not self._claims_the_trace():
            return False
        if not self._loop_thread_known:
            self._loop_thread, self._loop_thread_known = threading.get_ident(), True
            self._keep_the_loops_batches()
        # what a step dropped again (see _drop_step) gives back
        self._before_step = (self._train_pass, self._epochs_fed, frozenset(self._step_loaders),
                             self.epoch, self.index)
        if self.max_steps is not None and self.stream.steps >= self.max_steps:
            self.stop()  # the last step was not complete when it updated
            return False
        if self.check_fault is not None and (
                self.stream.steps == 1 and not self._op_known(self.check_fault)
                or self.stream.steps == self.check_fault.step + 1
                and not self._fault_can_fire(self.check_fault)):
            self.stop()
            return False
        if self.recorder is None:
            self.recorder = self._new_recorder(model)
            self.trace.env = capture_environment(_device_of(model))
        epoch = self._epoch()
        if self._yielded is not None:
            self._step_loaders.add(self._yielded[0])
        self._fed = False
        if self.max_epochs is not None and epoch >= self.max_epochs:
            self.stop()  # (a loader built anew for the epoch: no pass of the old one began)
            return False
        if epoch != self.epoch:
            self.epoch, self.index = epoch, 0
        step = self.stream.steps
        self.info = StepInfo(step=step, epoch=self.epoch, index=self.index)
        watch = self._watch(step)
        stressing = self.stress_runs and self.index == 0 and not _compiled(model)
        if stressing and watch == WATCH_NONE:
            watch = WATCH_CALLS  # (the stress names the module each op ran in)
        # inside the model's call: hooks may be added (its own run from the next call on)
        # but never removed here (see Recorder.hook_for); they go after the update
        self.recorder.begin_step(step, watch, rehook=False)
        if watch != WATCH_NONE:
            self.recorder.hook_for(watch)
            self._run_eagerly(True)
        if stressing:
            self._stress = StressMode(self.recorder, step, self.epoch, self.stress_runs,
                                      every_op=self.stress_every_op,
                                      device=str(_device_of(model)), env=self.trace.env)
            self._stress.__enter__()  # (below the op recorder: it sees each op as it ran)
        if step == self.zoom or (self.fault is not None and self.fault.op
                                 and self.fault.step == step):
            self._ops = OpRecorder(self.recorder, step, record=step == self.zoom,
                                   fault=self.fault, keep_risky=step == self.zoom,
                                   keep_planted=self.keep_planted, env=self.trace.env)
            self._ops.__enter__()
        if step == 0 and any(map(_in_shared_memory, self.recorder.trainable_parameters())):
            self.trace.probe[SHARED_PARAMETERS] = True
        if step == 0 or self._adopted:
            self.recorder.record_parameters(STATE)
            self._adopted = False
        else:
            self._record_changed_parameters()
        self._record_side_state()
        self.recorder.add_records(self._side.pending + self._ops_recorded_ahead(step))
        self._side.pending = []
        self._rng_taken = not by_call  # (a call records them with its batch)
        if self._rng_taken:
            self.recorder.record_rng()
        self._by_hand = []  # (taken after the step's backward)
        self._grads_by_hand = []
        return True

    def record_as_rank(self, rank: RankWatch, path: str | Path) -> bool:
        """This process, which records no rank, turns out to be one (a launcher in it
        started the others as copies of its command, then it joined their process group):
        before its first step it records as that rank, into `path`, a trace no other
        process claims; after, it cannot."""
        if self.rank is not None or self.stream.steps or self.stopped or not self.installed:
            return False
        rank.wrapped_by = "script"  # (the user's code builds its DDP model)
        self.rank = rank
        self._claimed = True  # (workers a launcher started, each its rank: Ray Train's)
        self.path = self.stream.path = Path(path)
        self._watch_ddp_init(rank)
        return True

    @property
    def claimed(self) -> bool:
        """Whether this process records its trace (see `claim`)."""
        return self._claimed

    def _claims_the_trace(self) -> bool:
        """Whether this process records (see `claim`); where another does, it detaches."""
        self._claimed = self._claim is not None and self._claim()
        if not self._claimed:
            self.stopped = True
            self.uninstall()
        return self._claimed

    def _recorded_names(self) -> set[str]:
        """The module names the recorded models' records are made under (a side model takes
        none of them)."""
        if self.recorder is not None:
            return self.recorder.module_names()
        model = self.models.current()
        return set(module_call_names(model)) if model is not None else set()

    def _recorded_parameters(self) -> set[int]:
        """The ids of the recorded models' parameters (the model's, before its recording
        began)."""
        if self.recorder is not None:
            return self.recorder.parameter_ids()
        model = self.models.current()
        return {id(p) for p in model.parameters()} if model is not None else set()

    def _record_changed_parameters(self) -> None:
        """Parameters changed in place since their update, outside the optimizer: recorded
        as the step's state (so a difference there is the parameters', not the forward's).
        A change through ``.data`` bumps no version counter and is not seen here."""
        changed = [p for p, version in self._versions.values() if p._version != version]
        if changed:
            self.recorder.record_parameters(STATE, of=changed)
            self._versions.update({id(p): (p, p._version) for p in changed})

    def _run_eagerly(self, eager: bool) -> None:
        """Compiled code runs eagerly at a step recorded module by module (a compiled graph
        would trace the recorder's hooks into itself and fuse the ops it names), compiled
        elsewhere; in every repeat alike. Needs torch's compiler stances (torch 2.6)."""
        if eager and self._eager is None and "torch._dynamo" in sys.modules and hasattr(
                torch.compiler, "set_stance"):
            self._eager = torch.compiler.set_stance("force_eager")
        elif not eager and self._eager is not None:
            self._eager.__exit__(None, None, None)
            self._eager = None

    def _new_recorder(self, model: nn.Module) -> Recorder:
        recorder = Recorder(model, fault=self.fault, watch=WATCH_NONE)
        for name, other in self.models.others:
            recorder.add_model(name, other)
        self.trace.probe[MODEL_CLASS] = recorder.model_class()
        return recorder

    def _watch(self, step: int) -> str:
        """Every module call at the zoomed step and at the step a fault is planted at (in
        every run, so that the planted change is compared where it is planted even when
        rounding absorbs it further on); step state only elsewhere."""
        return WATCH_MODULE if step in (self.zoom, self.planted_step) else WATCH_NONE

    def _op_known(self, fault: Fault) -> bool:
        """Whether `fault`'s op, if it names one, is one torch or torchvision has; where not,
        the refusal is noted for the audit (see planting.check_op_known)."""
        try:
            check_op_known(fault)
        except FaultRefused as exc:
            self.trace.probe[UNKNOWN_OP] = str(exc)
            return False
        return True

    def _fault_can_fire(self, fault: Fault) -> bool:
        """Whether `fault` passes the check the audit makes of it after this run (see
        planting.fault_target), on the steps recorded so far."""
        self._write()
        try:
            fault_target(fault, open_trace(self.path))
        except DetauditError:
            return False
        return True

    def _end_ops(self) -> None:
        if self._ops is not None:
            ops, self._ops = self._ops, None
            ops.__exit__(None, None, None)
            if self.recorder is not None and self.recorder.op_sites:
                self.trace.probe[OP_SITES] = dict(self.recorder.op_sites)
            if ops.record:  # (the zoomed step)
                against = self.measure_against
                if against is not None and self.rank is not None:
                    against = rank_trace_path(against, self.rank.rank)
                _keep_or_measure(ops.kept, self.path, kept_path(against) if against else None)
        if self._stress is not None:
            stress, self._stress = self._stress, None
            stress.__exit__(None, None, None)
            for row in stress.rows():
                self.trace.add_stress(row)
            self.trace.probe[STRESS_SECONDS] = (self.trace.probe.get(STRESS_SECONDS, 0.0)
                                                + stress.seconds)

    @property
    def model(self) -> nn.Module | None:
        """The model recorded: given, or found (see ModelFinder)."""
        return self.models.model

    @property
    def fault_fired(self) -> bool:
        return self._side_fault_fired or (self.recorder is not None and self.recorder.fault_fired)

    @property
    def given_optimizer_idle(self) -> bool:
        """The optimizer given never updated while another one did (the loop steps an
        optimizer made anew, not the one given)."""
        return (self.optimizer is not None and self._optimizer_used
                and id(self.optimizer) not in self._optimizers)

    def trained_none_of(self, model: nn.Module) -> bool:
        """Optimizers updated, none of them a parameter of `model` (they train another
        model: one made for an earlier model, in a notebook)."""
        return bool(self._optimizers) and not any(id(p) in self._versions
                                                  for p in model.parameters())

    def awaits_update(self) -> bool:
        """The open step has run its training forward (or backward) and its update is still
        to come: an optimizer was given or has updated, or one holds the model's parameters
        (a loop that names its losses before ``loss.backward()`` or ``opt.step()``)."""
        return (self.info is not None and (self._losses > 0 or self._batches > 0)
                and not self._updated and not self.inferring
                and (self.optimizer is not None or bool(self._optimizers)
                     or self._by_hand_possible is False))

    def end_step(self) -> None:
        """Close the open step and keep its records (a step that threw its gradients away
        without an update is dropped: see on_zero_grad)."""
        if self.info is None or self.recorder is None:
            return
        if self._discarded and not self._updated:
            self._drop_step()
            return
        self._end_ops()
        if not self._updated or self.inferring:  # (an inference step's call ends; a
            self._file_loader_batches()  # training step's update filed them: _step_done)
        if self._carried is not None:
            store_records(self.trace, self.info.step, self._carried)
            self._carried = None
        store_records(self.trace, self.info.step, self.recorder.end_step())
        ended = self.info.step + 1
        self.info.keep_losses(self._loss_values)
        self._loss_values = {}
        self.trace.steps.append(self.info)
        self.info, self._updated, self._batches, self._losses = None, False, 0, 0
        self._moved_on = False
        self._step_outputs = []
        self._fetched = 0
        self._stepped = {}
        self.index += 1
        if self.stream.due():
            self.save()
        if self.on_step_end is not None:
            self.on_step_end(ended)

    def stop(self) -> None:
        """The step or epoch limit is reached: save, stop recording, end the loop."""
        self.stopped = True
        self.trace.probe[ENDED] = True
        self.save()
        if self.on_limit is not None:
            self.on_limit()

    def end_updated_step(self) -> None:
        """The open step is complete once its update ran (by an optimizer or by hand): a
        run stopped from outside after it (a hang before the next batch) keeps it."""
        if self.info is not None and not self._updated and self._updated_by_hand():
            self._record_update_by_hand(last=True)
        if self.info is not None and self._updated and not self.stopped:
            self.end_step()

    def finish(self, failure: str | None = None) -> None:
        """The loop is over (or failed): close the open step, save the trace."""
        self.finishing = True
        try:
            self._finish(failure)
        finally:
            self.finishing = False

    def _finish(self, failure: str | None) -> None:
        self.trace.probe[ENDED] = True
        if not self._claimed and (self.stopped or not (failure or self.trace.failure)
                                  or not self._claims_the_trace()):
            # no step (a failure before the first is this process's to say, if it may); the
            # files it loaded from earlier runs are said all the same (a run that resumed
            # with nothing left to train)
            loaded = self.trace.probe.get(LOADED_FROM_EARLIER_RUNS)
            if loaded and not (failure or self.trace.failure):
                with open(self.path.with_name(self.path.name + STEPLESS_LOADS), "a") as notes:
                    notes.writelines(f"{name}\n" for name in loaded)
            return
        if self.stopped:
            self.save()
            return
        self.trace.failure = failure or self.trace.failure
        if self.info is not None and not self._updated and self._updated_by_hand():
            self._record_update_by_hand(last=True)
        if self.info is not None and self._discarded and not self._updated:
            self._drop_step()
        unapplied = (self.info is not None and self.recorder is not None
                     and self.trace.failure is None and not self._updated
                     and bool(self._losses) and bool(self._optimizers))
        if unapplied:
            # the run ended after backward, before the update that would have applied it
            # (accumulated passes the loop never applied): kept as a step without an
            # update, with the gradients it left, whose runs may differ as any step's may
            assert self.info is not None and self.recorder is not None
            self._end_ops()
            self.recorder.record_param_grads(stats=self._watch(self.info.step) != WATCH_NONE)
        elif self.info is not None and self.recorder is not None and (
                (self.trace.failure is not None and not self._moved_on) or (
                    not self._updated and (self._optimizers or not self._losses))):
            # the step that failed (after its update too: what the loop does after it, a
            # w.step naming its losses, a scheduler's step, never ran; but not once the loop
            # has taken the next batch, or ended its pass: the failure is not the step's),
            # or that the process ended in before backward (a script that exits on a NaN
            # loss), is not kept half-recorded; nor calls in training mode that no backward
            # or update followed (nothing trained)
            if self._updated and self.trace.failure is not None:
                self.trace.probe[FAILED_AFTER_UPDATE] = self.info.step
            self.recorder.end_step()
            self.info = None
        self.end_step()
        self.save()

    def _first_pass_unfinished(self) -> bool:
        """Whether --max-epochs was given and the run, not stopped by a limit, ends within
        its first pass over the training loader: short of its length, or, a loader of no
        length (an endless sampler, as detectron2's), before the pass ran out (a sampler
        drawing with replacement makes a pass endless in effect)."""
        if (self.max_epochs is None or not self.stream.steps or self.epoch != 0 or self.stopped
                or self.trace.failure is not None or self.explicit_epoch is not None
                or self._train_pass is None):
            return False
        length = self._pass_lengths.get(self._train_loader)
        if length is None:
            return self._train_pass not in self._passes_ended
        return self._pass_batches.get(self._train_pass, 0) < length

    def save(self) -> None:
        if self.fault is not None:
            self.trace.probe[FAULT_FIRED] = self.fault_fired
            if not self.fault_fired and self.recorder is not None and self.recorder.ops_at_fault:
                self.trace.probe[OPS_AT_FAULT] = sorted(self.recorder.ops_at_fault)
            if not self.fault_fired and self.recorder is not None \
                    and self.recorder.fault_met_zeros:
                self.trace.probe[FAULT_MET_ZEROS] = True
        if self.recorder is not None and (scripted := self.recorder.scripted_modules()):
            self.trace.probe[SCRIPTED] = scripted
        if self.recorder is not None and len(models := self.recorder.model_names()) > 1:
            self.trace.probe[MODELS] = models
        if self.recorder is not None and (tied := self.recorder.tied_parameters()):
            self.trace.probe[TIED_PARAMETERS] = tied
        # (saved at each step too: said of the run as it stands, the steps of an inference
        # it turned out not to be forgotten; and of the end only, when no limit ended it)
        self.trace.probe.pop(EPOCHS_UNSEEN, None)
        if (self.max_epochs is not None and self.stream.steps and self._train_pass is None
                and self.explicit_epoch is None):
            self.trace.probe[EPOCHS_UNSEEN] = True
        if (workers := self._loader_workers.get(self._train_loader or -1)) is not None:
            self.trace.probe[TRAIN_LOADER_WORKERS] = workers
        self.trace.probe.pop(EPOCHS_SPANNED, None)
        passes = self._passes.get(self._train_loader or -1, 0)
        if (self.max_epochs is not None and passes > self.max_epochs and not self.stopped
                and self.explicit_epoch is None):
            self.trace.probe[EPOCHS_SPANNED] = passes
        self.trace.probe.pop(FIRST_PASS_UNFINISHED, None)
        if self._first_pass_unfinished():
            self.trace.probe[FIRST_PASS_UNFINISHED] = self._pass_lengths[self._train_loader]
        if self.rank is not None:
            _note_group(self.rank)
            self.rank.epochs = self._samplers.get(self._train_loader or -1, [])
            if self.recorder is not None:
                self.rank.sharded = sorted(
                    set(self.rank.sharded) | set(self.recorder.sharded_parameters()))
                self.rank.tensor_parallel |= self.recorder.tensor_parallel()
                self.rank.partial_grads = sorted(
                    set(self.rank.partial_grads) | set(self.recorder.partial_gradients()))
            self.rank.note_in(self.trace)
        self._write()

    def _write(self) -> None:
        """Flush the trace to its file (nothing before the first step: a process that never
        trained, such as a data-preparation script in the same command, leaves no trace)."""
        if not self._claimed or not self.stream.steps and not self.trace.failure:
            return
        self.stream.flush()


MAX_UNOWNED_LOSSES = 256  # scalar losses kept before the model is known


def _note_group(rank: RankWatch) -> None:
    """The backend and world size of the process group the rank joined, while it exists."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_available() and dist.is_initialized():
            rank.backend, rank.world_size = str(dist.get_backend()), dist.get_world_size()


# the packages of model builders that call what they build (outside any module call, so
# only as they build it): torchvision's SSDLite measures its backbone's output channels so
_BUILDING_PACKAGES = ("torchvision.models.",)


def _building_a_model() -> bool:
    """Whether a model is being built: a module's ``__init__`` is running, or a model
    builder of a library (:data:`_BUILDING_PACKAGES`). A model that calls its layers as it
    is built (Ultralytics' YOLO measures its strides and FLOPs so, in training mode;
    torchvision's SSDLite its backbone's output channels, in eval mode) makes no call of
    the loop, neither a step nor a batch. Asked of top-level calls only."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and issubclass(type(frame.f_locals.get("self")),
                                                             nn.Module):
            return True
        if str(frame.f_globals.get("__name__")).startswith(_BUILDING_PACKAGES):
            return True
        frame = frame.f_back
    return False


def _dry_run(module: nn.Module, args: tuple) -> bool:
    """Whether a call is a dry run, no step of the loop: its module's parameters or its
    inputs are on the meta device, where only shapes are worked out (a layer sized so,
    Keras's symbolic build of a model on torch), or it has lazy modules whose parameters
    the call makes (``nn.LazyLinear``, torchrl's MLP: PyTorch's docs ask for a dry run
    before the optimizer is built). Asked of top-level calls only."""
    params = list(module.parameters())
    return ((bool(params) and params[0].is_meta)
            or any(isinstance(p, UninitializedParameter) for p in params)
            or any(t.is_meta for _, t in iter_tensors(args)))


def _in_shared_memory(param: torch.Tensor) -> bool:
    """Whether a CPU parameter lives in shared memory (``share_memory()``), where another
    process may write it (``is_shared()`` is true of every CUDA tensor: only CPU ones are
    asked)."""
    if param.device.type != "cpu" or param.layout != torch.strided:
        return False
    return param.is_shared()


def _compiled(model: nn.Module) -> bool:
    """Whether compiled code may run in the step: `model` compiled (torch.compile(model),
    model.compile()), or any function compiled so far (a dispatch mode would make it run
    otherwise than in the runs it is compared with)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    return (getattr(model, "_compiled_call_impl", None) is not None
            or bool(dynamo.utils.counters["frames"]["total"]) or any(
                wrapper._orig_mod is model or wrapper is model
                for wrapper in live_objects(dynamo.eval_frame.OptimizedModule)))


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _data_only(value: Any, made: set[int]) -> Any:
    """`value` with each tensor whose storage the step's own calls made (`made`: data
    pointers) replaced by a marker: the step's work, compared where it is made."""
    if isinstance(value, torch.Tensor):
        return "made in this step" if any(
            s.data_ptr() in made for s in storages_of(value)) else value
    if isinstance(value, (list, tuple)):
        return [_data_only(v, made) for v in value]
    if isinstance(value, dict):
        return {k: _data_only(v, made) for k, v in value.items()}
    return value
