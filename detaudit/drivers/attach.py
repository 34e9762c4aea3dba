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
called on. An epoch is a new pass over the training DataLoader (the loader whose batches
precede the first step); evaluation passes are not steps. Every step is recorded at scan level (see
:mod:`detaudit.trace`): batch, RNGs, losses, gradients, parameters after the update. In an
inference script (no optimizer, the model first called in eval mode) a step is one call of
the model, its outputs recorded. The process an exec run records in is set up and ended by
:mod:`.attach_process`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch._C._autograd import _get_sequence_nr
from torch.nn.utils.parametrize import ParametrizationList

from ..config import (
    ATTACH_MODES,
    AUTO,
    CALLS_UNSEEN,
    ENDED,
    FAULT_FIRED,
    INFER,
    INFERRED,
    TRAIN,
    Fault,
)
from ..record.environment import capture_environment
from ..record.fingerprint import TensorPrint
from ..record.oprecorder import OpRecorder
from ..record.recorder import WATCH_MODULE, WATCH_NONE, Recorder, RecordKey, StepRecords
from ..record.structure import iter_tensors
from ..trace import (
    OPTIMIZER,
    OUTPUT,
    PROBE_CONFIG,
    STATE,
    StepInfo,
    Trace,
    TraceStream,
)
from .rankprobe import RankWatch, sampler_snapshot
from .runner import loss_copy, store_records


class Attachment:
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
    ) -> None:
        if mode not in ATTACH_MODES:
            raise ValueError(f"mode must be one of {', '.join(ATTACH_MODES)}, not {mode!r}")
        self.path = Path(path)
        self.trace = Trace(probe=probe, repeat=repeat, env={})  # what is not yet flushed
        self.trace.probe[ENDED] = False  # until the loop ends, fails or reaches its limit
        self.stream = TraceStream(self.trace, self.path)
        self.model = model
        self.optimizer = optimizer
        self.max_steps, self.max_epochs = max_steps, max_epochs
        self.on_limit = on_limit
        self.zoom, self.fault = zoom, fault
        # the step a fault is planted at, in whichever run: recorded at module level in all
        self.planted_step = fault.step if fault is not None else planted_step
        self.recorder: Recorder | None = None
        self._ops: OpRecorder | None = None  # the op-level mode of a zoomed or faulted step
        self.info: StepInfo | None = None  # the open step
        self.epoch = 0
        self.explicit_epoch: int | None = None
        self.index = 0  # step within its epoch
        self._updated = False  # the open step's optimizer has stepped
        self._updated_at = 0  # the autograd sequence number when it did
        # the storage of what the open step's top-level training calls returned: a later
        # call given it (a discriminator given the generator's fakes) is given the step's
        # work, not data
        self._step_outputs: list[Any] = []
        self._stepped: set[int] = set()  # the optimizers (ids) that updated in the open step
        self._optimizers: set[int] = set()  # every optimizer that has updated
        self._carried: StepRecords | None = None  # the open step's state, of another model
        self._grads_pending = False  # step(closure): gradients recorded after the update
        self._batches = 0  # top-level training calls in the open step
        self.batches_seen = 0  # in all steps
        self._fetched = 0  # training loader batches recorded in the open step
        self._waiting: list[tuple[int, Any]] = []  # (loader, batch) fetched before a step began
        self._iterators: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._losses = 0
        self._loss_values: dict[str, torch.Tensor] = {}  # read once the step is over
        # losses backward was called on before any model call was seen (the model runs
        # inside a compiled function): recorded once the update names the model
        self._unowned_losses: list[torch.Tensor] = []
        self._placed: set[int] = set()  # optimizers whose model was seen or searched for
        # the model's trainable parameters and their versions after the open step's last
        # backward, in a loop that may update by hand (see _updated_by_hand)
        self._by_hand: list[tuple[torch.Tensor, int]] = []
        self._optimizer_used = False  # an optimizer's step has begun (its closure may run)
        self._by_hand_possible: bool | None = None  # see _updates_by_hand
        self._grads_by_hand: list[tuple[RecordKey, TensorPrint]] = []  # see after_backward
        # the modules within models found that way: their calls with gradients on are the
        # training calls (in eval mode too; none are seen inside compiled code)
        self._found_modules: set[int] = set()
        # each updated parameter's version counter as its update left it: one changed in
        # place between steps (clipping, pruning, a manual edit) is recorded again
        self._versions: dict[int, tuple[torch.Tensor, int]] = {}
        self._depth = 0
        self._candidates: list[nn.Module] = []
        self._checked: set[int] = set()  # see _add_models_trained_apart
        self._adopted = False  # a model built anew took the model's place (see _adopt)
        self._others: list[tuple[str, nn.Module]] = []  # further models recorded, by name
        self._train_loader: int | None = None
        self._latest_loader: int | None = None  # the last to begin a pass
        self._yielded: int | None = None  # the last to yield a batch
        # loaders whose batches fed steps: a call without gradients after a batch of another
        # (an evaluation that forgot eval()) is no step (see _evaluating)
        self._step_loaders: set[int] = set()
        self._epoch_base = 0  # epochs before the training loader's first pass (see _epoch)
        self._passes: dict[int, int] = {}
        self.rank = rank
        self._samplers: dict[int, list[dict[str, Any]]] = {}  # loader -> its passes' orders
        self._handles: list[Any] = []
        self._patches: list[tuple[Any, str, Any]] = []
        self.stopped = False
        self.installed = False
        self.in_backward = False
        self._eager: Any = None  # torch.compile's stance while a step runs eagerly
        # whether a step is a call of the model (inference) rather than an optimizer step:
        # as `mode` says, or (auto) decided at the first top-level call of a module with
        # parameters (see _inference_at)
        self.inferring: bool | None = {TRAIN: False, INFER: True}.get(mode)
        self._auto = mode == AUTO
        self._given_model = model is not None
        self._out_of_graphs = False  # see keep_out_of_graphs

    # -- installing ----------------------------------------------------------------------
    def install(self) -> Attachment:
        """Hook torch: module calls, backward, optimizer steps, DataLoader passes."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        # Global module hooks find the top-level calls; the recorder may hook the model's
        # modules from inside one of them (a zoomed step), which the model's own hooks
        # could not do while they are being run.
        self._handles += [
            nn.modules.module.register_module_forward_pre_hook(self._global_pre),
            nn.modules.module.register_module_forward_hook(self._global_post, always_call=True),
        ]
        self._handles += [register_optimizer_step_pre_hook(self._before_update),
                          register_optimizer_step_post_hook(self._after_update)]
        self._patch(torch.Tensor, "backward", _wrap_backward(self))
        self._patch(torch.autograd, "backward", _wrap_autograd_backward(self))
        self._patch(torch.utils.data.DataLoader, "__iter__", _wrap_loader_iter(self))
        self._patch(_LoaderIterator, "__next__", _wrap_loader_next(self))
        self._patch(torch.amp.GradScaler, "update", _wrap_scaler_update(self))
        self._patch(nn.Module, "compile", _wrap_module_compile(self))
        self._patch(torch, "compile", _wrap_torch_compile(self))
        for module in self.model.modules() if self.model is not None else ():
            if getattr(module, "_compiled_call_impl", None) is not None:  # compiled before
                self.see_compiled_calls(module)
        # torch.compile(model) warns that global hooks fire for its wrapper too: the wrapper
        # is the top-level call, the module it wraps a call inside it
        warnings.filterwarnings("ignore", message=re.escape(
            "Using `torch.compile(module)` when there are global hooks"))
        if self.rank is not None:
            ddp = torch.nn.parallel.DistributedDataParallel
            self._patch(ddp, "__init__", _wrap_ddp_init(self.rank))
        self.installed = True
        return self

    def uninstall(self) -> None:
        """Remove every hook and patch (what was recorded stays in the trace)."""
        self._end_ops()
        self._run_eagerly(False)
        if self.recorder is not None:
            self.recorder.__exit__(None, None, None)  # its module hooks, if a step had any
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches = []
        self.installed = self._out_of_graphs = False

    def see_compiled_calls(self, module: nn.Module) -> None:
        """`module.compile()` compiles its whole call, global hooks included: its calls are
        seen from outside the compiled code instead."""
        compiled = module._compiled_call_impl

        def call(*args: Any, **kwargs: Any) -> Any:
            self._global_pre(module, args)
            try:
                output = compiled(*args, **kwargs)
            except BaseException:
                self._global_post(module, args, None)
                raise
            replaced = self._global_post(module, args, output)
            return output if replaced is None else replaced

        self._patch(module, "_compiled_call_impl", call)

    def keep_out_of_graphs(self) -> None:
        """Something is compiled: the backward entry points are kept out of its graphs
        (a compiled function that calls backward runs them eagerly, as torch would without
        detaudit, rather than tracing detaudit's recording into the graph)."""
        if self._out_of_graphs:
            return
        self._out_of_graphs = True
        from torch._dynamo import disable

        self._patch(torch.Tensor, "backward", disable(torch.Tensor.backward))
        self._patch(torch.autograd, "backward", disable(torch.autograd.backward))

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    # -- what the hooks see ----------------------------------------------------------------
    def _global_pre(self, module: nn.Module, args: tuple) -> None:
        if _transformed() or isinstance(module, ParametrizationList):
            # not a top-level call of the loop (see _transformed), nor the computing of a
            # parametrized weight (each read of it calls its parametrizations)
            return
        if self._depth == 0:
            hooks_before = set(module._forward_pre_hooks)
            self._top_level_call(module, args)
            if self.recorder is not None:
                self.recorder.join_call(module, args, hooks_before)
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
        found = id(module) in self._found_modules and torch.is_grad_enabled()
        if (module.training or found) and not self._evaluating():
            if module not in self._candidates and any(True for _ in module.parameters()):
                self._candidates.append(module)
                if self._replaces_model(module):
                    self._adopt(module)
            # A step begins at the model's call, or at the first call after an update
            # of another model an optimizer trains (a GAN's generator called before its
            # discriminator): that call's work belongs to the step it starts.
            if module is self._current_model() or found or (
                    self._updated and any(module is m for _, m in self._others)):
                self._on_batch(module, args, {})
        elif self._last_step_updated() and module is self._current_model():
            self.end_step()  # evaluation after the last step's update: the run is over
            self.stop()

    def _global_post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if _transformed():
            return
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
                s for s in (t.untyped_storage() for _, t in iter_tensors(output)) if s.data_ptr())

    def _replaces_model(self, module: nn.Module) -> bool:
        """Whether `module`, called in training for the first time, takes the model's place:
        built anew like it (its class, its parameters' names and shapes) once no optimizer
        holds the model's parameters any more (a loop that resumes from a checkpoint in the
        same process; two such models trained side by side each keep their optimizer)."""
        model = self.model
        if model is None or self.optimizer is not None or type(module) is not type(model):
            return False
        def shapes(m: nn.Module) -> list[tuple[str, torch.Size]]:
            return [(name, p.shape) for name, p in m.named_parameters()]
        if shapes(module) != shapes(model):
            return False
        mine = {id(p) for p in model.parameters()}
        return not any(any(id(p) in mine for p in _parameters(o))
                       for o in _live(torch.optim.Optimizer))

    def _adopt(self, module: nn.Module) -> None:
        """`module` is the model from now on, recorded under the same names; the open step
        is over, and the next records the new model's parameters as it begins."""
        if self.info is not None:
            self.end_step()
        if self.recorder is not None:
            self.recorder.__exit__(None, None, None)
            self.recorder = None
        self.model = module
        self._versions = {}
        self._adopted = True

    def _inference_at(self, module: nn.Module) -> bool:
        """Whether the loop infers: decided (in auto mode) at the first top-level call of a
        module with parameters. It infers if that call is in eval mode or without gradients
        and no optimizer exists; the model is then that module."""
        if self.inferring is None and any(True for _ in module.parameters()):
            self.inferring = (not module.training or not torch.is_grad_enabled()) and (
                self.optimizer is None and not any(True for _ in _live(torch.optim.Optimizer)))
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
        if self.optimizer is None and not self._given_model:
            self.model = None
        self._others, self._candidates, self._checked = [], [], set()
        self._train_loader, self.epoch, self.index, self._epoch_base = None, 0, 0, 0
        self._updated, self._batches, self._losses = False, 0, 0
        self._loss_values, self._step_outputs = {}, []
        self.stream.restart()

    def _inferred_name(self, module: nn.Module) -> str | None:
        """In inference, each top-level call of a module with parameters is a step: of the
        model (named "") or of another model (an ensemble's), recorded too under its class's
        name; None for a module without parameters (a post-processing step)."""
        if module is self.model:
            return ""
        if self.model is None and any(True for _ in module.parameters()):
            self.model = module
            return ""
        name = next((n for n, m in self._others if m is module), None)
        if name is None and any(True for _ in module.parameters()):
            name = _unique(type(module).__name__, {n for n, _ in self._others})
            self._others.append((name, module))
            if self.recorder is not None:
                self.recorder.add_model(name, module)
        return name

    def _on_batch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A top-level training call: a new step begins if the last one has updated."""
        if self.info is not None and not self._updated and self._updated_by_hand():
            self._record_update_by_hand()
        if self._updated:
            self.end_step()
            if self.stopped:
                return
        if self.info is None and not self._begin_step(module):
            return
        assert self.recorder is not None
        batch = {"args": list(args), "kwargs": kwargs} if kwargs else list(args)
        if self._step_outputs:
            batch = _data_only(batch, {s.data_ptr() for s in self._step_outputs})
        if self._batches == 0:
            self.recorder.record_state(batch)
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
        if self.info is None and self._current_model() is None and not self._candidates:
            # kept until an update names the model: scalars only, and a bounded number (a
            # script with no optimizer calls backward for other ends)
            if tensor.numel() == 1 and len(self._unowned_losses) < MAX_UNOWNED_LOSSES:
                self._unowned_losses.append(tensor.detach())
            return
        if self.info is None and not self._begin_step(self._current_model()):
            return
        self._record_loss(tensor)

    def _record_loss(self, tensor: torch.Tensor) -> None:
        """Record one loss backward is called on (in the open step)."""
        assert self.recorder is not None and self.info is not None
        name = "loss" if self._losses == 0 else f"loss.{self._losses}"
        self._losses += 1
        self.recorder.record(OUTPUT, "", 0, name, tensor.detach())
        if tensor.numel() == 1:
            self._loss_values[name] = loss_copy(tensor)
        if self._watch(self.info.step) != WATCH_NONE:
            self.recorder.before_backward(tensor)  # module-level backward records, faults

    def name_losses(self, losses: dict[str, torch.Tensor]) -> None:
        """The user named the loss terms of the open step (``watch``'s ``w.step(losses)``)."""
        if self.info is None or self.recorder is None:
            return
        for name, value in losses.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                self.recorder.record(OUTPUT, "", 0, f"loss.{name}", value.detach())
                self._loss_values[name] = loss_copy(value)

    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_used = True  # (any optimizer: the loop does not update by hand)
        if self._auto and self.inferring:
            self._trains_after_all()
        if self.stopped or self.inferring or (
                self.optimizer is not None and optimizer is not self.optimizer):
            return
        self._choose_model(optimizer)
        if self._updated and id(optimizer) in self._stepped:
            self.end_step()  # it updates again: the step before it is over
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: self
        if callable(closure):
            # step(closure): the closure computes the gradients inside step; its forward
            # begins the step if no model was called yet (Lightning's first step)
            self._grads_pending = True
            self._unowned_losses = []  # the closure's losses are recorded as it runs
            if self.info is None:
                self._begin_step(self._current_model())
            return
        if id(optimizer) not in self._placed:  # (a closure's forward is yet to be seen)
            if not self._owned(optimizer) and len(self._placed) < MAX_MODEL_SEARCHES:
                self._find_model(optimizer)
                self._choose_model(optimizer)
            self._placed.add(id(optimizer))
        unowned, self._unowned_losses = self._unowned_losses, []  # (this step's, if any)
        if self.info is None and not self._begin_step(self._current_model()):
            return
        assert self.recorder is not None
        for loss in unowned:
            self._record_loss(loss)
        params = _parameters(optimizer)
        self._add_owners(params)
        self._end_ops()  # the update is not the model's ops
        self.recorder.record_param_grads(stats=self._watch(self.info.step) != WATCH_NONE,
                                         of=params)

    def _after_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.stopped or self.inferring or self.info is None or self.recorder is None or (
                self.optimizer is not None and optimizer is not self.optimizer):
            return
        params = _parameters(optimizer)
        if self._grads_pending:  # the gradients the closure made, as the update used them
            self._grads_pending = False
            self._choose_model(optimizer)  # the closure's forward named the candidates
            self._add_owners(params)
            self._end_ops()
            self.recorder.record_param_grads(stats=self._watch(self.info.step) != WATCH_NONE,
                                             of=params)
        self.recorder.record_parameters(OPTIMIZER, of=params)
        self._versions.update({id(p): (p, p._version) for p in params if not p.is_inference()})
        self.info.optimizer_stepped = True
        self.info.lr += [_finite(group.get("lr")) for group in optimizer.param_groups]
        self._stepped.add(id(optimizer))
        self._optimizers.add(id(optimizer))
        # complete once every optimizer seen so far has updated; the first step never is
        # (its optimizers are not known until it ends): the limit then stops the next one
        self._step_done(complete=self.info.step > 0 and self._optimizers <= self._stepped)

    def on_scaler_update(self, scaler: Any) -> None:
        """A GradScaler updated its scale: recorded; when it skipped the optimizer step
        (inf or NaN gradients), the step ends here, without an update. Before the model is
        known (no call of it seen), a skipped step is not recorded: its losses are dropped."""
        self._unowned_losses = []
        if self.stopped or self.info is None or self.recorder is None:
            return
        scale = float(scaler.get_scale())
        self.info.scale = _finite(scale)
        self.recorder.record(OPTIMIZER, "", 0, "scale", torch.tensor(scale, dtype=torch.float64))
        if not self._updated and self._losses:
            self._step_done(complete=True)

    def _updated_by_hand(self) -> bool:
        """Whether a loop that has no optimizer changed the model's parameters in place
        since the open step's last backward (`p -= lr * p.grad` under no_grad): an update
        it makes itself, which ends the step like an optimizer's."""
        return bool(self._by_hand and not self._optimizer_used and any(
            p._version != version for p, version in self._by_hand))

    def _updates_by_hand(self) -> bool:
        """Whether the loop may update the model by hand: no optimizer was given, none has
        stepped, and none holds the model's parameters (looked for once, at the first
        backward: SAM's perturbation or an optimizer stepped later is no update by hand)."""
        if self._by_hand_possible is None:
            model = self._current_model()
            if self.optimizer is not None or model is None:
                self._by_hand_possible = False
            else:
                mine = {id(p) for p in model.parameters()}
                self._by_hand_possible = not any(any(id(p) in mine for p in _parameters(o))
                                                 for o in _live(torch.optim.Optimizer))
        return self._by_hand_possible and not self._optimizer_used

    def _record_update_by_hand(self, last: bool = False) -> None:
        """The parameters the loop's own update left, as an optimizer's are recorded; the
        step is done (`last`: the run's last, ending now)."""
        assert self.info is not None and self.recorder is not None
        self.recorder.add_records(self._grads_by_hand)
        self.recorder.record_parameters(OPTIMIZER)
        self.info.optimizer_stepped = True
        if last:
            self._updated = True
        else:  # found inside the next call: its hooks were set after the backward
            self._step_done(complete=self.info.step > 0, between_calls=False)

    def after_backward(self) -> None:
        """A backward is over, outside any module call. In a loop that may update by hand
        (an update found only at the next call, inside it), the parameters' versions are
        taken, and the module hooks are set now for the next step, as an optimizer's update
        would set them."""
        if self.info is None or self.recorder is None or self.stopped or (
                not self._updates_by_hand()):
            return
        model = self._current_model()
        assert model is not None
        # what the parameters are now: a change from here on is the loop's update
        self._by_hand = [(p, p._version) for p in model.parameters()
                         if p.requires_grad and not p.is_inference()]
        # the gradients as this backward left them: the update's, if it comes next (a loop's
        # own update or zero_grad would change them before it is seen)
        self._grads_by_hand = self.recorder.print_param_grads(
            stats=self._watch(self.info.step) != WATCH_NONE)
        now, after = self._watch(self.info.step), self._watch(self.info.step + 1)
        if after != WATCH_NONE or now == WATCH_NONE:  # (a watched step keeps its own)
            self.recorder.hook_for(after)
            self._run_eagerly(after != WATCH_NONE)

    def _last_step_updated(self) -> bool:
        """The step at the step limit is open and has updated: by every optimizer that
        updates, or at step 0, where how many do is not known yet (a second optimizer
        updating after an evaluation call in that step would not be recorded)."""
        return (self._updated and self.info is not None and self.max_steps is not None
                and self.info.step + 1 >= self.max_steps
                and (self.info.step == 0 or self._optimizers <= self._stepped))

    def _step_done(self, complete: bool, between_calls: bool = True) -> None:
        """The open step has updated (or its update was skipped): the next training call
        begins a new one, and so does a second update by an optimizer that already updated
        (the updates of several optimizers between two forwards are one step); the module
        hooks are set for the next step now, `between_calls` (inside a call they cannot be:
        see after_backward). At the step limit the run ends here when the step is
        `complete`, else when the next step would begin."""
        assert self.info is not None and self.recorder is not None
        self._add_models_trained_apart()
        if between_calls:
            self.recorder.hook_for(self._watch(self.info.step + 1))
            # eager from here when the next step is watched: a compiled function that calls
            # the model begins before any hook of the step could set it
            self._run_eagerly(self._watch(self.info.step + 1) != WATCH_NONE)
        self._updated = True
        self._updated_at = _get_sequence_nr()  # autograd nodes made later: the next step's
        if complete and self.max_steps is not None and self.info.step + 1 >= self.max_steps:
            self.end_step()
            self.stop()

    def on_loader_pass(self, loader: Any) -> None:
        """A DataLoader starts a pass over its data."""
        key = id(loader)
        self._passes[key] = self._passes.get(key, 0) + 1
        self._latest_loader = key
        if self.rank is not None:
            self._samplers.setdefault(key, []).append(
                {"epoch": self._passes[key] - 1, "sampler": sampler_snapshot(loader)})
        if (key == self._train_loader and self.max_epochs is not None and not self.stopped
                and self._epoch_base + self._passes[key] > self.max_epochs):
            self.end_step()
            self.stop()

    def on_loader_batch(self, iterator: Any, batch: Any) -> None:
        """A DataLoader iterator yielded `batch`. The training loader's batches are step
        state beside what the model is called with: labels that a loss takes outside the
        model are in them. One fetched before its step begins waits for it (the last few)."""
        loader = self._iterators.get(iterator)
        if loader is None:
            return
        self._yielded = loader
        if self.info is not None and not self._updated:
            self._step_loaders.add(loader)
        if self.stopped:
            return
        if self.info is None or self._updated:  # (which loader is the step's: see _epoch)
            self._waiting = [*self._waiting[1 - _WAITING:], (loader, batch)]
        elif loader == (self._train_loader or self._latest_loader):
            self._record_loader_batch(batch)

    def _record_loader_batch(self, batch: Any) -> None:
        assert self.recorder is not None
        self.recorder.record(STATE, "", self._fetched, "batch.loader", batch, algorithm="xxh3")
        self._fetched += 1

    def set_epoch(self, epoch: int) -> None:
        """The user said which epoch the next steps belong to (``w.epoch(i)``)."""
        self.explicit_epoch = epoch

    # -- steps -----------------------------------------------------------------------------
    def _current_model(self) -> nn.Module | None:
        if self.model is not None:  # (a compiled model's wrapper has no truth value)
            return self.model
        return self._candidates[0] if self._candidates else None

    def _choose_model(self, optimizer: torch.optim.Optimizer) -> None:
        """At the first optimizer step, the model is the candidate that owns its parameters;
        the global hooks give way to one hook on it."""
        if self.model is not None:
            return
        updated = {id(p) for p in _parameters(optimizer)}
        owned = [(sum(id(p) in updated for p in m.parameters()), m) for m in self._candidates]
        if not any(n for n, _ in owned):
            return
        # the one that owns the most of them (not a part of the model called on its own
        # first, a sanity check of the backbone), the first called of those
        most = max(n for n, _ in owned)
        self.model = next(m for n, m in owned if n == most)
        if self.recorder is not None and self.recorder.model is not self.model:
            # the step began at another module's call (a frozen teacher, a GAN's generator):
            # its batch and RNG states are the step's; the model's parameters as they were
            # before the first step are recorded now, before its first update
            so_far = self.recorder.end_step() if self.info is not None else None
            self.recorder.__exit__(None, None, None)
            self.recorder = self._new_recorder(self.model)
            self.recorder.begin_step(self.stream.steps, self._watch(self.stream.steps))
            if so_far is not None:
                self._carried = _step_state(so_far)
                if self.stream.steps == 0:
                    self.recorder.record_parameters(STATE)

    def _find_model(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer updates before any training-mode call of a module was seen: the
        model runs inside a compiled function, where module hooks do not run, or trains in
        eval mode. The model is the module that owns the most of the optimizer's
        parameters, found among every live module; its calls with gradients on are the
        step's from then on (those a compiled function makes are seen at a zoomed step,
        which runs eagerly)."""
        updated = {id(p) for p in _parameters(optimizer)}
        owners = [(sum(id(p) in updated for p in m.parameters()), m) for m in _live(nn.Module)]
        owners = [(n, m) for n, m in owners if n]
        if not owners:
            return
        most = max(n for n, _ in owners)
        # the innermost of the modules that own that many: the model, not a container or a
        # wrapper of it (torch.compile's, a ModuleDict of models), so that names are its own
        owning = {id(m) for n, m in owners if n == most}
        model = next(m for n, m in owners if n == most and not any(
            id(c) in owning for c in list(m.modules())[1:]))
        self._candidates.append(model)
        # its calls, and those of wrappers that hold it (DDP), are the step's
        self._found_modules |= {id(m) for m in model.modules()} | owning
        self.trace.probe[CALLS_UNSEEN] = True

    def _owned(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a module seen in a training call owns some of the optimizer's parameters."""
        updated = {id(p) for p in _parameters(optimizer)}
        return any(id(p) in updated for m in self._candidates for p in m.parameters())

    def _add_owners(self, updated_params: list[torch.Tensor]) -> None:
        """Other top-level models whose parameters an optimizer updates (a head called apart
        from its backbone, a GAN's generator) are recorded too, named by their class, their
        parameters as they are before this first update kept as well."""
        if self.recorder is None or self.info is None:
            return
        updated = {id(p) for p in updated_params} - self.recorder.parameter_ids()
        for module in self._candidates:
            params = list(module.parameters())
            if not updated or not any(id(p) in updated for p in params):
                continue
            name = _unique(type(module).__name__, {n for n, _ in self._others})
            self._others.append((name, module))
            self.recorder.add_model(name, module)
            self.recorder.record_parameters(STATE, of=params)
            updated -= {id(p) for p in params}

    def _add_models_trained_apart(self) -> None:
        """Models called in training whose parameters an optimizer holds that has not
        updated yet (a GAN's generator, trained after the discriminator's first update) are
        recorded from now on: the step of their first update begins at their call and is
        recorded like any other (a fault planted there fires). Each is looked for once."""
        new = [m for m in self._candidates if id(m) not in self._checked
               and m is not self.model and not any(m is o for _, o in self._others)]
        if not new or self.optimizer is not None:
            return
        self._checked |= {id(m) for m in new}
        held = {id(p) for o in _live(torch.optim.Optimizer) for p in _parameters(o)}
        self._add_owners([p for m in new for p in m.parameters() if id(p) in held])

    def _begin_step(self, model: nn.Module | None) -> bool:
        if model is None:
            return False
        if self.max_steps is not None and self.stream.steps >= self.max_steps:
            self.stop()  # the last step was not complete when it updated
            return False
        if self.recorder is None:
            self.recorder = self._new_recorder(model)
            self.trace.env = capture_environment(_device_of(model))
        epoch = self._epoch()
        if self._yielded is not None:
            self._step_loaders.add(self._yielded)
        if self.max_epochs is not None and epoch >= self.max_epochs:
            self.stop()  # (a loader built anew for the epoch: no pass of the old one began)
            return False
        if epoch != self.epoch:
            self.epoch, self.index = epoch, 0
        step = self.stream.steps
        self.info = StepInfo(step=step, epoch=self.epoch, index=self.index)
        watch = self._watch(step)
        # inside the model's call: hooks may be added (its own run from the next call on)
        # but never removed here (see Recorder.hook_for); they go after the update
        self.recorder.begin_step(step, watch, rehook=False)
        if watch != WATCH_NONE:
            self.recorder.hook_for(watch)
            self._run_eagerly(True)
        if step == self.zoom or (self.fault is not None and self.fault.op
                                 and self.fault.step == step):
            self._ops = OpRecorder(self.recorder, step, record=step == self.zoom,
                                   fault=self.fault)
            self._ops.__enter__()
        waiting, self._waiting = self._waiting, []
        for loader, batch in waiting:
            if loader == self._train_loader:
                self._record_loader_batch(batch)
        if step == 0 or self._adopted:
            self.recorder.record_parameters(STATE)
            self._adopted = False
        else:
            self._record_changed_parameters()
        self._by_hand = []  # (taken after the step's backward)
        self._grads_by_hand = []
        return True

    def _epoch(self) -> int:
        """The epoch of the step about to begin: the passes of the training loader (the
        last to begin a pass before the first step), or as the user said (``w.epoch``). A
        step fed by another loader, once the training loader's pass is over, means the loop
        trains on a loader built anew for the epoch: its passes count on from there."""
        if self._train_loader is None:
            self._train_loader = self._latest_loader
        elif self._yielded not in (None, self._train_loader) and (
                self._train_loader not in self._iterators.values()):
            self._epoch_base = self.epoch + 2 - self._passes.get(self._yielded, 1)
            self._train_loader = self._yielded
        if self.explicit_epoch is not None:
            return self.explicit_epoch
        if self._train_loader is None:
            return 0
        return self._epoch_base + self._passes.get(self._train_loader, 1) - 1

    def _evaluating(self) -> bool:
        """A call in training mode without gradients right after a batch of a loader that
        never fed a step (a validation loader): an evaluation that forgot ``eval()``, which
        begins no step (a pseudo-labelling call on the step's own batch still does)."""
        return (not torch.is_grad_enabled() and self._yielded is not None
                and self._yielded not in self._step_loaders and bool(self._step_loaders))

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
        for name, other in self._others:
            recorder.add_model(name, other)
        return recorder

    def _watch(self, step: int) -> str:
        """Every module call at the zoomed step and at the step a fault is planted at (in
        every run, so that the planted change is compared where it is planted even when
        rounding absorbs it further on); step state only elsewhere."""
        return WATCH_MODULE if step in (self.zoom, self.planted_step) else WATCH_NONE

    def _end_ops(self) -> None:
        if self._ops is not None:
            ops, self._ops = self._ops, None
            ops.__exit__(None, None, None)

    @property
    def fault_fired(self) -> bool:
        return self.recorder is not None and self.recorder.fault_fired

    @property
    def given_optimizer_idle(self) -> bool:
        """The optimizer given never updated while another one did (the loop steps an
        optimizer made anew, not the one given)."""
        return (self.optimizer is not None and self._optimizer_used
                and id(self.optimizer) not in self._optimizers)

    def awaits_update(self) -> bool:
        """The open step has run backward and its update is still to come: an optimizer
        was given or has updated, or one holds the model's parameters (a loop that names
        its losses before ``opt.step()``)."""
        return (self.info is not None and self._losses > 0 and not self._updated
                and (self.optimizer is not None or bool(self._optimizers)
                     or self._by_hand_possible is False))

    def end_step(self) -> None:
        """Close the open step and keep its records."""
        if self.info is None or self.recorder is None:
            return
        self._end_ops()
        if self._carried is not None:
            store_records(self.trace, self.info.step, self._carried)
            self._carried = None
        store_records(self.trace, self.info.step, self.recorder.end_step())
        self.info.keep_losses(self._loss_values)
        self._loss_values = {}
        self.trace.steps.append(self.info)
        self.info, self._updated, self._batches, self._losses = None, False, 0, 0
        self._step_outputs = []
        self._fetched = 0
        self._stepped = set()
        self.index += 1
        if self.stream.due():
            self.save()

    def stop(self) -> None:
        """The step or epoch limit is reached: save, stop recording, end the loop."""
        self.stopped = True
        self.trace.probe[ENDED] = True
        self.save()
        if self.on_limit is not None:
            self.on_limit()

    def finish(self, failure: str | None = None) -> None:
        """The loop is over (or failed): close the open step, save the trace."""
        self.trace.probe[ENDED] = True
        if self.stopped:
            self.save()
            return
        self.trace.failure = failure or self.trace.failure
        if self.info is not None and not self._updated and self._updated_by_hand():
            self._record_update_by_hand(last=True)
        if (self.trace.failure or self._optimizers or not self._losses) and (
                self.info is not None and self.recorder is not None and not self._updated):
            # the step that failed, or that the process ended in before its update (a script
            # that exits on a NaN loss before backward), is not kept half-recorded; nor calls
            # in training mode that no backward or update followed (nothing trained)
            self.recorder.end_step()
            self.info = None
        self.end_step()
        self.save()

    def save(self) -> None:
        if self.fault is not None:
            self.trace.probe[FAULT_FIRED] = self.fault_fired
        if self.rank is not None:
            _note_group(self.rank)
            self.rank.epochs = self._samplers.get(self._train_loader or -1, [])
            self.rank.note_in(self.trace)
        self._write()

    def _write(self) -> None:
        """Flush the trace to its file (nothing before the first step: a process that never
        trained, such as a data-preparation script in the same command, leaves no trace)."""
        if not self.stream.steps and not self.trace.failure:
            return
        self.stream.flush()


MAX_UNOWNED_LOSSES = 256  # scalar losses kept before the model is known
# optimizers whose model is looked for among every live object: a loop that makes an
# optimizer per batch over tensors no module owns (an adversarial perturbation) stops there
MAX_MODEL_SEARCHES = 8


def _note_group(rank: RankWatch) -> None:
    """The backend and world size of the process group the rank joined, while it exists."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_available() and dist.is_initialized():
            rank.backend, rank.world_size = str(dist.get_backend()), dist.get_world_size()


def _step_state(records: StepRecords) -> StepRecords:
    """The batch and RNG state records among a step's records."""
    kept = [(k, p) for k, p in zip(records.keys, records.prints)
            if k[0] == STATE and k[3].startswith(("batch", "rng."))]
    return StepRecords([k for k, _ in kept], [p for _, p in kept], [])


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _live(kind: type) -> list[Any]:
    """Every live object of `kind` the garbage collector tracks (one pass over them all)."""
    import gc

    # (issubclass of the type: isinstance fails on a dead weak proxy)
    return [o for o in gc.get_objects() if issubclass(type(o), kind)]


def _unique(name: str, taken: set[str]) -> str:
    """`name`, or `name2`, `name3`, ... if taken."""
    k = 1
    while (candidate := name if k == 1 else f"{name}{k}") in taken:
        k += 1
    return candidate


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _wrap_backward(attachment: Attachment) -> Callable[..., Any]:
    original = torch.Tensor.backward

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # inside a backward, not the step's loss; or traced (torch.compile keeps it out of
        # its graphs once anything is compiled: see Attachment.keep_out_of_graphs)
        if attachment.in_backward or _transformed():
            return original(self, *args, **kwargs)
        attachment.on_backward(self)
        attachment.in_backward = True  # Tensor.backward calls torch.autograd.backward
        try:
            result = original(self, *args, **kwargs)
        finally:
            attachment.in_backward = False
        attachment.after_backward()
        return result

    return backward


def _wrap_autograd_backward(attachment: Attachment) -> Callable[..., Any]:
    original = torch.autograd.backward

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        # inside a backward (Tensor.backward, checkpointing), or traced (see above)
        if attachment.in_backward or _transformed():
            return original(tensors, *args, **kwargs)
        for tensor in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            attachment.on_backward(tensor)
        attachment.in_backward = True
        try:
            result = original(tensors, *args, **kwargs)
        finally:
            attachment.in_backward = False
        attachment.after_backward()
        return result

    return backward


def _wrap_loader_iter(attachment: Attachment) -> Callable[..., Any]:
    original = torch.utils.data.DataLoader.__iter__

    def __iter__(self: Any) -> Any:
        attachment.on_loader_pass(self)
        iterator = original(self)
        with contextlib.suppress(TypeError):  # an iterator that takes no weak reference
            attachment._iterators[iterator] = id(self)
        return iterator

    return __iter__


def _wrap_loader_next(attachment: Attachment) -> Callable[..., Any]:
    original = _LoaderIterator.__next__

    def __next__(self: Any) -> Any:
        try:
            batch = original(self)
        except StopIteration:
            attachment._iterators.pop(self, None)  # its pass is over
            raise
        attachment.on_loader_batch(self, batch)
        return batch

    return __next__


_compiling = torch.compiler.is_compiling
_functorch_level = getattr(torch._C._functorch, "maybe_current_level", lambda: None)


def _transformed() -> bool:
    """Whether code runs inside a graph torch.compile traces, or inside a torch.func
    transform (grad, vmap: its tensors are wrappers without storage): a module called there
    is a step of a function, not a training call of the loop."""
    return _compiling() or _functorch_level() is not None


_LoaderIterator = torch.utils.data.dataloader._BaseDataLoaderIter
_WAITING = 4  # training loader batches kept for a step not begun yet (a prefetching loop's)


def _wrap_ddp_init(rank: RankWatch) -> Callable[..., Any]:
    """DDP's constructor broadcasts rank 0's parameters: note this rank's as built first."""
    original = torch.nn.parallel.DistributedDataParallel.__init__

    def __init__(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if rank.init is None and isinstance(module, nn.Module):
            rank.record_init(module)
        original(self, module, *args, **kwargs)

    return __init__


def _wrap_torch_compile(attachment: Attachment) -> Callable[..., Any]:
    original = torch.compile

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        attachment.keep_out_of_graphs()
        return original(*args, **kwargs)

    return compile


def _wrap_module_compile(attachment: Attachment) -> Callable[..., Any]:
    original = nn.Module.compile

    def compile(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        attachment.see_compiled_calls(self)

    return compile


def _wrap_scaler_update(attachment: Attachment) -> Callable[..., Any]:
    original = torch.amp.GradScaler.update

    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        attachment.on_scaler_update(self)
        return result

    return update


def _data_only(value: Any, made: set[int]) -> Any:
    """`value` with each tensor whose storage the step's own calls made (`made`: data
    pointers) replaced by a marker: the step's work, compared where it is made."""
    if isinstance(value, torch.Tensor):
        return "made in this step" if value.untyped_storage().data_ptr() in made else value
    if isinstance(value, (list, tuple)):
        return [_data_only(v, made) for v in value]
    if isinstance(value, dict):
        return {k: _data_only(v, made) for k, v in value.items()}
    return value
