"""Backward records at module boundaries, the half of :class:`~detaudit.record.recorder.Recorder`
that works on the autograd graph.

Which module call made an autograd node is told by sequence numbers: a node belongs to the
innermost call whose forward was running when it was created. One walk of the graph before
backward hooks every node with an edge that leaves a call (to a node made before the call,
or to a leaf): its gradient is what the call sends back to that input. Nothing is added to
the graph, so the order gradients accumulate in, and so the numbers, stay as without us.

A reentrant checkpoint runs its forward again inside backward: such a call takes the
identity of the call it reruns (found through a call index built only then), and the graph
it builds is hooked when its outermost call returns, each node marked with its call.

:class:`BackwardBoundaries` is a base of the Recorder and uses its step state: the step's
calls (``_calls``), parameters (``_params``), fault, keys and fingerprinter.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..trace import BACKWARD, within
from .structure import has_ulps, iter_tensors, next_ulp, some_nonzero

_AccumulateGrad = torch._C._functions.AccumulateGrad  # the node that fills a leaf's .grad
SeqIndex = tuple[list[int], list[list[int]]]  # sequence numbers -> enclosing calls from there
# calls by (parent position, module) and by (first sequence number, module): see _indexed
CallIndex = tuple[dict[tuple[int, str], list[int]], dict[tuple[int, str], list[int]]]
_CALL_OF_NODE = "detaudit.call"  # a recomputed node's metadata: the Call that made it


@dataclass
class Call:
    """One call of one module within a step."""

    module: str
    index: int
    parent: int  # position of the enclosing call in the step's call list, -1 at the top
    seq_start: int = 0
    seq_end: int = 0
    inputs: dict[tuple[int, int], str] = field(default_factory=dict)  # autograd edge -> path
    # The objects whose ids key `inputs`, held until the step ends: a grad_fn's Python wrapper
    # dies with its last reference, and the graph walk before backward would then meet the
    # same node under a new id (and another node could take the old one).
    edge_objects: list[Any] = field(default_factory=list)
    # Inside backward: the autograd node running (None in forward), and the position of the
    # forward call this call runs again, a checkpoint's recomputation (-1: a call of its own).
    backward_node: Any = None
    original: int = -1
    # The modules whose parameters the call took as inputs (DETR's decoder is passed
    # `query_embed.weight`): those parameters' gradients come out of this call's backward.
    reads: list[str] = field(default_factory=list)


class BackwardBoundaries:
    """The recorder's graph work: the call that made a node, the boundary hooks, and the
    reentrant recomputations (see the module docstring)."""

    def call_for_node(self, node: Any) -> Call | None:
        """The innermost module call whose forward created autograd `node`."""
        if node is None or not self._calls:
            return None
        if self._recomputed:
            metadata = node.metadata
            if _CALL_OF_NODE in metadata:
                return metadata[_CALL_OF_NODE]
        chain = self._enclosing_calls(node._sequence_nr())
        return self._calls[chain[0]] if chain else None

    def _recomputes(self, name: str, node: Any, parent: int) -> int:
        """The position of the forward call that a call of `name` starting now, inside the
        backward of autograd `node`, runs again (a reentrant checkpoint's), or -1. Inside a
        recomputation it is the next call of `name` inside the call its parent runs again;
        one begins with the next call of `name` that `node`'s own forward made (an autograd
        Function's forward runs without grad: all its calls begin right after `node`)."""
        calls = self._calls
        children, starting = self._indexed()
        if parent >= 0:
            scope = calls[parent].original
            if scope < 0:
                return -1
            candidates = children.get((scope, name), [])
            done = len(children.get((parent, name), ()))
        else:
            seq = node._sequence_nr() + 1
            candidates = [i for i in starting.get((seq, name), ())
                          if calls[i].parent < 0 or calls[calls[i].parent].seq_start != seq]
            done = sum(1 for i in children.get((-1, name), ())
                       if calls[i].backward_node is node and calls[i].original >= 0)
        if done >= len(candidates):
            return -1
        match = candidates[done]
        return calls[match].original if calls[match].original >= 0 else match

    def _indexed(self) -> CallIndex:
        """The step's calls by (parent position, module) and by (first sequence number,
        module), where a recomputation finds the calls it runs again: built at the step's
        first recomputation (no cost to a step without one), kept up to date from then."""
        if self._call_index is None:
            self._call_index = ({}, {})
            for position, call in enumerate(self._calls):
                index_call(self._call_index, position, call)
        return self._call_index

    # -- backward ------------------------------------------------------------------------
    def before_backward(self, loss: torch.Tensor) -> None:
        """Walk the graph once and hook every autograd node on a module call's boundary."""
        if loss.grad_fn is None or not self._calls:
            return
        if self._records_modules or self._backward_fault_now():
            self._hook_graph([loss.grad_fn], self._enclosing_calls)

    def _backward_fault_now(self) -> bool:
        fault = self.fault
        return fault is not None and fault.phase == BACKWARD and fault.step == self._step

    def _hook_recomputation(self, position: int, output: Any) -> None:
        """Hook the graph that a recomputation (its outermost call at `position`) has just
        built, which backward runs next, and mark each node with the call that made it for
        the op level (on a GPU, their sequence numbers count on the thread of backward)."""
        calls = self._calls
        floor = calls[position].seq_start
        index = self._seq_index_of(list(range(position, len(calls))))
        roots = [t.grad_fn for _, t in iter_tensors(output)
                 if t.grad_fn is not None and t.grad_fn._sequence_nr() >= floor]
        outside = self.call_for_node(calls[position].backward_node)
        self._recomputed = True
        self._hook_graph(roots, lambda seq: _chain_at(index, seq), floor, outside,
                         boundaries=self._records_modules or self._backward_fault_now())

    def _hook_graph(
        self, roots: list[Any], chain_of: Callable[[int], list[int]], floor: int | None = None,
        outside: Call | None = None, boundaries: bool = True,
    ) -> None:
        """Walk the graph from `roots` and hook every node on a module call's boundary (only
        mark the nodes without `boundaries`); `chain_of` gives the calls that made a node.
        With a `floor` (a recomputation's first sequence number) the walk stays among nodes
        made from there on and marks each with its innermost call (`outside` if none)."""
        calls = self._calls
        params = {id(p): name.rpartition(".")[0] for name, p in self._params.items()}
        fault = self.fault
        fault_here = self._backward_fault_now()
        edges_of: dict[Any, list[tuple[int, int, str | None]]] = {}
        # One call can send several gradients to the same input (x + f(x)): they are told
        # apart as slot, slot#1, ... in the order of this walk, not in the order backward
        # happens to deliver them (which varies when several threads run it).
        sent: dict[tuple[int, str], int] = {}
        seen = set(roots)
        todo = list(roots)
        while todo:
            node = todo.pop()
            chain = chain_of(node._sequence_nr())
            if floor is not None:
                node.metadata[_CALL_OF_NODE] = calls[chain[0]] if chain else outside
            for k, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                if type(nxt) is _AccumulateGrad:
                    leaf = nxt.variable
                    if id(leaf) in params:
                        # Parameter gradients are recorded after backward; here only a fault
                        # planted in a module whose inputs need no gradient can use this edge
                        # (else it would land in, say, a bias gradient the optimizer of
                        # another model never reads): a parameter of that module or of one
                        # within it (a backbone's first layer, right after the data).
                        planted = next((c for c in chain if calls[c].module == fault.module),
                                       None) if fault_here else None
                        if planted is not None and not calls[planted].inputs and within(
                                params[id(leaf)], fault.module):
                            edges_of.setdefault(node, []).append((k, planted, None))
                        continue
                    target, created = (id(leaf), 0), -1  # a leaf: outside every call
                else:
                    target, created = (id(nxt), nr), nxt._sequence_nr()
                    if nxt not in seen and (floor is None or created >= floor):
                        seen.add(nxt)
                        todo.append(nxt)
                for c in chain if boundaries else ():  # innermost first: stop at the first
                    if calls[c].seq_start <= created:  # call that made `nxt`
                        break
                    slot = slot_name("grad_in", calls[c].inputs.get(target, f"?{nxt.name()}"))
                    n = sent[(c, slot)] = sent.get((c, slot), -1) + 1
                    edges_of.setdefault(node, []).append((k, c, f"{slot}#{n}" if n else slot))
        for node, edges in edges_of.items():
            if node not in self._hooked:  # (hooked by an earlier backward of the step)
                self._hooked.add(node)
                self._step_handles.append(node.register_hook(self._boundary_hook(edges)))

    def backward_key(self, call: Call, slot: str) -> tuple[str, str, int, str]:
        """The key of a backward record of `call`: `slot`, and in the n-th later backward
        pass of the step through the same call (`retain_graph=True`), `slot@n`. (Called
        holding the lock.)"""
        key = (BACKWARD, call.module, call.index, slot)
        n = self._backward_seen[key] = self._backward_seen.get(key, -1) + 1
        return key if n == 0 else (BACKWARD, call.module, call.index, f"{slot}@{n}")

    def _enclosing_calls(self, seq: int) -> list[int]:
        """The forward calls (innermost first) that created the node with sequence nr `seq`.

        Which calls enclose `seq` changes only where a call starts or ends, so the answer is
        kept per interval between those points, rebuilt when a forward call began or ended."""
        if self._seq_index is None:
            self._seq_index = self._seq_index_of(
                [i for i, c in enumerate(self._calls) if c.backward_node is None])
        return _chain_at(self._seq_index, seq)

    def _seq_index_of(self, positions: list[int]) -> SeqIndex:
        """For the calls at `positions`: each point where one starts or ends, and the calls
        enclosing the sequence numbers from there to the next point."""
        calls = self._calls
        points = sorted({p for i in positions for p in (calls[i].seq_start, calls[i].seq_end)})
        order = sorted(positions, key=lambda i: calls[i].seq_start)
        starts = [calls[i].seq_start for i in order]
        return points, [self._enclosing_at(p, order, starts) for p in points]

    def _enclosing_at(self, seq: int, order: list[int], starts: list[int]) -> list[int]:
        """`_enclosing_calls(seq)` the slow way: the last call started, then its ancestors."""
        i = bisect.bisect_right(starts, seq) - 1
        if i < 0:
            return []
        c = order[i]
        chain = []
        while c >= 0:
            call = self._calls[c]
            if call.seq_start <= seq < call.seq_end:
                chain.append(c)
            c = call.parent
        return chain

    def _boundary_hook(self, edges: list[tuple[int, int, str | None]]):
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
            grads = list(grad_inputs)
            changed = False
            fault = self.fault
            for k, c, slot in edges:
                call = self._calls[c]
                grad = grads[k]
                if grad is None:
                    continue
                # (in the first gradient any call of the module sends that can carry 1 ULP:
                # its first call's may be zero, or sent by torch.autograd.grad, as a critic's
                # call on the interpolated samples of a WGAN-GP gradient penalty is)
                if (
                    fault is not None and fault.phase == BACKWARD and fault.step == self._step
                    and fault.module == call.module and not self.fault_fired
                    and has_ulps(grad)
                ):
                    with _disable_current_modes():  # the fault's own ops are not the model's
                        # an all-zero gradient (nothing reached that input) cannot carry 1 ULP
                        if some_nonzero(grad):
                            grads[k] = next_ulp(grad, largest=True)
                            changed = self.fault_fired = True
                        else:
                            self.fault_met_zeros = True
                if slot is not None and self._records_modules:
                    with self._lock:
                        self._keys.append(self.backward_key(call, slot))
                        self.fp.add(grads[k])
            return tuple(grads) if changed else None

        return hook


def index_call(index: CallIndex, position: int, call: Call) -> None:
    children, starting = index
    children.setdefault((call.parent, call.module), []).append(position)
    starting.setdefault((call.seq_start, call.module), []).append(position)


def _chain_at(index: SeqIndex, seq: int) -> list[int]:
    """The calls (innermost first) enclosing sequence number `seq` in `index`."""
    i = bisect.bisect_right(index[0], seq) - 1
    return index[1][i] if i >= 0 else []


def slot_name(prefix: str, path: str) -> str:
    """`prefix.path`, or `prefix` for the empty path (a record's slot)."""
    return f"{prefix}.{path}" if path else prefix
