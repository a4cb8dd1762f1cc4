"""The report printed to the user: what each run is about, what it came to, and what it cost.

Only the ``format_*`` functions here build text, from the ``RunOutcome`` of
each run (``demo_launch``); ``demo.py`` prints it.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from collections.abc import Sequence
from typing import Any

from demo_launch import (
    COMPILE_ONCE_ENV,
    RUNS,
    Run,
    RunOutcome,
    collective_timeout,
    decisions,
    exception_text,
    first_line,
)
from demo_training import DemoConfig, divergence_step


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def wrap(text: str, indent: str = "   ") -> list[str]:
    """A paragraph of the report: ``text`` with its line breaks dropped, 100 columns wide, indented."""
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
    return ["", title, *wrap(text)]


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
                lines.extend(wrap(paragraph, "       "))
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
            return f"rank {o.rank}: {first_line(exception_text(o.error), 300)}"
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
    lines += wrap(
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
        lines += wrap(
            f"Here {world} ranks share {cores} CPU cores, so most of this cost is CPU oversubscription: "
            "each forced recompile runs on the same cores at the same time as the recompile that caused "
            f"it{no_cache}, so every compile takes longer than it would on a core of its own. The "
            "collectives' times here, too, include waiting for a rank to get a core: with one rank per "
            f"core (--nproc {cores}) they are far smaller."
        )
    else:
        lines += wrap(
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
        lines += wrap(
            "Ranks share the run's inductor cache on disk, as ranks of one host do by default, so even "
            f"with {COMPILE_ONCE_ENV}=0 a rank may load a kernel that a peer compiled a moment before "
            "(--compile-cache per-rank: each rank its own, as on different hosts)."
        )
    else:
        lines += wrap(
            "Each rank had an inductor cache of its own, as ranks on different hosts or in containers do "
            "(--compile-cache shared: one dir for the run's ranks, where inductor's own file cache already "
            "lets a rank reuse C++ kernels a peer built)."
        )
    if unknown:
        lines += wrap(
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
