"""Where a planted fault may go: `--inject-fault` checked against a run that went without it.

A fault names a module (as the reports name it), a phase, a step and maybe an op. Whether it
can fire is only known once a run has shown which modules ran at that step, which models
the loop calls apart and which are TorchScript: `exec` checks it against its first run (and
that run, which knows the fault, ends at the step after the fault's when it cannot fire, so
that a misspelt name is not refused only after the whole script has run).
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import replace

from .config import (
    ANY_MODULE,
    ROOT_NAME,
    SCRIPTED,
    SIDE_MODELS,
    UNKNOWN_OP,
    Fault,
    nearest_modules,
    scripted_fault,
)
from .errors import FaultRefused
from .trace import BACKWARD, FORWARD, STATE, AnyTrace

# why a fault at step 0 may find no module: models other than the first are named later
KNOWN_LATER = ("at step 0 only the model the first update trains is known before it runs; "
               "another model, trained by an optimizer of its own, is known from that update "
               "on: plant at step 1 or later")


def fault_target(fault: Fault, trace: AnyTrace) -> Fault:
    """After a run without the fault (it goes into the last): a step it never reached, or a
    module that did not run at that step, is one clear error now rather than after every
    run; the module names that did run are offered. An op fault in any module (no module
    named) is left to the run itself, which says if the op never ran. Returns the fault to
    plant: a module named as in the user's model is named inside the wrappers around it
    (DDP's ``module.``, Lightning Fabric's ``_forward_module.``)."""
    if (unknown := trace.probe.get(UNKNOWN_OP)) is not None:
        raise FaultRefused(unknown)
    if trace.failure is not None:
        return fault  # the failure is the finding
    if len(trace.steps) <= fault.step:
        raise FaultRefused(
            f"--inject-fault plants at step {fault.step}, but the command ran "
            f"{len(trace.steps)} step{'' if len(trace.steps) == 1 else 's'} "
            f"(0 to {len(trace.steps) - 1})")
    check_side_fault(fault, trace.probe.get(SIDE_MODELS) or [])
    said = scripted_fault(fault.module, trace.probe.get(SCRIPTED) or ())
    if said is not None:
        raise FaultRefused(f"--inject-fault: {said}")
    modules: set[str] = set()
    ran: set[str] = set()  # (and the model itself, "")
    owners: set[str] = set()  # modules with parameters, called or not
    for step, cut in trace.by_step():
        r = cut.records
        owners |= {m for p, m, s in zip(r["phase"], r["module"], r["slot"])
                   if p == STATE and s.startswith("param.")}
        if step == fault.step:
            ran = {m for p, m in zip(r["phase"], r["module"]) if p == FORWARD}
            modules = ran - {""}
            break
    if fault.module not in ("", ANY_MODULE) and ran and fault.module not in modules:
        wrapped = _inside_wrappers(fault.module, modules)
        if wrapped is not None:
            return replace(fault, module=wrapped)
        if fault.module in owners:
            raise FaultRefused(
                f"--inject-fault: the model has a module {fault.module!r}, but it was not seen "
                f"running at step {fault.step} (" + (KNOWN_LATER if fault.step == 0 else
                                                     "a layer the forward never calls, or "
                                                     "calls at other steps only") + ")")
        hint = (nearest_modules(fault.module, sorted(modules), "modules that ran") if modules
                else "the model ran no submodule there (it has none, or calls none): name "
                     f"the model itself, {ROOT_NAME}")  # (a bare nn.Linear)
        raise FaultRefused(
            f"--inject-fault: no module {fault.module!r} ran at step {fault.step}; {hint}")
    return fault


# the attributes under which wrappers hold the model they wrap: DDP's and DataParallel's,
# Lightning Fabric's (around DDP's too), FSDP1's, activation checkpointing's
_WRAPPER_ATTRIBUTES = {"module", "_forward_module", "_fsdp_wrapped_module",
                       "_checkpoint_wrapped_module"}


def _inside_wrappers(name: str, modules: set[str]) -> str | None:
    """The module that ran, named `name` within the wrappers around it (the fewest), the
    name the reports give it."""
    inside = [m for m in modules if m.endswith(f".{name}")
              and set(m[:-len(name) - 1].split(".")) <= _WRAPPER_ATTRIBUTES]
    return min(inside, key=len, default=None)


def check_side_fault(fault: Fault, sides: list[str]) -> None:
    """A model the loop calls apart (see attach's SideModels) is recorded by its calls'
    inputs and outputs: a fault is planted at its output, in forward, or at an op in it."""
    side = next((s for s in sides if fault.module == s or fault.module.startswith(s + ".")),
                None)
    if side is None or (fault.module == side and (fault.phase == FORWARD or fault.op)):
        return
    where = f"{side!r} is" if fault.module == side else f"{fault.module!r} is inside {side!r},"
    raise FaultRefused(
        f"--inject-fault: {where} a model the loop calls apart (no optimizer trains it), recorded by its calls' inputs and output: plant at its output "
        f"(--inject-fault {side}@forward:{fault.step}) or at an op in it "
        f"({side}/OP@forward:{fault.step})")


# namespaces all of whose ops are registered once torch and torchvision are imported; a
# library's own namespace registers its ops as its code loads, in the run
_BUILT_IN_NAMESPACES = ("aten", "prims", "torchvision")


def check_op_known(fault: Fault | None) -> None:
    """An op fault naming an op that neither PyTorch nor torchvision has is refused before
    any run (by exec's first run, at its first step: exec's own process never imports
    torch), with the nearest names (it could only be found never to have run); an op of a
    library's own namespace is left to the run, which loads it."""
    if fault is None or not fault.op:
        return
    namespace, _, name = fault.op.rpartition(".")
    if namespace and namespace not in _BUILT_IN_NAMESPACES:
        return
    ops = _registered_ops()
    if namespace == "torchvision" and not any(op.startswith("torchvision.") for op in ops):
        return  # (torchvision is not installed here, or did not load)
    if namespace:
        known, names = fault.op in ops, sorted(op for op in ops if op.startswith(namespace + "."))
    else:
        names = sorted({op.rpartition(".")[2] for op in ops})
        known = name in names
    if known:
        return
    close = difflib.get_close_matches(fault.op, names, n=3, cutoff=0.6)
    raise FaultRefused(
        f"--inject-fault: no op {fault.op!r} in PyTorch or torchvision"
        + (f" (did you mean {', '.join(close)}?)" if close else "")
        + ("" if namespace else
           f"; an op a library of its own registers: name it with its namespace "
           f"(LIBRARY.{name})"))


def _registered_ops() -> set[str]:
    """``namespace.op`` of every op registered with PyTorch's dispatcher, torchvision's
    included where it is installed."""
    import torch

    with contextlib.suppress(Exception):  # (not installed, or built for another torch)
        import torchvision  # noqa: F401
    return {"{}.{}".format(*n.split(".")[0].split("::"))
            for n in torch._C._dispatch_get_all_op_names()}


# forward ops whose backward op is named otherwise than OP_backward (the names of
# derivatives.yaml's formulas, as they dispatch)
_BACKWARD_OPS = {"relu": ("threshold_backward",), "embedding": ("embedding_dense_backward",),
                 "gather": ("scatter_add",), "index_select": ("index_add",),
                 "index": ("index_put", "_index_put_impl")}


def op_matches(pattern: str, op: str, phase: str) -> bool:
    """`op` is `pattern`, or (in backward) `pattern`'s own backward op, named the
    torchvision way (``_roi_align_backward``), the aten way (``convolution_backward``,
    ``_softmax_backward_data``), or otherwise (relu's ``threshold_backward``, gather's
    ``scatter_add``: see _BACKWARD_OPS). A pattern without a namespace (``addmm``) names the
    op in any namespace."""
    namespace, _, base = pattern.rpartition(".")
    if not namespace:
        op = op.rpartition(".")[2]
    names = (f"_{base}_backward", f"{base}_backward", f"{base}_backward_data",
             *(_BACKWARD_OPS.get(base, ()) if namespace in ("", "aten") else ()))
    backward = {f"{namespace}.{name}" if namespace else name for name in names}
    return op == pattern or (phase == BACKWARD and op in backward)


def plants_at(fault: Fault | None, step: int, module: str, phase: str, op: str) -> bool:
    """Whether `op`, run in `module` in `phase` at `step`, is the op the op-level `fault`
    changes (in whichever run plants it)."""
    return (fault is not None and bool(fault.op) and fault.step == step and fault.phase == phase
            and fault.module in (ANY_MODULE, module) and op_matches(fault.op, op, phase))
