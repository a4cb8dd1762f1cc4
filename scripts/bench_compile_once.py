"""First training step of an inductor-compiled DDP model on N ranks: COMPILER_COLLECTIVES_COMPILE_ONCE=0 vs default.

With compiler collectives on, COMPILER_COLLECTIVES_COMPILE_ONCE (default on,
0 = off, must match across ranks) makes one rank compile each inductor graph
and the others load its artifact. This benchmark measures what that saves on
the first step, as a user would run it: torchrun (``python -m
torch.distributed.run``), environment variables only, cold caches.

Workload: torch CPU, gloo, ``torch.compile(DDP(model), backend="inductor")``,
one thread per rank (OMP_NUM_THREADS=1, torch.set_num_threads(1),
TORCHINDUCTOR_COMPILE_THREADS=1); the model is ``--blocks`` (6) residual MLP
blocks of width ``--width`` (256): x + Linear(GELU(Linear(LayerNorm(x)))),
hidden 4 x width; SGD with momentum, ``--steps`` (3) steps. The service is on
through TORCH_COMPILER_COLLECTIVES=1 and COMPILER_COLLECTIVES_GUARDS=1 (the
README's zero-code form). Every run gets a fresh TORCHINDUCTOR_CACHE_DIR (and
TRITON_CACHE_DIR inside it); inherited TORCHINDUCTOR_*, TRITON_*, TORCHDYNAMO_*,
TORCH_COMPILE_* and COMPILER_COLLECTIVES_* variables are dropped.

Per rank, after a barrier so that all ranks start together: the first step's
wall time (just before the first compiled call to after its backward and
optimizer step) and its CPU seconds, this process and its waited-for children
(gcc), from getrusage(RUSAGE_SELF) + getrusage(RUSAGE_CHILDREN) deltas. A run
reports its slowest rank's wall and the CPU summed over its ranks; ratios are
to the 1-rank case of the same setting (always run: it is the baseline). After
the last step the ranks all-gather a SHA-256 of their flat parameters
(identical on every rank?) and rank 0 saves them; the driver checks that each
run's parameters equal those of the same case with COMPILE_ONCE=0.

Cases (``--cases``, comma-separated; default all):
  1rank        1 rank: a 1-rank compile, the baseline
  4shared      4 ranks, one cache dir
  4per-rank    4 ranks, a cache dir each (BENCH_CACHE_PER_RANK=<base>: the rank
               itself sets TORCHINDUCTOR_CACHE_DIR=<base>/rank<RANK> before
               importing torch, since torchrun cannot set per-rank variables)
  warm-cold    2 ranks, a cache dir each, rank 0's warmed first by an untimed
               2-rank run of the same job over that one dir; each rank's CPU /
               the 1-rank compile's
  2agents      2 torchrun agents x 2 ranks on 127.0.0.1 (--nnodes 2, static
               rendezvous), a cache dir per agent

Cache states (issue 29: the caches real jobs have), a table of their own; each
case is held to its floor, one cold compile plus a warm start for every other
rank (CPU: the 1rank row + (ranks - 1) x the 1rank-warm row), and, compile once
on, to its target (printed with it, and whether it is met):
  1rank-warm   1 rank over a dir warmed by an untimed 1-rank run: a warm start
               (a floor; run whenever a cache state is)
  2shared      2 ranks, one cold dir: the job alone (run with two-jobs, truncated)
  warm1-empty  2 ranks, a dir each: rank 0's warmed by an untimed 1-rank run,
               rank 1's empty. Target: each rank <= 0.35x a cold compile, the
               warm rank <= 1.1x its CPU with COMPILE_ONCE=0
  warm-off     2 ranks, a dir each, both warmed by an untimed run of the same
               2-rank job with the service off (none of its variables set but
               COMPILER_COLLECTIVES_COMPILE_ONCE=0). Target: each rank <= 0.35x
               a cold compile, 0 refused
  two-jobs     two 2-rank jobs (two torchrun agents, their own ports) on one
               cold dir, started together. Target: each job's CPU <= 1.1x the
               same job alone (2shared), 0 refused
  truncated    2 ranks, one dir warmed by an untimed run of the same job, then
               every file under its aotautograd/ and fxgraph/ cut to half its
               size. Target: finishes, CPU <= 1.1x a cold job (2shared)
Refusals are counted per run: the ranks' once_refused stats, summed.

Compile once's overhead per graph (issue 37), a table of its own for every
multi-rank case outside the cache states, compile once on: from each rank's
per-graph records (``stats()["compile_once"]``), per rank and what it did
(compiled, served, loaded, ...), the median over graphs and runs of its
exchanges (``exchange_s``: keys with the plan, result, load report), files
(``install_s``: a source collecting and digesting, a loader checking and
installing), bytes (``transfer_s``), wait (``waited_s``) and the wait's
latency after its source posted (``wait_ended_at`` - the source's
``posted_at``; the ranks share one host's clock); overhead = exchanges + files
+ latency, the time compile once adds outside the compile and the bytes (each
exchange includes waiting for the last rank to reach it: a last row per case
takes, per graph, the rank with the least overhead, an upper bound on what
compile once's own steps cost); rest
= the record's ``span_s`` less all of those (a source's compile, a loader's
lookup and load of the entry it was sent), with the artifact's bytes.

Settings, side by side in one run: "off" (COMPILER_COLLECTIVES_COMPILE_ONCE=0)
and "default" (the variable unset). If the installed compiler_collectives does
not know the variable (the feature is absent: setting it would fail the import
with ConfigError), neither setting sets it and both measure the same thing; the
header says so. Every run of one invocation shares a fresh TMPDIR under the
work dir, where inductor keeps its precompiled header whatever the cache dir
(4-5 CPU-s to build). An untimed 1-rank run comes first (``--no-prime`` skips
it), so that building that header and reading inductor's modules, gcc and its
headers from disk is not charged to whichever run is first. ``--repeat N``
runs every case and setting N times, interleaved, and reports medians. Every
run has a hard ``--timeout``; a failed run is reported in the table with the
tail of its log, and every process the script started is ended when it exits.

Run:  scripts/dev bench-compile-once [--cases 1rank,4shared] [--repeat 1] [--json]
      scripts/dev bench-compile-once --cases warm1-empty,warm-off,two-jobs,truncated
      [--blocks 6] [--width 256] [--timeout 900]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

COMPILE_ONCE_ENV = "COMPILER_COLLECTIVES_COMPILE_ONCE"
SETTINGS = ("off", "default")
SETTING_LABEL = {"off": "COMPILE_ONCE=0", "default": "default"}
SCRUBBED_PREFIXES = ("COMPILER_COLLECTIVES_", "TORCHINDUCTOR_", "TRITON_", "TORCHDYNAMO_", "TORCH_COMPILE_", "BENCH_")
SCRUBBED_NAMES = ("TORCH_COMPILER_COLLECTIVES", "OMP_NUM_THREADS")
CACHE_COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    what: str
    agents: tuple[int, ...]  # ranks per torchrun agent
    cache: str  # "shared", "per-rank" or "per-agent"
    warm_rank0: bool = False
    # The cache states table: how the dirs are readied, untimed, before the measured run (None:
    # cold); how many copies of the job start together on the same dirs; what it is held to.
    warm: str | None = None  # "1rank", "1rank-rank0", "service-off" or "truncated"
    jobs: int = 1
    target: str = ""
    needs: tuple[str, ...] = ()  # reference cases its ratios are to (run whenever it is)

    @property
    def world(self) -> int:
        return sum(self.agents)

    @property
    def cache_states(self) -> bool:
        return self.name in CACHE_STATES


CASES = {
    c.name: c
    for c in (
        Case("1rank", "1 rank (baseline)", (1,), "shared"),
        Case("4shared", "4 ranks, one cache dir", (4,), "shared"),
        Case("4per-rank", "4 ranks, a cache dir each", (4,), "per-rank"),
        Case("warm-cold", "2 ranks, rank 0's cache warm, rank 1's cold", (2,), "per-rank", warm_rank0=True),
        Case("2agents", "2 agents x 2 ranks, a cache dir per agent", (2, 2), "per-agent"),
        # The cache states table (issue 29): the floors first, then the states.
        Case("1rank-warm", "1 rank, its dir warmed by a 1-rank run (warm start)", (1,), "shared", warm="1rank"),
        Case("2shared", "2 ranks, one cold dir (the job alone)", (2,), "shared"),
        Case(
            "warm1-empty",
            "2 ranks, rank 0's dir warmed by a 1-rank run, rank 1's empty",
            (2,),
            "per-rank",
            warm="1rank-rank0",
            target="each rank ≤ 0.35× a cold compile; warm rank ≤ 1.1× its CPU with COMPILE_ONCE=0",
            needs=("1rank-warm",),
        ),
        Case(
            "warm-off",
            "2 ranks, both dirs warmed by the 2-rank job with the service off",
            (2,),
            "per-rank",
            warm="service-off",
            target="each rank ≤ 0.35× a cold compile; 0 refused",
            needs=("1rank-warm",),
        ),
        Case(
            "two-jobs",
            "two 2-rank jobs on one cold dir, started together",
            (2,),
            "shared",
            jobs=2,
            target="each job ≤ 1.1× its CPU alone (2shared); 0 refused",
            needs=("1rank-warm", "2shared"),
        ),
        Case(
            "truncated",
            "2 ranks, one dir whose entries are all truncated",
            (2,),
            "shared",
            warm="truncated",
            target="finishes; ≤ 1.1× a cold job (2shared)",
            needs=("1rank-warm", "2shared"),
        ),
    )
}
BASELINE = "1rank"
CACHE_STATES = ("1rank", "1rank-warm", "2shared", "warm1-empty", "warm-off", "two-jobs", "truncated")
WARM_START = "1rank-warm"
ALONE = "2shared"


# ------------------------------------------------------------------ the rank


def worker(args: argparse.Namespace) -> None:
    """One rank, started by torchrun. Environment first: nothing of torch is imported yet."""
    rank_env = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    per_rank_base = os.environ.get("BENCH_CACHE_PER_RANK")
    if per_rank_base:
        cache_dir = os.path.join(per_rank_base, f"rank{rank_env}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    import datetime
    import faulthandler
    import resource
    import struct

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    # A rank still running shortly before the driver's timeout shows where it is in the log.
    margin = min(20.0, args.timeout / 10)
    faulthandler.dump_traceback_later(max(1.0, args.deadline - time.time() - margin))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    class Block(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.fc1 = torch.nn.Linear(width, 4 * width)
            self.fc2 = torch.nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    class Net(torch.nn.Module):
        def __init__(self, blocks: int, width: int) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    net = Net(args.blocks, args.width)
    ddp = DDP(net)
    model = torch.compile(ddp, backend="inductor")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(args.batch, args.width, generator=gen) for _ in range(args.steps)]
    ys = [torch.randn(args.batch, args.width, generator=gen) for _ in range(args.steps)]

    def cpu_now() -> tuple[float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

    walls: list[float] = []
    cpus: list[tuple[float, float]] = []
    dist.barrier()
    for i in range(args.steps):
        opt.zero_grad(set_to_none=True)
        own0, kids0 = cpu_now()
        t0 = time.perf_counter()
        loss = F.mse_loss(model(xs[i]), ys[i])
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        own1, kids1 = cpu_now()
        walls.append(t1 - t0)
        cpus.append((own1 - own0, kids1 - kids0))

    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).contiguous()
    try:
        raw = flat.numpy().tobytes()
    except (ImportError, RuntimeError):  # a torch without numpy: slower, same within one venv
        raw = repr(flat.tolist()).encode()
    digest = hashlib.sha256(raw).digest()
    mine = torch.tensor(struct.unpack("<4q", digest), dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    identical = all(torch.equal(g, gathered[0]) for g in gathered)
    if rank == 0:
        torch.save(flat, os.path.join(args.out, "params.pt"))

    from torch._dynamo.utils import counters

    cache_counters = {f"{group}.{key}": int(counters[group][key]) for group, key in CACHE_COUNTERS}
    cc_stats: Any = None
    if "compiler_collectives" in sys.modules:
        cc_stats = sys.modules["compiler_collectives"].stats()
    result = {
        "rank": rank,
        "world": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "group_rank": int(os.environ.get("GROUP_RANK", "0")),
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "compiler_collectives_on": bool(torch._dynamo.config.enable_compiler_collectives),
        "compile_once_env": os.environ.get(COMPILE_ONCE_ENV),
        "wall_s": walls[0],
        "cpu_s": sum(cpus[0]),
        "cpu_self_s": cpus[0][0],
        "cpu_children_s": cpus[0][1],
        "step_walls_s": walls,
        "step_cpus_s": [sum(c) for c in cpus],
        "params_sha256": digest.hex(),
        "params_identical_across_ranks": identical,
        "cache_counters": cache_counters,
        "cc_stats": cc_stats,
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    faulthandler.cancel_dump_traceback_later()
    print(
        f"[rank {rank}] first step: wall {walls[0]:.2f}s, CPU {cpus[0][0]:.2f}s + children {cpus[0][1]:.2f}s; "
        f"later steps {', '.join(f'{w:.3f}s' for w in walls[1:])}; params identical across ranks: {identical}",
        flush=True,
    )
    dist.destroy_process_group()


# ------------------------------------------------------- processes, reaping


# Starting the agents and ending them with their trees is cc_launch's (outside the package),
# imported inside the driver's functions: the ranks (--worker) run this file too, and import
# nothing before their environment is set.
ENDING_MARK = "[bench] ending the job"


def _launch(
    agents: list[tuple[list[str], dict[str, str]]], log_path: str, timeout: float
) -> tuple[list[int], bool, float]:
    """Start every agent (command, env), output to ``log_path``; wait for all within ``timeout``.

    Returns each agent's exit status (negative: ended by that signal), whether the
    timeout struck, and the seconds taken. When one agent fails, the others
    get 30 s to end on their own (a peer waiting on a dead rank would wait out
    its collective timeout) before they are ended too, with every process under them."""
    import cc_launch as launch

    started = time.monotonic()
    with open(log_path, "ab") as log, launch.Agents() as running:
        for i, (cmd, env) in enumerate(agents):
            log.write(f"[bench] agent {i}: {' '.join(cmd)}\n".encode())
            log.flush()
            running.start(cmd, env=env, log=log)
        stopped = launch.wait_all(lambda: [p.poll() for p in running.procs], started + timeout, 30.0)
        if stopped is not None:
            why = f"timed out after {timeout:.0f}s" if stopped == "timed out" else "an agent failed 30s ago"
            log.write(f"{ENDING_MARK}: {why}\n".encode())
            log.flush()
    rcs = [p.returncode for p in running.procs]
    return rcs, stopped == "timed out", time.monotonic() - started


def _tail(path: str, lines: int = 30) -> str:
    """The log's last lines before the script ended the job (after that: torchrun's own unwinding)."""
    try:
        with open(path, errors="replace") as f:
            text = f.readlines()
    except OSError as e:
        return f"(no log: {e})"
    ends = [i for i, line in enumerate(text) if line.startswith(ENDING_MARK)]
    if ends:
        text = text[: ends[-1] + 1]
    return "".join(text[-lines:])


# ------------------------------------------------------------------ a run


def _base_env(args: argparse.Namespace, setting: str, set_var: bool) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(SCRUBBED_PREFIXES) and k not in SCRUBBED_NAMES and not k.startswith("PET_")
    }
    env.update(
        OMP_NUM_THREADS="1",
        TORCHINDUCTOR_COMPILE_THREADS="1",
        TORCH_COMPILER_COLLECTIVES="1",
        COMPILER_COLLECTIVES_GUARDS="1",
        # Ranks that load a peer's artifact wait for its compile: the service's
        # collectives must allow for that, like the run itself.
        COMPILER_COLLECTIVES_TIMEOUT=str(float(args.timeout)),
        PYTHONUNBUFFERED="1",
    )
    if getattr(args, "tmpdir", None):
        env["TMPDIR"] = args.tmpdir
    if setting == "off" and set_var:
        env[COMPILE_ONCE_ENV] = "0"
    return env


def _agent_cmd(args: argparse.Namespace, nnodes: int, node_rank: int, nproc: int, port: int, out: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "static",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--max-restarts",
        "0",
        os.path.abspath(__file__),
        "--worker",
        "--out",
        out,
        "--blocks",
        str(args.blocks),
        "--width",
        str(args.width),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--timeout",
        str(args.timeout),
        "--deadline",  # when the driver ends this job, as a time.time()
        f"{time.time() + args.timeout:.1f}",
    ]


def _read_ranks(out: str, world: int) -> tuple[list[dict[str, Any]], str | None]:
    ranks = []
    for r in range(world):
        try:
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError) as e:
            return [], f"rank {r} wrote no result ({e})"
    return ranks, None


def _cache_env(cache_dir: str) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton")}


def _job(args: argparse.Namespace, case: Case, base: dict[str, str], cache: str, out: str) -> list[Any]:
    """The torchrun agents of one job of ``case`` over ``cache``: (command, env) each."""
    from cc_launch import free_port

    port = free_port()
    agents = []
    for node_rank, nproc in enumerate(case.agents):
        env = dict(base)
        if case.cache == "shared":
            env.update(_cache_env(cache))
        elif case.cache == "per-rank":
            env["BENCH_CACHE_PER_RANK"] = cache
        else:
            env.update(_cache_env(os.path.join(cache, f"agent{node_rank}")))
        agents.append((_agent_cmd(args, len(case.agents), node_rank, nproc, port, out), env))
    return agents


def _service_off(base: dict[str, str]) -> dict[str, str]:
    """``base`` without the service: none of its variables set (one would import and install
    it), COMPILER_COLLECTIVES_COMPILE_ONCE=0 (an off value: it installs nothing)."""
    env = {k: v for k, v in base.items() if not k.startswith("COMPILER_COLLECTIVES_")}
    env.pop("TORCH_COMPILER_COLLECTIVES", None)
    env[COMPILE_ONCE_ENV] = "0"
    return env


def truncate_entries(cache: str) -> int:
    """Cut every file under ``cache``'s aotautograd/ and fxgraph/ to half its size; how many."""
    count = 0
    for level in ("aotautograd", "fxgraph"):
        for d, _, files in os.walk(os.path.join(cache, level)):
            for f in files:
                path = os.path.join(d, f)
                os.truncate(path, os.path.getsize(path) // 2)
                count += 1
    return count


def _warm_up(
    case: Case, args: argparse.Namespace, base: dict[str, str], cache: str, rundir: str, log_path: str
) -> tuple[float, str | None]:
    """Untimed: ready ``case``'s dirs as its row says. (seconds, None) or (seconds, why it failed)."""
    from cc_launch import free_port

    out = os.path.join(rundir, "warmup")
    os.makedirs(out, exist_ok=True)
    if case.warm_rank0:
        # The same 2-rank job over one dir fills <cache>/rank0, the dir rank 0 uses. (Before
        # issue 29 a 1-rank run would not do: AOTAutograd's key held the backward lowering the
        # service sets at 2+ ranks. The warm1-empty row measures that case now.)
        agents = [(_agent_cmd(args, 1, 0, 2, free_port(), out), dict(base, **_cache_env(os.path.join(cache, "rank0"))))]
    elif case.warm == "1rank":
        agents = [(_agent_cmd(args, 1, 0, 1, free_port(), out), dict(base, **_cache_env(cache)))]
    elif case.warm == "1rank-rank0":
        agents = [(_agent_cmd(args, 1, 0, 1, free_port(), out), dict(base, **_cache_env(os.path.join(cache, "rank0"))))]
    elif case.warm == "service-off":
        agents = _job(args, case, _service_off(base), cache, out)
    elif case.warm == "truncated":
        agents = _job(args, case, base, cache, out)
    else:
        return 0.0, None
    rcs, timed_out, secs = _launch(agents, log_path, args.timeout)
    if timed_out or any(rc != 0 for rc in rcs):
        return secs, "warm-up run " + ("timed out" if timed_out else f"failed (exit {rcs})")
    if case.warm == "truncated" and truncate_entries(cache) == 0:
        return secs, "warm-up run left no entry to truncate"
    return secs, None


def _job_result(ranks: list[dict[str, Any]], out: str) -> dict[str, Any]:
    states: dict[str, int] = {}
    for r in ranks:
        for record in (r["cc_stats"] or {}).get("compile_once", []):
            states[record["state"]] = states.get(record["state"], 0) + 1
    return {
        "wall_s": max(r["wall_s"] for r in ranks),
        "cpu_s": sum(r["cpu_s"] for r in ranks),
        "params_sha256": ranks[0]["params_sha256"],
        "params_path": os.path.join(out, "params.pt"),
        "ranks_identical": all(r["params_identical_across_ranks"] for r in ranks),
        "refused": sum(int((r["cc_stats"] or {}).get("once_refused", 0)) for r in ranks),
        "once_states": states,
    }


def run_once(case: Case, setting: str, rep: int, args: argparse.Namespace, root: str, set_var: bool) -> dict[str, Any]:
    rundir = os.path.join(root, case.name, setting, f"rep{rep}")
    cache = os.path.join(rundir, "cache")
    out = os.path.join(rundir, "out")
    log_path = os.path.join(rundir, "log.txt")
    os.makedirs(out, exist_ok=True)
    base = _base_env(args, setting, set_var)
    result: dict[str, Any] = {"case": case.name, "setting": setting, "rep": rep, "ok": False, "log": log_path}

    result["warmup_s"], error = _warm_up(case, args, base, cache, rundir, log_path)
    if error:
        result["error"] = error
        result["log_tail"] = _tail(log_path)
        return result

    # Every job of the case at once, over the same dirs, each with its own port and results.
    outs = [out] if case.jobs == 1 else [os.path.join(out, f"job{j}") for j in range(case.jobs)]
    agents = []
    for job_out in outs:
        os.makedirs(job_out, exist_ok=True)
        agents += _job(args, case, base, cache, job_out)
    rcs, timed_out, secs = _launch(agents, log_path, args.timeout)
    result["run_s"] = secs
    if timed_out or any(rc != 0 for rc in rcs):
        why = f"timed out after {args.timeout:.0f}s" if timed_out else f"exit status {rcs}"
        result["error"] = f"failed: {why}"
        result["log_tail"] = _tail(log_path)
        return result
    jobs, ranks = [], []
    for job_out in outs:
        job_ranks, error = _read_ranks(job_out, case.world)
        if error:
            result["error"] = error
            result["log_tail"] = _tail(log_path)
            return result
        jobs.append(_job_result(job_ranks, job_out))
        ranks += job_ranks
    result.update(
        ok=True,
        ranks=ranks,
        jobs=jobs,
        wall_s=max(j["wall_s"] for j in jobs),
        cpu_s=sum(j["cpu_s"] for j in jobs),
        params_sha256=jobs[0]["params_sha256"],
        params_path=jobs[0]["params_path"],
        ranks_identical=all(j["ranks_identical"] for j in jobs),
        jobs_identical=len({j["params_sha256"] for j in jobs}) == 1,
        service_on=all(r["compiler_collectives_on"] for r in ranks),
        refused=sum(j["refused"] for j in jobs),
    )
    if not args.keep:
        shutil.rmtree(cache, ignore_errors=True)
    return result


# ------------------------------------------------------------- the report


def _max_abs_diff(path_a: str, path_b: str) -> str:
    try:
        import torch

        a, b = torch.load(path_a), torch.load(path_b)
        if a.shape != b.shape:
            return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        return f"max |diff| {(a - b).abs().max().item():.3g}"
    except Exception as e:  # noqa: BLE001 (a report detail; never fail the report for it)
        return f"not compared: {e}"


def summarize(runs: list[dict[str, Any]], cases: list[Case]) -> list[dict[str, Any]]:
    rows = []
    baseline: dict[str, tuple[float, float]] = {}
    for setting in SETTINGS:
        ok = [r for r in runs if r["case"] == BASELINE and r["setting"] == setting and r["ok"]]
        if ok:
            baseline[setting] = (statistics.median(r["wall_s"] for r in ok), statistics.median(r["cpu_s"] for r in ok))
    for case in cases:
        reference = next((r for r in runs if r["case"] == case.name and r["setting"] == "off" and r["ok"]), None)
        for setting in SETTINGS:
            mine = [r for r in runs if r["case"] == case.name and r["setting"] == setting]
            ok = [r for r in mine if r["ok"]]
            row: dict[str, Any] = {
                "case": case.name,
                "what": case.what,
                "setting": setting,
                "ranks": case.world,
                "runs": len(mine),
                "failed": len(mine) - len(ok),
                "errors": [
                    {"rep": r["rep"], "error": r["error"], "log_tail": r["log_tail"]} for r in mine if not r["ok"]
                ],
            }
            rows.append(row)
            if not ok:
                continue
            row["wall_s"] = statistics.median(r["wall_s"] for r in ok)
            row["cpu_s"] = statistics.median(r["cpu_s"] for r in ok)
            n = len(ok[0]["ranks"])  # every job's ranks, in job order
            row["rank_cpu_s"] = [statistics.median(r["ranks"][i]["cpu_s"] for r in ok) for i in range(n)]
            row["rank_wall_s"] = [statistics.median(r["ranks"][i]["wall_s"] for r in ok) for i in range(n)]
            row["jobs"] = case.jobs
            row["job_cpu_s"] = [statistics.median(r["jobs"][j]["cpu_s"] for r in ok) for j in range(case.jobs)]
            row["refused"] = [r["refused"] for r in ok]  # per run, summed over its ranks
            row["once_states"] = [j["once_states"] for j in ok[-1]["jobs"]]
            if setting in baseline:
                b_wall, b_cpu = baseline[setting]
                row["wall_ratio"] = row["wall_s"] / b_wall
                row["cpu_ratio"] = row["cpu_s"] / b_cpu
                row["rank_cpu_ratio"] = [c / b_cpu for c in row["rank_cpu_s"]]
            last = ok[-1]["ranks"]
            row["cache_counters"] = {k: sum(r["cache_counters"][k] for r in last) for k in last[0]["cache_counters"]}
            row["service_on"] = all(r["service_on"] for r in ok)
            problems = []
            if not all(r["ranks_identical"] for r in ok):
                problems.append("ranks differ")
            if not all(r["jobs_identical"] for r in ok):
                problems.append("the jobs' parameters differ")
            if reference is None:
                problems.append("no COMPILE_ONCE=0 run to compare")
            else:
                for r in ok:
                    if r["params_sha256"] != reference["params_sha256"]:
                        diff = _max_abs_diff(r["params_path"], reference["params_path"])
                        problems.append(f"rep {r['rep']} differs from COMPILE_ONCE=0 ({diff})")
            row["params_identical"] = not problems
            row["params_problems"] = problems
            row["ranks_detail"] = [r["ranks"] for r in ok]
    _check_cache_states(rows)
    return rows


def _check_cache_states(rows: list[dict[str, Any]]) -> None:
    """The cache states rows: each job's CPU against its floor (one cold compile, a warm start
    for every other rank), and, with compile once on, the row's target."""
    by = {(r["case"], r["setting"]): r for r in rows if "cpu_s" in r}
    for row in rows:
        case = CASES[row["case"]]
        if not case.cache_states or "cpu_s" not in row:
            continue
        setting = row["setting"]
        cold, warm, alone = (by.get((name, setting)) for name in (BASELINE, WARM_START, ALONE))
        if cold is not None:
            row["rank_cpu_cold_ratio"] = [c / cold["cpu_s"] for c in row["rank_cpu_s"]]
            if warm is not None:
                row["floor_cpu_s"] = cold["cpu_s"] + (case.world - 1) * warm["cpu_s"]
                row["job_cpu_floor_ratio"] = [c / row["floor_cpu_s"] for c in row["job_cpu_s"]]
        if setting != "default" or not case.target:
            continue
        checks: list[tuple[str, bool | None]] = []
        none_refused = ("0 refused", not any(row["refused"]))
        if case.name in ("warm1-empty", "warm-off"):
            ratios = row.get("rank_cpu_cold_ratio")
            checks.append(("each rank ≤ 0.35× cold", None if ratios is None else max(ratios) <= 0.35))
        if case.name == "warm1-empty":
            off = by.get((case.name, "off"))
            ratio = None if off is None else row["rank_cpu_s"][0] / off["rank_cpu_s"][0]
            row["warm_rank_vs_off"] = ratio
            checks.append(("warm rank ≤ 1.1× off", None if ratio is None else ratio <= 1.1))
        if case.name == "warm-off":
            checks.append(none_refused)
        if case.name == "two-jobs":
            ratios = None if alone is None else [c / alone["cpu_s"] for c in row["job_cpu_s"]]
            row["job_cpu_alone_ratio"] = ratios
            checks += [("each job ≤ 1.1× alone", None if ratios is None else max(ratios) <= 1.1), none_refused]
        if case.name == "truncated":
            ratio = None if alone is None else row["cpu_s"] / alone["cpu_s"]
            row["cpu_cold_job_ratio"] = ratio
            checks += [("finishes", row["failed"] == 0), ("≤ 1.1× a cold job", None if ratio is None else ratio <= 1.1)]
        row["target"] = case.target
        row["target_checks"] = checks


def _fmt(row: dict[str, Any], key: str, spec: str, suffix: str = "") -> str:
    return f"{row[key]:{spec}}{suffix}" if key in row else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    """The first step's table: the 1-rank baseline and the cases outside the cache states table."""
    rows = [r for r in rows if r["case"] == BASELINE or not CASES[r["case"]].cache_states]
    print(
        "| case | setting | ranks | wall, slowest rank (s) | wall / 1-rank | CPU, summed (s) | CPU / 1-rank "
        "| CPU per rank / 1-rank | cache hit/miss (fx; aot) | params identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        label = SETTING_LABEL[row["setting"]]
        if "wall_s" not in row:
            print(f"| {row['case']} | {label} | {row['ranks']} | FAILED ({row['errors'][0]['error']}) | | | | | | |")
            continue
        per_rank = "-"
        if row["case"] == "warm-cold" and "rank_cpu_ratio" in row:
            per_rank = ", ".join(f"r{i} {x:.2f}x" for i, x in enumerate(row["rank_cpu_ratio"]))
        c = row["cache_counters"]
        cache = (
            f"{c['inductor.fxgraph_cache_hit']}/{c['inductor.fxgraph_cache_miss']}; "
            f"{c['aot_autograd.autograd_cache_hit']}/{c['aot_autograd.autograd_cache_miss']}"
        )
        params = "yes" if row["params_identical"] else "no"
        if row["failed"]:
            params += f" ({row['failed']} of {row['runs']} runs failed)"
        print(
            f"| {row['case']} | {label} | {row['ranks']} | {_fmt(row, 'wall_s', '.2f')} | "
            f"{_fmt(row, 'wall_ratio', '.2f', 'x')} | {_fmt(row, 'cpu_s', '.2f')} | "
            f"{_fmt(row, 'cpu_ratio', '.2f', 'x')} | {per_rank} | {cache} | {params} |"
        )
    _print_problems(rows)


def _print_problems(rows: list[dict[str, Any]]) -> None:
    """Under a table: each row's parameter problems, a service that was off, failed runs' log tails."""
    for row in rows:
        for problem in row.get("params_problems", []):
            print(f"\n{row['case']} {SETTING_LABEL[row['setting']]}: parameters: {problem}")
        if not row.get("service_on", True):
            print(f"\n{row['case']} {SETTING_LABEL[row['setting']]}: compiler collectives were OFF on some rank")
        for err in row["errors"]:
            print(f"\n{row['case']} {SETTING_LABEL[row['setting']]} rep {err['rep']}: {err['error']}; log tail:")
            print("    " + err["log_tail"].rstrip().replace("\n", "\n    "))


REFERENCE_ROLE = {BASELINE: "floor: the cold compile", WARM_START: "floor: a warm start", ALONE: "the job alone"}


def _ratios(values: list[float] | None, prefix: str) -> str:
    if values is None:
        return "-"
    return ", ".join(f"{prefix}{i} {x:.2f}x" for i, x in enumerate(values)) if len(values) > 1 else f"{values[0]:.2f}x"


def _states_text(states: list[dict[str, int]]) -> str:
    parts = []
    for j, counts in enumerate(states):
        text = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none"
        parts.append(f"job {j}: {text}" if len(states) > 1 else text)
    return "; ".join(parts)


def print_cache_states(rows: list[dict[str, Any]]) -> None:
    """The cache states table (issue 29): its floors, then each state side by side with
    COMPILE_ONCE=0, each against its floor and, compile once on, its target."""
    rows = [r for r in rows if CASES[r["case"]].cache_states]
    if not any(r["case"] not in REFERENCE_ROLE for r in rows):
        return
    print("Cache states: CPU is the first step's, summed over a job's ranks; floor = a 1-rank cold compile")
    print("+ a 1-rank warm start for every other rank; per-rank ratios are to the 1-rank cold compile.")
    print()
    print(
        "| case | setting | wall, slowest rank (s) | CPU per job (s) | CPU / floor | each rank's CPU / cold compile "
        "| refused | compile once, all ranks | params identical | target | met |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        label = SETTING_LABEL[row["setting"]]
        if "wall_s" not in row:
            print(f"| {row['case']} | {label} | FAILED ({row['errors'][0]['error']}) | | | | | | | | |")
            continue
        case = CASES[row["case"]]
        several = row["ranks"] > 1 or row["jobs"] > 1  # a 1-rank row is a floor itself
        per_rank = _ratios(row.get("rank_cpu_cold_ratio"), "r") if several else "-"
        to_floor = _ratios(row.get("job_cpu_floor_ratio"), "job ") if several else "-"
        params = "yes" if row["params_identical"] else "no"
        if row["failed"]:
            params += f" ({row['failed']} of {row['runs']} runs failed)"
        target = REFERENCE_ROLE.get(row["case"], case.target if row["setting"] == "default" else "")
        met = "-"
        if row.get("target_checks"):
            missed = [what for what, ok in row["target_checks"] if ok is False]
            unknown = [what for what, ok in row["target_checks"] if ok is None]
            met = "no: " + "; ".join(missed) if missed else "?: " + "; ".join(unknown) if unknown else "yes"
        job_cpu = ", ".join(f"{c:.2f}" for c in row["job_cpu_s"])
        refused = ", ".join(map(str, row["refused"]))
        print(
            f"| {row['case']} | {label} | {row['wall_s']:.2f} | {job_cpu} | "
            f"{to_floor} | {per_rank} | "
            f"{refused} | {_states_text(row['once_states'])} | {params} | {target} | {met} |"
        )
    for row in rows:
        extra = []
        if row.get("warm_rank_vs_off") is not None:
            extra.append(f"warm rank's CPU / its CPU with COMPILE_ONCE=0: {row['warm_rank_vs_off']:.2f}x")
        if row.get("job_cpu_alone_ratio") is not None:
            extra.append("each job's CPU / alone: " + ", ".join(f"{x:.2f}x" for x in row["job_cpu_alone_ratio"]))
        if row.get("cpu_cold_job_ratio") is not None:
            extra.append(f"CPU / a cold job (2shared): {row['cpu_cold_job_ratio']:.2f}x")
        if extra:
            print(f"\n{row['case']} {SETTING_LABEL[row['setting']]}: " + "; ".join(extra))
    for setting in SETTINGS:
        floors = {
            r["case"]: r["cpu_s"]
            for r in rows
            if r["setting"] == setting and r["case"] in REFERENCE_ROLE and "cpu_s" in r
        }
        if BASELINE in floors and WARM_START in floors:
            cold, warm = floors[BASELINE], floors[WARM_START]
            print(
                f"\nfloors, {SETTING_LABEL[setting]}: a cold compile {cold:.2f} CPU-s, a warm start "
                f"{warm:.2f} CPU-s; a 2-rank job's floor {cold + warm:.2f} CPU-s"
            )
    _print_problems(rows)


OVERHEAD_PARTS = (("exchange_s", "exchanges"), ("install_s", "files"), ("transfer_s", "bytes"), ("waited_s", "wait"))


def once_overhead(runs: list[dict[str, Any]], cases: list[Case]) -> list[dict[str, Any]]:
    """Per multi-rank case (compile once on), rank and state: medians over its graphs and runs."""
    rows = []
    for case in cases:
        if case.world < 2 or case.cache_states:
            continue
        samples: dict[tuple[int, str], list[dict[str, float]]] = {}
        graphs: dict[tuple[int, int], list[dict[str, float]]] = {}  # (run, seq): every rank's
        runs_seen: list[dict[str, Any]] = []
        for run in runs:
            if run["case"] != case.name or run["setting"] != "default" or not run["ok"]:
                continue
            per_rank = {r["rank"]: (r["cc_stats"] or {}).get("compile_once", []) for r in run["ranks"]}
            posted = {
                (rank, rec["seq"]): rec["posted_at"]
                for rank, recs in per_rank.items()
                for rec in recs
                if rec.get("posted_at") is not None
            }
            for rank, recs in per_rank.items():
                for rec in recs:
                    if "exchange_s" not in rec:
                        continue  # an installed package that does not time its parts
                    sample = {key: float(rec[key]) for key, _ in OVERHEAD_PARTS}
                    source_post = posted.get((rec["source"], rec["seq"]))
                    latency = 0.0
                    if rec.get("wait_ended_at") is not None and source_post is not None:
                        latency = max(0.0, rec["wait_ended_at"] - source_post)
                    sample["latency_s"] = latency
                    sample["overhead_s"] = sample["exchange_s"] + sample["install_s"] + latency
                    sample["rest_s"] = float(rec["span_s"]) - sum(sample[key] for key, _ in OVERHEAD_PARTS)
                    sample["bytes"] = float(rec["artifact_bytes"])
                    samples.setdefault((rank, rec["state"]), []).append(sample)
                    graphs.setdefault((len(runs_seen), rec["seq"]), []).append(sample)
            runs_seen.append(run)
        # Each exchange also waits for the last rank to reach it: the rank of a graph that waited
        # least (its least overhead) bounds from above what the exchanges cost by themselves.
        least = [min(ranks, key=lambda g: g["overhead_s"]) for ranks in graphs.values() if len(ranks) > 1]
        groups = [((rank, state), got) for (rank, state), got in sorted(samples.items())]
        groups += [((-1, "least of the ranks"), least)] if least else []
        for (rank, state), got in groups:
            row: dict[str, Any] = {"case": case.name, "rank": rank if rank >= 0 else "-", "state": state}
            row["graphs"] = len(got)
            for key in got[0]:
                row[key] = statistics.median(g[key] for g in got)
            rows.append(row)
    return rows


def print_once_overhead(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print("Compile once's overhead per graph (compile once on): medians over graphs and runs, per rank and state;")
    print("overhead = exchanges + files + wait latency after the source's post (outside the compile and the bytes);")
    print("each exchange includes waiting for the last rank to reach it: 'least of the ranks' is, per graph, the")
    print("rank with the least overhead (an upper bound on what compile once's own steps cost).")
    print()
    print(
        "| case | rank | state | graphs | exchanges (ms) | files (ms) | bytes (ms) | wait (ms) | wait latency (ms) "
        "| overhead (ms) | rest: compile or load (s) | artifact (KiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['rank']} | {r['state']} | {r['graphs']} | {r['exchange_s'] * 1e3:.1f} | "
            f"{r['install_s'] * 1e3:.1f} | {r['transfer_s'] * 1e3:.1f} | {r['waited_s'] * 1e3:.0f} | "
            f"{r['latency_s'] * 1e3:.1f} | {r['overhead_s'] * 1e3:.1f} | {r['rest_s']:.2f} | {r['bytes'] / 1024:.0f} |"
        )


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        try:
            with open("/proc/loadavg") as f:
                return "load average " + " ".join(f.read().split()[:3])
        except OSError:
            return "(load unknown)"


def _feature_known(args: argparse.Namespace) -> tuple[bool, str]:
    """Whether the installed compiler_collectives accepts COMPILER_COLLECTIVES_COMPILE_ONCE.

    Asked in a child with none of our variables set (an unknown one would fail the import)."""
    env = _base_env(args, "default", False)
    for k in ("TORCH_COMPILER_COLLECTIVES", "COMPILER_COLLECTIVES_GUARDS", "COMPILER_COLLECTIVES_TIMEOUT"):
        env.pop(k)
    code = f"from compiler_collectives import config; print({COMPILE_ONCE_ENV!r} in config.known_variables())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"could not ask compiler_collectives ({e}); the variable is not set"
    answer = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    if answer == ["True"]:
        return True, f"{COMPILE_ONCE_ENV} is known: COMPILE_ONCE=0 sets it to 0, default leaves it unset"
    if answer == ["False"]:
        return False, (
            f"{COMPILE_ONCE_ENV} is not known to the installed compiler_collectives (feature absent): "
            "neither setting sets it, both should measure the same"
        )
    return False, f"could not ask compiler_collectives (exit {done.returncode}): {done.stderr.strip()[-300:]}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case and setting, interleaved; medians")
    parser.add_argument(
        "--json", action="store_true", help="print the results as JSON on stdout (the table goes to stderr)"
    )
    parser.add_argument("--blocks", type=int, default=6, help="residual MLP blocks")
    parser.add_argument("--width", type=int, default=256, help="model width (hidden: 4 x width)")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=3, help="training steps (the first is measured)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds one torchrun job may take (the warm-cold warm-up gets its own)",
    )
    parser.add_argument("--workdir", default=None, help="where runs write caches, logs, results (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and every run's cache")
    parser.add_argument("--no-prime", action="store_true", help="skip the untimed 1-rank run made first")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names or args.repeat < 1 or args.steps < 1:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}" if unknown else "nothing to run")
    if BASELINE not in names:
        names.insert(0, BASELINE)  # every ratio is to it
    names += [need for n in list(names) for need in CASES[n].needs]  # the floors and references it is held to
    cases = [CASES[n] for n in CASES if n in names]

    def log(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    root = args.workdir or tempfile.mkdtemp(prefix="bench_compile_once_")
    os.makedirs(root, exist_ok=True)
    # Inductor keeps its precompiled headers under TMPDIR whatever the cache dir (4-5 CPU-s to
    # build): a fresh TMPDIR for this invocation, built by the priming run, untimed.
    args.tmpdir = tempfile.mkdtemp(prefix="tmp-", dir=root)
    load_start = _uptime()
    log(f"work dir {root}; TMPDIR {args.tmpdir}; {load_start}")
    set_var, feature_note = _feature_known(args)
    log(feature_note)
    runs: list[dict[str, Any]] = []
    if not args.no_prime:
        # The first compile of a session also reads torch's inductor modules, gcc and
        # its headers from disk, and builds the precompiled header in the fresh TMPDIR:
        # pay that untimed, not in whichever run comes first.
        log("priming: an untimed 1-rank run")
        prime = run_once(CASES[BASELINE], "default", -1, args, os.path.join(root, "prime"), set_var)
        log("  ok" if prime["ok"] else f"  {prime['error']} (log: {prime['log']}); going on")
    for rep in range(args.repeat):
        for case in cases:
            # Alternate which setting goes first, so neither always runs after the other.
            for setting in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
                log(f"rep {rep + 1}/{args.repeat} {case.name} {SETTING_LABEL[setting]}: running")
                r = run_once(case, setting, rep, args, root, set_var)
                runs.append(r)
                if r["ok"]:
                    log(f"  ok: wall {r['wall_s']:.2f}s (slowest rank), CPU {r['cpu_s']:.2f}s (summed)")
                else:
                    log(f"  {r['error']} (log: {r['log']})")
    load_end = _uptime()
    rows = summarize(runs, cases)
    overhead = once_overhead(runs, cases)
    header = {
        "model": f"{args.blocks} residual MLP blocks, width {args.width}, batch {args.batch}/rank, {args.steps} steps",
        "compile_once_variable": feature_note,
        "compile_once_variable_set": set_var,
        "load_start": load_start,
        "load_end": load_end,
        "repeat": args.repeat,
        "python": sys.executable,
    }
    # With --json the table still comes, on stderr with the progress lines.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        print(f"bench_compile_once: {header['model']}; median of {args.repeat} run(s) per row")
        print(
            "torch CPU, gloo, inductor, 1 thread per rank, TORCH_COMPILER_COLLECTIVES=1 COMPILER_COLLECTIVES_GUARDS=1"
        )
        print(feature_note)
        print(f"load at start: {load_start}")
        print()
        if any(not c.cache_states for c in cases):
            print_table(rows)
            print()
        if overhead:
            print_once_overhead(overhead)
            print()
        if any(c.cache_states and c.name not in REFERENCE_ROLE for c in cases):
            print_cache_states(rows)
            print()
        print(f"load at end: {load_end}")
    if args.json:
        print(json.dumps({**header, "rows": rows, "once_overhead": overhead}, indent=1, default=str))
    all_ok = all(r["ok"] for r in runs)
    if all_ok and not args.keep and args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    else:
        log(f"kept {root} (logs: <case>/<setting>/rep<N>/log.txt)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
