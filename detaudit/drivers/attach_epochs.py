"""Which data a step of an attached loop is fed, and which epoch it is in (see :mod:`.attach`).

Each DataLoader iterator knows its pass (its loader, the loader's pass number). The pass that
fed the first step is epoch 0; a later pass of its loader, or, once that pass is over, a pass
of another loader (one built anew for the epoch), is the next epoch; a pass that feeds no step
(a peek at one batch, an evaluation over the training data) counts for nothing. The training
loader's batches are step state (labels a loss takes outside the model are in them), and a
call without gradients that no training batch was fetched for is an evaluation, not a step.

:class:`Epochs` is a part of :class:`.attach.Attachment` (a mixin): it works on the
attachment's state (its open step, its recorder) as the rest of the class does.
"""

from __future__ import annotations

import threading
from types import CodeType
from typing import Any, NamedTuple

import torch
from torch import nn

from ..config import LOADER_IN_A_THREAD
from ..record.recorder import WATCH_MODULE, printed_now
from ..record.sites import in_an_installed_package
from ..trace import LOADER_BATCH, STATE
from .rankprobe import sampler_snapshot

_WAITING_UNPRINTED = 4  # batches of another loader than the training one, kept as they are
_WAITING_PRINTED = 4096  # prints of training batches that wait (a step of many micro-batches)


class Waiting(NamedTuple):
    """A batch a loader yielded, waiting for the step it feeds (see `_file_loader_batches`)."""

    pass_: tuple[int, int]  # (its loader's id, the loader's pass number)
    batch: Any  # its prints, or itself (another loader's: printed only if a step takes it)
    printed: bool
    by_library: bool  # fetched by library code, which may fetch ahead of the loop
    thread: int


def _may_fetch_ahead(fetched_by: CodeType | None) -> bool:
    """Whether the code that asked the DataLoader for a batch may be a wrapper that fetches
    ahead of the loop (accelerate's loader): library code. The loop's own code is taken at
    its word (a generator of its own that takes two batches a step fetches two before its
    first step, and ahead of nothing)."""
    return fetched_by is not None and in_an_installed_package(fetched_by.co_filename)


def _named(function: Any) -> str | None:
    """A function as a report names it: ``name at file:line``; None for none."""
    if function is None:
        return None
    inner = getattr(function, "func", function)  # (a functools.partial)
    name = getattr(inner, "__qualname__", type(inner).__name__)
    code = getattr(inner, "__code__", None)
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name


class Epochs:
    """The DataLoader callbacks, the epoch of a step and whether a call is an evaluation:
    mixed into :class:`.attach.Attachment`."""

    @property
    def _train_loader(self) -> int | None:
        return self._train_pass[0] if self._train_pass is not None else None

    def on_loader_pass(self, loader: Any) -> tuple[int, int]:
        """A DataLoader starts a pass over its data: which one it is. (The epoch limit ends
        the run as the next epoch's first step begins, not here: a pass over the training
        loader that feeds no step, `update_bn`'s after the last epoch, is no epoch.)"""
        key = id(loader)
        self._passes[key] = self._passes.get(key, 0) + 1
        self._latest_loader = key
        if self.max_epochs is not None and key not in self._pass_lengths:
            try:
                self._pass_lengths[key] = len(loader)
            except Exception:  # noqa: BLE001 -- an iterable dataset's loader, a len that fails
                self._pass_lengths[key] = None
        if getattr(loader, "num_workers", 0) and key not in self._loader_workers:
            self._loader_workers[key] = {"workers": loader.num_workers,
                                         "worker_init_fn": _named(loader.worker_init_fn)}
        if self.rank is not None:
            self._samplers.setdefault(key, []).append(
                {"epoch": self._passes[key] - 1, "sampler": sampler_snapshot(loader)})
        return key, self._passes[key]

    def on_loader_iter(self, loader: Any) -> None:
        """The ``__iter__`` of a DataLoader class of its own is called: it may serve every
        pass from one iterator that never ends (Ultralytics' InfiniteDataLoader, timm's
        MultiEpochsDataLoader), so a batch that iterator yields after this begins a new pass
        (see on_loader_batch; attach_patches.follow_passes_of)."""
        self._iter_called[id(loader)] = (loader, self._passes.get(id(loader), 0))

    def _pass_open(self, loader: int) -> bool:
        """Whether an iterator of `loader` is alive and not exhausted."""
        return any(key == loader for key, _ in self._iterators.values())

    def on_loader_exhausted(self, iterator: Any) -> None:
        """A DataLoader iterator ran out: its pass is over. The training pass over, after
        the open step's update, the step's code is over too: a failure from then on (in an
        evaluation, saving the results) is not the step's."""
        started = self._iterators.pop(iterator, None)
        if started is not None and self.max_epochs is not None:  # (see _first_pass_unfinished)
            self._passes_ended.add(started)
        if started is not None and started == self._train_pass:
            if self.info is not None and self._updated and not self._moved_on:
                self._record_optimizers_at_epoch_end()
            self._moved_on = self._moved_on or (self.info is not None and self._updated)

    def _record_optimizers_at_epoch_end(self) -> None:
        """The open step is the epoch's last: the state of the optimizers that updated in it
        (momentum, moments), as a scan keeps it once an epoch; a zoomed step has it already.
        Not where a thread of its own iterates the loader: when its pass ends is a race."""
        if self.recorder is None or self.info is None or self._watch(self.info.step) == (
                WATCH_MODULE) or self.trace.probe.get(LOADER_IN_A_THREAD) or (
                not self._in_the_loops_thread()):
            return
        for n, ref in enumerate(self._stepped.values()):
            if (optimizer := ref()) is not None:
                self.recorder.record_optimizer(optimizer, call=n)

    def on_loader_batch(self, iterator: Any, batch: Any, fetched_by: CodeType | None = None
                        ) -> None:
        """A DataLoader iterator yielded `batch` (asked for by the code `fetched_by`). The
        training loader's batches are step state beside what the model is called with:
        labels that a loss takes outside the model are in them. Each is printed as yielded
        (the loop may change it in place; another loader's, an evaluation's, only if a step
        takes it) and waits for the step it feeds (see :meth:`_file_loader_batches`). A
        loader iterated in another thread than the loop's (a prefetching thread) is not
        followed: when its batches are taken is a race; nor, from then on, is any other
        (see :meth:`_unfollow_loaders`)."""
        started = self._iterators.get(iterator)
        if started is None or self.trace.probe.get(LOADER_IN_A_THREAD):
            return
        if not self._in_the_loops_thread():
            self._unfollow_loaders()
            return
        self._moved_on = self._moved_on or (self.info is not None and self._updated)
        called = self._iter_called.pop(started[0], None)
        if called is not None and started[1] <= called[1]:  # its old iterator serves a new pass
            del self._iterators[iterator]
            started = self._iterators[iterator] = self.on_loader_pass(called[0])
        self._yielded = started
        if self.max_epochs is not None:  # (see _first_pass_unfinished)
            self._pass_batches[started] = self._pass_batches.get(started, 0) + 1
        loader = started[0]
        if self.info is not None and not self._updated:
            self._step_loaders.add(loader)
        self._fed = self._fed or loader in self._step_loaders
        if self.stopped:
            return
        step_open = self.info is not None and not self._updated
        if step_open and loader != (self._train_loader or self._latest_loader):
            return  # (which loader is the step's is decided as a step begins: see _epoch)
        # printed now unless it is another loader's than the training one (an evaluation's:
        # kept as it is, printed only if a step takes it: a loader built anew for an epoch)
        printed = loader == (self._train_loader or loader)
        if not printed:
            unprinted = [w for w in self._waiting if not w.printed]
            if len(unprinted) >= _WAITING_UNPRINTED:
                self._waiting.remove(unprinted[0])
        elif len(self._waiting) >= _WAITING_PRINTED:
            del self._waiting[0]
        self._waiting.append(Waiting(started, printed_now(batch, "xxh3") if printed else batch,
                                     printed, _may_fetch_ahead(fetched_by),
                                     threading.get_ident()))

    def _in_the_loops_thread(self) -> bool:
        """Whether this is the loop's thread, or may be (before its first step). A loader
        iterated in another thread (a prefetching thread) is not followed: when the loop
        takes its batches is a race, so neither are its batches filed nor its passes counted
        as epochs (a stop there would end each run after another number of steps)."""
        return not self._loop_thread_known or threading.get_ident() == self._loop_thread

    def _keep_the_loops_batches(self) -> None:
        """The loop's thread is known (its first step begins): batches other threads fetched
        before are not followed (see on_loader_batch)."""
        if any(w.thread != self._loop_thread for w in self._waiting):
            self._unfollow_loaders()

    def _unfollow_loaders(self) -> None:
        """A loader is iterated in another thread than the loop's: which loader feeds the
        steps can no longer be told (an evaluation loader the loop iterates itself between
        epochs would be taken for it, its batches filed in training steps and its passes
        counted as epochs), so from now on no loader's batches are filed and no pass is an
        epoch. The model's inputs are still recorded."""
        self.trace.probe[LOADER_IN_A_THREAD] = True
        self._waiting = []

    def _file_loader_batches(self) -> None:
        """The open step has taken its batches (it updates, or its call, in inference, ends):
        it is filed the training batches that wait, but the newest `_fetched_ahead` of a
        pass not over yet, which a wrapper fetched ahead of the loop for the next steps
        (accelerate's loader, and the Hugging Face Trainer through it). How far ahead is
        learnt as the first step takes its batches: the training batches fetched by then,
        library code among those who asked, beyond the step's training calls (the Trainer
        fetches a step's every micro-batch before its first, and one more)."""
        if self.recorder is None:
            return
        training = [w for w in self._waiting if w.pass_ == self._train_pass]
        if self._fetched_ahead is None and training:  # (a model called inside compiled
            # code makes no call seen: it took one batch all the same)
            self._fetched_ahead = max(0, len(training) - max(self._batches, 1)) if any(
                w.by_library for w in training) else 0
        live = set(self._iterators.values())
        ahead = self._fetched_ahead or 0
        held = [w for w in training[max(0, len(training) - ahead):] if w.pass_ in live]
        for waiting in training[:len(training) - len(held)]:
            self.recorder.add_printed(
                STATE, "", self._fetched, LOADER_BATCH,
                waiting.batch if waiting.printed else printed_now(waiting.batch, "xxh3"))
            self._fetched += 1
        # (those of another pass still going on wait: the next step may be fed by it, a
        # loader built anew for the epoch; see _epoch)
        self._waiting = [w for w in self._waiting
                         if w.pass_ != self._train_pass and w.pass_ in live] + held

    def set_epoch(self, epoch: int) -> None:
        """The user said which epoch the next steps belong to (``w.epoch(i)``)."""
        self.explicit_epoch = epoch

    def _epoch(self) -> int:
        """The epoch of the step about to begin, as the user said (``w.epoch``), or counted
        in the passes over data that feed steps: the pass that fed the first step is epoch
        0; a later pass of its loader, or, once that pass is over, a pass of another loader
        (one built anew for the epoch), begins the next. A pass that feeds no step (a peek at
        one batch, an evaluation over the training data) counts for nothing."""
        fed, now = self._yielded, self._train_pass
        if fed is not None and now is None:
            self._train_pass = fed
        elif fed is not None and now is not None and fed != now and (
                fed[1] > now[1] if fed[0] == now[0] else not self._pass_open(now[0])):
            self._train_pass = fed
            self._epochs_fed += 1
        return self.explicit_epoch if self.explicit_epoch is not None else self._epochs_fed

    def _evaluating(self, module: nn.Module) -> bool:
        """A call of `module` in training mode without gradients that would begin a step,
        though no loader that feeds steps yielded a batch for it (the loop evaluates on a
        validation loader or tensors after an update, having forgot ``eval()``): no step
        begins (a pseudo-labelling call on the next step's own batch still begins one).
        With no loader feeding steps, only a call of the model, in a loop that trains no
        other, is taken for an evaluation (a GAN's generator, called without gradients to
        make the fakes of its discriminator's step, begins that step)."""
        if torch.is_grad_enabled() or not (self.info is None or self._updated):
            return False
        if self._step_loaders:
            return not self._fed
        return module is self.models.current() and not self.models.others
