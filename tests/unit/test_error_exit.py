"""Our error leaves our code one way: through the compile scope's boundary, raised by the latch.

Inside a compile torch wraps whatever our code raises (``InternalTorchDynamoError``,
``BackendCompilerFailed``, AOTAutograd's cache bypass). Every seam torch calls is a
``compile_scope.boundary``, which latches our error in the compile's scope; the compile entry
wrapper (and compile once's lookup seam) raise the latched error in place of torch's wrapper;
the guard hook parks its error on ``health.latch`` for its thread's next compile. The code rules
below keep every other route closed, each shown failing on a mutation (as
``test_layering.py`` does):

* nothing catches one of torch's wrappers (``except BackendCompilerFailed``): only the latched
  error replaces them;
* nothing digs into an exception's chain to raise what it finds (a ``raise`` of ``__context__``
  or ``__cause__``, or of a name taken from one), and ``__context__`` is read only to describe
  an error in words (``audit.failure_text``);
* no error waits in a thread-local: ``threading.local()`` only in the latch, and in the two
  modules whose thread-locals hold no error (named below, with what they hold);
* no seam keeps an error on an object of its own (a ticket, a thread-local) in an ``except``
  clause: it latches it (``compile_scope.leave``);
* one context variable: the compile scope's;
* every seam of the seam table (a replacement torch calls inside a compile) is a boundary;
* one ``failure.fail()`` counts a failure (adds a ``Failure`` record) and poisons the latch;
  no other module does (the latch itself aside): not transport, which raises what stopped a
  build of our groups (``agreements/our_groups.py`` fails with it), and not the guard hook's
  Ctrl-C or a signal handler's exit, which ``fail()`` is told of as such;
* the agreements, ``scope()`` and ``doctor`` make our groups through ``our_groups`` only, so
  that a failed build poisons this rank;
* nobody keeps the latch: a new generation binds a new one (``health.adopt``), so each use
  reads ``health.latch`` anew (no ``from ..health import latch``, no module-level copy).

The behaviour itself (our error reaching the user's call as itself, by each route) is tested
where each agreement is: the guard hook's parked error in ``test_failures.py``,
``test_guard_collective.py`` and ``test_threads.py``; a trace's (``InternalTorchDynamoError``) in
``test_compiler_collective.py`` and ``test_audit.py``; a backend's (``BackendCompilerFailed``) and
the cache lookup's (a bypass) in ``test_compile_once.py`` and ``test_compile_once_caches.py``.
The scope's own rules are below.
"""

from __future__ import annotations

import ast
import functools
import re

import pytest

from compiler_collectives.agreements import compile_scope
from compiler_collectives.errors import CollectiveDesyncError, CollectivePoisonedError, CompileOnceError
from compiler_collectives.health.latch import Latch
from tests.contract.test_layering import TOP, TREE, Tree, mutated

WRAPPERS = ("InternalTorchDynamoError", "BackendCompilerFailed", "BypassAOTAutogradCache")
# Thread-locals that hold no error: what each holds.
THREAD_LOCALS_WITHOUT_ERRORS = {
    f"{TOP}.health.latch": "each thread's parked error: the latch itself",
    f"{TOP}.agreements.guard_owner": "the owning thread's mark, ending its ownership when the thread ends",
    f"{TOP}.agreements.audit_record": "the graph audited on this thread (its record and stage)",
}
# Reads of ``__context__`` that only put an error in words.
CONTEXT_READERS = {(f"{TOP}.agreements.audit", "failure_text")}
# Seam-table replacements that are no boundary, and why.
NOT_BOUNDARIES = {
    "compiler_seam:wrap_compile": "the compile entry wrapper itself: it raises the latched error",
    "compiler_seam:wrap_reset": "torch._dynamo.reset(), outside any compile",
    "compiler_seam:LocalState": "a class: Dynamo builds it, nothing of ours runs",
    "guard_seam:guard_hook": "the guard hook: never raises (C++ would abort), it parks on the latch",
    "guard_seam:set_guard_complete_hook": "called by our install only",
    "c10d_seam:wrap_destroy": "destroy_process_group(), outside any compile",
}

# Where a failure is counted and the latch poisoned: the failure procedure, and the latch itself.
FAILURE_OWNERS = {f"{TOP}.agreements.failure", f"{TOP}.health.latch"}
POISONS = ("poison", "poison_from_peer")
# What builds our groups (the facade's methods) and the one module of the agreements that calls them.
BUILDS = ("compile_pg", "guard_channel", "guard_pg", "choose_scope", "agree_scope")
GROUP_MAKER = f"{TOP}.agreements.our_groups"


@functools.cache
def _parse(text: str) -> ast.Module:
    return ast.parse(text)


def _functions(tree: ast.Module) -> dict[ast.AST, str]:
    """Every node -> the name of the outermost function it lies in ("" at module level)."""
    out: dict[ast.AST, str] = {}
    for top in tree.body:
        name = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else ""
        for node in ast.walk(top):
            out[node] = name
    return out


def _names_wrapper(node: ast.AST | None) -> bool:
    """Whether an ``except`` clause's type names one of torch's wrappers (by name, attribute or
    the seam table's string key)."""
    if node is None:
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in WRAPPERS:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in WRAPPERS:
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value in WRAPPERS:
            return True
    return False


def _chain_read(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in ("__context__", "__cause__")


def check_error_exit(tree: Tree) -> list[str]:
    """Offences against the one way out (see the module docstring)."""
    offences: list[str] = []
    for module, source in tree.items():
        if module.startswith(TOP):
            offences += _module_offences(module, source.shown, source.text)
    return offences


@functools.cache
def _module_offences(module: str, shown: str, text: str) -> tuple[str, ...]:
    """``check_error_exit``'s offences in one module (once per text: every mutation test checks
    the whole tree again)."""
    offences = []
    parsed = _parse(text)
    inside = _functions(parsed)
    dug: set[tuple[str, str]] = set()  # (function, name) bound from an exception's chain
    for node in ast.walk(parsed):
        if isinstance(node, ast.Assign) and any(_chain_read(s) for s in ast.walk(node.value)):
            dug |= {(inside[node], t.id) for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(parsed):
        where = f"{shown}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ExceptHandler) and _names_wrapper(node.type):
            offences.append(f"{where}: catches torch's wrapper ({ast.unparse(node.type)})")
        if isinstance(node, ast.ExceptHandler) and module.startswith(f"{TOP}.dynamo."):
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Assign)
                    and isinstance(sub.value, ast.Name)
                    and any(isinstance(t, ast.Attribute) for t in sub.targets)
                ):
                    offences.append(f"{shown}:{sub.lineno}: a seam keeps an error on an object (not the scope's latch)")
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc
            if _chain_read(exc) or (isinstance(exc, ast.Name) and (inside[node], exc.id) in dug):
                offences.append(f"{where}: raises what it dug out of an exception's chain")
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "__context__"
            and (module, inside[node]) not in CONTEXT_READERS
        ):
            offences.append(f"{where}: reads an exception's __context__")
        if isinstance(node, ast.Call):
            called = node.func
            name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", "")
            if name == "local" and module not in THREAD_LOCALS_WITHOUT_ERRORS:
                offences.append(f"{where}: a threading.local() outside the latch")
            if name == "ContextVar" and module != f"{TOP}.agreements.compile_scope":
                offences.append(f"{where}: a context variable other than the compile scope's")
    return tuple(offences)


def check_seams_are_boundaries(tree: Tree) -> list[str]:
    """Every replacement the seam table names is decorated ``compile_scope.boundary``."""
    table = tree[f"{TOP}.dynamo.table"].text
    offences = []
    for named in sorted(set(re.findall(r'replace="([a-z_0-9]+:[A-Za-z_0-9]+)"', table))):
        if named in NOT_BOUNDARIES:
            continue
        module, name = named.split(":")
        source = tree[f"{TOP}.dynamo.{module}"]
        parsed = _parse(source.text)
        found = [n for n in parsed.body if isinstance(n, ast.FunctionDef) and n.name == name]
        if not found:
            # A name bound to another function (``guard_hook = guard.hook``) is no boundary.
            offences.append(f"{source.shown}: seam {named} is not a function decorated compile_scope.boundary")
            continue
        if not any(ast.unparse(d) == "compile_scope.boundary" for d in found[0].decorator_list):
            offences.append(f"{source.shown}:{found[0].lineno}: seam {named} is not a compile_scope.boundary")
    return offences


def check_failure_by_hand(tree: Tree) -> list[str]:
    """Where a module outside ``FAILURE_OWNERS`` adds a ``Failure`` record or poisons the latch
    (through any name either is imported as)."""
    return [
        offence
        for module, source in tree.items()
        if module.startswith(TOP) and module not in FAILURE_OWNERS
        for offence in _failure_by_hand(source.shown, source.text)
    ]


@functools.cache
def _failure_by_hand(shown: str, text: str) -> tuple[str, ...]:
    parsed = _parse(text)
    records, poisons = {"Failure"}, set(POISONS)  # the names each is called by here
    for node in ast.walk(parsed):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "Failure":
                    records.add(alias.asname or alias.name)
                if alias.name in POISONS:
                    poisons.add(alias.asname or alias.name)
    out = []
    for node in ast.walk(parsed):
        if not isinstance(node, ast.Call):
            continue
        called = node.func
        name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", "")
        if name in records or (isinstance(called, ast.Attribute) and name == "Failure"):
            out.append(f"{shown}:{node.lineno}: adds a Failure record ({ast.unparse(node)})")
        elif name in poisons or (isinstance(called, ast.Attribute) and name in POISONS):
            out.append(f"{shown}:{node.lineno}: poisons the latch ({ast.unparse(node)})")
    return tuple(out)


def check_groups_made_through_the_agreements(tree: Tree) -> list[str]:
    """A build of our groups (``BUILDS`` called on transport's ``groups``, by any name it is
    imported as) outside transport and ``GROUP_MAKER``: its failure would poison nobody."""
    offences: list[str] = []
    for module, source in tree.items():
        if module.startswith(TOP) and module != GROUP_MAKER and not module.startswith(f"{TOP}.transport"):
            offences += _builds(source.shown, source.text)
    return offences


@functools.cache
def _builds(shown: str, text: str) -> tuple[str, ...]:
    parsed = _parse(text)
    facade = {
        alias.asname or alias.name
        for node in ast.walk(parsed)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("transport")
        for alias in node.names
        if alias.name == "groups"
    }
    return tuple(
        f"{shown}:{node.lineno}: builds our groups past our_groups ({ast.unparse(node)})"
        for node in ast.walk(parsed)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in BUILDS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in facade
    )


def check_latch_read_anew(tree: Tree) -> list[str]:
    """The latch bound once and kept: imported by name, or copied into a module-level name."""
    offences: list[str] = []
    for module, source in tree.items():
        if module.startswith(TOP):
            offences += _kept_latch(source.shown, source.text)
    return offences


@functools.cache
def _kept_latch(shown: str, text: str) -> tuple[str, ...]:
    parsed = _parse(text)
    out = [
        f"{shown}:{node.lineno}: imports the latch by name (read health.latch at each use)"
        for node in ast.walk(parsed)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").endswith("health")
        and any(alias.name == "latch" for alias in node.names)
    ]
    out += [
        f"{shown}:{node.lineno}: keeps the latch in a module-level name ({ast.unparse(node)})"
        for node in parsed.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "latch"
    ]
    return tuple(out)


# ------------------------------------------------------------------ the code rules


def test_only_the_failure_procedure_counts_a_failure_or_poisons_the_latch():
    assert check_failure_by_hand(TREE) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        # the hand-written procedures fail() replaced, one each
        (
            f"{TOP}.agreements.audit_verdict",
            "def f(err):\n    ledger.add(Divergence('audit'))\n    ledger.add(Failure('audit'))\n",
        ),
        (f"{TOP}.agreements.entry_check", "def f(err):\n    health.latch.poison(err)\n    raise err\n"),
        (f"{TOP}.agreements.compile_wait", "from ..records import Failure as Counted\nledger.add(Counted('x'))\n"),
        (f"{TOP}.dynamo.compiler_seam", "def f(err):\n    health.latch.poison_from_peer(err)\n"),
        # the four that poisoned by hand before fail() took them: a build of our groups, the
        # guard hook's Ctrl-C and a signal handler's exit
        (f"{TOP}.transport.groups", "def _new_group(err):\n    health.latch.poison(err)\n"),
        (f"{TOP}.agreements.guard_failure", "def park_interrupt(note):\n    health.latch.poison(note)\n"),
        # a pass-through on the health package, and a name imported for it
        (f"{TOP}.health", "def poison(error):\n    latch.poison(error)\n"),
        (f"{TOP}.agreements.guard", "from ..health.latch import poison as p\np(1)\n"),
    ],
)
def test_the_failure_check_flags_a_failure_counted_or_a_latch_poisoned_by_hand(module, snippet):
    offences = check_failure_by_hand(mutated(module, snippet))
    assert offences and all("(mutated)" in o for o in offences), offences


def test_every_build_of_our_groups_goes_through_the_agreements():
    assert check_groups_made_through_the_agreements(TREE) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        (f"{TOP}.agreements.audit_verdict", "def f():\n    return groups.compile_pg()\n"),
        (f"{TOP}.agreements.guard", "def group():\n    return groups.guard_pg()\n"),
        (f"{TOP}", "from .transport import groups as built\ndef scope(chosen):\n    built.choose_scope(chosen)\n"),
    ],
)
def test_the_group_check_flags_a_build_past_the_agreements(module, snippet):
    offences = check_groups_made_through_the_agreements(mutated(module, snippet))
    assert offences and all("(mutated)" in o for o in offences), offences


def test_nobody_keeps_the_latch():
    assert check_latch_read_anew(TREE) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        (f"{TOP}.transport.shm", "from ..health import latch\n"),
        (f"{TOP}.agreements.guard", "_latch = health.latch\n"),
    ],
)
def test_the_latch_check_flags_a_latch_kept_from_import(module, snippet):
    offences = check_latch_read_anew(mutated(module, snippet))
    assert offences and all("(mutated)" in o for o in offences), offences


def test_only_the_latch_and_the_scope_raise_our_error_out_of_torch_s_wrappers():
    assert check_error_exit(TREE) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        # the old routes, one each
        (
            f"{TOP}.dynamo.compiler_seam",
            """
            def dig(original):
                try:
                    return original()
                except bound.originals["InternalTorchDynamoError"] as e:
                    inner = e.__context__
                    raise inner from None
            """,
        ),
        (
            f"{TOP}.dynamo.once_seam",
            """
            import threading
            _kept = threading.local()
            """,
        ),
        (
            f"{TOP}.dynamo.once_seam",
            """
            def unwrap(original):
                try:
                    return original()
                except BackendCompilerFailed as e:
                    raise e.__cause__
            """,
        ),
        # Compile once's current ticket went back to a thread-local: it lives on the compile scope.
        (f"{TOP}.agreements.once.protocol", "import threading\n_local = threading.local()\n"),
        (f"{TOP}.agreements.exchange", "def f(e):\n    return e.__context__\n"),
        (
            f"{TOP}.dynamo.once_seam",
            """
            def keep(ticket, original):
                try:
                    return original()
                except CollectiveError as ours:
                    ticket.error = ours
                    raise
            """,
        ),
        (f"{TOP}.agreements.scope", "import contextvars\n_v = contextvars.ContextVar('x')\n"),
    ],
)
def test_the_error_exit_check_flags_another_way_out(module, snippet):
    assert check_error_exit(mutated(module, snippet)) != []


def test_every_seam_torch_calls_is_a_boundary():
    assert check_seams_are_boundaries(TREE) == []


def test_the_boundary_check_flags_a_seam_without_one():
    tree = dict(TREE)
    source = tree[f"{TOP}.dynamo.once_seam"]
    text = source.text.replace("@compile_scope.boundary\ndef try_load(", "def try_load(")
    assert text != source.text
    tree[f"{TOP}.dynamo.once_seam"] = type(source)(source.shown + " (mutated)", text, source.is_package)
    assert check_seams_are_boundaries(tree) != []


# ------------------------------------------------------------------ the scope and the latch


def _raise(error: BaseException) -> None:
    raise error


def test_a_boundary_latches_our_error_and_the_scope_raises_it_in_place_of_torch_s_wrapper():
    ours = CollectiveDesyncError("ranks out of step", kind="compiler")
    leaving = compile_scope.boundary(_raise)
    with pytest.raises(CollectiveDesyncError) as raised, compile_scope.opened() as scope:
        try:
            try:
                leaving(ours)
            except CollectiveDesyncError:
                raise RuntimeError("torch's wrapper") from None  # as Dynamo rewraps
        except Exception as wrapper:
            scope.raise_latched(wrapper)
            raise
    assert raised.value is ours


def test_a_nested_compile_s_error_goes_on_into_the_enclosing_scope():
    ours = CompileOnceError("the compiling rank is gone", kind="compile_once")
    with compile_scope.opened() as outer:
        with pytest.raises(CompileOnceError), compile_scope.opened() as inner:
            assert compile_scope.current() is inner
            compile_scope.boundary(_raise)(ours)
        assert compile_scope.current() is outer
        assert outer.error is ours
    assert compile_scope.current() is None


def test_a_keyboard_interrupt_is_not_replaced_by_a_latched_error():
    with compile_scope.opened() as scope:
        scope.latch(CollectiveDesyncError("x"))
        scope.raise_latched(KeyboardInterrupt())  # returns: the interrupt stays itself


def test_outside_a_compile_nothing_is_latched():
    ours = CollectiveDesyncError("x")
    with pytest.raises(CollectiveDesyncError):
        compile_scope.boundary(_raise)(ours)
    assert compile_scope.current() is None


def test_a_parked_error_is_raised_once_by_its_own_thread_and_a_new_latch_holds_none():
    import threading

    latch = Latch()
    latch.park(KeyboardInterrupt())
    seen = []
    other = threading.Thread(target=lambda: seen.append(latch.raise_parked()))
    other.start()
    other.join()
    assert seen == [None]  # another thread never sees it
    with pytest.raises(KeyboardInterrupt):
        latch.raise_parked()
    latch.raise_parked()  # raised once
    latch.park(CollectiveDesyncError("x"))
    Latch(explainer=latch.explainer).raise_parked()  # a new generation's latch: nothing parked


@pytest.mark.parametrize("moment", ["reset", "default_group_destroyed"])
def test_a_new_generation_replaces_the_latch_and_a_poisoned_rank_is_healthy_again(moment):
    import compiler_collectives as cc
    from compiler_collectives import health, runtime
    from compiler_collectives.agreements import failure

    old = health.latch
    try:
        old.poison(CollectiveDesyncError("ranks out of step", kind="guard"))
        old.park(CollectiveDesyncError("parked"))
        with pytest.raises(CollectivePoisonedError):
            health.latch.check("guard")
        cc.reset() if moment == "reset" else runtime.default_group_destroyed()
    finally:
        if health.latch is old:  # the moment failed: leave the next test a healthy rank
            runtime.reset()
    assert health.latch is not old and runtime.current().latch is health.latch
    assert health.latch.first_failure is None
    health.latch.check("guard")  # no refusal
    health.latch.raise_parked()  # nothing parked
    assert health.latch.explainer is failure.explain_report  # the wiring stays
