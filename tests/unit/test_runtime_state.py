"""One owner of the process's state: the runtime lists every module-level mutable below the seam.

``runtime.STATE`` says, module by module, what global state the package
holds: what each new generation replaces (built by the runtime and handed to
its layer), what a moment (``reset()``, ``torch.compiler.reset()``, a
destroyed default group, a fork, ``reset_stats()``) clears, what install
wires and what is kept for the process's life. No module declares anything
when imported. The check below parses the runtime and the agreements,
transport, health, store and instrument layers with ``ast`` (as
``test_layering.py`` does) and flags a module-level mutable that ``STATE``
does not list, or a listed name that its module does not bind; it is shown to
fail on a mutation. The moments' tests say what each replaces.

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

from tests.contract.test_layering import TOP, TREE, Tree, mutated

LAYERS = ("runtime", "torch_view", "agreements", "transport", "health", "store", "instrument")
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
    """Every module-level mutable of the runtime and the five layers is listed in ``runtime.STATE``,
    and every listed name is bound by its module."""
    offences = []
    for module, src in tree.items():
        if not _in_scope(module):
            continue
        found = module_mutables(src.text)
        names = declared.get(module, set())
        offences += [
            f"{src.shown}:{line} holds {name}, which runtime.STATE does not list (list it there, with "
            "what renews it: each generation's, cleared at a moment, wired or kept)"
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
        offences += [f"{src.shown}: runtime.STATE lists {name}, which it does not bind" for name in names - bound]
    return offences


def _declared() -> dict[str, set[str]]:
    from compiler_collectives import runtime

    out: dict[str, set[str]] = {}
    for held in runtime.STATE:
        out.setdefault(f"{TOP}.{held.module}", set()).update(held.names)
    return out


def test_every_module_level_mutable_below_the_seam_is_listed_by_the_runtime():
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
        # the runtime's own cache beside the one runtime
        ("compiler_collectives.runtime", "_built: list = []\n"),
    ],
)
def test_the_check_flags_a_new_module_level_mutable_the_runtime_does_not_list(module, snippet):
    offences = check_declared(mutated(module, snippet), _declared())
    assert offences and all("(mutated)" in o for o in offences), offences


def test_the_check_flags_a_listed_name_the_module_does_not_bind():
    declared = _declared()
    declared[f"{TOP}.agreements.audit_verdict"] = declared.get(f"{TOP}.agreements.audit_verdict", set()) | {"_gone"}
    assert check_declared(TREE, declared) == [
        f"{TREE[f'{TOP}.agreements.audit_verdict'].shown}: runtime.STATE lists _gone, which it does not bind"
    ]


def test_constants_and_functions_are_not_state():
    text = "import logging\nLIMITS = {'a': 1}\nlog = logging.getLogger('x')\ndef f():\n    x = []\n"
    assert module_mutables(text) == {}


def test_no_module_declares_state_when_imported_the_runtime_lists_it():
    from compiler_collectives import runtime

    listed = runtime.describe()
    for title in ("each generation's", "cleared at the moments named", "wired by install", "kept for"):
        assert title in listed
    # The agreements' sequences and compile once's hosts are one object of the generation's; no
    # agreement module keeps a counter of its own.
    kinds = {(h.module, name): h.kind for h in runtime.STATE for name in h.names}
    for part in (("health", "latch"), ("transport.generation", "current"), ("agreements.generation", "_current")):
        assert kinds[part] == "generation", part
    assert kinds[("agreements.guard_state", "state")] == "generation"
    for module in ("compiler", "audit_verdict", "once.protocol", "once.exchanges", "once.ticket"):
        assert not {n for (m, n) in kinds if m == f"agreements.{module}"}, module


MOMENTS = {
    "reset()": lambda runtime: runtime.reset(),
    "a destroyed default group": lambda runtime: runtime.default_group_destroyed(),
}


@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_a_new_generation_replaces_every_part_numbers_the_next_and_keeps_the_guard_owner(moment):
    from compiler_collectives import health, runtime, transport
    from compiler_collectives.agreements import generation, guard_state

    old = runtime.current().generation
    guard_state.state.owner = 7  # the owning thread's ident, carried from generation to generation
    guard_state.state.seq = 5
    try:
        MOMENTS[moment](runtime)
        new = runtime.current().generation
        assert new.number == old.number + 1
        assert transport.groups.number == new.number
        for part in ("latch", "transport", "agreements", "guard"):
            assert getattr(new, part) is not getattr(old, part), part
        assert health.latch is new.latch and generation.current() is new.agreements
        assert guard_state.state is new.guard and transport.groups.progress_sources is new.transport.progress_sources
        assert (new.guard.seq, new.guard.owner) == (0, 7)
        assert old.guard.seq == 5  # the old one is left as it was
    finally:
        guard_state.state.owner = 0


def test_stats_and_torch_reset_start_no_generation():
    from compiler_collectives import runtime

    before = runtime.current().generation
    runtime.reset_stats()
    runtime.torch_reset()
    assert runtime.current().generation is before


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
