"""The timing report reads trace files without a rank: an empty directory says how to produce
traces, a missing rank's file, malformed JSON (its file and line) and a bad event (its file and
event) are named, and a trace left unterminated by a crash is still read. Traces written by live
ranks, and the report over them: ``tests/ranks/test_timing.py``.
"""

from __future__ import annotations

import json

import pytest

from compiler_collectives.tools import report


def _write(path, events, close=True):
    text = "[\n" + "".join(json.dumps(e) + ",\n" for e in events)
    end = json.dumps({"name": "end", "ph": "i", "pid": 0, "tid": 0, "ts": 2.0})
    path.write_text(text + (end + "\n]\n" if close else ""))


def _event(rank, kind="guard", seq=1, dur=100.0):
    return {
        "name": f"{kind} collective",
        "ph": "X",
        "pid": rank,
        "tid": 0,
        "ts": 1.0,
        "dur": dur,
        "args": {"kind": kind, "seq": seq, "bytes_out": 24, "bytes_in": 24},
    }


def _meta(rank, world):
    return {"name": "compiler_collectives", "ph": "M", "pid": rank, "tid": 0, "args": {"world_size": world}}


def test_report_on_an_empty_directory_says_how_to_produce_traces(tmp_path):
    with pytest.raises(report.ReportError, match=r"no rank\*.json files.*COMPILER_COLLECTIVES_TRACE_DIR"):
        report.run(str(tmp_path))


def test_report_names_a_missing_rank_file(tmp_path):
    _write(tmp_path / "rank0.json", [_meta(0, 3), _event(0)])
    _write(tmp_path / "rank2.json", [_meta(2, 3), _event(2)])
    with pytest.raises(report.ReportError, match=r"missing trace file\(s\) for rank\(s\) \[1\]"):
        report.run(str(tmp_path))


def test_report_names_the_file_and_line_of_malformed_json(tmp_path):
    (tmp_path / "rank0.json").write_text('[\n{"ph": "M"},\n{"ph": "X", oops}\n]\n')
    with pytest.raises(report.ReportError, match=r"rank0\.json: line 3"):
        report.run(str(tmp_path))


def test_report_names_the_file_and_event_of_a_bad_event(tmp_path):
    _write(tmp_path / "rank0.json", [_meta(0, 1), {"ph": "X", "pid": 0, "ts": 1, "dur": 2, "args": {}}])
    with pytest.raises(report.ReportError, match=r"rank0\.json: event 1"):
        report.run(str(tmp_path))


def test_report_reads_a_trace_left_unterminated_by_a_crash(tmp_path):
    _write(tmp_path / "rank0.json", [_meta(0, 1), _event(0, seq=1), _event(0, seq=2)], close=False)
    traces = report.load(str(tmp_path))
    assert [e["args"]["seq"] for e in traces.events[0]] == [1, 2]


def test_the_report_command_exits_one_with_the_error_on_an_empty_directory(tmp_path, capsys):
    """The command's own exit, in process: ``python -m compiler_collectives report`` runs this
    ``main`` (its wiring: tests/ranks/test_timing.py's table test, a subprocess)."""
    from compiler_collectives.tools import cli

    assert cli.main(["report", str(tmp_path)]) == 1
    assert "no rank*.json files" in capsys.readouterr().err
