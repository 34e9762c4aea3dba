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

from types import CodeType
from typing import Any

import torch

from ..record.recorder import printed_now
from ..trace import LOADER_BATCH, STATE
from .rankprobe import sampler_snapshot
from .runner import in_a_library

_WAITING = 4  # training loader batches kept for a step not begun yet (a prefetching loop's)


def _may_fetch_ahead(fetched_by: CodeType | None) -> bool:
    """Whether the code that asked the DataLoader for a batch may be a wrapper that fetches
    ahead of the loop (accelerate's loader): library code. The loop's own code is taken at
    its word (a generator of its own that takes two batches a step fetches two before its
    first step, and ahead of nothing)."""
    return fetched_by is not None and in_a_library(fetched_by.co_filename)


class Epochs:
    """The DataLoader callbacks, the epoch of a step and whether a call is an evaluation:
    mixed into :class:`.attach.Attachment`."""

    @property
    def _train_loader(self) -> int | None:
        return self._train_pass[0] if self._train_pass is not None else None

    def on_loader_pass(self, loader: Any) -> tuple[int, int]:
        """A DataLoader starts a pass over its data: which one it is. The last epoch's pass
        over, a new pass of the training loader ends the run at the epoch limit."""
        key = id(loader)
        self._passes[key] = self._passes.get(key, 0) + 1
        self._latest_loader = key
        if self.rank is not None:
            self._samplers.setdefault(key, []).append(
                {"epoch": self._passes[key] - 1, "sampler": sampler_snapshot(loader)})
        if (key == self._train_loader and self.max_epochs is not None and not self.stopped
                and self._epochs_fed + 1 >= self.max_epochs and not self._pass_open(key)):
            self.end_step()
            self.stop()
        return key, self._passes[key]

    def _pass_open(self, loader: int) -> bool:
        """Whether an iterator of `loader` is alive and not exhausted."""
        return any(key == loader for key, _ in self._iterators.values())

    def on_loader_batch(self, iterator: Any, batch: Any, fetched_by: CodeType | None = None
                        ) -> None:
        """A DataLoader iterator yielded `batch` (asked for by the code `fetched_by`). The
        training loader's batches are step state beside what the model is called with:
        labels that a loss takes outside the model are in them. Each is printed as yielded
        (the loop may change it in place; another loader's, an evaluation's, only if a step
        takes it) and waits for the step it feeds (see :meth:`_take_loader_batches`)."""
        started = self._iterators.get(iterator)
        if started is None:
            return
        self._yielded = started
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
        ahead = self._fetched_ahead is None and _may_fetch_ahead(fetched_by)  # (until known)
        self._waiting = [*self._waiting[1 - _WAITING:],
                         (started, printed_now(batch, "xxh3") if printed else batch, printed,
                          ahead)]
        if step_open:
            self._take_loader_batches()

    def _take_loader_batches(self) -> None:
        """The open step takes the training batches that wait for it, but the newest
        `_fetched_ahead` of a pass not over yet: a wrapper that fetches ahead of the loop
        (accelerate's loader) holds them for the next steps. How far ahead it fetches is
        what it fetched before the first step began, beyond the one batch the loop took."""
        if self._fetched_ahead is None:
            fed = [ahead for started, _, _, ahead in self._waiting
                   if started == self._train_pass]
            self._fetched_ahead = len(fed) - 1 if len(fed) > 1 and any(fed) else 0
        live = set(self._iterators.values())
        held = 0
        while (held < self._fetched_ahead and held < len(self._waiting)
               and self._waiting[-1 - held][0] in live):
            held += 1
        taken = self._waiting[:len(self._waiting) - held]
        self._waiting = self._waiting[len(self._waiting) - held:]
        for started, kept, printed, _ in taken:
            if started == self._train_pass:  # (not a peek's, nor an evaluation's)
                self.recorder.add_printed(STATE, "", self._fetched, LOADER_BATCH,
                                          kept if printed else printed_now(kept, "xxh3"))
                self._fetched += 1

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

    def _evaluating(self) -> bool:
        """A call in training mode without gradients that would begin a step, though no
        loader that feeds steps yielded a batch for it (the loop evaluates on a validation
        loader or tensors after an update, having forgot ``eval()``): no step begins (a
        pseudo-labelling call on the next step's own batch still begins one)."""
        return (not torch.is_grad_enabled() and bool(self._step_loaders) and not self._fed
                and (self.info is None or self._updated))
