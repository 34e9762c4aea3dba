"""Where a step of an attached loop ends: its update (see :mod:`.attach`).

A step is one optimizer step, and the updates of several optimizers between two forwards
are one. The optimizer step hooks see the gradients as the optimizer gets them (after
unscaling and clipping) and the parameters after the update; the first update also names
the model (the candidate that owns the optimizer's parameters, see :mod:`.attach_models`)
and the other models an optimizer trains. A GradScaler that skips the update (inf or NaN
gradients) ends the step without one, and a loop with no optimizer that changes the
parameters itself (``p -= lr * p.grad``) ends it with its own. Once a step is done, the
module hooks are set for the next one and the step limit is checked.

:class:`Updates` is a part of :class:`.attach.Attachment` (a mixin): it works on the
attachment's state (its recorder, its open step) as the rest of the class does.
"""

from __future__ import annotations

import math
import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr

from ..config import CALLS_UNSEEN, DROPPED_STEPS
from ..record.environment import capture_environment
from ..record.recorder import WATCH_MODULE, WATCH_NONE, StepRecords, printed_now
from ..trace import OPTIMIZER, OUTPUT, STATE
from .attach_models import MAX_MODEL_SEARCHES, held_by_an_optimizer, parameters_of

# the code of every optimizer's step as torch runs it, with the step hooks around it
_STEP_WITH_HOOKS = torch.optim.Optimizer.profile_hook_step(lambda *args: None).__code__


def _inside_another_step(optimizer: torch.optim.Optimizer, frame: FrameType | None) -> bool:
    """Whether `optimizer` steps inside another optimizer's step: it is the inner optimizer
    of a wrapper (ZeroRedundancyOptimizer, Lookahead, accelerate's AcceleratedOptimizer),
    whose own hooks see the update as the loop does. (ZeRO's inner optimizer updates this
    rank's partition alone, before the wrapper broadcasts the others.)"""
    while frame is not None:
        if frame.f_code is _STEP_WITH_HOOKS and frame.f_locals.get("self") is not optimizer:
            return True
        frame = frame.f_back
    return False


def _initialising_state(frame: FrameType | None) -> bool:
    """Whether the update runs inside torch.distributed's code that makes an optimizer's
    state by a step on zero gradients (at lr 0) before a checkpoint is loaded into it
    (DCP's get_state_dict and set_state_dict, NamedOptimizer.init_state): no training step."""
    while frame is not None:
        if (frame.f_code.co_name in ("_init_optim_state", "init_state")
                and str(frame.f_globals.get("__name__")).startswith("torch.distributed.")):
            return True
        frame = frame.f_back
    return False


def _prints_of(params: list[torch.Tensor]) -> list[str]:
    return [print_.fp for _, print_ in printed_now(params, stats=False)]


class Updates:
    """The optimizer step hooks, a GradScaler's skipped update and a loop's update by hand,
    and the models an update names: mixed into :class:`.attach.Attachment`."""

    # -- the optimizer and the scaler ------------------------------------------------------
    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is not self.optimizer and _inside_another_step(optimizer, sys._getframe(1)):
            return  # (the optimizer given is the one recorded, wrapped or not)
        if _initialising_state(sys._getframe(1)):
            return
        self._optimizer_used = True  # (any optimizer: the loop does not update by hand)
        self._discarded = False  # (the gradients were not thrown away after all)
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
            self._closure_step = (optimizer, 0)
            self._unowned_losses = []  # the closure's losses are recorded as it runs
            if self.info is None:
                self._begin_step(self.models.current())
            return
        placed = self.models.placed
        if id(optimizer) not in placed:  # (a closure's forward is yet to be seen)
            if not self.models.owned(optimizer) and len(placed) < MAX_MODEL_SEARCHES:
                if self.models.find(optimizer):
                    self.trace.probe[CALLS_UNSEEN] = True
                self._choose_model(optimizer)
            placed.add(id(optimizer))
        unowned, self._unowned_losses = self._unowned_losses, []  # (this step's, if any)
        if self.info is None and not self._begin_step(self.models.current()):
            return
        assert self.recorder is not None
        for loss in unowned:
            self._record_loss(loss)
        params = parameters_of(optimizer)
        self._add_owners(params)
        self._end_ops()  # the update is not the model's ops
        self.recorder.record_param_grads(stats=self._watch(self.info.step) != WATCH_NONE,
                                         of=params)

    def _after_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is not self.optimizer and _inside_another_step(optimizer, sys._getframe(1)):
            return  # (the optimizer given is the one recorded, wrapped or not)
        if _initialising_state(sys._getframe(1)):
            return
        if self.stopped or self.inferring or self.info is None or self.recorder is None or (
                self.optimizer is not None and optimizer is not self.optimizer):
            return
        params = parameters_of(optimizer)
        if self._grads_pending:  # the gradients the closure made, as the update used them
            self._grads_pending = False
            self._choose_model(optimizer)  # the closure's forward named the candidates
            self._add_owners(params)
            self._end_ops()
            self.recorder.record_param_grads(stats=self._watch(self.info.step) != WATCH_NONE,
                                             of=params, call=self._closure_step[1])
        detailed = self._watch(self.info.step) == WATCH_MODULE  # (a zoomed or planted step)
        self.recorder.record_parameters(OPTIMIZER, of=params, stats=detailed)
        self._stepped.setdefault(id(optimizer), weakref.ref(optimizer))
        if detailed:
            self.recorder.record_optimizer(optimizer, stats=True,
                                           call=list(self._stepped).index(id(optimizer)))
        if self.info.step == 0:  # the settings the step ran under: the code may set them
            # after its first forward (taken as the step began)
            self.trace.env = capture_environment(self.trace.env.get("device"))
        self._versions.update({id(p): (p, p._version) for p in params if not p.is_inference()})
        self.info.optimizer_stepped = True
        self.info.lr += [_finite(group.get("lr")) for group in optimizer.param_groups]
        self._optimizers.add(id(optimizer))
        # complete once every optimizer seen so far has updated; the first step never is
        # (its optimizers are not known until it ends): the limit then stops the next one
        self._step_done(complete=self.info.step > 0 and self._optimizers <= self._stepped.keys())

    def on_zero_grad(self, owner: Any) -> None:
        """Gradients are zeroed (an optimizer's or a module's zero_grad). Those the open
        step's backward made for the model, with no update since and the parameters left as
        they were, are thrown away. If the next thing the loop does is a new training call,
        that was no training step (a gradient norm taken on a validation batch, a batch the
        loop skips), and the step is dropped then (see _drop_step); a backward or an update
        first (gradients combined by hand, as PCGrad does) keeps it."""
        if self._grads_pending:
            self._closure_evaluated()
        if (self.stopped or self.inferring or self.info is None or self._updated
                or not self._losses or self._grads_pending or self.recorder is None
                or self.in_backward):
            return
        params = (parameters_of(owner) if isinstance(owner, torch.optim.Optimizer)
                  else list(owner.parameters()))
        mine = self.recorder.parameter_ids()
        # (parameters changed since the backward: an update, or SAM's perturbation)
        self._discarded = any(id(p) in mine for p in params) and all(
            p._version == version for p, version in self._at_backward) and not (
            self._updates_by_hand() and self._updated_by_hand())

    def _closure_evaluated(self) -> None:
        """Inside ``step(closure)``, the closure zeroes the gradients to evaluate again (LBFGS
        evaluates up to max_iter times, updating the parameters in between): the gradients of
        the evaluation before, as the optimizer used them, are recorded now, each under its
        evaluation's number, so that one differing there is found before the forward of the
        next evaluation (on parameters the update changed) is."""
        optimizer, evaluations = self._closure_step
        if (self.stopped or self.info is None or self.recorder is None
                or self._losses <= evaluations):  # (no backward since the last)
            return
        self.recorder.record_param_grads(stats=self._watch(self.info.step) != WATCH_NONE,
                                         of=parameters_of(optimizer), call=evaluations)
        self._closure_step = (optimizer, evaluations + 1)
        self._closure_losses = self._losses

    def _drop_step(self) -> None:
        """Forget the open step as if it had not begun: its records (batch, loss,
        gradients), and the pass over data it would have counted as an epoch; the next
        training call begins it again, under the same number."""
        assert self.recorder is not None and self.info is not None
        if self.fault is not None and self.fault.step == self.info.step:
            # a fault planted at this step fires in it again
            self.recorder.fault_fired = self._side_fault_fired = False
        self._end_ops()
        self.recorder.end_step()  # (its records: not kept)
        self._carried = None
        (self._train_pass, self._epochs_fed, step_loaders, self.epoch,
         self.index) = self._before_step
        self._step_loaders = set(step_loaders)
        self.info, self._batches, self._losses, self._rng_taken = None, 0, 0, False
        self._loss_values, self._step_outputs, self._fetched = {}, [], 0
        self._discarded = False
        self._side.forget_calls()
        self.trace.probe[DROPPED_STEPS] = self.trace.probe.get(DROPPED_STEPS, 0) + 1

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

    # -- updates by hand -------------------------------------------------------------------
    def _updated_by_hand(self) -> bool:
        """Whether a loop that has no optimizer changed the model's parameters in place
        since the open step's last backward (`p -= lr * p.grad` under no_grad, or
        `p.data -= lr * p.grad`, which bumps no version counter: their prints tell): an
        update it makes itself, which ends the step like an optimizer's."""
        if not self._by_hand or self._optimizer_used:
            return False
        return any(p._version != version for p, version in self._by_hand) or (
            _prints_of([p for p, _ in self._by_hand]) != self._by_hand_prints)

    def _updates_by_hand(self) -> bool:
        """Whether the loop may update the model by hand: no optimizer was given, none has
        stepped, and none holds the model's parameters (looked for once, at the first
        backward: SAM's perturbation or an optimizer stepped later is no update by hand)."""
        if self._by_hand_possible is None:
            model = self.models.current()
            if self.optimizer is not None or model is None:
                self._by_hand_possible = False
            else:
                self._by_hand_possible = not held_by_an_optimizer(model)
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
        would set them. At a module-level step, the gradients are recorded as it left
        them (see Recorder.record_grads_left_by_backward)."""
        if self.info is None or self.recorder is None or self.stopped:
            return
        if self._watch(self.info.step) == WATCH_MODULE:
            self.recorder.record_grads_left_by_backward()
        if not self._updates_by_hand():
            return
        model = self.models.current()
        assert model is not None
        # what the parameters are now: a change from here on is the loop's update
        self._by_hand = [(p, p._version) for p in model.parameters()
                         if p.requires_grad and not p.is_inference()]
        self._by_hand_prints = _prints_of([p for p, _ in self._by_hand])
        # the gradients as this backward left them: the update's, if it comes next (a loop's
        # own update or zero_grad would change them before it is seen)
        self._grads_by_hand = self.recorder.print_param_grads(
            stats=self._watch(self.info.step) != WATCH_NONE)
        now, after = self._watch(self.info.step), self._watch(self.info.step + 1)
        if after != WATCH_NONE or now == WATCH_NONE:  # (a watched step keeps its own)
            self.recorder.hook_for(after)
            self._run_eagerly(after != WATCH_NONE)

    # -- a step done ------------------------------------------------------------------------
    def _last_step_updated(self) -> bool:
        """The step at the step limit is open and has updated: by every optimizer that
        updates, or at step 0, where how many do is not known yet (a second optimizer
        updating after an evaluation call in that step would not be recorded)."""
        return (self._updated and self.info is not None and self.max_steps is not None
                and self.info.step + 1 >= self.max_steps
                and (self.info.step == 0 or self._optimizers <= self._stepped.keys()))

    def _last_step_over(self) -> bool:
        """Whether the step at the step limit has updated, by its optimizers or by the loop's
        own update (seen now, and recorded: no training call will come to find it)."""
        if self._last_step_updated():
            return True
        if (self.info is None or self._updated or self.max_steps is None
                or self.info.step + 1 < self.max_steps or not self._updated_by_hand()):
            return False
        self._record_update_by_hand(last=True)
        return True

    def _step_done(self, complete: bool, between_calls: bool = True) -> None:
        """The open step has updated (or its update was skipped): the next training call
        begins a new one, and so does a second update by an optimizer that already updated
        (the updates of several optimizers between two forwards are one step); the module
        hooks are set for the next step now, `between_calls` (inside a call they cannot be:
        see after_backward). At the step limit the run ends here when the step is
        `complete`, else when the next step would begin."""
        assert self.info is not None and self.recorder is not None
        self._file_loader_batches()
        self._add_models_trained_apart()
        if between_calls:
            self.recorder.hook_for(self._watch(self.info.step + 1))
            # eager from here when the next step is watched: a compiled function that calls
            # the model begins before any hook of the step could set it
            self._run_eagerly(self._watch(self.info.step + 1) != WATCH_NONE)
        self._updated, self._fed = True, False  # (a batch for the next step is yet to come)
        self._updated_at = _get_sequence_nr()  # autograd nodes made later: the next step's
        if complete and self.max_steps is not None and self.info.step + 1 >= self.max_steps:
            self.end_step()
            self.stop()

    # -- the models an update names ---------------------------------------------------------
    def _choose_model(self, optimizer: torch.optim.Optimizer) -> None:
        """At the first optimizer step, the model is the candidate that owns its parameters
        (see ModelFinder.choose); the global hooks give way to one hook on it."""
        if not self.models.choose(optimizer):
            return
        if self.recorder is not None and self.recorder.model is not self.model:
            # the step began at another module's call (a frozen teacher, a GAN's generator):
            # its batch, RNG states and losses are the step's; the model's parameters as
            # they were before the first step are recorded now, before its first update
            so_far = self.recorder.end_step() if self.info is not None else None
            self.recorder.__exit__(None, None, None)
            self.recorder = self._new_recorder(self.model)
            self.recorder.begin_step(self.stream.steps, self._watch(self.stream.steps))
            if so_far is not None:
                self._carried = _step_state(so_far)
                if self.stream.steps == 0:
                    self.recorder.record_parameters(STATE)

    def _add_owners(self, updated_params: list[torch.Tensor]) -> None:
        """Other top-level models whose parameters an optimizer updates (a head called apart
        from its backbone, a GAN's generator; the module holding them, where their training
        calls its parts: see ModelFinder.holder_of) are recorded too, named by their class,
        their parameters as they are before this first update kept as well."""
        if self.recorder is None or self.info is None:
            return
        updated = {id(p) for p in updated_params} - self.recorder.parameter_ids()
        for module in self.models.candidates:
            if not updated:  # (every step after the first: no candidate's walked)
                return
            if not any(id(p) in updated for p in module.parameters()):
                continue
            module = self.models.holder_of(module, updated)
            params = list(module.parameters())
            name = self.models.name_other(module)
            self.recorder.add_model(name, module)
            self.recorder.record_parameters(STATE, of=params)
            updated -= {id(p) for p in params}

    def _add_models_trained_apart(self) -> None:
        """Models trained apart, found once their optimizer is known (see
        ModelFinder.trained_apart), are recorded from now on."""
        held = self.models.trained_apart()
        if held is not None:
            self._add_owners(held)


def _step_state(records: StepRecords) -> StepRecords:
    """The batch and RNG state records among a step's records, and its losses (those of
    a backward before the update that named the model)."""
    kept = [(k, p) for k, p in zip(records.keys, records.prints)
            if (k[0] == STATE and k[3].startswith(("batch", "rng.")))
            or (k[0] == OUTPUT and k[1] == "" and k[3].startswith("loss"))]
    return StepRecords([k for k, _ in kept], [p for _, p in kept], [])


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None

