"""The package's layout keeps its promises: layers, private names, one seam table.

* No module reads or writes another module's underscore names.
* Only ``compiler_collectives/dynamo/`` imports torch's private modules or
  reads torch's underscore names.
* No import cycle between our modules at import time.
* Every replacement the seam table names exists, and every row is listed in
  docs/design.md; the package version is declared once, as pyproject says.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "compiler_collectives"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: pathlib.Path, top_level_only: bool) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in ``module``."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                target = _resolve_relative(module, is_package, node.level, node.module)
            out.append((target, [alias.name for alias in node.names], node.lineno))
    return out


def _our_module(name: str) -> str | None:
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_another_module_s_private_names():
    offences = []
    for module, path in MODULES.items():
        for target, names, line in _imports(module, path, top_level_only=False):
            owner = _our_module(target)
            if owner is None or owner == module:
                continue
            for name in names:
                # ``from . import _x`` of a submodule named _x would be a private module: refuse too.
                if _private(name):
                    offences.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
    assert not offences, "\n".join(offences)


def _module_aliases(module: str, path: pathlib.Path) -> dict[str, str]:
    """Local names bound to our modules by imports (``from .. import health`` -> health)."""
    aliases = {}
    for target, names, _ in _imports(module, path, top_level_only=False):
        if not names:
            continue
        for name in names:
            full = f"{target}.{name}" if target else name
            if full in MODULES:
                aliases[name] = full
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname:
                    target = (
                        _resolve_relative(module, path.name == "__init__.py", node.level, node.module)
                        if node.level
                        else (node.module or "")
                    )
                    full = f"{target}.{alias.name}"
                    if full in MODULES:
                        aliases[alias.asname] = full
    return aliases


def test_no_module_reads_or_writes_another_module_s_private_names():
    offences = []
    for module, path in MODULES.items():
        aliases = _module_aliases(module, path)
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != module
                and _private(node.attr)
            ):
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not offences, "\n".join(offences)


def _torch_private(target: str) -> bool:
    return target.split(".")[0] == "torch" and any(_private(p) for p in target.split(".")[1:])


def test_only_the_dynamo_package_touches_torch_private_modules_or_names():
    offences = []
    for module, path in MODULES.items():
        if module.startswith("compiler_collectives.dynamo"):
            continue
        for target, names, line in _imports(module, path, top_level_only=False):
            if _torch_private(target) or (target.split(".")[0] == "torch" and any(_private(n) for n in names)):
                offences.append(f"{path.relative_to(ROOT)}:{line} imports {target} {names}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in ("torch", "dist"):
                    offences.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} reads {value.id}.{'.'.join(reversed(chain))}"
                    )
    assert not offences, "\n".join(offences)


def test_our_modules_import_each_other_without_a_cycle():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, names, _ in _imports(module, path, top_level_only=True):
            for full in [target] + [f"{target}.{n}" for n in names]:
                owner = _our_module(full)
                if owner is not None and owner != module and not module.startswith(owner + "."):
                    graph[module].add(owner)
    # A package's __init__ importing its own submodules is how packages work; a
    # submodule importing its package back (beyond the parents Python imports
    # first anyway) is a cycle like any other.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1 and not nxt.startswith(node + ".") and not node.startswith(nxt + "."):
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


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


def test_the_version_is_declared_once_and_pyproject_agrees():
    from compiler_collectives.version import __version__

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(__version__)}"$', pyproject, re.M)
    declared = [p for p in MODULES.values() if re.search(r"^__version__\s*=", p.read_text(), re.M)]
    assert declared == [PACKAGE / "version.py"]


def test_every_exception_type_of_the_package_is_declared_in_errors():
    offences = []
    for module, path in MODULES.items():
        if module == "compiler_collectives.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not _private(node.name):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if any(b.endswith(("Error", "Exception")) or b in ("Exception", "BaseException") for b in bases):
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno} declares {node.name}")
    assert not offences, "\n".join(offences)


def _imported_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return names


def test_no_module_but_the_package_root_registers_anything_when_imported():
    """Module-level code only defines: wiring is ``dynamo/wiring.py``'s, run by install."""
    offences = []
    for module, path in MODULES.items():
        if module == "compiler_collectives":
            continue  # installs at import, by design (and registers the fork handler)
        tree = ast.parse(path.read_text())
        imported = _imported_names(tree)
        for node in tree.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {ast.unparse(node.value)[:60]}")
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
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno} sets {ast.unparse(target)}")
    assert not offences, "\n".join(offences)


def test_the_seam_modules_read_torch_internals_only_through_bound_and_only_rows_of_the_table():
    from compiler_collectives.dynamo import table

    names = {row.name for row in table.SEAMS}
    keyed = re.compile(r"\b(?:originals|torch_of|pgo)(?:\[|\.get\()\s*\"([^\"]+)\"")
    called = re.compile(r"\b(?:current|set_current|config_patch|named|holds|original)\(\s*\"([^\"]+)\"")
    offences = []
    for module, path in MODULES.items():
        if not module.startswith("compiler_collectives.dynamo.") or module.endswith(".table"):
            continue
        text = path.read_text()
        for pattern in (keyed, called):
            offences += [
                f"{path.name}: {m.group(1)!r} is no row" for m in pattern.finditer(text) if m.group(1) not in names
            ]
        for target, imported, line in _imports(module, path, top_level_only=False):
            if _torch_private(target) or (target.split(".")[0] == "torch" and any(_private(n) for n in imported)):
                offences.append(f"{path.name}:{line} imports {target} {imported} (read it through bound)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                value = node.value
                while isinstance(value, ast.Attribute):
                    value = value.value
                if isinstance(value, ast.Name) and value.id == "torch":
                    offences.append(f"{path.name}:{node.lineno} reads {ast.unparse(node)} (read it through bound)")
    assert not offences, "\n".join(offences)


def test_every_namespace_the_audit_counts_as_communication_has_a_row():
    from compiler_collectives.agreements.fingerprint import COMM_NAMESPACES
    from compiler_collectives.dynamo import table

    checked = {
        row.path.split(".")[1] for row in table.SEAMS if row.module == "torch._ops" and row.path.startswith("ops.")
    }
    assert checked == COMM_NAMESPACES - {"c10d_functional"}  # legacy: registers no op in the supported releases
