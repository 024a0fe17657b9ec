"""Which commands take ``--broker`` and ``--config``, as docs/reference.md ("Command line")
lists them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qcluster.cli import cli, register_commands

BOTH = ["enqueue", "stats", "dead", "job", "purge", "slot", "master", "manager"]


def options(command: str) -> str:
    register_commands()
    result = CliRunner().invoke(cli, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", BOTH)
def test_the_broker_commands_take_broker_and_config(command: str) -> None:
    said = options(command)
    assert "--broker" in said and "--config" in said


def test_simulate_takes_config_only_and_demo_neither() -> None:
    simulate, demo = options("simulate"), options("demo")
    assert "--config" in simulate and "--broker" not in simulate
    assert "--config" not in demo and "--broker" not in demo and "--state-dir" in demo
