"""Where in the user's code something happened: the innermost frame outside detaudit, torch
and the Python installation (found without importing torch)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import site
import sys
import sysconfig
from types import FrameType

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


def in_an_installed_package(filename: str) -> bool:
    """Whether `filename` is a module of a package installed as a distribution, wherever its
    folder lies: the Python's packages, a `pip install --target` folder on PYTHONPATH, an
    editable checkout (a script run as a file, or a folder of modules, is none)."""
    path = os.path.abspath(filename)
    for entry in sys.path:
        root = os.path.join(os.path.abspath(entry or os.curdir), "")
        if entry and path.startswith(root):
            top = path[len(root):].split(os.sep)[0]
            if os.sep in path[len(root):] and top in _installed_packages(tuple(sys.path)):
                return True
    return in_a_library(filename)


@functools.lru_cache(maxsize=4)
def _installed_packages(path: tuple[str, ...]) -> frozenset[str]:
    """The top-level packages the distributions on the import `path` install."""
    import importlib.metadata

    return frozenset(importlib.metadata.packages_distributions())


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {PACKAGE_DIR, *_torch_dir(), site.getusersitepackages(),
            *getattr(site, "getsitepackages", list)(),  # (Debian's dist-packages)
            *(paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib",
                                       "scripts"))}  # (scripts: a console script's)
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)


def stopped_site(frame: FrameType | None) -> str:
    """Where a thread stopped from outside was (see site_of_stack), from its innermost
    frame."""
    stack = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return site_of_stack(stack)


def dumped_site(dump: str, main: int | None = None) -> str:
    """Where a faulthandler dump's thread `main` (by its id), else its current thread, else
    the last it lists (the oldest: the main thread, where the others started from it) was
    (see site_of_stack); "" for a dump with no frame."""
    blocks = re.split(r"\n(?=\S)", dump.strip())
    ids = [int(m.group(1), 16) if (m := re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)",
                                                  b)) else None for b in blocks]
    block = (blocks[ids.index(main)] if main is not None and main in ids else
             next((b for b in blocks if b.startswith("Current thread")), blocks[-1]))
    stack = [(name, int(line) if line.isdigit() else 0, function) for name, line, function in
             re.findall(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$', block, re.MULTILINE)]
    return site_of_stack(stack) if stack else ""


def site_of_stack(stack: list[tuple[str, int, str]]) -> str:
    """Where a stack (file, line, function; innermost first) was: the user's line and,
    where it was inside a library then, the innermost function it was in there outside
    detaudit and the standard library (torch's ``_try_get_data``, not the
    ``selectors.select`` it waits in), else the innermost. Code a library made
    (``<string>``, from ``eval``) is the library's."""
    def library(i: int) -> bool:
        name = stack[i][0]
        return in_a_library(name) or (name.startswith("<") and i + 1 < len(stack)
                                      and library(i + 1))

    user = next((i for i in range(len(stack)) if not library(i)), None)
    site = f"{stack[user][0]}:{stack[user][1]}" if user is not None else ""
    if not stack or user == 0:
        return site or "an unknown place"
    inner = next((i for i in range(user if user is not None else len(stack))
                  if not _standard_or_ours(stack[i][0])), 0)
    name, line, function = stack[inner]
    where = f"{function} of {library_path(name)}:{line}"
    return f"{site}, in {where}" if site else where


def _standard_or_ours(filename: str) -> bool:
    """Whether `filename` is the standard library's or detaudit's."""
    path = os.path.abspath(filename)
    standard, installed = _standard_dirs()
    return filename.startswith("<") or path.startswith(os.path.join(PACKAGE_DIR, "")) or (
        path.startswith(standard) and not path.startswith(installed))


@functools.cache
def _standard_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The standard library's folders, and the installed packages' (which may lie in it)."""
    paths = sysconfig.get_paths()
    return tuple(tuple(os.path.join(os.path.abspath(paths[name]), "") for name in names)
                 for names in (("stdlib", "platstdlib"), ("purelib", "platlib")))


def library_path(filename: str) -> str:
    """A library's file named from the folder it is installed in
    (``torch/utils/data/dataloader.py``, ``threading.py``)."""
    path = os.path.abspath(filename)
    roots = [os.path.dirname(d.rstrip(os.sep)) if d.rstrip(os.sep) in _packages() else d
             for d in _library_dirs()]
    root = max((r for r in roots if path.startswith(os.path.join(r, ""))), key=len, default="")
    return os.path.relpath(path, root) if root else path


def _packages() -> tuple[str, ...]:
    return PACKAGE_DIR, *_torch_dir()


@functools.cache
def _torch_dir() -> tuple[str, ...]:
    """Where torch is installed, found without importing it (exec's own process, which
    reads what its runs wrote, imports none)."""
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec is not None else None
    return (os.path.dirname(os.path.abspath(origin)),) if origin else ()
