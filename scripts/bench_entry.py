"""Per-call cost of entry agreement (issue 16), the check on and off, at two frames.

Frames, each compiled twice in the same rank processes (once with
COMPILER_COLLECTIVES_ENTRY_CHECK on, once off; separate code objects):
  one-entry     ``x + 1``: a frame with a single cache entry (the fast path:
                the wrapper reads one flag)
  three-entries a frame with three static entries whose programs differ (no
                collective / an all_reduce / an all_gather); every call runs
                the entry without a collective, so what is measured is the
                check itself (one more agreement on the guard channel)

The guard collective is on in every mode (the check needs it). Blocks of
``--calls`` calls per mode are interleaved; a mode's figure is the median
over all its calls, in µs per call. "added" is on minus off.

Run:  scripts/dev python scripts/bench_entry.py [--world 2] [--calls 300] [--blocks 7] [--transport auto]
      [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

_PROGRAM = {"which": 0}


@torch._dynamo.assume_constant_result
def _which() -> int:
    return _PROGRAM["which"]


def _one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _three(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    which = _which()
    if which == 1:
        x = funcol.all_reduce(x, "sum", dist.group.WORLD)
    elif which == 2:
        x = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    return x + 1


def _copy(fn):  # a new code object: its own cache and its own entry registry
    import types

    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__ + "_copy")


def _rank(rank: int, world: int, store: str, calls: int, blocks: int, transport: str, out_path: str) -> None:
    os.environ["COMPILER_COLLECTIVES_GUARD_TRANSPORT"] = transport
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import compiler_collectives as cc
    from compiler_collectives import config
    from compiler_collectives.agreements import entry as entry_agreement

    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.cache_size_limit = 16
    cc.enable(guards=True)
    fns: dict[str, tuple] = {}
    for check in (True, False):
        with config.override(entry_check=check):
            one = torch.compile(_copy(_one) if not check else _one, backend="eager")
            one(torch.ones(4))
            three = torch.compile(_copy(_three) if not check else _three, backend="eager")
            for which, rows in ((1, 5), (2, 6), (0, 4)):  # three entries, three programs
                _PROGRAM["which"] = which
                three(torch.ones(rows))
        fns[f"one-entry/{'on' if check else 'off'}"] = (one, torch.ones(4))
        fns[f"three-entries/{'on' if check else 'off'}"] = (three, torch.ones(4))
    mixed = {k: [e["mixed"] for e in v][-1] for k, v in entry_agreement.frames().items()}
    samples: dict[str, list[float]] = {m: [] for m in fns}
    for fn, x in fns.values():  # warm up
        for _ in range(50):
            fn(x)
    for _ in range(blocks):
        for name, (fn, x) in fns.items():
            dist.barrier()
            for _ in range(calls):
                t0 = time.perf_counter()
                fn(x)
                samples[name].append(time.perf_counter() - t0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "medians_us": {m: statistics.median(v) * 1e6 for m, v in samples.items()},
                    "mixed": mixed,
                    "stats": cc.stats(),
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    # Imported here, not at the top: spawned ranks run this file's top too, and must import
    # compiler_collectives only where their own code does.
    import cc_launch as launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--transport", default="auto", choices=("auto", "gloo"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the ranks may take; then they are killed")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-entry-")
    out = os.path.join(tmp, "out.json")
    launch.run_to_end(
        _rank,
        args.world,
        args=(args.world, os.path.join(tmp, "store"), args.calls, args.blocks, args.transport, out),
        timeout_s=args.timeout,
    )
    with open(out) as f:
        result = json.load(f)
    med = result["medians_us"]
    print(
        f"world {args.world}, transport {args.transport}, {args.blocks} blocks x {args.calls} calls, median µs per call"
    )
    print(f"{'frame':<15}{'check off':>12}{'check on':>12}{'added':>10}")
    for frame in ("one-entry", "three-entries"):
        off, on = med[f"{frame}/off"], med[f"{frame}/on"]
        print(f"{frame:<15}{off:>12.2f}{on:>12.2f}{on - off:>10.2f}")
    print(
        f"entry checks run on rank 0: {result['stats']['entry_checks']}; frames mixed: "
        f"{sorted(k.split(' at ')[0] for k, v in result['mixed'].items() if v)}"
    )


if __name__ == "__main__":
    main()
