"""Two tiers: the unit tier starts no process and runs in seconds; the multi-process tier is the rest.

* ``scripts/dev test`` runs both (CI does); ``scripts/dev test --fast`` runs
  the unit tier only.
* A test that starts a process (our rank harness, a subprocess, a
  multiprocessing pool) carries ``@pytest.mark.multiprocess``. An unmarked
  test that starts one fails at once, saying so: the tiers cannot drift.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        default=False,
        help="run the unit tier only: the tests that start no process (seconds)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "multiprocess: the test starts processes (ranks, a subprocess): the multi-process tier"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast"):
        return
    keep = [item for item in items if item.get_closest_marker("multiprocess") is None]
    dropped = [item for item in items if item.get_closest_marker("multiprocess") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


@pytest.fixture(autouse=True)
def _processes_only_in_the_multiprocess_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if request.node.get_closest_marker("multiprocess") is not None:
        yield
        return
    nodeid = request.node.nodeid

    def refuse(what: str):
        def guarded(self, *args, **kwargs):
            raise AssertionError(
                f"{nodeid} starts a process ({what}) but is not marked @pytest.mark.multiprocess: "
                "mark it, so that `scripts/dev test --fast` stays a tier that starts none"
            )

        return guarded

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing"))
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("subprocess"))
    yield
