"""Per-call cost of a small compiled function under guard collectives, side by side.

Modes, measured in interleaved blocks in the same rank processes:
  none   no guard collective (hook off)
  torch  torch's own guard_collectives_hook (all_gather_object per call)
  ours   compiler_collectives' hook on the default transport (auto: shared
         memory within a host, one leader per host between hosts)
  ours-yield  ours with the waiting of before the futex: yield until the word
         arrives, never sleep (shared memory only; same as ours elsewhere)
  ours-gloo  ours with COMPILER_COLLECTIVES_GUARD_TRANSPORT=gloo (all-reduce
         of two int64: hit/miss agreement + desync check)
  ours-gloo-nocheck  ours-gloo with COMPILER_COLLECTIVES_GUARD_DESYNC_CHECK=0 (one int64)
  ours+timing  ours with COMPILER_COLLECTIVES_TIMING-style recording on
  floor  a bare all-reduce of one int64 on a gloo group of the same kind,
         called straight through ProcessGroup.allreduce (the transport floor)
  hook+floor  a guard hook that does nothing but that bare all-reduce: what
         any guard collective pays for running inside a compiled call
  hook-noop  a guard hook that returns its argument: what torch charges for
         calling any Python guard hook (the floor under "ours" on one host)

A block is `--calls` calls; a mode's figure is the median over all its calls.
"added" is a mode's cost minus "none": what the guard collective adds.

``--hosts H`` splits each world into H "hosts" by setting GROUP_RANK per
rank, as torchrun does for each of its agents: ranks of one host share a
segment, and the host leaders exchange over gloo on loopback.

Run:  scripts/dev bench-guard [--worlds 2 4] [--hosts 1] [--calls 300] [--blocks 7] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = (
    "none",
    "hook-noop",
    "torch",
    "ours",
    "ours-yield",
    "ours-gloo",
    "ours-gloo-nocheck",
    "ours+timing",
    "floor",
    "hook+floor",
)


def _small(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _rank(rank: int, world: int, hosts: int, store: str, calls: int, blocks: int, out_path: str) -> None:
    os.environ["GROUP_RANK"] = str(rank * hosts // world)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import torch._C._dynamo.eval_frame as c_eval_frame
    import torch._dynamo.distributed as dynamo_distributed

    import compiler_collectives  # noqa: F401
    from compiler_collectives import dynamo
    from compiler_collectives.agreements import guard as guard_collective
    from compiler_collectives.instrument import timing
    from compiler_collectives.transport import groups

    torch_hook = dynamo.torch_original("guard_collectives_hook")
    # torch's hook asks torch._dynamo.distributed.get_guard_pg for its group;
    # give it its own gloo group as torch would create it.
    torch_guard_pg = dist.new_group(backend="gloo")
    ours_pg = groups.guard_pg()  # create our group up front, on every rank
    from compiler_collectives.transport import GlooGuardChannel

    default_channel = groups.guard_channel()
    transport = groups.guard_transport()
    gloo_channel = GlooGuardChannel(ours_pg, check_desync=True)
    nocheck_channel = GlooGuardChannel(ours_pg, check_desync=False)
    channels = {"ours-gloo": gloo_channel, "ours-gloo-nocheck": nocheck_channel}

    floor_pg = dist.new_group(backend="gloo")
    floor_t = torch.zeros(1, dtype=torch.int64)
    floor_opts = dist.AllreduceOptions()
    floor_opts.reduceOp = dist.ReduceOp.MIN

    f = torch.compile(_small, backend="eager")
    x = torch.ones(4)
    f(x)  # compile once; every later call is a cache hit

    def bare_hook(hit: bool) -> bool:
        floor_pg.allreduce([floor_t], floor_opts).wait()
        return hit

    def noop_hook(hit: bool) -> bool:
        return hit

    local = getattr(default_channel, "exchange", None)  # None on the gloo transport

    def set_mode(mode: str) -> None:
        timing.set_enabled(mode == "ours+timing")
        if local is not None:
            local.tune(sleep=mode != "ours-yield")
        guard_collective.use_channel(channels.get(mode, default_channel))
        if mode == "hook+floor":
            c_eval_frame.set_guard_complete_hook(bare_hook)
        elif mode == "hook-noop":
            c_eval_frame.set_guard_complete_hook(noop_hook)
        elif mode == "torch":
            dynamo_distributed.get_guard_pg = lambda: torch_guard_pg
            c_eval_frame.set_guard_complete_hook(torch_hook)
        elif mode.startswith("ours"):
            c_eval_frame.set_guard_complete_hook(guard_collective.hook)
        else:
            c_eval_frame.set_guard_complete_hook(None)

    per_call: dict[str, list[float]] = {m: [] for m in MODES}
    perf = time.perf_counter
    for block in range(blocks + 1):  # block 0 warms every path up and is discarded
        for mode in MODES:
            set_mode(mode)
            dist.barrier()
            samples = []
            if mode == "floor":
                for _ in range(calls):
                    start = perf()
                    floor_pg.allreduce([floor_t], floor_opts).wait()
                    samples.append(perf() - start)
            else:
                for _ in range(calls):
                    start = perf()
                    f(x)
                    samples.append(perf() - start)
            if block > 0:
                per_call[mode].extend(samples)

    set_mode("none")
    assert ours_pg is not None
    with open(f"{out_path}.{rank}", "w") as fh:
        json.dump(
            {
                "transport": transport,
                "none": statistics.median(per_call["none"]),
                "per_call": per_call if rank == 0 else {},
            },
            fh,
        )
    dist.destroy_process_group()


def run(world: int, hosts: int, calls: int, blocks: int, timeout_s: float) -> tuple[str, dict[str, float]]:
    """Rank 0's median per mode, plus "none-slowest": the slowest rank's "none"."""
    # Imported here, not at the top: spawned ranks run this file's top too, and must import
    # compiler_collectives only where their own code does.
    import cc_launch as launch

    tmp = tempfile.mkdtemp(prefix="cc-bench-guard-")
    out_path = os.path.join(tmp, "result.json")
    launch.run_to_end(
        _rank, world, args=(world, hosts, os.path.join(tmp, "store"), calls, blocks, out_path), timeout_s=timeout_s
    )
    results = []
    for rank in range(world):
        with open(f"{out_path}.{rank}") as fh:
            results.append(json.load(fh))
    medians = {m: statistics.median(v) * 1e6 for m, v in results[0]["per_call"].items()}
    medians["none-slowest"] = max(r["none"] for r in results) * 1e6
    return results[0]["transport"], medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes to measure")
    parser.add_argument("--hosts", type=int, default=1, help="split each world into this many hosts (GROUP_RANK)")
    parser.add_argument("--calls", type=int, default=300, help="calls per block")
    parser.add_argument("--blocks", type=int, default=7, help="measured blocks per mode")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds the ranks of one world may take; then they are killed"
    )
    args = parser.parse_args()
    print(
        f"bench_guard: worlds {args.worlds}, hosts {args.hosts}, {args.blocks} blocks x {args.calls} "
        f"calls per mode, torch {torch.__version__}",
        flush=True,
    )
    rows = []
    for world in args.worlds:
        transport, med = run(world, args.hosts, args.calls, args.blocks, args.timeout)
        rows.append((world, transport, med))
    print()
    print("| ranks | hosts | ours on | " + " | ".join(MODES) + " |")
    print("|---|---|---|" + "---|" * len(MODES))
    for world, transport, m in rows:
        print(f"| {world} | {args.hosts} | {transport} | " + " | ".join(f"{m[k]:.1f}" for k in MODES) + " |")
    print()
    print(
        "| ranks | ours added | over the slowest rank | of which any hook | ours added / floor | "
        "ours-yield added / floor | ours-gloo added / floor | torch added / ours added | "
        "ours-gloo added / ours added | timing overhead |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world, _transport, m in rows:
        added = {k: m[k] - m["none"] for k in MODES}
        print(
            f"| {world} | {added['ours']:.1f} µs | {m['ours'] - m['none-slowest']:.1f} µs | "
            f"{added['hook-noop']:.1f} µs | {added['ours'] / m['floor']:.3f}x | "
            f"{added['ours-yield'] / m['floor']:.3f}x | "
            f"{added['ours-gloo'] / m['floor']:.2f}x | {added['torch'] / added['ours']:.0f}x | "
            f"{added['ours-gloo'] / added['ours']:.0f}x | "
            f"{(m['ours+timing'] - m['ours']):+.1f} µs |"
        )
    print(
        "\nmedians in µs per call; 'added' = mode minus 'none'; floor = a bare gloo all-reduce of "
        "one int64 in a tight loop; timing overhead = ours+timing minus ours; 'of which any hook' = "
        "hook-noop minus none, what torch charges for calling any Python guard hook; 'over the slowest "
        "rank' = ours minus the largest 'none' of any rank (a collective runs at the slowest rank's pace)"
    )


if __name__ == "__main__":
    main()
