"""One way to write the environment a test gives its ranks: ``rank_env(timeout_s=30)``.

Our settings are named as ``compiler_collectives.config.SETTINGS_TABLE`` names them
(``Setting.attr``) and rendered as their variables (``Setting.env``): a bool as 1/0, anything
else as ``str``. A name the table does not hold is refused where the test is written, rather
than becoming a variable no rank reads. The harness's process-group timeout and inductor's
single compile thread have keywords of their own; any other variable (``TORCH_LOGS``,
``GROUP_RANK``, ``TORCHINDUCTOR_CACHE_DIR``, ...) goes through ``extra``.

The table is read from ``config.py``'s source, not imported: importing
``compiler_collectives.config`` imports the package, whose install reads the settings and
patches torch. A rank imports its test module (whose ``ENV = rank_env(...)`` runs then)
before its job runs, and some jobs import the package only later on purpose (after a process
group exists, or to catch a ``ConfigError``); the forkserver, which preloads
``tests.fixtures``, must not import it at all (tests/harness.py). ``tests/unit/test_rank_env.py``
holds this reading to the imported table.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from pathlib import Path

CONFIG_SOURCE = Path(__file__).resolve().parents[1] / "compiler_collectives" / "config.py"
PG_TIMEOUT_ENV = "HARNESS_PG_TIMEOUT"  # read by tests/harness.py's _child
# Inductor's compile workers and OpenMP's threads: one each, for ranks that share two cores.
SINGLE_THREAD_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}


@functools.cache
def setting_variables() -> dict[str, str]:
    """Each setting's name (``Setting.attr``) -> its variable (``Setting.env``), in table order:
    the first two arguments of every ``Setting(...)`` in ``SETTINGS_TABLE``."""
    tree = ast.parse(CONFIG_SOURCE.read_text())
    table = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "SETTINGS_TABLE"
    )
    assert isinstance(table, ast.Tuple)
    rows = {}
    for call in table.elts:
        assert isinstance(call, ast.Call) and len(call.args) >= 2
        attr, env = (ast.literal_eval(arg) for arg in call.args[:2])
        rows[attr] = env
    return rows


def _render(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def rank_env(
    *,
    pg_timeout_s: float | None = None,
    inductor_single_thread: bool = False,
    extra: Mapping[str, str] | None = None,
    **settings: object,
) -> dict[str, str]:
    """The variables for ``settings`` (by ``Setting.attr``), ``pg_timeout_s`` (the harness's
    ``HARNESS_PG_TIMEOUT``), ``inductor_single_thread`` and ``extra``: for ``run_ranks``'s
    ``env`` or a rank's entry in its ``rank_env``."""
    variables = setting_variables()
    unknown = sorted(set(settings) - variables.keys())
    if unknown:
        raise TypeError(f"rank_env(): no setting named {', '.join(unknown)}; the settings: {', '.join(variables)}")
    # A setting's variable only through its keyword: one spelling, checked, per setting.
    keywords = {env: attr for attr, env in variables.items()}
    through_extra = [f"{name} (as {keywords[name]}=...)" for name in sorted(extra or {}) if name in keywords]
    if through_extra:
        raise TypeError(f"rank_env(): pass a setting by its keyword, not in extra: {', '.join(through_extra)}")
    env = {variables[name]: _render(value) for name, value in settings.items()}
    if pg_timeout_s is not None:
        env[PG_TIMEOUT_ENV] = _render(pg_timeout_s)
    if inductor_single_thread:
        env.update(SINGLE_THREAD_ENV)
    env.update(extra or {})
    return env
