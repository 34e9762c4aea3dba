from __future__ import annotations

import pytest
import torch
import torchvision
from conftest import SmallCNN, module_audit, small_cnn_probe
from torch import nn

from detaudit import Fault, Probe
from detaudit.record.fingerprint import Fingerprinter
from detaudit.record.recorder import Recorder
from detaudit.seeding import seed_everything

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py


def _maskrcnn_probe(device):
    model = torchvision.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=128, max_size=128
    )
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        masks = torch.zeros(2, 128, 128, dtype=torch.uint8)
        masks[0, 10:60, 12:70] = 1
        masks[1, 40:110, 50:120] = 1
        target = {"boxes": torch.tensor([[12.0, 10, 70, 60], [50, 40, 120, 110]]),
                  "labels": torch.tensor([1, 2]), "masks": masks}
        batches.append(([torch.rand(3, 128, 128, generator=g)], [target]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, weight_decay=5e-4)
    return Probe(model=model, batches=batches, step=lambda m, b: m(*b), optimizer=optimizer)


def _train_plain(factory, steps=3):
    seed_everything(0)
    probe = factory("cpu")
    probe.model.train()
    losses = []
    for batch in list(probe.batches)[:steps]:
        out = probe.step(probe.model, batch)
        total = sum(out.values())
        total.backward()
        probe.optimizer.step()
        probe.optimizer.zero_grad(set_to_none=True)
        losses.append({k: float(v.detach()).hex() for k, v in out.items()})
    return losses, [p.detach().clone() for p in probe.model.parameters()]


@pytest.mark.slow
def test_recording_does_not_perturb_maskrcnn():
    plain_losses, plain_params = _train_plain(_maskrcnn_probe)
    result = module_audit(_maskrcnn_probe, repeats=1, epochs=1, steps=3)
    recorded = [s.losses for s in result.traces[0].steps]
    assert recorded == plain_losses
    # and the parameters after 3 steps: rebuild with recording on and compare bit for bit
    seed_everything(0)
    probe = _maskrcnn_probe("cpu")
    probe.model.train()
    with Recorder(probe.model) as rec:
        for i, batch in enumerate(probe.batches):
            rec.begin_step(i)
            out = probe.step(probe.model, batch)
            total = sum(out.values())
            rec.before_backward(total)
            total.backward()
            rec.record_param_grads()
            probe.optimizer.step()
            probe.optimizer.zero_grad(set_to_none=True)
            rec.end_step()
    for a, b in zip(plain_params, probe.model.parameters()):
        assert torch.equal(a, b.detach())


def test_hooks_are_removed_after_the_audit():
    model = SmallCNN()
    with Recorder(model):
        assert any(m._forward_hooks for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_records_are_keyed_and_called_modules_get_call_indices():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(torch.relu(self.lin(x)))

    def probe(device):
        m = Twice()
        return Probe(model=m, batches=[torch.randn(2, 4)], step=lambda m, b: m(b).sum(),
                     optimizer=torch.optim.SGD(m.parameters(), lr=0.1))

    trace = module_audit(probe, repeats=1).traces[0]
    keys = list(zip(trace.records["phase"], trace.records["module"], trace.records["call"],
                    trace.records["slot"]))
    assert ("forward", "lin", 0, "out") in keys and ("forward", "lin", 1, "out") in keys
    assert ("backward", "lin", 0, "grad_out") in keys and ("backward", "lin", 1, "grad_in.0") in keys
    assert ("backward", "lin", 0, "grad_in.0") not in keys  # its input needs no gradient
    assert len(keys) == len(set(zip(trace.records["step"], *zip(*keys))))  # keys are unique
    # backward records come in execution order: the second call's gradient first
    backward = [k for k in keys if k[0] == "backward" and k[1] == "lin"]
    assert backward[0][2] == 1


def test_rng_use_is_recorded_per_module_call():
    def probe(device):
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        return Probe(model=m, batches=[torch.randn(2, 4)], step=lambda m, b: m(b).sum(),
                     optimizer=torch.optim.SGD(m.parameters(), lr=0.1))

    trace = module_audit(probe, repeats=1).traces[0]
    rng = {(m, s) for m, s in zip(trace.records["module"], trace.records["slot"]) if "rng" in s}
    assert ("1", "rng.out") in rng and ("0", "rng.out") not in rng


def test_small_cnn_records_every_phase():
    trace = module_audit(small_cnn_probe, repeats=1, steps=1).traces[0]
    phases = set(trace.records["phase"])
    assert {"state", "forward", "backward", "grad", "optimizer", "output"} <= phases
    slots = set(trace.records["slot"])
    assert {"batch.0", "batch.1", "rng.torch", "rng.numpy", "rng.python"} <= slots


def test_gradient_hooks_from_several_threads_keep_each_key_with_its_print():
    """Backward across devices runs hooks on several autograd threads at once: every record
    must still carry its own tensor's print."""
    import sys

    from detaudit.record.fingerprint import fingerprint

    model = torch.nn.Linear(2, 2)
    grads = {f"grad_out.{i}": torch.full((64,), float(i)) for i in range(256)}
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes
    try:
        records = _hooks_from_threads(model, grads)
    finally:
        sys.setswitchinterval(switch)
    printed = {key[3]: p.fp for key, p in zip(records.keys, records.prints)}
    assert printed == {slot: fingerprint(g).fp for slot, g in grads.items()}


def _hooks_from_threads(model, grads):
    import threading

    from detaudit.record.recorder import Call

    with Recorder(model) as recorder:
        recorder.begin_step(0)
        call = Call("worker", 0, -1)
        hooks = [(recorder._grad_out_hook(call, slot), g) for slot, g in grads.items()]
        start = threading.Barrier(8)

        def run(part):
            start.wait()
            for hook, grad in part:
                hook(grad)

        threads = [threading.Thread(target=run, args=(hooks[i::8],)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return recorder.end_step()


def test_the_order_threads_deliver_gradients_in_is_not_a_divergence():
    """Two repeats whose backward hooks ran in opposite orders (as autograd threads on two
    devices may) record the same keys and prints: the comparison finds nothing."""
    from detaudit.analysis.compare import compare
    from detaudit.drivers.runner import store_records
    from detaudit.record.recorder import Call
    from detaudit.trace import Trace

    model = torch.nn.Linear(2, 2)
    grads = [(f"grad_out.{i}", torch.full((8,), float(i))) for i in range(32)]
    traces = []
    for repeat, order in enumerate((grads, grads[::-1])):
        with Recorder(model) as recorder:
            recorder.begin_step(0)
            call = Call("worker", 0, -1)
            for slot, grad in order:
                recorder._grad_out_hook(call, slot)(grad)
            trace = Trace(probe={}, repeat=repeat, env={})
            store_records(trace, 0, recorder.end_step())
        traces.append(trace)
    assert traces[0].records["slot"] != traces[1].records["slot"]  # delivered differently
    comparison = compare(traces)
    assert comparison.deterministic and comparison.total_records == 32
    # and a real difference among them is still found, by key
    traces[1].records["fp"][5] = "0" * 16
    assert compare(traces).first_diffs[0].slot == traces[1].records["slot"][5]


def test_the_batch_a_run_records_is_printed_as_loaded_and_a_model_call_as_computed():
    """`run` records the probe's batch before its step moves it: as loaded (xxh3 on the CPU,
    integers too); a batch recorded as the model is called with it keeps wsum for integers,
    so a CPU run and a GPU run compare them bitwise."""
    from detaudit import audit
    from detaudit.record.fingerprint import fingerprint

    labels = torch.tensor([[1, 3], [2, 0]])
    probe = Probe(model=SmallCNN(), batches=[(torch.randn(2, 3, 16, 16), labels)],
                  step=lambda m, b: {"loss": m(b[0]).sum()},
                  optimizer=None)
    frame = audit(lambda device: probe, repeats=1, steps=1, mode="train").traces[0].frame()
    printed = frame[(frame.phase == "state") & frame.slot.str.startswith("batch")]
    assert fingerprint(labels, "xxh3").fp in set(printed.fp)
    with Recorder(SmallCNN(), watch="none") as recorder:
        recorder.begin_step(0)
        recorder.record_state((labels,))
        computed = recorder.end_step()
    assert fingerprint(labels, "wsum").fp in {p.fp for p in computed.prints}


def test_gradients_into_a_call_are_named_by_its_inputs_whatever_python_does_with_wrappers():
    """A grad_fn's Python wrapper dies when nothing holds it; the backward walk must still
    match the node to the call's input (on CUDA the wrappers' addresses were reused)."""

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Linear(4, 4)
            self.heads = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            feats = [torch.tanh(self.stem(x) + i) for i in range(3)]
            outs, self.held = [], []
            for head, f in zip(self.heads, feats):
                outs.append(head(f))
                # a fresh wrapper of another node, held: it takes the address just freed
                self.held.append((self.stem.weight * 1).grad_fn)
            return sum(o.sum() for o in outs)

    def probe(device):
        m = Branches()
        return Probe(model=m, batches=[torch.randn(2, 4)], step=lambda m, b: m(b),
                     optimizer=torch.optim.SGD(m.parameters(), lr=0.1))

    trace = module_audit(probe, repeats=1).traces[0]
    slots = {(m, s) for p, m, s in zip(trace.records["phase"], trace.records["module"],
                                       trace.records["slot"]) if p == "backward"}
    for k in range(3):
        assert (f"heads.{k}", "grad_in.0") in slots
    assert not [s for _, s in slots if "?" in s]


def _mean_square_probe(build):
    """A probe training `build()` (6 features in) on 3 seeded batches, loss mean(out²), SGD."""

    def probe(device):
        torch.manual_seed(0)
        m = build()
        g = torch.Generator().manual_seed(1)
        return Probe(model=m, batches=[torch.randn(4, 6, generator=g) for _ in range(3)],
                     step=lambda m, b: m(b).pow(2).mean(),
                     optimizer=torch.optim.SGD(m.parameters(), lr=0.1))

    return probe


def test_a_backward_fault_in_a_container_right_after_the_data_fires_in_its_parameters():
    """A backbone whose input needs no gradient sends none back: the fault lands in the
    gradient of a parameter inside it (it never fired when planted on the container)."""

    def build():
        return torch.nn.Sequential(
            torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6)),
            torch.nn.Linear(6, 1))

    result = module_audit(_mean_square_probe(build), repeats=2, fault=Fault("0", "backward", 1))
    origin = result.comparison.origins[0]
    assert (origin.phase, origin.step) == ("backward", 1)
    assert origin.module.startswith("0.")  # the layer inside it whose gradient it changed


def test_a_backward_fault_in_a_linear_goes_into_the_gradient_of_its_input():
    """addmm's backward sends the bias gradient first: a planted backward fault must still
    land in the gradient the module sends back to its input, which every model reads (a
    bias gradient may be one another model's optimizer never uses, as in a GAN)."""

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(6, 6) for _ in range(3))

        def forward(self, x):
            return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    result = module_audit(_mean_square_probe(MLP), repeats=2, fault=Fault("fc2", "backward", 1))
    origin = result.comparison.origins[0]
    assert (origin.module, origin.phase, origin.step) == ("fc2", "backward", 1)
    assert origin.slots == ["grad_in.0"]


class _Checkpointed(torch.nn.Module):
    """fc1, then a block of two layers run under a reentrant checkpoint (or plainly)."""

    def __init__(self, checkpointed: bool = True):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 6)
        self.block = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(),
                                         torch.nn.Linear(6, 1))
        self.checkpointed = checkpointed

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if not self.checkpointed:
            return self.block(h)
        return torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)


@pytest.mark.parametrize("module", ["block", "block.2"])
def test_a_backward_fault_under_a_reentrant_checkpoint_fires_in_its_module(module):
    """A reentrant checkpoint runs the block again inside backward: the fault fires there
    (it never fired) and the block's own gradient, not fc1's, is the origin."""
    result = module_audit(_mean_square_probe(_Checkpointed), repeats=2,
                          fault=Fault(module, "backward", 1))
    origin = result.comparison.origins[0]
    assert (origin.module, origin.phase, origin.step) == (module, "backward", 1)
    assert origin.slots == ["grad_in.0"]


def _one_step_records(checkpointed):
    torch.manual_seed(0)
    model = _Checkpointed(checkpointed)
    with Recorder(model) as recorder:
        recorder.begin_step(0)
        loss = model(torch.randn(4, 6)).pow(2).mean()
        recorder.before_backward(loss)
        loss.backward()
        records = recorder.end_step()
    return {key: p.fp for key, p in zip(records.keys, records.prints)}, [
        (c.module, c.index, c.parent) for c in records.calls]


def test_a_reentrant_checkpoint_records_what_the_plain_model_records():
    """Recomputed in backward, the block's calls keep their forward identity: its backward
    records are keyed (and valued) as without the checkpoint, and the call tree is the
    forward's, without the recomputation."""
    plain, plain_calls = _one_step_records(checkpointed=False)
    checkpointed, calls = _one_step_records(checkpointed=True)
    assert checkpointed == plain
    assert calls == plain_calls


class _Spectral(torch.nn.Module):
    """A linear layer, rfft, a complex filter, irfft: complex outputs and gradients."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.to_freq = _Call(lambda x: torch.fft.rfft(x, dim=-1))
        self.filt = _Call(lambda f: f * self.filt.weight)
        self.filt.weight = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
        self.from_freq = _Call(lambda f: torch.fft.irfft(f, n=6, dim=-1))

    def forward(self, x):
        return self.from_freq(self.filt(self.to_freq(self.fc(x))))


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("module,phase,slot", [("to_freq", "forward", "out"),
                                               ("filt", "forward", "out"),
                                               ("filt", "backward", "grad_in.0")])
def test_a_fault_in_a_module_with_complex_values_changes_one_part_by_one_ulp(module, phase, slot):
    """A module whose output (or input gradient) is complex has no real floating tensor:
    the fault moves one real part by 1 ULP (it never fired)."""
    result = module_audit(_mean_square_probe(_Spectral), repeats=2, fault=Fault(module, phase, 1))
    origin = result.comparison.origins[0]
    assert (origin.module, origin.phase, origin.step, origin.slots) == (module, phase, 1, [slot])


def test_labels_beside_the_tensors_of_an_inference_output_are_compared():
    """An inference step's output holds labels and counts beside its tensors: each is a
    record under its path, so detections whose labels differ diverge (they passed)."""
    labels = iter(["cat", "dog"])  # one per repeat

    def probe(device):
        model = torch.nn.Linear(4, 2)
        label = next(labels)

        def step(m, batch):
            return [{"scores": m(batch), "label": label, "rank": 3, "box": None}]

        return Probe(model=model, batches=[torch.ones(2, 4)], step=step)

    result = module_audit(probe, repeats=2, mode="infer")
    slots = [s for p, s in zip(result.traces[0].records["phase"], result.traces[0].records["slot"])
             if p == "output"]
    assert slots == ["detections.0.scores", "detections.0.label", "detections.0.rank",
                     "detections.0.box"]
    assert not result.deterministic
    assert [d.slot for d in result.comparison.first_diffs] == ["detections.0.label"]


class _Carry(torch.autograd.Function):
    """An identity whose ctx holds another tensor as `variable` (as a user's Function may)."""

    @staticmethod
    def forward(ctx, x, held):
        ctx.variable = held
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Reading(nn.Module):
    """`inner` is called with the model's `table` weight (repeated over the batch), with an
    activation, and with an activation made by a Function whose ctx holds that weight."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.table, self.inner = nn.Linear(4, 4), nn.Embedding(3, 4), nn.Bilinear(4, 4, 1)

    def forward(self, x):
        repeated = self.table.weight.unsqueeze(0).repeat(x.shape[0], 1, 1)[:, 0]
        hidden = self.stem(x)
        return (self.inner(hidden, repeated) + self.inner(hidden, hidden)
                + self.inner(_Carry.apply(hidden, self.table.weight), hidden))


def test_a_call_given_a_parameter_or_a_copy_of_one_reads_its_module():
    model = _Reading()
    with Recorder(model) as recorder:
        recorder.begin_step(0)
        model(torch.ones(2, 4)).sum().backward()
        calls = recorder.end_step().calls
    assert [(c.module, c.index, c.reads) for c in calls] == [
        ("", 0, []), ("stem", 0, []), ("inner", 0, ["table"]), ("inner", 1, []),
        ("inner", 2, [])]


def test_sharded_and_tensor_parallel_models_are_told_apart(tmp_path):
    """The cross-rank checks leave out the parameters each rank holds a shard of (FSDP2,
    tensor parallelism) and the gradients each holds a partial sum of (SequenceParallel),
    and tensor parallelism alone gives a group's ranks the same batches: FSDP2 (and HSDP)
    shard each parameter on one mesh dimension, tensor parallelism without FSDP or on a
    second one."""
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    tp = pytest.importorskip("torch.distributed.tensor.parallel")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (fully_shard)")
    from torch.distributed.device_mesh import init_device_mesh

    def told(model):
        recorder = Recorder(model, Fingerprinter())
        return recorder.tensor_parallel(), recorder.sharded_parameters()

    def net():
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    everything = ["0.weight", "0.bias", "1.weight", "1.bias"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        assert told(net()) == (False, [])
        model = net()
        fsdp.fully_shard(model)
        assert told(model) == (False, everything)
        model = net()
        fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (1, 1),
                                                      mesh_dim_names=("replicate", "shard")))
        assert told(model) == (False, everything)  # HSDP
        model = net()
        tp.parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": tp.ColwiseParallel()})
        assert told(model) == (True, ["0.weight", "0.bias"])
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model = net()
        tp.parallelize_module(model, mesh["tp"], {"0": tp.ColwiseParallel()})
        fsdp.fully_shard(model, mesh=mesh["dp"])
        assert told(model) == (True, everything)
        model = net()  # tensor parallel in one layer, FSDP2 in the other
        tp.parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": tp.ColwiseParallel()})
        fsdp.fully_shard(model[1])
        assert told(model) == (True, everything)
        # SequenceParallel's norm: replicated weights whose gradients are partial sums
        from torch.distributed.tensor import Shard

        model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 2))
        tp.parallelize_module(model, init_device_mesh("cpu", (1,)), {
            "0": tp.SequenceParallel(), "1": tp.ColwiseParallel(input_layouts=Shard(1)),
            "2": tp.RowwiseParallel()})
        model(torch.randn(2, 3, 4)).sum().backward()
        recorder = Recorder(model, Fingerprinter())
        recorder.record_param_grads()
        assert recorder.partial_gradients() == ["0.bias", "0.weight"]
        assert "0.weight" not in recorder.sharded_parameters()
    finally:
        dist.destroy_process_group()


def test_module_hooks_removed_while_a_call_begins_do_nothing_in_that_call():
    """Torch runs the hooks a call began with: a hook removed from a call under way (a run
    that turns from inference to training at the model's first training call, inside a
    global pre-hook) was still called, without its keyword arguments, and raised."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with Recorder(model) as recorder:
        recorder.begin_step(0)
        removing = nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: recorder.hook_for("none"))
        try:
            model(torch.ones(1, 2))
        finally:
            removing.remove()
        assert not recorder._handles
        model(torch.ones(1, 2))  # (and no hook is left on the model)
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


class _LossMadeAtItsFirstCall(torch.nn.Module):
    """Ultralytics' models make their loss module at their first loss call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 1)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "criterion"):
            self.criterion = torch.nn.SmoothL1Loss()
        return self.criterion(self.body(x), torch.zeros(len(x), 1))


def test_a_module_the_model_gains_after_its_hooks_went_in_is_recorded_by_its_name():
    """Hooked for step 0 (a stressed epoch's first step follows its calls) before its loss
    module existed, the first run of an RT-DETR audit never recorded that module's calls;
    the second, hooked at step 1, did, and the audit said control flow forked there."""
    model = _LossMadeAtItsFirstCall()
    with Recorder(model, watch="none") as recorder:
        modules_called = []
        for step, watch in enumerate(("calls", "module")):
            recorder.begin_step(step, watch)
            model.loss(torch.ones(2, 4)).backward()
            modules_called.append({call.module for call in recorder.end_step().calls})
    assert modules_called[1] == {"body", "criterion"}
