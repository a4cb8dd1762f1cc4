"""Which tests run where: the unit tier, and whether a multi-process test can change with torch's release.

A pytest plugin (``conftest.py`` loads it). The suite has two tiers, and every test of the
multi-process tier says whether a torch release can change its outcome:

* ``@pytest.mark.multiprocess``: the test starts processes (ranks, a subprocess). The rest is
  the unit tier: no process, seconds, on every release.
* ``@pytest.mark.torch_seam``: a multi-process test whose outcome a torch release can change.
  Its subject is where we meet torch: the Dynamo/AOTAutograd/inductor seam (what a compile
  decides, guards, graphs and their levels, recompiles), inductor's and AOTAutograd's caches
  (compile once's artifacts, keys and loads), c10d and gloo behaviour and error text (process
  groups, destroy and re-init, timeouts of torch's own calls), torchrun, ``import torch``'s
  autoload, torch's logs and traces, and real models under DDP/FSDP/pipelining.
* ``@pytest.mark.release_independent``: a multi-process test of our own code, which drives
  torch only through what the seam tests above already pin: wire formats, shared memory,
  liveness and failure verdicts, the protocol's faults and waits, launch, config, reports,
  the demo's text. A torch release that broke one of these would break a seam test first.

Each meeting point with torch is pinned once per release, by its plainest test; the tests
that reach it the same way and vary our own side of it (another fault of the protocol,
another bad value of our settings, another of our artifacts in torch's trace, a second
launcher for the same ranks) are ``release_independent``, with a comment naming the seam
test that pins the point. CI runs the seam tier on two releases: a seam test costs twice.

A multi-process test that carries neither fails collection: the tiers cannot drift. The mark
closest to the test decides (a test's own mark over its module's ``pytestmark``).

``--tier`` chooses what runs: ``all`` (the default, what CI runs on the newest release),
``seam`` (the unit tier and the ``torch_seam`` tests: what CI runs on the other releases) or
``unit`` (``--fast``: no process at all).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

SEAM = "torch_seam"
INDEPENDENT = "release_independent"
TIERS = ("all", "seam", "unit")
UNIT_FOLDER = "tests/unit/"  # every test here starts no process (the collection check below)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tiers")
    group.addoption(
        "--tier",
        choices=TIERS,
        default="all",
        help="all: every test; seam: the unit tier and the torch_seam tests (CI on the older releases); "
        "unit: the tests that start no process (same as --fast)",
    )
    group.addoption(
        "--fast",
        action="store_true",
        default=False,
        help="run the unit tier only: the tests that start no process (seconds)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "multiprocess: the test starts processes (ranks, a subprocess): the multi-process tier"
    )
    config.addinivalue_line(
        "markers",
        f"{SEAM}: a multi-process test whose outcome a torch release can change (the Dynamo/inductor seam, "
        "caches, c10d/gloo behaviour, torchrun, autoload): runs on every release",
    )
    config.addinivalue_line(
        "markers",
        f"{INDEPENDENT}: a multi-process test of our own code only: runs on one release (the newest) in CI",
    )


def classification(item: pytest.Item) -> str | None:
    """``torch_seam`` or ``release_independent``, whichever mark is closest to the test; None if neither."""
    for mark in item.iter_markers():  # closest first: the function's, its class's, its module's
        if mark.name in (SEAM, INDEPENDENT):
            return mark.name
    return None


def unclassified(items: Iterable[pytest.Item]) -> list[str]:
    """The node ids of the multi-process tests that say neither whether torch can change them."""
    return [
        item.nodeid
        for item in items
        if item.get_closest_marker("multiprocess") is not None and classification(item) is None
    ]


def selected(item: pytest.Item, tier: str) -> bool:
    if item.get_closest_marker("multiprocess") is None:
        return True
    return tier == "all" or (tier == "seam" and classification(item) == SEAM)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = unclassified(items)
    if missing:
        shown = "\n  ".join(missing[:20]) + (f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise pytest.UsageError(
            f"{len(missing)} multi-process test(s) say neither @pytest.mark.{SEAM} (a torch release can change "
            f"the outcome: it goes through Dynamo/inductor, caches, c10d/gloo behaviour, torchrun or autoload) "
            f"nor @pytest.mark.{INDEPENDENT} (our code only). Mark each (tests/tiers.py says which is which):\n  "
            + shown
        )
    processes_in_unit = [
        item.nodeid
        for item in items
        if item.nodeid.startswith(UNIT_FOLDER) and item.get_closest_marker("multiprocess") is not None
    ]
    if processes_in_unit:
        raise pytest.UsageError(
            f"{len(processes_in_unit)} test(s) in {UNIT_FOLDER} start processes (@pytest.mark.multiprocess): "
            "that folder holds the tests that start none. Move each to tests/ranks/, tests/faults/ or "
            "tests/contract/:\n  " + "\n  ".join(processes_in_unit[:20])
        )
    tier = "unit" if config.getoption("--fast") else config.getoption("--tier")
    if tier == "all":
        return
    keep = [item for item in items if selected(item, tier)]
    dropped = [item for item in items if not selected(item, tier)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
