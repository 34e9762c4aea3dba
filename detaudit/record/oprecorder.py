"""Op-level recording: a dispatch mode that fingerprints every aten/torchvision op.

Runs on top of the module-level :class:`~detaudit.recorder.Recorder`, which says where each
op runs: in forward, the innermost module call on the hook stack; in backward, the module
call whose forward created the autograd node now executing
(``torch._C._current_autograd_node()``, matched by sequence number, or marked by the
recorder where a checkpoint recomputed it). Records go into the same step records as the
module level, under the phases ``op.forward`` / ``op.backward`` and slots
``op<k>/<namespace.op>/in.<i>`` (its plain arguments, ``.../in.args``) or ``.../out.<i>``,
where k counts the ops of that module call in execution order; an op outside every module
call (a loss the loop computes) is placed ``(outside the model)``.

The same mode, with recording off, plants op-level faults and runs the census
(op counts per module, and the deterministic-algorithms alerts each op raised).
Ops a thread runs :func:`outside_the_steps_ops` (a DataLoader delivering a batch) pass
through unseen.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..analysis.knowledge import applicable, lookup
from ..config import ANY_MODULE, Fault, op_site_key
from ..planting import plants_at
from ..trace import (
    BACKWARD,
    FORWARD,
    OP_BACKWARD,
    OP_FORWARD,
    OUTSIDE_MODEL,
    UNINITIALIZED_READ,
)
from .fingerprint import storage_address
from .recorder import Call, Recorder
from .sites import user_call_site
from .structure import has_ulps, is_dtensor, iter_tensors, next_ulp, on_local, some_nonzero

# the outputs of risky ops a zoomed step keeps, per repeat (see OpRecorder.keep_risky)
KEPT_BYTES = 256 * 2**20

# Ops that only re-label memory or metadata: their outputs are their inputs.
PASSTHROUGH_OPS = {"aten.detach", "aten.alias", "aten.lift_fresh", "aten._local_scalar_dense"}
# Ops whose outputs are uninitialized memory: their bytes are noise until written. FSDP2's
# all-gather buffer too: the op fills this rank's part of it, the all-gather the rest.
UNINITIALIZED_OPS = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
                  "aten.new_empty_strided", "aten.empty_permuted", "fsdp.all_gather_copy_in"}
# A fused RNN's scratch memory (oneDNN's workspace, cuDNN's and MIOpen's reserve), part of
# which the kernel never writes: noise, as uninitialized memory is. The forward op's outputs
# at these positions, and the backward op's arguments by these names, are not recorded.
SCRATCH_OUTPUTS = {"aten.mkldnn_rnn_layer": 3, "aten._cudnn_rnn": 3, "aten.miopen_rnn": 3}
SCRATCH_ARGUMENTS = frozenset({"workspace", "reserve"})
# op -> (its scratch arguments' positions, its scratch output's position or None)
_SCRATCH: dict[Any, tuple[tuple[int, ...], int | None]] = {}
# A wait for a collective's result: its input has not landed yet, its output has
WAITS = {"_c10d_functional.wait_tensor", "c10d_functional.wait_tensor"}
_SITE_OF_NODE = "detaudit.site"  # an autograd node's metadata: the user's line that made it
_COLLECTIVES: dict[Any, bool] = {}
_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}  # (see written_arguments)


def collective(func: Any) -> bool:
    """Whether `func` is a collective (it takes a process group, or a group's name; not
    GroupNorm's `int group`): its outputs are not settled when it returns (the result lands
    when its work is waited on), so they are not recorded at it, and running it again on one
    rank alone would hang the others."""
    known = _COLLECTIVES.get(func)
    if known is None:
        known = _COLLECTIVES[func] = any(
            "ProcessGroup" in str(arg.type) or arg.name == "group_name"
            or (arg.name == "group" and str(arg.type) == "str")
            for arg in func._schema.arguments)
    return known


def without_scratch(func: Any, args: tuple, kwargs: dict, out: Any
                    ) -> tuple[list[Any], dict[str, Any], Any]:
    """An op's arguments and outputs less its scratch memory (see SCRATCH_OUTPUTS), each
    left out as None."""
    known = _SCRATCH.get(func)
    if known is None:
        schema = func._schema
        known = _SCRATCH[func] = (
            tuple(i for i, arg in enumerate(schema.arguments) if arg.name in SCRATCH_ARGUMENTS),
            SCRATCH_OUTPUTS.get(schema.name.replace("::", ".")))
    positions, scratch = known
    if not positions and scratch is None:  # (nearly every op: nothing to leave out)
        return list(args), kwargs, out
    args = [None if i in positions else a for i, a in enumerate(args)]
    kwargs = {k: None if k in SCRATCH_ARGUMENTS else v for k, v in kwargs.items()}
    if scratch is not None and isinstance(out, (tuple, list)):
        out = tuple(None if i == scratch else o for i, o in enumerate(out))
    return args, kwargs, out


def bump_versions(func: Any, args: tuple, kwargs: dict) -> None:
    """Move the version counters an in-place foreach op leaves unmoved under a dispatch
    mode (see written_arguments), as the op moves them outside one: a print taken of those
    tensors before (a gradient before clipping's ``_foreach_mul_``) must not pass for them
    after, in a step recorded at any level. Every mode that runs ops calls it (the op
    recorder, the stress)."""
    for written in written_arguments(func, args, kwargs):
        if isinstance(written, (list, tuple)):
            for t in written:
                if isinstance(t, torch.Tensor) and not t.is_inference():
                    increment_version(t)


def written_arguments(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an op writes in place (``Tensor(a!)`` in its schema). An in-place
    foreach op (``_foreach_add_``: an optimizer's update with ``foreach=True``, or a loop's
    own) returns nothing and, under a dispatch mode, moves no version counter: what it wrote
    is its output, and must be read anew wherever it is read next."""
    known = _WRITTEN.get(func)
    if known is None:
        known = _WRITTEN[func] = tuple(
            (i, arg.name) for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write)
    return [args[i] if i < len(args) else kwargs.get(name) for i, name in known]



ALERT_MARK = "does not have a deterministic implementation"


def op_name(func: Any) -> str:
    """``namespace.op`` without the overload: ``aten.index_put``, ``torchvision.nms``."""
    return f"{func.namespace}.{func.overloadpacket.__name__}"


@dataclass
class Alert:
    """One deterministic-algorithms alert, and the op and module that raised it."""

    module: str
    phase: str
    op: str
    message: str


class Unintercepted:
    """The recorder's fingerprinter, run with this mode switched off (so the auditor's
    own tensor ops are never recorded as the model's)."""

    def __init__(self, fp: Any) -> None:
        self._fp = fp

    def add(self, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return self._fp.add(*args, **kwargs)

    def add_many(self, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return self._fp.add_many(*args, **kwargs)

    def add_bytes(self, *args: Any, **kwargs: Any) -> Any:
        return self._fp.add_bytes(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)


class _Fetching(threading.local):
    depth = 0  # outside_the_steps_ops blocks open in this thread


_FETCHING = _Fetching()


@contextlib.contextmanager
def outside_the_steps_ops() -> Iterator[None]:
    """Ops this thread runs meanwhile are not the step's: a DataLoader delivering a batch
    (the batch is step state, printed as it is yielded) runs ops whose number and place
    are a race -- which fetch unpickles a worker's batch depends on when it arrived -- and
    would shift the op-level records of one run against another's."""
    depth = _FETCHING.depth
    _FETCHING.depth = depth + 1
    try:
        yield
    finally:
        _FETCHING.depth = depth


class ModelOpMode(TorchDispatchMode):
    """A dispatch mode over the model's ops at one step: the recorder's own tensor ops run
    unseen (its fingerprinter unintercepted while the mode is on), and each op is located in
    the module call it runs in (:meth:`where`)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        # the outputs of forward ops outside the model, each with where the user's code ran
        # it: autograd sets their nodes once the op returns, and each node is then marked
        self._unmarked: list[tuple[list[weakref.ref], str]] = []

    def __enter__(self) -> ModelOpMode:  # noqa: PYI034
        self._saved_fp = self.recorder.fp
        if not isinstance(self._saved_fp, Unintercepted):  # another mode already did
            self.recorder.fp = Unintercepted(self._saved_fp)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.recorder.fp = self._saved_fp

    def where(self) -> tuple[str, Call | None]:
        """The phase of the op now dispatched and its module call: in forward the innermost
        call on the hook stack, in backward the call whose forward made the running node --
        but a forward run again inside backward (a checkpoint's recomputation) is forward."""
        node = torch._C._current_autograd_node()
        call = self.recorder.current_call(node)
        if node is None or call is not None:
            return FORWARD, call
        return BACKWARD, self.recorder.call_for_node(node)

    def site(self, phase: str, module: str, frame: Any) -> str:
        """Where in the user's code the op now dispatched ran, outside every module call of
        the model ("" in one, or with no user's frame): in forward the innermost user frame
        at or above `frame`; in backward, which the autograd engine runs with no frame of the
        user's, that of the forward op whose autograd node runs now (see mark_nodes)."""
        self._mark_nodes()
        if module != OUTSIDE_MODEL:
            return ""
        if phase == FORWARD:
            return user_call_site(frame)
        metadata = getattr(torch._C._current_autograd_node(), "metadata", None) or {}
        return metadata.get(_SITE_OF_NODE, "")

    def mark_nodes(self, phase: str, module: str, out: Any, site: str) -> None:
        """A forward op outside the model returned `out`: the autograd node its outputs get
        (set as the op returns: marked at the next op) is marked with `site`, so that the
        ops of its backward are placed there. A node made where no op of this mode ran (a
        view's, a node made in backward) is never marked: its ops get no line, never one
        that is not theirs."""
        if site and phase == FORWARD and module == OUTSIDE_MODEL:
            self._unmarked.append(([weakref.ref(t) for _, t in iter_tensors(out)], site))

    def _mark_nodes(self) -> None:
        if not self._unmarked:  # (every op comes here: most have nothing to mark)
            return
        unmarked, self._unmarked = self._unmarked, []
        for outputs, site in unmarked:
            for output in outputs:
                metadata = getattr(getattr(output(), "grad_fn", None), "metadata", None)
                if metadata is not None:
                    metadata.setdefault(_SITE_OF_NODE, site)

    def located(self, call: Call | None) -> tuple[str, int]:
        """The module and call index an op in `call` is recorded under: outside every call
        of the model, the model called apart that runs now, else "(outside the model)"."""
        if call is not None:
            return call.module, call.index
        return self.recorder.apart or (OUTSIDE_MODEL, 0)


class OpRecorder(ModelOpMode):
    """Records (or only counts, or only perturbs) every op; enter it around forward and
    backward of one step. Use one instance per step."""

    def __init__(
        self, recorder: Recorder, step: int, *, record: bool = True, fault: Fault | None = None,
        census: bool = False, capture: tuple[str, str, int, str] | None = None,
        keep_risky: bool = False, keep_planted: Fault | None = None,
        env: dict[str, Any] | None = None,
    ) -> None:
        """`keep_risky`, where ops are recorded: a copy of the outputs of each op known to
        make runs differ with the settings `env` records (the stress's risky ops), up to
        KEPT_BYTES, and of the op `keep_planted` (a fault any repeat plants) names, is kept
        (:attr:`kept`), so that the difference of one found to part the runs is measured
        without replaying them."""
        super().__init__(recorder)
        self.step = step
        self.record = record
        self.fault = fault if fault is not None and fault.op and fault.step == step else None
        self.census = census
        self.capture = capture  # (op phase, module, call, "op<k>/<name>"): keep its outputs
        self.captured: list[torch.Tensor] | None = None
        self.keep_risky = keep_risky
        self.keep_planted = keep_planted if keep_planted is not None and keep_planted.op else None
        self.env = env
        # (op phase, module, call, "op<k>/<name>") -> copies of its outputs (see keep_risky)
        self.kept: dict[tuple[str, str, int, str], list[torch.Tensor]] = {}
        self._kept_bytes = 0
        # (module, phase, op, its `accumulate` argument or None) -> calls
        self.counts: Counter[tuple[str, str, str, bool | None]] = Counter()
        self.alerts: list[Alert] = []
        self._ops: Counter[tuple[str, str, int]] = Counter()
        # storage address -> (tensor, version) of outputs of empty(): skipped until written
        self._fresh: dict[int, tuple[weakref.ref, int]] = {}
        # storage addresses a collective wrote (its result lands without a version bump):
        # read as inputs they are still skipped, but what reads them reads no noise
        self._landed: set[int] = set()

    def __enter__(self) -> OpRecorder:  # noqa: PYI034
        if self.census:  # the alerts are collected per op; keep their warnings quiet
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("ignore", UserWarning)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.census:
            self._warnings.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _FETCHING.depth:
            return func(*args, **kwargs)
        name = op_name(func)
        phase, call = self.where()
        op_phase = OP_FORWARD if phase == FORWARD else OP_BACKWARD
        module, index = self.located(call)
        if self.census:
            self.counts[(module, phase, name, accumulate_arg(func, args, kwargs))] += 1
        site = self.site(phase, module, sys._getframe(1)) if self.record else ""
        skip = func.is_view or name in PASSTHROUGH_OPS
        prefix = ""
        if (self.record or self.capture) and not skip:
            k = self._ops[(op_phase, module, index)]
            self._ops[(op_phase, module, index)] = k + 1
            prefix = f"op{k}/{name}"
            if self.record and module == OUTSIDE_MODEL and (site or phase == FORWARD):
                self.recorder.op_sites[op_site_key(self.step, phase == BACKWARD, prefix)] = site
            if self.record and name not in WAITS:
                inputs = list(without_scratch(func, args, kwargs, None)[:2])
                # its Python numbers too (a scale drawn on the host makes a different op call)
                self.recorder.record_values(op_phase, module, index, f"{prefix}/in.args", inputs)
                if self._fresh:
                    given = [t for _, t in iter_tensors(inputs)]
                    inputs = [t for t in given if not self._uninitialized(t)]
                    if not func._schema.is_mutable and any(
                            storage_address(t) not in self._landed for t in given
                            if self._uninitialized(t)):
                        # (it reads what that memory held: noise, whatever its inputs say)
                        self.recorder.record_values(op_phase, module, index,
                                                    f"{prefix}/{UNINITIALIZED_READ}", [True])
                self.recorder.record(op_phase, module, index, f"{prefix}/in", inputs)
        if self.census and torch.is_deterministic_algorithms_warn_only_enabled():
            out = self._run_catching_alert(func, args, kwargs, Alert(module, phase, name, ""))
        else:
            out = func(*args, **kwargs)
        if func._schema.is_mutable:
            bump_versions(func, args, kwargs)
        fault = self.fault
        if fault is not None and fault.phase == phase and fault.module in (ANY_MODULE, module):
            if not skip:
                self.recorder.ops_at_fault.add(name)
            if not self.recorder.fault_fired and plants_at(fault, self.step, module, phase, name):
                out = self._perturb(func, args, out)
        if prefix and self.record:
            if name in UNINITIALIZED_OPS:
                self._remember_uninitialized(out)
            elif collective(func):  # read fresh wherever they are read next
                written = {address for _, t in iter_tensors([args, kwargs, out])
                           if (address := storage_address(t)) is not None}
                self.recorder.fp.forget(written)
                self._landed |= written
            else:
                # an in-place or out= op's output is its input, whose version counter is
                # bumped only after this returns: it must not pass for the unchanged input
                # (nor the result a wait returns for the tensor it was given)
                self.recorder.record(op_phase, module, index, f"{prefix}/out",
                                     _results(func, args, kwargs, out),
                                     written=func._schema.is_mutable or name in WAITS)
        if prefix and self.capture == (op_phase, module, index, prefix):
            self.captured = [t.detach().to("cpu", copy=True) for _, t
                             in iter_tensors(without_scratch(func, (), {}, out)[2])]
        if prefix and self.record and self.keep_risky:
            self._keep((op_phase, module, index, prefix), name, phase, func, args, kwargs, out)
        self.mark_nodes(phase, module, out, site)
        return out

    def take_kept(self, other: OpRecorder) -> None:
        """Hold what `other` kept too (ops recorded aside for this step), within the one
        KEPT_BYTES."""
        self.kept.update(other.kept)
        self._kept_bytes += other._kept_bytes

    def _keep(self, key: tuple[str, str, int, str], name: str, phase: str, func: Any,
              args: tuple, kwargs: dict, out: Any) -> None:
        """Keep a copy of the outputs of a risky op (within KEPT_BYTES), or of the planted
        one. A copy that fails (out of memory, a tensor of no storage) is a measurement
        forgone, never the step's failure."""
        planted = plants_at(self.keep_planted, self.step, key[1], phase, name)
        if not planted and not lookup(name, phase):  # (most ops: nothing more to look at)
            return
        outputs = [t for _, t in iter_tensors(_results(func, args, kwargs, out))]
        if not outputs or any(map(is_dtensor, outputs)):  # (a shard's: not kept)
            return
        size = 0  # (the planted op's outputs: kept whatever the risky ops took)
        if not planted:
            if not applicable(name, phase, outputs[0].device.type, self.env,
                              accumulate_arg(func, args, kwargs)):
                return
            size = sum(t.numel() * t.element_size() for t in outputs)
            if self._kept_bytes + size > KEPT_BYTES:
                return
        try:
            with _disable_current_modes():
                self.kept[key] = [t.detach().to("cpu", copy=True) for t in outputs]
        except Exception:  # noqa: BLE001 -- see above
            return
        self._kept_bytes += size

    def _run_catching_alert(self, func: Any, args: tuple, kwargs: dict, alert: Alert) -> Any:
        """Run the op with alerts as errors, so that each one is seen at the op that raised
        it (a warning would only surface when the whole Python-level call returns); then
        run it as warn-only mode would. Alerts are raised before a kernel does any work."""
        torch.use_deterministic_algorithms(True, warn_only=False)
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if ALERT_MARK not in str(exc):
                raise
            alert.message = str(exc).split("\n")[0]
            self.alerts.append(alert)
        finally:
            torch.use_deterministic_algorithms(True, warn_only=True)
        return func(*args, **kwargs)

    def _remember_uninitialized(self, out: Any) -> None:
        for _, t in iter_tensors(out):
            address = storage_address(t)
            # (an inference tensor has no version counter: cannot tell when it is written)
            if address is not None and not t.is_inference():
                self._fresh[address] = (weakref.ref(t), t._version)
                self._landed.discard(address)

    def _uninitialized(self, t: torch.Tensor) -> bool:
        """Whether `t` is (a view of) an uninitialized output not written since."""
        entry = self._fresh.get(storage_address(t))
        if entry is None:
            return False
        tensor = entry[0]()
        return tensor is not None and tensor._version == entry[1]

    def _perturb(self, func: Any, args: tuple, out: Any) -> Any:
        """Plant the fault in the op's first output that is not all zero: 1 ULP for floats
        (a gradient's largest element in backward), a swap of two different elements for
        integers (a reordering, as a nondeterministic sort makes)."""
        for path, tensor in iter_tensors(out):
            changed = _perturbed(tensor, largest=self.fault.phase == BACKWARD)
            if changed is None:
                continue
            self.recorder.fault_fired = True
            if func._schema.is_mutable:
                tensor.copy_(changed)
                return out
            return _replace(out, path, changed)
        return out


def _results(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """What an op wrote: its outputs (scratch left out), or, for an in-place or out= op that
    returns nothing, the arguments it wrote."""
    if out is None and func._schema.is_mutable:
        return written_arguments(func, args, kwargs)
    return without_scratch(func, (), {}, out)[2]


def accumulate_arg(func: Any, args: tuple, kwargs: dict) -> bool | None:
    """The op's `accumulate` argument (index_put_, put_), None for ops without one."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "accumulate":
            value = args[i] if i < len(args) else kwargs.get("accumulate", False)
            return bool(value)
    return None


def _perturbed(t: torch.Tensor, largest: bool = False) -> torch.Tensor | None:
    if is_dtensor(t):  # (each process changes the part it holds)
        return on_local(t, lambda local: _perturbed(local, largest))
    if not t.numel():
        return None
    if has_ulps(t):  # an all-zero output (a gradient nothing reached) is skipped
        return next_ulp(t, largest) if some_nonzero(t) else None
    if t.layout is not torch.strided:  # (integers in a sparse layout: rare, left alone)
        return None
    flat = t.reshape(-1)
    different = (flat != flat[0]).nonzero()
    if not len(different):
        return None
    j = int(different[0])
    swapped = flat.clone()
    swapped[0], swapped[j] = flat[j], flat[0]
    return swapped.reshape(t.shape)


def _replace(out: Any, path: str, value: torch.Tensor) -> Any:
    """`out` with the tensor at `path` (as iter_tensors names it) replaced."""
    if not path:
        return value
    head, _, rest = path.partition(".")
    if isinstance(out, (list, tuple)):
        items = list(out)
        items[int(head)] = _replace(items[int(head)], rest, value)
        return type(out)(items) if isinstance(out, list) else tuple(items)
    if isinstance(out, dict):
        return {**out, head: _replace(out[head], rest, value)}
    return out
