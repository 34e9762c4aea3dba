"""Turning a probe description (built-in name + options, or a user file) into a factory.

A probe description is plain data, so a repeat in another interpreter, or a baseline
check next month, can rebuild exactly the same probe.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import torch

from ..config import PROBE_FILE_MODULE, ProbeSpec
from ..errors import DetauditError, ProbeError
from .runner import ProbeFactory, describe_user_error


def builtin_spec(name: str, options: dict[str, Any]) -> ProbeSpec:
    """The description of a built-in probe."""
    from .. import probes

    try:
        probes.get(name)
    except KeyError:
        known = ", ".join(n for n, _ in probes.available())
        raise DetauditError(f"unknown model {name!r}; known models: {known}") from None
    return ProbeSpec("builtin", name, options=options)


def file_spec(target: str) -> ProbeSpec:
    """The description of a user probe file given as ``FILE.py[:FUNC]``."""
    path, _, func = target.partition(":") if not Path(target).exists() else (target, "", "")
    path_obj = Path(path)
    if path_obj.is_dir():
        raise DetauditError(f"probe file {path} is a folder; give the probe file in it "
                            "(FILE.py[:FUNC])")
    if not path_obj.is_file():
        raise DetauditError(f"probe file {path} does not exist")
    return ProbeSpec("file", path_obj.stem, source=str(path_obj.resolve()), func=func or "probe")


def make_factory(spec: ProbeSpec) -> ProbeFactory:
    """A function `device -> Probe` for a probe description."""
    if spec.kind == "builtin":
        from .. import probes
        from ..probes.data import ProbeInputError
        from ..probes.options import RecipeOptions

        builder = probes.get(spec.name)
        try:
            options = RecipeOptions.from_dict(spec.options)
        except ValueError as exc:
            raise DetauditError(str(exc)) from None

        def factory(device: torch.device):
            try:
                return builder(device, options)
            except ProbeInputError as exc:
                raise DetauditError(str(exc)) from None

        return factory
    if spec.kind == "file" and spec.source:
        return _load_file_function(spec.source, spec.func)
    raise DetauditError(f"a probe of kind {spec.kind!r} cannot be rebuilt from its description")


def _load_file_function(source: str, func: str) -> ProbeFactory:
    """The probe function `func` of the file `source`, imported as Python runs a script:
    with the file's folder on ``sys.path``, so that it can import the modules beside it."""
    path = Path(source)
    module_name = f"{PROBE_FILE_MODULE}{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise DetauditError(f"cannot load probe file {path} (is it a .py file?)")
    folder = path.resolve().parent
    _import_from(folder)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except SyntaxError as exc:  # not a Python file detaudit can run: bad input, not a crash
        raise DetauditError(describe_user_error(exc, f"while importing {path}")) from exc
    except Exception as exc:
        raise ProbeError(describe_user_error(exc, f"while importing {path}")) from exc
    fn = getattr(module, func, None)
    if not callable(fn):
        raise DetauditError(f"probe file {path} defines no function {func!r}")
    _check_contract(fn, path, func)
    return fn


_probe_folders: set[Path] = set()  # the folders probe files were loaded from, in this process


def _import_from(folder: Path) -> None:
    """Put `folder` first on ``sys.path``, as Python does for a script (kept there: the probe
    may import when called), and forget the modules another probe file's folder gave that
    this folder has its own of (a ``helpers.py`` beside each of two probe files)."""
    for other in _probe_folders - {folder}:
        for name, module in list(sys.modules.items()):
            top = name.partition(".")[0]
            origin = getattr(module, "__file__", None)
            if (origin and Path(origin).is_relative_to(other)
                    and not Path(origin).is_relative_to(folder)
                    and ((folder / f"{top}.py").is_file() or (folder / top).is_dir())):
                del sys.modules[name]
    _probe_folders.add(folder)
    with contextlib.suppress(ValueError):
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))


def _check_contract(fn: ProbeFactory, path: Path, func: str) -> None:
    """A probe function must take the device, ``func(device)``, or the rank-aware
    ``func(device, rank, world_size)``; anything else is bad input, named in one line."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will tell
        return
    for args in ((None,), (None, None, None)):
        try:
            signature.bind(*args)
            return
        except TypeError:
            continue
    code = getattr(fn, "__code__", None)
    where = f"{path}:{code.co_firstlineno}" if code is not None else str(path)
    raise DetauditError(
        f"{where}: {func}{signature} does not take the device; a probe file defines "
        f"{func}(device) returning detaudit.Probe (or {func}(device, rank, world_size) for a "
        "distributed set-up that shards its own data)")
