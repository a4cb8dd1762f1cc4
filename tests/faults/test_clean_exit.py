"""A process that used the package exits with its own exit code, never SIGABRT.

Our heartbeat thread calls the c10d store from a daemon thread. If it is
inside a store call when the interpreter finalizes, CPython ends it as it
takes the GIL back, inside a pybind11 frame that cannot unwind, and the
process dies of SIGABRT ("terminate called without an active exception")
after the user's script finished. A heartbeat every 0.1 ms keeps the thread
inside store calls nearly all the time, which made that abort happen in about
half of the runs before the thread was stopped and joined at exit. Each rank also checks, from
an exit handler that runs after the package's own, that no thread or group of ours is left when
Python finalizes (``LEFT_RUNNING``): an exit path that leaves the thread running fails every run
that way, not only the runs where the race aborts.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.fixtures import clean_env
from tests.harness import free_port

# Every test here starts rank processes or subprocesses: the multi-process tier. Release-independent:
# the exit check is ours and fails every run that leaves our thread running; a process ending with
# our groups on each release is test_exit.py's.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

# No destroy_process_group(): many scripts end without it, and then our exit handler, not
# destroy's, must stop the heartbeat thread (destroy stops it on its own).
LEFT_RUNNING = 17  # exit code of a rank that still had our thread or groups when Python finalized
SCRIPT = f"""
import atexit, os, sys, threading

def nothing_of_ours_left_when_python_finalizes():
    # Registered before the package registers its own exit handler (at its first group), so it
    # runs after it (last in, first out): what it sees is what finalization would meet.
    from compiler_collectives.transport import groups
    threads = [t.name for t in threading.enumerate() if t.name.startswith("compiler_collectives") and t.is_alive()]
    if threads or groups.existing():
        print("left running at exit:", threads, sorted(groups.existing()), file=sys.stderr, flush=True)
        os._exit({LEFT_RUNNING})

atexit.register(nothing_of_ours_left_when_python_finalizes)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
import compiler_collectives as cc
cc.enable(guards=True)
f = torch.compile(lambda x: x * 2, backend="eager")
for _ in range(3):
    f(torch.ones(3))
"""

# With the thread left running at exit, a job aborted in about half of its runs, and fails the
# exit check above in every run: two runs (four exits) see that exit path fail twice over, and
# the race itself three times in four. Each run is two interpreters (~9 CPU-s each).
RUNS = 2


@pytest.mark.timeout(240)
def test_a_job_with_a_busy_heartbeat_that_skips_destroy_exits_zero_on_every_rank_every_time(tmp_path):
    from cc_launch import Agents

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    for run in range(RUNS):
        # The ranks as torchrun starts them, from env vars, without its agent (a third
        # interpreter that adds a quarter to the cost and nothing to what is tested).
        port = str(free_port())
        with Agents() as started:  # a rank still running at the end is killed
            ranks = [
                started.start(
                    [sys.executable, str(script)],
                    log=subprocess.PIPE,
                    env=clean_env(
                        COMPILER_COLLECTIVES_HEARTBEAT_S="0.0001",
                        OMP_NUM_THREADS="1",
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port,
                        WORLD_SIZE="2",
                        RANK=str(rank),
                        LOCAL_RANK=str(rank),
                    ),
                )
                for rank in range(2)
            ]
            outputs = [rank.communicate(timeout=100)[0].decode(errors="replace") for rank in ranks]
        for rank, (proc, err) in enumerate(zip(ranks, outputs)):
            assert proc.returncode == 0, f"run {run}, rank {rank}: exit code {proc.returncode}\n{err[-3000:]}"
            assert "terminate called" not in err, f"run {run}, rank {rank}:\n{err[-3000:]}"
