"""A pytest plugin: the CPU each test costs, its processes' included, side by side.

Where the suite's time goes on a 2-core machine is CPU, not waiting, once the
tests run on several workers: this attributes it. Each pytest-xdist worker
moves itself into a cgroup-v1 ``cpuacct`` group of its own, which every
process it starts (the forkserver, ranks, torchrun, gcc) inherits; a worker
runs one test at a time, so the group's usage before and after a test is
that test's CPU. Needs a writable ``/sys/fs/cgroup/cpuacct`` (root); without
one it records nothing and says so.

    PYTHONPATH=scripts scripts/dev test -p suite_cpu        # writes suite-cpu-<torch>-<worker>.json
    scripts/dev python scripts/suite_cpu.py [DIR] [--torch RELEASE]  # summary: by folder, file, top tests

Files are named by torch's release, so that one directory can hold a whole CI run's
(``PYTEST_ADDOPTS="-p suite_cpu" PYTHONPATH=scripts bash .ci/run``: each release's tier).

``CC_SUITE_CPU_DIR`` says where the JSON goes (default: the current directory).
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.metadata
import json
import logging
import os
import sys
import time
from typing import Any

import pytest

ROOT = "/sys/fs/cgroup/cpuacct"
log = logging.getLogger("compiler_collectives.suite_cpu")
_group: str | None = None
_rows: list[tuple[str, float, float]] = []


def _usage_s() -> float:
    assert _group is not None
    with open(os.path.join(_group, "cpuacct.usage")) as fh:
        return int(fh.read()) / 1e9


def pytest_configure(config: pytest.Config) -> None:
    global _group
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    group = os.path.join(ROOT, f"cc-suite-{worker}-{os.getpid()}")
    try:
        os.makedirs(group, exist_ok=True)
        with open(os.path.join(group, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
    except OSError as e:
        log.warning("suite_cpu: no cpuacct group (%s): nothing recorded", e)
        return
    _group = group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if _group is None:
        yield
        return
    cpu, wall = _usage_s(), time.monotonic()
    yield
    _rows.append((item.nodeid, _usage_s() - cpu, time.monotonic() - wall))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _group is None:
        return
    out = os.environ.get("CC_SUITE_CPU_DIR", ".")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    release = importlib.metadata.version("torch").split("+")[0]
    with open(os.path.join(out, f"suite-cpu-{release}-{worker}.json"), "w") as fh:
        json.dump(_rows, fh)


def summary(directory: str, top: int = 25, release: str = "*") -> str:
    """By folder, by file, then the ``top`` tests, of the runs in ``directory`` on torch ``release`` (a glob)."""
    pattern = os.path.join(directory, f"suite-cpu-{release}-*.json")
    rows = [row for path in glob.glob(pattern) for row in json.load(open(path))]
    total = sum(cpu for _, cpu, _ in rows)
    by_file: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for nodeid, cpu, _ in rows:
        by_file[nodeid.split("::")[0]] += cpu
        count[nodeid.split("::")[0]] += 1
    by_folder: collections.Counter[str] = collections.Counter()
    in_folder: collections.Counter[str] = collections.Counter()
    for nodeid, cpu, _ in rows:
        folder = os.path.dirname(nodeid.split("::")[0])
        by_folder[folder] += cpu
        in_folder[folder] += 1
    lines = [f"{len(rows)} tests, {total:.0f} CPU-s", "", "| folder | tests | CPU-s | share |", "|---|---|---|---|"]
    lines += [f"| `{f}/` | {in_folder[f]} | {c:.0f} | {100 * c / total:.0f} % |" for f, c in by_folder.most_common()]
    lines += ["", "| file | tests | CPU-s | share |", "|---|---|---|---|"]
    lines += [f"| `{f}` | {count[f]} | {c:.0f} | {100 * c / total:.0f} % |" for f, c in by_file.most_common()]
    lines += ["", "| test | CPU-s | wall-s |", "|---|---|---|"]
    for nodeid, cpu, wall in sorted(rows, key=lambda r: -r[1])[:top]:
        lines.append(f"| `{nodeid}` | {cpu:.1f} | {wall:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the suite's CPU, by file and by test (suite_cpu's JSON files)")
    parser.add_argument("directory", nargs="?", default=".")
    parser.add_argument("--torch", default="*", help="one torch release's runs (default: all in the directory)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    sys.stdout.write(summary(args.directory, args.top, args.torch) + "\n")
