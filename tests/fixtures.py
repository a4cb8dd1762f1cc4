"""What the parent side of many tests builds alike: the guard-transport parametrization, job
environments, inductor cache dirs, whether a process is gone, two torchrun agents as two hosts,
and a job several tests read run once per test run (``once_per_run``).

Rank-side helpers live in ``tests/rankside.py``; launching ranks lives in
``tests/harness.py``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

# Reads the settings table without importing the package: safe in the forkserver, which preloads us.
from tests.rank_env import rank_env

# Every guard-path behaviour runs on both mechanisms: the shared-memory channel
# ("auto" picks it on one host) and gloo. Each test takes ``transport``.
GUARD_TRANSPORTS = pytest.mark.parametrize("transport", ["shm", "gloo"])


class NoCache:
    """Compile once's ``Cache`` for unit tests that never reach it: a graph that needs no exchange
    touches no cache."""

    def root(self) -> str:
        raise AssertionError("not reached")

    def aot_dir(self, key: str) -> str:
        raise AssertionError("not reached")

    def fx_dir(self, key: str) -> str:
        raise AssertionError("not reached")

    def compiler(self) -> str:
        raise AssertionError("not reached")


# A test that asserts how fast a failure is named (a bound of a few seconds) runs
# alone: on a loaded machine the rank that detects or relays it is itself
# scheduled late, and the bound measures the machine instead of us.
NAMED_WITHIN_SECONDS = pytest.mark.whole_machine(
    "asserts that a failure is named within seconds: beside other tests the detecting rank is scheduled late"
)


def gone(pid: int) -> bool:
    """No process ``pid``, or only a zombie waiting for whoever adopted it (its parent was reaped first)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


def guard_env(transport: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` plus the setting that selects ``transport`` for the guard collective."""
    return {**(base or {}), **rank_env(guard_transport="auto" if transport == "shm" else "gloo")}


def clean_env(*, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a fresh interpreter (torchrun, a subprocess), without any of
    our settings (``COMPILER_COLLECTIVES_*``, or the names or prefixes in ``drop``), plus ``extra``."""
    prefixes = ("COMPILER_COLLECTIVES_", *drop)
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra)
    return env


def as_torchrun_starts_them(cmd: list[str], env: dict[str, str], timeout: float) -> list[tuple[int, str]]:
    """Two ranks of one host in fresh interpreters running ``cmd``, with ``env`` and the variables
    torchrun's agent gives its ranks, but no agent: a third interpreter that adds to the cost and
    nothing where the launcher is not the subject. Each rank's exit code and output (stdout and
    stderr); a rank still running after ``timeout`` is killed."""
    import subprocess

    from cc_launch import Agents
    from tests.harness import free_port

    launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    launcher.update(LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    with Agents() as started:  # a rank still running at the end is killed
        procs = [
            started.start(cmd, log=subprocess.PIPE, env={**env, **launcher, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(2)
        ]
        outputs = [proc.communicate(timeout=timeout)[0].decode(errors="replace") for proc in procs]
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"


def shared_cache(root: Path, name: str = "shared") -> dict[str, str]:
    """The environment of ranks that share one inductor cache dir, ``root / name`` (one host)."""
    return {CACHE_DIR: str(root / name)}


def cache_per_rank(root: Path, world: int, *, per_dir: int = 1, name: str = "rank") -> dict[int, dict[str, str]]:
    """Per-rank environments (``run_ranks``'s ``rank_env``) giving each block of ``per_dir``
    consecutive ranks its own inductor cache dir, ``root / f"{name}{rank // per_dir}"``: a dir
    per rank, or one per host of ``per_dir`` ranks."""
    return {r: {CACHE_DIR: str(root / f"{name}{r // per_dir}")} for r in range(world)}


REPO = str(Path(__file__).resolve().parents[1])
_FAILED_RANK = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\s+exitcode\s*: (-?\d+)")


@dataclasses.dataclass
class AgentsOutcome:
    returncodes: list[int]  # per agent
    outputs: list[str]  # per agent: its output, its ranks' included
    exitcodes: dict[int, int]  # rank -> exit code, for each rank an agent reported failed (negative: a signal)


def run_agents(
    tmp_path: Path,
    script: str,
    *,
    rdzv: str,
    env: dict[str, str],
    args: Sequence[str] = (),
    timeout: float = 200.0,
    expect_signals: dict[int, int] | None = None,
) -> AgentsOutcome:
    """Two torchrun agents on this machine as two hosts (``--nnodes 2 --nproc-per-node 1``), each
    with its own inductor cache dir (``tmp_path / f"agent{node}"``), running ``script`` (a file's
    text) with ``args``, configured by ``env`` alone on top of a clean environment, as a user would.

    ``rdzv``: "c10d" (an endpoint, which agent 0 hosts, as node 0 would: were it the agent of a
    rank that fails, its exit would break the other agent's rendezvous, and that agent would
    SIGTERM its rank) or "static" (``--master-addr``, ``--node-rank``). Either way no agent
    restarts its worker (``--max-restarts 0``, torchrun's default): the first to fail ends its
    agent, and the other agent leaves its rank running (with a restart, it would stop that rank
    within a second to re-rendezvous). Every agent and rank is reaped; past ``timeout`` they are
    killed and this raises, and so does a rank ended by a signal (as torchrun's failure summary
    reports it) that ``expect_signals`` does not name for it."""
    import subprocess
    import sys
    import time

    from cc_launch import Agents
    from tests.harness import free_port

    path = tmp_path / "agents_job.py"
    path.write_text(script)
    port = str(free_port())
    base = clean_env(drop=("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"))
    base.update(env, PYTHONPATH=os.pathsep.join(p for p in (REPO, base.get("PYTHONPATH")) if p))
    logs = [tmp_path / f"agent{node}.log" for node in range(2)]
    deadline = time.monotonic() + timeout
    with Agents() as agents:  # what is still running at the end is killed, ranks included
        for node, log in enumerate(logs):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            if rdzv == "c10d":
                host = "is_host=1" if node == 0 else "is_host=0"
                cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hosts"]
                cmd += ["--rdzv-conf", host]
            else:
                cmd += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port]
            with open(log, "wb") as fh:
                agent_env = dict(base, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"agent{node}"))
                agents.start([*cmd, "--max-restarts", "0", str(path), *args], env=agent_env, log=fh, cwd=REPO)
        for proc in agents.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        late = [node for node, proc in enumerate(agents.procs) if proc.poll() is None]
    outputs = [log.read_text(errors="replace") for log in logs]
    tails = "\n".join(f"--- agent {node}:\n{out[-4000:]}" for node, out in enumerate(outputs))
    assert not late, f"agents {late} still running after {timeout:.0f}s: killed\n{tails}"
    exitcodes = {int(r): int(code) for out in outputs for r, code in _FAILED_RANK.findall(out)}
    expected = {rank: -abs(sig) for rank, sig in (expect_signals or {}).items()}
    by_signal = {rank: code for rank, code in exitcodes.items() if code < 0}
    assert by_signal == expected, f"ranks ended by a signal: {by_signal}, expected {expected}\n{tails}"
    return AgentsOutcome([proc.returncode for proc in agents.procs], outputs, exitcodes)


class KeyStore:
    """Enough of a c10d store for a setup or scope check on one rank, run without processes: its
    keys in a dict, the other ranks' already set (a str value stored as bytes, as a store does)."""

    def __init__(self, keys: dict) -> None:
        self.keys = dict(keys)

    def set(self, key: str, value) -> None:
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def check(self, keys: list) -> bool:
        return all(k in self.keys for k in keys)

    def wait(self, keys: list, timeout) -> None:
        if not self.check(keys):
            raise RuntimeError(f"timed out waiting for {keys}")

    def add(self, key: str, n: int) -> int:
        self.keys[key] = str(int(self.keys.get(key, b"0")) + n).encode()
        return int(self.keys[key])


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, job: Callable[[Path], Any]) -> Any:
    """``job(dir)``'s result, the job run once per test run: for a module-scoped fixture whose
    job (ranks run once) several tests read.

    Side by side, a module's tests may land on several pytest-xdist workers, and each worker
    would run the module's fixture again. Here the first worker to ask runs the job in a dir
    of the run's (shared by its workers) and writes its result as JSON; the others wait for
    it on a lock and read it. So the result is what JSON holds (tuples come back as lists),
    and files the job left in ``dir`` are read, never changed, by the tests. A job that
    failed fails each test that asks, with the first one's traceback.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's own temp dir, whose children are its workers'
    saved = base / f"once-{name}.json"
    with open(base / f"once-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not saved.exists():
            where = base / f"once-{name}"
            where.mkdir()
            try:
                record = {"value": job(where)}
            except BaseException:  # pytest's failures included: the waiting tests fail alike
                saved.write_text(json.dumps({"error": traceback.format_exc()}))
                raise
            saved.write_text(json.dumps(record))
        record = json.loads(saved.read_text())
    if "error" in record:
        pytest.fail(f"{name}, the job these tests share, failed (on another worker):\n{record['error']}")
    return record["value"]
