"""The process a ``detaudit exec`` run records in: the bootstrap's entry point, which
attaches before the user's code runs (in the command's own process, in each rank's first
process, in ``torch.multiprocessing.spawn`` children), and the ways that process ends with
its trace saved (exit, ``os._exit``, SIGTERM, the step limit, the step timeout)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import (
    AUTO,
    CLAIM_SUFFIX,
    EXIT_CALL,
    FLUSHED_EACH_STEP,
    JOB_VARIABLE,
    LOADED_FROM_EARLIER_RUNS,
    OWNER_VARIABLE,
    RANK_OWNER_VARIABLE,
    RECORDED_BY,
    UNJOINED,
    Fault,
    rank_trace_path,
    written_by_an_earlier_run,
)
from ..record.sites import user_call_site
from .attach import Attachment
from .attach_patches import without_wrappers
from .rankprobe import RankWatch
from .runner import describe_user_error
from .stopping import note_attached, step_end_notes, stopped_by_the_timeout, timed_out


def failure_hook(attachment: Attachment) -> Callable[..., None]:
    """A ``sys.excepthook`` that keeps the user's uncaught error in the trace."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        with contextlib.suppress(Exception):
            attachment.trace.failure = describe_user_error(exc.with_traceback(tb), "while running")
        shown, seen = exc, set()
        while shown is not None and id(shown) not in seen:  # (and the errors it was raised in)
            seen.add(id(shown))
            shown.__traceback__ = without_wrappers(shown.__traceback__)
            shown = shown.__cause__ or shown.__context__
        previous(kind, exc, exc.__traceback__)

    return hook


def activate_from_environment() -> Attachment | None:
    """In a process started by ``detaudit exec``, as it imports torch (the bootstrap calls
    this; it has seeded ``random`` and numpy already, and handed a launcher's claim on):
    seed torch if asked, attach, and save the trace at exit.

    The first process of the command to begin a step records (a front-end that never
    imports torch, such as ``jupyter nbconvert``, leaves it to its kernel; a helper started
    before the script imported torch attaches, claims nothing and detaches as the script's
    first step is claimed: see :func:`_first_to_claim`), and so does the first
    process of each rank a launcher such as torchrun starts (``RANK`` and ``WORLD_SIZE``
    set), into a trace of its own; ``torch.multiprocessing.spawn`` children record from
    their entry point (see :func:`_spawned_rank`). Other processes, which inherit the claim
    (DataLoader workers, subprocesses), do not record.
    """
    text = os.environ.get(JOB_VARIABLE)
    if not text or _ATTACHED:
        return None
    job = json.loads(text)
    rank = _rank_to_claim()
    # a worker torch's elastic agent started (LOCAL_RANK set) records as its rank first:
    # those a launcher starts from its own process (`accelerate launch --multi_gpu` runs the
    # agent in it) find no owner. (Not any process with RANK set: a cluster may set it for
    # each node, torchrun's own process included, which would claim a worker's rank.)
    if rank is not None and "LOCAL_RANK" in os.environ:
        _claim(str(rank.rank))
        return _attach(job, rank)
    if os.environ.get(OWNER_VARIABLE) in (None, str(os.getpid())):  # execv keeps the pid
        _claim(None)  # (its children do not record; one started before may: see claim)
        attachment = _attach(job, claim=functools.partial(_first_to_claim, job["trace"]))
        _spawn_ranks_through(_spawned_rank)
        import torch.distributed as dist

        if dist.is_available():  # (a device mesh calls distributed_c10d's own name)
            joining = _recording_as_rank(attachment, job["trace"], dist.init_process_group)
            attachment._patch(dist, "init_process_group", joining)
            attachment._patch(dist.distributed_c10d, "init_process_group", joining)
        return attachment
    rank = rank or _launched_rank()
    if rank is not None:
        _claim(str(rank.rank))
        return _attach(job, rank)
    _seed_torch(job)  # a spawned child: seeded before its code runs, too
    _recording_once_it_joins(job)
    return None


def _seed_torch(job: dict[str, Any]) -> None:
    if job.get("seed") is not None:
        torch.manual_seed(int(job["seed"]))  # (every CUDA device too)


def _rank_to_claim() -> RankWatch | None:
    """The rank this process would record as (``RANK`` and ``WORLD_SIZE`` set, and no
    process above it claimed that rank), if any."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if (rank is not None and rank.isdigit() and world is not None and world.isdigit()
            and os.environ.get(RANK_OWNER_VARIABLE) != rank):
        return RankWatch(int(rank), int(world), UNJOINED)
    return None


def _launched_rank() -> RankWatch | None:
    """The rank of a copy of the command that a launcher in the recording process started
    (Lightning's and Fabric's for DDP on one machine: ``LOCAL_RANK`` and ``WORLD_SIZE``
    set, no ``RANK``; the process that started it records rank 0, see
    :func:`_recording_as_rank`), if this is one and no process above it claimed the rank."""
    rank, world = os.environ.get("LOCAL_RANK", ""), os.environ.get("WORLD_SIZE", "")
    if ("RANK" in os.environ or os.environ.get("NODE_RANK", "0") != "0" or not rank.isdigit()
            or not world.isdigit() or not 0 < int(rank) < int(world)  # (rank 0: the command)
            or os.environ.get(RANK_OWNER_VARIABLE) == rank
            or os.environ.get(OWNER_VARIABLE) != str(os.getppid())):  # (started by it)
        return None
    return RankWatch(int(rank), int(world), UNJOINED)


def _recording_as_rank(attachment: Attachment, trace: str,
                       init: Callable[..., Any]) -> Callable[..., Any]:
    """``init_process_group`` in the command's own process, which records no rank: once it
    joins a group of several, its launcher started the other ranks (see _launched_rank),
    and it records as its rank in that group from then on."""
    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        joined = init(*args, **kwargs)
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            rank, world = dist.get_rank(), dist.get_world_size()
            if world > 1 and attachment.record_as_rank(
                    RankWatch(rank, world, str(dist.get_backend())),
                    rank_trace_path(trace, rank)):
                os.environ[RANK_OWNER_VARIABLE] = str(rank)  # (its children: not that rank)
                _saved_every_step(attachment)
        return joined

    return init_process_group


def _recording_once_it_joins(job: dict[str, Any]) -> None:
    """A process that records nothing (it inherited the command's claim) records as its
    rank once it joins a process group of several as a rank no process above it records:
    a worker that a launcher other than torchrun or spawn started (Ray Train's workers,
    started by Ray's own processes, which inherit the environment of the script that
    started Ray). DataLoader workers and other children never join a group."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    init = dist.init_process_group

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        joined = init(*args, **kwargs)
        with contextlib.suppress(Exception):
            rank, world = dist.get_rank(), dist.get_world_size()
            if (world > 1 and not _ATTACHED
                    and os.environ.get(RANK_OWNER_VARIABLE) != str(rank)):
                dist.init_process_group = dist.distributed_c10d.init_process_group = init
                _claim(str(rank))
                _saved_every_step(_attach(
                    job, RankWatch(rank, world, str(dist.get_backend())), seeded=True))
        return joined

    dist.init_process_group = dist.distributed_c10d.init_process_group = init_process_group


def _saved_every_step(attachment: Attachment) -> None:
    """A rank that joined its group from a process no launcher of torch's started (Ray's
    workers; the command's own process, made rank 0 by a launcher in it) may be ended by
    its launcher without its exit hooks, as Ray ends its workers: its trace is saved at the
    end of every step, so only the step it was in is lost."""
    attachment.stream.every_step = True
    attachment.trace.probe[FLUSHED_EACH_STEP] = True


def _first_to_claim(trace: str) -> bool:
    """Whether this process is the first of the command to begin a step (or the process
    that did, re-executed), asked as its first step begins: processes started before the
    command's process imported torch, which inherited no claim (a helper that imports torch
    and trains nothing, two scripts a wrapper runs), record one trace, not each its own over
    it. The claim names the process, for exec to say."""
    claim = trace + CLAIM_SUFFIX
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        with contextlib.suppress(OSError, ValueError), open(claim) as f:
            return int(f.readline()) == os.getpid()
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n{shlex.join(sys.argv)}\n")
    return True


def _claim(rank: str | None) -> None:
    """This process records (for `rank`); its children inherit that and do not."""
    os.environ[OWNER_VARIABLE] = str(os.getpid())
    if rank is not None:
        os.environ[RANK_OWNER_VARIABLE] = rank


def _attach(job: dict[str, Any], rank: RankWatch | None = None,
            claim: Callable[[], bool] | None = None, seeded: bool = False) -> Attachment:
    """Record in this process (as `rank`), its torch seeded first unless it was as torch
    loaded (`seeded`: a process that attaches later must not draw anew)."""
    global _ATTACHED
    _ATTACHED = True
    if not seeded:
        _seed_torch(job)
    fault = Fault(**job["fault"]) if job.get("fault") else None
    path = job["trace"] if rank is None else rank_trace_path(job["trace"], rank.rank)
    if rank is not None:
        rank.wrapped_by = "script"  # the user's code builds its DDP model
    attachment = Attachment(path, job["probe"], int(job.get("repeat", 0)),
                            max_steps=job.get("max_steps"), max_epochs=job.get("max_epochs"),
                            zoom=job.get("zoom"), fault=fault,
                            rank=rank, planted_step=job.get("planted_step"),
                            mode=job.get("mode", AUTO), claim=claim,
                            stress=int(job.get("stress") or 0),
                            stress_every_op=bool(job.get("stress_every_op")),
                            check_fault=Fault(**job["check_fault"]) if rank is None
                            and job.get("check_fault") else None,
                            keep_planted=Fault(**job["keep_planted"])
                            if job.get("keep_planted") else None,
                            measure_against=Path(job["measure_against"])
                            if job.get("measure_against") else None)
    attachment.on_limit = functools.partial(_end_at_the_limit, attachment)
    attachment.install()
    _LINE_ENDS.follow(attachment)
    sys.excepthook = failure_hook(attachment)
    finish = functools.partial(_finish_run, attachment, job["trace"])
    atexit.register(finish)
    attachment._patch(os, "_exit", _exit_saving(finish))
    attachment._patch(sys, "exit", _exit_noting_where(attachment))
    if job.get("since_ns") is not None:
        attachment._patch(torch, "load", _loading_noted(
            attachment, torch.load, int(job["since_ns"]), int(job.get("began_ns") or 0)))
    # (exec asks it to stop, and ends it if it will not)
    note_attached(job["trace"], watched=bool(job.get("step_timeout")))
    attachment.trace.probe[RECORDED_BY] = os.getpid()
    attachment.on_step_end = step_end_notes(attachment.path)  # (a rank's too)
    if (threading.current_thread() is threading.main_thread()  # (torch imported in a thread)
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_terminate(attachment, job))
    return attachment


def _loading_noted(attachment: Attachment, load: Callable[..., Any], since_ns: int,
                   began_ns: int) -> Callable[..., Any]:
    """``torch.load`` that notes, in the trace, a file last written after the audit began
    (`since_ns`) and before this run of the command did (`began_ns`; not this process: the
    command's own first script may write what its second loads): one an earlier run of the
    audit wrote, such as a checkpoint the script resumes from, which makes the runs differ.
    A link is noted as the file it points to: a library may load through a temporary link
    that it deletes next (Composer's)."""
    @functools.wraps(load)
    def loading(f: Any, *args: Any, **kwargs: Any) -> Any:
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        with contextlib.suppress(OSError, TypeError, ValueError):  # (load says what is wrong)
            if isinstance(name, (str, os.PathLike)) and written_by_an_earlier_run(
                    name, since_ns, began_ns):
                file = os.path.realpath(name) if os.path.islink(name) else os.fspath(name)
                noted = attachment.trace.probe.setdefault(LOADED_FROM_EARLIER_RUNS, [])
                if file not in noted and len(noted) < 5:
                    noted.append(file)
        return load(f, *args, **kwargs)

    return loading


def _spawn_ranks_through(entry: Callable[..., Any]) -> None:
    """``torch.multiprocessing.spawn`` starts each rank at `entry` instead of torch's own
    wrapper (the child unpickles it by name), so that the rank records from its start."""
    spawning = importlib.import_module("torch.multiprocessing.spawn")  # the module, not
    global _TORCH_SPAWN_ENTRY  # torch.multiprocessing.spawn, the function
    if _TORCH_SPAWN_ENTRY is None:
        _TORCH_SPAWN_ENTRY = spawning._wrap
        spawning._wrap = entry


_TORCH_SPAWN_ENTRY: Callable[..., Any] | None = None
_ATTACHED = False  # this process records (once: the bootstrap may ask again)


def _spawned_rank(fn: Callable[..., Any], i: int, args: tuple, error_file: str) -> None:
    """A ``torch.multiprocessing.spawn`` child: process `i` records as rank `i` (the world
    size is the number of processes spawned, unknown here until it joins a group)."""
    spawning = importlib.import_module("torch.multiprocessing.spawn")
    job = json.loads(os.environ.get(JOB_VARIABLE) or "null")
    attachment = None
    if job is not None and os.environ.get(RANK_OWNER_VARIABLE) != str(i):
        _claim(str(i))
        attachment = _attach(job, RankWatch(i, 0, UNJOINED))
    failure = None
    try:
        (_TORCH_SPAWN_ENTRY or spawning._wrap)(fn, i, args, error_file)
    except SystemExit as exc:  # torch's wrapper exits 1 when the rank's function raised
        failure = f"rank {i} failed (exit code {exc.code})" if exc.code else None
        raise
    finally:
        if attachment is not None:
            attachment.finish(failure)


def _exit_noting_where(attachment: Attachment) -> Callable[..., None]:
    """``sys.exit`` that notes in the trace where the user's code called it (argparse's
    exit is noted at the ``parse_args`` call), so that a command ending with an error code
    after its steps says where."""
    real_exit = sys.exit

    def exit(status: object = None) -> None:
        with contextlib.suppress(Exception):
            site = user_call_site(sys._getframe(1))
            attachment.trace.probe[EXIT_CALL] = f"sys.exit({status!r})" + (
                f" at {site}" if site else "")
        real_exit(status)

    return exit


def _on_terminate(attachment: Attachment, job: dict[str, Any]) -> Callable[..., None]:
    """SIGTERM (detaudit exec after Ctrl-C): save what was recorded and end now, whatever
    the script would catch. A process that none of the user's code was running in (a
    notebook's kernel between cells, which its front-end ends after the last one) was done:
    nothing failed, and its last step is kept. It exits as SIGTERM would have it (143): a
    command whose own process ended so is a failed run all the same (a training loop
    inside an installed package, killed), a kernel's front-end that exits 0 is not. A run
    exec stops for its step timeout fails so, saying where it was (see stopping). A
    process forked from this one (a DataLoader worker) ends as SIGTERM ends it; one that
    is saving its trace as it ends already finishes that."""
    pid, handling = os.getpid(), []

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if handling or attachment.finishing:  # (a second SIGTERM: a launcher's, passed on)
            return
        handling.append(signum)
        while frame is not None and frame.f_code is handler.__code__:
            frame = frame.f_back  # (a second came as the first began: where that one was)
        try:
            if timed_out(job["trace"]):
                attachment.end_updated_step()  # (the hang came after it: it is complete)
                stopped_by_the_timeout(attachment.path, frame, float(job["step_timeout"]),
                                       attachment.finish)
            elif attachment.claimed:  # (one that never began a step says nothing)
                attachment.finish("interrupted (Ctrl-C or SIGTERM)" if user_call_site(frame)
                                  else None)
        finally:  # (a command ended so has not ended well: see execution)
            _end_process(128 + signum)

    return handler


def _end_at_the_limit(attachment: Attachment) -> None:
    """The step or epoch limit is reached and the trace saved (between steps, or as a
    DataLoader pass begins): the DataLoader workers end as the end of a loop ends them,
    each removing its temporary folder (killed with the process group, each would leave a
    ``pymp-*`` folder behind); the script's progress bars are closed as the end of a loop
    closes them, and a line its output left open is ended (a progress line redrawn with
    carriage returns: see _LineEnds), so that what prints next, the next run or the
    verdict, begins a line of its own; what the script registered to run at exit runs (see
    _run_exit_hooks); then the process ends."""
    for iterator in list(attachment.loader_iterators):
        shut_down = getattr(iterator, "_shutdown_workers", None)  # (not one without workers)
        if shut_down is not None:
            with contextlib.suppress(Exception):
                shut_down()
    _close_progress_bars()
    _LINE_ENDS.end_open_lines()
    _run_exit_hooks(attachment)
    _end_process()


class _LineEnds:
    """Whether the script's last write to stdout, and to stderr, left a line open (a stream
    whose `write` cannot be replaced is not followed)."""

    def __init__(self) -> None:
        self.streams: dict[int, tuple[Any, bool]] = {}  # id -> (the stream, left open)

    def follow(self, attachment: Attachment) -> None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None and id(stream) not in self.streams:
                with contextlib.suppress(AttributeError, TypeError):
                    attachment._patch(stream, "write", self._noting(stream, stream.write))
                    self.streams[id(stream)] = (stream, False)

    def _noting(self, stream: Any, write: Callable[..., Any]) -> Callable[..., Any]:
        def writing(text: Any, *args: Any, **kwargs: Any) -> Any:
            written = write(text, *args, **kwargs)
            if isinstance(text, str) and text:
                self.streams[id(stream)] = (stream, not text.endswith("\n"))
            return written
        return writing

    def end_open_lines(self) -> None:
        for stream, left_open in self.streams.values():
            if left_open:
                with contextlib.suppress(Exception):
                    stream.write("\n")
                    stream.flush()


_LINE_ENDS = _LineEnds()


def _run_exit_hooks(attachment: Attachment) -> None:
    """Run the exit hooks the script and its libraries registered (a temporary folder's
    removal, a logger's last flush), as its own end would: detaudit's save is done. One
    that has not returned within _EXIT_HOOKS_SECONDS (a child process it waits for, which
    the loop cut short would have ended) is left to the end of the process."""
    atexit.unregister(attachment.finish)
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is None:
        return
    hooks = threading.Thread(target=run, name="detaudit exit hooks", daemon=True)
    hooks.start()
    hooks.join(_EXIT_HOOKS_SECONDS)


_EXIT_HOOKS_SECONDS = 10.0


def _close_progress_bars() -> None:
    """Close the tqdm bars still open (tqdm.auto's and the libraries' subclasses are
    tqdm's too), innermost first."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    for bar in sorted(getattr(tqdm, "_instances", ()),
                      key=lambda b: -abs(getattr(b, "pos", 0))):  # (a fixed one's is negative)
        with contextlib.suppress(Exception):
            bar.close()


def _end_process(code: int = 0) -> None:
    """The trace is saved: end the process now, whatever the script would catch
    (``detaudit exec`` then ends the rest of its process group). On SIGTERM the
    DataLoader workers are not asked to end first: the signal may have come in the middle
    of the loader's own queue operations."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _REAL_EXIT(code)


_REAL_EXIT = os._exit


def _finish_run(attachment: Attachment, trace: str) -> None:
    """The run ends (its exit hook, ``os._exit``): the trace saved. Where exec stopped it
    for its step timeout and a SIGTERM handler of the script's own took the signal, the
    step whose update ran is kept, as detaudit's handler keeps it."""
    if timed_out(trace):
        attachment.end_updated_step()
    attachment.finish()


def _exit_saving(finish: Callable[[], None]) -> Callable[[int], None]:
    """``os._exit`` that saves the trace first (`finish`), in the recording process (a
    script that ends that way, as distributed ones do to avoid a hang at shutdown, skips
    the exit hook); its forked children (DataLoader workers) exit as they would."""
    pid = os.getpid()

    def _exit(code: int) -> None:
        if os.getpid() == pid:
            with contextlib.suppress(Exception):
                finish()
        _REAL_EXIT(code)

    return _exit
