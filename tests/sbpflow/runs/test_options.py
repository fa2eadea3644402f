"""RunOptions: one definition of how a job runs — validated with errors that name the field, the value and
the fix; mirrored field for field by service.proto's RunOptions; the defaults each context starts from."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sbpflow.codec import run_options, wire
from sbpflow.runs.options import BACKEND_NAMES, FIELD_NAMES, MANAGER_DEFAULTS, RunOptions, RunOptionsError
from sbpflow.v1 import service_pb2 as sp


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"backend": "slurm"}, "backend='slurm': use one of ('ray', 'inprocess')"),
        ({"ray_address": " "}, "ray_address=' ': give host:port or auto"),
        ({"timeout": 0.0}, "timeout=0.0: give a finite number of seconds greater than 0"),
        ({"timeout": -5}, "timeout=-5: give a finite number"),
        ({"timeout": math.inf}, "timeout=inf: give a finite number"),
        ({"timeout": math.nan}, "timeout=nan: give a finite number"),
        ({"timeout": "60"}, "timeout='60': give a number of seconds"),
        ({"max_restarts": -1}, "max_restarts=-1: give 0 (never restart) or more"),
        ({"max_restarts": 1.5}, "max_restarts=1.5: give a whole number"),
        ({"trace": "yes"}, "trace='yes': give True or False"),
        ({"return_parameters": 1}, "return_parameters=1: give True or False"),
    ],
)
def test_a_bad_value_names_the_field_the_value_and_the_fix(changes: dict[str, object], message: str) -> None:
    with pytest.raises(RunOptionsError) as e:
        RunOptions(**changes)  # type: ignore[arg-type]
    assert message in str(e.value)
    (name,) = changes
    assert (e.value.field, e.value.value) == (name, changes[name]) or math.isnan(e.value.value)


def test_options_are_frozen_and_replace_validates_again() -> None:
    o = RunOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.timeout = 1.0  # type: ignore[misc]
    assert o.replace(max_restarts=2).max_restarts == 2
    with pytest.raises(RunOptionsError, match="max_restarts=-2"):
        o.replace(max_restarts=-2)
    with pytest.raises(Exception, match=r"no field\(s\) \['steps'\]"):
        o.replace(steps=3)


def test_every_field_has_help_text() -> None:
    for f in dataclasses.fields(RunOptions):
        assert f.metadata["help"].strip(), f.name


def test_the_backend_names_are_the_launchers_backends() -> None:
    from sbpflow.control_plane.launch.launcher import BACKENDS

    assert BACKEND_NAMES == tuple(BACKENDS)


def test_the_defaults_of_each_context_are_todays() -> None:
    from sbpflow.control_plane.service.jobs import ManagerConfig
    from sbpflow.control_plane.service.server import ServerConfig

    assert (RunOptions().timeout, RunOptions().return_parameters) == (600.0, False)  # sf.run's
    manager = ManagerConfig().run
    assert (manager.timeout, manager.return_parameters) == (24 * 3600.0, True)
    assert (manager.backend, manager.ray_address, manager.trace, manager.max_restarts) == (
        "ray",
        None,
        False,
        0,
    )
    assert ServerConfig().run == manager == MANAGER_DEFAULTS
    assert (ManagerConfig().slots, ManagerConfig().checkpoint_root, ServerConfig().checkpoint_root) == (
        None,
    ) * 3


# ---- the wire ---------------------------------------------------------------------------------


def test_the_message_has_the_dataclass_fields() -> None:
    assert {f.name for f in sp.RunOptions.DESCRIPTOR.fields} == set(FIELD_NAMES)
    assert all(f.has_presence for f in sp.RunOptions.DESCRIPTOR.fields)  # unset = the reader's default


@pytest.mark.parametrize(
    "options",
    [
        RunOptions(),
        MANAGER_DEFAULTS,
        RunOptions(backend="inprocess", ray_address="10.0.0.1:6379", timeout=1.5, max_restarts=3, trace=True),
    ],
)
def test_round_trip(options: RunOptions) -> None:
    m = run_options.run_options_to_proto(options)
    back = sp.RunOptions.FromString(m.SerializeToString())
    assert run_options.run_options_from_proto(back) == options
    assert run_options.run_options_from_proto(back, base=MANAGER_DEFAULTS) == options  # every field is set


def test_unset_fields_come_from_the_base() -> None:
    got = run_options.run_options_from_proto(sp.RunOptions(max_restarts=1), base=MANAGER_DEFAULTS)
    assert got == MANAGER_DEFAULTS.replace(max_restarts=1)
    assert run_options.run_options_from_proto(sp.RunOptions()) == RunOptions()


@pytest.mark.parametrize(
    ("m", "message"),
    [
        (sp.RunOptions(backend=""), "RunOptions.backend='': use one of"),
        (sp.RunOptions(timeout=math.nan), "RunOptions.timeout=nan"),
        (sp.RunOptions(timeout=-1), "RunOptions.timeout=-1.0"),
        (sp.RunOptions(max_restarts=-3), "RunOptions.max_restarts=-3"),
    ],
)
def test_a_bad_message_is_a_wire_error_naming_the_field(m: sp.RunOptions, message: str) -> None:
    with pytest.raises(wire.WireError) as e:
        run_options.run_options_from_proto(m)
    assert message in str(e.value)
