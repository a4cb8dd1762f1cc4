"""What the parent side of many tests builds alike: the guard-transport parametrization, job
environments, inductor cache dirs, and whether a process is gone.

Rank-side helpers live in ``tests/rankside.py``; launching ranks lives in
``tests/harness.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Every guard-path behaviour runs on both mechanisms: the shared-memory channel
# ("auto" picks it on one host) and gloo. Each test takes ``transport``.
GUARD_TRANSPORTS = pytest.mark.parametrize("transport", ["shm", "gloo"])


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
    return {**(base or {}), "COMPILER_COLLECTIVES_GUARD_TRANSPORT": "auto" if transport == "shm" else "gloo"}


def clean_env(*, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a fresh interpreter (torchrun, a subprocess), without any of
    our settings (``COMPILER_COLLECTIVES_*``, or the names or prefixes in ``drop``), plus ``extra``."""
    prefixes = ("COMPILER_COLLECTIVES_", *drop)
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra)
    return env


CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"


def shared_cache(root: Path, name: str = "shared") -> dict[str, str]:
    """The environment of ranks that share one inductor cache dir, ``root / name`` (one host)."""
    return {CACHE_DIR: str(root / name)}


def cache_per_rank(root: Path, world: int, *, per_dir: int = 1, name: str = "rank") -> dict[int, dict[str, str]]:
    """Per-rank environments (``run_ranks``'s ``rank_env``) giving each block of ``per_dir``
    consecutive ranks its own inductor cache dir, ``root / f"{name}{rank // per_dir}"``: a dir
    per rank, or one per host of ``per_dir`` ranks."""
    return {r: {CACHE_DIR: str(root / f"{name}{r // per_dir}")} for r in range(world)}
