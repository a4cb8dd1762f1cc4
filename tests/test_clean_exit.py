"""A process that used the package exits with its own exit code, never SIGABRT.

Our heartbeat thread calls the c10d store from a daemon thread. If it is
inside a store call when the interpreter finalizes, CPython ends it as it
takes the GIL back, inside a pybind11 frame that cannot unwind, and the
process dies of SIGABRT ("terminate called without an active exception")
after the user's script finished. A heartbeat every 0.1 ms keeps the thread
inside store calls nearly all the time, which made that abort happen in about
half of the runs before the thread was stopped and joined at exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.fixtures import clean_env
from tests.harness import free_port

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = pytest.mark.multiprocess

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
import compiler_collectives as cc
cc.enable(guards=True)
f = torch.compile(lambda x: x * 2, backend="eager")
for _ in range(3):
    f(torch.ones(3))
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_a_torchrun_job_with_a_busy_heartbeat_exits_zero_on_every_rank_every_time(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = clean_env(COMPILER_COLLECTIVES_HEARTBEAT_S="0.0001", OMP_NUM_THREADS="1")
    for attempt in range(5):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(free_port()),
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 0, f"run {attempt}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        assert "terminate called" not in proc.stderr
