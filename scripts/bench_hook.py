"""The guard hook's own Python cost per call, without any exchange.

One process, a one-rank gloo group, and a channel whose ``agree`` returns at
once: what is left is everything the hook does on every compiled call around
the exchange (the failure check, the channel and thread checks, the frame
identity, the counters, the profiler check). The exchange itself is measured
by ``bench_guard.py``; this isolates the fast path's own cost, in ns, so that
a change to it can be compared before and after (``--repeat`` samples of
``--calls`` calls each; the table gives the median and the minimum).

Run:  scripts/dev bench-hook [--calls 100000] [--repeat 9]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch.distributed as dist


class _AgreeAtOnce:
    """A guard channel that agrees at once (benchmark only: no peer, no exchange)."""

    check_desync = True
    pg = None
    name = "none"

    def agree(self, hit: bool, seq: int, site: int) -> tuple[bool, bool]:
        return True, True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls per sample")
    parser.add_argument("--repeat", type=int, default=9, help="samples")
    args = parser.parse_args()

    import compiler_collectives  # noqa: F401  (installs the hook's seams)
    from compiler_collectives.agreements import guard

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(prefix="bench-hook-"), rank=0, world_size=1)
    guard.use_channel(_AgreeAtOnce())
    hook = guard.hook

    def sample(n: int) -> float:
        started = time.perf_counter_ns()
        for _ in range(n):
            hook(True)
        return (time.perf_counter_ns() - started) / n

    sample(args.calls // 5)  # warm-up
    samples = sorted(sample(args.calls) for _ in range(args.repeat))
    print(f"bench_hook: {args.repeat} samples x {args.calls} calls\n")
    print("| hook call (ns) | median | min |")
    print("|---|---|---|")
    print(f"| ours, no exchange | {samples[len(samples) // 2]:.0f} | {samples[0]:.0f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
