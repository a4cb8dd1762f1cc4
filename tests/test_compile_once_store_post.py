"""A compiling rank whose post fails on a dead store (issue 37, item 4): our ``StoreFailureError``,
naming the store and the graph, published through the failure procedure, never torch's raw error.

The job of test_compile_once_host_faults' store-failure tests: two ranks, each its own "host"
(``GROUP_RANK``) with a cache dir each, on a TCPStore hosted by a process of its own, which rank 1
kills as its compile for rank 0 starts. Rank 1 compiles on, then posts that its compile ended:
that post meets the dead store. (Rank 0, waiting for that post on its own connection to the same
store, raises its own store failure at once: the dead store is the one thing it could have heard
rank 1's failure through, so that is what reaches it.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures import cache_per_rank
from tests.harness import run_ranks
from tests.test_compile_once import ENV
from tests.test_compile_once_caches import COMPILING_RANK, WAITING_RANK
from tests.test_compile_once_host_faults import STORE_HOST, STORE_TIMEOUT_S, job_whose_store_fails

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]


@pytest.mark.timeout(200)
def test_a_compiling_rank_whose_post_meets_a_dead_store_raises_a_store_failure_naming_the_store_and_the_graph(
    tmp_path,
):
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        hosts = {r: {**dirs, "GROUP_RANK": str(r)} for r, dirs in cache_per_rank(tmp_path, 2, name="host").items()}
        outcome = run_ranks(
            job_whose_store_fails,
            2,
            args=({"port": port, "pid": host.pid, "fault": "killed"},),
            env={**ENV, "COMPILER_COLLECTIVES_TIMEOUT": str(STORE_TIMEOUT_S)},
            rank_env=hosts,
            init=False,
            timeout=150,
            check=False,
        )
    finally:
        host.kill()
        host.wait(10)
    compiling, waiting = outcome.results[COMPILING_RANK], outcome.results[WAITING_RANK]
    assert compiling is not None, outcome  # our error, caught by the job: not torch's, which escapes it
    assert compiling["type"] == "StoreFailureError", compiling
    message = compiling["message"]
    assert message.startswith("compile once #1 of ") and f"on rank {COMPILING_RANK}:" in message, message
    assert "could not tell the ranks waiting for it that its compile of this graph ended" in message, message
    assert f"the c10d store at 127.0.0.1:{port} failed" in message and "MASTER_ADDR" in message, message
    # Published through the failure procedure: its store report meets the same dead store.
    assert any("could not report its failure on the c10d store" in line for line in compiling["logs"]), compiling
    assert waiting is not None and waiting["type"] == "StoreFailureError", waiting
