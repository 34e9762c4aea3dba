"""Put on PYTHONPATH by ``detaudit exec``: attaches detaudit's recording in the process the
job names (nothing happens without the job variable), then runs the ``sitecustomize`` this
one hides, if there is one.

A process attaches when it imports torch, not when it starts (and records if it is the
first to begin a step): a front-end that never imports torch (``jupyter nbconvert``,
``papermill``, a wrapper script) leaves it to the process that trains (the notebook's
kernel). With ``--seed``, ``random`` is seeded now and numpy as it loads, before the user's
code can draw from either; torch as it loads.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import random
import sys

_JOB = "DETAUDIT_ATTACH"  # (config.JOB_VARIABLE; this file imports nothing of detaudit)
_OWNER = "DETAUDIT_ATTACH_PID"  # (config.OWNER_VARIABLE)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` right after the top-level module `name` is imported. It stays
    first on the import path until then: a library that only looks for the module
    (``importlib.util.find_spec("torch")``, as transformers does) gets a spec of its own."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            run_module, finder = spec.loader.exec_module, self

            def exec_module(module):  # (a loader may load other modules too)
                run_module(module)
                if module.__name__ == finder.name and finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                    finder.then(module)

            spec.loader.exec_module = exec_module
        return spec


class _WhenImportsSettle(importlib.abc.MetaPathFinder):
    """Calls `then()` at the first import after no module of detaudit is importing itself
    any more (torch, imported by detaudit's own import of a module the recording needs,
    as ``from detaudit import Probe`` does, cannot attach before that import is done)."""

    def __init__(self, then):
        self.then = then

    def find_spec(self, fullname, path=None, target=None):
        if not _detaudit_importing() and self in sys.meta_path:
            sys.meta_path.remove(self)
            self.then()


def _detaudit_importing():
    return any(name.split(".")[0] == "detaudit"
               and getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()))


def _after_import(name, then):
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def _unattached(said):
    """This process imports torch but cannot import detaudit: said where exec looks."""
    print(f"detaudit: {said}: this process runs unaudited", file=sys.stderr)
    try:
        with open(json.loads(os.environ[_JOB])["trace"] + ".unattached", "w") as note:
            note.write(said)
    except (OSError, ValueError, KeyError, TypeError):
        pass


def _attach(torch_module=None):
    if _detaudit_importing():
        sys.meta_path.insert(0, _WhenImportsSettle(_attach))
        return
    try:
        from detaudit.drivers.attach_process import activate_from_environment
    except ImportError as exc:  # a Python without detaudit
        _unattached(f"{sys.executable} cannot import detaudit ({exc})")
    else:
        activate_from_environment()


def _seed_numpy(seed):
    def seed_numpy(numpy):
        numpy.random.seed(seed % 2**32)
    return seed_numpy


def _start():
    try:
        job = json.loads(os.environ[_JOB])
    except ValueError:
        return
    if job.get("launcher") and os.environ.get(_OWNER) is None:
        # the command is a launcher (see execution._is_launcher): the script it starts
        # claims the recording, as the command's own process would
        os.environ[_JOB] = json.dumps({**job, "launcher": False})
        return
    if job.get("seed") is not None:
        random.seed(int(job["seed"]))
        _after_import("numpy", _seed_numpy(int(job["seed"])))
    _after_import("torch", _attach)


if os.environ.get(_JOB):
    _start()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_detaudit_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


_chain()
