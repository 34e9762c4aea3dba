"""The `detaudit` command: parses, turns the options into typed configuration once, calls
one API function per subcommand, and prints. Nothing below this module sees argparse."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .api import STAGE_NAMES, Progress
from .config import (
    ATTACH_MODES,
    AUTO,
    AuditConfig,
    Fault,
    Investigations,
    Launch,
    Preset,
    ProbeSpec,
    preset_for,
)
from .errors import EXIT_CRASH, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, DetauditError
from .words import counted

ALL_STEPS = "all"  # --steps all: every batch of each epoch
RECIPE_OPTIONS = ("instances", "num_classes", "data", "weights", "workers", "augment",
                  "accumulate", "clip_grad_norm", "lr", "scheduler")
RECIPE_FLAGS = ("image_size", "batch_size", "num_images", *RECIPE_OPTIONS, "shuffle", "amp")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, dispatch, and turn every way a command can end into one line and
    an exit code: 0 deterministic / match, 1 divergence found, 2 usage or input error (or a
    run not compared), 3 a crash (the user's code, leaving nothing to compare, or detaudit's
    own), 130 interrupted."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except _CommandLineRefused as exc:
        print(exc.line, file=sys.stderr)
        _ended_without_verdict(_options_said(argv), exc.line, EXIT_USAGE, time.perf_counter())
        return EXIT_USAGE
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return _dispatch(args, argv)
    finally:
        _forget_interrupts_already_handled()


def _renders(folder: Path) -> bool:
    """Whether `detaudit report` renders `folder`: it holds a trace (an interrupted run
    whose first repeat recorded no step holds none)."""
    from .errors import TraceError
    from .runfolder import load_run

    try:
        load_run(folder)
    except TraceError:
        return False
    return True


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the command; each way it can end becomes one line on stderr and its exit code."""
    started = time.perf_counter()
    _MADE_FOLDERS.clear()  # (this command's own: main may run many in one process)
    _RUN_FOLDERS.clear()
    try:
        with _sigterm_as_interrupt(), _output_that_outlives_its_reader():
            return args.func(args, argv)
    except DetauditError as exc:
        if args.debug:
            raise
        code, line = exc.exit_code, f"error: {_safe(str(exc))}"
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
        kept = next((f for f in _RUN_FOLDERS if (f / "run.json").exists()), None)
        line = (f"interrupted; what was recorded is kept in {kept} (`detaudit report {kept}` "
                "renders it)" if kept is not None and _renders(kept) else
                f"interrupted before a step was recorded ({kept}/run.json says what was "
                "asked; there is no report to render)" if kept is not None else
                "interrupted; what was recorded is kept (see run.json in the run folder; "
                "`detaudit report FOLDER` renders it)")
    except SystemExit as exc:  # raised by the user's code outside a repeat
        if args.debug:
            raise
        code = EXIT_CRASH
        line = (f"error: the audited code exited (SystemExit {exc.code!r}) before anything "
                "could be compared")
    except Exception as exc:
        if args.debug:
            raise
        code = EXIT_CRASH
        line = (f"internal error: {type(exc).__name__}: {_safe(str(exc))} (run with --debug "
                "for the traceback)")
    print(f"detaudit: {line}", file=sys.stderr)
    _ended_without_verdict(args, line, code, started)
    for folder in _MADE_FOLDERS:  # refused before anything was recorded: no folder left
        _remove_if_nothing_recorded(folder)
    return code


def _remove_if_nothing_recorded(folder: Path) -> None:
    """Remove a run folder this command made that holds nothing recorded: empty, or its
    run.json alone, listing no trace (a command exec could not start, say)."""
    with contextlib.suppress(OSError, ValueError):
        entries = list(folder.iterdir())
        if [p.name for p in entries] == ["run.json"]:
            if json.loads(entries[0].read_text()).get("traces"):
                return
            entries[0].unlink()
        folder.rmdir()


def _ended_without_verdict(args: argparse.Namespace, line: str, code: int,
                           started: float) -> None:
    """A command that ended before its verdict (an error, Ctrl-C) still gives what a CI job
    reads: with --json, an object saying so on stdout; with --junit, a test case that is an
    error of that kind ("usage", "failed", "interrupted"), never a pass or a divergence."""
    kind = {EXIT_USAGE: "usage", EXIT_INTERRUPTED: "interrupted"}.get(code, "failed")
    if getattr(args, "json", False):
        print(json.dumps({"verdict": kind, "headline": line, "exit_code": code}))
    if getattr(args, "junit", None):
        from .report.junit import junit_case

        case = junit_case(_junit_name(args), f"detaudit.{args.command}",
                          time.perf_counter() - started, False, line, line, kind)
        with contextlib.suppress(OSError, DetauditError):  # (an unwritable --junit is the error)
            _write_junit(args.junit, case)


def _junit_name(args: argparse.Namespace) -> str:
    """The name of a command's --junit test case, whatever its outcome (a CI system follows
    a test by its name): a check's baseline, a diff's two runs, a run's model or probe."""
    if args.command == "check":
        return Path(args.baseline).stem
    if args.command == "diff":
        return f"{Path(args.run_a).name}-vs-{Path(args.run_b).name}"
    name = getattr(args, "model", None) or getattr(args, "probe", None) or args.command
    return Path(str(name)).name


def _forget_interrupts_already_handled() -> None:
    """Let the exit code be the one returned. A Ctrl-C that lands while code compiled from
    a string runs (a dataclass or namedtuple being made, in any import) leaves CPython's
    "KeyboardInterrupt went uncaught" flag set even though it was caught here, and
    ``python -m detaudit`` then ends by SIGINT instead of 130. Running any string code
    clears that flag; an interrupt that really escapes sets it again."""
    exec("")  # noqa: S102 - the empty program, run for its side effect described above


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends a command the way Ctrl-C does: cleanly, keeping what was recorded."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _output_that_outlives_its_reader() -> Iterator[None]:
    """A reader that stops early (`detaudit ... | head`) closes the pipe: the rest of the
    output goes nowhere, and the exit code is still the verdict's."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PipeSafe(sys.stdout), _PipeSafe(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams


class _PipeSafe:
    """A text stream whose writes survive the reader closing the pipe (see above)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_nowhere()

    def _to_nowhere(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # a stream without a descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _safe(text: str) -> str:
    """Text from the user's world with control characters (ANSI/OSC escapes, BEL) shown
    escaped, so that it cannot rewrite the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class _CommandLineRefused(Exception):
    """The command line is wrong: `line` says how, in one line."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


class _OneLineErrors(argparse.ArgumentParser):
    """A parser whose usage errors are one line, as every other error is (argparse prints
    the whole usage first), and end as they do (see main: --json and --junit still say so)."""

    def error(self, message: str) -> NoReturn:
        raise _CommandLineRefused(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _version() -> str:
    from . import __version__

    return __version__


def _options_said(argv: list[str]) -> argparse.Namespace:
    """What a command line the parser refused asks for, as far as a CI job reads it: the
    command, --json, --junit PATH, --model or --probe (before any `--`: what follows it is
    the audited command's own)."""
    said = argv[:argv.index("--")] if "--" in argv else argv
    values: dict[str, Any] = {"command": next((a for a in said if not a.startswith("-")), "detaudit"),
                              "json": "--json" in said}
    for option in ("junit", "model", "probe"):
        flag = f"--{option}"
        for i, arg in enumerate(said):
            if arg == flag and i + 1 < len(said):
                values[option] = said[i + 1]
            elif arg.startswith(f"{flag}="):
                values[option] = arg.split("=", 1)[1]
    return argparse.Namespace(**values)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="detaudit",
        description="Find where, when and why a PyTorch detection model stops training "
        "(or inferring) the same way twice. Exit codes: 0 deterministic, 1 divergence found, "
        "2 usage or input error (or one run, not compared), 3 a crash, 130 interrupted.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"detaudit {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run", help="audit a model: repeat it, record every step, compare, then record the first "
        "divergent step in detail",
        description="Run a probe N times from the same seed under recording hooks and report "
        "the first divergence: step, epoch, phase, module, origin or propagated, and cause.",
    )
    _add_run_arguments(run)
    run.add_argument("--nproc", type=_count, metavar="N",
                     help="audit a DDP set-up on N ranks (torch.distributed.run; gloo on CPU, "
                     "NCCL on CUDA): per-rank traces, cross-rank desync, sampler and seeding checks")
    run.set_defaults(func=cmd_run)

    baseline = sub.add_parser(
        "baseline", help="run a probe and store its fingerprints as a CI baseline",
        description="Run the probe (default 1 repeat) and store repeat 0's fingerprints, stats, "
        "configuration and environment in a baseline file for `detaudit check` (a file there "
        "is replaced: a baseline is updated by writing it again). The run's own folder, with "
        "its reports, is written under reports/ as `run` writes one.",
    )
    _add_run_arguments(baseline, out_help="baseline file to write, e.g. reports/baselines/NAME.json")
    baseline.set_defaults(func=cmd_baseline)

    check = sub.add_parser(
        "check", help="re-run a baseline's configuration and compare (exit 1 on change)",
        description="Re-run exactly the configuration stored in BASELINE and compare with it. "
        "Exit 0: matches; 1: changed (first changed record, report folder); 2: unreadable baseline; "
        "3: the probe crashed. A baseline is code: it names a probe (a built-in model or a probe "
        "file) that check imports and runs; check prints the file first and refuses a probe file "
        "outside the current folder unless --allow-external-probe is given.",
    )
    check.add_argument("baseline", help="a file written by `detaudit baseline`")
    check.add_argument("--out", help="folder for the new run (default: reports/check-<timestamp>/)")
    check.add_argument("--overwrite", action="store_true",
                       help="replace the run already in --out (refused otherwise)")
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.add_argument("--allow-external-probe", action="store_true",
                       help="run the baseline's probe file even when it lies outside the current "
                       "folder (it is code, and runs with your rights)")
    check.add_argument("--isolation", choices=("inprocess", "process"), default="inprocess",
                       help="how to run the repeats (default inprocess)")
    _add_gate_arguments(check)
    check.set_defaults(func=cmd_check, json=False)

    diff = sub.add_parser(
        "diff", help="compare two saved runs (CPU vs CUDA, 1 vs 2 threads, before vs after)",
        description="Compare repeat 0 of two run folders bitwise (or within --rtol/--atol on the "
        "stored stats) and name the first module that differs, with the origin analysis.",
    )
    diff.add_argument("run_a", help="run folder A (or what watch wrote: a folder of traces, "
                      "a trace file)")
    diff.add_argument("run_b", help="run folder B (the same)")
    diff.add_argument("--zoom", action="store_true",
                      help="when they part at a step, replay both runs here (repeat 0, each from "
                      "its own configuration) to that step at module and op level, and name "
                      "the module and op where they part")
    _add_gate_arguments(diff)
    diff.set_defaults(func=cmd_diff)

    execute = sub.add_parser(
        "exec", help="audit your own training command, unmodified: detaudit exec -- python train.py",
        description="Run COMMAND --repeats times, each a fresh process tree, with detaudit's "
        "recording attached before your code starts (nothing in it changes). Every optimizer "
        "step is recorded at scan level: the batch the top-level model is called with, every "
        "RNG, the loss backward is called on, the gradients as the optimizer gets them and the "
        "parameters after the update (in an inference script, every call of the model: its "
        "inputs and outputs); then the runs are compared as `run` compares its repeats. "
        "A command that starts ranks (torchrun, torch.multiprocessing.spawn) is recorded per "
        "rank, and the ranks are checked against each other as with `run --nproc`.",
        epilog="examples: `detaudit exec --seed 0 --max-steps 20 -- python train.py --epochs 1`; "
        "`detaudit exec --seed 0 --max-steps 20 -- torchrun --nproc-per-node 2 train.py`; "
        "in CI, where a hang must not hold the job: `detaudit exec --seed 0 --max-steps 200 "
        "--step-timeout 600 --junit audit.xml -- python train.py`",
    )
    execute.add_argument("--repeats", type=_count, default=2, help="runs to compare (default 2)")
    execute.add_argument("--seed", type=_seed,
                         help="seed python, numpy, torch and CUDA before your code runs, and "
                         "PYTHONHASHSEED for the process tree (default: leave them as your code "
                         "sets them)")
    execute.add_argument("--mode", choices=ATTACH_MODES, default=AUTO,
                         help="what a step is: an optimizer step (train), or a top-level call "
                         "of the model (infer: its inputs and outputs are recorded); auto "
                         "(default): infer if the model's first call is in eval mode and the "
                         "script has no optimizer")
    execute.add_argument("--max-steps", type=_count, metavar="K",
                         help="end each run cleanly after K steps")
    execute.add_argument("--max-epochs", type=_count, metavar="E",
                         help="end each run cleanly when its training DataLoader starts pass E+1")
    execute.add_argument("--step-timeout", type=_seconds, metavar="SECONDS",
                         help="stop a run in which no step ends for SECONDS (a hang: a "
                         "DataLoader worker that died, a collective a rank never joins): the "
                         "verdict is FAILED, saying where it was stopped, and the stacks of its "
                         "threads are kept in the run folder; the time before the first step "
                         "and evaluations between steps count, so leave room for them "
                         "(default: no limit)")
    execute.add_argument("--inject-fault", metavar="MODULE[/OP][@forward|@backward][:STEP]",
                         help="plant a 1-ULP change in the last run, as `run --inject-fault` "
                         "does (modules are named inside the top-level model)")
    execute.add_argument("--no-zoom", dest="zoom", action="store_false",
                         help="after a divergence in forward or backward, do not re-run the "
                         "command to record that step at module and op level")
    execute.add_argument("--zoom-tries", type=_count, default=3, metavar="N",
                         help="re-runs of the divergent step before it is reported as "
                         "intermittent (default 3)")
    execute.add_argument("--stress", default="16", metavar="K|all[:K]",
                         help="proof by re-execution: at the first step of every epoch, the "
                         "first run re-runs each op known to be possibly nondeterministic K "
                         "times on identical copies of its inputs (not where compiled code "
                         "may run); distinct results make the verdict a divergence even when "
                         "the runs agreed. 'all': every op of those steps (slow); 0: off "
                         "(default: 16)")
    execute.add_argument("--out", help="run folder (default: reports/exec-<timestamp>/)")
    execute.add_argument("--overwrite", action="store_true",
                         help="replace the run already in --out (refused otherwise)")
    execute.add_argument("--json", action="store_true",
                         help="print the summary as JSON on stdout (the command's output goes "
                         "to stderr)")
    execute.add_argument("--junit", metavar="FILE", help="also write the verdict as JUnit XML")
    execute.add_argument("--quiet", action="store_true", help="no progress bar, verdict line only")
    execute.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                         help="the command to audit, after --")
    execute.set_defaults(func=cmd_exec)

    compare = sub.add_parser(
        "compare", help="compare runs recorded by detaudit.watch (or any traces)",
        description="Compare the traces of separate runs of one training -- trace files, or "
        "folders of them as detaudit.watch(out=...) writes -- and report like `run`.",
    )
    compare.add_argument("runs", nargs="+", help="trace files or folders of traces")
    compare.add_argument("--out", help="run folder (default: reports/compare-<timestamp>/)")
    compare.add_argument("--overwrite", action="store_true",
                         help="replace the run already in --out (refused otherwise)")
    compare.add_argument("--json", action="store_true", help="print the summary as JSON")
    compare.add_argument("--junit", metavar="FILE", help="also write the verdict as JUnit XML")
    compare.add_argument("--quiet", action="store_true", help="the verdict line only")
    compare.set_defaults(func=cmd_compare)

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
    report.add_argument("folder", help="a run folder written by `detaudit run`, `exec`, "
                        "`check`, `compare` or `baseline` (the run folder `baseline` writes "
                        "under reports/, not its baseline file)")
    report.add_argument("--json", action="store_true", help="print summary.json to stdout")
    report.set_defaults(func=cmd_report)
    for p in (run, baseline, check, diff, execute, compare, models, env, report):
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    return parser


def _whole_number(text: str, expected: str = "a whole number") -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes {expected}, not {text!r}") from None


def _count(text: str, expected: str = "a whole number", least: int = 1) -> int:
    """A count of runs, epochs, steps, ranks or tries: a whole number, at least `least`."""
    count = _whole_number(text, expected)
    if count < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {count}")
    return count


def _at_least(least: int) -> Callable[[str], int]:
    """The type of a recipe size that has a smallest value (an image's side, the workers)."""
    return functools.partial(_count, least=least)


def _steps(text: str) -> int | str:
    """--steps N, or all (every batch of each epoch)."""
    return ALL_STEPS if text == ALL_STEPS else _count(text, "a number of steps or all")


def _seed(text: str) -> int:
    """A seed every RNG takes as it is: 0 to 2**32 - 1 (numpy's and PYTHONHASHSEED's range;
    others would be folded into it, two seeds giving one)."""
    seed = _whole_number(text)
    if not 0 <= seed < 2**32:
        raise argparse.ArgumentTypeError(f"takes 0 to {2**32 - 1}, not {seed} (numpy and "
                                         "PYTHONHASHSEED take no other)")
    return seed


def _seconds(text: str) -> float:
    """A time limit: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of seconds, not {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"takes a number of seconds above 0, not {text}")
    return value


def _tolerance(text: str) -> float:
    """A tolerance: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def _add_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rtol", type=_tolerance, default=0.0,
                   help="compare the stored stats within this relative tolerance instead of bitwise")
    p.add_argument("--atol", type=_tolerance, default=0.0, help="absolute tolerance for the stats")
    p.add_argument("--junit", metavar="FILE", help="also write the result as JUnit XML")
    p.add_argument("--json", action="store_true",
                   help="print the result as JSON on stdout (verdict, headline, exit_code, "
                   "first difference, message)")


def _add_run_arguments(p: argparse.ArgumentParser, out_help: str | None = None) -> None:
    baseline = out_help is not None
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a built-in probe (see `detaudit models`)")
    what.add_argument("--probe", metavar="FILE.py[:FUNC]",
                      help="your own probe file; FUNC(device) returns detaudit.Probe (default FUNC: probe)")
    p.add_argument("--mode", choices=("train", "infer"), default="train",
                   help="train: forward, backward, optimizer step; infer: forward only (default: train)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:i] (default: auto)")
    p.add_argument("--repeats", type=_count, help=(
        "runs to record; the baseline keeps the first, and says when the others differ from "
        "it (default: 1)") if baseline else "runs to compare (CPU preset: 2, CUDA preset: 3)")
    p.add_argument("--epochs", type=_count, help="epochs per run (preset: 2)")
    p.add_argument("--steps", type=_steps, metavar="N|all",
                   help="steps per epoch; all: every batch of each epoch (CPU preset: 2, CUDA "
                   "preset: 5)")
    p.add_argument("--seed", type=_seed, default=0, help="seed for every RNG (default: 0)")
    p.add_argument("--deterministic", action="store_true",
                   help="turn PyTorch's deterministic settings on for the run, to compare")
    # (a baseline refuses what `run` alone does, with the reason: out of its help)
    p.add_argument("--inject-fault", metavar="MODULE[/OP][@forward|@backward][:STEP]",
                   help=argparse.SUPPRESS if baseline else "plant a 1-ULP change at MODULE ((model): the model itself) in the last "
                   "repeat (default: forward, step 0); with /OP (e.g. roi_heads.box_roi_pool/torchvision.roi_align@backward:1, "
                   "or op:torchvision.nms for any module; an OP without its namespace, such as nms, "
                   "names it in any) inside that op: 1 ULP in its first float output (its "
                   "backward op in backward), a swap of two elements in an integer one")
    if baseline:
        p.add_argument("--granularity", choices=("module", "op"), default="module",
                       help="what the baseline keeps of every step: module: every module call "
                       "(default; a later check names the module); op: every op too (slower)")
    else:
        p.add_argument("--granularity", choices=("scan", "module", "op"), default="scan",
                       help="scan (default): every step's state only (batch, RNGs, losses, "
                       "gradients as the optimizer gets them, parameters after the update), "
                       "then a zoom into the first divergent step at module and op level; "
                       "module: hooks per module call on every step; op: every "
                       "aten/torchvision op of every step too (much slower)")
    p.add_argument("--no-drill-down", dest="drill_down", action="store_false",
                   help="after a divergence, do not replay the first divergent step op by op" + (
                       "" if baseline else " (at scan granularity: do not zoom)"))
    p.add_argument("--zoom-tries", type=_count, default=3, metavar="N",
                   help=argparse.SUPPRESS if baseline else "scan: replays of the first divergent step before it is reported as "
                   "intermittent (default 3)")
    p.add_argument("--census", action=argparse.BooleanOptionalAction, default=True,
                   help="list the known-nondeterministic ops the model runs (one step, even when "
                   "the repeats agree) and the alerts raised under "
                   "use_deterministic_algorithms(True, warn_only=True) (default: on)")
    p.add_argument("--stress", default="16", metavar="K|all[:K]",
                   help="proof by re-execution: at the first step of every epoch, the last "
                   "repeat re-runs each op known to be possibly nondeterministic on the device K "
                   "times on identical copies of its inputs; distinct results make the verdict "
                   "a divergence even when the repeats agreed. 'all': every op of those steps "
                   "(slow); 0: off (default: 16)")
    p.add_argument("--verify-fix", action="store_true",
                   help=argparse.SUPPRESS if baseline else "re-run with PyTorch's deterministic settings: deterministic now? at what "
                   "step-time and peak-memory cost?")
    p.add_argument("--isolation", choices=("inprocess", "process"), default="inprocess",
                   help="process: each repeat in a fresh interpreter (catches PYTHONHASHSEED and "
                   "leftover global state); default: inprocess")
    p.add_argument("--out", required=out_help is not None,
                   help=out_help or "run folder (default: reports/<probe>-<timestamp>/)")
    if out_help is None:
        p.add_argument("--overwrite", action="store_true",
                       help="replace the run already in --out (refused otherwise: runs never mix)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    if out_help is None:
        p.add_argument("--junit", metavar="FILE", help="also write the verdict as JUnit XML")
    p.add_argument("--quiet", action="store_true", help="no progress bar, verdict line only")
    recipe = p.add_argument_group("built-in probe recipe (with --model)")
    recipe.add_argument("--image-size", type=_at_least(32), help="square image size (CPU preset: 128, CUDA: 800)")
    recipe.add_argument("--batch-size", type=_count, help="images per step (CPU preset: 1, CUDA: 2)")
    recipe.add_argument("--num-images", type=_count, help="synthetic dataset size")
    recipe.add_argument("--instances", type=_count, help="objects per synthetic image (default 3)")
    recipe.add_argument("--num-classes", type=_at_least(2),
                        help="classes the model predicts, background included (default 5)")
    recipe.add_argument("--data", metavar="synthetic|coco:IMAGES_DIR:ANNOTATIONS.json",
                        help="dataset (default: synthetic, generated from the seed)")
    recipe.add_argument("--weights", metavar="PATH", help="local state dict to load (no downloads)")
    recipe.add_argument("--workers", type=_at_least(0), help="DataLoader workers (default 0)")
    recipe.add_argument("--shuffle", action="store_true", help="shuffle the DataLoader")
    recipe.add_argument("--augment", choices=("none", "flip"), help="augmentation (default none)")
    recipe.add_argument("--amp", action="store_true",
                        help="mixed precision: autocast + GradScaler on CUDA, bf16 autocast on CPU")
    recipe.add_argument("--accumulate", type=_count, help="gradient accumulation steps")
    recipe.add_argument("--clip-grad-norm", type=float, help="clip gradients to this norm")
    recipe.add_argument("--lr", type=float, help="SGD learning rate (default 0.005)")
    recipe.add_argument("--scheduler", choices=("none", "cosine"),
                        help="LR scheduler: cosine annealing with warm restarts")


def cmd_run(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit run`."""
    from . import api

    if args.verify_fix and args.nproc:
        raise DetauditError("--verify-fix re-runs one process with PyTorch's deterministic "
                            "settings, and does not run with --nproc: audit the ranks, then "
                            "verify the fix without --nproc")
    launch = Launch(args.isolation, args.nproc)
    spec, config, preset = _audit_setup(args, launch)
    _check_output_file(args.junit, "--junit")
    out = _out_folder(args.out, spec.name)
    investigations = Investigations(drill_down=args.drill_down, census=args.census,
                                    verify_fix=args.verify_fix, zoom_tries=args.zoom_tries)
    with _stdout_kept_for(args.json):
        result = api.run(
            spec, config, out=out, overwrite=args.overwrite, investigations=investigations,
            launch=launch, command=_reproduce_command(argv),
            preset=preset.describe(config, spec, launch.nproc),
            progress=_Bar(args.quiet or args.json),
        )
    _print_summary(args, result.summary, out)
    if result.ranks is not None and result.ranks.crash:
        crash = result.ranks.crash
        from .analysis.verdict import crash_line

        print(_safe(f"detaudit: {crash_line(crash)}; traces kept in {out}: "
                    f"{', '.join(crash.get('kept', [])) or 'none'}"), file=sys.stderr)
    if args.junit:
        _write_junit(args.junit, result.junit_case())
    return result.verdict.exit_code


def cmd_exec(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit exec -- COMMAND`."""
    from .config import ExecJob
    from .execution import exec_command

    started = time.perf_counter()

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise DetauditError("exec needs the command to audit after --, e.g. "
                            "detaudit exec --max-steps 10 -- python train.py")
    _check_output_file(args.junit, "--junit")
    out = _out_folder(args.out, "exec")
    job = ExecJob(repeats=args.repeats, seed=args.seed, max_steps=args.max_steps,
                  max_epochs=args.max_epochs, fault=_fault(args.inject_fault, check_op=False),
                  zoom=args.zoom, zoom_tries=args.zoom_tries, mode=args.mode,
                  step_timeout=args.step_timeout,
                  **_stress(args.stress))
    result = exec_command(command, job, out=out, overwrite=args.overwrite,
                          progress=_Bar(args.quiet or args.json),
                          output=sys.stderr if args.json else None,
                          reproduce=_reproduce_command(argv))
    return _report_compared(args, result, out, "detaudit.exec", started)


def cmd_compare(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit compare RUN ...`."""
    from .attached import compare

    started = time.perf_counter()
    _check_output_file(args.junit, "--junit")
    out = _out_folder(args.out, "compare")
    return _report_compared(args, compare(*args.runs, out=out, overwrite=args.overwrite), out,
                            "detaudit.compare", started)


def _report_compared(args: argparse.Namespace, result: Any, out: Path, classname: str,
                     started: float) -> int:
    """Print a compared run like `run` prints its own; its exit code. The JUnit case's time
    is the command's, from `started` (perf_counter)."""
    from .analysis.verdict import junit_error
    from .report import render_console
    from .report.junit import junit_case

    _print_summary(args, result.summary, out)
    if args.junit:
        verdict = result.verdict
        _write_junit(args.junit, junit_case(result.summary["probe"].get("name", "run"),
                                            classname, time.perf_counter() - started,
                                            verdict.passed, verdict.headline,
                                            render_console(result.summary),
                                            junit_error(verdict.kind)))
    return result.exit_code


def cmd_baseline(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit baseline`: run, then store repeat 0 as the baseline."""
    from . import api

    if args.verify_fix:
        raise DetauditError("--verify-fix is an investigation of `detaudit run`; a baseline "
                            "records the model as it is (run `detaudit run --verify-fix` first)")
    launch = Launch(args.isolation)
    spec, config, _ = _audit_setup(args, launch, repeats=1)
    api.check_baseline_config(config)
    _check_output_file(args.out, "--out")
    folder = _out_folder(None, f"{spec.name}-baseline")
    with _stdout_kept_for(args.json):
        made = api.baseline(spec, config, args.out, out=folder, launch=launch,
                            command=_reproduce_command(argv),
                            progress=_Bar(args.quiet or args.json))
    for warning in made.warnings:
        print(f"detaudit: warning: {_safe(warning)} (reports: {folder})", file=sys.stderr)
    if args.json:
        print(json.dumps({"path": str(made.path), "records": len(made.trace),
                          "steps": len(made.trace.steps), "warnings": made.warnings},
                         indent=1, sort_keys=True))
    else:
        print(f"baseline written: {made.path} ({len(made.trace)} records, "
              f"{len(made.trace.steps)} steps)")
    return EXIT_OK


def cmd_check(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit check BASELINE`."""
    from . import api

    started = time.perf_counter()
    _check_output_file(args.junit, "--junit")
    out = _out_folder(args.out, "check")
    with _stdout_kept_for(args.json):
        result = api.check(args.baseline, out=out, overwrite=args.overwrite,
                           launch=Launch(args.isolation), rtol=args.rtol, atol=args.atol,
                           command=_reproduce_command(argv),
                           progress=_Bar(args.quiet or args.json),
                           allow_external_probe=args.allow_external_probe)
    gate = result.gate
    if args.json:
        _print_gate_json(gate, folder=str(out))
    else:
        print(_safe(f"{gate.message}\nreport folder: {out}"))  # (as run says, either way)
    if args.junit:
        _write_junit(args.junit, _gate_case(gate, _junit_name(args), "detaudit.check",
                                            started))
    return gate.exit_code


def cmd_diff(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit diff RUN_A RUN_B`."""
    from . import api

    started = time.perf_counter()
    _check_output_file(args.junit, "--junit")
    with _stdout_kept_for(args.json):
        gate = api.diff(args.run_a, args.run_b, args.rtol, args.atol, zoom=args.zoom)
    if args.json:
        _print_gate_json(gate)
    else:
        print(_safe(gate.message))
    if args.junit:
        _write_junit(args.junit, _gate_case(gate, _junit_name(args), "detaudit.diff", started))
    return gate.exit_code


def _print_gate_json(gate: Any, **more: Any) -> None:
    """A check's or diff's result as JSON on stdout."""
    from dataclasses import asdict

    from .storage import jsonable

    print(json.dumps(jsonable({
        "verdict": gate.verdict, "headline": gate.headline, "exit_code": gate.exit_code,
        "first": asdict(gate.first) if gate.first is not None else None,
        "env_differences": gate.env_differences, "zoom": gate.zoom, "message": gate.message,
        **more}), indent=1, sort_keys=True))


def cmd_models(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit models`."""
    from tabulate import tabulate

    from . import probes

    print(tabulate(probes.available(), headers=["model", "what it audits"]))
    return EXIT_OK


def cmd_env(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit env`."""
    from tabulate import tabulate

    from . import api

    env, flagged = api.environment()
    if args.json:
        print(json.dumps({"env": env, "risks": flagged}, indent=1, sort_keys=True))
    else:
        rows = [(k, v, "RISK: " + flagged[k] if k in flagged else "") for k, v in sorted(env.items())]
        print(tabulate(rows, headers=["setting", "value", "risk"], maxcolwidths=[None, 40, 70]))
        print(f"\n{counted(len(flagged), 'risky setting')}" if flagged else "\nno risky settings")
    return EXIT_OK


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    """`detaudit report DIR`."""
    from . import api
    from .analysis.verdict import exit_code
    from .report import render_console, summary_json

    summary = api.render_folder(args.folder)
    code = exit_code(summary["verdict"])
    print(summary_json({**summary, "exit_code": code}) if args.json
          else _safe(render_console(summary)))
    return code


# -- from options to typed configuration ---------------------------------------------------
def _audit_setup(
    args: argparse.Namespace, launch: Launch, repeats: int | None = None
) -> tuple[ProbeSpec, AuditConfig, Preset]:
    """The probe description, the audit configuration and the preset they were filled from."""
    from . import api

    device = api.resolve_device(args.device)
    preset = preset_for(device.split(":")[0])

    def pick(name: str, default: Any = None) -> Any:
        value = getattr(args, name, None)
        if value is not None:
            return value
        return default if default is not None else getattr(preset, name)

    steps = pick("steps")
    config = AuditConfig(
        repeats=pick("repeats", repeats), epochs=pick("epochs"),
        steps=None if steps == ALL_STEPS else steps,
        mode=args.mode, device=device, seed=args.seed, deterministic=args.deterministic,
        fault=_fault(args.inject_fault), granularity=args.granularity,
        **_stress(getattr(args, "stress", "0")),
    )
    return _probe_spec(args, preset, launch.nproc), config, preset


def _stress(text: str) -> dict[str, Any]:
    """--stress K, all or all:K as AuditConfig fields."""
    every = text == "all" or text.startswith("all:")
    count = text[4:] if text.startswith("all:") else "16" if text == "all" else text
    try:
        runs = int(count)
    except ValueError:
        raise DetauditError(f"--stress takes a number of runs, all or all:K, not {text!r}") from None
    if runs < 0 or runs == 1:
        raise DetauditError("--stress needs at least 2 runs to compare (0 turns it off)")
    return {"stress": runs, "stress_every_op": every}


def _fault(text: str | None, check_op: bool = True) -> Fault | None:
    """--inject-fault's fault; its op checked here unless `check_op` is False (exec, whose
    own process never imports torch: its first run checks it)."""
    if text is not None and not text.strip():  # (an unset variable in a CI script, say)
        raise DetauditError("--inject-fault is empty: give MODULE[/OP][@forward|@backward]"
                            "[:STEP], or leave the option out")
    from .planting import check_op_known

    try:
        fault = Fault.parse(text) if text else None
    except DetauditError as exc:
        raise DetauditError(f"--inject-fault: {exc}") from None
    if check_op:
        check_op_known(fault)
    return fault


def _probe_spec(args: argparse.Namespace, preset: Preset, nproc: int | None) -> ProbeSpec:
    """A probe file's description, or a built-in probe's with its recipe options; on N ranks
    a built-in probe gets N times the images, so that every rank runs the preset's steps."""
    from .drivers.loading import builtin_spec, file_spec

    if args.probe:
        given = [f"--{n.replace('_', '-')}" for n in RECIPE_FLAGS if getattr(args, n, None)]
        if given:
            raise DetauditError(f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} the built-in recipe (--model); a "
                                "probe file builds its own model and data")
        return file_spec(args.probe)
    options: dict[str, Any] = {"seed": args.seed}
    for name in ("image_size", "batch_size", "num_images"):
        value = getattr(args, name)
        options[name] = getattr(preset, name) if value is None else value
    if nproc and args.num_images is None:
        options["num_images"] *= nproc
    for name in RECIPE_OPTIONS:
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    if args.shuffle:
        options["shuffle"] = True
    if args.amp:
        options["amp"] = True
    return builtin_spec(args.model, options)


def _out_folder(given: str | None, name: str) -> Path:
    """The run folder: --out as given, or a new ``reports/<name>-<timestamp>`` folder (removed
    again if the command ends before writing anything into it)."""
    from .runfolder import new_folder

    if given:
        _RUN_FOLDERS.append(Path(given))
        return Path(given)
    folder = new_folder("reports", name)
    _MADE_FOLDERS.append(folder)
    _RUN_FOLDERS.append(folder)
    return folder


_MADE_FOLDERS: list[Path] = []  # default run folders this command made
_RUN_FOLDERS: list[Path] = []  # the run folder this command writes (named if interrupted)


def _check_output_file(path: str | None, flag: str) -> None:
    """An output file's folder is created and must be writable before any work starts."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise DetauditError(f"{flag} {path} is a folder, not a file")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.probe", "w"):
            pass
        (target.parent / f".{target.name}.probe").unlink()
    except OSError as exc:
        raise DetauditError(f"{flag} {path} cannot be written: {exc.strerror or exc}") from None


@contextlib.contextmanager
def _stdout_kept_for(json_output: bool) -> Iterator[None]:
    """With --json, stdout holds only the JSON: the audited code's prints go to stderr."""
    if not json_output:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _reproduce_command(argv: list[str]) -> str:
    """The command line as given, minus detaudit's --out and --overwrite (a rerun writes a
    new folder); what follows ``--`` is the user's command, kept whole."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept, skip = [], False
    for arg in argv[:end]:
        if skip or arg == "--out":
            skip = not skip
            continue
        if not arg.startswith("--out=") and arg != "--overwrite":
            kept.append(arg)
    return "detaudit " + shlex.join(kept + argv[end:])


# -- output --------------------------------------------------------------------------------
class _Bar(Progress):
    """The API's progress, drawn as a tqdm bar on stderr (nothing when quiet)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.bar: Any = None

    def start(self, total: int | None, unit: str, description: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, disable=True if self.quiet else None, leave=False,
                        file=sys.stderr, unit=unit, dynamic_ncols=True, desc=description)

    def advance(self, description: str) -> None:
        if self.bar is not None:
            self.bar.set_description(description)
            self.bar.update(1)

    def status(self, description: str) -> None:
        if self.bar is not None:
            self.bar.set_description(description)

    def note(self, message: str) -> None:
        print(f"detaudit: {_safe(message)}", file=sys.stderr)

    def stage(self, name: str) -> None:
        if not self.quiet:
            print(f"detaudit: {STAGE_NAMES.get(name, name)} ...", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _print_summary(args: argparse.Namespace, summary: dict[str, Any], out: Path) -> None:
    """The summary as --json (with the exit code, as a command that ends before its verdict
    gives it), --quiet or the console text (with the ranks), then the folder."""
    from .analysis.verdict import exit_code
    from .report import render_console, render_ranks_console, summary_json

    if args.json:
        print(summary_json({**summary, "exit_code": exit_code(summary["verdict"])}))
    elif args.quiet:
        print(_safe(summary["headline"]))
    else:
        print(_safe(render_console(summary)))
        ranks = render_ranks_console(summary)
        if ranks:
            print("\n" + _safe(ranks))
        print(f"\nreports: {out}")


def _gate_case(gate: Any, name: str, classname: str, started: float) -> Any:
    """The JUnit case of a check or diff; its time is the command's, from `started`."""
    from .analysis.verdict import junit_error
    from .report.junit import junit_case

    return junit_case(name, classname, time.perf_counter() - started, gate.ok, gate.headline,
                      gate.message, junit_error(gate.verdict))


def _write_junit(path: str, case: Any) -> None:
    from .report.junit import write_junit

    write_junit(path, [case])
