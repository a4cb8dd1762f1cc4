"""The docs match the code: settings table, documented errors, README commands."""

from __future__ import annotations

import ast
import pathlib
import re

import compiler_collectives
from compiler_collectives import config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_configuration_doc_lists_every_setting_with_its_default():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for row in config.SETTINGS_TABLE:
        line = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{row.env}` |")), None)
        assert line is not None, f"{row.env} is not in docs/configuration.md"
        assert f"`{row.default!r}`" in line, f"{row.env}: documented default differs from {row.default!r}"


def test_configuration_doc_says_which_settings_must_match_across_ranks_as_the_table_does():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for row in config.SETTINGS_TABLE:
        line = next(ln for ln in doc.splitlines() if ln.startswith(f"| `{row.env}` |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == ("yes" if row.must_match else "no"), f"{row.env}: must-match column is {cells[2]!r}"
    # The settings the issue names as free to differ stay free.
    free = {row.attr for row in config.SETTINGS_TABLE if not row.must_match}
    assert {"trace_dir", "timing"} <= free


def _pinned_type(node: ast.AST) -> str | None:
    """The error type a statement proves was raised: ``pytest.raises(Name)`` or an
    exact ``assert result[...] == "Name"`` (the rank helpers record ``type(e).__name__``
    of what they caught). ``in (A, B)`` and message substrings prove nothing."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "raises"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "pytest"
        and node.args
    ):
        arg = node.args[0]
        if isinstance(arg, ast.Name):
            return arg.id
        if isinstance(arg, ast.Attribute):
            return arg.attr
    if (
        isinstance(node, ast.Assert)
        and isinstance(node.test, ast.Compare)
        and len(node.test.ops) == 1
        and isinstance(node.test.ops[0], ast.Eq)
        and isinstance(node.test.left, ast.Subscript)
    ):
        right = node.test.comparators[0]
        if isinstance(right, ast.Constant) and isinstance(right.value, str):
            return right.value
    return None


def _tests_pinning_each_error_type() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name == "test_docs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                for statement in ast.walk(node):
                    name = _pinned_type(statement)
                    if name is not None:
                        found.setdefault(name, []).append(f"{path.name}::{node.name}")
    return found


def test_every_documented_error_exists_and_a_test_raises_exactly_that_type():
    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    documented = re.findall(r"^## (\w+)$", doc, flags=re.MULTILINE)
    assert "CollectiveTimeoutError" in documented
    pinned = _tests_pinning_each_error_type()
    for name in documented:
        if name == "CollectiveError":
            continue  # the base class: every test of a subclass produces one
        # the type exists where users import it from ...
        assert name in ("ConfigError", "ReportError") or hasattr(compiler_collectives, name), name
        # ... and some test function makes it happen and checks that exact type
        assert pinned.get(name), f"no test raises the documented error {name} and checks its type"


def test_every_exported_error_is_documented():
    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    for name in compiler_collectives.__all__:
        if name.endswith("Error"):
            assert f"## {name}" in doc, f"{name} is exported but not in docs/troubleshooting.md"


def test_readme_opens_with_the_demo_and_test_commands_that_ci_runs():
    readme = (ROOT / "README.md").read_text().splitlines()[:25]
    text = "\n".join(readme)
    assert "scripts/dev demo" in text and "scripts/dev test" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/dev test" in ci


def test_ci_runs_every_tested_torch_release_and_pyproject_and_the_docs_agree():
    import tomllib

    from compiler_collectives import dynamo

    ci = (ROOT / ".ci" / "run").read_text()
    # lanes=("release:tier" "release:tier release:tier"): each quoted lane's runs in order, the lanes side by side.
    lanes = re.search(r"^lanes=\((.*)\)$", ci, flags=re.MULTILINE).group(1)
    runs = dict(run.split(":") for run in lanes.replace('"', " ").split())
    releases = sorted(runs, key=lambda r: tuple(map(int, r.split("."))))
    assert tuple(releases) == dynamo.TESTED_TORCH
    # The whole suite on the newest release, the tier a release can change on the others.
    assert runs == {r: ("all" if r == releases[-1] else "seam") for r in releases}
    # The README's default release, run by the README's own command; --all-releases knows them all.
    assert re.search(r"^default_release=2\.13\.0\b", ci, flags=re.MULTILINE)
    assert re.search(r'^default_torch="2\.13\.0"$', (ROOT / "scripts" / "dev").read_text(), flags=re.MULTILINE)
    dev_releases = re.search(r"^supported_torch=\((.*)\)$", (ROOT / "scripts" / "dev").read_text(), re.MULTILINE)
    assert tuple(dev_releases.group(1).split()) == dynamo.TESTED_TORCH
    assert all(dynamo.version_supported(r) for r in releases)
    (lo_major, lo_minor), (hi_major, hi_minor) = dynamo.SUPPORTED_TORCH
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}" in deps
    for doc in ("README.md", "docs/usage.md"):
        text = (ROOT / doc).read_text()
        assert all(r in text for r in releases), f"{doc} does not name every tested release"


def test_usage_doc_shows_how_to_read_a_job_with_tlparse_and_torch_logs():
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert "TORCH_TRACE=" in usage and "tlparse /tmp/trace" in usage and "--all-ranks-html" in usage
    assert "`compiler_collectives` | INFO" in usage and "`+compiler_collectives` | DEBUG" in usage
