"""The `detaudit` command: a thin layer over the API; each subcommand calls one function."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import EXIT_DIVERGED, EXIT_OK, EXIT_USAGE, DetauditError

CPU_PRESET = {"image_size": 128, "epochs": 2, "steps": 2, "batch_size": 1, "num_images": 2,
              "repeats": 2}
CUDA_PRESET = {"image_size": 800, "epochs": 2, "steps": 5, "batch_size": 2, "num_images": 10,
               "repeats": 3}
_FAULT = re.compile(
    r"^(?P<module>[^@:/]*)(/(?P<op>[\w.]+))?(@(?P<phase>forward|backward))?(:(?P<step>\d+))?$"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, dispatch, map errors to one line and exit code 2."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except DetauditError as exc:
        if args.debug:
            raise
        print(f"detaudit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("detaudit: interrupted (traces of finished repeats are kept)", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="detaudit",
        description="Find where, when and why a PyTorch detection model stops training "
        "(or inferring) the same way twice. Exit codes: 0 deterministic, 1 divergence found, "
        "2 usage or input error.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run", help="audit a model: repeat it, record every module, compare",
        description="Run a probe N times from the same seed under recording hooks and report "
        "the first divergence: step, epoch, phase, module, origin or propagated, and cause.",
    )
    _add_run_arguments(run)
    run.add_argument("--nproc", type=int, metavar="N",
                     help="audit a DDP set-up on N ranks (torch.distributed.run; gloo on CPU, "
                     "NCCL on CUDA): per-rank traces, cross-rank desync, sampler and seeding checks")
    run.set_defaults(func=cmd_run)

    baseline = sub.add_parser(
        "baseline", help="run a probe and store its fingerprints as a CI baseline",
        description="Run the probe (default 1 repeat) and store repeat 0's fingerprints, stats, "
        "configuration and environment in a baseline file for `detaudit check`.",
    )
    _add_run_arguments(baseline, out_help="baseline file to write, e.g. reports/baselines/NAME.json")
    baseline.set_defaults(func=cmd_baseline)

    check = sub.add_parser(
        "check", help="re-run a baseline's configuration and compare (exit 1 on change)",
        description="Re-run exactly the configuration stored in BASELINE and compare with it. "
        "Exit 0: matches; 1: changed (first changed record, report folder); 2: unreadable baseline.",
    )
    check.add_argument("baseline", help="a file written by `detaudit baseline`")
    check.add_argument("--out", help="folder for the new run (default: reports/check-<timestamp>/)")
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.add_argument("--isolation", choices=("inprocess", "process"), default="inprocess",
                       help="how to run the repeats (default inprocess)")
    _add_gate_arguments(check)
    check.set_defaults(func=cmd_check, json=False)

    diff = sub.add_parser(
        "diff", help="compare two saved runs (CPU vs CUDA, 1 vs 2 threads, before vs after)",
        description="Compare repeat 0 of two run folders bitwise (or within --rtol/--atol on the "
        "stored stats) and name the first module that differs, with the origin analysis.",
    )
    diff.add_argument("run_a", help="run folder A")
    diff.add_argument("run_b", help="run folder B")
    _add_gate_arguments(diff)
    diff.set_defaults(func=cmd_diff)

    models = sub.add_parser("models", help="list the built-in probes and what each audits")
    models.set_defaults(func=cmd_models)

    env = sub.add_parser(
        "env", help="print the determinism-relevant environment and flag risky settings",
        description="Versions, devices, threads, cuDNN flags, deterministic-algorithms mode, "
        "CUBLAS_WORKSPACE_CONFIG and PYTHONHASHSEED, each risky one flagged with the reason.",
    )
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=cmd_env)

    report = sub.add_parser(
        "report", help="re-render the reports of a saved run folder (no model needed)"
    )
    report.add_argument("folder", help="a run folder written by `detaudit run`")
    report.add_argument("--json", action="store_true", help="print summary.json to stdout")
    report.set_defaults(func=cmd_report)
    for p in (run, baseline, check, diff, models, env, report):
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    return parser


def _add_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rtol", type=float, default=0.0,
                   help="compare the stored stats within this relative tolerance instead of bitwise")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for the stats")
    p.add_argument("--junit", metavar="FILE", help="also write the result as JUnit XML")


def _add_run_arguments(p: argparse.ArgumentParser, out_help: str | None = None) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a built-in probe (see `detaudit models`)")
    what.add_argument("--probe", metavar="FILE.py[:FUNC]",
                      help="your own probe file; FUNC(device) returns detaudit.Probe (default FUNC: probe)")
    p.add_argument("--mode", choices=("train", "infer"), default="train",
                   help="train: forward, backward, optimizer step; infer: forward only (default: train)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:i] (default: auto)")
    p.add_argument("--repeats", type=int, help="runs to compare (CPU preset: 2, CUDA preset: 3)")
    p.add_argument("--epochs", type=int, help="epochs per run (preset: 2)")
    p.add_argument("--steps", type=int, help="steps per epoch (CPU preset: 2, CUDA preset: 5)")
    p.add_argument("--seed", type=int, default=0, help="seed for every RNG (default: 0)")
    p.add_argument("--deterministic", action="store_true",
                   help="turn PyTorch's deterministic settings on for the run, to compare")
    p.add_argument("--inject-fault", metavar="MODULE[/OP][@forward|@backward][:STEP]",
                   help="plant a 1-ULP change at MODULE in the last repeat (default: forward, "
                   "step 0); with /OP (e.g. roi_heads.box_roi_pool/torchvision.roi_align@backward:1, "
                   "or op:torchvision.nms for any module) inside that op: 1 ULP in its first float "
                   "output (its backward op in backward), a swap of two elements in an integer one")
    p.add_argument("--granularity", choices=("module", "op"), default="module",
                   help="module: hooks per module call (default); op: every aten/torchvision op of "
                   "every step too (much slower, for short runs)")
    p.add_argument("--no-drill-down", dest="drill_down", action="store_false",
                   help="after a divergence, do not replay the first divergent step op by op")
    p.add_argument("--census", action=argparse.BooleanOptionalAction, default=True,
                   help="list the known-nondeterministic ops the model runs (one step, even when "
                   "the repeats agree) and the alerts raised under "
                   "use_deterministic_algorithms(True, warn_only=True) (default: on)")
    p.add_argument("--verify-fix", action="store_true",
                   help="re-run with PyTorch's deterministic settings: deterministic now? at what "
                   "step-time and peak-memory cost?")
    p.add_argument("--isolation", choices=("inprocess", "process"), default="inprocess",
                   help="process: each repeat in a fresh interpreter (catches PYTHONHASHSEED and "
                   "leftover global state); default: inprocess")
    p.add_argument("--out", required=out_help is not None,
                   help=out_help or "run folder (default: reports/<probe>-<timestamp>/)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    if out_help is None:
        p.add_argument("--junit", metavar="FILE", help="also write the verdict as JUnit XML")
    p.add_argument("--quiet", action="store_true", help="no progress bar, verdict line only")
    recipe = p.add_argument_group("built-in probe recipe (with --model)")
    recipe.add_argument("--image-size", type=int, help="square image size (CPU preset: 128, CUDA: 800)")
    recipe.add_argument("--batch-size", type=int, help="images per step (CPU preset: 1, CUDA: 2)")
    recipe.add_argument("--num-images", type=int, help="synthetic dataset size")
    recipe.add_argument("--instances", type=int, help="objects per synthetic image (default 3)")
    recipe.add_argument("--data", metavar="synthetic|coco:IMAGES_DIR:ANNOTATIONS.json",
                        help="dataset (default: synthetic, generated from the seed)")
    recipe.add_argument("--weights", metavar="PATH", help="local state dict to load (no downloads)")
    recipe.add_argument("--workers", type=int, help="DataLoader workers (default 0)")
    recipe.add_argument("--shuffle", action="store_true", help="shuffle the DataLoader")
    recipe.add_argument("--augment", choices=("none", "flip"), help="augmentation (default none)")
    recipe.add_argument("--amp", action="store_true",
                        help="mixed precision: autocast + GradScaler on CUDA, bf16 autocast on CPU")
    recipe.add_argument("--accumulate", type=int, help="gradient accumulation steps")
    recipe.add_argument("--clip-grad-norm", type=float, help="clip gradients to this norm")
    recipe.add_argument("--lr", type=float, help="SGD learning rate (default 0.005)")
    recipe.add_argument("--scheduler", choices=("none", "cosine"),
                        help="LR scheduler: cosine annealing with warm restarts")


def parse_fault(text: str | None):
    """`MODULE[@forward|@backward][:STEP]` -> Fault."""
    from .recorder import Fault

    if not text:
        return None
    if text.startswith("op:"):
        text = "/" + text[3:]
    m = _FAULT.match(text)
    if not m or not (m.group("module") or m.group("op")):
        raise DetauditError(
            f"--inject-fault {text!r} is not MODULE[/OP][@forward|@backward][:STEP] or op:OP[...]"
        )
    return Fault(m.group("module"), m.group("phase") or "forward", int(m.group("step") or 0),
                 m.group("op"))


def cmd_run(args: argparse.Namespace) -> int:
    """`detaudit run`."""
    spec, config, preset_text = _run_setup(args)
    out = Path(args.out) if args.out else _default_folder(spec["name"])
    if args.nproc is not None:
        from .cli_distributed import run_command

        return run_command(args, spec, config, out, preset_text, _reproduce_command(args))
    traces, timings = _run(spec, config, out, args)
    extra = _investigate(args, spec, config, traces, timings)
    summary = _finish(args, spec, config, out, traces, timings, preset_text, extra)
    if args.junit:
        from .junit import JUnitCase, write_junit
        from .report import render_console

        failure = None if summary["verdict"] == "deterministic" else summary["headline"]
        write_junit(args.junit, [JUnitCase(spec["name"], "detaudit.run",
                                           sum(t.seconds for t in timings), failure,
                                           render_console(summary))])
    return EXIT_OK if summary["verdict"] == "deterministic" else EXIT_DIVERGED


def cmd_baseline(args: argparse.Namespace) -> int:
    """`detaudit baseline`: run, then store repeat 0 as the baseline."""
    from .api import AuditResult
    from .compare import compare
    from .gate import save_baseline

    if args.repeats is None:
        args.repeats = 1
    spec, config, _ = _run_setup(args)
    folder = _default_folder(f"{spec['name']}-baseline")
    traces, timings = _run(spec, config, folder, args)
    if traces[0].failure:
        raise DetauditError(f"the baseline run failed: {traces[0].failure}")
    path = save_baseline(args.out, spec, AuditResult(config, traces, compare(traces), timings))
    print(f"baseline written: {path} ({len(traces[0])} records, {len(traces[0].steps)} steps)")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    """`detaudit check BASELINE`."""
    from .api import AuditResult
    from .compare import compare
    from .gate import check_baseline
    from .runner import AuditConfig

    out = Path(args.out) if args.out else _default_folder("check")
    args.banner = "check"

    def run_fn(spec: dict[str, Any], config: dict[str, Any]) -> AuditResult:
        cfg = AuditConfig.from_dict(config)
        traces, timings = _run(spec, cfg, out, args)
        args.quiet = True  # the gate prints its own message
        _finish(args, spec, cfg, out, traces, timings, "as stored in the baseline")
        return AuditResult(cfg, traces, compare(traces), timings)

    return _gate_output(args, check_baseline(args.baseline, run_fn, args.rtol, args.atol),
                        Path(args.baseline).stem, "detaudit.check", f"\nreport folder: {out}")


def cmd_diff(args: argparse.Namespace) -> int:
    """`detaudit diff RUN_A RUN_B`."""
    from .gate import diff_traces
    from .runfolder import load_run

    _, traces_a = load_run(args.run_a)
    _, traces_b = load_run(args.run_b)
    gate = diff_traces(traces_a, traces_b, args.rtol, args.atol, labels=(args.run_a, args.run_b))
    return _gate_output(args, gate, f"{Path(args.run_a).name}-vs-{Path(args.run_b).name}",
                        "detaudit.diff", "")


def _gate_output(args: argparse.Namespace, gate: Any, name: str, classname: str, tail: str) -> int:
    print(gate.message + (tail if not gate.ok else ""))
    if args.junit:
        from .junit import write_junit

        write_junit(args.junit, [gate.junit_case(name, classname)])
    return gate.exit_code


def _run_setup(args: argparse.Namespace):
    """(probe description, AuditConfig, preset text) from `run`-style arguments."""
    import torch

    from .runner import AuditConfig, resolve_device

    device = resolve_device(args.device)
    preset_name = "cuda" if device.type == "cuda" else "cpu"
    preset = CUDA_PRESET if preset_name == "cuda" else CPU_PRESET

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return preset[name] if value is None else value

    config = AuditConfig(
        repeats=pick("repeats"), epochs=pick("epochs"), steps=pick("steps"), mode=args.mode,
        device=str(device), seed=args.seed, deterministic=args.deterministic,
        fault=parse_fault(args.inject_fault), granularity=getattr(args, "granularity", "module"),
    )
    spec = _probe_spec(args, preset)
    args.banner = f"{spec['name']} on {device}, threads={torch.get_num_threads()}"
    return spec, config, _preset_text(preset_name, config, spec)


def _default_folder(name: str) -> Path:
    return Path("reports") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _probe_spec(args: argparse.Namespace, preset: dict[str, Any]) -> dict[str, Any]:
    from .loading import builtin_spec, file_spec

    if args.probe:
        return file_spec(args.probe)
    options: dict[str, Any] = {"seed": args.seed}
    for name in ("image_size", "batch_size", "num_images"):
        value = getattr(args, name)
        options[name] = preset[name] if value is None else value
    for name in ("instances", "data", "weights", "workers", "augment", "accumulate",
                 "clip_grad_norm", "lr", "scheduler"):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    if args.shuffle:
        options["shuffle"] = True
    if args.amp:
        options["amp"] = True
    return builtin_spec(args.model, options)


def _preset_text(preset: str, config: Any, spec: dict[str, Any]) -> str:
    options = spec.get("options", {})
    size = f", {options['image_size']} px, batch {options['batch_size']}" if options else ""
    return (f"{preset} preset: {config.repeats} repeats x {config.epochs} epochs x "
            f"{config.steps} steps{size}, {config.mode}")


def _run(spec: dict[str, Any], config: Any, out: Path, args: argparse.Namespace):
    from tqdm import tqdm

    from .api import audit_config
    from .isolation import run_isolated
    from .loading import make_factory

    total_steps = config.repeats * config.epochs * (config.steps or 0) or None
    bar = tqdm(total=total_steps if args.isolation == "inprocess" else config.repeats,
               disable=True if (args.quiet or args.json) else None, leave=False, file=sys.stderr, unit="step"
               if args.isolation == "inprocess" else "repeat", dynamic_ncols=True,
               desc=args.banner)
    try:
        if args.isolation == "process":
            return run_isolated(spec, config, out, on_repeat=lambda r: bar.update(1))

        def on_step(repeat: int, epoch: int, index: int, step: int) -> None:
            bar.set_description(f"repeat {repeat + 1}/{config.repeats} epoch {epoch + 1}/{config.epochs}")
            bar.update(1)

        result = audit_config(make_factory(spec), config, out=out, probe_info=spec, on_step=on_step)
        return result.traces, result.timings
    finally:
        bar.close()


def _investigate(args, spec, config, traces, timings) -> dict[str, Any]:
    """The op drill-down, census and fix verification asked for (all in this process)."""
    from .compare import compare
    from .investigate import investigate
    from .loading import make_factory

    comparison = compare(traces)
    wanted = {"ops": args.drill_down and comparison.first_step is not None,
              "census": args.census, "verify": args.verify_fix}
    if not any(wanted.values()):
        return {}
    names = {"ops": "op-level replay of the first divergent step", "census": "census",
             "verify": "fix verification"}
    quiet = args.quiet or args.json

    def on_stage(name: str) -> None:
        if not quiet:
            print(f"detaudit: {names[name]} ...", file=sys.stderr)

    return investigate(
        make_factory(spec), config, comparison, timings, ops=wanted["ops"],
        census=wanted["census"], verify=wanted["verify"], probe_info=spec,
        traces=traces, on_stage=on_stage,
    )


def _finish(args, spec, config, out: Path, traces, timings, preset_text: str,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save run.json and the reports, print the summary; return the summary."""
    from dataclasses import asdict

    from .compare import compare
    from .report import summarize, write_reports
    from .runfolder import RunInfo, save_run

    info = RunInfo(
        probe={**spec, "preset": preset_text}, config=config.to_dict(),
        command=_reproduce_command(args), traces=[f"trace-{t.repeat}.json.gz" for t in traces],
        timings=[asdict(t) for t in timings], extra=extra or {},
    )
    save_run(out, info)
    summary = summarize(info, compare(traces), traces)
    write_reports(out, summary)
    print_summary(args, summary, out)
    return summary


def print_summary(args: argparse.Namespace, summary: dict[str, Any], out: Path,
                  more: str = "") -> None:
    """The summary as --json, --quiet or the console text (plus `more`), then the folder."""
    from .report import render_console

    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True, default=str))
    elif args.quiet:
        print(summary["headline"])
    else:
        print(render_console(summary))
        if more:
            print("\n" + more)
        print(f"\nreports: {out}")


def _reproduce_command(args: argparse.Namespace) -> str:
    """The command line as given, minus --out (a rerun should write a new folder)."""
    argv, skip = [], False
    for arg in args.argv:
        if skip or arg == "--out":
            skip = not skip
            continue
        if not arg.startswith("--out="):
            argv.append(arg)
    return "detaudit " + shlex.join(argv)


def cmd_models(args: argparse.Namespace) -> int:
    """`detaudit models`."""
    from tabulate import tabulate

    import probes

    print(tabulate(probes.available(), headers=["model", "what it audits"]))
    return EXIT_OK


def cmd_env(args: argparse.Namespace) -> int:
    """`detaudit env`."""
    from tabulate import tabulate

    from .environment import capture_environment, risks

    env = capture_environment()
    flagged = risks(env)
    if args.json:
        print(json.dumps({"env": env, "risks": flagged}, indent=1, sort_keys=True))
    else:
        rows = [(k, v, "RISK: " + flagged[k] if k in flagged else "") for k, v in sorted(env.items())]
        print(tabulate(rows, headers=["setting", "value", "risk"], maxcolwidths=[None, 40, 70]))
        print(f"\n{len(flagged)} risky setting(s)" if flagged else "\nno risky settings")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """`detaudit report DIR`."""
    from .report import render_console, render_folder

    summary = render_folder(args.folder)
    print(json.dumps(summary, indent=1, sort_keys=True, default=str) if args.json
          else render_console(summary))
    return EXIT_OK if summary["verdict"] == "deterministic" else EXIT_DIVERGED


if __name__ == "__main__":
    sys.exit(main())
