"""Settings: parsing from the environment, Python overrides, and their documentation."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize(
    "env, value",
    [
        ("COMPILER_COLLECTIVES_TIMEOUT", "soon"),
        ("COMPILER_COLLECTIVES_TIMEOUT", "0"),
        ("COMPILER_COLLECTIVES_GUARDS", "maybe"),
        ("COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES", "1.5"),
        ("COMPILER_COLLECTIVES_HEARTBEAT_S", "-1"),
    ],
)
def test_a_value_that_does_not_parse_raises_config_error_naming_the_variable(env, value):
    with pytest.raises(ConfigError, match=env):
        load_from_env({env: value})


def test_override_changes_settings_temporarily_and_restores_them():
    before = config.settings.timeout_s
    with config.override(timeout_s=before + 1):
        assert config.settings.timeout_s == before + 1
        assert config.settings.sources["timeout_s"] == "api"
    assert config.settings.timeout_s == before


def test_setting_an_unknown_name_is_refused():
    with pytest.raises(AttributeError):
        config.set_value("no_such_setting", 1)
