"""`scripts/dev demo` (scripts/demo*.py): its default story end to end in a subprocess, and its report.

Its plan, --help and report without a rank (options, schedule, where a stuck rank was, the tables):
``tests/unit/test_demo_plan_and_report.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.fixtures import gone

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
# scripts/demo*.py: the demo is not part of the library.
import demo_launch  # noqa: E402  (starting the ranks, what they came to)
import demo_training  # noqa: E402  (the training a user copies)

# Multi-process tests here: release independent (tests/tiers.py).
pytestmark = pytest.mark.release_independent


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


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.whole_machine(
    "the hazard's 6 s timeout must outlast the skew between two ranks compiling the same step, "
    "and the cost report reads a CPU core per rank: beside other tests the skew passed 6 s"
)
def test_the_default_demo_tells_the_story_hazard_stuck_cure_agrees_cost_shown(tmp_path):
    # The default runs (the hazard, then the cure), with fewer steps: rank 1
    # recompiles alone in step 3 instead of 8. The hazard waits out our timeout:
    # 6 s instead of the demo's 10 s, still several seconds past the skew between
    # two ranks compiling the same step on a loaded machine.
    out_json = tmp_path / "demo.json"
    proc = _run_cli(["--steps", "8", "--hazard-timeout", "6", "--json", str(out_json)], timeout=280)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output  # the hazard is expected to get stuck
    results = {r["run"]: r for r in json.loads(out_json.read_text())}
    assert list(results) == ["compiler-only", "on"], output
    hazard, on = results["compiler-only"], results["on"]
    lonely = demo_training.divergence_step(1, 2, 8) + 1

    # 1. The hazard is reported as stuck, as expected, and labelled so before it runs.
    assert "EXPECTED TO GET STUCK" in proc.stdout, output
    assert f"STUCK, as expected, in step {lonely}/8" in proc.stdout, output
    assert "'compiler-only' got stuck, as expected" in proc.stdout, output
    assert not hazard["finished"] and hazard["stuck"] and hazard["expected_stuck"], hazard
    # Our timeout named the hang on the rank that recompiled alone ...
    errors = {r["rank"]: demo_launch.exception_text(r["error"]) for r in hazard["ranks"] if r["error"]}
    assert errors.get(1, "").startswith(demo_launch.HANG_ERRORS), errors
    assert "Our timeout turned the hang into an error on rank 1" in proc.stdout, output
    assert hazard["elapsed_s"] < demo_training.DemoConfig().timeout, hazard["elapsed_s"]
    # ... and the report says where each rank was: rank 1 in our compiler
    # collective, rank 0 in DDP's all-reduce in backward, both from the training loop.
    where = {r["rank"]: r["stuck_at"] or "" for r in hazard["ranks"]}
    assert "backward" in where[0] and "train (demo_training.py" in where[0], where
    assert "compiler.py" in where[1] and "train (demo_training.py" in where[1], where
    assert re.search(r"rank 1: in our compiler collective: .*train \(demo_training\.py:\d+\)", proc.stdout), output
    assert hazard["log_dir"] is None  # nothing to look into: it went as expected

    # 2. The cure finishes, every rank making the same decisions; rank 0
    # recompiled because rank 1's guards missed.
    assert "[on] step   8/8" in proc.stdout, output
    assert on["finished"] and on["agree"] is True, on
    assert "with the same compile decisions on every rank" in proc.stdout, output
    on0, on1 = (r["result"] for r in on["ranks"])
    assert on0["graph_dims"] == on1["graph_dims"] and on0["graphs"] > 1
    assert on0["forced_recompiles"] >= 1 and on1["forced_recompiles"] == 0
    assert lonely - 1 in on0["forced_steps"], on0["forced_steps"]

    # 3. The cost: one line per rank beside its total, with plausible figures.
    assert "THE COST: what the service added in run 'on', per rank" in proc.stdout, output
    rows = re.findall(
        r"^\s+(\d)\s+([\d.]+)s\s+(\d+) x (\d+) µs, (\d+) ms\s+(\d+) \(.*\), ([\d.]+)s\s+(\d+)",
        proc.stdout,
        re.MULTILINE,
    )
    assert [int(r[0]) for r in rows] == [0, 1], output
    for row, result in zip(rows, (on0, on1)):
        total, guards, per_call_us, exchanges, forced = (
            float(row[1]),
            int(row[2]),
            int(row[3]),
            int(row[5]),
            int(row[7]),
        )
        assert 0 < total <= on["elapsed_s"]
        assert guards == result["guard_collectives"] > 0
        assert 0 < result["guard_per_call_s"] < 1.0 and per_call_us == round(result["guard_per_call_s"] * 1e6)
        assert exchanges == result["exchanges"] >= result["compiler_collectives"] >= 1
        assert forced == result["forced_recompiles"]
    assert 0 < on0["forced_extra_cpu_s"] < on0["cpu_s"], on0
    assert "each of the 2 ranks has a CPU core of its own" in proc.stdout or "oversubscription" in proc.stdout

    # 4. Not in the default run: one line says how to see it.
    assert "scripts/dev demo --compile-once" in proc.stdout, output
    for run in (hazard, on):
        for rank in run["ranks"]:
            assert gone(rank["pid"]), f"rank process {rank['pid']} of run {run['run']} was not reaped"
