"""A MODEL of the guard collective's per-call cost against world size, calibrated here.

Nothing here runs at 16,384 ranks: the script measures four figures on this
machine with two processes, then extrapolates each path's cost with the
number of sequential network hops its algorithm needs.

Measured (medians over many calls, two ranks, gloo on loopback):
  hop     one-way latency of a gloo send/recv ping-pong (RTT / 2)
  shm     our shared-memory exchange (two ranks of one host)
  round   one leader round on our path (two ranks as two hosts), less one hop:
          our per-round overhead beyond the wire
  ring2   a gloo all-reduce of one int64 at 2 ranks
  torch2  torch's all_gather_object of a bool at 2 ranks (its guard collective)

Modelled, for N = L ranks per host x H hosts:
  torch (all_gather_object): two ring all-gathers (sizes, then bytes), each
      N-1 sequential hops, plus unpickling N objects on every rank:
      2(N-1)*hop + N*unpickle + (torch2 - 2*hop - 2*unpickle)
  gloo ring (today's --transport gloo): gloo's all-reduce is a ring for small
      tensors, 2(N-1) sequential hops: 2(N-1)*hop + (ring2 - 2*hop)
  ours (auto): shm(L) on every host, then on H > 1 recursive doubling between
      leaders, ceil(log2 H) rounds plus 2 when H is not a power of two:
      shm + rounds(H) * (hop + round)

``--hop-us`` replaces the measured loopback hop with a datacentre figure (a
TCP hop between hosts is typically 10-50 µs); ``--ranks-per-host`` sets L.

Run:  scripts/dev python scripts/guard_scale_model.py [--hop-us 25] [--ranks-per-host 8] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

CALLS = 3000


def _median_us(fn, calls: int = CALLS) -> float:
    samples = []
    perf = time.perf_counter
    for _ in range(calls):
        start = perf()
        fn()
        samples.append(perf() - start)
    return statistics.median(samples) * 1e6


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from compiler_collectives.transport import groups

    results: dict[str, float] = {}
    pg = dist.new_group(backend="gloo")
    t = torch.zeros(1, dtype=torch.int64)
    peer = 1 - rank

    def ping_pong() -> None:
        if rank == 0:
            pg.send([t], peer, 0).wait()
            pg.recv([t], peer, 0).wait()
        else:
            pg.recv([t], peer, 0).wait()
            pg.send([t], peer, 0).wait()

    dist.barrier()
    results["hop"] = _median_us(ping_pong) / 2

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    dist.barrier()
    results["ring2"] = _median_us(lambda: pg.allreduce([t], opts).wait())

    objects = [None, None]
    dist.barrier()
    results["torch2"] = _median_us(lambda: dist.all_gather_object(objects, True, group=pg), calls=1000)

    payload = pickle.dumps(True)
    results["unpickle"] = _median_us(lambda: pickle.loads(payload), calls=20000)

    channel = groups.guard_channel()
    assert channel.name == "shm", channel.name
    seq = [0]

    def shm_call() -> None:
        seq[0] += 1
        channel.agree(True, seq[0], 1)

    dist.barrier()
    results["shm"] = _median_us(shm_call, calls=20000)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def _two_hosts_rank(rank: int, store: str, out: str) -> None:
    os.environ["GROUP_RANK"] = str(rank)  # two ranks, two "hosts": every call takes one leader round
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from compiler_collectives.transport import groups

    channel = groups.guard_channel()
    assert channel.name == "shm+leaders", channel.name
    seq = [0]

    def call() -> None:
        seq[0] += 1
        channel.agree(True, seq[0], 1)

    dist.barrier()
    value = _median_us(call)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"two_hosts": value}, fh)
    dist.destroy_process_group()


def measure(timeout_s: float) -> dict[str, float]:
    # Imported here, not at the top: spawned ranks run this file's top too, and must import
    # compiler_collectives only where their own code does.
    import cc_launch as launch

    figures: dict[str, float] = {}
    for target in (_rank, _two_hosts_rank):
        tmp = tempfile.mkdtemp(prefix="cc-scale-")
        out = os.path.join(tmp, "out.json")
        launch.run_to_end(target, 2, args=(os.path.join(tmp, "store"), out), timeout_s=timeout_s)
        with open(out) as fh:
            figures.update(json.load(fh))
    figures["round"] = max(0.0, figures["two_hosts"] - figures["shm"] - figures["hop"])
    return figures


def rounds(hosts: int) -> int:
    if hosts <= 1:
        return 0
    power = 1 << (hosts.bit_length() - 1)
    return int(math.log2(power)) + (2 if power != hosts else 0)


def model(f: dict[str, float], hop: float, ranks_per_host: int, hosts: int) -> dict[str, float]:
    n = ranks_per_host * hosts
    torch_fixed = max(0.0, f["torch2"] - 2 * f["hop"] - 2 * f["unpickle"])
    ring_fixed = max(0.0, f["ring2"] - 2 * f["hop"])
    return {
        "torch": 2 * (n - 1) * hop + n * f["unpickle"] + torch_fixed,
        "ring": 2 * (n - 1) * hop + ring_fixed,
        "ours": f["shm"] + rounds(hosts) * (hop + f["round"]),
    }


def _fmt(us: float) -> str:
    return f"{us / 1000:.1f} ms" if us >= 1000 else f"{us:.1f} µs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hop-us",
        type=float,
        default=None,
        help="one-way latency of a hop between hosts (default: measured loopback hop)",
    )
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds each 2-rank measurement may take; then it is killed"
    )
    args = parser.parse_args()
    f = measure(args.timeout)
    hop = f["hop"] if args.hop_us is None else args.hop_us
    print(f"guard_scale_model (A MODEL, not a measurement at scale), torch {torch.__version__}")
    print(
        "calibration, measured here (2 processes, medians): "
        + ", ".join(f"{k} {v:.1f} µs" for k, v in sorted(f.items()))
    )
    print(
        f"hop used between hosts: {hop:.1f} µs ({'measured loopback' if args.hop_us is None else '--hop-us'}); "
        f"{args.ranks_per_host} ranks per host\n"
    )
    print(
        "| ranks | hosts | leader rounds | torch all_gather_object | gloo ring all-reduce | ours (shm + leaders) | "
        "torch / ours | ring / ours |"
    )
    print("|---|---|---|---|---|---|---|---|")
    sizes = [args.ranks_per_host * h for h in (1, 2, 3, 4, 8, 16, 64, 128, 256, 512, 1024, 2048)]
    for n in sizes:
        hosts = max(1, n // args.ranks_per_host)
        m = model(f, hop, args.ranks_per_host, hosts)
        print(
            f"| {n} | {hosts} | {rounds(hosts)} | {_fmt(m['torch'])} | {_fmt(m['ring'])} | {_fmt(m['ours'])} | "
            f"{m['torch'] / m['ours']:.0f}x | {m['ring'] / m['ours']:.0f}x |"
        )


if __name__ == "__main__":
    sys.exit(main())
