"""Damaged and hostile trace files: each one either loads into a trace that compares and
renders, or is one TraceError naming the file -- never another exception.

The fuzz test mutates the checked-in golden trace with a seeded mutator (no dependencies):
values of another type, deleted keys, duplicated list elements, deep nesting, byte flips in
the JSON text and in the gzip stream, and truncation. A failing case is reproduced by its
index: ``_case(i)`` builds the same bytes every time.
"""

from __future__ import annotations

import gzip
import json
import random
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest

from detaudit.analysis.compare import compare, compare_ops
from detaudit.analysis.diff import diff_traces
from detaudit.analysis.verdict import judge
from detaudit.errors import TraceError
from detaudit.report import (
    render_console,
    render_github,
    render_html,
    render_markdown,
    summarize,
    summary_json,
)
from detaudit.runfolder import RunInfo
from detaudit.storage import dump_json
from detaudit.trace import Trace

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py

GOLDEN = Path(__file__).parent / "golden" / "planted"
RAW = (GOLDEN / "trace-0.json.gz").read_bytes()
TEXT = gzip.decompress(RAW)
DATA = json.loads(TEXT)
GOOD = Trace.load(GOLDEN / "trace-0.json.gz")
_RUN = json.loads((GOLDEN / "run.json").read_text())
INFO = RunInfo(probe=_RUN["probe"], config=_RUN["config"], command="", traces=[])
RENDERERS = (render_console, render_markdown, render_html, render_github, summary_json)

SEED = 20240617
CASES = 4800
DEEP = "\x00deep\x00"  # stands for a nested value spliced into the JSON text


# -- the mutator ----------------------------------------------------------------------------
def _other_value(rng: random.Random) -> Any:
    """A value of some type, often not the one the format wants there."""
    return rng.choice([
        lambda: rng.randint(-3, 300),
        lambda: rng.choice(["", "a", "forward", "op.forward", "op1/aten.mm/out.0", "op/x",
                            "0x1.8p1", "\u2028é\x00", "x" * 5000]),
        lambda: rng.uniform(-1e6, 1e6),
        lambda: None,
        lambda: rng.choice([[], [1, "a", None], [0, 1], [[2]], [-1]]),
        lambda: rng.choice([{}, {"a": 1}, {"step": 0}]),
        lambda: rng.choice([True, False]),
        lambda: rng.choice([2**63, 2**63 - 1, 2**64 + 1, -(2**63), 10**30, 10**400]),
        lambda: rng.choice(["nan", "NaN", "inf", "-inf", "Infinity", "0x1p+1024", "1e999",
                            "-0x0p+0", "0x", "0x1.zp3"]),
        lambda: rng.choice([float("nan"), float("inf"), -float("inf"), 1e308, -0.0]),
    ])()


def _tweak(rng: random.Random, value: Any) -> Any:
    """A value of the same type as `value`, usually different: mostly still a valid trace."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return max(-1, value + rng.choice([-2, -1, 1, 2, 7]))
    if isinstance(value, float):
        return value * rng.choice([-1.0, 0.5, 1.0000001, 3.0])
    if isinstance(value, str):
        return rng.choice([value + "x", value[:-1], "", "head", "forward", "backward", "op.forward",
                           "op0/aten.addmm/out.0", "rng.in", "0x1.8p1", "nan", value.upper()])
    if isinstance(value, list):
        return value[::-1]
    return value


def _walk(rng: random.Random, data: Any) -> list[Any]:
    """A random path from the root (at least one step down)."""
    path: list[Any] = []
    node = data
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.8):
        key = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    return path


def _get(data: Any, path: list[Any]) -> Any:
    for key in path:
        data = data[key]
    return data


def _encode(data: Any, rng: random.Random, depth: int = 0) -> bytes:
    """The trace file's bytes: gzip-compressed JSON (sometimes plain), with DEEP spliced in."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))  # NaN as the JSON extension
    if depth:
        nested = rng.choice([("[" * depth, "]" * depth), ('{"a":' * depth + "0", "}" * depth)])
        text = text.replace(json.dumps(DEEP), "".join(nested))
    raw = text.encode()
    return gzip.compress(raw, mtime=0) if rng.random() < 0.8 else raw


def _flip(rng: random.Random, raw: bytes, low: int = 0) -> bytes:
    out = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        out[rng.randrange(low, len(out))] ^= rng.randrange(1, 256)
    return bytes(out)


def _replace(rng: random.Random) -> tuple[str, bytes]:
    data = json.loads(TEXT)
    path = _walk(rng, data)
    value = _other_value(rng)
    _get(data, path[:-1])[path[-1]] = value
    return f"replace {path} with {str(value)[:40]!r}", _encode(data, rng)


def _same_type(rng: random.Random) -> tuple[str, bytes]:
    data = json.loads(TEXT)
    path = _walk(rng, data)
    parent = _get(data, path[:-1])
    parent[path[-1]] = value = _tweak(rng, parent[path[-1]])
    return f"tweak {path} to {str(value)[:40]!r}", _encode(data, rng)


def _delete(rng: random.Random) -> tuple[str, bytes]:
    data = json.loads(TEXT)
    path = _walk(rng, data)
    del _get(data, path[:-1])[path[-1]]
    return f"delete {path}", _encode(data, rng)


def _duplicate(rng: random.Random) -> tuple[str, bytes]:
    data = json.loads(TEXT)
    for _ in range(100):
        path = _walk(rng, data)
        lists = [path[:i] for i in range(1, len(path) + 1)
                 if isinstance(_get(data, path[:i]), list) and _get(data, path[:i])]
        if lists:
            break
    target = rng.choice(lists)
    items = _get(data, target)
    i = rng.randrange(len(items))
    items.insert(i, json.loads(json.dumps(items[i])))
    return f"duplicate {target}[{i}]", _encode(data, rng)


def _nest(rng: random.Random) -> tuple[str, bytes]:
    data = json.loads(TEXT)
    path = _walk(rng, data)
    _get(data, path[:-1])[path[-1]] = DEEP
    depth = rng.choice([100_000, 5000, 900, 65, 64, 63, 10])
    return f"nest {path} {depth} deep", _encode(data, rng, depth)


def _flip_json(rng: random.Random) -> tuple[str, bytes]:
    raw = _flip(rng, TEXT)
    return "flip bytes of the JSON text", gzip.compress(raw, mtime=0) if rng.random() < 0.8 else raw


def _flip_gzip(rng: random.Random) -> tuple[str, bytes]:
    if rng.random() < 0.2:  # the header: flags, mtime, extra flags, OS (some still load)
        out = bytearray(RAW)
        out[rng.randrange(2, 10)] ^= rng.randrange(1, 256)
        return "flip a byte of the gzip header", bytes(out)
    return "flip bytes of the gzip stream", _flip(rng, RAW)


def _truncate(rng: random.Random) -> tuple[str, bytes]:
    if rng.random() < 0.2:
        n = rng.randrange(len(TEXT))
        return f"truncate the JSON text at {n}", TEXT[:n]
    n = rng.randrange(len(RAW))
    return f"truncate the gzip stream at {n}", RAW[:n]


KINDS: dict[str, Callable[[random.Random], tuple[str, bytes]]] = {
    "replace": _replace, "same-type": _same_type, "delete": _delete, "duplicate": _duplicate,
    "nest": _nest, "flip-json": _flip_json, "flip-gzip": _flip_gzip, "truncate": _truncate,
}


def _case(i: int) -> tuple[str, str, bytes]:
    """Case i: its kind, what it did, and the file's bytes (the same every time)."""
    kind = list(KINDS)[i % len(KINDS)]
    what, raw = KINDS[kind](random.Random(SEED * 100_000 + i))
    return kind, what, raw


# -- what a loaded trace must survive -------------------------------------------------------
def _use(t: Trace) -> None:
    """Everything after loading: compare, judge, summarize, every renderer, the gate, the op
    comparison, and writing the trace again."""
    for pair in ([t, t], [t, GOOD], [GOOD, t]):
        comparison = compare(pair)
        verdict = judge(comparison)
        summary = summarize(INFO, comparison, pair, verdict)
        for render in RENDERERS:
            assert isinstance(render(summary), str)
        compare_ops(pair)
    diff_traces(GOOD, t)
    diff_traces(t, GOOD, rtol=1e-3)
    again = Trace.from_dict(json.loads(dump_json(t.to_dict())))
    assert again.to_dict() == t.to_dict()


def test_fuzzed_traces_load_and_render_or_are_one_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "trace-0.json.gz"
    outcomes: dict[str, dict[str, int]] = {kind: {"loaded": 0, "rejected": 0} for kind in KINDS}
    failures: list[str] = []
    start = time.perf_counter()
    for i in range(CASES):
        kind, what, raw = _case(i)
        path.write_bytes(raw)
        try:
            t = Trace.load(path)
        except TraceError as exc:
            message = str(exc)
            if str(path) not in message or "\n" in message:
                failures.append(f"case {i} ({what}): unclear error {message[:200]!r}")
            outcomes[kind]["rejected"] += 1
            continue
        except Exception:  # noqa: BLE001 - anything but TraceError is the bug we look for
            failures.append(f"case {i} ({what}): load raised {traceback.format_exc(limit=-2)}")
            continue
        try:
            _use(t)
        except Exception:  # noqa: BLE001
            failures.append(f"case {i} ({what}): loaded, then {traceback.format_exc(limit=-3)}")
            continue
        outcomes[kind]["loaded"] += 1
    elapsed = time.perf_counter() - start
    assert not failures, f"{len(failures)} failing cases; first:\n" + "\n".join(failures[:5])
    loaded = sum(o["loaded"] for o in outcomes.values())
    rejected = sum(o["rejected"] for o in outcomes.values())
    print(f"\n{CASES} cases in {elapsed:.1f} s: {loaded} loaded, {rejected} rejected; {outcomes}")
    assert loaded + rejected == CASES >= 2000
    assert loaded > 0 and rejected > 0
    for kind, counts in outcomes.items():  # every kind ran; the blunt ones never load
        assert sum(counts.values()) >= CASES // len(KINDS), kind
    assert outcomes["truncate"]["loaded"] == 0


# -- single damages, each with its message -------------------------------------------------
def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))
    return path


def test_the_golden_trace_loads_unchanged() -> None:
    for name in ("trace-0.json.gz", "trace-1.json.gz"):
        raw = (GOLDEN / name).read_bytes()
        t = Trace.load(GOLDEN / name)
        assert t.to_dict() == json.loads(gzip.decompress(raw))
        assert dump_json(t.to_dict(), compress=True) == raw


def test_a_byte_flip_in_the_deflate_stream_is_one_trace_error(tmp_path: Path) -> None:
    # find a flip that zlib itself rejects (not only the gzip checksum), so that the
    # zlib.error path is the one taken
    for pos in range(10, len(RAW) - 8):
        raw = bytearray(RAW)
        raw[pos] ^= 0xFF
        try:
            gzip.decompress(bytes(raw))
        except zlib.error:
            break
        except (OSError, EOFError):
            continue
    else:
        pytest.fail("no byte flip makes zlib fail")
    path = tmp_path / "t.json.gz"
    path.write_bytes(bytes(raw))
    with pytest.raises(TraceError, match="truncated or corrupt") as info:
        Trace.load(path)
    assert str(path) in str(info.value)


def test_deeply_nested_json_is_one_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.json.gz"
    text = TEXT.decode().replace('"env":{', '"env":{"x":' + "[" * 100_000 + "]" * 100_000 + ",")
    assert len(text) > 200_000
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    with pytest.raises(TraceError, match="nested too deeply") as info:
        Trace.load(path)
    assert str(path) in str(info.value)
    moderate = json.loads(TEXT)
    moderate["env"]["x"] = json.loads("[" * 200 + "]" * 200)
    with pytest.raises(TraceError, match=r"env is nested more than 64 deep"):
        Trace.load(_write(tmp_path, moderate))


def test_a_parent_out_of_range_is_one_trace_error(tmp_path: Path) -> None:
    data = json.loads(TEXT)
    data["calls"]["parent"][1] = 1  # the call at position 1 of step 0 names itself
    with pytest.raises(TraceError, match=r"calls\.parent\[1\] is 1, not the position of an earl"):
        Trace.load(_write(tmp_path, data))
    data = json.loads(TEXT)
    data["calls"]["parent"][0] = -2
    with pytest.raises(TraceError, match=r"calls\.parent\[0\] is -2, not an integer >= -1"):
        Trace.load(_write(tmp_path, data))


DELETE = object()
DAMAGES = [  # {path: new value (DELETE: remove it; index len(list): append)}, message
    ({("records", "step"): "0" * 120}, r"records\.step is '0{40}'\.\.\., not a list"),
    ({("records", "step", 12): "a"}, r"records\.step\[12\] is 'a', not an integer"),
    ({("records", "nonfinite", 3): True}, r"records\.nonfinite\[3\] is True, not an integer"),
    ({("records", "shape", 0): [2, -1]}, r"records\.shape\[0\] is a list, not a list of"),
    ({("records", "norm", 0): float("nan")}, r"records\.norm\[0\] is nan, not a finite"),
    ({("records", "fp", 120): "0" * 16}, r"records columns have different lengths"),
    # a print or a phase a baseline's editor damaged: a damaged file (exit 2), never a
    # difference (exit 1: "MISMATCH at ... ba7kward")
    ({("records", "fp", 0): "zz"}, r"records\.fp\[0\] is 'zz', not 16 hexadecimal digits"),
    ({("records", "phase", 0): "ba7kward"}, r"records\.phase\[0\] is 'ba7kward', not one of"),
    ({("records", "slot"): DELETE}, r"records\.slot is missing"),
    ({("records", "phase", 0): "op.forward"}, r"records\.slot\[0\] is 'batch\.0', not an op slot"),
    ({("calls", "step", 11): DELETE}, r"calls columns have different lengths"),
    ({("calls", "index", 1): 0, ("calls", "module", 1): ""},
     r"calls\[1\] repeats call 0 of module '' in step 0"),
    ({("steps", 0, "losses", "mse"): "half"},
     r"steps\[0\]\.losses\['mse'\] is 'half', not a float in hex"),
    ({("steps", 0, "losses", "mse"): "0x1p+1024"}, r"is '0x1p\+1024', not a float in hex"),
    ({("steps", 1, "step"): 1.0}, r"steps\[1\]\.step is 1\.0, not an integer"),
    ({("steps", 1, "optimizer_stepped"): 1}, r"optimizer_stepped is 1, not true or false"),
    ({("steps", 1, "lr"): "0.1"}, r"steps\[1\]\.lr is '0\.1', not a list"),
    ({("steps", 1, "scale"): "1"}, r"steps\[1\]\.scale is '1', not a finite number or null"),
    ({("steps", 2): [0, 0, 0]}, r"steps\[2\] is a list, not a dict"),
    ({("steps", 2, "epoch"): DELETE}, r"steps\[2\]\.epoch is missing"),
    ({("steps",): {}}, r"steps is a dict, not a list"),
    ({("repeat",): -1}, r"repeat is -1, not an integer >= 0"),
    ({("repeat",): 2**64}, r"repeat is 18446744073709551616, not an integer"),
    ({("env",): []}, r"env is a list, not a dict"),
    ({("env", "threads"): float("inf")}, r"env holds inf, not a finite number"),
    ({("probe", "config"): "cpu"}, r"probe\.config is 'cpu', not a dict"),
    ({("failure",): 3}, r"failure is 3, not a string or null"),
]


@pytest.mark.parametrize(("edits", "message"), DAMAGES)
def test_each_damage_is_named(tmp_path: Path, edits: dict[tuple, Any], message: str) -> None:
    data = json.loads(TEXT)
    for path, value in edits.items():
        parent = _get(data, list(path[:-1]))
        if value is DELETE:
            del parent[path[-1]]
        elif isinstance(parent, list) and path[-1] == len(parent):
            parent.append(value)
        else:
            parent[path[-1]] = value
    path = _write(tmp_path, data)
    with pytest.raises(TraceError, match=message) as info:
        Trace.load(path)
    text = str(info.value)
    assert text.startswith(f"trace {path} is damaged: ") and "\n" not in text


def test_the_version_must_be_the_integer(tmp_path: Path) -> None:
    for version in (True, 1.0, "1"):
        data = json.loads(TEXT)
        data["version"] = version
        with pytest.raises(TraceError, match="format version"):
            Trace.load(_write(tmp_path, data))


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    data = json.loads(TEXT)
    data["steps"][0]["future"] = {"a": 1}
    data["records"]["future"] = "x"
    data["future"] = [1]
    t = Trace.load(_write(tmp_path, data))
    assert t.to_dict() == DATA


def test_a_loss_near_the_float_maximum_renders(tmp_path: Path) -> None:
    data = json.loads(TEXT)
    data["steps"][0]["losses"]["mse"] = (1.7e308).hex()
    _use(Trace.load(_write(tmp_path, data)))
