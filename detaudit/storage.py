"""How detaudit's files are written and read: atomically, and with one clear error.

Every file detaudit writes (traces, ``run.json``, baselines, reports) goes through
:func:`atomic_write`, so a crash or Ctrl-C never leaves half a file under the real name;
every JSON file it reads goes through :func:`read_json` and :func:`check_format`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .errors import TraceError


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write `data` to a ``.part`` file, flush it to disk, then rename it over `path`."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as file:
            file.write(raw)
            file.flush()
            os.fsync(file.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def dump_json(data: Any, *, compress: bool = False, indent: int | None = None) -> bytes:
    """Deterministic, strict JSON bytes (sorted keys, never a bare NaN), gzip-compressed
    without a timestamp. Values that may be non-finite go through :func:`jsonable` first."""
    separators = None if indent is not None else (",", ":")
    text = json.dumps(data, sort_keys=True, indent=indent, separators=separators,
                      allow_nan=False)
    return gzip.compress(text.encode(), mtime=0) if compress else text.encode()


def jsonable(value: Any) -> Any:
    """`value` with every non-finite float written as the string ``"nan"``, ``"inf"`` or
    ``"-inf"`` (strict JSON has no NaN), tuples as lists and other objects as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int)):
        return value
    return str(value)


def read_bytes(path: str | Path, what: str) -> bytes:
    """A file's bytes; one clear error naming it otherwise."""
    path = Path(path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except MemoryError:
        raise TraceError(f"cannot read {what} {path}: it is too large to read") from None


@contextlib.contextmanager
def open_file(path: str | Path, what: str) -> Iterator[BinaryIO]:
    """A file open for reading in binary; one clear error naming it if it cannot be."""
    try:
        file = open(path, "rb")  # noqa: SIM115 -- closed below
    except OSError as exc:
        raise TraceError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    with file:
        yield file


def read_json(path: str | Path, what: str) -> Any:
    """Parse a JSON file, gzip-compressed or not; one clear error naming it otherwise."""
    path = Path(path)
    raw = read_bytes(path, what)
    try:
        return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    # zlib.error: a damaged deflate stream; EOFError: a cut one; OSError: a bad gzip header
    # or checksum; ValueError: not JSON or not text (UnicodeDecodeError, JSONDecodeError).
    except (OSError, EOFError, zlib.error, ValueError):
        raise TraceError(f"{what} {path} is truncated or corrupt") from None
    except RecursionError:
        raise TraceError(f"{what} {path} is corrupt: its JSON is nested too deeply") from None
    except MemoryError:
        raise TraceError(f"{what} {path} is too large to read") from None


def check_format(data: Any, name: str, version: int, source: str, remedy: str) -> dict[str, Any]:
    """`data` as a dict after checking its ``format`` and ``version`` header fields."""
    if not isinstance(data, dict) or data.get("format") != name:
        other = data.get("format") if isinstance(data, dict) else None
        if isinstance(other, str) and other.startswith("detaudit-"):  # (another of ours)
            hint = (" (`detaudit check` runs a baseline; compare the folder a check writes)"
                    if other == "detaudit-baseline" else "")
            raise TraceError(f"{source} is a {other[:40].replace('-', ' ')} file, not a "
                             f"{name.replace('-', ' ')} file{hint}")
        raise TraceError(f"{source} is not a {name.replace('-', ' ')} file")
    found = data.get("version")
    if type(found) is not int or found != version:  # not True, not 1.0
        raise TraceError(
            f"{source} has format version {describe(found)}; this detaudit reads "
            f"version {version} ({remedy})"
        )
    return data


def describe(value: Any, size: int = 40) -> str:
    """A value read from a file, shown in an error message: short, one line, never deep."""
    if isinstance(value, dict):
        return "a dict"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**size:
        return "a huge integer"
    if isinstance(value, str) and len(value) > size:
        return repr(value[:size]) + "..."
    text = repr(value)
    return text if len(text) <= size else text[:size] + "..."
