"""What the parent side of many tests builds alike: the guard-transport parametrization and job environments.

Rank-side helpers live in ``tests/rankside.py``; launching ranks lives in
``tests/harness.py``.
"""

from __future__ import annotations

import os

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
