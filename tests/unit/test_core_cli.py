"""The core CLI registers the roles' commands from their entry points, and the knowledge the
roles share is defined once in the core (issue 18 items 3 and 4)."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import typer
from typer.testing import CliRunner

from qcluster import cli, cli_support, exitcodes, metrics
from qcluster.errors import ConfigError
from qcluster.procfs import total_pss_bytes

ROLE_COMMANDS = {"master", "manager", "slot", "simulate", "demo"}


def registered() -> list[str]:
    return [str(info.name or getattr(info.callback, "__name__", "?"))
            for info in cli.cli.registered_commands]


def test_every_role_command_is_an_entry_point_of_the_installed_package() -> None:
    points = {p.name: p.value for p in entry_points(group=cli.COMMANDS_GROUP)}
    assert set(points) >= ROLE_COMMANDS
    assert all(value.startswith("qcluster.") for value in points.values())


def test_registering_twice_adds_each_command_once() -> None:
    cli.register_commands()
    cli.register_commands()
    names = registered()
    assert set(names) >= ROLE_COMMANDS
    assert len(names) == len(set(names))
    result = CliRunner().invoke(cli.cli, ["--help"])
    assert result.exit_code == 0
    for name in (*ROLE_COMMANDS, "enqueue", "stats", "dead"):
        assert f" {name} " in result.output


def test_the_slot_command_keeps_its_options() -> None:
    cli.register_commands()
    result = CliRunner().invoke(cli.cli, ["slot", "--help"])
    assert result.exit_code == 0
    for option in ("--queue", "--app", "--burst", "--config", "--broker", "--log-level"):
        assert option in result.output


def test_an_expected_error_becomes_one_line_and_its_exit_code() -> None:
    with pytest.raises(typer.Exit) as caught, cli_support.user_errors():
        raise ConfigError("bad")
    assert caught.value.exit_code == exitcodes.CONFIG


def test_total_pss_is_the_master_plus_its_slots() -> None:
    assert total_pss_bytes(100, [10, 20, 30]) == 160
    assert total_pss_bytes(100, ()) == 100


def test_metric_names_are_defined_once_with_their_help() -> None:
    assert (*metrics.MANAGER_QUEUE_GAUGES, *metrics.MANAGER_GAUGES) == metrics.MANAGER_METRICS
    assert tuple(metrics.MASTER_METRICS_HELP) == metrics.MASTER_METRICS
    every = [*metrics.SLOT_METRICS, *metrics.MASTER_METRICS, *metrics.MANAGER_METRICS]
    assert len(every) == len(set(every))
    assert all(name.startswith("qcluster_") for name in every)
    slot = metrics.slot_metrics()
    created = {metric._name for metric in vars(slot).values()}
    # prometheus_client keeps a counter's name without its _total suffix
    assert {name.removesuffix("_total") for name in metrics.SLOT_METRICS} == created


@pytest.mark.parametrize("args, says", [
    (["--help"], "with each one's reason and last error, or requeue or delete them"),
    (["enqueue", "--help"], "a queue it does not declare is refused (exit 2"),
])
def test_help_reads_a_docstring_as_sentences_not_its_source_lines(
        args: list[str], says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each docstring line break was kept: `qcluster --help` broke 'each one's' from
    'reason' mid-line, whatever the terminal's width."""
    monkeypatch.setenv("COLUMNS", "250")
    cli.register_commands()
    result = CliRunner().invoke(cli.cli, args, terminal_width=250)
    assert result.exit_code == 0, result.output
    assert any(says in line for line in result.output.splitlines()), result.output
