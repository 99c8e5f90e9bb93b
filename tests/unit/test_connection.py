"""ConnectOptions: one name and one default per setting shared with the run file's BusConfig."""

from __future__ import annotations

import dataclasses

import pytest

from areal_async.config import BusConfig
from bus import ConnectOptions


def test_connect_options_defaults_equal_the_run_files_for_every_shared_setting() -> None:
    """A setting named alike in BusConfig and ConnectOptions has the same default, so a worker
    started from a run file and a script that builds ConnectOptions by hand behave alike."""
    config = {f.name: f.default for f in dataclasses.fields(BusConfig)}
    options = {f.name: f.default for f in dataclasses.fields(ConnectOptions)}
    shared = (set(config) & set(options)) - {"url"}  # "embedded" only means something to the launcher
    assert {"connect_timeout_s", "reconnect_wait_max_s", "token", "tls_ca"} <= shared
    assert {name: options[name] for name in shared} == {name: config[name] for name in shared}


@pytest.mark.parametrize(
    "name", ["connect_timeout_s", "reconnect_wait_min_s", "request_timeout_s", "drain_timeout_s"]
)
def test_a_non_positive_timeout_is_refused_naming_the_field(name: str) -> None:
    """Durations are seconds (``_s``) and must be positive; the error names the field."""
    with pytest.raises(ValueError, match=f"ConnectOptions.{name} must be > 0, got 0"):
        ConnectOptions(**{name: 0})


def test_a_backoff_ceiling_below_its_floor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"reconnect_wait_max_s \(0.1\) must be >= reconnect_wait_min_s"):
        ConnectOptions(reconnect_wait_min_s=0.5, reconnect_wait_max_s=0.1)
