"""Timing switched on by environment variables: traces, summary, report (issue: timing).

The report's reading of bad trace files: ``tests/unit/test_timing_report.py``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from compiler_collectives.tools import report
from tests.fixtures import once_per_run
from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import kept_logs

# Multi-process tests here: release independent (tests/tiers.py).
pytestmark = pytest.mark.release_independent

CALLS = 6
LATE_S = 0.5


def _fn(x: torch.Tensor) -> torch.Tensor:
    return x.relu() + 1


def traced_job(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives.transport import groups

    f = torch.compile(_fn, backend="eager")
    # Our groups first: creating them is a rendezvous (the setup check) that
    # would line the ranks up again before the first exchange.
    groups.compile_pg()
    if rank == 1:
        time.sleep(LATE_S)  # rank 1 reaches the first exchange last, by this much
    for _ in range(CALLS):
        f(torch.ones(3 + rank, 2))
    s = cc.stats()
    figures = s["timing"]
    assert figures["guard"]["count"] == s["guard_collectives"]
    assert figures["compiler"]["count"] == s["compiler_collectives"] + s["compiler_input_exchanges"]
    assert 0 < figures["guard"]["p50_s"] <= figures["guard"]["max_s"]
    return {"compiler": s["compiler_collectives"], "guard": s["guard_collectives"]}


def _job_env(trace_dir: str) -> dict[str, str]:
    return rank_env(guards=True, timing=True, trace_dir=trace_dir, extra={"TORCH_COMPILER_COLLECTIVES": "1"})


def _enable_from_env_in_forkserver(rank: int, world: int) -> dict:
    # torch._dynamo.config was imported by the forkserver before our env was
    # set; apply TORCH_COMPILER_COLLECTIVES the way a fresh interpreter would.
    torch._dynamo.config.enable_compiler_collectives = os.environ["TORCH_COMPILER_COLLECTIVES"] == "1"
    return traced_job(rank, world)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    """The dir one 2-rank job wrote its traces to, one job per test run (``once_per_run``)."""
    return once_per_run(tmp_path_factory, "timing-traces", _traced_job)


def _traced_job(directory: Path) -> str:
    outcome = run_ranks(_enable_from_env_in_forkserver, 2, env=_job_env(str(directory)))
    assert outcome.results == [{"compiler": 1, "guard": CALLS - 1}] * 2
    return str(directory)


@pytest.mark.multiprocess
def test_every_rank_writes_one_valid_chrome_trace_with_an_event_per_collective(trace_dir):
    assert sorted(os.listdir(trace_dir)) == ["rank0.json", "rank1.json"]
    for rank in (0, 1):
        with open(os.path.join(trace_dir, f"rank{rank}.json")) as f:
            events = json.load(f)  # closed at exit: strict JSON
        collectives = [e for e in events if e.get("ph") == "X"]
        kinds = [e["args"]["kind"] for e in collectives]
        assert kinds.count("compiler") == 2  # the argument exchange, then the end of the trace
        assert kinds.count("guard") == CALLS - 1
        inputs, compiler = [e for e in collectives if e["args"]["kind"] == "compiler"]
        assert inputs["args"]["phase"] == "inputs" and compiler["args"]["phase"] == "trace"
        assert compiler["args"]["frame"].startswith("_fn at ")
        assert compiler["args"]["restart"] is False  # the differing dim was known before tracing
        assert compiler["args"]["bytes_out"] > 0 and compiler["args"]["bytes_in"] > compiler["args"]["bytes_out"]
        # What the recorder records about each exchange: the compile it belongs
        # to, how far apart the ranks arrived, and which rank came last.
        assert inputs["args"]["compile_id"] == compiler["args"]["compile_id"] == "0/0"
        assert inputs["args"]["last_rank"] == 1
        assert inputs["args"]["arrival_spread_ms"] >= LATE_S * 1e3 * 0.8
        assert compiler["args"]["arrival_spread_ms"] < inputs["args"]["arrival_spread_ms"]
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in collectives)
        guards = [e for e in collectives if e["args"]["kind"] == "guard"]
        assert [e["args"]["seq"] for e in guards] == list(range(1, CALLS))
        assert all(e["args"]["hit"] and e["args"]["agreed_hit"] for e in guards)


@pytest.mark.multiprocess
def test_the_report_merges_the_ranks_and_its_table_counts_match(trace_dir, tmp_path):
    merged = str(tmp_path / "merged.json")
    text = report.run(trace_dir, merged)
    traces = report.load(trace_dir)
    rows = {(r["rank"], r["kind"]): r for r in report.table_rows(traces)}
    assert {k: r["count"] for k, r in rows.items()} == {
        (0, "compiler"): 2,
        (0, "guard"): CALLS - 1,
        (1, "compiler"): 2,
        (1, "guard"): CALLS - 1,
    }
    with open(merged) as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert "slowest" in text and "last to arrive" in text


def untraced_job(rank: int, world: int) -> dict:
    import sys

    import compiler_collectives as cc
    from compiler_collectives.instrument import timing

    package_dir = os.path.dirname(cc.__file__) + os.sep
    written = []

    def audit(event: str, args: tuple) -> None:
        # Every file this process opens for writing, wherever it is, when our
        # package's code is on the stack (torch's own files are not ours to judge).
        if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        mode, flags = args[1], args[2]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        if not writing:
            return
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.startswith(package_dir):
                written.append(os.fsdecode(args[0]))
                return
            frame = frame.f_back

    sys.addaudithook(audit)
    cc.enable(guards=True)
    f = torch.compile(_fn, backend="eager")
    for _ in range(3):
        f(torch.ones(3 + rank, 2))
    return {
        "recorder": timing.recorder is not None,
        "timing": "timing" in cc.stats(),
        "written": written,
        "files": os.listdir(os.getcwd()),
    }


@pytest.mark.multiprocess
def test_with_the_variables_unset_nothing_is_recorded_and_no_file_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outcome = run_ranks(untraced_job, 2)
    for r in outcome.results:
        assert r["recorder"] is False and r["timing"] is False
        # Nothing anywhere, but the guard transport's segment (unlinked once every rank mapped it).
        # The guard collective's shared-memory segment is created in /dev/shm (an
        # O_TMPFILE opened on the directory, then linked under our name): not a trace.
        segment = [p for p in r["written"] if p == "/dev/shm" or p.startswith("/dev/shm/compiler_collectives-")]
        assert [p for p in r["written"] if p not in segment] == [], r["written"]
        assert r["files"] == []
    assert os.listdir(tmp_path) == []


def unwritable_job(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    warnings = kept_logs("compiler_collectives.timing", "WARNING")
    cc.enable(guards=True)
    f = torch.compile(_fn, backend="eager")
    for _ in range(4):
        f(torch.ones(3 + rank, 2))
    return {"warnings": warnings, "guard": cc.stats()["guard_collectives"]}


@pytest.mark.multiprocess
def test_an_unwritable_trace_directory_warns_once_and_the_job_goes_on(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    outcome = run_ranks(unwritable_job, 2, env=rank_env(trace_dir=blocker / "traces"))
    for r in outcome.results:
        assert r["guard"] == 3
        assert len(r["warnings"]) == 1 and "trace" in r["warnings"][0]


@pytest.mark.multiprocess
def test_the_report_command_prints_the_table_and_exits_zero(trace_dir):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "compiler_collectives", "report", trace_dir], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("2 ranks; merged trace: ")
    guard_rows = [ln.split() for ln in lines if ln.split()[1:2] == ["guard"]]
    assert [(row[0], row[2]) for row in guard_rows] == [("0", str(CALLS - 1)), ("1", str(CALLS - 1))]
