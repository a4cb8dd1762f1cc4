"""cc_launch: every process a job starts ends with the job, and what ended it is named.

Real processes, short deadlines. The ranks here run this file's functions and
nothing of torch: they are forked ("fork" starts them in milliseconds; spawn
or a forkserver would import this file, and torch with ``tests.fixtures``, in each).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import cc_launch as launch
from tests.fixtures import gone

# Multi-process tests here: release independent (tests/tiers.py).
pytestmark = pytest.mark.release_independent


def _wait_gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def hang_on_rank_1(rank: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(120)


def rank_1_killed_by_sigkill(rank: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def rank_0_fails_rank_1_hangs(rank: int) -> None:
    if rank == 0:
        sys.exit(3)
    time.sleep(120)


def sleep_then_exit(seconds: list[float], rank: int) -> None:
    time.sleep(seconds[rank])


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_rank_still_running_at_the_deadline_is_killed_and_named(tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        launch.run_to_end(hang_on_rank_1, 2, args=(str(tmp_path),), timeout_s=2, start_method="fork")
    assert time.monotonic() - started < 30
    assert "rank 1 was still running after 2s: killed" in str(raised.value)
    assert "rank 0" not in str(raised.value)  # it exited 0
    assert gone(int((tmp_path / "rank1").read_text()))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_rank_ended_by_a_signal_is_reported_with_the_signals_name():
    with pytest.raises(RuntimeError, match=r"rank 1 was ended by signal SIGKILL \(exit code -9\)") as raised:
        launch.run_to_end(rank_1_killed_by_sigkill, 2, timeout_s=30, start_method="fork")
    assert "rank 0" not in str(raised.value)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_after_a_rank_fails_its_peers_are_killed_once_the_grace_passes_not_at_the_deadline():
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        launch.run_to_end(rank_0_fails_rank_1_hangs, 2, timeout_s=300, grace_after_failure_s=1, start_method="fork")
    assert time.monotonic() - started < 30
    assert "rank 0 exited with code 3" in str(raised.value)
    assert "rank 1 was still running 1s after a rank failed: killed" in str(raised.value)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_reap_lets_each_process_exit_within_its_own_grace_and_kills_the_rest_after_the_hook():
    # Rank 0 outlives its grace (0.5 s); rank 1 ends within its own (20 s).
    ranks = launch.start_ranks(sleep_then_exit, 2, lambda rank, _: ([60.0, 1.0], rank), start_method="fork")
    handed: list[tuple[str | None, bool]] = []
    try:
        killed = launch.reap(
            ranks.procs, [0.5, 20.0], before_kill=lambda stuck: handed.extend((p.name, p.is_alive()) for p in stuck)
        )
    finally:
        ranks.close()
    assert killed == [0]
    assert handed == [(ranks.procs[0].name, True)]  # alive when the hook ran, and alone
    assert ranks.exitcodes == [-signal.SIGKILL, 0]


# A torchrun-like agent: it starts a "rank" in a session of its own, says its pid, and waits.
AGENT = textwrap.dedent(
    """
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    print(rank.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_kill_tree_ends_an_agent_and_the_rank_it_started_in_a_session_of_its_own():
    with launch.Agents() as agents:
        agent = agents.start([sys.executable, "-c", AGENT], log=subprocess.PIPE)
        assert agent.stdout is not None
        rank_pid = int(agent.stdout.readline())
        launch.kill_tree(agent)
        assert agent.returncode == -signal.SIGTERM
        assert _wait_gone(rank_pid), f"the agent's rank {rank_pid} outlived kill_tree"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_agents_still_running_when_their_block_ends_are_killed_and_finished_ones_keep_their_status():
    with pytest.raises(KeyError), launch.Agents() as agents:
        done = agents.start([sys.executable, "-c", "raise SystemExit(4)"])
        done.wait(timeout=30)
        running = agents.start([sys.executable, "-c", "import time; time.sleep(120)"])
        raise KeyError("the block ends by an exception")
    assert done.returncode == 4
    assert running.returncode == -signal.SIGTERM


def test_exit_text_names_an_exit_code_a_signal_and_a_signal_this_platform_does_not_name():
    assert launch.exit_text(3) == "exited with code 3"
    assert launch.exit_text(-signal.SIGABRT) == "was ended by signal SIGABRT (exit code -6)"
    assert launch.signal_name(250) == "250"
    assert launch.exit_text(None) == "is still running"


@pytest.mark.multiprocess
def test_importing_the_launcher_imports_neither_torch_nor_the_package():
    code = "import json, sys, cc_launch; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    imported = {name.split(".")[0] for name in json.loads(out.stdout)}
    assert "cc_launch" in imported
    assert not imported & {"torch", "compiler_collectives"}


def test_a_free_port_lies_below_the_kernels_ephemeral_range_where_no_outgoing_connection_can_take_it():
    low = launch.ephemeral_low()
    ports = {launch.free_port() for _ in range(20)}
    assert all(15000 <= port < low for port in ports), (ports, low)
    assert len(ports) > 1  # drawn at random, not the same port each time
