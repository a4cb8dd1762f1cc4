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
