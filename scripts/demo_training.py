"""The training a user copies: one rank's DDP training loop under torch.compile, and the service's one call.

``train()`` is an ordinary DDP training loop plus one call,
``compiler_collectives.enable(guards=True)``. Around it: the tiny transformer
it trains, the per-rank data whose sequence lengths make the ranks recompile
at different steps, and what the loop measures for the report (which graphs
Dynamo compiled, and the wall and CPU seconds of every step). It all runs
inside a rank's process; starting the ranks is ``demo_launch``'s, the text
shown to the user ``demo_report``'s.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import compiler_collectives
from compiler_collectives.instrument import timing

try:
    import resource
except ImportError:  # not on Windows: CPU time of this process only
    resource = None  # type: ignore[assignment]


# ----------------------------------------------------------------- settings

# The runs (demo_launch.RUNS) done when none are named: the hazard, then the cure.
DEFAULT_RUNS = ("compiler-only", "on")


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
