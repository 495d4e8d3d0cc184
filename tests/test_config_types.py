"""Each service's table of settings and its typed configuration name the same settings with the
same types: every Setting has a field whose type its default and its parser give, and every
field has a Setting. So `config.name` is a real attribute mypy checks, and a setting added to a
table without its field (or the other way round) fails here before anything reads it."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from fleet_min.config import COLLECTOR_SETTINGS, CollectorConfig, Setting, SettingsTable, resolve
from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS, ControlPlaneConfig

TABLES = [pytest.param(COLLECTOR_SETTINGS, CollectorConfig, id="collector"),
          pytest.param(CONTROLPLANE_SETTINGS, ControlPlaneConfig, id="controlplane")]


def _fits(value: Any, kind: Any) -> bool:
    """Is value of the annotated type (bool is not an int here, nor an int a float)?"""
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return isinstance(value, tuple) and all(_fits(part, item) for part in value)
    return type(value) is kind


def _parser_returns(setting: Setting) -> Any:
    """The type a setting's parser gives (a plain type, such as str, is its own parser)."""
    if isinstance(setting.kind, type):
        return setting.kind
    return typing.get_type_hints(setting.kind)["return"]


def mismatches(table: SettingsTable[Any], config: type) -> list[str]:
    fields = typing.get_type_hints(config)
    found = []
    for setting in table:
        if setting.name not in fields:
            found.append(f"{setting.name}: no field")
            continue
        kind = fields[setting.name]
        if not _fits(setting.default, kind):
            found.append(f"{setting.name}: default {setting.default!r} is not {kind}")
        if _parser_returns(setting) != kind:
            found.append(f"{setting.name}: its parser gives {_parser_returns(setting)}, "
                         f"the field is {kind}")
    names = {setting.name for setting in table}
    found += [f"{name}: no setting" for name in fields if name not in names]
    return found


@pytest.mark.parametrize("table, config", TABLES)
def test_every_setting_has_a_field_of_its_type_and_every_field_a_setting(table, config):
    assert table.config is config
    assert dataclasses.is_dataclass(config)
    assert mismatches(table, config) == []


@pytest.mark.parametrize("table, config", TABLES)
def test_resolve_builds_the_typed_configuration(table, config):
    resolved = resolve(table, environ={})
    assert type(resolved) is config
    for setting in table:
        assert getattr(resolved, setting.name) == setting.default
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.port = 1
    with pytest.raises(AttributeError):
        resolved.no_such_setting  # noqa: B018 (nothing answers for a name outside the table)


def test_a_field_and_a_setting_that_disagree_are_found():
    @dataclasses.dataclass(frozen=True)
    class Wrong:
        port: float
        extra: str

    table = SettingsTable(Wrong, Setting("port", "FLEET_PORT", 8788, int, "TCP port."),
                          Setting("name", "FLEET_NAME", "", str, "A name."))
    assert mismatches(table, Wrong) == [
        "port: default 8788 is not <class 'float'>",
        "port: its parser gives <class 'int'>, the field is <class 'float'>",
        "name: no field", "extra: no setting"]
