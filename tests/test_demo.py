"""`scripts/dev demo` (scripts/demo.py): end to end in a subprocess, its timeout path, and --help."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import compiler_collectives

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import demo  # noqa: E402  (scripts/demo.py: the demo is not part of the library)


def _run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # A torchrun-like environment would make the demo run "this rank's part" only.
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "demo.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _table_rows(stdout: str, run: str) -> dict[int, str]:
    """rank -> table row, for the rows of one run."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(rf"^{re.escape(run)}\s+(\d+)\s", line)
        if m:
            rows[int(m.group(1))] = line
    return rows


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still there: only acceptable as a zombie waiting for init.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_demo_runs_both_trainings_and_the_service_makes_ranks_agree(tmp_path):
    out_json = tmp_path / "demo.json"
    proc = _run_cli(["--nproc", "2", "--steps", "6", "--json", str(out_json)], timeout=280)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output

    # Progress was shown while it ran, for both runs.
    assert "[off] step   1/6" in proc.stdout and "[on] step   6/6" in proc.stdout, output

    # The table holds both runs, one row per rank; every service rank finished.
    off_rows, on_rows = _table_rows(proc.stdout, "off"), _table_rows(proc.stdout, "on")
    assert sorted(off_rows) == [0, 1] and sorted(on_rows) == [0, 1], output
    for row in on_rows.values():
        assert row.rstrip().endswith("finished"), row
    assert "same compile decisions on every rank" in proc.stdout, output
    assert "DIFFERENT compile decisions across ranks" in proc.stdout, output

    results = {r["run"]: r for r in json.loads(out_json.read_text())}
    off, on = results["off"], results["on"]
    assert off["finished"] and on["finished"]
    # Without the service rank 0 (whose length never changes) keeps one static
    # graph while rank 1 recompiles alone: the ranks disagree.
    assert off["agree"] is False
    off0, off1 = (r["result"] for r in off["ranks"])
    assert off0["graphs"] == 1 and off0["dynamic_dims"] == []
    assert off1["graphs"] > 1 and off1["dynamic_dims"]
    assert off0["guard_collectives"] == off1["guard_collectives"] == 0
    # With it, every rank compiles the same graphs with the same dynamic dims,
    # and rank 0 recompiled because rank 1's guards missed.
    assert on["agree"] is True
    on0, on1 = (r["result"] for r in on["ranks"])
    assert on0["graph_dims"] == on1["graph_dims"]
    assert on0["dynamic_dims"] == on1["dynamic_dims"] == off1["dynamic_dims"]
    assert on0["forced_recompiles"] >= 1
    assert on0["guard_collectives"] == on1["guard_collectives"] > 0
    for run in (off, on):
        for rank in run["ranks"]:
            assert _gone(rank["pid"]), f"rank process {rank['pid']} of run {run['run']} was not reaped"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_hanging_run_is_reported_as_timed_out_and_its_ranks_are_killed(tmp_path):
    # Compiler collectives without guard collectives hang as soon as rank 1
    # recompiles alone; the demo must kill the ranks at --timeout and say so.
    out_json = tmp_path / "demo.json"
    timeout = 45
    proc = _run_cli(
        ["--runs", "compiler-only", "--nproc", "2", "--steps", "4", "--timeout", str(timeout), "--json", str(out_json)],
        timeout=240,
    )
    output = proc.stdout + proc.stderr
    (run,) = json.loads(out_json.read_text())
    try:
        assert proc.returncode == 0, output  # this run is expected to hang
        assert "timed out" in proc.stdout, output
        assert not run["finished"]
        assert {r["status"] for r in run["ranks"]} == {"timed out"}, run
        assert run["elapsed_s"] < timeout + 15, run["elapsed_s"]
        # Before killing them the demo asked every rank where it was stuck.
        assert all(r["stuck_at"] for r in run["ranks"]), run["ranks"]
        assert "was stuck in" in proc.stdout, output
        for rank in run["ranks"]:
            assert _gone(rank["pid"]), f"rank process {rank['pid']} was not killed"
    finally:
        if run.get("log_dir"):
            shutil.rmtree(run["log_dir"], ignore_errors=True)


def _demo_parser():
    return demo.build_parser()


@pytest.mark.multiprocess
def test_demo_help_lists_and_explains_every_option():
    demo_parser = _demo_parser()
    help_text = demo_parser.format_help()
    options = [a for a in demo_parser._actions if a.option_strings and a.dest != "help"]
    expected = {
        "--nproc",
        "--steps",
        "--backend",
        "--timeout",
        "--runs",
        "--batch-size",
        "--seed",
        "--log-every",
        "--json",
    }
    assert expected <= {s for a in options for s in a.option_strings}
    for action in options:
        for flag in action.option_strings:
            assert flag in help_text, flag
        assert action.help and len(action.help) > 15, f"{action.option_strings} has no real help"
    for name in demo.RUNS:  # every run --runs accepts is explained
        assert f"'{name}'" in " ".join(help_text.split()), name

    # And the real command line prints it.
    proc = _run_cli(["--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    for action in options:
        for flag in action.option_strings:
            assert flag in proc.stdout, flag


def test_bad_options_are_rejected(capsys):
    parser = demo.build_parser()
    for bad in (["--runs", "off,nope"], ["--nproc", "0"], ["--timeout", "-1"], ["--steps", "x"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(bad)
        assert e.value.code == 2, bad
    # Values argparse accepts but the demo cannot use: refused before any rank starts.
    for bad in (["--nproc", "1"], ["--steps", "1"]):
        args = parser.parse_args(bad)
        assert args.func(args) == 2, bad
    assert "--runs" in capsys.readouterr().err


def test_the_length_schedule_makes_ranks_diverge_at_different_steps():
    world, steps = 4, 30
    firsts = []
    for rank in range(world):
        lengths = [demo.sequence_length(rank, s, world, steps, 32) for s in range(steps)]
        assert lengths[0] == 32  # the first compile is the same on every rank
        changed = [s for s in range(steps) if lengths[s] != 32]
        firsts.append(changed[0] if changed else None)
    assert firsts[0] is None  # rank 0 never leaves the common bucket
    assert firsts[1:] == sorted(set(firsts[1:])), firsts  # the others leave one after another
    assert all(f < steps // 2 + 1 for f in firsts[1:]), firsts
    assert [demo.batch_size(r, steps - 1, world, steps, 4) for r in range(world)] == [4, 4, 4, 3]


def test_stuck_at_names_the_innermost_frame_the_service_and_the_training_line():
    pkg = os.path.dirname(demo.__file__)
    svc = os.path.dirname(compiler_collectives.__file__)
    log_text = (
        "some warning\n"
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 4287 in all_gather\n'
        f'  File "{svc}/transport/gloo.py", line 187 in all_gather_bytes\n'
        f'  File "{svc}/agreements/compiler.py", line 70 in exchange\n'
        '  File "/x/torch/_dynamo/convert_frame.py", line 9 in _compile\n'
        f'  File "{pkg}/demo.py", line 306 in train\n'
        f'  File "{pkg}/demo.py", line 400 in _rank_main\n'
        "\n"
    )
    assert demo.stuck_at(log_text) == (
        "all_gather (distributed_c10d.py:4287) <- all_gather_bytes (gloo.py:187) <- train (demo.py:306)"
    )
    in_backward = (
        "Stack (most recent call first):\n"
        '  File "/x/torch/autograd/graph.py", line 979 in _engine_run_backward\n'
        f'  File "{pkg}/demo.py", line 307 in train\n'
        f'  File "{pkg}/demo.py", line 408 in _rank_main\n'
    )
    assert demo.stuck_at(in_backward) == "_engine_run_backward (graph.py:979) <- train (demo.py:307)"
    assert demo.stuck_at("no stack here") is None
