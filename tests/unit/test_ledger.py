"""Counts come from records: the ledger (``compiler_collectives/ledger.py``) is the one writer of
the counters of ``stats()``.

* No module but the ledger writes a counter: no assignment (``=``, ``+=``, ``setattr``) to an
  attribute or key named for a counter, and no write through the ledger's instance. Shown
  failing on mutations of the real tree, as ``tests/contract/test_layering.py`` does.
* Every kind of record has a row in the ledger's one table; one that lacks a row raises.
* The guard hook's ledger call allocates nothing (timing off: the hook took no clock); store
  requests counted from many threads all count; ``reset_stats()`` forgets every record and zeroes
  every counter. What the ledger offers its readers: ``tests/unit/test_ledger_readers.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import sys
import threading
import typing

import pytest

import compiler_collectives as cc
from compiler_collectives import ledger as ledger_module
from compiler_collectives import records
from compiler_collectives.ledger import COUNTERS, COUNTS, Ledger, ledger
from tests.contract.test_layering import TOP, TREE, Tree, mutated

LEDGER = f"{TOP}.ledger"
# Names a write through which is a write to the ledger's state, whatever the attribute.
LEDGER_NAMES = {"ledger", "_ledger"}


@functools.cache
def _nodes(text: str) -> tuple[ast.AST, ...]:
    """Every node of ``text``'s tree, once per text (each mutation checks the whole tree again)."""
    return tuple(ast.walk(ast.parse(text)))


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _writes_a_counter(target: ast.expr, module: str) -> bool:
    if isinstance(target, ast.Attribute) and (target.attr in COUNTERS or _root_name(target) in LEDGER_NAMES):
        return True
    if isinstance(target, ast.Subscript):
        key = target.slice
        snapshot = module == TOP and _root_name(target) == "out"
        if isinstance(key, ast.Constant) and key.value in COUNTERS and not snapshot:
            return True
        return _root_name(target) in LEDGER_NAMES
    return False


def check_counter_writes(tree: Tree) -> list[str]:
    """Every write of a counter outside the ledger: ``x.errors += 1``, ``x.errors = 0``,
    ``x["errors"] += 1``, ``setattr(x, "errors", ...)``, ``ledger.anything = ...``.

    ``out["..."]`` in the package root is left alone: ``stats()`` names its copy of the counters
    ``out``, and adds keys of its own to it."""
    offences = []
    for module, src in tree.items():
        if module == LEDGER:
            continue
        for node in _nodes(src.text):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = [t for t in node.targets]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                name = node.args[1] if len(node.args) > 1 else None
                if (isinstance(name, ast.Constant) and name.value in COUNTERS) or (
                    node.args and _root_name(node.args[0]) in LEDGER_NAMES
                ):
                    offences.append(f"{src.shown}:{node.lineno}: setattr of a counter")
                continue
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if _writes_a_counter(t, module):
                        offences.append(f"{src.shown}:{node.lineno}: writes {ast.unparse(t)}")
    return offences


def test_no_module_but_the_ledger_writes_a_counter() -> None:
    assert check_counter_writes(TREE) == []


@pytest.mark.parametrize(
    "snippet",
    [
        "counters.errors += 1",  # the old way: a counter bumped by hand
        "stats.guard_collectives = 0",
        "setattr(counters, 'once_loaded', 3)",
        "totals['audit_exchanges'] += 1",
        "out['errors'] = 0",  # the package root's name for its copy, in another module
        "ledger.guard_collectives += 1",  # the ledger's own preallocated field, from outside it
        "_ledger._totals['errors'] += 1",
        "setattr(ledger, name, 0)",
        "a, ledger.x = 1, 2",
    ],
)
def test_the_counter_check_flags_a_write_outside_the_ledger(snippet: str) -> None:
    tree = mutated(f"{TOP}.agreements.audit", snippet)
    assert check_counter_writes(tree)


def test_the_counter_check_leaves_the_ledger_s_calls_and_reads_alone() -> None:
    snippet = """
    ledger.add(records.Failure("audit"))
    ledger.guard_call(0.1, False, True)
    seen = ledger.counters()["errors"]
    errors = 0
    """
    assert check_counter_writes(mutated(f"{TOP}.agreements.audit", snippet)) == []


# ----------------------------------------------------------------- the table


def _record_kinds(module: object) -> list[type]:
    return [c for _, c in inspect.getmembers(module, inspect.isclass) if dataclasses.is_dataclass(c)]


def test_every_kind_of_record_has_a_row_in_the_table_and_counts_only_counters() -> None:
    kinds = _record_kinds(records)
    assert kinds and set(kinds) == set(COUNTS)
    names = {name for kind in kinds for name in ledger_module.counts(_example(kind))}
    assert names <= set(COUNTERS)


def test_a_record_the_table_lacks_raises_instead_of_counting_nothing() -> None:
    @dataclasses.dataclass(frozen=True)
    class Unknown:
        n: int

    with pytest.raises(KeyError):
        Ledger().add(Unknown(1))
    with pytest.raises(KeyError):  # a graph that ended in a way the table lacks
        Ledger().add(records.OnceGraph("half loaded", 0, {}))


def test_records_are_frozen() -> None:
    record = records.AuditRecompileWait(1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.waited_s = 2.0  # type: ignore[misc]


def _example(kind: type) -> object:
    """A record of ``kind`` with a value of each field's type."""
    if kind is records.OnceGraph:
        return records.OnceGraph("loaded", 2, {})
    values = {int: 1, float: 0.5, str: "audit", bool: True}
    return kind(**{name: values.get(t, {}) for name, t in typing.get_type_hints(kind).items()})


# ----------------------------------------------------------------- what the ledger promises


def test_every_counter_is_zero_on_a_fresh_ledger_and_stats_keeps_their_order() -> None:
    fresh = Ledger().counters()
    assert list(fresh) == list(COUNTERS)
    assert fresh == COUNTERS
    assert list(cc.stats())[: len(COUNTERS)] == list(COUNTERS)


def test_the_counters_are_the_sum_of_the_records_kept() -> None:
    book = Ledger()
    added = [
        records.CompilerExchange("trace", 2, 100, 300, 0.5, 0.01, 1),
        records.CompilerExchange("inputs", 1, 40, 120, 0.25, 0.02, 3),
        records.OnceGraph("loaded", 2, {}),
        records.OnceGraph("raised", 0, {}),
        records.Failure("audit"),
    ]
    for record in added:
        book.add(record)
    kept = [x for kind in COUNTS for x in book.kept(kind)]
    assert sorted(map(repr, kept)) == sorted(map(repr, added))
    summed = dict(COUNTERS)
    for record in kept:
        for name, n in ledger_module.counts(record).items():
            summed[name] += n
    summed.update(last_arrival_spread_s=0.02, last_late_rank=3)  # the latest compiler collective's
    assert book.counters() == summed


def test_a_graph_counts_in_the_counter_of_how_it_ended_and_a_raised_or_failed_one_in_none() -> None:
    book = Ledger()
    for ended in ledger_module.ONCE_ENDED:
        before = book.counters()
        book.add(records.OnceGraph(ended, 0, {}))
        after = book.counters()
        changed = {k for k in after if after[k] != before[k]}
        assert len(changed) == (0 if ended in ("raised", "source raised", "failed") else 1), ended


def test_the_time_waited_in_compile_once_is_the_sum_of_the_graphs_records() -> None:
    book = Ledger()
    book.add(records.OnceGraph("loaded", 0, {}, waited_s=1.5))
    book.add(records.OnceGraph("failed", 0, {}, waited_s=0.25))  # a wait counts however the graph ended
    assert book.counters()["once_wait_s"] == 1.75


def test_the_kept_records_are_bounded_while_the_counters_count_every_one() -> None:
    book = Ledger()
    for _ in range(ledger_module.KEEP + 10):
        book.add(records.PathsDiverged(1))
    assert len(book.kept(records.PathsDiverged)) == ledger_module.KEEP
    assert book.counters()["diverged_paths"] == ledger_module.KEEP + 10


def test_a_guard_outcome_allocates_nothing() -> None:
    book = Ledger()
    book.read_guards(lambda *call: None)  # registered, but the hook took no clock (timing off)
    call = book.guard_call
    seq = 1 << 40  # the hook's call number, an int it already holds

    def calls(n: int, local_miss: bool, agreed_miss: bool) -> int:
        """Blocks still allocated after ``n`` calls: they would grow with ``n`` if a call kept any."""
        before = sys.getallocatedblocks()
        for _ in itertools.repeat(None, n):
            call(0.001, local_miss, agreed_miss, seq, 0)
        return sys.getallocatedblocks() - before

    for outcome in ((False, False), (True, True), (False, True)):
        calls(100, *outcome)  # warm
        assert calls(100_000, *outcome) <= 8, outcome
    counted = book.counters()
    assert counted["guard_collectives"] == 3 * 100_100
    assert counted["guard_local_misses"] == counted["guard_agreed_misses"] - counted["forced_recompiles"] == 100_100
    # A forced recompile: this rank hit and another missed.
    assert counted["forced_recompiles"] == 100_100


def test_store_requests_counted_from_many_threads_all_count() -> None:
    book = Ledger()

    def count() -> None:
        for _ in range(2_000):
            book.store_requests(2)

    threads = [threading.Thread(target=count) for _ in range(4)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert book.counters()["store_requests"] == 4 * 2_000 * 2


def test_reset_stats_forgets_every_record_and_zeroes_every_counter() -> None:
    ledger.add(records.AuditDifference({"seq": 1}))
    ledger.add(records.OnceGraph("local", 0, {"seq": 1, "ended": "local"}))
    ledger.guard_call(0.5, True, True)
    assert cc.stats()["audit_report_only_differences"] >= 1 and cc.stats()["compile_once"]
    cc.reset_stats()
    after = cc.stats()
    assert {k: after[k] for k in COUNTERS} == COUNTERS
    assert after["compile_once"] == []
    from compiler_collectives.agreements import audit

    assert audit.reports() == []
