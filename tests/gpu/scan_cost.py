"""What a scanned step costs on CUDA: paired ratios, kernel launches, host syncs. Prints tables.

    python tests/gpu/scan_cost.py            # CUDA: Mask R-CNN (v1), 800 px, batch 2
    python tests/gpu/scan_cost.py --smoke    # CPU, 96 px: checks the script

1. Paired step times (plain, then recorded, on the same model and batch, lr=0 and the RNG
   reset before each, so every step does the same work; the order alternates pair by pair):
   a scanned step (the engine's own step: step state, losses, gradients as the optimizer
   receives them, parameters after the update) and a zoomed step (module + op level in one
   pass). Beside them, the bytes the scan fingerprints per step and the floor: one read of
   the same tensors (``torch._foreach_norm``).
2. Kernel launches per step (torch profiler): every kernel of a plain step and of a scanned
   step, and the launches made inside each of the recorder's entry points.
3. Host syncs (``torch.cuda.set_sync_debug_mode``): each synchronising call in a scanned step,
   placed by the innermost frame outside torch: the model's own, or the recorder's, before
   or at the end of the step (where the recorder fetches its prints in one transfer).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from detaudit.drivers import runner
from detaudit.drivers.loading import builtin_spec, make_factory
from detaudit.record import fused
from detaudit.record.fingerprint import Fingerprinter
from detaudit.record.oprecorder import OpRecorder
from detaudit.record.recorder import WATCH_MODULE, WATCH_NONE, Recorder
from detaudit.seeding import seed_everything
from detaudit.trace import StepInfo

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from fused_wsum_check import DTYPES, sample

DETAUDIT = str(ROOT / "detaudit") + os.sep
TORCH = str(Path(torch.__file__).parent) + os.sep  # the separator keeps torchvision out
PROBES = os.sep + "probes" + os.sep  # the built-in probes (installed under detaudit/): models
ENTRY_POINTS = ("record_state", "record", "before_backward", "record_param_grads",
                "record_parameters", "end_step")


def plain_step(probe, batch) -> None:
    """The training step with no recorder: what the user runs."""
    losses = probe.step(probe.model, batch)
    sum(losses.values()).backward()
    probe.optimizer.step()
    probe.optimizer.zero_grad(set_to_none=True)


def recorded_step(probe, batch, recorder: Recorder, step: int, zoom: bool) -> None:
    """The engine's step (`runner._train_step`) as `_run_steps` records it: scanned, or
    zoomed (every module call and op recorded)."""
    watch = WATCH_MODULE if zoom else WATCH_NONE
    recorder.begin_step(step, watch)
    info = StepInfo(step=step, epoch=0, index=step)
    recorder.record_state(batch, as_loaded=True)  # as the runner records it: xxh3 on the CPU
    scope = OpRecorder(recorder, step, record=True) if zoom else contextlib.nullcontext()
    losses = runner._train_step(probe, batch, recorder, info, step, scope, modules=zoom)
    recorder.end_step()
    info.keep_losses(losses)


def build(device: torch.device, size: int, batch_size: int):
    """A Mask R-CNN v1 probe (lr=0), its first batch, and a few steps already taken."""
    seed_everything(0)
    factory = make_factory(builtin_spec("maskrcnn_v1", {
        "image_size": size, "batch_size": batch_size, "num_images": batch_size, "lr": 0.0}))
    probe = factory(device)
    probe.model.train()
    batch = next(iter(probe.batches))
    for _ in range(3):
        plain_step(probe, batch)
    return probe, batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def paired_times(probe, batch, device, pairs: int, zoom: bool) -> list[tuple[float, float]]:
    """(plain, recorded) seconds per pair, the order alternating pair by pair. The plain step
    runs outside the recorder (a module-level recorder's hooks stay while it is entered); only
    the step is timed, not entering the recorder (once per repeat in an audit)."""
    watch = WATCH_MODULE if zoom else WATCH_NONE
    with Recorder(probe.model, watch=watch) as recorder:
        recorded_step(probe, batch, recorder, 0, zoom)  # warm: kernels built, caches filled
    out = []
    for i in range(pairs):
        times = {}
        for kind in (("plain", "recorded") if i % 2 == 0 else ("recorded", "plain")):
            torch.manual_seed(i)
            with (Recorder(probe.model, watch=watch) if kind == "recorded"
                  else contextlib.nullcontext()) as recorder:
                _sync(device)
                t0 = time.perf_counter()
                if recorder is None:
                    plain_step(probe, batch)
                else:
                    recorded_step(probe, batch, recorder, i + 1, zoom)
                _sync(device)
                times[kind] = time.perf_counter() - t0
        out.append((times["plain"], times["recorded"]))
    return out


def scanned_bytes(probe, batch) -> tuple[int, list[torch.Tensor]]:
    """Bytes the fingerprinter is handed in one scanned step, and those tensors."""
    seen: list[torch.Tensor] = []
    add, add_many = Fingerprinter.add, Fingerprinter.add_many

    def counting_add(self, t, *args, **kwargs):
        seen.append(t)
        return add(self, t, *args, **kwargs)

    def counting_many(self, tensors, *args, **kwargs):
        seen.extend(tensors)
        with mock.patch.object(Fingerprinter, "add", add):
            return add_many(self, tensors, *args, **kwargs)

    with mock.patch.object(Fingerprinter, "add", counting_add), \
            mock.patch.object(Fingerprinter, "add_many", counting_many), \
            Recorder(probe.model, watch=WATCH_NONE) as recorder:
        recorded_step(probe, batch, recorder, 0, zoom=False)
    tensors = [t.detach() for t in seen if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors), tensors


def read_once_seconds(tensors: list[torch.Tensor], device) -> float:
    """The floor: one read of the scanned tensors (floating ones by `_foreach_norm`, in few
    kernels; the rest summed), best of five."""
    here = [t.reshape(-1) for t in tensors if t.device.type == device.type]
    floats = [t for t in here if t.is_floating_point()]
    others = [t for t in here if not t.is_floating_point()]
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        if floats:
            torch._foreach_norm(floats)
        for t in others:
            t.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _torch_form(on: bool):
    """Device prints by the torch form (not the fused kernel) inside the block, if `on`."""
    return mock.patch.dict(os.environ, {"DETAUDIT_FUSED_WSUM": "0" if on else "1"})


def _samples(device) -> list[torch.Tensor]:
    """A tensor of every dtype, several blocks long, with extreme values, on `device` (the
    interpreter check's samples, here on the GPU)."""
    g = torch.Generator().manual_seed(0)
    return [sample(dtype, 10_001, g).to(device) for dtype in DTYPES]


def agreement(tensors: list[torch.Tensor], device) -> list[tuple]:
    """The fused kernel's prints against the torch form's (the scanned tensors and a tensor
    of every dtype), whether the kernel ran, and the time of each form on the scanned tensors
    that live on the device (best of 5: the batch, on the CPU, is neither form's)."""
    everything = tensors + _samples(device)
    on_device = [t for t in tensors if t.device.type == device.type]

    def printed(of):
        f = Fingerprinter(stats=False)
        f.add_many(of)
        return f.collect()

    rows = []
    results = {}
    for label, torch_form in (("fused kernel", False), ("torch form", True)):
        with _torch_form(torch_form), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[label] = printed(everything)
            best = float("inf")
            for _ in range(5):
                _sync(device)
                t0 = time.perf_counter()
                printed(on_device)
                best = min(best, time.perf_counter() - t0)
        what = f"{label}: ms for the {len(on_device)} scanned tensors on the device, fetched"
        rows.append((what, f"{best * 1e3:.2f}"))
        if not torch_form:
            ran = fused.usable(device) and not fused._FAILED
            failure = "; ".join(str(w.message) for w in caught if "fused" in str(w.message))
            rows.append(("fused kernel ran", "yes" if ran else f"NO {failure}"))
    same = [a == b for a, b in zip(results["fused kernel"], results["torch form"])]
    names = [str(t.dtype).replace("torch.", "") for t in _samples("cpu")]
    wrong = [names[i - len(tensors)] if i >= len(tensors) else f"scanned #{i}"
             for i, ok in enumerate(same) if not ok]
    rows.append((f"fused kernel == torch form ({len(same)} prints, every dtype)",
                 "yes" if not wrong else f"NO: {', '.join(wrong)}"))
    return rows


def _launch(name: str) -> bool:
    return "LaunchKernel" in name or name in ("cudaMemcpyAsync", "cudaMemsetAsync")


def kernel_counts(probe, batch, device) -> list[tuple]:
    """Kernels of a plain and a scanned step, and the launches inside each entry point."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])

    recorder = Recorder(probe.model, watch=WATCH_NONE)
    for name in ENTRY_POINTS:
        setattr(recorder, name, _labelled(getattr(recorder, name), f"detaudit.{name}",
                                          record_function))
    counted = {}
    with recorder:
        for kind in ("plain", "scanned"):
            torch.manual_seed(0)
            _sync(device)
            with profile(activities=activities) as prof:
                if kind == "plain":
                    plain_step(probe, batch)
                else:
                    recorded_step(probe, batch, recorder, 1, zoom=False)
                _sync(device)
            events = prof.events()
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            counted[kind] = (len(kernels), events)
    rows = [("plain step: device activities (kernels, copies, sets)", counted["plain"][0]),
            ("scanned step: device activities", counted["scanned"][0]),
            ("difference (the recorder's)", counted["scanned"][0] - counted["plain"][0])]
    per_entry: Counter = Counter()
    calls: Counter = Counter()
    host_us: Counter = Counter()
    device_us: Counter = Counter()
    for e in counted["scanned"][1]:
        if not e.name.startswith("detaudit.") or _has_detaudit_parent(e):
            continue
        calls[e.name] += 1
        per_entry[e.name] += _launches_under(e)
        host_us[e.name] += e.cpu_time_total
        device_us[e.name] += getattr(e, "device_time_total", 0)
    for name in sorted(per_entry, key=lambda n: -per_entry[n]):
        rows.append((f"  launches inside {name} ({calls[name]} calls)", per_entry[name]))
    # Where a scanned step's extra time goes: the host (Python, launches) or the device.
    for name in sorted(host_us, key=lambda n: -host_us[n]):
        rows.append((f"  ms inside {name}: host, device (its kernels)",
                     f"{host_us[name] / 1e3:.2f}, {device_us[name] / 1e3:.2f}"))
    return rows


def _labelled(fn, label: str, record_function):
    """`fn`, its calls marked `label` in the profile."""
    def labelled(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return labelled


def _has_detaudit_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("detaudit."):
            return True
        parent = parent.cpu_parent
    return False


def _launches_under(event) -> int:
    return sum(_launch(c.name) + _launches_under(c) for c in event.cpu_children)


def host_syncs(probe, batch, device) -> list[tuple]:
    """Each synchronising call of a scanned step, placed by its innermost frame outside torch."""
    seen: Counter = Counter()
    ended = [False]
    recorder = Recorder(probe.model, watch=WATCH_NONE)
    end_step = recorder.end_step

    def marking_end_step():
        ended[0] = True
        return end_step()
    recorder.end_step = marking_end_step

    def place(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not f.filename.startswith(TORCH) and "warnings" not in f.filename]
        frame = frames[-1] if frames else None
        if frame is None or not frame.filename.startswith(DETAUDIT) or PROBES in frame.filename:
            where = "the model's own"
        else:
            when = "at the end of the step" if ended[0] else "INSIDE the step"
            where = (f"detaudit, {when}: {Path(frame.filename).name}:{frame.lineno} "
                     f"({frame.name})")
        seen[where] += 1

    with recorder, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = place
        torch.manual_seed(0)
        _sync(device)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            recorded_step(probe, batch, recorder, 1, zoom=False)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return sorted(seen.items(), key=lambda kv: kv[0]) or [("no synchronising call", 0)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, 96 px: check the script")
    parser.add_argument("--pairs", type=int, default=10, help="paired scanned steps")
    parser.add_argument("--size", type=int, default=800, help="image size (px)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device (use --smoke to check the script)")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    size, pairs, batch_size = (96, 2, 1) if args.smoke else (args.size, args.pairs, 2)
    probe, batch = build(device, size, batch_size)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (smoke)"
    print(f"detaudit scan cost, {time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}, "
          f"Mask R-CNN v1 {size} px, batch {batch_size}", flush=True)

    variants = [("scanned step", False)]
    if fused.usable(device):
        variants = [("scanned step (fused print kernel)", False),
                    ("scanned step (torch form of the print)", True)]
    measured = []
    for label, torch_form in variants:
        with _torch_form(torch_form):
            measured.append((label, paired_times(probe, batch, device, pairs, zoom=False)))
    measured.append(("zoomed step (module + op level)",
                     paired_times(probe, batch, device, max(2, pairs // 4), zoom=True)))
    nbytes, tensors = scanned_bytes(probe, batch)
    floor = read_once_seconds(tensors, device)
    plain = statistics.median(p for p, _ in measured[0][1])
    rows = [("plain step", f"{plain * 1e3:.1f}", "", len(measured[0][1]))]
    for label, pairs_ in measured:
        ratios = [(r / p - 1) * 100 for p, r in pairs_]
        spread = f"{statistics.median(ratios):+.1f}% ({min(ratios):+.1f}% to {max(ratios):+.1f}%)"
        rows.append((label, f"{statistics.median(r for _, r in pairs_) * 1e3:.1f}", spread,
                     len(pairs_)))
    rows.append((f"floor: one read of the {nbytes / 1e6:.0f} MB scanned ({len(tensors)} tensors)",
                 f"{floor * 1e3:.2f}", f"{floor / plain * 100:.2f}% of the plain step", ""))
    print(tabulate(rows, headers=["step", "median ms", "overhead (median of pairs)", "pairs"]),
          flush=True)
    print(tabulate(agreement(tensors, device), headers=["print of the scanned tensors", ""]),
          flush=True)
    print(tabulate(kernel_counts(probe, batch, device), headers=["kernels per step", "count"]),
          flush=True)
    print(tabulate(host_syncs(probe, batch, device), headers=["synchronising calls in a scanned step",
                                                       "count"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
