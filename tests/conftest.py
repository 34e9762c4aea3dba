"""Shared tiny models and probes: small enough for 2 CPU cores."""

from __future__ import annotations

import contextlib
import os

# Intel MKL may pick code paths that give other results from run to run at one thread count
# on some CPUs (seen: the backward of a 3x3 convolution over a 1x1 map, 2 threads, a Xeon
# with AVX-512 and AMX): detaudit rightly finds that, and the tests that need a CPU whose
# computations repeat (no false alarm on Mask R-CNN) ask MKL for reproducible paths, before
# torch loads it; processes the tests start inherit it.
os.environ.setdefault("MKL_CBWR", "AUTO")

import numpy as np
import pytest
import torch
from torch import nn

from detaudit import Probe
from detaudit.trace import Trace, TraceStream


class Block(nn.Module):
    """conv -> relu, with a residual connection."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.conv(x))


class SmallCNN(nn.Module):
    """stem -> two residual blocks -> pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block1 = Block()
        self.block2 = Block()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(self.block1(self.stem(x))).mean((2, 3)))


def small_cnn_probe(device: torch.device, steps: int = 4) -> Probe:
    """A deterministic training set-up of SmallCNN."""
    model = SmallCNN().to(device)
    g = torch.Generator().manual_seed(123)
    batches = [(torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 4, generator=g))
               for _ in range(steps)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(m: nn.Module, batch):
        x, y = batch
        return {"mse": (m(x.to(device)) - y.to(device)).pow(2).mean()}

    return Probe(model=model, batches=batches, step=step, optimizer=optimizer)


class CentreGather(nn.Module):
    """Gathers features at object centres: a 1-D gather with duplicate indices."""

    def forward(self, features: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        n, c, h, w = features.shape
        table = features.permute(0, 2, 3, 1).reshape(n * h * w, c)
        return table[centres]


class GatherNet(nn.Module):
    """conv features -> gathered at centres -> linear; its backward is nondeterministic
    on 2+ CPU threads (index_put_ with accumulate over duplicate indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, 16, 3, padding=1)
        self.gather = CentreGather()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        return self.head(self.gather(self.features(x), centres))


def gather_probe(device: torch.device, steps: int = 3) -> Probe:
    """A training set-up of GatherNet: 4000 centres drawn with duplicates from 64 cells."""
    model = GatherNet().to(device)
    g = torch.Generator().manual_seed(7)
    batches = [
        (torch.randn(1, 3, 32, 32, generator=g), torch.randint(0, 64, (4000,), generator=g),
         torch.randn(4000, 4, generator=g))
        for _ in range(steps)
    ]

    def step(m: nn.Module, batch):
        x, centres, targets = (t.to(device) for t in batch)
        return (m(x, centres) - targets).pow(2).mean()

    return Probe(model=model, batches=batches, step=step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def unseeded_probe(device: torch.device) -> Probe:
    """Two Linear layers fed by an unseeded numpy generator: every repeat sees other data."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    rng = np.random.default_rng()  # unseeded: a different stream every repeat

    def batches(epoch: int):
        for _ in range(3):
            yield torch.from_numpy(rng.normal(size=(4, 8)).astype("float32")).to(device)

    return Probe(model=model, batches=batches, step=lambda m, b: m(b).pow(2).mean(),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture
def two_threads():
    """Run the test on 2 CPU threads (where CPU accumulation order varies), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "shares_cores: may run beside another test under pytest-xdist (it proves "
        "nothing that needs both CPU cores to itself); any other test runs alone")
    config.addinivalue_line(
        "markers", "alone: runs alone under pytest-xdist even in a module that shares_cores "
        "(a real thread race must fire, which contention for the cores makes rare)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (`-n 2`), a test holds the run's lock file from before its first
    fixture is made to after its last is torn down (a module's fixtures run an audit too):
    shared when it is marked `shares_cores`, exclusive otherwise, so that a race that must
    fire on 2 threads (a test marked `alone`, or one that sets the thread count) or a test
    no one has looked at never has another test beside it. (A Mask R-CNN-sized test, marked
    `slow`, keeps both cores busy by itself, yet shares them: the other worker's tests fill
    what it leaves idle, and the suite took 1,009 s where it took 1,100 s with those tests
    alone.) A test beside another runs on one thread (see one_thread_each). The file lies
    in the run's temporary folder, which holds each worker's (and which pytest removes with
    its older runs)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    import fcntl  # (POSIX; xdist runs here)

    beside = (item.get_closest_marker("shares_cores") is not None
              and item.get_closest_marker("alone") is None
              and not {"two_threads", "threads"} & set(item.fixturenames))
    folder = item.config._tmp_path_factory.getbasetemp().parent
    with open(folder / "cores.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH if beside else fcntl.LOCK_EX)
        try:
            with one_thread_each() if beside else contextlib.nullcontext():
                return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def one_thread_each():
    """A test beside another computes on one CPU thread, and so do the processes it starts:
    two tests of two threads each on two cores wait on each other's threads (a Mask R-CNN
    test took 70 s beside a copy of itself at two threads each, 34 s at one)."""
    before, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if variable is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = variable


@pytest.fixture(scope="session", autouse=True)
def temporary_folder_of_started_processes(tmp_path_factory):
    """Processes the tests start make their temporary files in the run's temporary folder,
    which pytest removes with its older runs: torchrun leaves a log folder
    (``torchelastic_*``) on every run, and a DataLoader worker that a test ends by a signal
    leaves its ``pymp-*`` folder. Its path stays short: a DataLoader worker sends a batch's
    shared memory through a socket it makes there, whose path may not pass 107 bytes (past
    that the batch is lost, and the loop waits for it forever)."""
    folder = tmp_path_factory.mktemp("started-processes")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    with _bytecode_kept():
        yield
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before


@contextlib.contextmanager
def _bytecode_kept():
    """The processes the tests start (each run of `exec`, a zoom's replay, a rank) keep the
    bytecode they compile, beside its source (`__pycache__`, which git ignores; a write is
    atomic): where PYTHONDONTWRITEBYTECODE is set, each compiled detaudit anew, about 0.1 s
    of every process."""
    saved = os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["PYTHONDONTWRITEBYTECODE"] = saved


@pytest.fixture(autouse=True)
def no_hooks_left_behind():
    """Every test must leave no global module hook or dispatch mode installed."""
    yield
    from torch.nn.modules import module as module_mod
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert not module_mod._global_forward_hooks
    assert not module_mod._global_forward_pre_hooks
    assert _get_current_dispatch_mode() is None


def module_audit(probe, **kwargs):
    """An audit that records every module call of every step (``granularity="module"``),
    without the op drill-down unless asked: what tests of module-level recording and
    localisation need, whatever the default granularity."""
    from detaudit import audit

    return audit(probe, **{"granularity": "module", "drill_down": False, **kwargs})


def stream_trace(trace: Trace, path, every: int = 1) -> TraceStream:
    """Write `trace` as a recorder would: its steps one at a time, flushed every `every`."""
    live = Trace(probe=trace.probe, repeat=trace.repeat, env=trace.env, failure=trace.failure,
                 stress=trace.stress)
    stream = TraceStream(live, path)
    for n, info in enumerate(trace.steps):
        for table, into in ((trace.records, live.records), (trace.calls, live.calls)):
            rows = [i for i, s in enumerate(table["step"]) if s == info.step]
            for name, column in into.items():
                column += [table[name][i] for i in rows]
        live.steps.append(info)
        if (n + 1) % every == 0:
            stream.flush()
            assert len(live) == 0 and not live.steps  # nothing flushed is held
    stream.flush()
    return stream
