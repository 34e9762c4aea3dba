"""Module-level recording: hooks that fingerprint every module call, forward and backward.

Forward: pre/post hooks on every module record the tensors going in and out, the call's
place in the call tree, and whether it advanced the torch RNG.

Backward: the gradient w.r.t. each module output comes from a tensor hook registered in
forward; the gradient a module sends to each of its inputs, from hooks on the autograd
nodes at the call's boundary, which :mod:`detaudit.record.backward` finds (as it finds the
calls a reentrant checkpoint recomputes).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._C._autograd import _get_sequence_nr
from torch.autograd.function import BackwardCFunction
from torch.nn.parameter import UninitializedBuffer
from torch.utils._python_dispatch import _disable_current_modes

from ..config import PROBE_FILE_MODULE, Fault
from ..trace import FORWARD, GRAD, LEFT_BY_BACKWARD, OPTIMIZER, STATE
from .backward import BackwardBoundaries, Call, CallIndex, SeqIndex, index_call, slot_name
from .fingerprint import Fingerprinter, TensorPrint
from .structure import iter_leaves, iter_tensors, next_ulp, replace_first_float

WATCH_MODULE, WATCH_CALLS, WATCH_NONE = "module", "calls", "none"
WATCH_LEVELS = (WATCH_MODULE, WATCH_CALLS, WATCH_NONE)
RecordKey = tuple[str, str, int, str]  # (phase, module, call, slot)
_READ_HOPS = 4  # one-input ops between a parameter and the call input made of it (see _note_read)


@dataclass
class StepRecords:
    """Everything recorded during one step, in execution order, prints resolved."""

    keys: list[RecordKey]
    prints: list[TensorPrint]
    calls: list[Call]


def rng_states() -> dict[str, bytes]:
    """The state of every RNG a training step may draw from, as bytes."""
    out = {"torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda:{i}"] = state.numpy().tobytes()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out["numpy"] = keys.tobytes() + repr((kind, pos, has_gauss, gauss)).encode()
    out["python"] = repr(random.getstate()).encode()
    return out


def _host_rng_state() -> int:
    """A digest of Python's and numpy's global RNG states."""
    _, keys, pos, _, _ = np.random.get_state()
    return hash((random.getstate(), keys.tobytes(), pos))


def _module_rng_state() -> bytes:
    """The RNG state a module's own draws (dropout, randperm) change: torch CPU + current CUDA."""
    state = torch.get_rng_state().numpy().tobytes()
    if torch.cuda.is_initialized():  # 20x cheaper than is_available(), and implies it
        state += torch.cuda.get_rng_state().numpy().tobytes()
    return state


class Recorder(BackwardBoundaries):
    """Records fingerprints of a model's module calls; use as a context manager.

    The runner drives it: ``begin_step`` → (forward runs) → ``before_backward(loss)`` →
    (backward runs) → ``record_param_grads`` → ``record(...)`` for step state →
    ``end_step``. ``fault`` plants a 1-ULP change (this recorder's run only).
    """

    def __init__(
        self,
        model: nn.Module,
        fingerprinter: Fingerprinter | None = None,
        fault: Fault | None = None,
        track_rng: bool = True,
        watch: str = "module",
    ) -> None:
        self.model = model
        self.fp = fingerprinter or Fingerprinter()
        self.fault = fault if fault is not None and not fault.op else None  # op faults: OpRecorder
        self.track_rng = track_rng
        self.fault_fired = False
        # a backward fault's module ran backward at its step, every gradient it sent to its
        # inputs all zero: none could carry 1 ULP
        self.fault_met_zeros = False
        # the ops an op fault's module ran in its phase at its step (see OpRecorder): what
        # to name where the fault's op never ran
        self.ops_at_fault: set[str] = set()
        # Python's and numpy's global RNGs are outside the dispatcher: with watch_host_rng,
        # the module calls during which they advanced are kept in host_draws.
        self.watch_host_rng = False
        self.host_draws: set[tuple[str, int]] = set()
        self._models = [uncompiled(model)]
        self._prefixes = [""]  # each model's names begin with its own
        # each buffer as the last step began and its version then (see _record_buffers)
        self._buffers_seen: dict[str, tuple[weakref.ref, int | None]] = {}
        self._buffers_recorded = False  # (the first time: every buffer, as built)
        self._names = {id(m): name for name, m in self._models[0].named_modules()}
        self._aliases = shared_module_aliases(self._models[0], "")  # (see _pre_hook)
        self._params = dict(self._models[0].named_parameters())
        self._param_owners: dict[int, str] | None = None  # (see _note_read)
        self._partial: set[str] = set()  # see partial_gradients
        self._handles: list[tuple[Any, _Hook]] = []  # (a module hook's handle, the hook)
        self._hooked_modules: set[int] = set()  # the ids of the modules _handles hook
        self._step_handles: list[Any] = []
        self._step = -1
        self._thread = threading.get_ident()  # (see begin_step)
        self._lock = threading.Lock()  # a record's key and print are appended together
        # the call of a model called apart (see attach's SideModels) running now, by name
        # and index: ops outside every module call of the recorded models are placed in it
        self.apart: tuple[str, int] | None = None
        # where the user's code ran each op recorded outside the model (see config.OP_SITES)
        self.op_sites: dict[str, str] = {}
        if watch not in WATCH_LEVELS:
            raise ValueError(f"watch must be one of {', '.join(WATCH_LEVELS)}, not {watch!r}")
        self._default_watch = self._watch = watch
        self._reset_step()

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Recorder:  # noqa: PYI034
        if self._watch != WATCH_NONE:
            self._install()
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove_module_hooks()
        for handle in self._step_handles:
            handle.remove()
        self._step_handles = []

    def _remove_module_hooks(self) -> None:
        """Remove the module hooks. A call under way runs the hooks it began with, removed
        or not (and a pre-hook removed from it is called without its keyword arguments):
        each removed hook does nothing from now on."""
        for handle, hook in self._handles:
            handle.remove()
            hook.hook = _no_hook
        self._handles = []
        self._hooked_modules = set()

    def _install(self, skip: set[int] | None = None) -> None:
        """Hook every module of every model recorded once, but those hooked already and
        those in `skip`. A module a model gained since the recorder was made (a loss module
        its first loss call makes, as Ultralytics' models do) is named by its place in it."""
        seen = set(skip or ()) | self._hooked_modules
        for root, prefix in zip(self._models, self._prefixes):
            for name, module in nn.Module.named_modules(root, prefix=prefix):
                if id(module) in seen or isinstance(module, torch.jit.ScriptModule):
                    continue  # (a TorchScript module takes no hooks: see scripted_modules)
                seen.add(id(module))
                self._names[id(module)] = name
                self._hook(module)

    def _hook(self, module: nn.Module) -> None:
        self._hooked_modules.add(id(module))
        pre, post = _Hook(self._pre_hook), _Hook(self._post_hook)
        self._handles.append((module.register_forward_pre_hook(pre, with_kwargs=True), pre))
        # (called when forward raises too, with no output: the call ends there, as one that
        # a non-reentrant checkpoint's recomputation stops early does)
        self._handles.append((module.register_forward_hook(post, with_kwargs=True,
                                                           always_call=True), post))

    @property
    def _records_modules(self) -> bool:
        return self._watch == WATCH_MODULE

    def _reset_step(self) -> None:
        self._keys: list[RecordKey] = []
        self._calls: list[Call] = []
        self._stack: list[tuple[int, bytes | None, int | None]] = []
        self._counts: dict[str, int] = {}
        self._seq_index: SeqIndex | None = None
        self._call_index: CallIndex | None = None  # see _indexed
        self._recomputed = False  # some nodes of this step's graph carry their call
        # backward records of the step so far, by key, and the autograd nodes hooked: a
        # later backward through the same graph (`retain_graph=True`) runs those hooks again
        self._backward_seen: dict[RecordKey, int] = {}
        self._hooked: set[Any] = set()
        self._backwards_left = 0  # the backward passes whose gradients are recorded so far

    def begin_step(self, step: int, watch: str | None = None, rehook: bool = True) -> None:
        """Start recording global step `step`, watching its modules as `watch` says (default:
        as the recorder was made): ``module`` records every module call; ``calls`` follows the
        calls without recording them (for op attribution and planted faults); ``none``
        leaves the model without hooks (a scanned step: step state only). Without `rehook`
        the hooks stay as they are (see :meth:`hook_for`)."""
        self._step = step
        self._thread = threading.get_ident()  # the step's calls are this thread's
        self._reset_step()
        self._watch = watch or self._default_watch
        if rehook:
            self.hook_for(self._watch)

    def hook_for(self, watch: str) -> None:
        """Install the module hooks `watch` needs, or remove them for ``none``. Torch runs
        the hooks of a module call as they were when the call began: a hook removed inside
        a call does nothing there (see _remove_module_hooks), and one added inside a call
        runs from the next call on."""
        if watch == WATCH_NONE and self._handles:
            self._remove_module_hooks()
        elif watch != WATCH_NONE:
            self._install()  # (and the modules the models gained since it last did)

    def end_step(self) -> StepRecords:
        """Finish the step: fetch device values once and hand over its records."""
        for handle in self._step_handles:
            handle.remove()
        self._step_handles = []
        prints = self.fp.collect()
        for call in self._calls:  # a graph never run backward would keep its saved tensors
            call.edge_objects.clear()
            call.backward_node = None
        out = StepRecords(self._keys, prints, self._call_tree() if self._records_modules else [])
        self._reset_step()
        return out

    def _call_tree(self) -> list[Call]:
        """The step's calls but recomputations, each parent a position among them (a call
        made anew inside a recomputation sits in the call recomputed)."""
        calls = self._calls
        kept = {i: n for n, i in enumerate(i for i, c in enumerate(calls) if c.original < 0)}
        if len(kept) == len(calls):
            return calls

        def place(p: int) -> int:
            return -1 if p < 0 else kept[p if calls[p].original < 0 else calls[p].original]

        return [replace(c, parent=place(c.parent)) for c in calls if c.original < 0]

    # -- where execution is now (for the op-level recorder) ------------------------------
    def current_call(self, node: Any = None) -> Call | None:
        """The innermost module call running forward right now, if any: in forward, or (with
        `node`) inside the backward of autograd `node`, as a checkpoint recomputes."""
        if not self._stack:
            return None
        call = self._calls[self._stack[-1][0]]
        return call if call.backward_node is node else None

    # -- generic records ---------------------------------------------------------------
    def record(
        self, phase: str, module: str, call: int, slot: str, value: Any, stats: bool = True,
        algorithm: str | None = None, written: bool = False, plain: bool = False,
    ) -> None:
        """Fingerprint every tensor in `value` under (phase, module, call, slot[.path]);
        `algorithm` and `written` as :meth:`Fingerprinter.add_many` takes them. With `plain`,
        its str, int, float, bool and None values too, each printed by its repr after the
        tensors (a label that differs is a divergence)."""
        tensors, values = [], []
        for path, leaf in (iter_leaves if plain else iter_tensors)(value):
            if isinstance(leaf, torch.Tensor):
                self._keys.append((phase, module, call, slot_name(slot, path)))
                tensors.append(leaf)
            else:
                values.append((path, leaf))
        self.fp.add_many(tensors, stats, algorithm, written)
        for path, leaf in values:
            self._keys.append((phase, module, call, slot_name(slot, path)))
            self.fp.add_bytes(repr(leaf).encode())

    def record_values(self, phase: str, module: str, call: int, slot: str, value: Any) -> None:
        """The plain values in `value` (str, int, float, bool, None: an op's arguments that
        are no tensors), as one record printed by their paths and reprs; none if it has none."""
        values = [(path, leaf) for path, leaf in iter_leaves(value)
                  if not isinstance(leaf, torch.Tensor)]
        if values:
            self._keys.append((phase, module, call, slot))
            self.fp.add_bytes(repr(values).encode())

    def record_state(self, batch: Any, as_loaded: bool = False, rng: bool = True) -> None:
        """Step-boundary state: the batch and every RNG (unless `rng` is false: taken
        already). A batch `as_loaded` (as the data pipeline yields it, before the training
        code moves it to a device) is printed by xxh3 in every dtype where it is on the CPU
        (see `fingerprint.scheme`)."""
        self.record(STATE, "", 0, "batch", batch, algorithm="xxh3" if as_loaded else None)
        if rng:
            self.record_rng()
        self._record_buffers()

    def record_rng(self) -> None:
        """The state of every RNG (torch's, each CUDA device's, numpy's, Python's)."""
        for name, state in rng_states().items():
            self._keys.append((STATE, "", 0, f"rng.{name}"))
            self.fp.add_bytes(state)

    def _record_buffers(self) -> None:
        """The buffers written since the last step began (BatchNorm's running statistics,
        counters, an EMA a module keeps), keyed (state, owning module, 0, buffer.<name>):
        the model's state besides its parameters. A buffer is recorded once something wrote
        to it (its version moved, or a new tensor took its name), and every buffer as built,
        as step 0 begins (not on the meta device): one never written since (a cached mask, a
        scratch buffer made by torch.empty) is not read again, and the comparison takes a
        difference there as evidence only, never as one of the runs (see compare's
        `as_built`). A norm layer's running statistics, which its kernel writes without
        moving their version, are recorded each step its layer is in training mode."""
        as_built = not self._buffers_recorded and self._step == 0
        self._buffers_recorded = True
        seen: set[int] = set()
        changed = []
        for prefix, model in zip(self._prefixes, self._models):
            statistics = running_statistics(model, prefix)
            for name, buffer in model.named_buffers(prefix=prefix):
                if id(buffer) in seen or isinstance(buffer, UninitializedBuffer):
                    continue
                seen.add(id(buffer))
                version = None if buffer.is_inference() else buffer._version
                before = self._buffers_seen.get(name)
                self._buffers_seen[name] = (weakref.ref(buffer), version)
                layer = statistics.get(name)
                built_print = before is None and as_built and not buffer.is_meta
                if built_print or before is not None and (
                        before[0]() is not buffer or version is None or version != before[1]
                        or (layer is not None and layer.training)):
                    changed.append((name, buffer))
        self._keys += _parameter_keys(STATE, changed, kind="buffer")
        # (stats where parameters have them: a step recorded module by module, which a
        # tolerance diff measures, a running mean a few ULPs off included)
        self.fp.add_many([t for _, t in changed], stats=self._watch == WATCH_MODULE)

    def record_parameters(self, phase: str, of: Iterable[torch.Tensor] | None = None,
                          stats: bool = False) -> None:
        """Every parameter, keyed by its owning module (all before step 0, trainable ones after
        each update; only those among `of` when it is given). Stats only when asked (a step
        recorded module by module, which a tolerance diff measures): at scan level, 3 passes
        over every weight per step would dominate the cost."""
        # after an update, no print taken before it is reused: an update may write without
        # bumping the version counter (`p.data.add_(...)`, a collective's broadcast)
        self._record_per_parameter(phase, stats, [
            (name, p) for name, p in self._among(of) if phase == STATE or p.requires_grad
        ], written=phase != STATE)

    def record_side_state(self, params: list[tuple[str, torch.Tensor]],
                          buffers: list[tuple[str, torch.Tensor]]) -> None:
        """Parameters and buffers of a model no optimizer trains (see attach's SideModels),
        named in full, as the step's state."""
        self._keys += _parameter_keys(STATE, params) + _parameter_keys(STATE, buffers,
                                                                       kind="buffer")
        self.fp.add_many([t for _, t in params] + [t for _, t in buffers],
                         stats=self._watch == WATCH_MODULE)

    def record_param_grads(self, stats: bool = True,
                           of: Iterable[torch.Tensor] | None = None, call: int = 0) -> None:
        """Every parameter's accumulated ``.grad`` after backward (only those among `of`
        when it is given), with stats unless told not to: across machines (`diff --rtol`)
        they are what a gradient difference is measured by; a scan compares bitwise and
        skips their passes over every gradient. `call` counts the evaluations of an
        optimizer that takes several in one step (LBFGS's closure)."""
        self._record_per_parameter(GRAD, stats, self._grads(of), call)

    def record_grads_left_by_backward(self) -> None:
        """Every parameter's ``.grad`` as a backward of the step has just left it, before
        the loop's own code can rescale it (clipping, unscaling), keyed (grad, owning
        module, n, left.param.<name>) for the step's n-th backward: what tells a gradient
        its backward made differ from one the loop rescaled by a norm another made differ."""
        items = self._grads(None)
        self._keys += [(GRAD, owner, self._backwards_left, f"{LEFT_BY_BACKWARD}{slot}")
                       for _, owner, _, slot in _parameter_keys(GRAD, items)]
        with _disable_current_modes():  # (an op-level step's mode: these ops are not the model's)
            self.fp.add_many([t for _, t in items], stats=True)
        self._backwards_left += 1

    def _grads(self, of: Iterable[torch.Tensor] | None) -> list[tuple[str, torch.Tensor]]:
        grads = [(name, p.grad) for name, p in self._among(of) if p.grad is not None]
        self._partial.update(name for name, g in grads if _is_partial(g))
        return grads

    def print_param_grads(self, stats: bool) -> list[tuple[RecordKey, TensorPrint]]:
        """The records :meth:`record_param_grads` would make now, taken aside (fetched at
        once) for :meth:`add_records` to add to a later step's."""
        items = self._grads(None)
        return _printed_aside(_parameter_keys(GRAD, items), [t for _, t in items], stats,
                              self.fp.algorithm)

    def add_printed(self, phase: str, module: str, call: int, slot: str,
                    printed: list[tuple[str, TensorPrint]]) -> None:
        """Add what :func:`printed_now` printed as the records (phase, module, call,
        slot[.path]) of the step."""
        self.add_records([((phase, module, call, slot_name(slot, path)), print_)
                          for path, print_ in printed])

    def add_records(self, records: list[tuple[RecordKey, TensorPrint]]) -> None:
        """Add records taken aside by :meth:`print_param_grads` to the step's."""
        for key, print_ in records:
            self._keys.append(key)
            self.fp.add_print(print_)

    def _among(self, params: Iterable[torch.Tensor] | None) -> list[tuple[str, Any]]:
        """The named parameters recorded, in model order: those among `params`, or all."""
        if params is None:
            return list(self._params.items())
        ids = {id(p) for p in params}
        return [(name, p) for name, p in self._params.items() if id(p) in ids]

    def sharded_parameters(self) -> list[str]:
        """The names of the parameters recorded that this process holds a shard of (a
        DTensor placed as a shard, as FSDP2's are; one an FSDP1 module shards: its flat
        parameter, or the views of its shard that ``use_orig_params`` gives): their prints
        differ from rank to rank."""
        by_fsdp1 = _sharded_by_fsdp1(self._models)
        return [name for name, p in self._params.items() if _is_shard(p) or id(p) in by_fsdp1]

    def partial_gradients(self) -> list[str]:
        """The names of the parameters whose gradient was seen as a partial sum (a DTensor
        placed `Partial`, as a norm's under SequenceParallel: each rank holds its own part,
        reduced later): their prints differ from rank to rank."""
        return sorted(self._partial)

    def tensor_parallel(self) -> bool:
        """Whether the models are split across ranks by tensor parallelism (a DTensor shard
        that no FSDP module holds, or one sharded on two mesh dimensions: FSDP's and
        another): the ranks of one group then work on the same batch by design. (FSDP2
        alone, HSDP included, shards each parameter on one mesh dimension.)"""
        by_fsdp = {id(p) for root in self._models for m in root.modules()
                   if _is_fsdp_class(m, "FSDPModule")
                   for p in m.parameters()}
        return any(_is_shard(p) and (id(p) not in by_fsdp or _shard_dims(p) > 1)
                   for p in self._params.values())

    def add_model(self, name: str, model: nn.Module) -> None:
        """Record `model` too, another top-level model of the same loop (trained by its own
        optimizer, or called apart from the first), its modules and parameters named under
        `name`."""
        hooked = {id(m) for root in self._models for m in root.modules()}
        model = uncompiled(model)
        self._models.append(model)
        self._prefixes.append(name)
        self._names.update({id(m): n for n, m in model.named_modules(prefix=name)
                            if id(m) not in hooked})
        for key, aliases in shared_module_aliases(model, name).items():
            self._aliases.setdefault(key, {}).update(aliases)
        self._params.update(model.named_parameters(prefix=name))
        self._param_owners = None
        if self._handles:
            self._install(skip=hooked)

    def join_call(self, module: nn.Module, args: tuple, hooks_before: set[int]) -> None:
        """`module`'s call began with the forward pre-hooks `hooks_before` (their ids), and
        ours were installed inside it (from a global hook): torch runs the post-hooks a call
        ends with, but only the pre-hooks it began with, so the call is entered here."""
        if any(key not in hooks_before and self._owns(hook)
               for key, hook in module._forward_pre_hooks.items()):
            self._pre_hook(module, args, {})

    def leave_call(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """`module`'s call, entered by our pre-hook, ends the step (an inference step's call,
        seen from a global hook, which torch runs first): our post-hook runs now, in the step,
        and what it returns (a planted fault's output) is returned; after the step it finds
        no call open and does nothing."""
        if self._stack and any(self._owns(hook) for hook in module._forward_hooks.values()):
            return self._post_hook(module, args, {}, output)
        return None

    def _owns(self, hook: Any) -> bool:
        """Whether a module's hook is one of this recorder's."""
        return isinstance(hook, _Hook) and getattr(hook.hook, "__self__", None) is self

    def model_class(self) -> str:
        """The recorded model's class, qualified by its module
        (``torchvision.models.segmentation.lraspp.LRASPP``; a probe file's by the file's
        name: ``my_probe.Detector``); a wrapper's (DDP, a compiled model) with the class it
        wraps (``...DistributedDataParallel(__main__.Net)``)."""
        def named(module: nn.Module) -> str:
            where = type(module).__module__
            if where.startswith(PROBE_FILE_MODULE):
                origin = getattr(sys.modules.get(where), "__file__", None) or where
                where = os.path.splitext(os.path.basename(origin))[0]
            return f"{where}.{type(module).__qualname__}"

        inner = getattr(self.model, "_orig_mod", None)
        if not isinstance(inner, nn.Module) and type(self.model).__name__ in (
                "DistributedDataParallel", "DataParallel"):
            inner = getattr(self.model, "module", None)
        return named(self.model) + (f"({named(inner)})" if isinstance(inner, nn.Module) else "")

    def scripted_modules(self) -> list[str]:
        """The names of the TorchScript modules (``torch.jit.script``) in the recorded
        models, the outermost: they take no hooks, so their calls are not recorded by
        module; their ops are, in the module that calls them."""
        names = [self._names[id(m)] for root in self._models for m in root.modules()
                 if isinstance(m, torch.jit.ScriptModule) and id(m) in self._names]
        return [n for n in names if not any(n.startswith(f"{outer}.") for outer in names)]

    def tied_parameters(self) -> dict[str, list[str]]:
        """The parameters a recorded model holds in more than one of its modules (tied
        weights, whose records go under the first name): that name -> the others. A module
        registered under several names (one layer repeated) is one module, not a tie."""
        tied: dict[str, list[str]] = {}
        for model, prefix in zip(self._models, self._prefixes):
            # (torch's own walks: a model may override them with older signatures, as
            # torchrl's LossModule does named_parameters)
            modules = dict(nn.Module.named_modules(model, prefix=prefix, remove_duplicate=False))
            first: dict[int, str] = {}
            for name, p in nn.Module.named_parameters(model, prefix=prefix,
                                                      remove_duplicate=False):
                if id(p) not in first:
                    first[id(p)] = name
                elif (modules.get(name.rpartition(".")[0])
                      is not modules.get(first[id(p)].rpartition(".")[0])):
                    tied.setdefault(first[id(p)], []).append(name)
        return tied

    def model_names(self) -> list[str]:
        """The names the recorded models' modules go under ("" the first model's)."""
        return list(self._prefixes)

    def module_names(self) -> set[str]:
        """The names of the recorded models' modules (a shared one's every name that calls
        are named by: see shared_module_aliases), and of the models."""
        return {*self._names.values(), *self._prefixes,
                *(name for aliases in self._aliases.values() for name in aliases.values())}

    def trainable_parameters(self) -> list[torch.Tensor]:
        """The recorded parameters that take gradients (not inference tensors)."""
        return [p for p in self._params.values() if p.requires_grad and not p.is_inference()]

    def parameter_ids(self) -> set[int]:
        """The ids of the parameters recorded."""
        return {id(p) for p in self._params.values()}

    def record_optimizer(self, optimizer: torch.optim.Optimizer | None,
                         stats: bool = False, call: int = 0) -> None:
        """Optimizer state (momentum buffers, steps) per parameter, and each group's lr (with
        stats when asked, as :meth:`record_parameters`); `call`: which of the step's
        optimizers it is (a GAN's two each have a group 0)."""
        if optimizer is None:
            return
        names = {id(p): name for name, p in self._params.items()}
        keys, tensors = [], []
        for gi, group in enumerate(optimizer.param_groups):
            keys.append((OPTIMIZER, "", call, f"lr.{gi}"))
            tensors.append(torch.tensor(float(group["lr"]), dtype=torch.float64))
            for param in group["params"]:
                state = optimizer.state.get(param)
                if not state:
                    continue
                owner, _, local = names.get(id(param), f"?.{gi}").rpartition(".")
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, (int, float)):  # (a count: Adam's step, at times)
                        value = torch.tensor(float(value), dtype=torch.float64)
                    for path, tensor in iter_tensors(value):  # (LBFGS keeps lists of them)
                        keys.append((OPTIMIZER, owner, call,
                                     slot_name(f"state.{local}.{key}", path)))
                        tensors.append(tensor)
        self._keys += keys
        self.fp.add_many(tensors, stats=stats)

    def _record_per_parameter(
        self, phase: str, stats: bool, items: list[tuple[str, torch.Tensor]], call: int = 0,
        written: bool = False,
    ) -> None:
        """One tensor per named parameter, keyed (phase, owning module, call, param.<name>);
        `written`: see Fingerprinter.add_many."""
        self._keys += _parameter_keys(phase, items, call=call)
        self.fp.add_many([t for _, t in items], stats, written=written)

    # -- forward hooks -------------------------------------------------------------------
    def _elsewhere(self, node: Any) -> bool:
        """A call in another thread than the step's, but for autograd's (a checkpoint
        recomputing in backward): the loop's evaluation run in the background."""
        return node is None and threading.get_ident() != self._thread

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        node = torch._C._current_autograd_node()
        if self._elsewhere(node):
            return
        name = self._names.get(id(module), type(module).__name__)
        parent = self._stack[-1][0] if self._stack else -1
        if parent >= 0 and self._calls[parent].backward_node is not node:
            parent = -1  # begun anew in backward (or after it), not in the calls left open
        if parent >= 0 and (aliases := self._aliases.get(id(module))) is not None:
            name = aliases.get(self._calls[parent].module, name)  # (named where it ran)
        # (a recomputation is run by an autograd Function's backward, as a reentrant
        # checkpoint's; a non-reentrant one recomputes from a built-in node: new calls)
        original = (self._recomputes(name, node, parent)
                    if isinstance(node, BackwardCFunction) else -1)
        if original >= 0:
            index = self._calls[original].index
        else:
            index = self._counts.get(name, 0)
            self._counts[name] = index + 1
            if node is None:
                self._seq_index = None
        position = len(self._calls)
        call = Call(name, index, parent, seq_start=_get_sequence_nr(), backward_node=node,
                    original=original)
        if self._call_index is not None:  # (kept up to date once a recomputation needed it)
            index_call(self._call_index, position, call)
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            inputs: Any = (("0", args[0]),)  # the common case, without walking the structure
        else:
            inputs = _iter_inputs(args, kwargs)
        recording = self._records_modules
        for path, tensor in inputs if recording else ():
            if original < 0:  # a recomputation's forward records would be its original's
                self._keys.append((FORWARD, name, index, f"in.{path}"))
                self.fp.add(tensor)
            if tensor.requires_grad:
                edge = (tensor.grad_fn, tensor.output_nr) if tensor.grad_fn else (tensor, 0)
                call.inputs.setdefault((id(edge[0]), edge[1]), path)
                call.edge_objects.append(edge[0])
                self._note_read(call, tensor)
        self._calls.append(call)
        rng = _module_rng_state() if self.track_rng and recording and original < 0 else None
        host = _host_rng_state() if self.watch_host_rng else None
        self._stack.append((len(self._calls) - 1, rng, host))

    def _note_read(self, call: Call, tensor: torch.Tensor) -> None:
        """Where input `tensor` is a recorded model's parameter, or a view or copy of one
        made by a short chain of one-input ops (HF's DETR passes
        `query_position_embeddings.weight.unsqueeze(0).repeat(...)`), note its module as
        read by `call`."""
        param: Any = tensor
        node = tensor.grad_fn
        for _ in range(_READ_HOPS):
            if node is None:
                break
            # (known by its type: a custom Function's ctx may hold a `variable` of its own)
            if type(node).__name__ == "AccumulateGrad":
                param = node.variable
                break
            param = None
            inputs = [f for f, _ in node.next_functions if f is not None]
            node = inputs[0] if len(inputs) == 1 else None
        if not isinstance(param, nn.Parameter):
            return
        if self._param_owners is None:
            self._param_owners = {id(p): name.rpartition(".")[0]
                                  for name, p in self._params.items()}
        owner = self._param_owners.get(id(param))
        if owner is not None and owner not in call.reads:
            call.reads.append(owner)

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._stack or self._elsewhere(torch._C._current_autograd_node()):
            return None
        position, rng_before, host_before = self._stack.pop()
        call = self._calls[position]
        if host_before is not None and _host_rng_state() != host_before:
            self.host_draws.add((call.module, call.index))
        call.seq_end = _get_sequence_nr()
        if call.backward_node is None:
            self._seq_index = None
        replaced, computed = None, output
        fault = self.fault
        if (
            fault is not None and fault.phase == FORWARD and fault.step == self._step
            and fault.module == call.module and call.index == 0
        ):
            with _disable_current_modes():  # the fault's own ops are not the model's
                replaced, found = replace_first_float(output, next_ulp)
            if found:
                output, self.fault_fired = replaced, True
            else:
                replaced = None
        if call.original >= 0 and call.parent < 0:
            self._hook_recomputation(position, output)
        if not self._records_modules:
            return replaced
        outputs = list(_tensors_of(output))
        for path, tensor in outputs if call.original < 0 else ():
            self._keys.append((FORWARD, call.module, call.index, slot_name("out", path)))
            self.fp.add(tensor)
        # (the gradient of what the call computed, not of a planted fault's copy of it: the
        # copy's lacks the module's own use of its output, where it makes one, as effdet's
        # BiFPN cells do, and would differ from the other runs' by far more than the fault)
        for path, tensor in outputs if computed is output else _tensors_of(computed):
            if tensor.requires_grad and _computed_in(call, tensor):
                handle = tensor.register_hook(self._grad_out_hook(call, slot_name("grad_out", path)))
                self._step_handles.append(handle)
        if rng_before is not None:
            rng_after = _module_rng_state()
            if rng_after != rng_before:
                for slot, state in (("rng.in", rng_before), ("rng.out", rng_after)):
                    self._keys.append((FORWARD, call.module, call.index, slot))
                    self.fp.add_bytes(state)
        return replaced

    def _grad_out_hook(self, call: Call, slot: str):
        def hook(grad: torch.Tensor) -> None:
            with self._lock:  # backward across devices runs hooks on several threads
                self._keys.append(self.backward_key(call, slot))
                self.fp.add(grad)

        return hook


def _tensors_of(output: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """A call's output tensors by path (a lone tensor, the common case, without a walk)."""
    return (("", output),) if isinstance(output, torch.Tensor) else iter_tensors(output)


def _computed_in(call: Call, tensor: torch.Tensor) -> bool:
    """Whether output `tensor` was computed in `call` (its autograd node is no older than
    the call), not passed through from before it: an input returned as it is (effdet's
    resampling, where no resampling is needed), a parameter. The gradient of such a tensor
    sums every use of it, the module's or not: it is no gradient of the module's output."""
    node = tensor.grad_fn
    return node is not None and node._sequence_nr() >= call.seq_start


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile(model)`` wrapper holds: its names are the user's (the
    wrapper's have ``_orig_mod.`` in front), and the wrapper's call is the top-level one.
    (A wrapper exists only once torch's compiler is imported: nothing is imported here.)"""
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return model._orig_mod if wrapper is not None and isinstance(model, wrapper) else model


def shared_module_aliases(model: nn.Module, prefix: str) -> dict[int, dict[str, str]]:
    """The modules `model` holds under several names that hold no parameter and no buffer
    (one activation every block calls, as Ultralytics' ``Conv.default_act``): for each
    (by id), the name of each module holding it once -> the name it has there. A call of
    one is named by the module it ran in, not by its first name only; one with a parameter
    or a buffer keeps its first name, which its records go under."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, module in nn.Module.named_modules(model, prefix=prefix, remove_duplicate=False):
        found.setdefault(id(module), (module, []))[1].append(name)
    aliases: dict[int, dict[str, str]] = {}
    for key, (module, names) in found.items():
        if len(names) < 2 or any(True for _ in module.parameters()) or any(
                True for _ in module.buffers()):
            continue
        holders = [name.rpartition(".")[0] for name in names]
        aliases[key] = {holder: name for holder, name in zip(holders, names)
                        if holders.count(holder) == 1}
    return aliases


def module_call_names(model: nn.Module) -> list[str]:
    """The names the calls of `model`'s modules are recorded under: each module's first
    name, and a shared one's others (see shared_module_aliases)."""
    names = [name for name, _ in model.named_modules()]
    return names + [name for aliases in shared_module_aliases(model, "").values()
                    for name in aliases.values() if name not in names]


def _iter_inputs(args: tuple, kwargs: dict):
    """A call's input tensors: positional ones by index, keyword ones by name."""
    yield from iter_tensors(list(args))
    yield from iter_tensors(kwargs)


class _Hook:
    """One of the recorder's module hooks. A copy of the module (``copy.deepcopy(model)``
    for an EMA, ``torch.save`` of the whole module) takes a hook that does nothing: the
    copy is not the module recorded, and the recorder (its lock) cannot be copied."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _no_hook

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detached, ())


def _no_hook(*args: Any, **kwargs: Any) -> None:
    """What a copied module's hook of the recorder's becomes (see _Hook)."""


def _detached() -> Any:
    return _no_hook


def call_prints(module: str, call: int, args: tuple, kwargs: dict, output: Any
                ) -> list[tuple[RecordKey, TensorPrint]]:
    """The forward records of one call of a module no recorder hooks (a model the loop
    calls apart, see attach's SideModels), printed now: its inputs (``in.<i>``,
    ``in.<keyword>``) and output (``out``), for :meth:`Recorder.add_records` to add to a
    step's."""
    keys: list[RecordKey] = []
    tensors: list[torch.Tensor] = []
    inputs = [*((f"in.{i}", a) for i, a in enumerate(args)),
              *((f"in.{k}", v) for k, v in kwargs.items())]
    for slot, value in [*inputs, ("out", output)]:
        for path, tensor in iter_tensors(value):
            keys.append((FORWARD, module, call, slot_name(slot, path)))
            tensors.append(tensor)
    return _printed_aside(keys, tensors, stats=False)


def running_statistics(model: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The running statistics of the norm layers in `model` (BatchNorm, SyncBatchNorm, an
    InstanceNorm that tracks them), by buffer name -> their layer: the batch-norm kernel
    writes them in place without moving their version counter, so a layer in training mode
    has written them in every call."""
    return {f"{name}.{stat}".lstrip("."): layer
            for name, layer in model.named_modules(prefix=prefix)
            if isinstance(layer, nn.modules.batchnorm._NormBase) and layer.track_running_stats
            for stat in ("running_mean", "running_var")
            if isinstance(getattr(layer, stat, None), torch.Tensor)}


def printed_now(value: Any, algorithm: str | None = None, stats: bool = True
                ) -> list[tuple[str, TensorPrint]]:
    """Every tensor in `value` printed now, apart from any step, by its path: a batch as the
    DataLoader yielded it, before the loop changes it in place (a Mixup), for
    :meth:`Recorder.add_printed` to add to the step it feeds."""
    leaves = list(iter_tensors(value))
    return _printed_aside([path for path, _ in leaves], [t for _, t in leaves], stats=stats,
                          algorithm=algorithm)


def _printed_aside(keys: list[Any], tensors: list[torch.Tensor], stats: bool,
                   algorithm: str | None = None) -> list[tuple[Any, TensorPrint]]:
    """`tensors` printed now, apart from the step's own fingerprinter (fetched at once), as
    records `keys` for :meth:`Recorder.add_records`."""
    fp = Fingerprinter(stats=stats, algorithm=algorithm)
    with _disable_current_modes():  # (an op-level step's mode: these ops are not the model's)
        fp.add_many(tensors, stats)
        prints = fp.collect()
    return list(zip(keys, prints))


def _sharded_by_fsdp1(models: list[nn.Module]) -> set[int]:
    """The ids of the parameters that FSDP1 modules (``FullyShardedDataParallel``) in
    `models` hold sharded: each module's own (not those of the FSDP modules inside it),
    unless its strategy is NO_SHARD or its shard group has one rank."""
    wrapped = [m for root in models for m in root.modules()
               if _is_fsdp_class(m, "FullyShardedDataParallel")]
    held: set[int] = set()
    for fsdp in wrapped:
        strategy = getattr(fsdp, "sharding_strategy", None)
        if getattr(strategy, "name", "") == "NO_SHARD" or getattr(fsdp, "world_size", 2) < 2:
            continue
        inner = {id(p) for m in fsdp.modules()
                 if m is not fsdp and _is_fsdp_class(m, "FullyShardedDataParallel")
                 for p in m.parameters()}
        held |= {id(p) for p in fsdp.parameters()} - inner
    return held


def _is_fsdp_class(module: nn.Module, name: str) -> bool:
    """Whether `module` is an instance of torch's FSDP class `name` (FSDP2's ``FSDPModule``,
    FSDP1's ``FullyShardedDataParallel``), found by name: FSDP is imported only where used."""
    return any(c.__name__ == name and c.__module__.startswith("torch.distributed")
               for c in type(module).__mro__)


def _is_shard(t: Any) -> bool:
    """Whether `t` is a DTensor placed as a shard on some dimension of its device mesh."""
    return _shard_dims(t) > 0


def _is_partial(t: Any) -> bool:
    """Whether `t` is a DTensor holding a partial sum on some dimension of its mesh."""
    return any(getattr(placement, "is_partial", lambda: False)()
               for placement in getattr(t, "placements", None) or ())


def _shard_dims(t: Any) -> int:
    """On how many dimensions of its device mesh a DTensor is placed as a shard."""
    return sum(1 for placement in getattr(t, "placements", None) or ()
               if getattr(placement, "is_shard", lambda: False)())


def _parameter_keys(phase: str, items: list[tuple[str, Any]], kind: str = "param",
                    call: int = 0) -> list[RecordKey]:
    """The keys of per-parameter (or per-buffer) records: (phase, owning module, `call`,
    <kind>.<name>)."""
    return [(phase, owner, call, f"{kind}.{local}")
            for owner, _, local in (name.rpartition(".") for name, _ in items)]
