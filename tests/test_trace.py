from __future__ import annotations

import copy
import gzip
import json

import pytest
from conftest import module_audit, small_cnn_probe, stream_trace

from detaudit.analysis.compare import compare
from detaudit.errors import TraceError
from detaudit.record.fingerprint import TensorPrint
from detaudit.storage import dump_json
from detaudit.trace import StepInfo, Trace, TraceFile, open_trace

pytestmark = pytest.mark.shares_cores  # under pytest-xdist: see conftest.py


@pytest.fixture(scope="module")
def traces():
    return module_audit(small_cnn_probe, repeats=2, epochs=1).traces


def test_save_load_round_trip_and_same_bytes(traces, tmp_path):
    a = traces[0].save(tmp_path / "a.json.gz")
    b = traces[1].save(tmp_path / "b.json.gz")
    loaded = Trace.load(a)
    assert loaded.records == traces[0].records
    assert loaded.steps == traces[0].steps
    # two repeats of a deterministic run differ only in the repeat number
    da, db = (json.loads(gzip.decompress(p.read_bytes())) for p in (a, b))
    assert da["repeat"] == 0 and db["repeat"] == 1
    da.pop("repeat"), db.pop("repeat")
    assert da == db
    assert a.read_bytes() == traces[0].save(tmp_path / "again.json.gz").read_bytes()


def test_environment_is_recorded(traces):
    env = traces[0].env
    for key in ("torch", "torchvision", "cuda", "cudnn", "threads", "deterministic_algorithms",
                "CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "device"):
        assert key in env
    assert traces[0].probe["config"]["seed"] == 0


def test_frame_view(traces):
    frame = traces[0].frame()
    assert len(frame) == len(traces[0])
    assert {"step", "phase", "module", "call", "slot", "fp", "norm"} <= set(frame.columns)
    assert set(frame.phase) >= {"state", "forward", "backward", "grad", "optimizer", "output"}


def test_truncated_file_is_one_clear_error(traces, tmp_path):
    path = traces[0].save(tmp_path / "t.json.gz")
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(TraceError, match="truncated or corrupt"):
        Trace.load(path)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(TraceError, match="truncated or corrupt"):
        Trace.load(tmp_path / "junk.json")
    with pytest.raises(TraceError, match="cannot read"):
        Trace.load(tmp_path / "missing.json.gz")


def test_unknown_version_is_rejected(traces, tmp_path):
    data = traces[0].to_dict()
    data["version"] = 99
    path = tmp_path / "v99.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match="version 99"):
        Trace.load(path)


# -- the streamed form (version 2): written while recording, memory flat --------------------
def test_a_streamed_trace_reads_back_as_the_trace(traces, tmp_path):
    path = stream_trace(traces[0], tmp_path / "s.json.gz").path
    loaded = Trace.load(path)
    assert loaded.records == traces[0].records
    assert loaded.calls == traces[0].calls
    assert loaded.steps == traces[0].steps
    assert loaded.probe == json.loads(json.dumps(traces[0].probe))
    assert loaded.env == traces[0].env


def test_a_streamed_trace_cut_while_writing_keeps_every_flush_before_the_cut(traces, tmp_path):
    stream = stream_trace(traces[0], tmp_path / "s.json.gz")
    raw = stream.path.read_bytes()
    whole = len(traces[0].steps)
    members = _member_ends(raw)
    assert len(members) == whole + 1  # one per step, and the last flush's end line
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(raw[: members[1] + (members[2] - members[1]) // 2])  # in the 3rd member
    loaded = Trace.load(cut)
    assert [s.step for s in loaded.steps] == [0, 1]
    assert set(loaded.records["step"]) == {0, 1}
    # a damaged member with whole ones after it is not a cut: one clear error
    broken = bytearray(raw)
    broken[members[0] + 20] ^= 0xFF
    (tmp_path / "broken.json.gz").write_bytes(bytes(broken))
    with pytest.raises(TraceError, match="corrupt"):
        Trace.load(tmp_path / "broken.json.gz")


def _member_ends(raw: bytes) -> list[int]:
    import zlib

    ends, at = [], 0
    while at < len(raw):
        member = zlib.decompressobj(31)
        member.decompress(raw[at:])
        at = len(raw) - len(member.unused_data)
        ends.append(at)
    return ends


def test_watch_over_many_steps_holds_only_what_is_new(tmp_path, monkeypatch):
    import torch
    from torch import nn

    import detaudit
    from detaudit import trace as trace_module

    monkeypatch.setattr(trace_module, "FLUSH_ROWS", 200)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    held = []
    with detaudit.watch(model, opt, out=tmp_path) as w:
        for _ in range(300):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            w.step()
            held.append(len(w._attachment.trace))
    per_step = 1 + 3 + 4 + 4  # batch, rng streams, loss, 4 gradients, 4 parameters
    assert max(held) < 200 + 2 * per_step  # flushed whenever 200 records are held
    trace = Trace.load(w.path)
    assert [s.step for s in trace.steps] == list(range(300))
    assert len(trace) >= 300 * (per_step - 3) and trace.records["step"][-1] == 299


def test_a_streamed_trace_opens_to_be_read_a_step_at_a_time(traces, tmp_path):
    stream = stream_trace(traces[0], tmp_path / "s.json.gz")
    opened = open_trace(stream.path)
    assert isinstance(opened, TraceFile)
    assert opened.steps == traces[0].steps and opened.env == traces[0].env
    cuts = list(opened.by_step())
    expected = list(traces[0].by_step())
    assert [s for s, _ in cuts] == [s for s, _ in expected] == [s.step for s in traces[0].steps]
    for (_, got), (_, want) in zip(cuts, expected):
        assert got.records == want.records and got.calls == want.calls
    assert opened.records == traces[0].records  # whole, for the analyses that need it
    # a trace saved whole (not streamed) is loaded whole
    assert isinstance(open_trace(traces[1].save(tmp_path / "whole.json.gz")), Trace)


def test_comparing_streamed_traces_gives_what_comparing_them_in_memory_gives(traces, tmp_path):
    from detaudit.analysis.compare import compare

    changed = copy.deepcopy(traces[1])
    changed.records["fp"][len(changed) // 2] = "0" * 16  # one record of a middle step
    files = [open_trace(stream_trace(t, tmp_path / f"{i}.json.gz").path)
             for i, t in enumerate((traces[0], changed))]
    in_memory, streamed = compare([traces[0], changed]), compare(files)
    assert streamed.first_step == in_memory.first_step == changed.records["step"][len(changed) // 2]
    assert streamed == in_memory
    assert compare([traces[0], traces[1]]).deterministic


def test_a_streamed_trace_with_a_step_out_of_order_is_damaged(traces, tmp_path):
    path = tmp_path / "s.json.gz"
    lines = [{"format": "detaudit-trace", "version": 2}]
    for step in (0, 1, 0):
        rows = [i for i, s in enumerate(traces[0].records["step"]) if s == step]
        lines.append({"steps": [], "calls": {}, "records": {
            c: [traces[0].records[c][i] for i in rows] for c in traces[0].records}})
    lines.append({"end": {"probe": {}, "repeat": 0, "env": {}, "failure": None}})
    path.write_bytes(gzip.compress(b"".join(dump_json(x) + b"\n" for x in lines)))
    with pytest.raises(TraceError, match="damaged: line 4 holds records of step 0, which ended"):
        list(open_trace(path).by_step())


def test_a_streamed_trace_saved_elsewhere_keeps_what_was_changed(traces, tmp_path):
    opened = open_trace(stream_trace(traces[0], tmp_path / "s.json.gz").path)
    opened.repeat, opened.failure = 3, "interrupted"
    saved = opened.save(tmp_path / "moved.json.gz")
    (tmp_path / "s.json.gz").unlink()  # the file it came from may go
    again = open_trace(saved)
    assert (again.repeat, again.failure, again.steps) == (3, "interrupted", traces[0].steps)
    assert again.records == traces[0].records
    assert opened.records == traces[0].records  # read from where it was saved


def test_a_run_into_a_folder_streams_its_repeats_and_compares_as_if_held(tmp_path, monkeypatch):
    from conftest import small_cnn_probe

    from detaudit import Fault, audit
    from detaudit import trace as trace_module

    monkeypatch.setattr(trace_module, "FLUSH_ROWS", 50)  # several flushes per repeat
    kwargs = {"repeats": 2, "steps": 4, "granularity": "module", "drill_down": False,
              "fault": Fault("head", "backward", 2)}
    held, streamed = audit(small_cnn_probe, **kwargs), audit(small_cnn_probe, out=tmp_path, **kwargs)
    assert all(isinstance(t, Trace) for t in held.traces)
    assert all(isinstance(t, TraceFile) for t in streamed.traces)
    assert len(_member_ends((tmp_path / "trace-0.json.gz").read_bytes())) > 2
    assert streamed.comparison == held.comparison and streamed.comparison.first_step == 2
    assert [(f.module, f.role) for f in streamed.comparison.origins] == [("head", "origin")]
    assert Trace.load(tmp_path / "trace-1.json.gz").records == held.traces[1].records


def test_a_cut_streamed_trace_saved_with_its_failure_keeps_every_whole_flush(traces, tmp_path):
    raw = stream_trace(traces[0], tmp_path / "s.json.gz").path.read_bytes()
    members = _member_ends(raw)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(raw[: members[1] + (members[2] - members[1]) // 2])  # killed while writing
    opened = open_trace(cut)
    opened.failure = "killed"
    again = open_trace(opened.save(tmp_path / "kept.json.gz"))
    assert (again.failure, [s.step for s in again.steps]) == ("killed", [0, 1])
    assert {s for s, _ in again.by_step()} == {0, 1}


def test_compare_refuses_to_write_its_run_folder_over_the_traces_it_compares(traces, tmp_path):
    import detaudit
    from detaudit.errors import DetauditError

    for i, t in enumerate(traces):
        stream_trace(t, tmp_path / f"trace-{i}.json.gz")
    with pytest.raises(DetauditError, match="holds trace-0.json.gz, one of the traces compared"):
        detaudit.compare(tmp_path, out=tmp_path, overwrite=True)
    assert detaudit.compare(tmp_path, out=tmp_path / "compared").comparison.deterministic


def test_the_fork_is_repeat_0s_first_missing_record_before_one_only_another_repeat_has(traces):
    from detaudit.analysis.compare import compare

    other = copy.deepcopy(traces[1])
    r = other.records
    steps = r["step"]
    drop = max(i for i, s in enumerate(steps) if s == 3)  # repeat 1 lacks a record of step 3
    extra = max(i for i, s in enumerate(steps) if s == 1)  # and has one more at step 1
    for name, column in r.items():
        del column[drop]
        column.insert(extra + 1, "slot.extra" if name == "slot" else column[extra])
    fork = compare([traces[0], other]).fork
    assert (fork.step, fork.missing) == (3, 1) and fork.slot == traces[0].records["slot"][drop]


def test_calls_keep_the_parameters_they_read_and_traces_without_them_load(traces, tmp_path):
    """`reads` (the modules whose parameters a call took as inputs) is written only where a
    call read one, as in traces written before it was kept: a trace without it, whole or
    streamed, loads with none read; one with it keeps it; a value of the wrong kind is
    damage."""
    plain = traces[0]
    assert not any(plain.calls["reads"])  # SmallCNN passes no parameter to a call
    whole = plain.save(tmp_path / "whole.json.gz")
    data = json.loads(gzip.decompress(whole.read_bytes()))
    assert "reads" not in data["calls"]
    assert Trace.load(whole).calls == plain.calls
    stream = stream_trace(plain, tmp_path / "s.json.gz")
    assert b'"reads"' not in gzip.decompress(stream.path.read_bytes())
    assert [c.calls for _, c in open_trace(stream.path).by_step()] == [
        c.calls for _, c in plain.by_step()]
    assert open_trace(stream.path).calls == plain.calls
    reading = copy.deepcopy(plain)
    reading.calls["reads"][1] = ["stem"]
    for path in (reading.save(tmp_path / "reads.json.gz"),
                 stream_trace(reading, tmp_path / "reads-s.json.gz").path):
        assert open_trace(path).calls == reading.calls
    by_hand = Trace(probe=plain.probe, repeat=0, env=plain.env, steps=list(plain.steps),
                    records=plain.records,  # a trace built with the columns of before
                    calls={k: v for k, v in plain.calls.items() if k != "reads"})
    assert Trace.load(by_hand.save(tmp_path / "by-hand.json.gz")).calls == plain.calls
    data["calls"]["reads"] = ["stem"] * len(data["calls"]["step"])
    whole.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(TraceError, match=r"calls\.reads\[0\] is .*not a list of strings"):
        Trace.load(whole)


def _parameters_trace(repeat: int, steps: list[list[tuple[str, str, str]]]) -> Trace:
    """A trace of parameter records only: per step, (phase, slot, print)."""
    trace = Trace(probe={}, repeat=repeat, env={})
    for step, records in enumerate(steps):
        trace.steps.append(StepInfo(step=step, epoch=0, index=step, losses={"loss": "0x1p+0"}))
        for phase, slot, fp in records:
            trace.add_record(step, (phase, "fc", 0, slot), TensorPrint(fp, (2,), "float32",
                                                                       1.0, 1.0, 0))
    return trace


def test_a_repeat_that_began_where_another_ended_is_found_with_a_parameter_set_between_steps():
    """`frozen` is trained by no optimizer and set between steps 0 and 1 (a state record
    at step 1): a repeat beginning with the parameters repeat 0 ended with continued it."""
    first = _parameters_trace(0, [
        [("state", "param.w", "w0"), ("state", "param.frozen", "f0"), ("optimizer", "param.w", "w1")],
        [("state", "param.frozen", "f1"), ("optimizer", "param.w", "w2")]])
    second = _parameters_trace(1, [
        [("state", "param.w", "w2"), ("state", "param.frozen", "f1"), ("optimizer", "param.w", "w3")],
        [("optimizer", "param.w", "w4")]])
    assert compare([first, second]).continued_from == (1, 0, 1, True)


def test_a_buffer_whose_name_holds_param_is_no_parameter_that_diverged_under_an_equal_loss():
    a, b = (_parameters_trace(k, [[("state", "param.w", "w0"), ("optimizer", "param.w", "w1")],
                                  [("state", "buffer.param_count", f"n{k}"),
                                   ("optimizer", "param.w", "w2")]]) for k in (0, 1))
    c = compare([a, b])
    assert (c.first_step, c.param_drift_step, c.drifted) == (1, None, None)
