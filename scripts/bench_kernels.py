"""What a test graph's C++ kernels cost an inductor compile: fresh interpreters, interleaved, medians.

Each run is a fresh interpreter with a fresh inductor cache dir (as a compile-once test's rank
has), one thread (``TORCHINDUCTOR_COMPILE_THREADS=1``), that compiles a forward and backward
twice, and reports the CPU of each compile (its own and its children's: gcc included):

  kernels   ``relu(x @ w).sum()`` then ``tanh(x @ w).sum()``: C++ kernels (the activation,
            the sum, their backward), what most compile-once tests compile
  matmuls   ``x @ w`` then ``(x @ w) @ w``, backward against a gradient of ones: extern
            matmuls only, no C++ kernel

The machine's precompiled header is built by an untimed first run (it stays under the
machine's temp dir whatever the cache dir, as in the test suite).

Run:  scripts/dev python scripts/bench_kernels.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys
import torch

def cpu():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

graphs = {
    "kernels": (lambda x, w: torch.relu(x @ w).sum(), lambda x, w: torch.tanh(x @ w).sum()),
    "matmuls": (lambda x, w: x @ w, lambda x, w: (x @ w) @ w),
}[sys.argv[1]]
x, w = torch.ones(8, 4), torch.ones(4, 4, requires_grad=True)
torch.compile(torch.sin, backend="eager")(x)  # Dynamo's own first-use cost, outside the timing
took = []
for fn in graphs:
    before = cpu()
    out = torch.compile(fn, backend="inductor")(x, w)
    out.backward(None if out.dim() == 0 else torch.ones_like(out))
    took.append(cpu() - before)
print(json.dumps(took))
"""


def run(kind: str) -> list[float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="bench-kernels-"))
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", CHILD, kind], env=env, capture_output=True, text=True, check=True)
    took: list[float] = json.loads(out.stdout.strip().splitlines()[-1])
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    run("kernels")  # untimed: builds the precompiled header if the machine has none
    results: dict[str, list[list[float]]] = {"kernels": [], "matmuls": []}
    for _ in range(args.runs):
        for kind in results:  # interleaved, so that the machine's load falls on both alike
            results[kind].append(run(kind))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print("| graph | first compile, CPU-s | second compile, CPU-s |")
    print("|---|---|---|")
    for kind, runs in results.items():
        first, second = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"| {kind} | {first:.2f} | {second:.2f} |")


if __name__ == "__main__":
    main()
