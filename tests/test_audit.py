"""The engine finds real and planted divergences, names origin, step and cause, and stays
quiet on deterministic runs."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
from typing import ClassVar

import pytest
import torch
from conftest import gather_probe, module_audit, small_cnn_probe, unseeded_probe
from test_recorder import _maskrcnn_probe
from torch import nn

from detaudit import Fault, Probe, audit
from detaudit.analysis.causes import cause_text
from detaudit.analysis.compare import CONTAINS, ORIGIN, PROPAGATED, CallFinding
from detaudit.analysis.verdict import first_divergence
from detaudit.drivers.loading import builtin_spec, make_factory
from detaudit.errors import DetauditError
from detaudit.report import render_console

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py


def _roles(comparison, step, phase):
    return {f.module: f.role for f in comparison.findings if f.step == step and f.phase == phase}


def _summary(result):
    return result.summary


def test_no_false_alarm_over_five_repeats():
    result = module_audit(small_cnn_probe, repeats=5, epochs=2)
    c = result.comparison
    assert c.deterministic
    assert c.differing_records == 0 and c.first_step is None and c.cause == "none"
    assert c.total_records > 300
    assert "DETERMINISTIC" in render_console(_summary(result))


def test_planted_forward_fault_is_localised():
    result = module_audit(small_cnn_probe, repeats=3, epochs=1, fault=Fault("block1.conv", "forward", 2))
    c = result.comparison
    assert c.first_step == 2 and c.cause == "forward"
    assert c.first_by_phase["forward"].module == "block1.conv"
    assert [(o.module, o.phase) for o in c.origins] == [("block1.conv", "forward")]
    roles = _roles(c, 2, "forward")
    assert roles["block1"] == CONTAINS  # the parent is not the origin
    assert roles["block1.act"] == PROPAGATED  # nor is the child after it
    assert roles["block2"] == PROPAGATED
    assert roles.get("") in (None, CONTAINS)  # the model itself, if its output changed
    assert {m for m, r in roles.items() if r != PROPAGATED} <= {"block1.conv", "block1", ""}
    assert "stem" not in roles  # upstream stays equal
    first = next(f for f in c.origins)
    assert first.differing == 1  # only the faulty repeat of 3 differs


def test_planted_backward_fault_is_localised():
    result = module_audit(small_cnn_probe, repeats=2, epochs=1, fault=Fault("block2.conv", "backward", 1))
    c = result.comparison
    assert c.first_step == 1 and c.cause == "backward"
    assert "forward" not in c.first_by_phase
    assert [(o.module, o.phase) for o in c.origins] == [("block2.conv", "backward")]
    roles = _roles(c, 1, "backward")
    assert roles["block2"] == CONTAINS
    assert roles["block1"] == PROPAGATED and roles["stem"] == PROPAGATED
    assert "head" not in roles  # downstream in forward = upstream in backward: unchanged
    # whether 1 ULP in one gradient element survives the weight-gradient sums depends on the
    # CPU's kernels; when it does, it shows from step 1 on, never earlier
    assert c.param_drift_step in (None, 1, 2)
    assert set(c.first_by_phase) <= {"backward", "grad", "optimizer", "output"}


def test_fault_in_module_without_input_gradient_uses_its_parameter_gradient():
    result = module_audit(small_cnn_probe, repeats=2, epochs=1, fault=Fault("stem", "backward", 0))
    c = result.comparison
    assert c.first_step == 0 and c.cause == "backward"
    assert [(o.module, o.phase) for o in c.origins] == [("stem", "backward")]


class _Decoding(nn.Module):
    """Takes the model's learned queries as an input, as DETR's transformer does, and their
    positions repeated over the batch, as Hugging Face's DETR does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, memory: torch.Tensor, queries: torch.Tensor, *,
                positions: torch.Tensor) -> torch.Tensor:
        return self.lin(memory + queries + positions)


class _Attending(nn.Module):
    """Queries attending over the input: `nn.MultiheadAttention` reads its `out_proj`
    weight without calling it, as DETR's decoder does, and `query`'s weight is passed to
    the decoding module, as DETR's `query_embed.weight` is (`position`'s, repeated over the
    batch, as Hugging Face's DETR passes its `query_position_embeddings`). `emb`, never
    called either, is
    read by the model itself; `perturbed` (repeat, step) adds 1 ULP to its weight's
    gradient there, as a racing accumulation would."""

    perturbed: ClassVar[tuple[int, int] | None] = None
    calls: ClassVar[dict[str, int]] = {"repeat": -1, "step": -1}

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.emb = nn.Embedding(6, 8)
        self.query = nn.Embedding(6, 8)
        self.position = nn.Embedding(6, 8)
        self.decoding = _Decoding()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.decoding(
            self.attn(self.queries(x), x, x, need_weights=False)[0], self.query.weight,
            positions=self.position.weight.unsqueeze(0).repeat(x.shape[0], 1, 1))
        return self.head(attended + _OneUlpInBackward.apply(self.emb.weight)[:x.shape[1]])


class _OneUlpInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if (_Attending.calls["repeat"], _Attending.calls["step"]) == _Attending.perturbed:
            grad = grad.clone()
            grad.view(-1)[0] = torch.nextafter(grad.view(-1)[0], torch.tensor(math.inf))
        return grad


def _attending_probe(device: torch.device) -> Probe:
    _Attending.calls.update(repeat=_Attending.calls["repeat"] + 1, step=-1)
    model = _Attending().to(device)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(2, 6, 8, generator=g) for _ in range(3)]

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        _Attending.calls["step"] += 1
        return m(x.to(device)).pow(2).mean()

    return Probe(model=model, batches=batches, step=step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("own_difference", [False, True])
def test_a_module_whose_weight_another_reads_is_downstream_of_it_not_an_origin(own_difference):
    """A backward fault in the head changes the gradients of the attention's `out_proj`,
    `query` and `position`, modules never called: they are downstream, in the attention's
    call and in the call their weights were passed to, not origins of their own. The embedding, never
    called either and read by the model alone, stays an origin where its own gradient
    changed in that step (nothing says it came from the head)."""
    _Attending.calls["repeat"], _Attending.perturbed = -1, (1, 1) if own_difference else None
    try:
        result = module_audit(_attending_probe, repeats=2, epochs=1,
                              fault=Fault("head", "backward", 1))
    finally:
        _Attending.perturbed = None
    calls = result.traces[0].calls
    assert {(m, tuple(r)) for m, r in zip(calls["module"], calls["reads"]) if r} == {
        ("decoding", ("query", "position"))}
    c = result.comparison
    assert (c.first_step, c.cause) == (1, "backward")
    assert {"attn.out_proj", "query", "position"} <= {m for s, m, _ in c.grad_diffs if s == 1}
    assert _roles(c, 1, "backward")["attn"] == PROPAGATED
    assert [(o.module, o.phase) for o in c.origins] == [("head", "backward")] + (
        [("emb", "backward")] if own_difference else [])


@pytest.mark.slow
def test_planted_backward_fault_in_maskrcnn_at_module_level():
    """Every step recorded at module level (backward by scan + zoom: tests/test_cli.py)."""
    module, phase = "roi_heads.box_roi_pool", "backward"
    result = module_audit(_maskrcnn_probe, repeats=2, epochs=1, steps=2, fault=Fault(module, phase, 1))
    c = result.comparison
    assert c.first_step == 1 and c.cause == phase
    origin = c.origins[0]
    assert (origin.module, origin.phase) == (module, phase)
    assert _roles(c, 1, phase).get("roi_heads") in (None, CONTAINS)
    assert not any(f.role == ORIGIN and f.module != module for f in c.findings if f.step == 1)


@pytest.mark.slow
def test_planted_forward_fault_in_maskrcnn_by_scan_and_zoom():
    """The default scan, then the zoom into step 2; roi_heads' backward, which reuses the
    changed activations of the pool inside it, is not a second origin."""
    module, phase = "roi_heads.box_roi_pool", "forward"
    small = make_factory(builtin_spec("maskrcnn", {"image_size": 64, "num_images": 3,
                                                   "batch_size": 1}))
    result = audit(small, repeats=2, epochs=1, steps=3, stress=0, fault=Fault(module, phase, 2))
    assert result.config.granularity == "scan"
    assert result.investigations["zoom"]["status"] == "found"
    c = result.comparison
    assert (c.first_step, c.cause) == (2, phase)
    assert [(o.module, o.phase, o.step) for o in c.origins] == [(module, phase, 2)]
    assert _roles(c, 2, "backward").get("roi_heads") in (None, PROPAGATED)


@pytest.mark.alone  # a real race must fire
def test_real_cpu_nondeterminism_in_duplicate_index_gather(two_threads):
    result = module_audit(gather_probe, repeats=3, epochs=1)
    c = result.comparison
    # The race is proven by re-execution whether or not it fired between the repeats.
    assert result.verdict.exit_code == 1
    assert [(p.module, p.phase, p.base_op) for p in c.proven] == [
        ("gather", "backward", "aten.index_put")]
    if c.first_step is None:  # the threads did not race between repeats this time
        assert result.verdict.headline.startswith("NONDETERMINISTIC OP: aten.index_put in gather")
        return
    assert c.cause == "backward"  # at the first step where the threads raced (luck: often 0)
    assert [(o.module, o.phase) for o in c.origins] == [("gather", "backward")]
    assert c.first_by_phase["backward"].module == "gather"
    assert c.param_drift_step == c.first_step
    text = render_console(_summary(result))
    if c.loss.first_step is None:  # (an update may round the gradients' difference away)
        assert c.drifted in ("parameters", "gradients")
        assert f"loss stayed bit-identical while {c.drifted} diverged" in text
    else:
        assert f"loss first differs at step {c.loss.first_step}" in text


def test_same_gather_on_one_thread_is_deterministic():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert module_audit(gather_probe, repeats=2).comparison.deterministic
    finally:
        torch.set_num_threads(before)


def test_unseeded_augmentation_is_a_data_cause():
    result = module_audit(unseeded_probe, repeats=2)
    c = result.comparison
    assert c.first_step == 0 and c.cause == "data"
    assert "step 0 (epoch 1), state, batch (first record); cause: data" in (
        result.verdict.headline)
    assert c.first_by_phase["state"].slot.startswith("batch")
    # a module found where the batch differs only sees it: the batch is the first
    # divergence (a scan's gradient was named the origin, with cause: data)
    seen = CallFinding(0, "backward", "fc", 0, ORIGIN, ["param.weight"], 1, 2)
    first = first_divergence(dataclasses.replace(c, findings=[seen, *c.findings]))
    assert (first["phase"], first["role"]) == ("state", "first record")
    assert first["slots"][0].startswith("batch")


def test_a_backward_fault_where_the_module_sends_only_zero_gradients_says_so():
    """A module whose every input gradient is zero (what follows it multiplies by zero, as
    DETR's first decoder layer's softmax cancels) did run backward: the fault was refused
    as planted in a module that "did not run backward", a frozen layer."""
    class Zero(nn.Module):
        def forward(self, x):
            return x * 0

    def probe(device: torch.device) -> Probe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Zero(), nn.Linear(4, 1))
        return Probe(model=model, batches=[torch.randn(2, 4)], step=lambda m, b: m(b).sum(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    with pytest.raises(DetauditError) as refused:
        module_audit(probe, repeats=2, epochs=1, steps=1, fault=Fault("1", "backward", 0))
    said = str(refused.value)
    assert ("module '1' ran backward at step 0 of 1 recorded step, but every gradient it sent "
            "to its inputs was all zero") in said, said
    assert "frozen" not in said


@pytest.mark.parametrize("fault_step", [1, 0])
def test_a_fault_planted_after_the_runs_already_part_is_said_not_to_be_the_finding(fault_step):
    """Unseeded data parts the runs at step 0; a fault planted at step 1 was never mentioned,
    so the finding read as the fault's. The report says the fault came later and what to
    do; a fault at the step where they part gets no such note."""
    result = module_audit(unseeded_probe, repeats=2, fault=Fault("2", "forward", fault_step))
    assert (result.comparison.first_step, result.comparison.cause) == (0, "data")
    console = render_console(_summary(result))
    note = ("note: the fault planted at step 1 (2@forward:1) comes after step 0, where the "
            "runs already part, so it is not what was found there")
    assert (note in console) == (fault_step == 1), console


@pytest.mark.parametrize("version", ["2.0.8", "1.4.24", None])
def test_a_data_cause_says_how_to_seed_an_augmentation_library_no_global_seed_reaches(
        monkeypatch, version):
    """albumentations 2's Compose draws from a generator of its own: a Kaggle-style script
    seeded everything and ran under --seed 0, and its batches still differed. Where the run
    imported it, the cause says how to seed it; not for an older one (it drew from the
    global RNGs), nor where it was not imported."""
    if version is None:
        monkeypatch.delitem(sys.modules, "albumentations", raising=False)
    else:
        monkeypatch.setitem(sys.modules, "albumentations",
                            types.SimpleNamespace(__version__=version))
    result = module_audit(unseeded_probe, repeats=2)
    text = result.summary["cause"]["text"]
    assert result.comparison.cause == "data"
    assert (f"the run imported albumentations {version}" in text) == (version == "2.0.8")
    assert ("(fix: A.Compose([...], seed=0))" in text) == (version == "2.0.8")


class _LossInside(nn.Module):
    """Computes its loss itself and returns it with an intermediate (as DETR returns its
    encoder's output): that output is also read inside, upstream of `dec`."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        memory = self.enc(x)
        return {"loss": (self.dec(memory) - y).pow(2).mean(), "memory": memory}


def test_a_backward_fault_inside_a_model_that_returns_an_intermediate_is_no_outside_cause():
    """The gradient entering the returned intermediate differs (it comes back through
    `dec`), yet the difference began inside the model: not "computed outside the model"."""
    def probe(device: torch.device) -> Probe:
        torch.manual_seed(0)
        model = _LossInside().to(device)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
                   for _ in range(3)]
        return Probe(model=model, batches=batches, step=lambda m, b: m(*b)["loss"],
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    c = module_audit(probe, repeats=2, fault=Fault("dec", "backward", 1)).comparison
    assert (c.first_step, c.cause, [(o.module, o.phase) for o in c.origins]) == (
        1, "backward", [("dec", "backward")])
    assert cause_text(c).startswith("a backward computation gave different gradients")


_DRAWS = {"calls": 0}


class LeakySampler(nn.Module):
    """Draws a data-dependent number of random values; how many also depends on state
    left over from earlier repeats, as samplers with caches do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _DRAWS["calls"] += 1
        count = int((x > 0).sum()) + _DRAWS["calls"] % 2
        torch.rand(count)  # the draw is used for nothing the output depends on
        return x


def test_module_drawing_a_varying_amount_of_randomness_is_an_rng_cause():
    def probe(device):
        model = nn.Sequential(nn.Linear(8, 8), LeakySampler(), nn.Dropout(0.5), nn.Linear(8, 2))
        g = torch.Generator().manual_seed(0)
        data = [torch.randn(4, 8, generator=g) for _ in range(3)]
        return Probe(model=model, batches=data, step=lambda m, b: m(b).pow(2).mean(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    _DRAWS["calls"] = 0
    c = module_audit(probe, repeats=2).comparison
    assert c.first_step == 0 and c.cause == "rng"
    origin = c.origins[0]
    assert origin.module == "1" and origin.rng and origin.phase == "forward"
    assert _roles(c, 0, "forward").get("2") == PROPAGATED  # dropout then draws other values


def test_a_generator_reseeded_during_the_step_is_an_rng_cause_named_at_its_draw():
    """torch.seed() in the step, then noise from it outside the model: every RNG state agrees
    as the step begins, the drill-down finds aten.rand_like with equal inputs and differing
    outputs. Its generator is the input that differs (it was `cause: forward`)."""
    def probe(device):
        model = nn.Linear(8, 2)
        g = torch.Generator().manual_seed(0)
        data = [torch.randn(4, 8, generator=g) for _ in range(2)]

        def step(m, b):
            torch.seed()
            return m(b + 0.01 * torch.rand_like(b)).pow(2).mean()

        return Probe(model=model, batches=data, step=step,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    try:
        result = audit(probe, repeats=2, steps=2)
    finally:
        torch.manual_seed(0)  # (torch.seed() left the global generator unseeded)
    summary = result.summary
    assert result.verdict.exit_code == 1 and summary["ops"][0]["op"] == "aten.rand_like"
    assert summary["cause"]["kind"] == "rng" and "cause: rng" in result.verdict.headline
    assert summary["cause"]["text"].startswith("aten.rand_like in (outside the model) drew "
                                               "different random numbers from equal inputs")
    assert "its generator's state differs" in render_console(summary)


class Keep(nn.Module):
    """Returns one tensor, or two on some repeats: control flow that forks."""

    def forward(self, x):
        _DRAWS["calls"] += 1
        return (x, x * 2) if _DRAWS["calls"] % 2 == 0 else (x,)


def test_forked_control_flow_is_aligned_by_key():
    def probe(device):
        model = nn.Sequential(nn.Linear(4, 4), Keep())
        return Probe(model=model, batches=[torch.randn(2, 4)],
                     step=lambda m, b: sum(t.sum() for t in m(b)), optimizer=None)

    _DRAWS["calls"] = 0
    c = module_audit(probe, repeats=2).comparison
    assert c.fork is not None and c.fork.module == "1" and c.fork.missing == 1
    # what can be paired still is: the Linear before the fork agrees
    assert ("0", "forward") not in {(f.module, f.phase) for f in c.findings}


class _SharedHead(nn.Module):
    """One `shared` head applied to two branches in a forward, as an FPN head over levels."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.shared = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.a(x)) + self.shared(self.b(x))


class _SharedOnData(nn.Module):
    """`shared` called twice straight on the data: its inputs need no gradient. Backward
    sends the second call's gradients first, and the fault is planted there; the first
    call's are small, so 1 ULP survives their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1e-3 * self.shared(x) + self.shared(2 * x)


def _shared_probe(model: type[nn.Module]):
    """A factory of probes training a fresh `model` on three random batches."""

    def factory(device: torch.device) -> Probe:
        net = model().to(device)
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g))
                   for _ in range(3)]

        def step(m: nn.Module, batch):
            x, y = batch
            return {"mse": (m(x.to(device)) - y.to(device)).pow(2).mean()}

        return Probe(model=net, batches=batches, step=step,
                     optimizer=torch.optim.SGD(net.parameters(), lr=0.1))

    return factory


@pytest.mark.parametrize("model, fault, origin", [
    (_SharedHead, Fault("b", "forward", 1), ("b", "forward")),
    (_SharedHead, Fault("shared", "forward", 1), ("shared", "forward")),
    (_SharedHead, Fault("shared", "backward", 1), ("shared", "backward")),
    (_SharedOnData, Fault("shared", "backward", 1), ("shared", "backward")),
])
def test_module_called_twice_is_an_origin_only_where_its_calls_say(model, fault, origin) -> None:
    """A parameter gradient sums over every call of its module: a difference entering at a
    later call (b's output into shared's call 1) makes it differ downstream, not at an origin."""
    c = module_audit(_shared_probe(model), repeats=2, epochs=1, fault=fault).comparison
    assert c.first_step == 1
    assert [(o.module, o.phase) for o in c.origins] == [origin]
    if fault.module == "b":  # shared's parameter gradient did differ, downstream of b
        assert (1, "shared", "weight") in c.grad_diffs


class _Critic(nn.Module):
    """A piecewise-linear critic: the gradient of its input gradient with respect to its
    input is zero."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.act, self.out = nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.first(x)))


def _gradient_penalty_probe(device: torch.device) -> Probe:
    """A WGAN-GP critic's steps: its first call, on samples mixed from real and fake ones,
    is taken apart by torch.autograd.grad for the gradient penalty, before the loss's
    backward."""
    torch.manual_seed(0)
    critic = _Critic().to(device)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randn(4, 8, generator=g) for _ in range(2))
               + (torch.rand(4, 1, generator=g),) for _ in range(3)]

    def step(m: nn.Module, batch):
        real, fake, mix = (t.to(device) for t in batch)
        mixed = (mix * real + (1 - mix) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(m(mixed).sum(), mixed, create_graph=True)
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        return m(fake).mean() - m(real).mean() + 10 * penalty

    return Probe(model=critic, batches=batches, step=step,
                 optimizer=torch.optim.SGD(critic.parameters(), lr=0.01))


@pytest.mark.parametrize("module", ["first", "out"])
def test_a_backward_fault_in_a_critic_whose_first_call_makes_its_gradient_penalty_is_found(
        module):
    """The loss's backward sends the first call's layers zero gradients (or none): the
    fault was planted there only, and never fired. It is planted in the first gradient of
    the module that can carry 1 ULP, a later call's."""
    c = module_audit(_gradient_penalty_probe, repeats=2, epochs=1,
                     fault=Fault(module, "backward", 1)).comparison
    assert c.first_step == 1
    assert [(o.module, o.phase) for o in c.origins] == [(module, "backward")]


def _rounded_away(device: torch.device, lr: float = 1e-12, steps: int = 3) -> Probe:
    """A step whose update is too small to change any parameter (lr 1e-12)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    batches = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
               for i in range(steps)]
    return Probe(model=model, batches=batches, step=lambda m, x: m(x).pow(2).mean(),
                 optimizer=torch.optim.SGD(model.parameters(), lr=lr))


@pytest.mark.parametrize("probe", [
    _rounded_away,
    # the update changes the parameters in the same step (the last: no loss after it)
    functools.partial(_rounded_away, lr=1.0, steps=2),
], ids=["update rounded away", "update in the same step"])
def test_gradients_that_differ_while_parameters_and_loss_agree_are_called_gradients(probe):
    """A backward difference: the gradients differ first, whether or not the update made
    from them rounds away, yet the headline said "the loss stayed bit-identical while
    parameters diverged"."""
    result = audit(probe, repeats=2, epochs=1, fault=Fault("0", "backward", 1))
    c = result.comparison
    assert (c.first_step, c.cause, c.drifted) == (1, "backward", "gradients")
    assert "the loss stayed bit-identical while gradients diverged" in result.verdict.headline
    assert "gradients diverged from step 1" in render_console(_summary(result))


class _SharedActivationConv(nn.Module):
    """Ultralytics' Conv: every instance holds the one activation of its class."""

    default_act = nn.SiLU()

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.act = self.default_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))


def _shared_activation_probe(device: torch.device) -> Probe:
    torch.manual_seed(0)
    model = nn.Sequential(_SharedActivationConv(3, 4), _SharedActivationConv(4, 4),
                          _SharedActivationConv(4, 4), nn.Flatten(), nn.Linear(256, 2))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 2, generator=g))
               for _ in range(3)]

    def step(m: nn.Module, batch):
        return {"mse": (m(batch[0]) - batch[1]).pow(2).mean()}

    return Probe(model=model.to(device), batches=batches, step=step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("fault", [Fault("1.act", "forward", 2, op="aten.silu"),
                                   Fault("1.act", "backward", 1)],
                         ids=lambda f: f"{f.module}/{f.op}@{f.phase}")
def test_a_module_every_block_shares_is_named_by_the_block_it_ran_in(fault):
    """One activation held by every block (Ultralytics' Conv.default_act) is named where it
    ran: a fault planted in block 1's is found in block 1's, not under its first name."""
    result = audit(_shared_activation_probe, repeats=2, steps=3, fault=fault)
    first = result.verdict.first
    assert (first["step"], first["phase"], first["module"], first["role"]) == (
        fault.step, fault.phase, "1.act", "origin"), result.verdict.headline
    if fault.op:
        op = result.investigations["ops"]["ops"][0]
        assert (op["module"], op["op"], op["role"]) == ("1.act", "aten.silu", "origin")
    full = module_audit(_shared_activation_probe, repeats=2, steps=3, fault=fault)
    assert [(o.module, o.phase, o.step) for o in full.comparison.origins] == [
        ("1.act", fault.phase, fault.step)]
    roles = _roles(full.comparison, fault.step, fault.phase)
    # (block 0's ran before it in forward, after it in backward)
    assert roles.get("0.act") == (None if fault.phase == "forward" else PROPAGATED), roles


class _PassedThrough(nn.Module):
    """Returns its input as it is (effdet's resampling, where no resampling is needed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Combine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.resample = _PassedThrough()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resample(x) * self.weight


class _TwoConsumers(nn.Module):
    """The stem's output feeds `combine` (through a module that passes it on) and `head`."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.combine, self.head = nn.Linear(8, 8), _Combine(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.combine(h).sum() + self.head(h).sum()


def _loss_model_probe(build: type[nn.Module], device: torch.device) -> Probe:
    """A model that returns its loss, trained on 3 batches of 4 × 8."""
    torch.manual_seed(0)
    model = build().to(device)
    batches = list(torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1)))
    return Probe(model=model, batches=batches, step=lambda m, b: m(b.to(device)),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_module_that_passes_its_input_on_is_no_origin_of_anothers_backward():
    """The gradient of a tensor a module returns as it got it sums every use of it: a
    backward fault in `head`, the stem's other consumer, made `combine` an origin through
    its child's gradient (effdet's BiFPN listed four such). Only `head` is."""
    probe = functools.partial(_loss_model_probe, _TwoConsumers)
    result = module_audit(probe, repeats=2, steps=3, fault=Fault("head", "backward", 1))
    c = result.comparison
    assert [(o.module, o.phase, o.step) for o in c.origins] == [("head", "backward", 1)]
    assert module_audit(probe, repeats=2, steps=3).comparison.deterministic


class _UsesItsOwnOutput(nn.Module):
    """Returns `a`'s output and uses it itself too (a BiFPN cell's node that feeds the
    next node and is one of the cell's outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return h, self.b(h)


class _CellNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = _UsesItsOwnOutput(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.cell(x)
        return (self.head(h) * 3 + g).sum()


def test_a_forward_fault_in_a_module_that_uses_its_own_output_moves_its_gradient_by_little():
    """The fault is planted in a copy of the output, which the module's own use of it does
    not read: the copy's gradient lacked that use, and the report's size of the difference
    showed the module's received gradient 12 % apart in effdet. It is the gradient of what
    the module computed, as in the other runs: apart by rounding only."""
    result = module_audit(functools.partial(_loss_model_probe, _CellNet), repeats=2, steps=3,
                          fault=Fault("cell", "forward", 1))
    assert [(o.module, o.phase, o.step) for o in result.comparison.origins][:1] == [
        ("cell", "forward", 1)]
    norms = []
    for trace in result.traces:
        frame = trace.frame()
        row = frame[(frame.step == 1) & (frame.phase == "backward") & (frame.module == "cell")
                    & (frame.slot == "grad_out.0")]
        norms.append(float(row.norm.iloc[0]))
    assert math.isclose(norms[0], norms[1], rel_tol=1e-5), norms
