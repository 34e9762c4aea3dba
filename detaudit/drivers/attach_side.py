"""The calls of models a loop calls apart (an EMA, a teacher: see
:class:`.attach_models.SideModels`), as an attached loop records them (see :mod:`.attach`).

Each top-level call of such a model is recorded (its inputs and output) in the step its work
is for: the open step until its update, the next one after it -- a teacher called for the
next batch's pseudo-labels runs before the step it works for begins, so its records wait
for that step. When that step is recorded op by op (zoomed, or an op fault planted in it),
the ops of such a call are recorded aside and join the step as it begins (with the outputs
they kept for the audit to measure). A forward fault
named after the model is planted at its output.

:class:`SideCalls` is a part of :class:`.attach.Attachment` (a mixin): it works on the
attachment's state (its recorder, its open step) as the rest of the class does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..record.oprecorder import OpRecorder
from ..record.recorder import WATCH_NONE, Recorder, RecordKey, call_prints
from ..record.structure import next_ulp, replace_first_float
from ..trace import FORWARD


class SideCalls:
    """The side models' top-level calls: mixed into :class:`.attach.Attachment`."""

    def _init_side_calls(self) -> None:
        self._side_call: tuple[str, int] | None = None  # the side model's call running now
        self._side_fault_fired = False  # a fault planted at a side model's output fired
        # (step, its recorder, its op recorder): the ops of side calls made before the step
        # they work for began, recorded aside for it
        self._ahead: tuple[int, Recorder, OpRecorder] | None = None
        self._ahead_open = False  # the op recorder aside runs (in the side call now)

    def _step_ahead(self) -> int:
        """The step a call made now works for: the open one until its update, else the next."""
        if self.info is None:  # (before the first step, or between two)
            return self.stream.steps
        return self.info.step + (1 if self._updated else 0)

    def _side_call_begins(self, module: nn.Module) -> None:
        """A top-level call of `module` begins (after the attachment saw it)."""
        self._side_call = None if self.stopped else self._side.begin_call(
            module, self._step_ahead())
        if self.recorder is not None:
            self.recorder.apart = self._side_call
        if self._side_call is not None and (self.info is None or self._updated):
            self._record_ops_ahead()

    def _side_call_ends(self, args: tuple, kwargs: dict, output: Any) -> Any:
        """The top-level call begun last ends with `output`: its records, and the output a
        fault planted there replaced (None when none was)."""
        where, self._side_call = self._side_call, None
        if self.recorder is not None:
            self.recorder.apart = None
        if where is None:
            return None
        if self._ahead_open and self._ahead is not None:
            self._ahead_open = False
            self._ahead[2].__exit__(None, None, None)
            self._side_fault_fired |= self._ahead[1].fault_fired
        replaced = None
        if self._plants_in_side(where[0]):
            replaced, self._side_fault_fired = replace_first_float(output, next_ulp)
            output = replaced if self._side_fault_fired else output
        records = call_prints(*where, args, kwargs, output)
        if self.info is not None and not self._updated and self.recorder is not None:
            self.recorder.add_records(records)
        else:  # (called before the step it works for begins)
            self._side.pending += records
        return replaced if self._side_fault_fired else None

    def _plants_in_side(self, name: str) -> bool:
        """Whether a forward fault is planted at the output of this call of side model
        `name` (the first in the step the fault names)."""
        fault = self.fault
        return (fault is not None and not fault.op and fault.phase == FORWARD
                and not self._side_fault_fired and fault.module == name
                and fault.step == self._step_ahead())

    def _record_ops_ahead(self) -> None:
        """The side call begun now works for a step that has not begun: if that step is
        recorded op by op, its ops are recorded aside until the call ends."""
        step, fault = self._step_ahead(), self.fault
        assert self._side_call is not None
        if fault is not None and not (fault.op and fault.step == step
                                      and fault.module == self._side_call[0]):
            fault = None  # (an op fault in any module fires in the step's own ops)
        if self._ops is not None or (step != self.zoom and fault is None):
            return
        if self._ahead is None or self._ahead[0] != step:
            recorder = Recorder(nn.Module(), watch=WATCH_NONE)
            recorder.begin_step(step, WATCH_NONE, rehook=False)
            self._ahead = (step, recorder, OpRecorder(
                recorder, step, record=step == self.zoom, fault=fault,
                keep_risky=step == self.zoom, keep_planted=self.keep_planted,
                env=self.trace.env))
        self._ahead[1].apart = self._side_call
        self._ahead[2].__enter__()
        self._ahead_open = True

    def _ops_recorded_ahead(self, step: int) -> list[tuple[RecordKey, Any]]:
        """The records of the ops recorded aside for `step`, which begins now; the outputs
        they kept join those the step's own ops keep (see attach._save_kept)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != step:
            return []
        if self._ops is not None:
            self._ops.take_kept(ahead[2])
        done = ahead[1].end_step()
        return list(zip(done.keys, done.prints))
