"""What our autoload costs `import torch`: fresh interpreters, interleaved, medians.

Configurations, each `python -c "import torch"` in a fresh interpreter:
  autoload off   TORCH_DEVICE_BACKEND_AUTOLOAD=0: torch calls no entry point
                 at all (as if no extension, ours included, were installed)
  inactive       our entry point present, none of our variables set (the
                 default for every user of a machine with the package)
  active         TORCH_COMPILER_COLLECTIVES=1: the package loads and installs
                 itself, which imports torch._dynamo

"inactive - autoload off" is an upper bound on what merely having the package
installed costs: it also contains torch's own scan of the entry points, which
it does whether or not we are installed. The split line times the two parts
separately.

Run:  scripts/dev bench-import [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "autoload off": {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    "inactive": {},
    "active": {"TORCH_COMPILER_COLLECTIVES": "1"},
}
OURS = (
    "TORCH_COMPILER_COLLECTIVES",
    "COMPILER_COLLECTIVES_GUARDS",
    "COMPILER_COLLECTIVES_TIMING",
    "COMPILER_COLLECTIVES_TRACE_DIR",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
)


def _time_import(extra: dict[str, str]) -> float:
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    env.update(extra)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import torch"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def _split_costs_ms() -> tuple[float, float]:
    """In a fresh interpreter: torch's entry-point scan, then our module's import + load()."""
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    code = (
        "import time\n"
        "t = time.perf_counter()\n"
        "from importlib.metadata import entry_points\n"
        "entry_points(group='torch.backends')\n"
        "scan = time.perf_counter() - t\n"
        "t = time.perf_counter()\n"
        "import compiler_collectives_autoload as a\n"
        "a.load()\n"
        "print(scan * 1e3, (time.perf_counter() - t) * 1e3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    scan, ours = out.stdout.split()
    return float(scan), float(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh interpreters per configuration")
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
    _time_import({})  # warm the file cache
    for _ in range(args.runs):
        for name, extra in CONFIGS.items():  # interleaved: drift hits every configuration alike
            samples[name].append(_time_import(extra))
    med = {name: statistics.median(v) for name, v in samples.items()}
    print(f"bench_import: {args.runs} fresh interpreters per configuration, interleaved\n")
    print("| configuration | median `import torch` (s) | vs autoload off |")
    print("|---|---|---|")
    for name in CONFIGS:
        print(f"| {name} | {med[name]:.3f} | {med[name] - med['autoload off']:+.3f} s |")
    splits = [_split_costs_ms() for _ in range(args.runs)]
    scan = statistics.median(x for x, _ in splits)
    ours = statistics.median(y for _, y in splits)
    print(
        f"\nsplit, in fresh interpreters (median of {args.runs}): torch's entry-point scan "
        f"{scan:.1f} ms; importing our autoload module and its inactive load() {ours:.2f} ms"
    )


if __name__ == "__main__":
    main()
