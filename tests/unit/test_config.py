"""Settings: parsing from the environment, Python overrides, and their documentation."""

from __future__ import annotations

import pytest

import compiler_collectives_autoload as autoload
from compiler_collectives import config
from compiler_collectives.config import ConfigError, load_from_env


def test_every_setting_has_its_documented_default_when_the_environment_is_empty():
    settings = load_from_env({})
    for row in config.SETTINGS_TABLE:
        assert getattr(settings, row.attr) == row.default
        assert settings.sources[row.attr] == "default"


def test_environment_values_are_parsed_and_marked_as_coming_from_the_environment():
    settings = load_from_env(
        {
            "COMPILER_COLLECTIVES_GUARDS": "yes",
            "COMPILER_COLLECTIVES_TIMEOUT": "12.5",
            "COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES": "1024",
            "COMPILER_COLLECTIVES_HEARTBEAT_S": "0",
        }
    )
    assert settings.guards is True
    assert settings.timeout_s == 12.5
    assert settings.max_payload_bytes == 1024
    assert settings.heartbeat_s == 0.0
    assert settings.sources["timeout_s"] == "env"


# Each names the variable; where ``import torch`` reports it (the autoload tests run one of each
# route), also the value and what is accepted.
@pytest.mark.parametrize(
    "env, value, expected",
    [
        ("COMPILER_COLLECTIVES_TIMEOUT", "soon", "COMPILER_COLLECTIVES_TIMEOUT"),
        ("COMPILER_COLLECTIVES_TIMEOUT", "0", "COMPILER_COLLECTIVES_TIMEOUT"),
        ("COMPILER_COLLECTIVES_GUARDS", "maybe", "COMPILER_COLLECTIVES_GUARDS"),
        ("COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES", "1.5", "COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES"),
        ("COMPILER_COLLECTIVES_HEARTBEAT_S", "-1", "COMPILER_COLLECTIVES_HEARTBEAT_S"),
        (
            "COMPILER_COLLECTIVES_GUARDS",
            "ture",
            "COMPILER_COLLECTIVES_GUARDS='ture': expected 1/0, true/false, yes/no or on/off",
        ),
        ("COMPILER_COLLECTIVES_TIMEOUT", "5m", "COMPILER_COLLECTIVES_TIMEOUT='5m': expected a number of seconds"),
        (
            "COMPILER_COLLECTIVES_GUARD_TRANSPORT",
            "shm",
            "COMPILER_COLLECTIVES_GUARD_TRANSPORT='shm': expected one of auto, gloo",
        ),
        ("COMPILER_COLLECTIVES_AUTOLOAD", "yes please", "COMPILER_COLLECTIVES_AUTOLOAD='yes please': expected 1/0"),
    ],
)
def test_a_value_that_does_not_parse_raises_config_error_naming_the_variable(env, value, expected):
    with pytest.raises(ConfigError) as raised:
        load_from_env({env: value})
    assert expected in str(raised.value)


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("COMPILER_COLLECTIVES_GAURDS", "COMPILER_COLLECTIVES_GUARDS"),
        ("COMPILER_COLLECTIVES_TIMEOUT_S", "COMPILER_COLLECTIVES_TIMEOUT"),
    ],
)
def test_a_misspelt_variable_name_is_refused_naming_the_closest_known_one(typo, meant):
    with pytest.raises(ConfigError) as raised:
        load_from_env({typo: "1"})
    assert f"{typo} is not a compiler_collectives variable: did you mean {meant}?" in str(raised.value)


@pytest.mark.parametrize(
    "environ, wanted",
    [
        ({}, False),
        ({"TORCH_COMPILER_COLLECTIVES": "1"}, True),
        ({"TORCH_COMPILER_COLLECTIVES": "0"}, False),
        ({"COMPILER_COLLECTIVES_GUARDS": "ture"}, True),  # a bad value is checked, not ignored
        ({"COMPILER_COLLECTIVES_GAURDS": "1"}, True),  # so is a misspelt name
        ({"COMPILER_COLLECTIVES_LOG_LEVEL": "DEBUG"}, False),  # retired: read by nobody
        ({"TORCH_COMPILER_COLLECTIVES": "1", "COMPILER_COLLECTIVES_AUTOLOAD": "0"}, False),
    ],
    ids=["nothing", "torch-switch", "torch-switch-off", "bad-value", "misspelt", "retired", "autoload-off"],
)
def test_import_torch_activates_us_for_torchs_switch_or_any_variable_of_ours_unless_autoload_is_off(environ, wanted):
    assert autoload.wanted(environ) is wanted


def test_override_changes_settings_temporarily_and_restores_them():
    before = config.settings.timeout_s
    with config.override(timeout_s=before + 1):
        assert config.settings.timeout_s == before + 1
        assert config.settings.sources["timeout_s"] == "api"
    assert config.settings.timeout_s == before


def test_setting_an_unknown_name_is_refused():
    with pytest.raises(AttributeError):
        config.set_value("no_such_setting", 1)
