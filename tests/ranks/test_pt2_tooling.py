"""What PT2's own tooling shows of us: tlparse artifacts, recompile reasons, TORCH_LOGS (issue 12),
and compile once's artifact and compile-time events (issue 29). What each artifact says, built
from given observations without a rank: ``tests/unit/test_tooling_artifacts.py``."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from tests.fixtures import cache_per_rank, clean_env, once_per_run, shared_cache
from tests.harness import run_ranks
from tests.ranks.test_compile_once import ENV as ONCE_ENV
from tests.ranks.test_compile_once import job as once_job
from tests.rankside import kept_logs

# Multi-process tests here: torch seam (tests/tiers.py).
pytestmark = pytest.mark.torch_seam


def _step(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


def _last_recompile_reason() -> str | None:
    import torch._dynamo.utils as dynamo_utils

    return dynamo_utils.get_compilation_metrics()[-1].recompile_reason


def one_rank_changes_size(rank: int, world: int, missing: list[int]) -> dict:
    """Every rank compiles with size 8; then the ranks in ``missing`` see 8 + rank and miss."""
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(8, 4))
    f(torch.ones(8 + rank if rank in missing else 8, 4))
    s = cc.stats()
    return {
        "reason": _last_recompile_reason(),
        "forced": s["forced_recompiles"],
        "exchanges": s["guard_reason_exchanges"],
    }


def _tlparse() -> str:
    found = shutil.which("tlparse", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    assert found, "tlparse is not installed (it is in the dev extras: pip install -e '.[dev]')"
    return found


def _artifacts_by_compile(trace_dir: pathlib.Path, rank: int, out: pathlib.Path) -> dict[str, dict]:
    """tlparse over one rank's trace: compile id -> {artifact file name: parsed JSON, or text}.

    Dynamo writes a single recompile reason as a bare string in a "json" artifact.
    """
    (log,) = trace_dir.glob(f"dedicated_log_torch_trace_rank_{rank}_*.log")
    proc = subprocess.run(
        [_tlparse(), str(log), "-o", str(out), "--no-browser", "--overwrite"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    directory = json.loads((out / "compile_directory.json").read_text())
    found: dict[str, dict] = {}
    for compile_id, entry in directory.items():
        found[compile_id] = {}
        for artifact in entry["artifacts"]:
            if artifact["name"].endswith(".json"):
                text = (out / artifact["url"]).read_text()
                try:
                    found[compile_id][artifact["name"]] = json.loads(text)
                except json.JSONDecodeError:
                    found[compile_id][artifact["name"]] = text
    return found


def _named(artifacts: dict, prefix: str) -> list[dict]:
    """The artifacts of one name, in the order they were written (tlparse numbers them)."""
    chosen = [(int(n.rsplit("_", 1)[1].split(".")[0]), v) for n, v in artifacts.items() if n.startswith(prefix + "_")]
    return [v for _, v in sorted(chosen, key=lambda item: item[0])]


@pytest.mark.multiprocess
def test_the_rank_that_hit_records_the_rank_that_missed_and_its_reason():
    outcome = run_ranks(one_rank_changes_size, 2, args=([1],))
    hit, missed = outcome.results
    own = missed["reason"]
    assert "tensor 'x' size mismatch at index 0. expected 8, actual 9" in own
    assert hit["reason"] == f"forced by the guard collective: rank 1 missed: {own}"
    assert (hit["forced"], missed["forced"]) == (1, 0)
    assert hit["exchanges"] == missed["exchanges"] == 1


def _reasons_logged(rank: int, world: int) -> dict:
    """Dynamo's own recompile log (TORCH_LOGS=recompiles), captured on each rank."""
    import torch._logging

    import compiler_collectives as cc

    torch._logging.set_logs(recompiles=True)
    lines = kept_logs("torch._dynamo.guards.__recompiles", "NOTSET")
    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(8, 4))
    f(torch.ones(8, 4, dtype=torch.float64) if rank in (1, 2) else torch.ones(8, 4))
    return {"log": "\n".join(lines), "metric": _last_recompile_reason()}


@pytest.mark.multiprocess
def test_a_rank_that_missed_keeps_its_reason_and_gains_the_other_ranks_that_missed():
    outcome = run_ranks(_reasons_logged, 3)
    logs = [r["log"] for r in outcome.results]
    own = {rank: outcome.results[rank]["metric"] for rank in (1, 2)}
    for rank, other in ((1, 2), (2, 1)):
        assert "tensor 'x' dtype mismatch" in own[rank]  # Dynamo's own reason comes first
        assert f"- {own[rank]}\n" in logs[rank]
        assert f"the guard collective saw other ranks miss too: rank {other}: {own[other]}" in logs[rank]
        assert "forced by the guard collective" not in logs[rank]
    forced = f"forced by the guard collective: rank 1 missed: {own[1]}; rank 2 missed: {own[2]}"
    assert outcome.results[0]["metric"] == forced
    assert f"- {forced}" in logs[0]


def no_miss(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    for _ in range(5):
        f(torch.ones(8, 4))
    s = cc.stats()
    return {"guard": s["guard_collectives"], "exchanges": s["guard_reason_exchanges"]}


@pytest.mark.multiprocess
def test_when_every_rank_hits_no_reasons_are_exchanged():
    outcome = run_ranks(no_miss, 2)
    assert outcome.results == [{"guard": 4, "exchanges": 0}] * 2


# ---------------------------------------------------------------- compile once (issue 29)

ONCE_EVENTS = ("compile_once", "compile_once_wait", "compile_once_finish")
# The compiles of the traced job: its first frame's two (one rank changes size), then compile once's graph.
CHANGES = ("[0/0]", "[0/1]")
ONCE = "[1/0]"


def once_job_timed(rank: int, world: int) -> dict:
    """Compile once's small training step (one graph: forward and backward), and the time each of
    our events took in Dynamo's compile timings (what ``compile_times()`` prints)."""
    import torch._dynamo.utils as dynamo_utils

    out = once_job(rank, world, {})
    out["timed"] = {k: list(v) for k, v in dynamo_utils.compilation_time_metrics.items() if k in ONCE_EVENTS}
    return out


def traced_job(rank: int, world: int) -> dict:
    """First one rank changes size (``one_rank_changes_size``, the eager backend: the compiles
    ``CHANGES``), then compile once's step as a fresh rank runs it (guards off: ``ONCE``)."""
    import compiler_collectives as cc

    one_rank_changes_size(rank, world, [1])
    cc.disable()
    return once_job_timed(rank, world)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict:
    """One 2-rank job with TORCH_TRACE on (``traced_job``): a recompile the guard collective forced,
    then an inductor graph under compile once with a cache dir per rank (the artifact travels over
    gloo); each rank's trace read by tlparse. Shared by the tests that read PT2's tooling: one pair
    of spawned ranks (each imports torch with the variable set) instead of one per test, and one
    per test run (``once_per_run``)."""
    return once_per_run(tmp_path_factory, "pt2-traced", _traced)


def _traced(tmp: pathlib.Path) -> dict:
    trace_dir = tmp / "trace"
    env = {**ONCE_ENV, "TORCH_TRACE": str(trace_dir), **shared_cache(tmp)}
    rank_env = cache_per_rank(tmp, 2)
    # spawn: TORCH_TRACE is read when torch is imported
    outcome = run_ranks(traced_job, 2, env=env, rank_env=rank_env, start_method="spawn", timeout=300)
    for r in outcome.results:
        assert r["type"] is None, r
    artifacts_, events = [], []
    for rank in (0, 1):
        out = tmp / f"tlparse{rank}"
        artifacts_.append(_artifacts_by_compile(trace_dir, rank, out))
        events.append(json.loads((out / "chromium_events.json").read_text()))
    return {"results": outcome.results, "artifacts": artifacts_, "events": events}


def _ranks_by_state(results: list) -> tuple[int, int]:
    """(the rank that compiled, the rank that loaded) the job's one graph."""
    states = [r["records"][-1]["state"] for r in results]
    assert sorted(states) == ["compiled", "loaded"], states
    return states.index("compiled"), states.index("loaded")


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_tlparse_files_our_artifacts_under_the_compile_they_belong_to(traced):
    for rank in (0, 1):
        compiles = traced["artifacts"][rank]
        assert set(compiles) == {*CHANGES, ONCE}  # the second frame is compile once's, below
        first, recompile = (compiles[c] for c in CHANGES)

        # the first compile: an input exchange and an end-of-trace exchange, nothing differs
        inputs, trace = _named(first, "compiler_collective")
        assert (inputs["phase"], trace["phase"]) == ("inputs", "trace")
        assert (
            inputs["entries"]
            == trace["entries"]
            == [{"L['x']": {"scalar": "?", "size": [8, 4], "stride": ["S(1)", 1]}}] * 2
        )
        assert trace["dynamic"] == []
        assert trace["restart"] is False and trace["restart_skipped"] is True and trace["restart_why"]
        assert trace["rounds"] == 1 and trace["bytes_received"] == 2 * trace["bytes_sent"] > 0
        assert trace["time_ms"] >= 0 and trace["rank"] == rank and trace["world_size"] == 2

        # the recompile the guard collective agreed on: who missed and why, then the exchanges
        (guard,) = _named(recompile, "guard_collective")
        assert guard["missed_ranks"] == [1]
        assert guard["forced"] is (rank == 0)
        assert "size mismatch at index 0. expected 8, actual 9" in guard["reasons_by_rank"]["1"][0]
        (reasons,) = _named(recompile, "recompile_reasons")
        assert reasons == guard["recorded_reasons"][0]
        _, trace = _named(recompile, "compiler_collective")
        (dim0,) = trace["dynamic"]
        assert dim0 == {
            "source": "L['x']",
            "what": "size",
            "dim": 0,
            "values": {"0": 8, "1": 9},
            "ranks": [1],
            "why": "differs across ranks",
        }


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_each_rank_writes_a_compile_once_artifact_saying_who_compiled_who_loaded_bytes_and_wait(traced):
    results = traced["results"]
    compiler, loader = _ranks_by_state(results)
    found = {}
    for rank in (0, 1):
        compiles = traced["artifacts"][rank]
        assert not any(_named(compiles[c], "compile_once") for c in CHANGES)  # none for the eager backend's
        (found[rank],) = _named(compiles[ONCE], "compile_once")  # one per graph
    plan = {str(compiler): {"role": "compile", "source": compiler}, str(loader): {"role": "load", "source": compiler}}
    for rank, artifact in found.items():
        record = results[rank]["records"][-1]
        assert artifact["rank"] == rank and artifact["world_size"] == 2
        assert (artifact["seq"], artifact["frame"], artifact["level"], artifact["key"]) == (
            record["seq"],
            record["frame"],
            "aot",
            record["key"],
        )
        assert artifact["key"] and "_step" in artifact["frame"]
        assert (artifact["state"], artifact["why"]) == (record["state"], record["why"])
        assert artifact["plan"] == plan
        assert (artifact["compiled_by"], artifact["loaders"]) == ([compiler], [loader])
        assert artifact["served_by"] == artifact["compiled_locally"] == []
        assert artifact["time_ms"] >= artifact["wait_ms"] >= 0
    compiled, loaded = found[compiler], found[loader]
    assert (compiled["state"], compiled["role"], compiled["source"]) == ("compiled", "compile", compiler)
    assert (compiled["bytes_received"], compiled["wait_ms"]) == (0, 0)
    assert (loaded["state"], loaded["role"], loaded["source"]) == ("loaded", "load", compiler)
    assert (loaded["outcome"], loaded["outcome_why"]) == ("hit", None)
    # the bytes that crossed, and the wait for the compiling rank, as the rank counted them
    sent = results[compiler]["stats"]["once_bytes_sent"]
    assert loaded["bytes_received"] == results[loader]["stats"]["once_bytes_received"] == sent > 0
    assert loaded["wait_ms"] > 0
    assert loaded["wait_ms"] == pytest.approx(results[loader]["records"][-1]["waited_s"] * 1e3, abs=1)


def _spans(events: list[dict]) -> list[dict]:
    """Chromium begin/end events paired: name, args (the end event's), duration (s) and the names
    of the events open around it. Ours must nest properly with every other event (torch's own are
    not checked among themselves)."""
    stack: list[dict] = []
    spans = []
    for e in sorted((e for e in events if e.get("ph") in ("B", "E")), key=lambda e: e["ts"]):
        if e["ph"] == "B":
            stack.append({"name": e["name"], "ts": e["ts"], "outer": [s["name"] for s in stack]})
            continue
        at = max(i for i, s in enumerate(stack) if s["name"] == e["name"])
        crossed = [s["name"] for s in stack[at:]]
        assert len(crossed) == 1 or not set(crossed) & set(ONCE_EVENTS), f"{e['name']} ends inside {crossed[1:]}"
        span = stack.pop(at)
        spans.append({**span, "args": e.get("args") or {}, "s": (e["ts"] - span["ts"]) / 1e6})
    assert not set(ONCE_EVENTS) & {s["name"] for s in stack}, [s["name"] for s in stack]
    return spans


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_each_graph_s_record_times_its_exchanges_files_and_bytes_apart_from_its_compile_and_wait(traced):
    results = traced["results"]
    compiler, loader = _ranks_by_state(results)
    for rank in (compiler, loader):
        record = results[rank]["records"][-1]
        parts = [record[k] for k in ("exchange_s", "install_s", "transfer_s", "waited_s")]
        # every rank takes the exchanges, handles the artifact's files and moves its bytes
        assert all(p > 0 for p in parts[:3]), (rank, record)
        assert record["span_s"] >= sum(parts) - 1e-3, (rank, record)
        assert record["artifact_bytes"] == results[compiler]["stats"]["once_bytes_sent"] > 0
    made, took = results[compiler]["records"][-1], results[loader]["records"][-1]
    assert made["wait_ended_at"] is None and took["posted_at"] is None
    # the loader's wait ended after the compiling rank posted (one host's clock)
    assert took["wait_ended_at"] >= made["posted_at"] - 1e-3


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_a_loading_rank_s_wait_is_a_dynamo_timed_event_of_its_own_inside_the_backend_compile(traced):
    results = traced["results"]
    compiler, loader = _ranks_by_state(results)
    waited_s = results[loader]["records"][-1]["waited_s"]
    # Dynamo's compile timings (torch._dynamo.utils.compile_times()) attribute it by our names.
    timed = results[loader]["timed"]
    (wait_s,) = timed["compile_once_wait"]
    assert wait_s >= waited_s - 1e-3 and waited_s > 0
    (whole_s,) = timed["compile_once"]
    assert whole_s >= wait_s
    assert "compile_once_finish" not in timed  # a loader's exchanges all run inside its wait
    assert "compile_once_wait" not in results[compiler]["timed"]
    assert len(results[compiler]["timed"]["compile_once_finish"]) == 1
    # The chromium events of TORCH_TRACE (tlparse's trace view): nested in torch's own, role added.
    spans = {rank: _spans(traced["events"][rank]) for rank in (0, 1)}
    (wait,) = [s for s in spans[loader] if s["name"] == "compile_once_wait"]
    assert wait["outer"][-2:] == ["backend_compile", "compile_once"], wait["outer"]
    assert wait["args"]["compile_id"] == ONCE.strip("[]")
    assert (wait["args"]["role"], wait["args"]["source"], wait["args"]["seq"]) == ("load", compiler, 1)
    assert wait["args"]["waited_s"] == pytest.approx(waited_s, abs=1e-3)
    assert wait["args"]["bytes_received"] == results[loader]["stats"]["once_bytes_received"] > 0
    assert wait["s"] == pytest.approx(wait_s, abs=0.05)
    # The compiling rank: its whole compile is work for others (role "compile"), its finish too.
    (whole,) = [s for s in spans[compiler] if s["name"] == "compile_once"]
    assert "backend_compile" in whole["outer"] and whole["args"]["role"] == "compile"
    (finish,) = [s for s in spans[compiler] if s["name"] == "compile_once_finish"]
    assert finish["outer"][-1] == "compile_once" and finish["args"]["role"] == "compile"
    assert not [s for s in spans[compiler] if s["name"] == "compile_once_wait"]


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = clean_env(drop=("TORCH_",))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**clean, **env}
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "spec, level",
    [
        # TORCH_LOGS's registration of our loggers is torch's: one spec pins it per release.
        pytest.param("compiler_collectives", "INFO", marks=pytest.mark.release_independent),
        ("+compiler_collectives", "DEBUG"),
    ],
)
def test_torch_logs_sets_the_level_of_our_loggers(spec, level):
    proc = _python(
        "import logging, torch\n"
        "print(logging.getLevelName(logging.getLogger('compiler_collectives.guard').getEffectiveLevel()))",
        TORCH_LOGS=spec,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == level
