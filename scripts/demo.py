"""The demo: what the service is for, in one command (``scripts/dev demo``).

The story it tells
------------------
Every rank trains the same tiny transformer language model under
``DistributedDataParallel`` (gloo, CPU) and ``torch.compile``. The ranks see
*different sequence lengths*, as they do with per-rank length bucketing or
sequence packing:

* at step 0 every rank is in the same length bucket (32 tokens);
* then the ranks leave that bucket one after another (rank 1 first, rank 2 a
  few steps later, ...), while rank 0 stays in it;
* the last rank's data does not divide evenly, so its final batch is short
  (``drop_last=False``).

So rank 1 recompiles at a step where rank 0 does not. The default run shows:

1. **The hazard** (``compiler-only``: compiler collectives without guard
   collectives). Every compile is a collective, so rank 1's lone recompile
   waits for peers that never join it, while rank 0 waits for rank 1 in DDP's
   all-reduce: the job hangs. (Torch's own compiler collective crashes on
   gloo/CPU before it gets that far, so the demo uses ours.) Our collective
   timeout, short here, turns the hang into ``CollectiveTimeoutError``; the
   demo shows where each rank was stuck. This run is expected to fail.
2. **The cure** (``on``: ``compiler_collectives.enable(guards=True)``). The
   guard collective notices the first rank whose guards miss and every rank
   recompiles at that step; the compiler collective makes the differing dim
   dynamic everywhere. It finishes, with the same decisions on every rank.
3. **The cost**, per rank, beside the run's total: guard collectives (µs per
   call), exchanges (compiler collectives and program audits), and forced
   recompiles (recompiles a rank did only because a peer's guards missed).
4. **Compile once** (inductor; ``--compile-once`` or ``--backend inductor``):
   CPU-seconds spent compiling, the C++ compiler's processes included, per rank
   and in total, with ``COMPILER_COLLECTIVES_COMPILE_ONCE=0`` and with the
   default, each in a fresh inductor cache.

``--runs off`` adds the run without the service: it finishes here, with
different graphs on different ranks, only because the demo's compiled graph
holds no collective and torch's own compiler collectives are off.

Run it
------
``scripts/dev demo`` (or ``python scripts/demo.py``; ``--help`` for the
options) launches the ranks itself; under ``torchrun --nproc-per-node 2
scripts/demo.py`` each process runs its own rank and rank 0 prints the results
(the hazard is left out there: nothing could stop its stuck ranks but the
timeouts).

How to read it
--------------
``train()`` is the part to copy: it is an ordinary DDP training loop plus one
call, ``compiler_collectives.enable(guards=True)``. Everything else here
(launching rank processes, the timeouts, measuring, the report) is scaffolding.

Only the ``format_*`` functions build text, and ``cmd_demo`` prints it. This is
not part of the library: it is an example of using it, kept out of the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import logging
import math
import multiprocessing as mp
import os
import queue as queue_mod
import re
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import compiler_collectives
from compiler_collectives.instrument import timing

try:
    import resource
except ImportError:  # not on Windows: CPU time of this process only
    resource = None  # type: ignore[assignment]

log = logging.getLogger("compiler_collectives.demo")


# ----------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Run:
    """One way of running the training; each run gets fresh rank processes."""

    name: str
    use_service: bool
    guards: bool
    description: str
    must_finish: bool = True  # False: getting stuck is what this run demonstrates
    expect_stuck: bool = False  # the hazard: reported as stuck, with a short collective timeout
    # Part 4: inductor, cfg.compile_steps steps, a fresh inductor cache shared
    # by the run's ranks, one compile thread per rank; compile_once sets
    # COMPILER_COLLECTIVES_COMPILE_ONCE (None: leave it alone).
    compile_part: bool = False
    compile_once: bool | None = None


RUNS: dict[str, Run] = {
    "compiler-only": Run(
        "compiler-only",
        True,
        False,
        "the hazard: compiler collectives without guard collectives (expected to get stuck)",
        must_finish=False,
        expect_stuck=True,
    ),
    "on": Run("on", True, True, "the cure: compiler + guard collectives (compiler_collectives.enable(guards=True))"),
    "off": Run(
        "off",
        False,
        False,
        "without the service (torch's default: each rank decides alone; finishes here only because "
        "the demo's graph holds no collective and torch's compiler collectives are off)",
    ),
    "compile-each": Run(
        "compile-each",
        True,
        True,
        "inductor with COMPILER_COLLECTIVES_COMPILE_ONCE=0: every rank compiles every graph",
        compile_part=True,
        compile_once=False,
    ),
    "compile-once": Run(
        "compile-once",
        True,
        True,
        "inductor with compile once (the default): one rank compiles each graph, the others load it",
        compile_part=True,
        compile_once=True,
    ),
}

DEFAULT_RUNS = ("compiler-only", "on")
COMPILE_RUNS = ("compile-each", "compile-once")
COMPILE_ONCE_ENV = "COMPILER_COLLECTIVES_COMPILE_ONCE"


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    nproc: int = 2
    steps: int = 30
    backend: str = "aot_eager"
    timeout: float = 120.0
    hazard_timeout: float = 10.0
    compile_steps: int = 1
    compile_cache: str = "per-rank"  # part 4: one dir per rank (as hosts or containers have), or "shared"
    runs: tuple[str, ...] = DEFAULT_RUNS
    batch_size: int = 4
    base_length: int = 32
    vocab: int = 256
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    lr: float = 3e-3
    seed: int = 0
    log_every: int = 5


def run_config(run: Run, cfg: DemoConfig) -> DemoConfig:
    """The configuration ``run`` trains with: part 4 compiles with inductor, for a few steps."""
    if run.compile_part:
        return dataclasses.replace(cfg, backend="inductor", steps=cfg.compile_steps)
    return cfg


def collective_timeout(run: Run, cfg: DemoConfig) -> float:
    """Seconds our collectives wait for the slowest rank: short in the hazard run."""
    return min(cfg.hazard_timeout, cfg.timeout) if run.expect_stuck else cfg.timeout


# -------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A small GPT-style language model; ``forward`` returns the next-token loss."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, max_length: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_length, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------- data


def divergence_step(rank: int, world: int, steps: int) -> int:
    """The step at which ``rank`` leaves the common length bucket (rank 0: never)."""
    if rank == 0:
        return steps  # never
    # One rank after another, all within the first half of training.
    return rank * max(1, steps // (2 * world))


def sequence_length(rank: int, step: int, world: int, steps: int, base: int) -> int:
    """Per-rank, per-step sequence length, like per-rank length bucketing.

    Every rank starts in the same bucket (``base``), so the first compile is
    the same everywhere; after its divergence step a rank cycles through
    longer buckets.
    """
    if step < divergence_step(rank, world, steps):
        return base
    return base + 8 * (1 + (step + rank) % 4)


def batch_size(rank: int, step: int, world: int, steps: int, full: int) -> int:
    """Full batches, except the last rank's final one (its shard does not divide evenly)."""
    if rank == world - 1 and step == steps - 1 and full > 1:
        return full - 1
    return full


def make_batch(cfg: DemoConfig, rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic, learnable token data from a seeded RNG: arithmetic progressions mod vocab."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + rank * 10_007 + step)
    b = batch_size(rank, step, world, cfg.steps, cfg.batch_size)
    t = sequence_length(rank, step, world, cfg.steps, cfg.base_length)
    start = torch.randint(0, cfg.vocab, (b, 1), generator=gen)
    stride = torch.randint(1, 6, (b, 1), generator=gen)
    seq = (start + stride * torch.arange(t + 1)) % cfg.vocab
    return seq[:, :-1], seq[:, 1:]


def max_length(cfg: DemoConfig) -> int:
    return cfg.base_length + 8 * 4


# ------------------------------------------------------ counting the compiles


class CompileRecorder:
    """A torch.compile backend that records what Dynamo compiled, then delegates.

    Per graph it keeps Dynamo's compile id (``frame/compile-of-that-frame``)
    and which dims of the graph's tensor inputs are symbolic, i.e. which dims
    automatic dynamic shapes chose to make dynamic.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.compile_ids: list[tuple[int, int]] = []
        self.graphs: list[list[str]] = []  # per graph: dynamic dims, e.g. "tokens[1]"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        cid = torch._guards.CompileContext.current_compile_id()
        if cid is not None and cid.frame_id is not None:
            self.compile_ids.append((cid.frame_id, cid.frame_compile_id or 0))
        self.graphs.append(dynamic_dims(gm))
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

    @property
    def compiles(self) -> int:
        return len(set(self.compile_ids))

    @property
    def recompiles(self) -> int:
        # frame_compile_id counts the compiles of one frame: > 0 is a recompile.
        return len({c for c in self.compile_ids if c[1] > 0})


def dynamic_dims(gm: torch.fx.GraphModule) -> list[str]:
    """``name[dim,...]`` for every graph input with a symbolic size, in input order."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        dims = [str(i) for i, d in enumerate(value.shape) if isinstance(d, torch.SymInt)]
        if dims:
            name = str(node.target)
            if name.startswith("L_") and name.endswith("_"):
                name = name[2:-1]  # L_tokens_ -> tokens
            out.append(f"{name}[{','.join(dims)}]")
    return out


def merge_dims(graphs: Sequence[Sequence[str]]) -> list[str]:
    """All dims any graph made dynamic, one entry per input: tokens[1] + tokens[0,1] -> tokens[0,1]."""
    merged: dict[str, set[int]] = {}
    for graph in graphs:
        for entry in graph:
            name, dims = entry[:-1].split("[")
            merged.setdefault(name, set()).update(int(d) for d in dims.split(","))
    return [f"{name}[{','.join(map(str, sorted(dims)))}]" for name, dims in merged.items()]


# -------------------------------------------------------------- the training


def cpu_seconds() -> tuple[float, float]:
    """User + system CPU seconds of this process and of its children that have exited.

    Inductor runs the C++ compiler in child processes and waits for them, so
    their CPU time lands in the second figure.
    """
    if resource is None:
        return time.process_time(), 0.0
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def train(
    rank: int,
    world: int,
    use_service: bool,
    cfg: DemoConfig,
    *,
    guards: bool = True,
    timeout_s: float | None = None,
    record_timing: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Train ``cfg.steps`` steps on this rank; the default process group must exist.

    Returns plain data (counts, dims, timings) for the report. ``record_timing``
    times each of our collectives, for the guard collective's cost per call.
    """
    if use_service:
        # The whole integration: every rank calls this before its first
        # compiled call. Compiler collectives make each compile a collective
        # decision; guard collectives (guards=True) make every rank recompile
        # when any rank's guards miss, so no rank ever compiles alone.
        # (Equivalent: TORCH_COMPILER_COLLECTIVES=1 COMPILER_COLLECTIVES_GUARDS=1
        # in the environment and `import compiler_collectives`.)
        compiler_collectives.enable(guards=guards)
        # Give up on a stuck collective after the demo's timeout rather than
        # the library default (300 s), so a hang is bounded, under torchrun too.
        compiler_collectives.config.set_value("timeout_s", cfg.timeout if timeout_s is None else timeout_s)
    else:
        compiler_collectives.disable()
    # Record each collective's duration, for the guard collective's cost per
    # call (the median: the mean includes waiting for a rank that compiles).
    settings = compiler_collectives.config.settings
    own_timing = record_timing and use_service and not (settings.timing or settings.trace_dir)
    if own_timing:
        timing.set_enabled(True)

    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    model = TinyLM(cfg.vocab, cfg.d_model, cfg.heads, cfg.layers, max_length(cfg))
    recorder = CompileRecorder(cfg.backend)
    # DDP around the compiled model: DDP's hooks all-reduce the gradients
    # that the compiled backward produces.
    ddp = nn.parallel.DistributedDataParallel(torch.compile(model, backend=recorder))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr)

    # Per step: wall and CPU time, whether this rank compiled in it, and
    # whether one of those compiles was forced by another rank's guard miss.
    measured = StepCosts()
    loss_value = math.nan
    cpu_started = cpu_seconds()
    started = time.perf_counter()
    try:
        for step in range(cfg.steps):
            with measured.step(recorder, use_service):
                tokens, targets = make_batch(cfg, rank, world, step)
                loss = ddp(tokens, targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loss_value = loss.item()
            if on_step is not None:
                on_step(step, loss_value)
        elapsed = time.perf_counter() - started
        cpu_ended = cpu_seconds()
        s = compiler_collectives.stats()
    finally:
        if own_timing:
            timing.set_enabled(False)  # no summary at exit: the demo reports it
            timing.set_enabled(None)

    guard_figures = s.get("timing", {}).get("guard")
    guard_mean = s["guard_time_s"] / s["guard_collectives"] if s["guard_collectives"] else 0.0
    all_dims = merge_dims(recorder.graphs)
    return {
        "rank": rank,
        "backend": cfg.backend,
        "compiles": recorder.compiles,
        "recompiles": recorder.recompiles,
        "graphs": len(recorder.graphs),
        "graph_dims": recorder.graphs,
        "dynamic_dims": all_dims,
        "compiler_collectives": s["compiler_collectives"],
        "guard_collectives": s["guard_collectives"],
        "forced_recompiles": s["forced_recompiles"],
        "collective_time_s": s["compiler_time_s"] + s["guard_time_s"],
        # The cost of the service on this rank (part 3).
        "guard_time_s": s["guard_time_s"],
        "guard_per_call_s": guard_figures["p50_s"] if guard_figures else guard_mean,
        "audit_exchanges": s["audit_exchanges"],
        "reason_exchanges": s["guard_reason_exchanges"],
        "exchanges": s["compiler_collectives"] + s["audit_exchanges"] + s["guard_reason_exchanges"],
        "exchange_time_s": s["compiler_time_s"] + s["audit_time_s"],
        "forced_steps": measured.forced_steps,
        "forced_extra_wall_s": measured.extra("wall", measured.forced_steps),
        "forced_extra_cpu_s": measured.extra("cpu", measured.forced_steps),
        "compile_steps": measured.compile_steps,
        "compile_wall_s": measured.extra("wall", measured.compile_steps),
        # CPU seconds of the steps in which this rank compiled (part 4), the
        # C++ compiler's processes included, and theirs alone.
        "compile_cpu_s": sum(measured.cpu[i] for i in measured.compile_steps),
        "compile_children_cpu_s": sum(measured.children_cpu[i] for i in measured.compile_steps),
        "cpu_s": sum(cpu_ended) - sum(cpu_started),
        "steps": cfg.steps,
        "train_time_s": elapsed,
        "steps_per_s": cfg.steps / elapsed if elapsed > 0 else math.inf,
        "final_loss": loss_value,
    }


class StepCosts:
    """Wall and CPU seconds of every training step, and which steps compiled."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.children_cpu: list[float] = []
        self.compile_steps: list[int] = []  # steps in which this rank compiled
        self.forced_steps: list[int] = []  # ... a recompile forced by another rank's guard miss

    @contextmanager
    def step(self, recorder: CompileRecorder, use_service: bool) -> Iterator[None]:
        graphs, forced = len(recorder.graphs), self._forced(use_service)
        cpu0, wall0 = cpu_seconds(), time.perf_counter()
        yield
        wall1, cpu1 = time.perf_counter(), cpu_seconds()
        index = len(self.wall)
        self.wall.append(wall1 - wall0)
        self.cpu.append(sum(cpu1) - sum(cpu0))
        self.children_cpu.append(cpu1[1] - cpu0[1])
        if len(recorder.graphs) > graphs:
            self.compile_steps.append(index)
            if self._forced(use_service) > forced:
                self.forced_steps.append(index)

    @staticmethod
    def _forced(use_service: bool) -> int:
        return int(compiler_collectives.stats()["forced_recompiles"]) if use_service else 0

    def extra(self, kind: str, steps: Sequence[int]) -> float:
        """Seconds ``steps`` took beyond a step that compiles nothing (the median of those)."""
        values = self.wall if kind == "wall" else self.cpu
        plain = [v for i, v in enumerate(values) if i not in self.compile_steps]
        typical = statistics.median(plain) if plain else 0.0
        return sum(max(0.0, values[i] - typical) for i in steps)


def decisions(result: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    """What must be equal on every rank: the graphs, each with its dynamic dims."""
    return tuple(tuple(g) for g in result["graph_dims"])


def rank_cache_dir(run_cache_dir: str, rank: int, cfg: DemoConfig) -> str:
    """This rank's inductor cache in part 4: the run's, or (``--compile-cache per-rank``) its own in it."""
    return run_cache_dir if cfg.compile_cache == "shared" else os.path.join(run_cache_dir, f"rank{rank}")


def prepare_compile_run(run: Run, cache_dir: str) -> bool | None:
    """Part 4's settings, on this rank, before it compiles anything.

    A fresh inductor cache for the run (shared by its ranks), one compile
    thread, so the C++ compiler runs as this rank's children, and
    ``COMPILER_COLLECTIVES_COMPILE_ONCE`` as the run asks. Returns whether
    compile once is on, or None when this version of the package has no such
    setting (then both runs of part 4 compile on every rank).
    """
    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    inductor_config.compile_threads = 1  # read at import, and torch is imported already
    config = compiler_collectives.config
    row = next((r for r in config.SETTINGS_TABLE if r.env == COMPILE_ONCE_ENV), None)
    if row is None:
        return None
    # Settings are read from the environment at import (done in the parent
    # of this process): set the value too, as the environment would have.
    if run.compile_once is False:
        os.environ[COMPILE_ONCE_ENV] = "0"
        config.set_value(row.attr, row.parse(row.env, "0"), "env")
    else:
        os.environ.pop(COMPILE_ONCE_ENV, None)
        config.set_value(row.attr, row.default, "default")
    return bool(getattr(config.settings, row.attr))


# ---------------------------------------------------------- results of a run


@dataclasses.dataclass
class RankOutcome:
    rank: int
    status: str  # "finished", "timed out", "error", "died", "killed"
    result: dict[str, Any] | None = None
    last_step: int = -1  # last step this rank completed
    error: str | None = None  # traceback or reason
    pid: int | None = None  # of the rank process (None under torchrun)
    stuck_at: str | None = None  # where a rank that did not finish was waiting


@dataclasses.dataclass
class RunOutcome:
    run: Run
    ranks: list[RankOutcome]
    elapsed_s: float
    log_dir: str | None = None  # kept only when something went wrong
    steps: int = 0  # steps the run was to train
    compile_once: bool | None = None  # part 4: the setting on the ranks (None: not set or unknown)

    @property
    def finished(self) -> bool:
        return all(r.status == "finished" for r in self.ranks)

    @property
    def timed_out(self) -> bool:
        return any(r.status == "timed out" for r in self.ranks)

    @property
    def stuck(self) -> bool:
        """Did not finish because ranks waited for each other until a timeout (ours, or the demo's)."""
        return not self.finished and (self.timed_out or self.hang_error is not None)

    @property
    def hang_error(self) -> RankOutcome | None:
        """The first rank whose collective gave up waiting for its peers (its error names the hang)."""
        for o in self.ranks:
            if o.status == "error" and _first_line(exception_text(o.error)).startswith(HANG_ERRORS):
                return o
        return None

    @property
    def agree(self) -> bool | None:
        """Whether every rank made the same compile decisions (None: unknown)."""
        if not self.finished:
            return None
        first = decisions(self.ranks[0].result)  # type: ignore[arg-type]
        return all(decisions(r.result) == first for r in self.ranks)  # type: ignore[arg-type]


# What our collectives raise when they give up waiting: peers that are gone or
# stuck, or (desync) peers that are alive but elsewhere, as in the hazard.
HANG_ERRORS = ("CollectiveTimeoutError", "CollectiveDesyncError")


# ------------------------------------------------- running ranks as processes


def _rank_main(
    rank: int, world: int, run_name: str, cfg: DemoConfig, run_dir: str, messages: Any, cache_dir: str | None
) -> None:
    """Entry point of one spawned rank process."""
    # Keep the terminal readable: this rank's stdout/stderr (Dynamo warnings
    # and the like) go to a log file; the parent shows it if the run fails.
    log_fd = os.open(os.path.join(run_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    if _STACK_SIGNAL is not None:
        # If this rank hangs, the parent asks for its stack before killing it.
        faulthandler.register(_STACK_SIGNAL, file=sys.stderr, all_threads=False)
    # Several ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    run = RUNS[run_name]
    try:
        compile_once = None
        if cache_dir is not None:
            compile_once = prepare_compile_run(run, rank_cache_dir(cache_dir, rank, cfg))
        dist.init_process_group(
            "gloo",
            init_method="file://" + os.path.join(run_dir, "store"),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg.timeout),
        )

        def on_step(step: int, loss: float) -> None:
            messages.put(("step", rank, step, loss))

        result = train(
            rank,
            world,
            run.use_service,
            run_config(run, cfg),
            guards=run.guards,
            timeout_s=collective_timeout(run, cfg),
            record_timing=not run.compile_part,  # part 4 reports CPU-seconds only
            on_step=on_step,
        )
        result["compile_once"] = compile_once
        messages.put(("done", rank, result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        messages.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


ProgressFn = Callable[[str], None]


def _mp_context() -> Any:
    """Where rank processes come from: fresh processes, without paying `import torch` each time.

    With "forkserver" every rank is forked from a server process that has only
    imported this module (so torch): nothing was compiled or initialized
    there, so each rank starts as clean as a spawned one, seconds sooner.
    """
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return mp.get_context("spawn")


def launch_run(run: Run, cfg: DemoConfig, progress: ProgressFn = lambda line: None) -> RunOutcome:
    """Run ``train`` on ``cfg.nproc`` fresh rank processes; bounded by ``cfg.timeout``.

    Every child is reaped before this returns: ranks still running at the
    deadline (or shortly after another rank failed) are killed. When a rank
    fails, the others are asked at once where they are (their stacks go to
    their logs), since that is where they were stuck.
    """
    ctx = _mp_context()
    rcfg = run_config(run, cfg)
    run_dir = tempfile.mkdtemp(prefix=f"cc-demo-{run.name}-")
    cache_dir = tempfile.mkdtemp(prefix=f"cc-demo-{run.name}-inductor-") if run.compile_part else None
    messages = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, cfg.nproc, run.name, cfg, run_dir, messages, cache_dir),
            name=f"demo-{run.name}-rank{rank}",
            daemon=True,
        )
        for rank in range(cfg.nproc)
    ]
    outcomes = [RankOutcome(rank, "running") for rank in range(cfg.nproc)]
    started = time.monotonic()
    deadline = started + cfg.timeout
    failed_at: float | None = None
    grace_after_failure = 10.0  # peers of a failed rank are stuck in collectives
    quiet_notice_s = 30.0  # say so when no rank finished a step for this long
    last_news = started
    interrupted = True  # until the loop below ends normally
    try:
        for p, o in zip(procs, outcomes):
            p.start()
            o.pid = p.pid
        while any(o.status == "running" for o in outcomes):
            now = time.monotonic()
            if now >= deadline or (failed_at is not None and now >= failed_at + grace_after_failure):
                break
            if now - last_news >= quiet_notice_s:
                # Not a frozen terminal: say what we are waiting for.
                done = " ".join(str(o.last_step + 1) for o in outcomes)
                progress(
                    f"  [{run.name}] no step finished for {now - last_news:.0f}s (compiling, or "
                    f"stuck); steps done per rank: {done}; timeout in {deadline - now:.0f}s"
                )
                last_news = now
            try:
                message = messages.get(timeout=0.5)
            except queue_mod.Empty:
                for o, p in zip(outcomes, procs):
                    # Exited, and nothing of it is left in the queue: it died
                    # without reporting (a signal, os._exit, a crash in C++).
                    if o.status == "running" and p.exitcode is not None and messages.empty():
                        o.status, o.error = "died", f"exit code {p.exitcode}"
                        failed_at = failed_at or time.monotonic()
                continue
            kind, rank = message[0], message[1]
            o = outcomes[rank]
            last_news = time.monotonic()
            if kind == "step":
                step, loss = message[2], message[3]
                o.last_step = step
                if rank == 0 and _should_log(step, rcfg):
                    progress(_progress_line(run.name, step, rcfg, loss, time.monotonic() - started))
            elif kind == "done":
                o.status, o.result = "finished", message[2]
            elif kind == "error":
                o.status, o.error = "error", message[2]
                progress(f"  [{run.name}] rank {rank} failed: {_first_line(exception_text(o.error), 150)}")
                if failed_at is None:
                    failed_at = time.monotonic()
                    # Where the others are now is where they were stuck.
                    _request_stacks(p for p, q in zip(procs, outcomes) if q.status == "running")
        interrupted = False
    finally:
        # Ranks that reported are exiting: give them a moment. Otherwise we are
        # past the deadline (or interrupted): no more waiting.
        all_reported = all(o.status != "running" for o in outcomes)
        _reap(procs, grace_s=5.0 if all_reported else 0.0)
        messages.close()
        messages.cancel_join_thread()
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
        if interrupted:  # nobody will be shown the logs
            shutil.rmtree(run_dir, ignore_errors=True)
    for o in outcomes:
        if o.status == "running":
            o.status = "timed out" if failed_at is None else "killed"
        if o.status != "finished":
            # The stack it was asked for while it waited, else its own traceback.
            o.stuck_at = stuck_at(_read(os.path.join(run_dir, f"rank{o.rank}.log"))) or stuck_at(o.error or "")
    elapsed = time.monotonic() - started
    outcome = RunOutcome(run, outcomes, elapsed, steps=rcfg.steps)
    if run.compile_part:
        outcome.compile_once = next((o.result.get("compile_once") for o in outcomes if o.result), None)
    if all(o.status == "finished" for o in outcomes) or (run.expect_stuck and outcome.hang_error is not None):
        # Nothing to look into: it finished, or got stuck as the hazard does (the report shows where).
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        outcome.log_dir = run_dir
    return outcome


def _request_stacks(procs: Iterator[Any] | Sequence[Any]) -> None:
    """Ask rank processes to write their Python stack to their logs (faulthandler)."""
    if _STACK_SIGNAL is None:
        return
    for p in procs:
        try:
            os.kill(p.pid, _STACK_SIGNAL)
        except (OSError, TypeError):
            pass


def _reap(procs: Sequence[Any], grace_s: float) -> None:
    """Give children ``grace_s`` to exit; ask the rest where they are stuck, kill them, join all."""
    grace = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:  # None: never started
            p.join(timeout=max(0.0, grace - time.monotonic()))
    stuck = [p for p in procs if p.pid is not None and p.is_alive()]
    _request_stacks(stuck)  # faulthandler writes each one's stack to its log
    if stuck and _STACK_SIGNAL is not None:
        time.sleep(1.0)
    for p in stuck:
        log.info("killing %s (pid %d)", p.name, p.pid)
        p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)


# Sent to a stuck rank before it is killed; None where there is no SIGUSR1 (Windows).
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)

_FRAME = re.compile(r'^File "([^"]+)", line (\d+),? in (\S+)')


def stuck_at(text: str) -> str | None:
    """Where a rank was stuck: from the last stack in ``text``.

    That is a stack faulthandler wrote to a rank's log (most recent call
    first) or a Python traceback (most recent call last), whichever comes
    last. Returns e.g. ``all_gather_bytes (gloo.py:187) <- train (demo.py:301)``:
    the innermost frame, the innermost frame of the service below it, and the
    training loop's line that led there.
    """
    dump, tb = "(most recent call first):", "Traceback (most recent call last):"
    at_dump, at_tb = text.rfind(dump), text.rfind(tb)
    if at_dump < 0 and at_tb < 0:
        return None
    if at_dump > at_tb:
        lines = text[at_dump + len(dump) :].splitlines()[1:]
    else:
        lines = text[at_tb + len(tb) :].splitlines()[1:]
    frames = []
    for line in lines:
        if not line.startswith(" "):
            break  # the end of the stack (the exception's line, or a blank one)
        m = _FRAME.match(line.strip())
        if m:
            path, lineno, func = m.groups()
            frames.append((path, f"{func} ({os.path.basename(path)}:{lineno})"))
        elif at_dump > at_tb:
            break  # faulthandler writes frames only
    if at_tb > at_dump:
        frames.reverse()  # innermost first
    if not frames:
        return None
    package = os.path.dirname(os.path.abspath(compiler_collectives.__file__)) + os.sep
    shown = [frames[0][1]]
    # The innermost frame of the service, if any (e.g. the compiler collective) ...
    for path, frame in frames[1:]:
        if os.path.abspath(path).startswith(package):
            shown.append(frame)
            break
    # ... and the training loop's line that led there.
    for _path, frame in frames[1:]:
        if frame.startswith("train ("):
            shown.append(frame)
            break
    return " <- ".join(shown)


def _should_log(step: int, cfg: DemoConfig) -> bool:
    done = step + 1
    return done == 1 or done % cfg.log_every == 0 or done == cfg.steps


def _progress_line(run_name: str, step: int, cfg: DemoConfig, loss: float, elapsed_s: float) -> str:
    return f"  [{run_name}] step {step + 1:>3}/{cfg.steps}  loss {loss:6.3f}  (rank 0, {elapsed_s:5.1f}s)"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


_EXCEPTION_TYPE = re.compile(r"^(?:[A-Za-z_][\w]*\.)+(?=\w+(?:Error|Exception|Interrupt|Exit)\b)")


def exception_text(text: str | None) -> str:
    """The exception a traceback ends with, all its lines: ``Type: message`` (the module path dropped)."""
    lines = (text or "").rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    start = frames[-1] + 1 if frames else 0
    while start < len(lines) and (not lines[start] or lines[start][0].isspace()):
        start += 1  # the frame's source line and its ^^^ markers
    message = "\n".join(lines[start:]).strip() or _last_line(text)
    return _EXCEPTION_TYPE.sub("", message)


def _first_line(text: str, limit: int = 200) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ------------------------------------------------------------ under torchrun


def launched_by_torchrun() -> bool:
    """True when this process is one rank of a job started by torchrun (or similar)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_this_rank(cfg: DemoConfig, progress: ProgressFn = lambda line: None) -> list[RunOutcome] | None:
    """Under torchrun: run every selected run in this process, one after another.

    There is no parent to kill a hung rank here, so the timeout is enforced by
    the collectives themselves (process-group and service timeouts). Returns
    the outcomes on rank 0 and None on the other ranks.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout))
    outcomes: list[RunOutcome] = []
    previous: Run | None = None
    try:
        for name in cfg.runs:
            run = RUNS[name]
            rcfg = run_config(run, cfg)
            for line in format_intro(run, previous, cfg, world):
                progress(line)
            previous = run
            # A fresh start for each run, as if in a new process.
            torch._dynamo.reset()
            compiler_collectives.reset()
            compiler_collectives.reset_stats()
            compile_once, cache_dir = None, None
            if run.compile_part:
                # A fresh inductor cache for the run, named by rank 0 (shared by the ranks of a host).
                names: list[Any] = [tempfile.mkdtemp(prefix=f"cc-demo-{name}-inductor-") if rank == 0 else None]
                dist.broadcast_object_list(names, src=0)
                cache_dir = str(names[0])
                os.makedirs(cache_dir, exist_ok=True)
                compile_once = prepare_compile_run(run, rank_cache_dir(cache_dir, rank, cfg))
            started = time.monotonic()

            def on_step(step: int, loss: float, _name: str = name, _t0: float = started, _c: DemoConfig = rcfg) -> None:
                if rank == 0 and _should_log(step, _c):
                    progress(_progress_line(_name, step, _c, loss, time.monotonic() - _t0))

            result = train(
                rank,
                world,
                run.use_service,
                rcfg,
                guards=run.guards,
                timeout_s=collective_timeout(run, cfg),
                record_timing=not run.compile_part,
                on_step=on_step,
            )
            result["compile_once"] = compile_once
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(result, gathered, dst=0)
            if cache_dir is not None:
                dist.barrier()
                shutil.rmtree(cache_dir, ignore_errors=True)
            if gathered is not None:
                ranks = [RankOutcome(r, "finished", res, rcfg.steps - 1) for r, res in enumerate(gathered)]
                outcome = RunOutcome(run, ranks, time.monotonic() - started, steps=rcfg.steps)
                outcome.compile_once = compile_once
                outcomes.append(outcome)
                progress(f"  [{name}] finished in {outcome.elapsed_s:.1f}s")
        compiler_collectives.disable()
    finally:
        dist.destroy_process_group()
    return outcomes if rank == 0 else None


# ---------------------------------------------------------------- the report


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _wrap(text: str, indent: str = "   ") -> list[str]:
    return textwrap.wrap(
        " ".join(text.split()),
        width=100,
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _section(run: Run) -> str:
    return "compile" if run.compile_part else run.name


def format_intro(run: Run, previous: Run | None, cfg: DemoConfig, world: int) -> list[str]:
    """The heading and explanation printed before a run (once for part 4's two runs)."""
    if previous is not None and _section(previous) == _section(run):
        return [""]
    lonely = divergence_step(1, world, cfg.steps) + 1  # the step in which rank 1 recompiles alone
    others = "rank 0" if world == 2 else "the other ranks"
    if run.expect_stuck:
        title = f"THE HAZARD: a rank recompiles alone (run '{run.name}', EXPECTED TO GET STUCK)"
        text = (
            "Compiler collectives on, guard collectives off. Every compile is then a collective, so "
            f"when rank 1 recompiles in step {lonely} and {others} {'does' if world == 2 else 'do'} not, "
            f"rank 1 waits in the compiler collective for peers that never join it, while {others} "
            f"{'waits' if world == 2 else 'wait'} for rank 1 in DDP's gradient all-reduce: the job hangs. "
            "This is the deadlock the service exists to prevent. (Torch's own "
            "compiler collective crashes on gloo/CPU before it gets that far, so this run uses ours.) Our "
            f"timeout, {collective_timeout(run, cfg):.0f} s here (COMPILER_COLLECTIVES_TIMEOUT, 300 s by "
            "default), turns the hang into a named error."
        )
    elif run.compile_part:
        title = "COMPILE ONCE: one compile instead of N (inductor; runs 'compile-each' and 'compile-once')"
        steps = "training step" if cfg.compile_steps == 1 else f"{cfg.compile_steps} training steps"
        where = "shared by the run's ranks" if cfg.compile_cache == "shared" else "per rank"
        text = (
            f"The first {steps} with inductor and the service on, twice, each time in a fresh inductor "
            f"cache {where}, one compile thread per rank: with "
            f"{COMPILE_ONCE_ENV}=0 every rank compiles every graph; with the default one rank compiles "
            "each graph and the others load it."
        )
    elif run.use_service and run.guards:
        title = f"THE CURE: guard collectives too (run '{run.name}')"
        text = (
            "compiler_collectives.enable(guards=True). When any rank's guards miss, every rank "
            f"recompiles in that step (rank 0 too, in step {lonely}), and the compiler collective makes "
            "the length dynamic on every rank at once."
        )
    elif not run.use_service:
        title = f"WITHOUT THE SERVICE (run '{run.name}')"
        text = (
            "Each rank's Dynamo decides alone. This finishes here only because the demo's compiled graph "
            "holds no collective and torch's own compiler collectives are off; the ranks still end with "
            "different graphs."
        )
    else:
        title, text = f"run '{run.name}'", run.description
    return ["", title, *_wrap(text)]


def format_result(run: RunOutcome) -> list[str]:
    """What one run came to: stuck (and where), or finished (and whether the ranks agree)."""
    steps = run.steps
    if run.run.compile_part:
        if not run.finished:
            return [f"  => did not finish: {_failure(run)}"]
        return [f"  => finished in {run.elapsed_s:.0f}s"]
    if run.stuck:
        step = max(o.last_step for o in run.ranks) + 2
        how = "as expected" if run.run.expect_stuck else "NOT expected"
        lines = [f"  => STUCK, {how}, in step {step}/{steps}, after {run.elapsed_s:.0f}s. Where each rank was:"]
        for o in run.ranks:
            where = o.stuck_at or "(no stack)"
            gloss = _gloss(where)
            lines.append(f"       rank {o.rank}: {gloss + ': ' if gloss else ''}{where}")
        first = run.hang_error
        if first is not None:
            lines.append(f"     Our timeout turned the hang into an error on rank {first.rank}:")
            for paragraph in exception_text(first.error).splitlines():
                lines.extend(_wrap(paragraph, "       "))
        else:
            lines.append(f"     No rank raised within the run's limit ({run.elapsed_s:.0f}s); the demo killed them.")
        if run.log_dir:
            lines.append(f"     (rank logs: {run.log_dir})")
        return lines
    if not run.finished:
        what = "NOT expected" if run.run.must_finish else "and not by getting stuck"
        return [f"  => FAILED ({what}): {_failure(run)}"] + (
            [f"     (rank logs: {run.log_dir})"] if run.log_dir else []
        )
    example = run.ranks[0].result
    assert example is not None
    if run.agree:
        head = [
            f"  => finished in {run.elapsed_s:.0f}s, with the same compile decisions on every rank: "
            f"{_describe_decisions(example)}"
        ]
    else:
        groups: dict[tuple[tuple[str, ...], ...], list[int]] = {}
        for o in run.ranks:
            assert o.result is not None
            groups.setdefault(decisions(o.result), []).append(o.rank)
        head = [f"  => finished in {run.elapsed_s:.0f}s, with DIFFERENT compile decisions across ranks:"]
        for ranks in groups.values():
            result = run.ranks[ranks[0]].result
            assert result is not None
            who = "rank" + ("s " if len(ranks) > 1 else " ") + ",".join(map(str, ranks))
            head.append(f"       {who}: {_describe_decisions(result)}")
    if run.run.expect_stuck:
        head.append("     (it did not get stuck: the hazard did not show this time)")
    return head + format_rank_table(run)


def _failure(run: RunOutcome) -> str:
    for o in run.ranks:
        if o.status == "error":
            return f"rank {o.rank}: {_first_line(exception_text(o.error), 300)}"
    o = next(o for o in run.ranks if o.status != "finished")
    return f"rank {o.rank} {o.status}" + (f" ({o.error})" if o.error else "")


def _gloss(where: str) -> str:
    """A few words on a stack the demo knows: which collective the rank was waiting in."""
    if "backward" in where:
        return "in backward (DDP's gradient all-reduce)"
    if "all_gather" in where or "exchange" in where:
        return "in our compiler collective"
    return ""


_RANK_COLUMNS = (
    ("rank", ">"),
    ("compiles", ">"),
    ("recompiles", ">"),
    ("graphs", ">"),
    ("dynamic dims", "<"),
    ("forced", ">"),
    ("steps/s", ">"),
)


def format_rank_table(run: RunOutcome) -> list[str]:
    rows = []
    for o in run.ranks:
        r = o.result
        assert r is not None
        rows.append(
            [
                str(o.rank),
                str(r["compiles"]),
                str(r["recompiles"]),
                str(r["graphs"]),
                " ".join(r["dynamic_dims"]) or "-",
                str(r["forced_recompiles"]),
                f"{r['steps_per_s']:.2f}",
            ]
        )
    return ["", *_columns(_RANK_COLUMNS, rows, "     ")]


def _columns(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]], indent: str) -> list[str]:
    header = [name for name, _ in columns]
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        parts = [c.ljust(w) if a == "<" else c.rjust(w) for c, w, (_, a) in zip(cells, widths, columns)]
        return (indent + "  ".join(parts)).rstrip()

    return [fmt(header), *(fmt(row) for row in rows)]


def format_cost(run: RunOutcome, cores: int) -> list[str]:
    """Part 3: what the service added on each rank, beside the rank's total."""
    lines = ["", f"THE COST: what the service added in run '{run.run.name}', per rank"]
    rows = []
    for o in run.ranks:
        r = o.result
        assert r is not None
        kinds = [f"{r['compiler_collectives']} compiler", f"{r['audit_exchanges']} audit"]
        if r["reason_exchanges"]:
            kinds.append(f"{r['reason_exchanges']} reasons")
        forced = str(r["forced_recompiles"])
        if r["forced_recompiles"]:
            forced += f", {r['forced_extra_cpu_s']:.1f} CPU-s"
        rows.append(
            [
                str(o.rank),
                f"{r['train_time_s']:.1f}s",
                f"{r['guard_collectives']} x {r['guard_per_call_s'] * 1e6:.0f} µs, {r['guard_time_s'] * 1e3:.0f} ms",
                f"{r['exchanges']} ({', '.join(kinds)}), {r['exchange_time_s']:.2f}s",
                forced,
            ]
        )
    columns = (
        ("rank", ">"),
        ("total", ">"),
        ("guard collectives", "<"),
        ("exchanges", "<"),
        ("forced recompiles", "<"),
    )
    lines += _columns(columns, rows, "   ")
    own = min(o.result["guard_per_call_s"] for o in run.ranks if o.result) * 1e6
    lines += _wrap(
        "total: the rank's training time, compiles included. Guard collectives: one per call of a "
        "compiled frame; the median time of one call, and their total time. The rank that arrives "
        f"last pays only the collective itself ({own:.0f} µs here); the others also wait for it. "
        "Exchanges: compiler collectives, program audits and recompile reasons, and their time, most "
        "of it waiting for a rank that is still tracing. Forced recompiles: compiles a rank did only "
        "because another rank's guards missed, and the CPU-seconds their steps took beyond a plain step."
    )
    world = len(run.ranks)
    backend = run.ranks[0].result["backend"] if run.ranks[0].result else "?"
    no_cache = f" ({backend} keeps no cache the ranks could share)" if backend in ("aot_eager", "eager") else ""
    if world > cores:
        lines += _wrap(
            f"Here {world} ranks share {cores} CPU cores, so most of this cost is CPU oversubscription: "
            "each forced recompile runs on the same cores at the same time as the recompile that caused "
            f"it{no_cache}, so every compile takes longer than it would on a core of its own. The "
            "collectives' times here, too, include waiting for a rank to get a core: with one rank per "
            f"core (--nproc {cores}) they are far smaller."
        )
    else:
        lines += _wrap(
            f"Here each of the {world} ranks has a CPU core of its own. A forced recompile runs while "
            "the rank that needed it compiles its own, which DDP makes every rank wait for anyway: it "
            "costs CPU-seconds, little wall time."
        )
    return lines


def format_compile_once(outcomes: Sequence[RunOutcome], nproc: int, cache: str = "shared") -> list[str]:
    """Part 4: CPU-seconds compiling per rank and in total, compile once off and on."""
    lines = ["  => CPU-seconds of the steps that compiled, per rank and in total, the C++ compiler's included:"]
    rows = []
    unknown = False
    for run in outcomes:
        label = f"{COMPILE_ONCE_ENV}=0" if run.run.compile_once is False else "default (compile once)"
        if not run.finished:
            rows.append([label, *(["?"] * nproc), "?", "?", f"{run.elapsed_s:.0f}s (did not finish)"])
            continue
        per_rank = [o.result["compile_cpu_s"] for o in run.ranks if o.result]
        children = sum(o.result["compile_children_cpu_s"] for o in run.ranks if o.result)
        rows.append(
            [
                label,
                *(f"{c:.1f}" for c in per_rank),
                f"{sum(per_rank):.1f}",
                f"{children:.1f}",
                f"{run.elapsed_s:.0f}s",
            ]
        )
        unknown = unknown or run.compile_once is None
    columns = (
        ("run", "<"),
        *((f"rank {r}", ">") for r in range(nproc)),
        ("total", ">"),
        ("of which C++", ">"),
        ("wall", ">"),
    )
    lines += _columns(columns, rows, "   ")
    if cache == "shared":
        lines += _wrap(
            "Ranks share the run's inductor cache on disk, as ranks of one host do by default, so even "
            f"with {COMPILE_ONCE_ENV}=0 a rank may load a kernel that a peer compiled a moment before "
            "(--compile-cache per-rank: each rank its own, as on different hosts)."
        )
    else:
        lines += _wrap(
            "Each rank had an inductor cache of its own, as ranks on different hosts or in containers do "
            "(--compile-cache shared: one dir for the run's ranks, where inductor's own file cache already "
            "lets a rank reuse C++ kernels a peer built)."
        )
    if unknown:
        lines += _wrap(
            f"This version of compiler_collectives has no {COMPILE_ONCE_ENV}: both runs compiled on every rank."
        )
    return lines


def _describe_decisions(result: dict[str, Any]) -> str:
    graphs = result["graph_dims"]
    shown = ["static" if not g else "dynamic " + " ".join(g) for g in graphs]
    return f"{len(graphs)} graph{'s' if len(graphs) != 1 else ''} ({'; '.join(shown)})"


def format_report(outcomes: Sequence[RunOutcome], upcoming: Sequence[str], cores: int, cfg: DemoConfig) -> list[str]:
    """What to print after the last of ``outcomes``: its result, then its part's figures.

    The cost follows the first service run that finished; part 4's table
    follows the last of its runs (``upcoming``: the name of the next run, if any).
    """
    run = outcomes[-1]
    lines = format_result(run)
    if _is_cure(run) and run.finished and not any(_is_cure(o) and o.finished for o in outcomes[:-1]):
        lines += format_cost(run, cores)
    if run.run.compile_part and not (upcoming and RUNS[upcoming[0]].compile_part):
        group: list[RunOutcome] = []
        for o in reversed(outcomes):
            if not o.run.compile_part:
                break
            group.insert(0, o)
        lines += format_compile_once(group, len(run.ranks), cfg.compile_cache)
    return lines


def _is_cure(run: RunOutcome) -> bool:
    return run.run.use_service and run.run.guards and not run.run.compile_part


def format_summary(outcomes: Sequence[RunOutcome]) -> str:
    """One sentence: what the runs showed."""
    parts = []
    for run in outcomes:
        name = f"'{run.run.name}'"
        if run.run.expect_stuck:
            parts.append(f"{name} got stuck, as expected" if run.stuck else f"{name} did NOT get stuck")
        elif not run.finished:
            parts.append(f"{name} did NOT finish")
        elif run.run.compile_part:
            parts.append(f"{name} finished")
        elif run.agree:
            parts.append(f"{name} finished, every rank making the same decisions")
        else:
            parts.append(f"{name} finished, ranks making different decisions")
    return "; ".join(parts) + "."


def demo_succeeded(outcomes: Sequence[RunOutcome]) -> bool:
    """Every run that should finish finished, and every run with the full service agreed."""
    for run in outcomes:
        if run.run.must_finish and not run.finished:
            return False
        if run.run.use_service and run.run.guards and not run.agree:
            return False
    return True


def outcome_to_json(run: RunOutcome) -> dict[str, Any]:
    """Plain data for ``--json`` (and for tools that read demo results)."""
    return {
        "run": run.run.name,
        "description": run.run.description,
        "elapsed_s": run.elapsed_s,
        "steps": run.steps,
        "finished": run.finished,
        "stuck": run.stuck,
        "expected_stuck": run.run.expect_stuck,
        "agree": run.agree,
        "compile_once": run.compile_once,
        "log_dir": run.log_dir,
        "ranks": [dataclasses.asdict(o) for o in run.ranks],
    }


# --------------------------------------------------------------------- command line


def _say(line: str = "") -> None:
    print(line, flush=True)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number > 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _run_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RUNS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(RUNS)}; got {text!r}")
    return names


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except those that are None (--runs says its own)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_demo_parser(subparsers: Any) -> None:
    d = DemoConfig()
    runs_help = "; ".join(f"'{name}': {run.description}" for name, run in RUNS.items())
    p = subparsers.add_parser(
        "demo",
        help="what the service is for: the deadlock it prevents, what it costs, one compile instead of N",
        description=(
            "Train a tiny transformer language model with DistributedDataParallel (gloo, CPU) and "
            "torch.compile on ranks that see different sequence lengths, each run in fresh rank "
            "processes. By default: the hazard (compiler collectives without guard collectives: one rank "
            "recompiles alone and the job gets stuck until our timeout names it; expected to fail), the "
            "cure (compiler + guard collectives: it finishes with the same compile decisions on every "
            "rank) and its cost per rank (guard collectives, exchanges, forced recompiles). "
            "--compile-once adds CPU-seconds spent compiling with inductor, with and without compile "
            "once. Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) it runs only this "
            "rank's part, without the hazard, and rank 0 prints the results."
        ),
        epilog=(
            "Exit status: 0 when every run that should finish finished and the service runs' "
            "ranks agree (the hazard is expected to get stuck); 1 otherwise; 2 for bad options."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--nproc",
        type=_positive_int,
        default=d.nproc,
        metavar="N",
        help="number of ranks (processes) to launch; more ranks than CPU cores makes every compile "
        "slower (ignored under torchrun)",
    )
    p.add_argument(
        "--steps", type=_positive_int, default=d.steps, metavar="N", help="training steps per run (at least 2)"
    )
    p.add_argument(
        "--backend",
        default=d.backend,
        metavar="NAME",
        help="torch.compile backend, e.g. aot_eager, eager, inductor (inductor needs a C++ compiler, "
        "and adds the compile-once part)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=d.timeout,
        metavar="SECONDS",
        help="wall-clock limit per run; ranks still running then are killed and the "
        "run is reported as timed out (under torchrun: the collectives' timeout)",
    )
    p.add_argument(
        "--hazard-timeout",
        type=_positive_float,
        default=d.hazard_timeout,
        metavar="SECONDS",
        help="our collectives' timeout in the hazard run ('compiler-only'): how long the rank that "
        "recompiles alone waits for its peers before it raises (CollectiveDesyncError: they are alive, "
        "elsewhere)",
    )
    p.add_argument(
        "--runs",
        type=_run_list,
        default=None,
        metavar="LIST",
        help=f"comma-separated runs to do, in order (default: {','.join(DEFAULT_RUNS)}). {runs_help}",
    )
    p.add_argument(
        "--compile-once",
        action="store_true",
        help="also run the compile-once part ('compile-each' then 'compile-once': inductor, about 1.5 "
        "minutes more on 2 cores)",
    )
    p.add_argument(
        "--compile-steps",
        type=_positive_int,
        default=d.compile_steps,
        metavar="N",
        help="training steps of each compile-once run (each new graph is one more compile)",
    )
    p.add_argument(
        "--compile-cache",
        choices=("shared", "per-rank"),
        default=d.compile_cache,
        help="inductor's cache in each compile-once run: one fresh directory per rank (the default: as on "
        "different hosts or in containers), or one shared by the run's ranks (as ranks of one host share "
        "the default one)",
    )
    p.add_argument(
        "--batch-size", type=_positive_int, default=d.batch_size, metavar="N", help="sequences per batch and rank"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model weights and the synthetic token data")
    p.add_argument(
        "--log-every",
        type=_positive_int,
        default=d.log_every,
        metavar="N",
        help="print a progress line every N steps (from rank 0)",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="also write the per-rank results of every run as JSON to PATH"
    )
    p.set_defaults(func=cmd_demo)


def selected_runs(args: argparse.Namespace, under_torchrun: bool) -> tuple[str, ...]:
    """--runs as given; else the default story (without the hazard under torchrun), plus part 4 if asked."""
    if args.runs is not None:
        return tuple(args.runs)
    runs = tuple(n for n in DEFAULT_RUNS if not (under_torchrun and RUNS[n].expect_stuck))
    if args.compile_once or args.backend == "inductor":
        runs += COMPILE_RUNS
    return runs


def cmd_demo(args: argparse.Namespace) -> int:
    demo = sys.modules[__name__]

    if args.steps < 2:
        print("demo: --steps must be at least 2", file=sys.stderr)
        return 2
    under_torchrun = demo.launched_by_torchrun()
    if args.nproc < 2 and not under_torchrun:
        print("demo: --nproc must be at least 2 (the point is ranks that disagree)", file=sys.stderr)
        return 2
    cfg = demo.DemoConfig(
        nproc=args.nproc,
        steps=args.steps,
        backend=args.backend,
        timeout=args.timeout,
        hazard_timeout=args.hazard_timeout,
        compile_steps=args.compile_steps,
        compile_cache=args.compile_cache,
        runs=selected_runs(args, under_torchrun),
        batch_size=args.batch_size,
        seed=args.seed,
        log_every=args.log_every,
    )
    started = time.monotonic()
    cores = usable_cores()

    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
        is_rank0 = os.environ.get("RANK") == "0"
        say = _say if is_rank0 else (lambda line="": None)
        say(f"compiler_collectives demo under torchrun: {world} ranks, {cfg.steps} steps, backend {cfg.backend}")
        outcomes = demo.run_this_rank(cfg, progress=say)
        if outcomes is None:
            return 0
        for i, outcome in enumerate(outcomes):
            _say()
            _say(f"run '{outcome.run.name}':")
            # Cores across the job, as if every host had as many as this one.
            all_cores = cores * max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            for line in format_report(outcomes[: i + 1], cfg.runs[i + 1 : i + 2], all_cores, cfg):
                _say(line)
    else:
        world = cfg.nproc
        per_core = "one per core" if world <= cores else "MORE RANKS THAN CORES"
        _say(
            f"compiler_collectives demo: {world} ranks on {cores} CPU cores ({per_core}), gloo; a tiny "
            f"transformer under DDP and torch.compile (backend {cfg.backend}), {cfg.steps} steps per run"
        )
        for line in _wrap(
            f"The ranks see different sequence lengths, as with per-rank length bucketing: all start at "
            f"{cfg.base_length} tokens; rank 1 moves to other lengths in step "
            f"{divergence_step(1, world, cfg.steps) + 1}"
            + (", the next ranks later" if world > 2 else "")
            + "; rank 0 never does; the last rank's final batch is short.",
            "",
        ):
            _say(line)
        outcomes = []
        previous: Run | None = None
        for i, name in enumerate(cfg.runs):
            run = demo.RUNS[name]
            for line in format_intro(run, previous, cfg, world):
                _say(line)
            previous = run
            outcomes.append(demo.launch_run(run, cfg, progress=_say))
            for line in format_report(outcomes, cfg.runs[i + 1 : i + 2], cores, cfg):
                _say(line)

    if not any(o.run.compile_part for o in outcomes) and not under_torchrun:
        _say()
        _say(
            "COMPILE ONCE (one compile instead of N: CPU-seconds compiling with inductor, with and without "
            "it; about 1.5 minutes more on 2 cores): scripts/dev demo --compile-once"
        )
    _say()
    _say(f"In short: {format_summary(outcomes)} Total wall time {time.monotonic() - started:.0f}s.")
    for outcome in outcomes:
        if outcome.run.must_finish and not outcome.finished:
            for o in outcome.ranks:
                if o.error and o.status == "error":
                    _say(f"--- run '{outcome.run.name}', rank {o.rank}:\n{o.error.rstrip()}")
                    break  # the first traceback is usually the cause

    if args.json:
        with open(args.json, "w") as f:
            json.dump([demo.outcome_to_json(o) for o in outcomes], f, indent=2)
    return 0 if demo.demo_succeeded(outcomes) else 1


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (``scripts/dev demo --help``)."""
    parent = argparse.ArgumentParser(prog="scripts/dev")
    add_demo_parser(parent.add_subparsers(dest="command"))
    return parent._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # A SIGTERM (a CI job cancelled, `timeout`, ...) unwinds like Ctrl-C, so the
    # demo kills and reaps its rank processes.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main_thread else None
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
