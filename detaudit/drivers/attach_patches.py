"""The torch entry points an attachment patches to see a loop it does not run (see
:mod:`.attach`).

Global module and optimizer hooks do not show everything a step is made of: which tensor is
the loss (``Tensor.backward``, ``torch.autograd.backward``), which DataLoader pass and batch
the step belongs to (``DataLoader.__iter__``, its iterators' ``__next__``), a skipped update
(``GradScaler.update``), compiled code (``torch.compile``, ``Module.compile``) and, in one rank
of a distributed command, the parameters as built (``DistributedDataParallel.__init__``).
Each wrapper here calls the original and calls back into the attachment (the
:class:`Callbacks` it is made for); a warning torch aims at the caller of a wrapped function
is shown at the user's line, not at the wrapper (:func:`shown_past_wrappers`), and a
script's error is shown without the wrappers it passed through (:func:`without_wrappers`).
:class:`Installing`, a part of the attachment (a mixin), puts them and the global hooks in
and takes them out again.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch import nn

from ..record.oprecorder import outside_the_steps_ops
from .rankprobe import RankWatch

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Self


class Callbacks(Protocol):
    """What the wrappers call back into (an :class:`.attach.Attachment`)."""

    in_backward: bool
    making_iterator: int  # DataLoader.__iter__ calls under way (see _begin_pass_outside_iter)
    # a DataLoader iterator -> its pass: (its loader's id, the loader's pass number)
    _iterators: weakref.WeakKeyDictionary[Any, tuple[int, int]]
    loader_iterators: weakref.WeakSet[Any]  # every DataLoader iterator made, while alive

    def on_backward(self, tensor: Any) -> None: ...
    def after_backward(self) -> None: ...
    def on_loader_pass(self, loader: Any) -> tuple[int, int]: ...
    def on_loader_iter(self, loader: Any) -> None: ...
    def on_loader_batch(self, iterator: Any, batch: Any, fetched_by: Any = None) -> None: ...
    def on_loader_exhausted(self, iterator: Any) -> None: ...
    def on_scaler_update(self, scaler: Any) -> None: ...
    def on_manual_seed(self, frame: Any, seed: Any) -> None: ...
    def on_parameter_made(self, module: Any, name: str, param: Any) -> None: ...
    def on_zero_grad(self, owner: Any) -> None: ...
    def keep_out_of_graphs(self) -> None: ...
    def see_compiled_calls(self, module: nn.Module) -> None: ...


_compiling = torch.compiler.is_compiling
_functorch_level = getattr(torch._C._functorch, "maybe_current_level", lambda: None)


def transformed() -> bool:
    """Whether code runs inside a graph torch.compile traces, inside a torch.func transform
    (grad, vmap: its tensors are wrappers without storage) or under torch.jit.trace (its
    sizes are traced values): a module called there is a step of a function, or the
    tracing of a module, not a training call of the loop."""
    return _compiling() or _functorch_level() is not None or torch.jit.is_tracing()


LoaderIterator = torch.utils.data.dataloader._BaseDataLoaderIter


def wrap_backward(attachment: Callbacks) -> Callable[..., Any]:
    return _backward_entry(attachment, torch.Tensor.backward, "self")


def wrap_autograd_backward(attachment: Callbacks) -> Callable[..., Any]:
    return _backward_entry(attachment, torch.autograd.backward, "tensors")


def _backward_entry(attachment: Callbacks, original: Callable[..., Any], first: str
                    ) -> Callable[..., Any]:
    """`original` (a way into backward), telling the attachment what backward is called on
    (its argument `first`: a tensor or a sequence of them) before, and that it ended after."""

    def backward(*args: Any, **kwargs: Any) -> Any:
        # inside a backward (Tensor.backward calls torch.autograd.backward; checkpointing),
        # or traced (torch.compile keeps it out of its graphs once anything is compiled:
        # see Attachment.keep_out_of_graphs)
        if attachment.in_backward or transformed():
            return original(*args, **kwargs)
        tensors = args[0] if args else kwargs.get(first)
        for tensor in [tensors] if isinstance(tensors, torch.Tensor) else tensors or ():
            attachment.on_backward(tensor)
        attachment.in_backward = True
        try:
            result = original(*args, **kwargs)
        finally:
            attachment.in_backward = False
        attachment.after_backward()
        return result

    return backward


def wrap_manual_seed(attachment: Callbacks) -> Callable[..., Any]:
    original = torch.random.manual_seed

    @functools.wraps(original)
    def manual_seed(seed: Any) -> Any:
        attachment.on_manual_seed(sys._getframe(1), seed)
        return original(seed)

    return manual_seed


def wrap_loader_iter(attachment: Callbacks) -> Callable[..., Any]:
    original = torch.utils.data.DataLoader.__iter__

    def __iter__(self: Any) -> Any:
        started = _begin_pass(attachment, self)
        attachment.making_iterator += 1
        try:
            iterator = original(self)
        finally:
            attachment.making_iterator -= 1
        _follow(attachment, iterator, started)
        return iterator

    return __iter__


def wrap_loader_iterator_init(attachment: Callbacks) -> Callable[..., Any]:
    """Every DataLoader iterator is kept (weakly) while it lives, for its workers to be
    ended with the process (see attach_process); one made outside ``DataLoader.__iter__``
    (a loader of its own that calls ``_get_iterator``, as Ultralytics' does) begins a pass
    as well."""
    original = LoaderIterator.__init__

    @functools.wraps(original)
    def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        original(self, loader, *args, **kwargs)
        with contextlib.suppress(TypeError):  # (a subclass that takes no weak reference)
            attachment.loader_iterators.add(self)
        _begin_pass_outside_iter(attachment, self, loader)

    return __init__


def wrap_loader_iterator_reset(attachment: Callbacks) -> Callable[..., Any]:
    """An exhausted DataLoader iterator made to serve a pass again outside
    ``DataLoader.__iter__`` (a loader of its own that resets it itself) begins a pass."""
    original = LoaderIterator._reset

    @functools.wraps(original)
    def _reset(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        loader = args[0] if args else kwargs.get("loader")
        first = args[1] if len(args) > 1 else kwargs.get("first_iter", False)
        if loader is not None and not first:  # (as it is made: see the __init__ above)
            _begin_pass_outside_iter(attachment, self, loader)

    return _reset


def _begin_pass_outside_iter(attachment: Callbacks, iterator: Any, loader: Any) -> None:
    if not attachment.making_iterator:  # (DataLoader.__iter__ begins its own passes)
        _follow(attachment, iterator, _begin_pass(attachment, loader))


def _begin_pass(attachment: Callbacks, loader: Any) -> tuple[int, int]:
    """`loader` begins a pass: which one (see Epochs.on_loader_pass)."""
    follow_passes_of(type(loader))
    return attachment.on_loader_pass(loader)


def _follow(attachment: Callbacks, iterator: Any, started: tuple[int, int]) -> None:
    """The batches `iterator` yields are those of the pass `started`."""
    with contextlib.suppress(TypeError):  # an iterator that takes no weak reference
        attachment._iterators[iterator] = started


# The attachments installed now, innermost last: a DataLoader class's own __iter__, wrapped
# once while any is installed (see follow_passes_of), tells each of them.
_INSTALLED: list[Callbacks] = []
_OWN_ITERS: dict[type, Callable[..., Any]] = {}  # the classes wrapped, and their __iter__


def follow_passes_of(loader_class: type) -> None:
    """A DataLoader class with an ``__iter__`` of its own may serve every pass from one
    iterator (see Epochs.on_loader_iter): its ``__iter__`` is wrapped until the last
    attachment is uninstalled."""
    owner = next(c for c in loader_class.__mro__ if "__iter__" in vars(c))
    if owner is torch.utils.data.DataLoader or owner in _OWN_ITERS:
        return
    own = _OWN_ITERS[owner] = vars(owner)["__iter__"]

    @functools.wraps(own)
    def __iter__(self: Any) -> Any:
        for attachment in _INSTALLED:
            attachment.on_loader_iter(self)
        return own(self)

    owner.__iter__ = __iter__


def _unwrap_own_iters() -> None:
    for owner, own in _OWN_ITERS.items():
        owner.__iter__ = own
    _OWN_ITERS.clear()


def wrap_loader_next(attachment: Callbacks) -> Callable[..., Any]:
    original = LoaderIterator.__next__

    def __next__(self: Any) -> Any:
        try:
            with outside_the_steps_ops():
                batch = original(self)
        except StopIteration:
            attachment.on_loader_exhausted(self)
            raise
        attachment.on_loader_batch(self, batch, sys._getframe(1).f_code)  # (who asked)
        return batch

    return __next__


def _wrap_ddp_init(rank: RankWatch) -> Callable[..., Any]:
    """DDP's constructor broadcasts rank 0's parameters: note this rank's as built first."""
    original = torch.nn.parallel.DistributedDataParallel.__init__

    def __init__(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if rank.init is None and isinstance(module, nn.Module):
            rank.record_init(module)
        original(self, module, *args, **kwargs)

    return __init__


def wrap_torch_compile(attachment: Callbacks) -> Callable[..., Any]:
    original = torch.compile

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        attachment.keep_out_of_graphs()
        return original(*args, **kwargs)

    return compile


def wrap_module_compile(attachment: Callbacks) -> Callable[..., Any]:
    original = nn.Module.compile

    def compile(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        attachment.see_compiled_calls(self)

    return compile


def wrap_zero_grad(attachment: Callbacks, owner: type) -> Callable[..., Any]:
    """`owner.zero_grad` (an optimizer's or a module's), telling the attachment first."""
    original = owner.zero_grad

    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        attachment.on_zero_grad(self)
        return original(self, *args, **kwargs)

    return zero_grad


def wrap_scaler_update(attachment: Callbacks) -> Callable[..., Any]:
    original = torch.amp.GradScaler.update

    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        attachment.on_scaler_update(self)
        return result

    return update


class Installing:
    """Putting the global hooks and the wrappers above into torch, and taking them out:
    mixed into :class:`.attach.Attachment` (whose hooks they call)."""

    def install(self) -> Self:
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
            _register_global_post(self._global_post),
        ]
        self._handles += [register_optimizer_step_pre_hook(self._before_update),
                          register_optimizer_step_post_hook(self._after_update)]
        self._patch(torch.Tensor, "backward", wrap_backward(self))
        self._patch(torch.autograd, "backward", wrap_autograd_backward(self))
        self._patch(torch.utils.data.DataLoader, "__iter__", wrap_loader_iter(self))
        self._patch(LoaderIterator, "__next__", wrap_loader_next(self))
        self._patch(LoaderIterator, "__init__", wrap_loader_iterator_init(self))
        self._patch(LoaderIterator, "_reset", wrap_loader_iterator_reset(self))
        self._patch(torch.amp.GradScaler, "update", wrap_scaler_update(self))
        self._patch(torch.optim.Optimizer, "zero_grad",
                    wrap_zero_grad(self, torch.optim.Optimizer))
        self._patch(nn.Module, "zero_grad", wrap_zero_grad(self, nn.Module))
        self._patch(nn.Module, "compile", wrap_module_compile(self))
        self._patch(torch, "compile", wrap_torch_compile(self))
        seeding = wrap_manual_seed(self)
        self._patch(torch, "manual_seed", seeding)
        self._patch(torch.random, "manual_seed", seeding)
        self._handles.append(nn.modules.module.register_module_parameter_registration_hook(
            self.on_parameter_made))
        for module in self.model.modules() if self.model is not None else ():
            if getattr(module, "_compiled_call_impl", None) is not None:  # compiled before
                self.see_compiled_calls(module)
        # torch.compile(model) warns that global hooks fire for its wrapper too: the wrapper
        # is the top-level call, the module it wraps a call inside it
        warnings.filterwarnings("ignore", message=re.escape(
            "Using `torch.compile(module)` when there are global hooks"))
        if hasattr(warnings, "_showwarnmsg"):
            self._patch(warnings, "_showwarnmsg", shown_past_wrappers(warnings._showwarnmsg))
        if self.rank is not None:
            self._watch_ddp_init(self.rank)
        _INSTALLED.append(self)
        self.installed = True
        return self

    def _watch_ddp_init(self, rank: RankWatch) -> None:
        """Note `rank`'s parameters as built when DDP wraps them (before its broadcast)."""
        self._patch(torch.nn.parallel.DistributedDataParallel, "__init__", _wrap_ddp_init(rank))

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
        if self in _INSTALLED:
            _INSTALLED.remove(self)
        if not _INSTALLED:
            _unwrap_own_iters()
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
                self._global_post(module, args, None, kwargs)
                raise
            replaced = self._global_post(module, args, output, kwargs)
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
        original = getattr(owner, name)
        setattr(owner, name, replacement)  # (first: one that cannot be set is not undone)
        self._patches.append((owner, name, original))
        code = getattr(replacement, "__code__", None)
        if code is not None and code.co_filename.startswith(_PACKAGE):
            WRAPPERS.add(code)  # (see shown_past_wrappers)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
WRAPPERS: set[Any] = set()  # the code of the wrappers put into torch (and os, sys)


def shown_past_wrappers(show: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``warnings._showwarnmsg`` that moves a warning torch (or any library) aims at its
    caller (``stacklevel``) from the detaudit wrapper that called it to the code that called
    the wrapper: ``torch.load``'s or a DataLoader's warnings then name the user's line, as
    they do without detaudit. detaudit's own warnings, and those a library gives detaudit's
    other code (a hook's), stay where they are."""

    def _showwarnmsg(message: Any) -> Any:
        if str(message.filename).startswith(_PACKAGE):
            caller = _past_wrappers(sys._getframe(1), message.filename, message.lineno)
            if caller is not None:
                message.filename, message.lineno = caller.f_code.co_filename, caller.f_lineno
                message.line = None  # read again from the new place
        return show(message)

    return _showwarnmsg


def without_wrappers(tb: Any) -> Any:
    """Traceback `tb` without the frames of detaudit's wrappers that the error passed
    through (``torch.load``'s, ``backward``'s): a script's own error is shown as it is
    without detaudit. A wrapper's frame the error was raised in stays."""
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code in WRAPPERS:
        tb = tb.tb_next
    entry = tb
    while entry is not None:
        after = entry.tb_next
        while after is not None and after.tb_next is not None and after.tb_frame.f_code in WRAPPERS:
            after = after.tb_next
        entry.tb_next, entry = after, after
    return tb


def _past_wrappers(frame: Any, filename: str, lineno: int) -> Any:
    """The first frame outside detaudit that called the wrapper a warning is shown at, or
    None where detaudit itself warned, the frame is not a wrapper's (not on the stack)."""
    while frame is not None and frame.f_globals.get("__name__") == "warnings":
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_PACKAGE):
        return None
    while frame is not None and (frame.f_code.co_filename, frame.f_lineno) != (filename, lineno):
        frame = frame.f_back
    if frame is None or frame.f_code not in WRAPPERS:
        return None
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return frame


def _register_global_post(hook: Callable[..., Any]) -> Any:
    """The global forward hook, always called, given the call's keyword arguments where
    torch passes them to global hooks (2.6 and later)."""
    register = nn.modules.module.register_module_forward_hook
    if "with_kwargs" not in inspect.signature(register).parameters:
        return register(hook, always_call=True)

    def with_kwargs(module: nn.Module, args: tuple, *rest: Any) -> Any:
        # (kwargs, output); after a call that raised, torch gives the output alone
        return hook(module, args, rest[-1], rest[0] if len(rest) == 2 else None)

    return register(with_kwargs, always_call=True, with_kwargs=True)
