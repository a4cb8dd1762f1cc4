"""A process that used the package exits with its own exit code, never SIGABRT.

Our heartbeat thread calls the c10d store from a daemon thread. If it is
inside a store call when the interpreter finalizes, CPython ends it as it
takes the GIL back, inside a pybind11 frame that cannot unwind, and the
process dies of SIGABRT ("terminate called without an active exception")
after the user's script finished. A heartbeat every 0.1 ms keeps the thread
inside store calls nearly all the time, which made that abort happen in about
half of the runs before the thread was stopped and joined at exit. Each rank also checks, from
an exit handler that runs after the package's own, that no thread or group of ours is left when
Python finalizes (``tests.rankside.LEFT_RUNNING``): an exit path that leaves the thread running fails every run
that way, not only the runs where the race aborts.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.fixtures import REPO, as_torchrun_starts_them, clean_env

# Every test here starts rank processes or subprocesses: the multi-process tier. Release-independent:
# the exit check is ours and fails every run that leaves our thread running; a process ending with
# our groups on each release is test_exit.py's.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

# No destroy_process_group(): many scripts end without it, and then our exit handler, not
# destroy's, must stop the heartbeat thread (destroy stops it on its own).
SCRIPT = """
import atexit
from tests.rankside import nothing_of_ours_left_when_python_finalizes  # before the package's handler

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
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = clean_env(
        COMPILER_COLLECTIVES_HEARTBEAT_S="0.0001",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),  # the exit check
    )
    for run in range(RUNS):
        ranks = as_torchrun_starts_them([sys.executable, str(script)], env, 100)
        for rank, (code, err) in enumerate(ranks):
            assert code == 0, f"run {run}, rank {rank}: exit code {code}\n{err[-3000:]}"
            assert "terminate called" not in err, f"run {run}, rank {rank}:\n{err[-3000:]}"
