"""The docs match the code: settings table, documented errors, README commands."""

from __future__ import annotations

import pathlib
import re

import compiler_collectives
from compiler_collectives import config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_configuration_doc_lists_every_setting_with_its_default():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for row in config.SETTINGS_TABLE:
        line = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{row.env}` |")), None)
        assert line is not None, f"{row.env} is not in docs/configuration.md"
        assert f"`{row.default!r}`" in line, f"{row.env}: documented default differs from {row.default!r}"


def test_every_documented_error_exists_and_is_produced_by_a_test():
    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    documented = re.findall(r"^## (\w+)$", doc, flags=re.MULTILINE)
    assert "CollectiveTimeoutError" in documented
    tests_text = "\n".join(
        p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_docs.py"
    )
    for name in documented:
        if name == "CollectiveError":
            continue  # the base class: every test of a subclass produces one
        # the type exists where users import it from ...
        assert name in ("ConfigError", "ReportError") or hasattr(compiler_collectives, name), name
        # ... and some test makes it happen and checks its type
        produced = (
            f"pytest.raises({name}" in tests_text
            or f"pytest.raises(report.{name}" in tests_text
            or f'== "{name}"' in tests_text
            or f'"{name}" in' in tests_text
            or f'("{name}",' in tests_text
            or f'"{name}")' in tests_text
        )
        assert produced, f"no test produces the documented error {name}"


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

    from compiler_collectives import dynamo_seams

    ci = (ROOT / ".ci" / "run").read_text()
    releases = re.search(r"^releases=\((.*)\)$", ci, flags=re.MULTILINE).group(1).split()
    assert tuple(releases) == dynamo_seams.TESTED_TORCH
    assert releases[0] == "2.13.0"  # the README's default, run by the README's own command
    assert all(dynamo_seams.version_supported(r) for r in releases)
    (lo_major, lo_minor), (hi_major, hi_minor) = dynamo_seams.SUPPORTED_TORCH
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}" in deps
    for doc in ("README.md", "docs/usage.md"):
        text = (ROOT / doc).read_text()
        assert all(r in text for r in releases), f"{doc} does not name every tested release"


def test_usage_doc_shows_how_to_read_a_job_with_tlparse_and_torch_logs():
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert "TORCH_TRACE=" in usage and "tlparse /tmp/trace" in usage and "--all-ranks-html" in usage
    assert "`compiler_collectives` | INFO" in usage and "`+compiler_collectives` | DEBUG" in usage
