"""One benchmark of ``scripts/dev``, run alternately on this tree and on an earlier commit, in one run.

A redesign that must leave a cost unchanged is judged side by side: the same
benchmark, this working tree and ``--base`` (a commit, checked out once into a
temporary git worktree), alternating round by round so that both meet the
same load. ``--busy N`` runs N busy-looping processes beside every run (the
"beside two busy processes" condition); ``--quiet-and-busy`` runs each round
twice, without and with them.

Each run's own output is kept whole under ``--out`` (one file per run); the
summary picks the rows a benchmark prints as ``| world | ours added | ...``
(bench-guard's second table) and gives each tree's median over the rounds.

Run:  scripts/dev python scripts/bench_ab.py --base 2664c27 --rounds 3 --quiet-and-busy -- bench-guard --worlds 2 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
# scripts/dev's benchmark names and the script each runs (the same table as scripts/dev's).
SCRIPTS = {
    "bench-guard": "scripts/bench_guard.py",
    "bench-compile-once": "scripts/bench_compile_once.py",
    "bench-compile": "scripts/bench_compile.py",
    "bench-hook": "scripts/bench_hook.py",
    "bench-entry": "scripts/bench_entry.py",
}
# bench-guard's second table: | ranks | ours added | over the slowest rank | ...
ADDED_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*([-\d.]+) µs\s*\|")


@contextlib.contextmanager
def base_tree(ref: str) -> Iterator[pathlib.Path]:
    """``ref`` checked out into a temporary worktree of this repository, removed afterwards."""
    where = pathlib.Path(tempfile.mkdtemp(prefix="bench-ab-")) / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), ref], check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False)


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each while the body runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def run_once(tree: pathlib.Path, script: str, args: list[str], out: pathlib.Path) -> tuple[float, str]:
    """The benchmark's script of ``tree``, with ``tree``'s package first on the path; (seconds, output)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(tree / script), *args],
        cwd=tree,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    out.write_text(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"bench_ab: {script} in {tree} exited {done.returncode}; its output: {out}")
    return time.monotonic() - started, done.stdout


def added_rows(output: str) -> dict[int, float]:
    """World size -> 'ours added' (µs) from bench-guard's second table."""
    rows = {}
    for line in output.splitlines():
        m = ADDED_ROW.match(line)
        if m:
            rows[int(m.group(1))] = float(m.group(2))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs base then this tree")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside every run")
    parser.add_argument("--quiet-and-busy", action="store_true", help="each round quiet, then beside two busy ones")
    parser.add_argument("--out", default=None, help="directory for each run's output (default: a temp dir)")
    parser.add_argument("bench", choices=sorted(SCRIPTS), help="the scripts/dev benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (after --)")
    ns = parser.parse_args()
    args = [a for a in ns.args if a != "--"]
    out_dir = pathlib.Path(ns.out or tempfile.mkdtemp(prefix="bench-ab-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    conditions = [("quiet", 0), ("busy2", 2)] if ns.quiet_and_busy else [(f"busy{ns.busy}", ns.busy)]
    load = os.getloadavg()
    print(f"bench_ab: {ns.bench} {' '.join(args)}; base {ns.base} vs this tree; {ns.rounds} rounds; load {load}")
    figures: dict[tuple[str, str, int], list[float]] = {}
    with base_tree(ns.base) as base:
        trees = {"base": base, "this": ROOT}
        for rnd in range(ns.rounds):
            for condition, spinners in conditions:
                # Base first in even rounds, this tree first in odd ones: neither always runs second.
                for order_name in ("base", "this") if rnd % 2 == 0 else ("this", "base"):
                    out = out_dir / f"{condition}-{order_name}-{rnd}.txt"
                    with busy(spinners):
                        seconds, text = run_once(trees[order_name], SCRIPTS[ns.bench], args, out)
                    rows = added_rows(text)
                    print(f"round {rnd} {condition} {order_name}: {seconds:.0f} s {rows}", flush=True)
                    for world, value in rows.items():
                        figures.setdefault((condition, order_name, world), []).append(value)
    if figures:
        print("\n| condition | ranks | base: ours added (median) | this: ours added (median) | this / base |")
        print("|---|---|---|---|---|")
        for condition, _ in conditions:
            for world in sorted({w for (c, _, w) in figures if c == condition}):
                b = statistics.median(figures.get((condition, "base", world), [float("nan")]))
                t = statistics.median(figures.get((condition, "this", world), [float("nan")]))
                print(f"| {condition} | {world} | {b:.1f} µs | {t:.1f} µs | {t / b:.2f}x |")
    print(f"\neach run's output: {out_dir}; load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
