"""``rank_env``: the one way a test writes its ranks' environment (tests/rank_env.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from compiler_collectives import config
from tests.rank_env import rank_env, setting_variables


def test_a_setting_named_as_the_settings_table_names_it_becomes_its_variable():
    assert rank_env(timeout_s=30, scope="strided:2") == {
        "COMPILER_COLLECTIVES_TIMEOUT": "30",
        "COMPILER_COLLECTIVES_SCOPE": "strided:2",
    }


def test_a_switch_is_written_1_or_0():
    assert rank_env(guards=True, audit=False) == {"COMPILER_COLLECTIVES_GUARDS": "1", "COMPILER_COLLECTIVES_AUDIT": "0"}


def test_what_rank_env_writes_a_rank_reads_back_as_the_values_given():
    given = {"timeout_s": 2.5, "heartbeat_s": 0.0005, "max_payload_bytes": 65536, "compile_once": False}
    settings = config.load_from_env(rank_env(**given))
    assert {name: getattr(settings, name) for name in given} == given


def test_an_unknown_setting_is_refused_naming_every_known_one():
    with pytest.raises(TypeError, match="no setting named timeout") as refused:
        rank_env(timeout=30)  # the variable's name, not the setting's
    assert all(row.attr in str(refused.value) for row in config.SETTINGS_TABLE)


def test_a_setting_passed_as_a_raw_variable_in_extra_is_refused_naming_its_keyword():
    with pytest.raises(TypeError, match=r"COMPILER_COLLECTIVES_TIMEOUT \(as timeout_s=...\)"):
        rank_env(extra={"COMPILER_COLLECTIVES_TIMEOUT": "30"})


def test_every_variable_rank_env_writes_for_a_setting_is_that_settings_variable_in_the_table():
    # rank_env reads the table from config.py's source (it must not import the package): the
    # same rows as the imported table, so every keyword writes exactly its row's variable.
    assert setting_variables() == {row.attr: row.env for row in config.SETTINGS_TABLE}
    every = rank_env(**{row.attr: row.default for row in config.SETTINGS_TABLE})
    assert set(every) == {row.env for row in config.SETTINGS_TABLE}


def test_the_harness_process_group_timeout_is_written_for_the_harness():
    assert rank_env(pg_timeout_s=1800) == {"HARNESS_PG_TIMEOUT": "1800"}


def test_a_single_inductor_thread_means_one_compile_worker_and_one_openmp_thread():
    assert rank_env(inductor_single_thread=True) == {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}


def test_any_other_variable_goes_through_extra_as_it_is():
    assert rank_env(timeout_s=60, extra={"TORCH_LOGS": "+dynamo"}) == {
        "COMPILER_COLLECTIVES_TIMEOUT": "60",
        "TORCH_LOGS": "+dynamo",
    }


def test_rank_env_imports_nothing_of_the_package():
    # The forkserver preloads tests.fixtures, which imports rank_env: the package's import
    # would install it there, before any rank's environment exists (tests/harness.py).
    tree = ast.parse((Path(__file__).resolve().parents[1] / "rank_env.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "compiler_collectives"], imported
