"""A bad policy reads as one line naming each field, from ``@app.queue(...)`` as from
``[queues.NAME]`` in qcluster.toml (issue 15: bad values are refused with one clear line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from qcluster import App
from qcluster.config import load_settings
from qcluster.errors import ConfigError


@pytest.mark.parametrize("policy, expected", [
    ({"dead_max_age": float("nan")}, "queue 'x': dead_max_age: Input should be a finite number"),
    ({"bogus": 1}, "queue 'x': bogus: unknown key"),
    ({"batch_sise": 10}, "queue 'x': batch_sise: unknown key (did you mean 'batch_size'?)"),
    ({"priority": "high", "max_slots": -1},
     "queue 'x': priority: Input should be a valid integer, unable to parse string as an "
     "integer; max_slots: Input should be greater than or equal to 0"),
])
def test_a_bad_app_queue_policy_is_one_line_per_field(policy: dict[str, Any],
                                                      expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        App().queue("x", **policy)
    assert str(caught.value) == expected


def test_a_policy_wide_rule_names_the_policy_and_keeps_its_reason() -> None:
    with pytest.raises(ConfigError) as caught:
        App().queue("x", lock_timeout=5, batch_timeout=10)
    message = str(caught.value)
    assert message.startswith("queue 'x': policy: lock_timeout (5s) must be at least")
    assert "\n" not in message and "Value error" not in message


def test_the_config_file_names_the_queue_and_field_the_same_way(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text("[queues.mail]\ndead_max_age = 0.5\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert "queues.mail.dead_max_age: Input should be greater than or equal to 1" in str(
        caught.value)


def test_a_configuration_file_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    """It ended in a UnicodeDecodeError traceback (chaos row B4)."""
    config = tmp_path / "qcluster.toml"
    config.write_bytes(b"\xff\xfe = 1\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert str(caught.value) == f"{config}: not valid TOML: not UTF-8 (byte 0 is 0xff)"


@pytest.mark.parametrize("name", ["a b", "[x]", "-lead", "q{1}", ""])
def test_a_queue_section_outside_the_name_rule_is_refused(tmp_path: Path, name: str) -> None:
    """``[queues."a b"]`` was accepted and the manager and masters started (row B4)."""
    config = tmp_path / "qcluster.toml"
    config.write_text(f'[queues."{name}"]\npriority = 1\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert f'[queues."{name}"]: invalid queue name' in str(caught.value)


@pytest.mark.parametrize("secret, reason", [
    ("changeme", "well-known placeholder"), ("Xq7-short", "shorter than 16 characters")])
def test_a_weak_named_token_is_refused_without_repeating_it(
        tmp_path: Path, secret: str, reason: str) -> None:
    """``[tokens]`` names who changed a control (issue 19); a weak one is refused at start,
    and the message, which may reach a log, never holds the secret."""
    (tmp_path / "qcluster.toml").write_text(f'[tokens]\nops = "{secret}"\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(tmp_path / "qcluster.toml")
    message = str(caught.value)
    assert "[tokens] ops" in message and reason in message
    assert secret not in message


def test_named_tokens_come_from_the_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "qcluster.toml").write_text('[tokens]\nops = "0123456789abcdef0123"\n')
    assert load_settings(tmp_path / "qcluster.toml").tokens == {"ops": "0123456789abcdef0123"}
    monkeypatch.setenv("QCLUSTER_TOKENS", '{"ci": "fedcba9876543210fedc"}')
    assert load_settings(None).tokens == {"ci": "fedcba9876543210fedc"}


def test_a_misspelt_queue_section_is_logged_with_the_queue_meant(
        caplog: pytest.LogCaptureFixture) -> None:
    """[queues.emial] was ignored in silence: its max_attempts applied to nothing. Another
    app's queue in a shared file is not a mistake, and says nothing."""
    app = App("shop")
    app.queue("emails")(lambda jobs: None)
    with caplog.at_level("WARNING", logger="qcluster.app"):
        merged = app.with_overrides({"emial": {"max_attempts": 3}, "thumbnails": {"priority": 2},
                                     "emails": {"max_slots": 4}})
    assert [r.getMessage() for r in caplog.records] == [
        "[queues.emial] in the configuration: app 'shop' declares no such queue (did you "
        "mean emails?): its settings apply to no slot"]
    assert merged.queues["emails"].policy.max_slots == 4


@pytest.mark.parametrize("toml, says", [
    ("[queues.mail]\nbatch_sise = 10\n",
     "[queues.mail] has unknown key(s) ['batch_sise'] (did you mean 'batch_size'?)"),
    ("[manger]\ninterval = 2\n", "manger: unknown setting (did you mean 'manager'?)"),
    ("[master]\ngracefull_timeout_s = 2\n",
     "master.gracefull_timeout_s: unknown setting in [master] (did you mean "
     "'graceful_timeout_s'?)"),
    ('brokr_url = "redis://x"\n', "brokr_url: unknown setting (did you mean 'broker_url'?)"),
    ("[queues.mail]\nzzzz = 1\n", "['zzzz']; allowed: ['batch_size', "),
])
def test_a_misspelt_setting_names_the_one_it_misses(tmp_path: Path, toml: str,
                                                    says: str) -> None:
    """A typo read 'Extra inputs are not permitted', or listed every policy key, and left
    the user to find which one they meant."""
    config = tmp_path / "qcluster.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert says in str(caught.value)


def test_size_by_wait_in_the_config_takes_the_target_wait_from_the_code(tmp_path: Path) -> None:
    """[queues.NAME] size_by = "wait" was refused unless the same table set a
    target_wait, even for a queue whose @app.queue has one; a queue without any is still
    refused, in one line, once the app is loaded."""
    config = tmp_path / "qcluster.toml"
    config.write_text('[queues.mail]\nsize_by = "wait"\n[queues.bulk]\nsize_by = "wait"\n')
    settings = load_settings(config)
    app = App()
    app.queue("mail", target_wait=30)(lambda jobs: None)
    app.queue("bulk")(lambda jobs: None)
    with pytest.raises(ConfigError) as caught:
        app.with_overrides(settings.queues)
    message = str(caught.value)
    assert message.startswith('[queues.bulk] in the configuration: policy: size_by = "wait" '
                              "needs a target_wait"), message
    assert "\n" not in message
    del settings.queues["bulk"]
    assert app.with_overrides(settings.queues).spec("mail").policy.size_by == "wait"
