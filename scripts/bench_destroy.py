"""What ``destroy_process_group()`` costs each rank, torch alone and with the package (issue 36).

Two jobs of ``--world`` gloo ranks, one without compiler_collectives and one
with it (guards on), each run ``--generations`` generations on the same
``MASTER_PORT`` (``--port new``: a new port each): ``init_process_group``
(tcp://, rank 0 hosts the store),
a tiny compiled function called a few times, then a timed
``destroy_process_group()``. The ranks meet on a FileStore of their own
between generations (as torchrun's agents would), so a slow destroy costs
time here, never a hang; the jobs alternate ``--jobs`` times. The figure is
the median, over every rank and generation, of each rank's own destroy in ms.

With ``--profile`` the package's job also times each part of our side of a
destroy (each clear of the GROUP_ENDING and GROUP_DESTROYED moments, and each moment).

Run:  scripts/dev bench-destroy [--world 2] [--generations 5] [--jobs 3] [--port same|new] [--profile]
      [--timeout 300] [--job-timeout 90]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _accepts(port: int) -> bool:
    """Whether something still accepts connections on ``port`` (the old store's server)."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _profiled() -> dict[str, list[float]]:
    """Wrap each clear of the moments of a destroy, and each moment, with a timer (ms per call)."""
    import dataclasses

    from compiler_collectives import runtime, transport
    from compiler_collectives.agreements import guard_state
    from compiler_collectives.dynamo import bound

    times: dict[str, list[float]] = {}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

        return run

    # Each step of the runtime's moments of a destroy (it calls them through their modules).
    for owner, name in ((transport, "let_go"), (guard_state, "let_go"), (transport, "default_group_destroyed")):
        label = f"{owner.__name__.removeprefix('compiler_collectives.')}:{name}"
        setattr(owner, name, timed(label, getattr(owner, name)))
    runtime.Runtime.begin = timed("runtime:begin (the next generation)", runtime.Runtime.begin)
    # The moments the c10d seam runs around torch's destroy (the runtime's, handed in at install).
    bound.moments = dataclasses.replace(
        bound.moments,
        default_group_ending=timed("(before torch's destroy)", bound.moments.default_group_ending),
        default_group_destroyed=timed("(after torch's destroy)", bound.moments.default_group_destroyed),
    )
    return times


def _rank(
    rank: int,
    world: int,
    ports: list[int],
    coordination: str,
    package: bool,
    profile: bool,
    hang_s: float,
    out: str,
) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(hang_s, exit=True)  # a hung job says where, then ends
    times: dict[str, list[float]] = {}
    if package:
        import compiler_collectives as cc

        cc.enable(guards=True)
        if profile:
            times = _profiled()
    f = torch.compile(_tiny, backend="eager")
    coordinate = dist.FileStore(coordination, world)
    destroys: list[float] = []
    open_after: list[bool] = []
    for generation, port in enumerate(ports):
        # Nobody starts a generation before every rank ended the last one.
        coordinate.add(f"ended/{generation - 1}", 1)
        while coordinate.add(f"ended/{generation - 1}", 0) < world:
            time.sleep(0.005)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        for _ in range(3):
            f(torch.ones(2))
        dist.barrier()
        t0 = time.perf_counter()
        dist.destroy_process_group()
        destroys.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:  # the store's host: its server must have closed the port by now
            open_after.append(_accepts(port))
    with open(f"{out}.{rank}", "w") as fh:
        json.dump({"destroy_ms": destroys, "parts_ms": times, "open_after": open_after}, fh)


def _job(
    world: int, generations: int, same_port: bool, package: bool, profile: bool, timeout_s: float
) -> dict[str, list[float]]:
    import cc_launch as launch

    ports = [launch.free_port()] * generations if same_port else [launch.free_port() for _ in range(generations)]
    tmp = tempfile.mkdtemp(prefix="bench-destroy-")
    out = os.path.join(tmp, "out")
    launch.run_to_end(
        _rank,
        world,
        args=(world, ports, os.path.join(tmp, "coordination"), package, profile, timeout_s - 5, out),
        timeout_s=timeout_s,
    )
    merged: dict[str, list[float]] = {"destroy": [], "open_after": []}
    for rank in range(world):
        with open(f"{out}.{rank}") as fh:
            result = json.load(fh)
        merged["destroy"] += result["destroy_ms"]
        merged["open_after"] += result["open_after"]
        for name, values in result["parts_ms"].items():
            merged.setdefault(name, []).extend(values)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--generations", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=3, help="jobs of each kind, alternating")
    parser.add_argument("--port", choices=("same", "new"), default="same", help="each generation's port")
    parser.add_argument("--only", choices=("torch", "package"), help="run one kind of job only")
    parser.add_argument("--profile", action="store_true", help="time each part of our side of a destroy")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds all jobs may take; then killed")
    parser.add_argument("--job-timeout", type=float, default=90.0, help="seconds one job may take (a hang)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout
    torch_ms: list[float] = []
    ours: dict[str, list[float]] = {}
    still_open: dict[str, int] = {}
    probed: dict[str, int] = {}
    for _ in range(args.jobs):
        for package in (False, True):
            if args.only and args.only != ("package" if package else "torch"):
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"bench-destroy: past --timeout {args.timeout:.0f}s")
            got = _job(
                args.world, args.generations, args.port == "same", package, args.profile, min(left, args.job_timeout)
            )
            if package:
                for name, values in got.items():
                    ours.setdefault(name, []).extend(values)
            else:
                torch_ms += got["destroy"]
            kind = "with the package" if package else "torch alone"
            still_open[kind] = still_open.get(kind, 0) + int(sum(got["open_after"]))
            probed[kind] = probed.get(kind, 0) + len(got["open_after"])
    med_torch, med_ours = statistics.median(torch_ms), statistics.median(ours["destroy"])
    print(
        f"world {args.world}, {args.jobs} jobs x {args.generations} generations each, {args.port} port, gloo; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'destroy_process_group()':<28}{'median ms':>10}{'max ms':>9}{'n':>5}")
    print(f"{'torch alone':<28}{med_torch:>10.1f}{max(torch_ms):>9.1f}{len(torch_ms):>5}")
    print(f"{'with the package':<28}{med_ours:>10.1f}{max(ours['destroy']):>9.1f}{len(ours['destroy']):>5}")
    print(f"added: {med_ours - med_torch:+.1f} ms ({med_ours / med_torch:.2f}x torch's)")
    print(
        "old store's port still accepting when rank 0's destroy returned: "
        + ", ".join(f"{kind} {still_open[kind]} of {probed[kind]}" for kind in probed)
    )
    parts = {k: v for k, v in ours.items() if k not in ("destroy", "open_after")}
    if parts:
        print("our side of a destroy, median ms (max):")
        for name, values in sorted(parts.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"  {name:<70}{statistics.median(values):>8.2f} ({max(values):.2f})")


if __name__ == "__main__":
    main()
