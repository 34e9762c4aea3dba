"""How ``detaudit exec`` stops a run: when asked (Ctrl-C), and for ``--step-timeout`` when
no step ends in time, saying where it was.

Every process of the run that attaches notes itself beside the run's trace (PIDS_SUFFIX):
exec asks each to stop, and kills what is left, torchrun's ranks in sessions of their own
too (:func:`stop_run`, :func:`kill_left`). The recording process (each rank's) writes the
number of steps it ended to a file as steps end (PROGRESS_SUFFIX; at most every
NOTE_STEPS_EVERY_S), and exec watches
those files (:func:`wait_watching`): it shows the steps as progress and, with a step
timeout, watches when they change. When no step has ended for the timeout, it leaves a
mark (TIMED_OUT_SUFFIX), has each noted process write its stacks from C (DUMP_SIGNAL, which
works where Python cannot run a handler), then asks the command and each noted process to
stop (SIGTERM). A process that finds the mark as the signal comes keeps the step it had
completed, writes where its threads were (STACKS_SUFFIX) and saves its trace with the
failure (:func:`stopped_by_the_timeout`); what has not ended after the grace time is
killed, and the failure is said for it (:func:`say_timed_out`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import (
    ENDED,
    PIDS_SUFFIX,
    PROGRESS_SUFFIX,
    RECORDED_BY,
    STACKS_SUFFIX,
    TIMED_OUT_SUFFIX,
)
from ..record.sites import dumped_site, stopped_site
from ..trace import Trace

WATCH_INTERVAL_S = 1.0  # how often exec looks for a step's end
NOTE_STEPS_EVERY_S = 0.2  # the most often a recording process writes its steps ended
DUMP_WAIT_S = 0.5  # after the dump signal, how long exec gives the processes to write
# the signal that makes a watched process write its stacks from C (see note_attached): a
# real-time one no library claims, where there are such
DUMP_SIGNAL = signal.SIGRTMAX - 6 if hasattr(signal, "SIGRTMAX") else None
DUMP_SUFFIX = ".dump-"  # beside a run's trace, then the pid: what DUMP_SIGNAL made it write
MAIN_THREAD = "main thread"  # (a dump's first line: the id of the thread to read it by)
_DUMPS: list[Any] = []
# how a run was stopped for its step timeout: asked and ended, killed, or stopped before any
# process of it had imported torch (nothing of it could say where it was)
ASKED, KILLED, UNSTARTED = "asked", "killed", "unstarted"
_SAID = "no step ended within the --step-timeout"  # (how each failure it makes begins)


# -- in exec's own process --------------------------------------------------------------
def wait_watching(child: subprocess.Popen, trace: Path, timeout: float | None,
                  grace: float, on_steps: Callable[[int], None] | None = None,
                  ) -> tuple[int, str | None]:
    """The command's exit code, and how it was stopped for `timeout` (None: it was not). A
    run in which no step ends for that long (from the start, then from each step's end in
    any rank) is marked timed out and its processes asked to stop; whatever of them has not
    ended within `grace` seconds is killed. `on_steps` is given the steps ended (the most
    of any rank) when that changes."""
    if timeout is None and on_steps is None:
        return child.wait(), None
    seen: dict[Path, int] = {}
    last = time.monotonic()  # (the files' changes, not their times: no clock of theirs)
    while True:
        try:
            return child.wait(timeout=min(timeout or WATCH_INTERVAL_S, WATCH_INTERVAL_S)), None
        except subprocess.TimeoutExpired:
            pass
        beats, moved = beside(trace, PROGRESS_SUFFIX), False
        for beat in beats:
            with contextlib.suppress(OSError):
                changed = beat.stat().st_mtime_ns
                if seen.get(beat) != changed:
                    seen[beat], last, moved = changed, time.monotonic(), True
        if moved and on_steps is not None:
            on_steps(max(map(_steps_ended, beats)))
        if timeout is not None and time.monotonic() - last > timeout:
            break
    mark = trace.with_name(trace.name + TIMED_OUT_SUFFIX)
    mark.touch()
    if child.poll() is not None:  # (it ended as the time ran out)
        mark.unlink(missing_ok=True)
        return child.returncode, None
    unstarted = not _attached(trace)
    _ask_for_stacks(child, trace)
    ended = stop_run(child, trace, grace)
    return child.wait(), UNSTARTED if unstarted else ASKED if ended else KILLED


def _steps_ended(beat: Path) -> int:
    """The steps a progress file says its process ended (0 while it is being written)."""
    try:
        return int(beat.read_text())
    except (OSError, ValueError):
        return 0


def _ask_for_stacks(child: subprocess.Popen, trace: Path) -> None:
    """Each process of a watched run writes its stacks from C (see note_attached), then a
    moment for them to."""
    if DUMP_SIGNAL is None:
        return
    asked = [p for p in dict.fromkeys(_left(trace, child.pid)) if _catches(p.pid, DUMP_SIGNAL)]
    for process in asked:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, DUMP_SIGNAL)
    if asked:
        time.sleep(DUMP_WAIT_S)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (/proc's SigCgt mask)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def stop_run(child: subprocess.Popen, trace: Path, grace: float) -> bool:
    """Ask the command and each of its processes that attached to stop (SIGTERM: each saves
    what it recorded, then ends; not their DataLoader workers, whose end the loop would
    report as a crash) and wait up to `grace` seconds for them; whatever has not ended then
    is killed. Whether all ended when asked."""
    for pid in dict.fromkeys([child.pid, *(p.pid for p in _left(trace, child.pid))]):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    # a thin launcher may end at once, its ranks (in sessions of their own under torchrun)
    # after they saved
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (child.poll() is None or _left(trace, child.pid)):
        time.sleep(0.05)
    ended = child.poll() is not None and not _left(trace, child.pid)
    kill_left(child, trace)
    return ended


def kill_left(child: subprocess.Popen, trace: Path) -> None:
    """Whatever the command left running: its process group (DataLoader workers,
    subprocesses) and each process that attached outside it (torchrun starts each rank in
    a session of its own)."""
    for process in _left(trace, child.pid):
        process.kill()
    for process in _attached(trace):  # (a rank that ended, its stuck DataLoader worker left)
        process.kill_group()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def _left(trace: Path, group: int) -> list[_Process]:
    """The processes of the run that attached and still run (see _Process.ours)."""
    return [p for p in _attached(trace) if p.ours(group)]


def say_timed_out(recorded: dict[int | None, Trace], how: str, timeout: float,
                  grace: float, stand_ins: dict[int | None, Trace],
                  wheres: dict[int, str]) -> None:
    """The failure of a run stopped for its step timeout where its processes could not say
    it (killed, a handler of the script's own that took the signal, a wrapper that passes
    none on), or said another (what the stop made the script raise); where each was, as
    its recording process wrote it from C (`wheres`, by pid), if it did. A run that
    recorded nothing is its `stand_ins` (one per rank, as the run before had them)."""
    if not recorded:
        recorded.update(stand_ins)
    for trace in recorded.values():
        where = wheres.get(trace.probe.get(RECORDED_BY, -1))
        if where and trace.failure is not None and trace.failure.startswith(_SAID):
            # where it said it was as SIGTERM came, the other processes ending (a rank
            # whose peer ended moves on): where its stacks from C put it, before that
            trace.failure = f"{_SAID} ({timeout:g} s); it was at {where}"
            continue
        killed = how == KILLED and trace.probe.get(ENDED) is False  # (not one that ended)
        said = f"{_SAID} ({timeout:g} s)" + (
            f", and it did not end within {grace:g} s of being asked to (SIGTERM): killed"
            + (", its steps since the last one it saved lost" if trace.steps else "")
            if killed else ", which counts from the start: no process of the command had "
            "imported torch yet" if how == UNSTARTED else ": stopped (SIGTERM)"
            + ("" if where else "; where it was is not known"))
        said += f"; it was at {where}" if where else ""
        if trace.failure is None:
            trace.failure = said
        elif not trace.failure.startswith(_SAID):
            trace.failure = f"{said}; as it stopped: {trace.failure}"


def keep_stacks(trace: Path, name: str) -> Path | None:
    """The stacks the processes of a stopped run wrote, as one file in the run folder
    (``stacks-<name>.txt``), if any did: as each said where it was when asked to stop, and
    as each wrote them from C just before (innermost call first)."""
    said = [p.read_text(errors="replace") for p in sorted(beside(trace, STACKS_SUFFIX))]
    dumped = [f"process {pid}, its stacks as it wrote them from C when the time ran out, "
              f"before it was asked to stop:\n{text}" for pid, _, text in _dumps(trace)]
    if not said and not dumped:
        return None
    kept = trace.with_name(f"stacks-{name}.txt")
    kept.write_text("\n".join(said + dumped))
    return kept


def dumped_wheres(trace: Path) -> dict[int, str]:
    """Where each process of a stopped run was, by pid, as it wrote it on DUMP_SIGNAL."""
    return {pid: where for pid, main, text in _dumps(trace)
            if (where := dumped_site(text, main))}


def _dumps(trace: Path) -> list[tuple[int, int | None, str]]:
    """What each process of the run wrote on DUMP_SIGNAL: (pid, its main thread's id, the
    dump), where it wrote any."""
    found = []
    for path in beside(trace, DUMP_SUFFIX + "*"):
        pid = path.name.rpartition(DUMP_SUFFIX)[2]
        with contextlib.suppress(OSError, ValueError):
            head, _, text = path.read_text(errors="replace").partition("\n")
            main = int(head.removeprefix(MAIN_THREAD), 16) if head.startswith(MAIN_THREAD) \
                else None
            if pid.isdigit() and text.strip():
                found.append((int(pid), main, text))
    return sorted(found)


def clear_files(trace: Path) -> None:
    """What stopping keeps beside a run's trace (and its ranks'), once the run is over."""
    for suffix in (PROGRESS_SUFFIX, PIDS_SUFFIX, TIMED_OUT_SUFFIX, STACKS_SUFFIX):
        for path in beside(trace, suffix):
            path.unlink(missing_ok=True)
    for path in beside(trace, DUMP_SUFFIX + "*"):
        path.unlink(missing_ok=True)


def beside(trace: Path, suffix: str) -> list[Path]:
    """The files with `suffix` beside a run's trace and each of its ranks'."""
    stem = trace.name.removesuffix(".json.gz")
    return [*trace.parent.glob(trace.name + suffix),
            *trace.parent.glob(f"{stem}-r*.json.gz{suffix}")]


@dataclass(frozen=True)
class _Process:
    """A process of the run that attached, as it noted itself: its pid and, where /proc
    tells, when it started (so that a pid used again since is not taken for it)."""

    pid: int
    started: str

    def ours(self, group: int) -> bool:
        """Whether it still runs (an ended one not yet waited for does not) and is the one
        noted; where /proc is not, one in the command's process `group`."""
        state, started = _stat(self.pid)
        if started:
            return state != "Z" and started == self.started
        with contextlib.suppress(ProcessLookupError, PermissionError):
            return os.getpgid(self.pid) == group
        return False

    def kill(self) -> None:
        """Killed, with its own process group where it leads one (torchrun starts each rank
        in a session of its own: its DataLoader workers are in it)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, signal.SIGKILL)
            os.kill(self.pid, signal.SIGKILL)

    def kill_group(self) -> None:
        """What is left of the process group it led, if it did, ended or not: the members
        /proc shows in that group that started after it (not a group of a pid used again)."""
        if not self.started:
            return
        for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.pid and int(fields[19]) >= int(self.started):
                    os.kill(int(entry.name), signal.SIGKILL)


def _attached(trace: Path) -> list[_Process]:
    with contextlib.suppress(OSError):
        lines = trace.with_name(trace.name + PIDS_SUFFIX).read_text().splitlines()
        return [_Process(int(pid), started) for pid, _, started in
                (line.partition(" ") for line in lines) if pid.isdigit()]
    return []


def _stat(pid: int | str) -> tuple[str, str]:
    """A process's state and start time (fields 3 and 22 of /proc/PID/stat); ("", "") where
    it has ended or there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return "", ""


# -- in the command's processes ------------------------------------------------------------
def note_attached(trace: str, watched: bool = False) -> None:
    """This process attached to record `trace`'s run: exec may ask it to stop. `watched`
    (a step timeout): :data:`DUMP_SIGNAL` makes it write the stacks of its threads beside
    the trace, from C, even where Python cannot run a handler (a wait inside a C extension
    that never returns: a collective on the GPU), headed by its main thread's id. Set up
    before the process is noted: exec sends that signal only to a noted process that
    catches it (its default action ends a process)."""
    if watched and DUMP_SIGNAL is not None:
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            dump = open(f"{trace}{DUMP_SUFFIX}{os.getpid()}", "w")  # noqa: SIM115 (kept open)
            dump.write(f"{MAIN_THREAD} {threading.main_thread().ident:#x}\n")
            dump.flush()
            faulthandler.register(DUMP_SIGNAL, file=dump, all_threads=True)
            _DUMPS.append(dump)  # (faulthandler writes to its descriptor: kept open)
    with contextlib.suppress(OSError), open(trace + PIDS_SUFFIX, "a") as pids:
        pids.write(f"{os.getpid()} {_stat('self')[1]}\n")


def step_end_notes(path: Path, every: float = NOTE_STEPS_EVERY_S) -> Callable[[int], None]:
    """What notes that this process ended a step of the trace at `path` (the steps it
    ended, as each ends): written at most every `every` seconds, so that a short step
    pays for no write; exec reads them each WATCH_INTERVAL_S, and a step timeout is
    seconds long."""
    path, written = path.with_name(path.name + PROGRESS_SUFFIX), [-float("inf")]

    def step_ended(steps: int) -> None:
        now = time.monotonic()
        if now - written[0] >= every:
            written[0] = now
            with contextlib.suppress(OSError):
                path.write_text(str(steps))

    return step_ended


def timed_out(trace: str) -> bool:
    """Whether exec stopped the run of `trace` for its step timeout (asked as SIGTERM comes)."""
    return os.path.exists(trace + TIMED_OUT_SUFFIX)


def stopped_by_the_timeout(path: Path, frame: Any, seconds: float,
                           finish: Callable[[str], None]) -> None:
    """No step ended in `seconds`: where the main thread was (`frame`, where the signal
    found it) goes into the failure, given to `finish`, and every thread's stack into a
    file beside the trace at `path`, for exec to keep."""
    where = stopped_site(frame)
    said = f"process {os.getpid()} ({shlex.join(sys.argv)}), stopped at {where}\n{_stacks(frame)}"
    with contextlib.suppress(OSError):  # (one write: other processes of the run append too)
        fd = os.open(path.with_name(path.name + STACKS_SUFFIX),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{said}\n".encode(errors="replace"))
        finally:
            os.close(fd)
    finish(f"{_SAID} ({seconds:g} s); it was at {where}")


def _stacks(main_frame: Any) -> str:
    """Every thread's stack, most recent call last, as a traceback gives it: the main
    thread's from `main_frame`, where the signal found it (the handler runs in that thread,
    so its own frames are left out)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = {main: main_frame, **{
        ident: frame for ident, frame in sys._current_frames().items() if ident != main}}
    return "".join(
        f"\nThread {names.get(ident, ident)} (most recent call last):\n"
        + "".join(traceback.format_stack(frame))
        for ident, frame in frames.items() if frame is not None)
