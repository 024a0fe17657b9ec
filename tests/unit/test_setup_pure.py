"""Pure parts of the newcomer's path: the cluster identity's refusal, the one-time logins,
the session's form field, one-line configuration errors and the local token file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.cluster_identity import mismatch
from qcluster.config import load_settings
from qcluster.errors import ConfigError
from qcluster.local_token import ensure_local_token, read_local_token
from qcluster.manager.api.login import CODE_TTL_S, SESSION_TTL_S, Logins, _same_origin, form_field
from qcluster.messages import ClusterClaim

ids = st.text(alphabet="0123456789abcdef", min_size=8, max_size=64)
urls = st.text(min_size=1, max_size=80)


@given(ids, urls, urls)
def test_the_same_cluster_is_never_refused(identity: str, one: str, other: str) -> None:
    assert mismatch(ClusterClaim(id=identity, broker=one), ClusterClaim(id=identity, broker=other),
                    who="master a") is None


@given(ids, ids, urls, urls)
def test_another_cluster_is_refused_in_one_line_naming_both_brokers(
        mine: str, theirs: str, my_url: str, their_url: str) -> None:
    refusal = mismatch(ClusterClaim(id=mine, broker=my_url),
                       ClusterClaim(id=theirs, broker=their_url), who="master a")
    if mine == theirs:
        assert refusal is None
    else:
        assert refusal is not None and my_url in refusal and their_url in refusal
        assert refusal.startswith("master a uses the broker ")


def test_an_unknown_side_is_not_refused() -> None:
    claim = ClusterClaim(id="0123456789abcdef", broker="redis://x")
    assert mismatch(None, claim, who="m") is None and mismatch(claim, None, who="m") is None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_login_code_opens_one_session_once_and_expires() -> None:
    clock = Clock()
    logins = Logins(clock)
    code = logins.mint("the-secret-token-value")
    session = logins.spend(code)
    assert session is not None and logins.secret(session) == "the-secret-token-value"
    assert "the-secret-token-value" not in session
    assert logins.spend(code) is None  # once
    late = logins.mint("the-secret-token-value")
    clock.now += CODE_TTL_S + 1
    assert logins.spend(late) is None
    clock.now += SESSION_TTL_S
    assert logins.secret(session) is None


@given(st.text(max_size=40),
       st.lists(st.tuples(st.text("abcdefgh_", min_size=1, max_size=8), st.text(max_size=8)),
                max_size=4))
def test_the_session_field_is_found_among_others(value: str,
                                                 others: list[tuple[str, str]]) -> None:
    body = urlencode([*others, ("session", value), ("session", "a later one")]).encode()
    assert form_field(body, "session") == (value or "a later one")  # a blank one is none


@pytest.mark.parametrize(("origin", "same"), [
    (None, True), ("http://127.0.0.1:7300", True), ("http://evil.example", False),
    ("http://127.0.0.1:7301", False), ("null", False),
])
def test_a_state_change_from_another_origin_gets_no_session(origin: str | None,
                                                            same: bool) -> None:
    headers = {"host": "127.0.0.1:7300", **({"origin": origin} if origin else {})}
    assert _same_origin(headers) is same


@given(st.text(max_size=60))
def test_a_malformed_tokens_variable_is_one_line_and_never_repeated(
        value: str) -> None:
    if "\0" in value:
        return  # no environment variable can hold it
    os.environ["QCLUSTER_TOKENS"] = value
    try:
        load_settings(None)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and "QCLUSTER_TOKENS" in message
        # the value is never shown: either the fixed "not valid JSON" line, or each
        # field's reason with "a secret, not shown" in place of what was given
        assert message.startswith("invalid configuration: QCLUSTER_TOKENS is not valid JSON"
                                  ) or "(got a secret, not shown)" in message
    finally:
        del os.environ["QCLUSTER_TOKENS"]


def test_an_invalid_environment_value_is_one_line_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QCLUSTER_MANAGER", json.dumps({"interval_s": "x", "window_s": -1}))
    with pytest.raises(ConfigError) as caught:
        load_settings(None)
    message = str(caught.value)
    assert "\n" not in message and "QCLUSTER_MANAGER" in message
    assert "manager.interval_s" in message and "manager.window_s" in message


def test_the_local_token_is_written_once_for_this_user_alone(tmp_path: Path) -> None:
    token = ensure_local_token(tmp_path / "state")
    path = tmp_path / "state" / "token"
    assert len(token) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert ensure_local_token(tmp_path / "state") == token == read_local_token(tmp_path / "state")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="not this user's alone"):
        read_local_token(tmp_path / "state")
    assert read_local_token(tmp_path / "none") is None


def test_the_local_tokens_directory_is_made_private(tmp_path: Path) -> None:
    ensure_local_token(tmp_path / "made" / "state")
    assert (tmp_path / "made" / "state").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_token_directory_others_may_write_in_is_refused(tmp_path: Path, mode: int) -> None:
    # another user could swap the file there (a symlink loop: no control works any more)
    state = tmp_path / "state"
    ensure_local_token(state)
    state.chmod(mode)
    for call in (ensure_local_token, read_local_token):
        with pytest.raises(ConfigError, match=r"local token's directory .* is writable by others"):
            call(state)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_token_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ensure_local_token(state)
    os.chown(state, 65534, 65534)
    with pytest.raises(ConfigError, match=r"local token's directory .* belongs to uid 65534"):
        ensure_local_token(state)


def test_a_misspelt_variable_is_named_with_the_setting_meant() -> None:
    from qcluster.cli_support import warn_misspelt_variables

    said = warn_misspelt_variables({"QCLUSTER_BROKER": "redis://x", "QCLUSTER_TOKN": "t",
                                    "QCLUSTER_REDIS_PASSWORD": "p", "QCLUSTER_TOKEN": "t",
                                    "QCLUSTER_TEST_REDIS_URL": "u", "HOME": "/"})
    assert said == [
        "warning: QCLUSTER_BROKER is not a qcluster setting (did you mean QCLUSTER_BROKER_URL?):"
        " it is ignored",
        "warning: QCLUSTER_TOKN is not a qcluster setting (did you mean QCLUSTER_TOKEN?): it is"
        " ignored"]
