"""Where in the user's code something happened: the innermost frame outside detaudit, torch
and the Python installation."""

from __future__ import annotations

import functools
import os
import site
import sysconfig
from types import FrameType

import torch

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # detaudit/
# detaudit's code that runs a probe's steps: below it, with no user's frame in between, the
# op ran in the probe detaudit drives (a built-in one, installed with the library)
_DRIVERS = tuple(os.path.join(PACKAGE_DIR, name) for name in (
    os.path.join("drivers", "runner.py"), "investigate", "api.py", "cli.py", "__main__.py"))


def user_call_site(frame: FrameType | None) -> str:
    """`file:line` of the innermost frame at or above `frame` outside detaudit, torch and
    the Python installation (where the user's code called into them); "" if none is, or
    if detaudit's own driver called the code first."""
    while frame is not None and in_a_library(frame.f_code.co_filename):
        if os.path.abspath(frame.f_code.co_filename).startswith(_DRIVERS):
            return ""
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""


def in_a_library(filename: str) -> bool:
    """Whether `filename` is detaudit's, torch's or the Python installation's: its standard
    library or installed packages (not anything under its prefix: a script in /usr/src/app
    run by /usr/bin/python is the user's)."""
    return filename.startswith("<frozen ") or os.path.abspath(filename).startswith(
        _library_dirs())


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {PACKAGE_DIR, os.path.dirname(torch.__file__), site.getusersitepackages(),
            *getattr(site, "getsitepackages", list)(),  # (Debian's dist-packages)
            *(paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib",
                                       "scripts"))}  # (scripts: a console script's)
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)
