"""One owner of the process's state: every module-level mutable below the seam is declared.

``compiler_collectives/process_state.py`` is the list of what each moment
(``reset()``, ``torch.compiler.reset()``, a destroyed default group, a fork,
``reset_stats()``) clears, what install wires and what is kept for the
process's life. Each module declares its own, with a decorator on the function
that clears, sets or fills it. The check below parses the agreements,
transport, health, store and instrument layers with ``ast`` (as ``test_layering.py``
does) and flags a module-level mutable that no declaration names, or a
declaration that names nothing the module binds; it is shown to fail on a
mutation.

There is one way of noticing a new generation: ``transport.generation``'
``notice()`` is the one place that looks at which default group is current
(``dist.group.WORLD``); it runs the destroyed group's moment when that
changed. ``check_one_noticer`` flags any other module of the package that
reads the default group, and is shown to fail on a mutation.

A module-level mutable is a name rebound through ``global`` in the module, or
bound at module level to a list, dict or set (a display or a comprehension),
to a call of a known mutable type (``threading.local``, ``collections.deque``,
``weakref.WeakKeyDictionary``, ...) or of a class the module defines. Names in
upper case are constants by the house's convention, unless rebound.
"""

from __future__ import annotations

import ast
import functools

import pytest

from .test_layering import TOP, TREE, Tree, mutated

LAYERS = ("agreements", "transport", "health", "store", "instrument")
MUTABLE_CALLS = {
    "local",
    "Lock",
    "RLock",
    "Event",
    "Condition",
    "deque",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "dict",
    "list",
    "set",
    "bytearray",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
_DISPLAYS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _in_scope(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] in LAYERS


def _constant(name: str) -> bool:
    return name.lstrip("_").isupper()


@functools.cache
def _parsed(text: str) -> ast.Module:
    return ast.parse(text)  # once per text: every mutation test checks the whole tree again


@functools.cache
def module_mutables(text: str) -> dict[str, int]:
    """Module-level mutable names of a module's source -> the line that binds them (cached: do
    not change the dict)."""
    tree = _parsed(text)
    rebound = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    out: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if not isinstance(target, ast.Name) or target.id == "__all__":
                continue
            name = target.id
            mutable = name in rebound
            if not mutable and not _constant(name):
                if isinstance(value, _DISPLAYS):
                    mutable = True
                elif isinstance(value, ast.Call):
                    func = value.func
                    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                    mutable = called in MUTABLE_CALLS or called in classes
            if mutable:
                out.setdefault(name, node.lineno)
    return out


def check_declared(tree: Tree, declared: dict[str, set[str]]) -> list[str]:
    """Every module-level mutable in the five layers is declared in ``process_state``, and
    every declared name is bound by its module."""
    offences = []
    for module, src in tree.items():
        if not _in_scope(module):
            continue
        found = module_mutables(src.text)
        names = declared.get(module, set())
        offences += [
            f"{src.shown}:{line} holds {name}, which process_state does not list (declare it with "
            "process_state.clears, wired or kept on the function that clears, sets or fills it)"
            for name, line in sorted(found.items())
            if name not in names
        ]
        bound = {
            t.id
            for node in _parsed(src.text).body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        }
        offences += [f"{src.shown}: process_state lists {name}, which it does not bind" for name in names - bound]
    return offences


def _declared() -> dict[str, set[str]]:
    import compiler_collectives  # noqa: F401  (imports every module, so each has declared)
    from compiler_collectives import process_state

    return {module: process_state.declared(module) for module in TREE}


def test_every_module_level_mutable_below_the_seam_is_declared():
    assert check_declared(TREE, _declared()) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        ("compiler_collectives.agreements.guard", "_x = {}\n"),
        ("compiler_collectives.transport.groups", "_seen: list[int] = []\n"),
        ("compiler_collectives.store.mailbox", "import threading\n_tls = threading.local()\n"),
        ("compiler_collectives.health.diagnosis", "_seen: dict[int, float] = {}\n"),
        ("compiler_collectives.transport.generation", "_worlds = set()\n"),
        ("compiler_collectives.instrument.timing", "_count = 0\ndef bump():\n    global _count\n    _count += 1\n"),
        ("compiler_collectives.agreements.once.protocol", "import weakref\n_w = weakref.WeakKeyDictionary()\n"),
        # a sequence of an agreement's own again, beside the generation's
        ("compiler_collectives.agreements.compiler", "_seq = 0\ndef bump():\n    global _seq\n    _seq += 1\n"),
    ],
)
def test_the_check_flags_a_new_module_level_mutable_declared_nowhere(module, snippet):
    offences = check_declared(mutated(module, snippet), _declared())
    assert offences and all("(mutated)" in o for o in offences), offences


def test_the_check_flags_a_declaration_of_a_name_the_module_does_not_bind():
    declared = _declared()
    declared[f"{TOP}.agreements.audit_verdict"] = declared[f"{TOP}.agreements.audit_verdict"] | {"_gone"}
    assert check_declared(TREE, declared) == [
        f"{TREE[f'{TOP}.agreements.audit_verdict'].shown}: process_state lists _gone, which it does not bind"
    ]


def test_constants_and_functions_are_not_state():
    text = "import logging\nLIMITS = {'a': 1}\nlog = logging.getLogger('x')\ndef f():\n    x = []\n"
    assert module_mutables(text) == {}


def test_each_moment_clears_what_it_lists_and_a_reset_starts_a_new_generation():
    from compiler_collectives import process_state

    listed = process_state.describe()
    for moment in process_state.Moment:
        assert f"{moment.value} clears:" in listed
    # The guard's state goes with every moment of a generation (the fork's own function).
    assert "compiler_collectives.agreements.guard_state: state" in listed
    # The agreements' sequences and compile once's hosts are one object of the generation's, replaced
    # at each moment that ends one; no agreement module keeps a counter of its own (compile once's
    # records are the ledger's, read by the ledger's readers; its current ticket is the compile
    # scope's: no state of its own).
    assert "compiler_collectives.agreements.generation: _current: this generation's agreement state" in listed
    [replaced] = [i for i in process_state.items() if i.owner == f"{TOP}.agreements.generation"]
    assert replaced.moments == process_state.EVERY_GENERATION
    for module in ("compiler", "audit_verdict", "once.protocol", "once.exchanges"):
        assert process_state.declared(f"{TOP}.agreements.{module}") <= {"_compile_id"}, module
    assert not process_state.declared(f"{TOP}.agreements.once.ticket")
    before = process_state.generation()
    process_state.run(process_state.STATS)
    assert process_state.generation() == before
    process_state.run(process_state.RESET)
    assert process_state.generation() == before + 1


# ------------------------------------------------- noticing a new generation

NOTICER = f"{TOP}.transport.generation"
# What names the default group itself: torch's public handle, and its c10d internals.
DEFAULT_GROUP_NAMES = {"WORLD", "_get_default_group", "default_pg", "_world"}


def check_one_noticer(tree: Tree) -> list[str]:
    """Only ``transport.generation`` reads which default group is current; every other module asks it
    (``groups.notice()``) or keeps nothing a generation's moment does not clear."""
    offences = []
    for module, src in tree.items():
        if module == NOTICER:
            continue
        for node in ast.walk(_parsed(src.text)):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.alias):  # from ... import _get_default_group
                name = node.name.rpartition(".")[2]
            else:
                continue
            if name in DEFAULT_GROUP_NAMES:
                offences.append(
                    f"{src.shown}:{node.lineno} reads the default group ({name}): call "
                    "transport.groups.notice() (generation.notice), the one place that notices a new one, and let the "
                    "moment it runs clear what this module keeps"
                )
    return offences


def test_only_the_transport_generation_reads_which_default_group_is_current():
    assert check_one_noticer(TREE) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        ("compiler_collectives.agreements.guard", "def f():\n    return dist.group.WORLD\n"),
        ("compiler_collectives.transport.scope", "import torch.distributed as dist\n_w = dist.GroupMember.WORLD\n"),
        (
            "compiler_collectives.dynamo.c10d_seam",
            "from torch.distributed.distributed_c10d import _get_default_group\n",
        ),
    ],
)
def test_the_noticer_check_flags_another_module_that_reads_the_default_group(module, snippet):
    offences = check_one_noticer(mutated(module, snippet))
    assert offences and all("(mutated)" in o for o in offences), offences
