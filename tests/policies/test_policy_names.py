"""Policy names by mechanism, and the alias period for the names they had before."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from gateway.config import Settings
from gateway.policies.registry import (
    ALL_NAMES,
    DEPRECATED_NAMES,
    LIVE_NAMES,
    ORACLE_NAMES,
    get_policy,
    resolve_name,
)
from rollout_gateway.cli import app


def test_every_old_name_maps_to_a_current_one_of_the_same_kind() -> None:
    assert set(DEPRECATED_NAMES.values()) <= set(ALL_NAMES)
    assert not set(DEPRECATED_NAMES) & set(ALL_NAMES)  # the old names are gone from the lists
    for old, new in DEPRECATED_NAMES.items():
        assert (old.endswith("-perfect")) == (new in ORACLE_NAMES)


def test_an_old_name_is_resolved_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    warned: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="gateway.policies.registry"):
        assert resolve_name("ours-lane", warned=warned) == "straggler-lane"
        assert resolve_name("ours-lane", warned=warned) == "straggler-lane"
        assert resolve_name("straggler-lane", warned=warned) == "straggler-lane"
    deprecations = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert deprecations == ["policy name 'ours-lane' is deprecated; use 'straggler-lane' "
                            "(the old name will be removed)"]


@pytest.mark.parametrize(("old", "new"), [("ours", "progressive"),
                                          ("ours-lane", "straggler-lane")])
def test_old_names_still_build_and_configure_the_new_policy(old: str, new: str) -> None:
    assert get_policy(old).name == new
    assert Settings(policy=old).policy == new
    assert new in LIVE_NAMES


def test_the_cli_resolves_an_old_name_before_checking_it() -> None:
    res = CliRunner().invoke(app, ["bench", "live", "--policy", "ours-lane-perfect"])
    assert res.exit_code == 2 and "'straggler-lane-oracle' cannot run live" in res.output
