from __future__ import annotations

import gzip
import json

import pytest
from conftest import module_audit, small_cnn_probe

from detaudit.errors import TraceError
from detaudit.trace import Trace


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
