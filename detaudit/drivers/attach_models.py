"""Which modules are the models of a loop an attachment records (see :mod:`.attach`).

Nothing tells an attachment which module is the model unless the user does: the candidates
are the top-level modules called in training mode, and the model is the one whose parameters
the first optimizer step updates (:meth:`ModelFinder.choose`); when no such call is seen (the
model runs inside a compiled function, or trains in eval mode) it is looked for among every
live module (:meth:`ModelFinder.find`). Other models an optimizer trains (a head called apart
from its backbone, a GAN's generator, an ensemble's members in inference) are recorded too,
under their class's name; a model built anew like the model once no optimizer holds the old
one (a loop that resumes from a checkpoint) takes its place. Models the loop calls but no
optimizer trains (an EMA, a teacher) are :class:`SideModels`. The attachment owns the
recording; these classes only say which modules are which, and what of them to record.
"""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..record.recorder import running_statistics
from ..record.sites import in_a_library

# optimizers whose model is looked for among every live object: a loop that makes an
# optimizer per batch over tensors no module owns (an adversarial perturbation) stops there
MAX_MODEL_SEARCHES = 8


class ModelFinder:
    """The model recorded (`model`, given or found), the candidates for it, and the other
    models recorded beside it. `optimizer`, when given, is the only one whose model counts."""

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.given = model is not None
        self.candidates: list[nn.Module] = []
        self.others: list[tuple[str, nn.Module]] = []  # further models recorded, by name
        # the modules within models found among every live module (see find): their calls
        # with gradients on are the training calls (in eval mode too; none are seen inside
        # compiled code)
        self.found_modules: set[int] = set()
        self.placed: set[int] = set()  # optimizers whose model was seen or searched for
        self.checked: set[int] = set()  # see trained_apart

    def current(self) -> nn.Module | None:
        """The model, or until it is known the first candidate."""
        if self.model is not None:  # (a compiled model's wrapper has no truth value)
            return self.model
        return self.candidates[0] if self.candidates else None

    def is_other(self, module: nn.Module) -> bool:
        return any(module is m for _, m in self.others)

    def found(self, module: nn.Module) -> bool:
        """Whether `module` is within a model found among every live module (see find)."""
        return id(module) in self.found_modules

    def add_candidate(self, module: nn.Module) -> bool:
        """`module` is called in training: a candidate if it has parameters (True if new)."""
        if module not in self.candidates and any(True for _ in module.parameters()):
            self.candidates.append(module)
            return True
        return False

    def forget(self) -> None:
        """The loop, taken for inference, trains: the models named so far are forgotten (the
        model given, or the one the optimizer given updates, is kept)."""
        if self.optimizer is None and not self.given:
            self.model = None
        self.others, self.candidates, self.checked = [], [], set()

    def choose(self, optimizer: torch.optim.Optimizer) -> bool:
        """At the first optimizer step, the model is the candidate that owns its parameters
        (True when it is chosen now)."""
        if self.model is not None:
            return False
        updated = {id(p) for p in parameters_of(optimizer)}
        owned = [(sum(id(p) in updated for p in m.parameters()), m) for m in self.candidates]
        if not any(n for n, _ in owned):
            return False
        # the one that owns the most of them (not a part of the model called on its own
        # first, a sanity check of the backbone), the first called of those
        most = max(n for n, _ in owned)
        self.model = self.holder_of(next(m for n, m in owned if n == most), updated)
        return True

    def holder_of(self, part: nn.Module, updated: set[int]) -> nn.Module:
        """`part`, or, where a module that holds it owns more of the parameters an optimizer
        updates (`updated`: their ids), the innermost of those that own the most: a model
        never called itself in training, whose training code calls its parts
        (Stable-Baselines3's policies, whose ``evaluate_actions`` calls their feature
        extractor and heads; SAC's actor; an ``nn.Sequential`` that
        ``checkpoint_sequential`` runs). Its parts are then named inside it, and their calls
        with gradients on are the step's (see `found`)."""
        owned = sum(id(p) in updated for p in part.parameters())
        if owned == len(updated):
            return part
        holders = [(n, m) for m in live_objects(nn.Module) if m is not part
                   and (n := sum(id(p) in updated for p in m.parameters())) > owned
                   and any(c is part for c in m.modules())]
        if not holders:
            return part
        holder, _ = _innermost_owning_most(holders)
        self.found_modules |= {id(m) for m in holder.modules()}
        return holder

    def find(self, optimizer: torch.optim.Optimizer) -> bool:
        """An optimizer updates before any training-mode call of a module was seen: the
        model runs inside a compiled function, where module hooks do not run, or trains in
        eval mode. The model is the module that owns the most of the optimizer's
        parameters, found among every live module; its calls with gradients on are the
        step's from then on (those a compiled function makes are seen at a zoomed step,
        which runs eagerly). True when one is found."""
        updated = {id(p) for p in parameters_of(optimizer)}
        owners = [(sum(id(p) in updated for p in m.parameters()), m)
                  for m in live_objects(nn.Module)]
        owners = [(n, m) for n, m in owners if n]
        if not owners:
            return False
        model, owning = _innermost_owning_most(owners)
        self.candidates.append(model)
        # its calls, and those of wrappers that hold it (DDP), are the step's
        self.found_modules |= {id(m) for m in model.modules()} | owning
        return True

    def owned(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a module seen in a training call owns some of the optimizer's parameters."""
        updated = {id(p) for p in parameters_of(optimizer)}
        return any(id(p) in updated for m in self.candidates for p in m.parameters())

    def name_other(self, module: nn.Module) -> str:
        """Name `module` another model recorded: by its class (`Name2`, ... when taken)."""
        name = _unique(type(module).__name__, {n for n, _ in self.others})
        self.others.append((name, module))
        return name

    def inferred_name(self, module: nn.Module) -> tuple[str | None, bool]:
        """In inference, each top-level call of a module with parameters is a step: of the
        model (named "") or of another model (an ensemble's), recorded too under its class's
        name; None for a module without parameters (a post-processing step). The flag says
        that `module` is another model named just now (to be recorded from now on)."""
        if module is self.model:
            return "", False
        if self.model is None and any(True for _ in module.parameters()):
            self.model = module
            return "", False
        name = next((n for n, m in self.others if m is module), None)
        if name is None and any(True for _ in module.parameters()):
            return self.name_other(module), True
        return name, False

    def replaces_model(self, module: nn.Module) -> bool:
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
        return not held_by_an_optimizer(model)

    def trained_apart(self) -> list[torch.Tensor] | None:
        """Models called in training whose parameters an optimizer holds that has not
        updated yet (a GAN's generator, trained after the discriminator's first update) are
        recorded from now on: the step of their first update begins at their call and is
        recorded like any other (a fault planted there fires). Each is looked for once: the
        parameters an optimizer holds of those looked for now, None if none was."""
        new = [m for m in self.candidates if id(m) not in self.checked
               and m is not self.model and not self.is_other(m)]
        if not new or self.optimizer is not None:
            return None
        self.checked |= {id(m) for m in new}
        held = {id(p) for o in live_objects(torch.optim.Optimizer) for p in parameters_of(o)}
        return [p for m in new for p in m.parameters() if id(p) in held]


def _innermost_owning_most(owners: list[tuple[int, nn.Module]]) -> tuple[nn.Module, set[int]]:
    """Of modules by how many of an optimizer's parameters each owns, the innermost of those
    that own the most: the model, not a container or a wrapper of it (torch.compile's, a
    ModuleDict of models), so that names are its own; and the ids of all that own as many."""
    most = max(n for n, _ in owners)
    owning = {id(m) for n, m in owners if n == most}
    return next(m for n, m in owners if n == most and not any(
        id(c) in owning for c in list(m.modules())[1:])), owning


def parameters_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def live_objects(kind: type) -> list[Any]:
    """Every live object of `kind` the garbage collector tracks (one pass over them all)."""
    import gc

    # (issubclass of the type: isinstance fails on a dead weak proxy)
    return [o for o in gc.get_objects() if issubclass(type(o), kind)]


def held_by_an_optimizer(model: nn.Module) -> bool:
    """Whether a live optimizer holds some of `model`'s parameters."""
    mine = {id(p) for p in model.parameters()}
    return any(any(id(p) in mine for p in parameters_of(o))
               for o in live_objects(torch.optim.Optimizer))


def _bound_name(module: nn.Module) -> str | None:
    """The name the user's code holds `module` by where it calls it, in the outermost of
    its frames that holds it (timm's `model_ema`, not `model`, the parameter of the
    `validate` it is passed to): a key path into a dict, list or tuple of that frame
    (``emas.fast.0``) first, else a variable of the frame or an attribute of its ``self``,
    else an attribute of an object a variable holds (``ema.ema``). Where none does, the
    innermost library frame's attribute of ``self`` that holds it (Stable-Baselines3's
    ``self.q_net_target``), or of an object a variable holds (YOLOv5's ``ema.ema``). It is
    the same in every run whatever order two models of one class are first called in (by a
    loop variable, say), where a name by class and order is not."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    users = [f for f in frames if not in_a_library(f.f_code.co_filename)]
    for frame in reversed(users):
        owner = frame.f_locals.get("self")
        name = _held_in(module, [frame.f_locals, frame.f_globals, *_attributes(owner)])
        if name is not None:
            return name
    return next((name for frame in frames if frame not in users
                 and (name := _held_in(module, _attributes(frame.f_locals.get("self")))
                      or _in_an_object(module, _named([frame.f_locals])))), None)


def _attributes(owner: Any) -> list[dict[str, Any]]:
    return [getattr(owner, "_modules", None) or {}, getattr(owner, "__dict__", None) or {}]


def _held_in(module: nn.Module, scopes: list[dict[str, Any]]) -> str | None:
    """The name `module` has in `scopes`: a key path into a container first, else a name,
    else a module's attribute (timm's EMA wrapper's `model_ema.module`), else another
    object's (`ema.ema`)."""
    named = _named(scopes)
    held = next((f"{name}.{path}" for name, value in named
                 if isinstance(value, (dict, list, tuple))
                 and (path := _path_to(module, value, depth=2))), None)
    return held or next((name for name, value in named if value is module), None) or (
        _in_an_object(module, named))


def _named(scopes: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(name, value) for scope in scopes for name, value in list(scope.items())
            if name != "self" and name.isidentifier()]


def _in_an_object(module: nn.Module, named: list[tuple[str, Any]]) -> str | None:
    """``name.attribute`` where an object holds `module` as an attribute: a module first
    (timm's EMA wrapper's ``model_ema.module``), else an object that is no container,
    class or Python module (an EMA helper's ``ema.ema``)."""
    for modules in (True, False):
        for name, value in named:
            if isinstance(value, nn.Module) is not modules or isinstance(
                    value, (dict, list, tuple, type, ModuleType)):
                continue
            attributes = value._modules if modules else getattr(value, "__dict__", None)
            if isinstance(attributes, dict):
                found = next((a for a, inner in list(attributes.items()) if inner is module),
                             None)
                if found is not None and found.isidentifier():
                    return f"{name}.{found}"
    return None


def _path_to(module: nn.Module, container: Any, depth: int) -> str | None:
    """The key path to `module` inside `container` (dicts, lists and tuples, `depth` deep;
    large ones are not searched)."""
    if isinstance(container, dict):
        items = [(str(k), v) for k, v in container.items() if isinstance(k, (str, int))]
    elif isinstance(container, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(container)]
    else:
        return None
    if len(items) > _SEARCHED_ITEMS:
        return None
    for key, value in items:
        if value is module:
            return key
        if depth > 1 and (inner := _path_to(module, value, depth - 1)):
            return f"{key}.{inner}"
    return None


_SEARCHED_ITEMS = 1000  # a frame's containers larger than this (a dataset) are not searched


def _unique(name: str, taken: set[str]) -> str:
    """`name`, or `name2`, `name3`, ... if taken."""
    k = 1
    while (candidate := name if k == 1 else f"{name}{k}") in taken:
        k += 1
    return candidate


class SideModels:
    """Models the loop calls but no optimizer trains (an EMA copy evaluated between epochs, a
    frozen teacher, a model restored for evaluation): their parameters and buffers are step
    state, recorded as a step begins once the model was first seen, then each time they
    changed in place (an EMA's update after every step); each top-level call's inputs and
    output are step records too. Named as the loop holds them (see _bound_name), else by
    their class."""

    def __init__(self) -> None:
        self._models: dict[int, tuple[str, Any]] = {}  # id -> (name, weakref to the module)
        self._versions: dict[int, tuple[Any, int]] = {}  # id(tensor) -> (weakref, version)
        self._calls: dict[str, int] = {}  # each side model's calls for step `_step`
        self._step = -1
        self.pending: list[tuple[Any, Any]] = []  # call records for the step about to begin
        # modules found to be no side model, asked once (an optimizer is looked for among
        # every live object: an evaluation loop would pay that at each call)
        self._rejected: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def begin_call(self, module: nn.Module, step: int) -> tuple[str, int] | None:
        """A top-level call of `module` begins, working for step `step`: the name its
        records take and its index among the model's calls for that step (None if it is no
        side model)."""
        known = self._models.get(id(module))
        if known is None:
            return None
        if step != self._step:
            self._step, self._calls = step, {}
        name = known[0]
        index = self._calls.get(name, 0)
        self._calls[name] = index + 1
        return name, index

    def forget_calls(self) -> None:
        """The step the calls worked for is dropped (begun again): counted from 0 again."""
        self._calls = {}

    def saw(self, module: nn.Module, recorded: set[int], taken: set[str]) -> str | None:
        """A top-level call of `module` that is no training call: a side model if it has
        parameters, none of them recorded (`recorded`: their ids) and none an optimizer's;
        its name if it is new. `taken`: the names of the models recorded already."""
        if id(module) in self._models or module in self._rejected:
            return None
        params = list(module.parameters())
        if not params or any(id(p) in recorded for p in params) or held_by_an_optimizer(
                module):
            self._rejected.add(module)
            return None
        name = _unique(_bound_name(module) or type(module).__name__,
                       taken | {name for name, _ in self._models.values()})
        self._models[id(module)] = (name, weakref.ref(module))
        return name

    def changed(self, recorded: set[int]
                ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """The side models' parameters and buffers not recorded yet, or changed in place
        since, by name (a norm layer's running statistics whenever it is in training mode:
        update_bn's calls write them without moving their version); a side model whose
        parameters became a recorded model's (`recorded`: their ids; the model evaluated
        before its training began) is one no more."""
        params: list[tuple[str, torch.Tensor]] = []
        buffers: list[tuple[str, torch.Tensor]] = []
        for key, (name, ref) in list(self._models.items()):
            module = ref()
            if module is None or any(id(p) in recorded for p in module.parameters()):
                del self._models[key]
                continue
            training = {n for n, layer in running_statistics(module, name).items()
                        if layer.training}
            for into, tensors in ((params, module.named_parameters(prefix=name)),
                                  (buffers, module.named_buffers(prefix=name))):
                for tensor_name, tensor in tensors:
                    version = None if tensor.is_inference() else tensor._version
                    before = self._versions.get(id(tensor))
                    if (before is not None and before[0]() is tensor and before[1] == version
                            and tensor_name not in training):
                        continue
                    into.append((tensor_name, tensor))
                    if version is not None:
                        self._versions[id(tensor)] = (weakref.ref(tensor), version)
        return params, buffers
