"""Traces and artifacts come from records: the ledger's readers write them, nothing else does.

* The ledger offers every record it adds to each of its readers, once counted; a guard call
  reaches its guard reader only when the hook timed it (it takes the clock only while one is
  registered, and timing on is what registers one).
* The timing reader turns each record into the Chrome trace event the trace has always held.
* No module but the readers (``instrument/timing.py``, ``dynamo/tooling.py``) writes a trace
  event or a structured-trace artifact: none names torch's structured trace or timing's
  recorder, and none but the composition root names a reader, and then only to register it.
  Shown failing on mutations of the real tree, as ``tests/contract/test_layering.py`` does.
"""

from __future__ import annotations

import ast
import functools
import json

import pytest

from compiler_collectives import records
from compiler_collectives.instrument import timing
from compiler_collectives.ledger import Ledger, ledger
from tests.contract.test_layering import TOP, TREE, Tree, mutated

# The ledger's readers: the only modules that write a trace event or one of our artifacts.
READERS = {f"{TOP}.instrument.timing", f"{TOP}.dynamo.tooling"}
# What writes them: torch's structured trace, timing's recorder (and what makes one).
WRITERS = {"trace_structured", "recorder", "Recorder", "ensure"}
# The readers' modules, by the names the package binds them to, and each one's reader.
READER_MODULES = {"timing", "tooling"}
READ = "read"
# The composition root registers the readers: there only, a reader is named, as an argument of:
REGISTERING = {"add_reader", "remove_reader"}


@functools.cache
def _nodes(text: str) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(text)))


def _names_a_writer(node: ast.AST) -> str | None:
    """The writer ``node`` names: ``trace_structured``, ``x.recorder``, ``x["trace_structured"]``,
    ``getattr(x, "trace_structured")``, ``from .timing import recorder``."""
    if isinstance(node, ast.Name) and node.id in WRITERS:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in WRITERS:
        return node.attr
    key = node.slice if isinstance(node, ast.Subscript) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
        key = node.args[1] if len(node.args) > 1 else None
    if isinstance(key, ast.Constant) and key.value in WRITERS:
        return str(key.value)
    if isinstance(node, ast.ImportFrom):
        found = [a.name for a in node.names if a.name in WRITERS]
        return found[0] if found else None
    return None


def _names_a_reader(node: ast.AST) -> bool:
    """``timing.read`` / ``tooling.read``, or ``read`` imported from either module."""
    if isinstance(node, ast.Attribute) and node.attr == READ:
        return isinstance(node.value, ast.Name) and node.value.id in READER_MODULES
    if isinstance(node, ast.ImportFrom) and (node.module or "").rpartition(".")[2] in READER_MODULES:
        return any(a.name == READ for a in node.names)
    return False


def check_trace_writes(tree: Tree) -> list[str]:
    """Every place outside the ledger's readers that writes a trace event or an artifact of ours,
    or hands a reader anything but the ledger's ``add_reader``/``remove_reader``."""
    offences = []
    for module, src in tree.items():
        if module in READERS:
            continue
        nodes = _nodes(src.text)
        registered = {
            id(arg)
            for node in nodes
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REGISTERING
            for arg in node.args
        }
        for node in nodes:
            writer = _names_a_writer(node)
            if writer is not None:
                offences.append(f"{src.shown}:{node.lineno}: names {writer}, which only the ledger's readers use")
            elif _names_a_reader(node) and id(node) not in registered:
                offences.append(f"{src.shown}:{node.lineno}: a reader used outside the ledger's registration")
    return offences


def test_no_module_but_the_ledger_s_readers_writes_a_trace_event_or_an_artifact() -> None:
    assert check_trace_writes(TREE) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        # the old ways: the agreements feeding the recorder by hand
        ("agreements.compiler", "timing.recorder.compiler(record)"),
        ("agreements.once.graph", "rec = timing.ensure(0, 1)"),
        ("agreements.guard", "from ..instrument.timing import recorder"),
        # an artifact written straight into torch's structured trace
        ("dynamo.compiler_seam", "bound.originals['trace_structured']('artifact', payload_fn=p)"),
        ("dynamo.audit_seam", "torch._logging.trace_structured('artifact', payload_fn=p)"),
        ("dynamo.once_seam", "getattr(torch._logging, 'trace_structured')('artifact')"),
        # a reader called by hand, or handed to a lower layer as a sink
        ("dynamo.compiler_seam", "tooling.read(record)"),
        ("dynamo.wiring", "audit_verdict.set_artifact_sink(tooling.read)"),
        ("runtime", "from .instrument.timing import read"),
    ],
)
def test_the_trace_check_flags_an_event_or_artifact_written_outside_the_readers(module: str, snippet: str) -> None:
    assert check_trace_writes(mutated(f"{TOP}.{module}", snippet))


def test_the_trace_check_leaves_the_registration_of_the_readers_alone() -> None:
    snippet = """
    ledger.add_reader(tooling.read)
    ledger.remove_reader(timing.read)
    figures = timing.figures()
    """
    assert check_trace_writes(mutated(f"{TOP}.runtime", snippet)) == []


# ----------------------------------------------------------------- what the ledger offers its readers


def test_a_reader_is_offered_every_record_once_it_is_counted() -> None:
    book = Ledger()
    seen: list[tuple[object, int]] = []
    book.add_reader(lambda x: seen.append((x, book.counters()["errors"])))
    failure = records.Failure("audit")
    book.add(failure)
    assert seen == [(failure, 1)]


def test_a_reader_registered_twice_hears_each_record_once_and_a_removed_one_hears_nothing() -> None:
    book = Ledger()
    seen: list[object] = []
    book.add_reader(seen.append)
    book.add_reader(seen.append)
    book.add(records.PathsDiverged(1))
    book.remove_reader(seen.append)
    book.add(records.PathsDiverged(2))
    assert seen == [records.PathsDiverged(1)]


def test_a_reader_sees_every_rank_s_role_of_a_graph_and_the_ledger_keeps_the_graph_without_them() -> None:
    """What the artifact reads grows with the world; 256 graphs of it kept at 8,192 ranks would be
    two million entries: the ledger keeps the graph's record, not every rank's role."""
    book = Ledger()
    seen: list[records.OnceGraph] = []
    book.add_reader(seen.append)  # type: ignore[arg-type]
    roles = {r: ("load", 0) for r in range(1, 8192)} | {0: ("compile", None)}
    book.add(records.OnceGraph("compiled", 0, {"seq": 1}, rank=0, roles=roles))
    assert len(seen[0].roles) == 8192
    [kept] = book.kept(records.OnceGraph)
    assert kept.roles == {} and kept.record == {"seq": 1} and kept.ended == "compiled"


def test_reset_stats_keeps_the_readers() -> None:
    book = Ledger()
    seen: list[object] = []
    book.add_reader(seen.append)
    book.read_guards(lambda *call: None)
    book.clear()
    book.add(records.PathsDiverged(1))
    assert seen == [records.PathsDiverged(1)] and book.guard_reader is not None


def test_a_guard_call_reaches_the_guard_reader_only_when_the_hook_timed_it() -> None:
    book = Ledger()
    heard: list[tuple[int, float, int, bool, bool]] = []
    book.guard_call(0.25, True, True, 6, 1_000)  # no guard reader: counted only
    book.read_guards(lambda *call: heard.append(call))
    book.guard_call(0.25, False, False, 7, 0)  # untimed (the hook took no clock)
    book.guard_call(0.5, False, True, 8, 2_000)  # this rank hit, another missed
    assert heard == [(2_000, 0.5, 8, True, False)]
    assert book.counters()["guard_collectives"] == 3


def test_timing_on_registers_the_guard_reader_and_timing_off_removes_it() -> None:
    assert ledger.guard_reader is None  # timing off: the hook takes no clock
    timing.set_enabled(True)
    try:
        assert ledger.guard_reader is not None
    finally:
        timing.set_enabled(False)
        timing.set_enabled(None)
    assert ledger.guard_reader is None and timing.figures() is None


# ----------------------------------------------------------------- the timing reader's events


def test_the_timing_reader_writes_each_record_s_event_as_the_trace_has_always_held_it(tmp_path) -> None:
    recorder = timing.Recorder(1, 2, str(tmp_path))
    recorder.compiler(
        records.CompilerExchange(
            "trace", 1, 100, 200, 0.002, 0.0015, 0, seq=3, frame="f at x.py:1", started_ns=5_000, compile_id="0/1"
        )
    )
    recorder.guard(7_000, 0.000_01, 4, True, False)
    record = {"seq": 2, "frame": "f at x.py:1", "state": "loaded", "why": None, "source": 0}
    recorder.once(records.OnceGraph("loaded", 0, record, bytes_in=64, started_ns=1_000, finished_ns=3_001_000))
    recorder.close()
    events = json.loads((tmp_path / "rank1.json").read_text())
    compiler, guard, once = [e for e in events if e["ph"] == "X"]
    assert (compiler["name"], compiler["ts"], compiler["dur"], compiler["pid"]) == (
        "compiler collective",
        5.0,
        2000.0,
        1,
    )
    assert compiler["args"] == {
        "kind": "compiler",
        "seq": 3,
        "frame": "f at x.py:1",
        "compile_id": "0/1",
        "bytes_out": 100,
        "bytes_in": 200,
        "rounds": 1,
        "phase": "trace",
        "restart": None,
        "arrival_spread_ms": 1.5,
        "last_rank": 0,
    }
    assert (guard["name"], guard["ts"]) == ("guard collective", 7.0)
    assert guard["args"] == {
        "kind": "guard",
        "seq": 4,
        "hit": True,
        "agreed_hit": False,
        "bytes_out": 24,
        "bytes_in": 24,
    }
    assert (once["name"], once["dur"]) == ("compile once: loaded", 3000.0)
    assert once["args"] == {
        "kind": "compile_once",
        "seq": 2,
        "frame": "f at x.py:1",
        "state": "loaded",
        "why": "",
        "source": 0,
        "bytes_in": 64,
    }
    assert recorder.figures()["compiler"]["bytes"] == 300 and recorder.late_ranks == {0: 1}
