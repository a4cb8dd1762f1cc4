"""First-compile wall time: compiler collectives off, ours, ours with the program audit, torch's own.

A 32-layer residual MLP (Linear + LayerNorm + GELU, width 64) is compiled on
2 gloo ranks, from a clean Dynamo state each time, for backends eager and
aot_eager (``--backends`` adds inductor), with input batch sizes that differ
across ranks or agree. Every configuration is measured in every repetition,
interleaved, in the same rank processes, so the ratios are side by side. A
measurement is the slowest rank's first-call time (the job's first step ends
when its last rank does). "ours" runs with COMPILER_COLLECTIVES_AUDIT off,
"ours+audit" with it on. The audit's own time is reported next to them, from
``stats()``: fingerprinting on the slowest rank, and the whole audit on the
rank that arrived last at its exchange (the other ranks' extra time there is
waiting for that rank, which the job would do anyway at its first collective).

Run:  scripts/dev bench-compile [--reps 5] [--nproc 2] [--backends eager,aot_eager] [--timeout 1800]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WIDTH = 64
LAYERS = 32


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.norm(self.linear(x)))


class ResidualMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


MODES = ("off", "ours", "audit", "torch")


def _configs(backends: list[str]) -> list[tuple[str, str, str]]:
    return [(backend, sizes, mode) for backend in backends for sizes in ("differ", "agree") for mode in MODES]


def _rank(rank: int, world: int, store: str, reps: int, out_path: str, backends: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch_reference import ImplementationSwitch, torch_pickle_size

    import compiler_collectives as cc
    from compiler_collectives import config
    from compiler_collectives.agreements import compiler as compiler_collective

    switch = ImplementationSwitch()
    captured: dict[str, Any] = {}
    original_exchange = compiler_collective.exchange

    def capturing_exchange(ds: Any, frame: Any, pg: Any = None, *, state: Any = None) -> Any:
        if state is None:  # the end-of-trace exchange carries the full state
            captured["state"] = ds.local_state
        return original_exchange(ds, frame, pg, state=state)

    compiler_collective.exchange = capturing_exchange

    torch.manual_seed(0)
    model = ResidualMLP()
    configs = _configs(backends)
    times: dict[tuple[str, str, str], list[float]] = {c: [] for c in configs}
    audit_own: dict[tuple[str, str], list[float]] = {}
    payload: dict[str, int] = {}
    for rep in range(reps):
        for backend, sizes, mode in configs:
            switch.use("torch" if mode == "torch" else "ours")
            torch._dynamo.config.enable_compiler_collectives = mode != "off"
            config.set_value("audit", mode == "audit")
            torch._dynamo.reset()
            cc.reset_stats()
            batch = 16 + 8 * rank if sizes == "differ" else 16
            x = torch.randn(batch, WIDTH)
            compiled = torch.compile(model, backend=backend)
            dist.barrier()
            start = time.perf_counter()
            compiled(x)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[(backend, sizes, mode)].append(elapsed.item())
            if mode == "audit":
                # Fingerprinting: the slowest rank's. The whole audit: the rank that
                # arrived last at the exchange spent least in it, and its time is
                # what the audit adds to the step (the others' extra is waiting for it).
                s = cc.stats()
                prints = torch.tensor([s["audit_fingerprint_s"]], dtype=torch.float64)
                dist.all_reduce(prints, op=dist.ReduceOp.MAX)
                total = torch.tensor([s["audit_time_s"]], dtype=torch.float64)
                dist.all_reduce(total, op=dist.ReduceOp.MIN)
                audit_own.setdefault((backend, sizes), []).append([total.item(), prints.item()])
            if mode == "ours" and rep == 0 and backend == "eager":
                payload[f"ours_{sizes}"] = cc.stats()["compiler_bytes_sent"]
                payload[f"pickle_{sizes}"] = torch_pickle_size(captured["state"])
                payload[f"entries_{sizes}"] = len(captured["state"].automatic_dynamic)
        if rank == 0:
            print(f"  repetition {rep + 1}/{reps} done", flush=True)
    if rank == 0:
        import json

        with open(out_path, "w") as f:
            json.dump(
                {
                    "times": {"|".join(k): v for k, v in times.items()},
                    "audit_own": {"|".join(k): v for k, v in audit_own.items()},
                    "payload": payload,
                },
                f,
            )
    dist.destroy_process_group()


def main() -> None:
    # Imported here, not at the top: spawned ranks run this file's top too, and must import
    # compiler_collectives only where their own code does.
    import cc_launch as launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every configuration")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument(
        "--backends",
        default="eager,aot_eager",
        help="comma-separated torch.compile backends (eager, aot_eager, inductor)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds the ranks may take in all; then they are killed"
    )
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if "inductor" in backends:
        # A cache hit would skip the very compile (and audit levels) being measured.
        os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
        os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    tmp = tempfile.mkdtemp(prefix="cc-bench-")
    out_path = os.path.join(tmp, "result.json")
    print(f"bench_compile: {args.nproc} ranks, {args.reps} repetitions, torch {torch.__version__}", flush=True)
    launch.run_to_end(
        _rank,
        args.nproc,
        args=(args.nproc, os.path.join(tmp, "store"), args.reps, out_path, backends),
        timeout_s=args.timeout,
    )
    import json

    with open(out_path) as f:
        data = json.load(f)
    times = {tuple(k.split("|")): v for k, v in data["times"].items()}
    print()
    audit_own = {tuple(k.split("|")): v for k, v in data["audit_own"].items()}
    print(
        "| backend | input sizes | off (s) | ours (s) | ours+audit (s) | torch's own (s) | ours / off | "
        "ours+audit / ours | paired | torch / off | ours / torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for backend in backends:
        for sizes in ("differ", "agree"):
            med = {m: statistics.median(times[(backend, sizes, m)]) for m in MODES}
            # each repetition measures ours and ours+audit back to back: the median
            # of those per-repetition ratios is less sensitive to load drifting
            paired = statistics.median(
                a / o for a, o in zip(times[(backend, sizes, "audit")], times[(backend, sizes, "ours")])
            )
            print(
                f"| {backend} | {sizes} | {med['off']:.3f} | {med['ours']:.3f} | {med['audit']:.3f} | "
                f"{med['torch']:.3f} | {med['ours'] / med['off']:.2f}x | {med['audit'] / med['ours']:.3f}x | "
                f"{paired:.3f}x | {med['torch'] / med['off']:.2f}x | {med['ours'] / med['torch']:.2f}x |"
            )
    print()
    print(
        "| backend | input sizes | fingerprinting, slowest rank (ms) | whole audit, last rank to arrive (ms) "
        "| whole audit / ours |"
    )
    print("|---|---|---|---|---|")
    for backend in backends:
        for sizes in ("differ", "agree"):
            total = statistics.median(t for t, _ in audit_own[(backend, sizes)])
            prints = statistics.median(f for _, f in audit_own[(backend, sizes)])
            ours = statistics.median(times[(backend, sizes, "ours")])
            print(f"| {backend} | {sizes} | {prints * 1e3:.1f} | {total * 1e3:.1f} | {total / ours * 100:.2f}% |")
    p = data["payload"]
    if not p:
        return  # the payload sizes are measured with the eager backend
    print()
    print("| input sizes | entries | ours (msgpack bytes) | torch (pickle bytes) | ours / pickle |")
    print("|---|---|---|---|---|")
    for sizes in ("differ", "agree"):
        print(
            f"| {sizes} | {p[f'entries_{sizes}']} | {p[f'ours_{sizes}']} | {p[f'pickle_{sizes}']} | "
            f"{p[f'ours_{sizes}'] / p[f'pickle_{sizes}']:.2f} |"
        )


if __name__ == "__main__":
    main()
