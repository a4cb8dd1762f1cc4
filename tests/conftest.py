"""Two tiers, run side by side: the unit tier starts no process and runs in seconds; the multi-process tier is the rest.

* ``scripts/dev test`` runs both on several pytest-xdist workers;
  ``scripts/dev test --fast`` runs the unit tier only, and ``--tier seam`` the unit tier and
  the multi-process tests a torch release can change (``tests/tiers.py``: every
  multi-process test is ``torch_seam`` or ``release_independent``).
* A test that starts a process (our rank harness, a subprocess, a
  multiprocessing pool) carries ``@pytest.mark.multiprocess``. An unmarked
  test that starts one fails at once, saying so: the tiers cannot drift.
* Side by side, each test has its own ``TMPDIR`` (so its FileStores, job dirs
  and its children's temp files are its own; ports come from the kernel and
  /dev/shm segment names carry a pid and a random token). Inductor's default
  cache and its precompiled header stay the ones a user's machine has, shared
  by every test that does not set its own cache dir: per test, they would
  rebuild the header (4-5 CPU-s) and every kernel in every test.
* A test marked ``@pytest.mark.whole_machine`` (a time or memory bound that
  other tests' load would break) runs alone: it waits for the tests running
  on other workers to finish, and none starts beside it. Its marker says why.
  The lock is the machine's, not the run's: CI runs two releases' suites side
  by side (``.ci/run``), and a test of the other run is load all the same.
  The whole-machine tests come first and keep the machine from the first to
  the last of them; waiting for it is not a test's time (its timeout).
"""

from __future__ import annotations

import getpass
import multiprocessing.process
import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from tests import pool
from tests.harness import MachineHold

# The tiers (unit, multi-process; torch_seam or release_independent) and --tier/--fast: tests/tiers.py.
pytest_plugins = ("tests.tiers", "pytester")

# The machine's temp dir, before any test moves TMPDIR: where every worker of a
# run finds the machine lock, and where inductor keeps its default cache and its
# precompiled headers (torch's rule: <tmp>/torchinductor_<user>; the headers stay
# there whatever TORCHINDUCTOR_CACHE_DIR says).
_MACHINE_TMP = tempfile.gettempdir()
_INDUCTOR_HOME = f"torchinductor_{getpass.getuser()}"
_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(_MACHINE_TMP, _INDUCTOR_HOME)
_SHARED_HEADERS = os.path.join(_MACHINE_TMP, _INDUCTOR_HOME, "precompiled_headers")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "whole_machine(reason): the test asserts a time or memory bound that other tests' load would break: "
        "under xdist workers it runs alone",
    )
    config.addinivalue_line(
        "markers",
        "fresh_ranks(reason): in tests/ranks/, the test's ranks are processes of its own, not a pool's "
        "(tests/pool.py): its marker says why",
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    pool.close_pools()  # this worker's pools of ranks, if it started any


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        mark = item.get_closest_marker("whole_machine")
        if mark is not None and not (mark.args or mark.kwargs.get("reason")):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.whole_machine needs a reason (why it runs alone)")
        fresh = item.get_closest_marker("fresh_ranks")
        if fresh is not None and not (fresh.args or fresh.kwargs.get("reason")):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.fresh_ranks needs a reason (why not a pool's ranks)")
    # Side by side, the tests that run alone go first (each waits for the machine
    # once, before the others fill it), then the long multi-process tests; the
    # unit tests come last and fill the workers' tails.
    items.sort(
        key=lambda item: (
            item.get_closest_marker("whole_machine") is None,
            item.get_closest_marker("multiprocess") is None,
        )
    )


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


@pytest.fixture(autouse=True)
def _side_by_side(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    tmpdir = tmp_path_factory.mktemp("tmpdir")  # beside tmp_path, which stays the test's own and empty
    # Inductor's precompiled header (4-5 CPU-s to build) stays the machine's, as a
    # user's does: built once per run, not once per test. Its builds are file-locked.
    os.makedirs(_SHARED_HEADERS, exist_ok=True)
    (tmpdir / _INDUCTOR_HOME).mkdir()
    (tmpdir / _INDUCTOR_HOME / "precompiled_headers").symlink_to(_SHARED_HEADERS, target_is_directory=True)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", _INDUCTOR_CACHE)


def _alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("whole_machine") is not None


# This worker's hold on the machine, side by side (the module's docstring; tests.harness.MachineHold).
_machine = MachineHold(os.path.join(_MACHINE_TMP, f"cc-suite-machine-{getpass.getuser()}"))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's: a wait is not the test's time
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if "PYTEST_XDIST_TESTRUNUID" not in os.environ:
        yield
        return
    _machine.before(_alone(item))
    yield
    _machine.after(_alone(item), nextitem is not None and _alone(nextitem))
