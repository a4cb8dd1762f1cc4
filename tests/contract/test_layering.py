"""The package's layout keeps its promises: layers by rank, private names, one seam table.

* Every module belongs to a ranked layer (``RANKS``) and imports nothing of a
  higher rank: lazy imports (inside functions), ``TYPE_CHECKING`` imports and
  ``importlib.import_module("compiler_collectives...")`` count as imports.
* The agreements import only what ``transport/__init__.py`` exports.
* No module imports, reads or writes another module's underscore names, through
  whatever name the module is bound to (``from x import m``, ``import x.m as s``,
  ``import x.m``, ``getattr(s, "_n")``).
* Only ``compiler_collectives/dynamo/`` touches torch's private modules or
  names: by import, attribute, ``importlib.import_module``, ``__import__``,
  ``getattr`` or ``sys.modules``.
* No import cycle between our modules at import time, the root package included.
* Every exception type, underscored or not, is declared in errors.py; the
  package version is declared once (annotated or not), as pyproject says.
* The seam table's replacements exist; docs/design.md lists every seam row and
  draws the layers in rank order with every module.

Each check is a function over a ``Tree`` (module name -> source text) that
returns its offences. The tests run it on the real tree, which must be clean,
and on a mutation of it (a snippet added to a real module, or a synthetic
module), which must be flagged: every check is shown able to fail.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import pathlib
import re
import textwrap
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "compiler_collectives"
TOP = "compiler_collectives"


# ----------------------------------------------------------------- the tree


@dataclasses.dataclass(frozen=True)
class Source:
    shown: str  # the path offences name
    text: str
    is_package: bool


Tree = dict[str, Source]


def real_tree() -> Tree:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = Source(str(path.relative_to(ROOT)), path.read_text(), is_package)
    return out


TREE = real_tree()


def mutated(module: str, snippet: str, tree: Tree | None = None) -> Tree:
    """The real tree with ``snippet`` appended to ``module`` (added as a new module if absent)."""
    tree = dict(TREE if tree is None else tree)
    old = tree.get(module, Source(f"<mutation {module}>", "", False))
    tree[module] = Source(old.shown + " (mutated)", old.text + "\n" + textwrap.dedent(snippet), old.is_package)
    return tree


@functools.cache
def _parse(text: str) -> ast.Module:
    return ast.parse(text)


@functools.cache
def _nodes(text: str) -> tuple[ast.AST, ...]:
    """Every node of ``text``'s tree, once per text: the checks walk each module many times (every
    mutation test checks the whole tree again, with one module changed)."""
    return tuple(ast.walk(_parse(text)))


@functools.cache
def _imports(text: str) -> tuple[tuple[ast.AST, bool], ...]:
    """``_import_nodes`` of ``text``'s tree, once per text."""
    return tuple(_import_nodes(_parse(text)))


def _ours(tree: Tree, name: str) -> str | None:
    """The module of ours that ``name`` (a dotted path) names or lies in."""
    while name:
        if name in tree:
            return name
        name = name.rpartition(".")[0]
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(node: ast.AST) -> str | None:
    """The module a constant ``importlib.import_module("x")`` / ``__import__("x")`` names."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    arg = node.args[0]
    if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        if name == "import_module" and arg.value.startswith("."):
            return None  # relative to a package argument: not followed
        return arg.value
    return None


def _import_nodes(root: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every import (statement or constant dynamic import), and whether it runs when the module
    is imported (not inside a function, not under ``if TYPE_CHECKING:``)."""

    def visit(node: ast.AST, runtime: bool) -> Iterator[tuple[ast.AST, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _dynamic_import(node) is not None:
            yield node, runtime
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            runtime = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, False)
            for child in node.orelse:
                yield from visit(child, runtime)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, runtime)

    yield from visit(root, True)


@dataclasses.dataclass(frozen=True)
class Edge:
    target: str  # one of our modules
    line: int
    runtime: bool


def edges(tree: Tree, module: str) -> list[Edge]:
    """The modules of ours that ``module`` imports. A package's parents, which Python imports
    first anyway, count only when named (``import compiler_collectives``) or when a name that is
    not a submodule is taken from them (``from .. import install_error``)."""
    src = tree[module]
    out = []
    for node, runtime in _imports(src.text):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, src.is_package, node.level, node.module)
            ancestor = base == module or module.startswith(base + ".")
            for alias in node.names:
                # a submodule, or a name the package's __init__ defines (``*`` included)
                targets.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in tree else base)
            if not ancestor:
                targets.append(base)
        else:
            targets = [_dynamic_import(node) or ""]
        for target in targets:
            owner = _ours(tree, target)
            if owner is not None and owner != module:
                out.append(Edge(owner, node.lineno, runtime))
    return out


def _aliases(tree: Tree, module: str) -> dict[str, str]:
    """Local names bound to our modules: ``from .. import health``, ``from . import x as s``,
    ``import compiler_collectives.transport.shm as s``, ``import compiler_collectives``."""
    src = tree[module]
    out = {}
    for node, _ in _imports(src.text):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in tree:
                    out[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] in tree:
                    out[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, src.is_package, node.level, node.module)
            for alias in node.names:
                if f"{base}.{alias.name}" in tree:
                    out[alias.asname or alias.name] = f"{base}.{alias.name}"
    return out


def _module_of(tree: Tree, aliases: dict[str, str], node: ast.expr) -> str | None:
    """The module of ours an expression names (``s``, ``compiler_collectives.transport.shm``)."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _module_of(tree, aliases, node.value)
        if parent is not None and f"{parent}.{node.attr}" in tree:
            return f"{parent}.{node.attr}"
    return None


def _reads(tree: Tree, module: str) -> Iterator[tuple[str, str, int]]:
    """(module of ours, name, line) for every ``m.name`` and ``getattr(m, "name")`` (also
    ``setattr``, ``delattr``, ``hasattr``) on another module of ours in ``module``."""
    aliases = _aliases(tree, module)
    for node in _nodes(tree[module].text):
        if isinstance(node, ast.Attribute):
            owner, name = _module_of(tree, aliases, node.value), node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "delattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            owner, name = _module_of(tree, aliases, node.args[0]), node.args[1].value
        else:
            continue
        if owner is not None and owner != module:
            yield owner, name, node.lineno


# ---------------------------------------------------------------- the layers

BASE = ("config", "errors", "ledger", "observations", "records", "torch_view", "version")
RANKS = {
    # the root package's __init__ (the public API), __main__ and runtime (the composition root)
    "package": 8,
    # the command-line tools (cli, doctor, report): they read everything
    "tools": 7,
    "dynamo": 6,
    "agreements": 5,
    "transport": 4,
    # liveness and diagnosis: what the store's records say of a peer
    "health": 3,
    # the store floor: bounded store calls, the heartbeat and failure-report board, notices, rendezvous
    "store": 2,
    # timing and the artifacts' plain data: what every layer records into
    "instrument": 1,
    # config, errors, observations, stats, torch_view, version
    "base": 0,
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != TOP:
        return None
    if len(parts) == 1 or parts[1:] in (["__main__"], ["runtime"]):
        return "package"
    if len(parts) == 2 and parts[1] in BASE:
        return "base"
    if parts[1] in RANKS and parts[1] not in ("package", "base"):
        return parts[1]
    return None


def check_layers(tree: Tree) -> list[str]:
    """Every module is in a ranked layer, and imports nothing from a higher one."""
    offences = []
    for module, src in tree.items():
        layer = layer_of(module)
        if layer is None:
            offences.append(f"{src.shown}: {module} is in no ranked layer (add its folder to RANKS)")
            continue
        for edge in edges(tree, module):
            up = layer_of(edge.target)
            if up is not None and RANKS[up] > RANKS[layer]:
                how = "" if edge.runtime else " (lazily or under TYPE_CHECKING)"
                offences.append(f"{src.shown}:{edge.line} ({layer}) imports {edge.target} ({up}){how}")
    return offences


def _exports(tree: Tree, package: str) -> set[str]:
    for node in _parse(tree[package].text).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def check_transport_exports(tree: Tree) -> list[str]:
    """The agreements use only the names ``transport/__init__.py`` exports (its ``__all__``)."""
    transport = f"{TOP}.transport"
    exported = _exports(tree, transport)
    offences = []
    for module, src in tree.items():
        if layer_of(module) != "agreements":
            continue
        for node, _ in _imports(src.text):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, src.is_package, node.level, node.module)
                if base.startswith(transport + "."):
                    offences.append(f"{src.shown}:{node.lineno} imports from {base}")
                elif base == transport:
                    offences.extend(
                        f"{src.shown}:{node.lineno} imports transport.{a.name}, which transport does not export"
                        for a in node.names
                        if a.name not in exported
                    )
            else:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [_dynamic_import(node)]
                offences.extend(
                    f"{src.shown}:{node.lineno} imports {n}" for n in names if n and n.startswith(transport + ".")
                )
        for owner, name, line in _reads(tree, module):
            if owner == transport and name not in exported:
                offences.append(f"{src.shown}:{line} reads transport.{name}, which transport does not export")
    return offences


def check_cycles(tree: Tree) -> list[str]:
    """No cycle among the imports that run when a module is imported, the root package included."""
    graph = {m: sorted({e.target for e in edges(tree, m) if e.runtime}) for m in tree}
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                found.append("import cycle: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


# ------------------------------------------------------------- private names


def check_private_imports(tree: Tree) -> list[str]:
    """No ``from <our module> import _name`` (nor ``import`` of a private module of ours) elsewhere."""
    offences = []
    for module, src in tree.items():
        for node, _ in _imports(src.text):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, src.is_package, node.level, node.module)
                owner = _ours(tree, base)
                if owner is None or owner == module:
                    continue
                # ``from . import _x`` of a submodule named _x would be a private module: refuse too.
                offences.extend(
                    f"{src.shown}:{node.lineno} imports {base}.{a.name}" for a in node.names if _private(a.name)
                )
                if any(_private(p) for p in base.split(".")):
                    offences.append(f"{src.shown}:{node.lineno} imports from the private module {base}")
            elif isinstance(node, ast.Import):
                offences.extend(
                    f"{src.shown}:{node.lineno} imports the private module {a.name}"
                    for a in node.names
                    if _ours(tree, a.name) not in (None, module) and any(_private(p) for p in a.name.split("."))
                )
    return offences


def check_private_reads(tree: Tree) -> list[str]:
    """No module reads or writes another module's underscore names, whatever name it is bound to."""
    return [
        f"{tree[module].shown}:{line} uses {owner}.{name}"
        for module in tree
        for owner, name, line in _reads(tree, module)
        if _private(name)
    ]


# ------------------------------------------------------- torch's private side


def _torch_private(target: str) -> bool:
    parts = target.split(".")
    return parts[0] == "torch" and any(_private(p) for p in parts[1:])


def _in_dynamo(module: str) -> bool:
    return module == f"{TOP}.dynamo" or module.startswith(f"{TOP}.dynamo.")


def _chain(node: ast.expr) -> tuple[str | None, list[str]]:
    """(root name, attributes) of ``a.b.c`` -> ("a", ["b", "c"])."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def _is_sys_modules(node: ast.expr) -> bool:
    root, attrs = _chain(node)
    return (root == "sys" and attrs == ["modules"]) or (root == "modules" and not attrs)


def _str_arg(node: ast.Call | ast.Subscript) -> str | None:
    arg = node.slice if isinstance(node, ast.Subscript) else (node.args[0] if node.args else None)
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def check_torch_private(tree: Tree) -> list[str]:
    """Outside ``dynamo/``, nothing reaches torch's private modules or names, in any of the forms
    Python offers: import, attribute, ``importlib.import_module``/``__import__``, ``getattr`` (and
    ``setattr``/``hasattr``/``delattr``), ``sys.modules``; through any name torch is bound to."""
    offences: list[str] = []
    for module, src in tree.items():
        if not _in_dynamo(module):
            offences += _torch_private_in(src.shown, src.text)
    return offences


@functools.cache
def _torch_private_in(where: str, source: str) -> tuple[str, ...]:
    """One module's offences (``check_torch_private``); a module's own, so once per source."""
    offences = []
    body = _nodes(source)
    torch_names = {"torch", "dist"}
    for node in body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
                if _torch_private(a.name):
                    offences.append(f"{where}:{node.lineno} imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            torch_names.update(a.asname or a.name for a in node.names)
            if _torch_private(node.module or "") or any(_private(a.name) for a in node.names):
                offences.append(f"{where}:{node.lineno} imports {node.module} {[a.name for a in node.names]}")
    for node in body:
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root, attrs = _chain(node)
            if root in torch_names:
                offences.append(f"{where}:{node.lineno} reads {root}.{'.'.join(attrs)}")
        elif isinstance(node, ast.Call):
            func = node.func
            text = _str_arg(node)
            if _dynamic_import(node) is not None and _torch_private(_dynamic_import(node) or ""):
                offences.append(f"{where}:{node.lineno} imports {_dynamic_import(node)} dynamically")
            elif (
                isinstance(func, ast.Name)
                and func.id in ("getattr", "setattr", "delattr", "hasattr")
                and len(node.args) >= 2
                and _chain(node.args[0])[0] in torch_names
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
            ):
                offences.append(f"{where}:{node.lineno} {func.id}s {node.args[1].value} of torch")
            elif (
                isinstance(func, ast.Attribute)
                and _is_sys_modules(func.value)
                and text is not None
                and _torch_private(text)
            ):
                offences.append(f"{where}:{node.lineno} takes {text} from sys.modules")
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
            text = _str_arg(node)
            if text is not None and _torch_private(text):
                offences.append(f"{where}:{node.lineno} takes {text} from sys.modules")
    return tuple(offences)


# ---------------------------------------------------- errors and the version

_BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _base_name(node: ast.expr) -> str:
    root, attrs = _chain(node)
    return attrs[-1] if attrs else (root or "")


def check_exceptions(tree: Tree) -> list[str]:
    """Every exception type, underscored or not, is declared in errors.py (a subclass of one of
    ours, of a builtin exception or of a local exception class counts)."""
    errors = f"{TOP}.errors"
    ours = {n.name for n in _nodes(tree[errors].text) if isinstance(n, ast.ClassDef)} if errors in tree else set()
    offences = []
    for module, src in tree.items():
        if module == errors:
            continue
        classes = [n for n in _nodes(src.text) if isinstance(n, ast.ClassDef)]
        exceptional = _BUILTIN_EXCEPTIONS | ours
        flagged: set[int] = set()
        changed = True
        while changed:  # local subclasses of local exception classes, to a fixed point
            changed = False
            for c in classes:
                bases = {_base_name(b) for b in c.bases}
                if id(c) not in flagged and any(b in exceptional or b.endswith(("Error", "Exception")) for b in bases):
                    exceptional.add(c.name)
                    flagged.add(id(c))
                    changed = True
                    offences.append(f"{src.shown}:{c.lineno} declares {c.name}")
    return offences


def _assigned_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _assigned_names(t)
    elif isinstance(target, ast.Starred):
        yield from _assigned_names(target.value)


def version_declarations(tree: Tree) -> list[str]:
    """The modules that assign ``__version__`` (plain, annotated, augmented or unpacked)."""
    out = []
    for module, src in tree.items():
        for node in _nodes(src.text):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            if any("__version__" in _assigned_names(t) for t in targets):
                out.append(module)
                break
    return out


# ------------------------------------------------------- the real tree: clean


def test_every_module_is_in_a_ranked_layer_and_imports_nothing_above_it():
    offences = check_layers(TREE)
    assert not offences, "\n".join(offences)


def test_the_agreements_use_only_what_transport_exports():
    offences = check_transport_exports(TREE)
    assert not offences, "\n".join(offences)


def test_no_module_imports_another_module_s_private_names():
    offences = check_private_imports(TREE)
    assert not offences, "\n".join(offences)


def test_no_module_reads_or_writes_another_module_s_private_names():
    offences = check_private_reads(TREE)
    assert not offences, "\n".join(offences)


def test_only_the_dynamo_package_touches_torch_private_modules_or_names():
    offences = check_torch_private(TREE)
    assert not offences, "\n".join(offences)


def test_our_modules_import_each_other_without_a_cycle():
    offences = check_cycles(TREE)
    assert not offences, "\n".join(offences)


def test_every_exception_type_of_the_package_is_declared_in_errors():
    offences = check_exceptions(TREE)
    assert not offences, "\n".join(offences)


def test_the_version_is_declared_once_and_pyproject_agrees():
    from compiler_collectives.version import __version__

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(__version__)}"$', pyproject, re.M)
    assert version_declarations(TREE) == [f"{TOP}.version"]


# ------------------------------------------------ mutations: each check fails


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        # a top-level import upward: transport reading the agreements
        ("compiler_collectives.transport.groups", "from ..agreements import guard as _g\n"),
        # a lazy one, inside a function
        ("compiler_collectives.agreements.guard", "def f():\n    from ..dynamo import bound\n"),
        # one under TYPE_CHECKING
        ("compiler_collectives.health.diagnosis", "if TYPE_CHECKING:\n    from ..transport import Groups\n"),
        # the store floor reading the health layer above it (a verdict, a diagnosis)
        ("compiler_collectives.store.board", "from ..health.liveness import stale_after\n"),
        ("compiler_collectives.store.calls", "def f():\n    from ..health import diagnosis\n"),
        # the instrumentation reading the agreements (the artifacts' old Shared import)
        (
            "compiler_collectives.instrument.artifacts",
            "if TYPE_CHECKING:\n    from ..agreements.reasons import Shared\n",
        ),
        # the base reading the instrumentation
        ("compiler_collectives.config", "def f():\n    from .instrument import timing\n"),
        # the agreements reading the command-line tools (the old tools.timing import)
        ("compiler_collectives.agreements.compiler", "from ..tools import report\n"),
        # the tools reading the root package (doctor's old `import compiler_collectives as package`)
        ("compiler_collectives.tools.doctor", "def f():\n    import compiler_collectives as package\n"),
        # a name, not a submodule, from the root package
        ("compiler_collectives.dynamo.install", "def f():\n    from .. import install_error\n"),
        # importlib with a constant name
        ("compiler_collectives.health", "import importlib\nimportlib.import_module('compiler_collectives.dynamo')\n"),
        # a module outside every ranked layer
        ("compiler_collectives.extras.thing", "x = 1\n"),
    ],
)
def test_the_layer_check_flags_an_upward_import(module, snippet):
    offences = check_layers(mutated(module, snippet))
    assert offences, f"not flagged: {snippet!r} in {module}"
    assert all("(mutated)" in o or "<mutation" in o for o in offences), offences


def test_the_layer_check_allows_imports_down_and_within_a_layer():
    tree = mutated(
        "compiler_collectives.agreements.guard",
        "def f():\n    from ..transport import groups\n    from . import wire\n    from .. import config\n",
    )
    assert check_layers(tree) == []


@pytest.mark.parametrize(
    "snippet",
    [
        "from ..transport import shm\n",  # agreements/scope.py's old import
        "from ..transport.scope import Scope\n",  # and its other one
        "import compiler_collectives.transport.hierarchy as h\n",
        "from .. import transport\nx = transport.shm\n",
    ],
)
def test_the_transport_export_check_flags_a_name_transport_does_not_export(snippet):
    offences = check_transport_exports(mutated("compiler_collectives.agreements.scope", snippet))
    assert offences, snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "from ..transport.shm import _HDR_VERSION\n",
        "from ..transport import _private_module\n",
        "from ..transport._hidden import x\n",
    ],
)
def test_the_private_import_check_flags_a_private_import(snippet):
    assert check_private_imports(mutated("compiler_collectives.agreements.scope", snippet)), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        # the gap the review found: a module imported under another name
        "import compiler_collectives.transport.shm as s\nx = s._HDR_VERSION\n",
        "from ..transport import shm as s\nx = s._HDR_VERSION\n",
        "import compiler_collectives.transport.shm\nx = compiler_collectives.transport.shm._HDR_VERSION\n",
        "from .. import transport\nx = transport.shm._HDR_VERSION\n",
        "from ..transport import shm\nshm._HDR_VERSION = 9\n",
        "from ..transport import shm\nx = getattr(shm, '_HDR_VERSION')\n",
        "def f():\n    from ..store import board as w\n    return w._log\n",
    ],
)
def test_the_private_read_check_flags_a_private_read_through_any_alias(snippet):
    offences = check_private_reads(mutated("compiler_collectives.agreements.scope", snippet))
    assert offences, snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch._dynamo\n",
        "from torch import _dynamo\n",
        "import torch\nx = torch._dynamo.config\n",
        "import torch as t\nx = t._dynamo\n",
        "from torch import fx\nx = fx._symbolic_trace\n",
        # the gaps the review found
        "import importlib\nm = importlib.import_module('torch._dynamo.config')\n",
        "from importlib import import_module\nm = import_module('torch._inductor')\n",
        "m = __import__('torch._dynamo')\n",
        "import torch\nm = getattr(torch, '_dynamo')\n",
        "import torch\nm = getattr(torch.fx, '_symbolic_trace')\n",
        "import torch\nm = getattr(torch._C, 'x')\n",
        "import torch\nok = hasattr(torch, '_inductor')\n",
        "import sys\nm = sys.modules['torch._dynamo']\n",
        "import sys\nm = sys.modules.get('torch._dynamo.eval_frame')\n",
    ],
)
def test_the_torch_private_check_flags_every_form_outside_dynamo(snippet):
    assert check_torch_private(mutated("compiler_collectives.agreements.scope", snippet)), snippet
    # ... and dynamo/ may.
    assert check_torch_private(mutated("compiler_collectives.dynamo.install", snippet)) == []


def test_the_torch_private_check_leaves_public_torch_alone():
    snippet = "import importlib, sys, torch\nimportlib.import_module('torch.fx')\nsys.modules['torch.nn']\n"
    snippet += "getattr(torch, 'compile')\nx = torch.fx.Graph\n"
    assert check_torch_private(mutated("compiler_collectives.agreements.scope", snippet)) == []


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        # the gap the review found: a cycle through the root package's __init__
        ("compiler_collectives.health", "from .. import install_error\n"),
        ("compiler_collectives.agreements.wire", "import compiler_collectives\n"),
        ("compiler_collectives.transport.gloo", "from compiler_collectives import stats as _s, reset\n"),
        # and an ordinary one
        ("compiler_collectives.transport.shm", "from .groups import Groups\n"),
    ],
)
def test_the_cycle_check_flags_a_cycle(module, snippet):
    offences = check_cycles(mutated(module, snippet))
    assert offences, snippet


def test_the_cycle_check_ignores_imports_that_run_later():
    lazy = "def f():\n    import compiler_collectives\nif TYPE_CHECKING:\n    from .groups import Groups\n"
    assert check_cycles(mutated("compiler_collectives.transport.shm", lazy)) == []


@pytest.mark.parametrize(
    "snippet",
    [
        "class Bad(Exception):\n    pass\n",
        # the gap the review found: an underscored one
        "class _Bad(Exception):\n    pass\n",
        "class _Bad(ValueError):\n    pass\n",
        "from ..errors import CollectiveError\nclass _Mine(CollectiveError):\n    pass\n",
        "class Base(Exception):\n    pass\nclass _Sub(Base):\n    pass\n",
        "def f():\n    class _Local(RuntimeError):\n        pass\n",
    ],
)
def test_the_exception_check_flags_an_exception_declared_outside_errors(snippet):
    assert check_exceptions(mutated("compiler_collectives.agreements.wire", snippet)), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        '__version__ = "9.9.9"\n',
        # the gap the review found: annotated
        '__version__: str = "9.9.9"\n',
        '__version__, other = "9.9.9", 1\n',
    ],
)
def test_the_version_check_flags_a_second_declaration(snippet):
    assert version_declarations(mutated("compiler_collectives.stats", snippet)) != [f"{TOP}.version"], snippet


# ------------------------------------------------------------------- docs


def _layer_picture() -> list[str]:
    """docs/design.md's layer picture, one text per box section, top to bottom."""
    doc = (ROOT / "docs" / "design.md").read_text()
    block = doc.split("## Layers, and where each lives", 1)[1].split("```", 2)[1]
    sections: list[str] = []
    for line in block.splitlines():
        if line.strip().startswith(("┌", "├", "└")):
            sections.append("")
        elif sections and line.strip().startswith("│"):
            sections[-1] += line + "\n"
    return [s for s in sections if s]


def test_docs_design_draws_the_layers_in_rank_order_with_every_module():
    sections = _layer_picture()
    special = {"package": "compiler_collectives/__init__.py", "base": "compiler_collectives/*.py"}
    order = []
    for layer in RANKS:
        where = special.get(layer, f"compiler_collectives/{layer}/")
        boxes = [s for s in sections if where in s]
        assert len(boxes) == 1, f"docs/design.md's layer picture has {len(boxes)} boxes for {where}"
        text = boxes[0]
        order.append(sections.index(text))
        for module in TREE:
            if layer_of(module) != layer or TREE[module].is_package:
                continue
            name = module.rsplit(".", 1)[1]
            assert re.search(rf"(?<![\w.]){re.escape(name)}\b", text), f"the {layer} box does not name {module}"
    assert order == sorted(order), "docs/design.md draws the layers out of rank order"


# --------------------------------------------------------------- seam table


def test_every_replacement_the_seam_table_names_exists():
    import importlib

    from compiler_collectives.dynamo import table

    for row in table.SEAMS:
        if row.replace is None:
            continue
        module_name, name = row.replace.split(":")
        module = importlib.import_module(f"compiler_collectives.dynamo.{module_name}")
        assert callable(getattr(module, name, None)), f"{row.name}: {row.replace} does not exist"


def test_the_installed_torch_passes_every_required_row_of_the_seam_table():
    from compiler_collectives.dynamo import table

    problems, degraded = table.check(table.required_rows())
    assert problems == [] and degraded == []


def test_docs_design_lists_every_row_of_the_seam_table():
    from compiler_collectives.dynamo import table

    doc = (ROOT / "docs" / "design.md").read_text()
    for row in table.SEAMS:
        line = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{row.module}:{row.path}` |")), None)
        assert line is not None, f"docs/design.md does not list the seam {row.module}:{row.path}"
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == (f"`{row.replace}`" if row.replace else "— (read)"), line
        assert cells[2] == ("yes" if row.required else f"no ({row.level})"), line
        for read in row.reads:
            assert read.what in cells[3], f"{row.name}: the read {read.what!r} is not in docs/design.md"


def _imported_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return names


ROOT_INSTALL = f"{TOP}.runtime"  # the package root's one call at import: this module's install()


def _module_level_calls(tree: ast.Module) -> Iterator[ast.Call]:
    """Every call that runs when the module is imported (not inside a function or a class body's function)."""

    def visit(node: ast.AST) -> Iterator[ast.Call]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Call):
            yield node
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    for node in tree.body:
        yield from visit(node)


def check_import_effects(tree: Tree) -> list[str]:
    """Importing a module only defines; the package root's import runs one call, ``runtime.install()``.

    Elsewhere a module-level call statement, or a module-level write into a module or object it
    imported, is flagged. In the root package every call that runs at import is flagged but one,
    ``install()`` of ``runtime`` (the composition root), which must be there exactly once.
    """
    offences = []
    for module, source in tree.items():
        parsed = _parse(source.text)
        if module == TOP:
            aliases = _aliases(tree, module)
            installs = 0
            for call in _module_level_calls(parsed):
                func = call.func
                if (
                    isinstance(func, ast.Attribute)
                    and func.attr == "install"
                    and _module_of(tree, aliases, func.value) == ROOT_INSTALL
                ):
                    installs += 1
                else:
                    offences.append(f"{source.shown}:{call.lineno} calls {ast.unparse(call)[:60]} when imported")
            if installs != 1:
                offences.append(f"{source.shown} runs runtime.install() {installs} times when imported, not once")
            continue
        imported = _imported_names(parsed)
        for node in parsed.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                offences.append(f"{source.shown}:{node.lineno} calls {ast.unparse(node.value)[:60]}")
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign)
                else []
            )
            for target in targets:
                base = target
                while isinstance(base, (ast.Attribute, ast.Subscript)):
                    base = base.value
                if base is not target and isinstance(base, ast.Name) and base.id in imported:
                    offences.append(f"{source.shown}:{node.lineno} sets {ast.unparse(target)}")
    return offences


def test_importing_the_package_runs_runtime_install_once_and_no_module_registers_anything():
    """Module-level code only defines; the root's one call is the composition root's install()."""
    assert check_import_effects(TREE) == []


def _root_without_install() -> Tree:
    tree = dict(TREE)
    old = tree[TOP]
    lines = [ln for ln in old.text.splitlines() if "_runtime.install()" not in ln or ln.startswith((" ", "#"))]
    tree[TOP] = Source(old.shown + " (mutated)", "\n".join(lines) + "\n", True)
    return tree


@pytest.mark.parametrize(
    ("module", "snippet"),
    [
        # a lower layer registering a hook of its own when imported
        ("compiler_collectives.transport.groups", "import os\nos.register_at_fork(after_in_child=print)\n"),
        # a module wiring another at import (what dynamo/wiring.py's wire() does at install)
        ("compiler_collectives.dynamo.tooling", "from ..agreements import audit\naudit.sink = print\n"),
        # the composition root doing something when imported, rather than when install() runs
        ("compiler_collectives.runtime", "install()\n"),
        # the root package registering a hook beside install(), or installing twice
        (TOP, "import os as _o\n_o.register_at_fork(after_in_child=print)\n"),
        (TOP, "_runtime.install()\n"),
        (TOP, "_warned = _runtime.warn_retired_variables()\n"),
    ],
)
def test_the_import_effect_check_flags_a_module_that_does_something_when_imported(module, snippet):
    offences = check_import_effects(mutated(module, snippet))
    assert offences and all("(mutated)" in o for o in offences), offences


def test_the_import_effect_check_flags_a_package_root_that_does_not_install():
    assert check_import_effects(_root_without_install()) == [
        f"{TREE[TOP].shown} (mutated) runs runtime.install() 0 times when imported, not once"
    ]


def test_the_seam_modules_read_torch_internals_only_through_bound_and_only_rows_of_the_table():
    from compiler_collectives.dynamo import table

    names = {row.name for row in table.SEAMS}
    keyed = re.compile(r"\b(?:originals|torch_of|pgo)(?:\[|\.get\()\s*\"([^\"]+)\"")
    called = re.compile(r"\b(?:current|set_current|config_patch|named|holds|original)\(\s*\"([^\"]+)\"")
    offences = []
    for module, source in TREE.items():
        if not module.startswith(f"{TOP}.dynamo.") or module.endswith(".table"):
            continue
        text = source.text
        for pattern in (keyed, called):
            offences += [
                f"{source.shown}: {m.group(1)!r} is no row" for m in pattern.finditer(text) if m.group(1) not in names
            ]
        for node in _nodes(text):
            if isinstance(node, ast.Import):
                targets = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, source.is_package, node.level, node.module)
                targets = [(base, [alias.name for alias in node.names])]
            else:
                continue
            for target, imported in targets:
                if _torch_private(target) or (target.split(".")[0] == "torch" and any(_private(n) for n in imported)):
                    offences.append(f"{source.shown}:{node.lineno} imports {target} {imported} (read it through bound)")
        for node in _nodes(text):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                value = node.value
                while isinstance(value, ast.Attribute):
                    value = value.value
                if isinstance(value, ast.Name) and value.id == "torch":
                    offences.append(f"{source.shown}:{node.lineno} reads {ast.unparse(node)} (read it through bound)")
    assert not offences, "\n".join(offences)


def test_every_namespace_the_audit_counts_as_communication_has_a_row():
    from compiler_collectives.agreements.fingerprint import COMM_NAMESPACES
    from compiler_collectives.dynamo import table

    checked = {
        row.path.split(".")[1] for row in table.SEAMS if row.module == "torch._ops" and row.path.startswith("ops.")
    }
    assert checked == COMM_NAMESPACES - {"c10d_functional"}  # legacy: registers no op in the supported releases
