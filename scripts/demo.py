"""The demo: the same small DDP + torch.compile training, without and with the service.

What it shows
-------------
Every rank trains the same tiny transformer language model under
``DistributedDataParallel`` (gloo, CPU) and ``torch.compile``. The ranks see
*different sequence lengths*, as they do with per-rank length bucketing or
sequence packing:

* at step 0 every rank is in the same length bucket (32 tokens);
* then the ranks leave that bucket one after another (rank 1 first, rank 2 a
  few steps later, ...), while rank 0 stays in it;
* the last rank's data does not divide evenly, so its final batch is short
  (``drop_last=False``).

Without the service each rank's Dynamo decides alone. Rank 0 never sees a
second length and keeps one static graph; rank 1 recompiles with a dynamic
length at step 3, rank 2 at step 6, ...; only the last rank recompiles for the
short batch. The ranks end up with different graphs, and each lone recompile
stalls every other rank in DDP's all-reduce.

With the service (``compiler_collectives.enable(guards=True)``) the guard
collective notices the first rank whose guards miss and every rank recompiles
at that same step; the compiler collective then sees that the lengths differ
across ranks and makes that dim dynamic everywhere. All ranks end with the
same graphs and the same dynamic dims.

Run it
------
``scripts/dev demo`` (or ``python scripts/demo.py``; ``--help`` for the
options) launches the ranks itself; under ``torchrun --nproc-per-node 4
scripts/demo.py`` each process runs its own rank and rank 0 prints the table.

How to read it
--------------
``train()`` is the part to copy: it is an ordinary DDP training loop plus one
call, ``compiler_collectives.enable(guards=True)``. Everything else here
(launching rank processes, the timeout, the table) is scaffolding.

Only ``format_table`` builds text, and ``main`` prints it. This is not part of
the library: it is an example of using it, kept out of the package.
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
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import compiler_collectives

log = logging.getLogger("compiler_collectives.demo")


# ----------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Run:
    """One way of running the training; each run gets fresh rank processes."""

    name: str
    use_service: bool
    guards: bool
    description: str
    must_finish: bool = True  # False: a hang is what this run demonstrates


RUNS: dict[str, Run] = {
    "off": Run("off", False, False, "without the service (torch's default: each rank decides alone)"),
    "on": Run("on", True, True, "with the service (compiler + guard collectives)"),
    # Not in the default set: compiler collectives alone cannot cope with one
    # rank recompiling by itself (its collective waits for ranks that never
    # come), which is exactly what the guard collective prevents. Selecting
    # it shows what a hang looks like here: a bounded timeout.
    "compiler-only": Run(
        "compiler-only",
        True,
        False,
        "compiler collectives without guard collectives (expected to hang, then time out)",
        must_finish=False,
    ),
}

DEFAULT_RUNS = ("off", "on")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    nproc: int = 4
    steps: int = 30
    backend: str = "aot_eager"
    timeout: float = 120.0
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


def train(
    rank: int,
    world: int,
    use_service: bool,
    cfg: DemoConfig,
    *,
    guards: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Train ``cfg.steps`` steps on this rank; the default process group must exist.

    Returns plain data (counts, dims, timings) for the table.
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
        # the library default, so a hang under torchrun is bounded too.
        compiler_collectives.config.set_value("timeout_s", cfg.timeout)
    else:
        compiler_collectives.disable()

    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    model = TinyLM(cfg.vocab, cfg.d_model, cfg.heads, cfg.layers, max_length(cfg))
    recorder = CompileRecorder(cfg.backend)
    # DDP around the compiled model: DDP's hooks all-reduce the gradients
    # that the compiled backward produces.
    ddp = nn.parallel.DistributedDataParallel(torch.compile(model, backend=recorder))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr)

    loss_value = math.nan
    started = time.perf_counter()
    for step in range(cfg.steps):
        tokens, targets = make_batch(cfg, rank, world, step)
        loss = ddp(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if on_step is not None:
            on_step(step, loss_value)
    elapsed = time.perf_counter() - started

    s = compiler_collectives.stats()
    all_dims = merge_dims(recorder.graphs)
    return {
        "rank": rank,
        "compiles": recorder.compiles,
        "recompiles": recorder.recompiles,
        "graphs": len(recorder.graphs),
        "graph_dims": recorder.graphs,
        "dynamic_dims": all_dims,
        "compiler_collectives": s["compiler_collectives"],
        "guard_collectives": s["guard_collectives"],
        "forced_recompiles": s["forced_recompiles"],
        "collective_time_s": s["compiler_time_s"] + s["guard_time_s"],
        "steps": cfg.steps,
        "train_time_s": elapsed,
        "steps_per_s": cfg.steps / elapsed if elapsed > 0 else math.inf,
        "final_loss": loss_value,
    }


def decisions(result: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    """What must be equal on every rank: the graphs, each with its dynamic dims."""
    return tuple(tuple(g) for g in result["graph_dims"])


# ---------------------------------------------------------- results of a run


@dataclasses.dataclass
class RankOutcome:
    rank: int
    status: str  # "finished", "timed out", "error", "died"
    result: dict[str, Any] | None = None
    last_step: int = -1  # last step this rank completed
    error: str | None = None  # traceback or reason
    pid: int | None = None  # of the rank process (None under torchrun)
    stuck_at: str | None = None  # where a killed rank was waiting, from its stack


@dataclasses.dataclass
class RunOutcome:
    run: Run
    ranks: list[RankOutcome]
    elapsed_s: float
    log_dir: str | None = None  # kept only when something went wrong

    @property
    def finished(self) -> bool:
        return all(r.status == "finished" for r in self.ranks)

    @property
    def timed_out(self) -> bool:
        return any(r.status == "timed out" for r in self.ranks)

    @property
    def agree(self) -> bool | None:
        """Whether every rank made the same compile decisions (None: unknown)."""
        if not self.finished:
            return None
        first = decisions(self.ranks[0].result)  # type: ignore[arg-type]
        return all(decisions(r.result) == first for r in self.ranks)  # type: ignore[arg-type]


# ------------------------------------------------- running ranks as processes


def _rank_main(rank: int, world: int, run_name: str, cfg: DemoConfig, run_dir: str, messages: Any) -> None:
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
        dist.init_process_group(
            "gloo",
            init_method="file://" + os.path.join(run_dir, "store"),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg.timeout),
        )

        def on_step(step: int, loss: float) -> None:
            messages.put(("step", rank, step, loss))

        result = train(rank, world, run.use_service, cfg, guards=run.guards, on_step=on_step)
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
    deadline (or shortly after another rank failed) are killed.
    """
    ctx = _mp_context()
    run_dir = tempfile.mkdtemp(prefix=f"cc-demo-{run.name}-")
    messages = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, cfg.nproc, run.name, cfg, run_dir, messages),
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
                if rank == 0 and _should_log(step, cfg):
                    progress(_progress_line(run.name, step, cfg, loss, time.monotonic() - started))
            elif kind == "done":
                o.status, o.result = "finished", message[2]
            elif kind == "error":
                o.status, o.error = "error", message[2]
                failed_at = failed_at or time.monotonic()
                progress(f"  [{run.name}] rank {rank} failed: {_last_line(o.error)}")
        interrupted = False
    finally:
        # Ranks that reported are exiting: give them a moment. Otherwise we are
        # past the deadline (or interrupted): no more waiting.
        all_reported = all(o.status != "running" for o in outcomes)
        _reap(procs, grace_s=5.0 if all_reported else 0.0)
        messages.close()
        messages.cancel_join_thread()
        if interrupted:  # nobody will be shown the logs
            shutil.rmtree(run_dir, ignore_errors=True)
    for o in outcomes:
        if o.status == "running":
            o.status = "timed out" if failed_at is None else "killed"
            o.stuck_at = stuck_at(_read(os.path.join(run_dir, f"rank{o.rank}.log")))
    elapsed = time.monotonic() - started
    outcome = RunOutcome(run, outcomes, elapsed)
    if all(o.status == "finished" for o in outcomes):
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        outcome.log_dir = run_dir
    return outcome


def _reap(procs: Sequence[Any], grace_s: float) -> None:
    """Give children ``grace_s`` to exit; ask the rest where they are stuck, kill them, join all."""
    grace = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:  # None: never started
            p.join(timeout=max(0.0, grace - time.monotonic()))
    stuck = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in stuck:
        try:
            os.kill(p.pid, _STACK_SIGNAL)  # faulthandler writes its stack to the rank's log
        except (OSError, TypeError):
            pass
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


def stuck_at(log_text: str) -> str | None:
    """Where a rank was stuck, from the last stack faulthandler wrote to its log.

    Returns e.g. ``all_gather_bytes (gloo.py:187) <- train (demo.py:301)``:
    the innermost frame, then the training loop's line that led there.
    """
    marker = "(most recent call first):"
    at = log_text.rfind(marker)
    if at < 0:
        return None
    frames = []
    for line in log_text[at + len(marker) :].splitlines()[1:]:
        line = line.strip()
        if not line.startswith("File "):
            break
        # File "/path/x.py", line 12 in func
        try:
            path = line.split('"')[1]
            lineno = line.split(", line ")[1].split(" ")[0]
            func = line.rsplit(" in ", 1)[1]
        except IndexError:
            continue
        frames.append((path, f"{func} ({os.path.basename(path)}:{lineno})"))
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
    try:
        for name in cfg.runs:
            run = RUNS[name]
            progress("")
            progress(f"run '{name}': {run.description}")
            # A fresh start for each run, as if in a new process.
            torch._dynamo.reset()
            compiler_collectives.reset()
            compiler_collectives.reset_stats()
            started = time.monotonic()

            def on_step(step: int, loss: float, _name: str = name, _t0: float = started) -> None:
                if rank == 0 and _should_log(step, cfg):
                    progress(_progress_line(_name, step, cfg, loss, time.monotonic() - _t0))

            result = train(rank, world, run.use_service, cfg, guards=run.guards, on_step=on_step)
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(result, gathered, dst=0)
            if gathered is not None:
                ranks = [RankOutcome(r, "finished", res, cfg.steps - 1) for r, res in enumerate(gathered)]
                outcomes.append(RunOutcome(run, ranks, time.monotonic() - started))
                progress(f"  [{name}] finished in {time.monotonic() - started:.1f}s")
        compiler_collectives.disable()
    finally:
        dist.destroy_process_group()
    return outcomes if rank == 0 else None


# ---------------------------------------------------------------- the table


_COLUMNS = (
    ("run", "<"),
    ("rank", ">"),
    ("compiles", ">"),
    ("recompiles", ">"),
    ("graphs", ">"),
    ("dynamic dims", "<"),
    ("guard colls", ">"),
    ("forced", ">"),
    ("coll time", ">"),
    ("steps/s", ">"),
    ("status", "<"),
)


def _row(run: RunOutcome, o: RankOutcome, steps: int) -> list[str]:
    r = o.result
    if o.status == "finished" and r is not None:
        status = "finished"
    elif o.status == "timed out":
        status = f"timed out in step {o.last_step + 2}/{steps}"
    elif o.status == "killed":
        status = f"killed after a peer failed (in step {o.last_step + 2}/{steps})"
    else:
        status = f"{o.status}: {_last_line(o.error)}"[:60]
    if r is None:
        return [run.run.name, str(o.rank)] + ["?"] * 8 + [status]
    return [
        run.run.name,
        str(o.rank),
        str(r["compiles"]),
        str(r["recompiles"]),
        str(r["graphs"]),
        " ".join(r["dynamic_dims"]) or "-",
        str(r["guard_collectives"]),
        str(r["forced_recompiles"]),
        f"{r['collective_time_s']:.3f}s",
        f"{r['steps_per_s']:.2f}",
        status,
    ]


def format_table(outcomes: Sequence[RunOutcome], steps: int) -> str:
    """One per-rank table for all runs, then a line per run on whether ranks agree."""
    header = [name for name, _ in _COLUMNS]
    rows: list[list[str]] = []
    breaks: set[int] = set()
    for run in outcomes:
        if rows:
            breaks.add(len(rows))
        rows.extend(_row(run, o, steps) for o in run.ranks)
    widths = [
        max(len(header[i]), *(len(row[i]) for row in rows)) if rows else len(header[i]) for i in range(len(header))
    ]

    def fmt(cells: Sequence[str]) -> str:
        parts = []
        for cell, width, (_, align) in zip(cells, widths, _COLUMNS):
            parts.append(cell.ljust(width) if align == "<" else cell.rjust(width))
        return "  ".join(parts).rstrip()

    rule = "-" * len(fmt(["-" * w for w in widths]))
    lines = [fmt(header), rule]
    for i, row in enumerate(rows):
        if i in breaks:
            lines.append(rule)
        lines.append(fmt(row))
    lines.append(rule)
    lines.append("")
    for run in outcomes:
        lines.append(f"{run.run.name:>13}: {run.run.description}")
        lines.append(" " * 15 + _verdict(run))
    return "\n".join(lines)


def _verdict(run: RunOutcome) -> str:
    if run.agree is None:
        what = "did not finish within the timeout; its ranks were killed" if run.timed_out else "did not finish"
        lines = [what + (f" (rank logs: {run.log_dir})" if run.log_dir else "")]
        for o in run.ranks:
            if o.stuck_at:
                lines.append(f"rank {o.rank} was stuck in {o.stuck_at}")
        return ("\n" + " " * 17).join(lines)
    if run.agree:
        example = run.ranks[0].result
        assert example is not None
        return f"finished in {run.elapsed_s:.0f}s; same compile decisions on every rank: {_describe_decisions(example)}"
    # Group ranks by their decisions so the difference is plain to see.
    groups: dict[tuple, list[int]] = {}
    for o in run.ranks:
        assert o.result is not None
        groups.setdefault(decisions(o.result), []).append(o.rank)
    parts = []
    for ranks in groups.values():
        example = run.ranks[ranks[0]].result
        assert example is not None
        who = "rank" + ("s " if len(ranks) > 1 else " ") + ",".join(map(str, ranks))
        parts.append(f"{who}: {_describe_decisions(example)}")
    return f"finished in {run.elapsed_s:.0f}s; DIFFERENT compile decisions across ranks:\n" + "\n".join(
        " " * 17 + p for p in parts
    )


def _describe_decisions(result: dict[str, Any]) -> str:
    graphs = result["graph_dims"]
    shown = ["static" if not g else "dynamic " + " ".join(g) for g in graphs]
    return f"{len(graphs)} graph{'s' if len(graphs) != 1 else ''} ({'; '.join(shown)})"


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
        "finished": run.finished,
        "agree": run.agree,
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


def add_demo_parser(subparsers: Any) -> None:
    d = DemoConfig()
    runs_help = "; ".join(f"'{name}': {run.description}" for name, run in RUNS.items())
    p = subparsers.add_parser(
        "demo",
        help="train a small DDP + torch.compile model without and with the service, compare ranks",
        description=(
            "Train a tiny transformer language model with DistributedDataParallel (gloo, CPU) and "
            "torch.compile on several ranks that see different sequence lengths, once without "
            "and once with compiler_collectives, each run in fresh rank processes. Prints a "
            "per-rank table (compiles, recompiles, graphs, dynamic dims, guard collectives, "
            "forced recompiles, time in collectives, steps/s, status) and whether every rank "
            "made the same compile decisions. Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT set) it runs only this rank's part and rank 0 prints the table."
        ),
        epilog=(
            "Exit status: 0 when every run that should finish finished and the service run's "
            "ranks agree; 1 otherwise; 2 for bad options."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--nproc",
        type=_positive_int,
        default=d.nproc,
        metavar="N",
        help="number of ranks (processes) to launch; ignored under torchrun",
    )
    p.add_argument(
        "--steps", type=_positive_int, default=d.steps, metavar="N", help="training steps per run (at least 2)"
    )
    p.add_argument(
        "--backend",
        default=d.backend,
        metavar="NAME",
        help="torch.compile backend, e.g. aot_eager, eager, inductor (inductor needs a C++ compiler)",
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
        "--runs",
        type=_run_list,
        default=",".join(DEFAULT_RUNS),
        metavar="LIST",
        help=f"comma-separated runs to do, in order. {runs_help}",
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


def cmd_demo(args: argparse.Namespace) -> int:
    demo = sys.modules[__name__]

    if args.steps < 2:
        print("demo: --steps must be at least 2", file=sys.stderr)
        return 2
    if args.nproc < 2 and not demo.launched_by_torchrun():
        print("demo: --nproc must be at least 2 (the point is ranks that disagree)", file=sys.stderr)
        return 2
    cfg = demo.DemoConfig(
        nproc=args.nproc,
        steps=args.steps,
        backend=args.backend,
        timeout=args.timeout,
        runs=args.runs,
        batch_size=args.batch_size,
        seed=args.seed,
        log_every=args.log_every,
    )
    started = time.monotonic()

    if demo.launched_by_torchrun():
        is_rank0 = os.environ.get("RANK") == "0"
        say = _say if is_rank0 else (lambda line="": None)
        say(
            f"compiler_collectives demo under torchrun: {os.environ['WORLD_SIZE']} ranks, "
            f"{cfg.steps} steps, backend {cfg.backend}"
        )
        outcomes = demo.run_this_rank(cfg, progress=say)
        if outcomes is None:
            return 0
    else:
        _say(
            f"compiler_collectives demo: {cfg.nproc} ranks (gloo, CPU), {cfg.steps} steps per run, "
            f"backend {cfg.backend}, timeout {cfg.timeout:.0f}s per run"
        )
        _say(
            textwrap.fill(
                f"Ranks see different sequence lengths: all start at {cfg.base_length} tokens; "
                "ranks 1.. switch to other lengths one after another (rank 0 never), and the last "
                "rank's final batch is short.",
                width=100,
            )
        )
        outcomes = []
        for name in cfg.runs:
            run = demo.RUNS[name]
            _say()
            _say(f"run '{name}': {run.description}")
            outcome = demo.launch_run(run, cfg, progress=_say)
            state = "finished" if outcome.finished else ("timed out" if outcome.timed_out else "failed")
            _say(f"  [{name}] {state} in {outcome.elapsed_s:.1f}s")
            outcomes.append(outcome)

    _say()
    _say(demo.format_table(outcomes, cfg.steps))
    _say()
    _say(
        textwrap.fill(
            "compiles: Dynamo frame compilations, recompiles: those of an already compiled frame; "
            "graphs: graphs handed to the backend; dynamic dims: graph inputs with symbolic sizes; "
            "guard colls: guard collectives run; forced: recompiles this rank did only because "
            "another rank's guards missed; coll time: time spent in compiler + guard collectives "
            "(mostly waiting for slower ranks); steps/s: over the whole run, compiles included.",
            width=100,
        )
    )
    _say(f"total wall time {time.monotonic() - started:.1f}s")
    for outcome in outcomes:
        if outcome.ranks and any(o.error for o in outcome.ranks):
            _say()
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
