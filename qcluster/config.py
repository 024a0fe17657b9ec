"""Settings for every role, loaded in one place.

Sources, highest first: explicit arguments (CLI flags) > ``QCLUSTER_*`` environment
variables > ``qcluster.toml`` (``--config`` or ``QCLUSTER_CONFIG``; ``./qcluster.toml``
if present) > defaults. Errors name the file, the field and what was expected, and
nothing is started.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from qcluster.broker.urls import AMQP_SCHEMES, join_urls, split_urls
from qcluster.errors import ConfigError, InvalidQueueName, field_reasons
from qcluster.names import check_queue_name, closest
from qcluster.policy import QueuePolicy
from qcluster.security import check_token_strength

DEFAULT_CONFIG_FILE = "qcluster.toml"


class MasterSettings(BaseModel):
    """``[master]``: per-host limits. Nothing here is required: the host is sized from
    memory, load and cgroups."""

    model_config = ConfigDict(extra="forbid")

    reserve_mb: float = Field(512.0, ge=0)
    """Memory left to the OS and other programs when sizing the host, MiB."""
    slot_pss_estimate_mb: float = Field(64.0, gt=0)
    """Assumed PSS of one slot before any slot has been measured, MiB."""
    max_load_per_cpu: float = Field(4.0, gt=0)
    """Capacity is capped at max_load_per_cpu * cpus when load is that high."""
    max_slots: int = Field(256, ge=1, le=100_000)
    """Hard cap on slots on one host, whatever memory says."""
    report_interval_s: float = Field(2.0, gt=0, le=60)
    """Seconds between reports to the manager (at most 60: a silent host must expire)."""
    heartbeat_timeout_s: float = Field(30.0, gt=0)
    """A slot silent for this long (not inside a batch) is killed as hung."""
    memory_kill_factor: float = Field(2.0, gt=1)
    """Kill a slot whose Private_Dirty passes this multiple of its recycle limit."""
    graceful_timeout_s: float = Field(60.0, gt=0)
    """On shutdown, seconds slots get to finish their batch before SIGKILL."""


class ManagerSettings(BaseModel):
    """``[manager]``: the planner and its HTTP server."""

    model_config = ConfigDict(extra="forbid")

    listen: str = "127.0.0.1:7300"
    interval_s: float = Field(2.0, gt=0, le=60)
    """Seconds between planning rounds (also the masters' report interval: at most 60)."""
    window_s: float = Field(60.0, gt=0)
    """Sliding window of statistics the planner looks at."""
    host_expiry_intervals: int = Field(3, ge=1)
    """A host that missed this many report intervals is dead."""
    target_utilization: float = Field(0.8, gt=0, le=1)
    decisions_kept: int = Field(500, ge=10)
    record: Path | None = None
    """Append what the manager observes each round to this file (JSON Lines, a trace
    ``qcluster simulate`` replays; see docs/manager.md)."""
    record_max_mb: float = Field(1024.0, gt=0)
    """A recording past this size moves to FILE.1 (replacing an older one); a new one starts."""


#: Where masters report and the commands find the manager when no manager_url is set: the
#: manager's own default listen address, so one machine needs no setting.
DEFAULT_MANAGER_URL = "http://127.0.0.1:7300"


class Settings(BaseSettings):
    """Everything a qcluster process may be configured with."""

    model_config = SettingsConfigDict(env_prefix="QCLUSTER_", extra="forbid")

    broker_url: str | None = None
    """Broker URL(s); several RabbitMQ URLs separated by ';' fail over. None: embedded."""
    queue_type: Literal["classic", "quorum"] | None = None
    """RabbitMQ: the type of every queue (a queue's policy ``queue_type`` wins); added to an
    ``amqp://`` broker_url as ``?queue_type=`` unless the URL has one. Ignored by Redis."""
    app: str | None = None
    """Application module (``MODULE`` or ``MODULE:ATTR``)."""
    state_dir: Path = Path(".qcluster")
    """Where the embedded broker keeps its socket and data."""
    manager_url: str | None = None
    """Where masters report (e.g. http://127.0.0.1:7300)."""
    token: str | None = None
    """Required by every mutating HTTP endpoint (401 without it)."""
    tokens: dict[str, str] = Field(default_factory=dict)
    """``[tokens]`` NAME = "SECRET" (env: QCLUSTER_TOKENS as a JSON object): more tokens the
    manager accepts for state changes, each shown by its NAME (never its value) as who
    paused or drained; the unnamed ``token`` shows as "token"."""
    metrics_dir: Path | None = None
    """prometheus_client multiprocess directory; default: /dev/shm when usable."""
    queues: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """``[queues.NAME]``: QueuePolicy overrides, keyed by QueuePolicy field names."""
    periodic: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """``[periodic.NAME]``: periodic jobs the manager enqueues (``queue``, ``cron`` or
    ``every``, ``payload``, ``catch_up``, ``missed_after``); keys given for a NAME the app
    declares with ``@app.periodic`` replace the app's. Checked where the app's declarations
    are known too, at the manager's start (qcluster.manager.planning.periodic.configured_jobs)."""
    master: MasterSettings = Field(default_factory=lambda: MasterSettings.model_validate({}))
    manager: ManagerSettings = Field(default_factory=lambda: ManagerSettings.model_validate({}))

    @model_validator(mode="after")
    def _queue_type_in_the_url(self) -> Settings:
        """Every process gets the broker through its URL: the global queue type rides in it."""
        entries = split_urls(self.broker_url or "")
        if (self.queue_type and entries and entries[0].startswith(AMQP_SCHEMES)
                and not any("queue_type=" in one for one in entries)):
            self.broker_url = join_urls([
                f"{one}{'&' if '?' in one else '?'}queue_type={self.queue_type}"
                for one in entries])
        return self

    @field_validator("tokens")
    @classmethod
    def _named_tokens_are_strong(cls, value: dict[str, str]) -> dict[str, str]:
        for name, secret in value.items():
            if name == "token":  # the unnamed `token` is shown by that name: it would win
                raise ValueError('[tokens] name "token" is the unnamed `token`\'s: set '
                                 "`token` itself, or give this one another name")
            if not name.strip() or not name.isprintable() or len(name) > 64:
                raise ValueError(f"[tokens] name {json.dumps(name)}: 1 to 64 printable "
                                 "characters, it is shown on the admin page")
            try:
                check_token_strength(secret)
            except ConfigError as exc:
                raise ValueError(f"[tokens] {name}: {exc}") from None
        return value

    @field_validator("queues")
    @classmethod
    def _known_policy_keys(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        allowed = set(QueuePolicy.model_fields)
        for name, overrides in value.items():
            try:
                check_queue_name(name)
            except InvalidQueueName as exc:
                raise ValueError(f"[queues.{json.dumps(name)}]: {exc}") from None
            unknown = sorted(set(overrides) - allowed)
            if unknown:
                raise ValueError(f"[queues.{name}] has unknown key(s) {unknown}"
                                 + _did_you_mean(unknown, allowed))
            _check_overrides(name, overrides)
        return value

    _toml_file: Path | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        return tuple(sources)


def _check_overrides(queue: str, overrides: dict[str, Any]) -> None:
    """Validate ``[queues.NAME]`` against the policy rules now, not at the first planning
    round: a pair such as lock_timeout 5 / batch_timeout 10 is refused at start."""
    checked = dict(overrides)
    if checked.get("size_by") == "wait" and "target_wait" not in checked:
        # Its target_wait may be the code's (@app.queue): checked once merged with it,
        # where the app is loaded (App.with_overrides).
        checked["size_by"] = "utilization"
    try:
        QueuePolicy.model_validate(checked)
    except ValidationError as exc:
        raise ValueError(field_reasons(exc.errors(), prefix=f"queues.{queue}.",
                                       whole="/".join(sorted(overrides)))) from None


def _reason(message: str) -> str:
    return message.removeprefix("Value error, ")


def _did_you_mean(unknown: list[str], allowed: set[str]) -> str:
    """``' (did you mean 'x'?)'`` for a misspelt key, else the keys allowed."""
    like = [found for key in unknown if (found := closest(key, allowed)) is not None]
    if like:
        return f" (did you mean {', '.join(map(repr, like))}?)"
    return f"; allowed: {sorted(allowed)}"


def _unknown_setting(loc: tuple[Any, ...]) -> str:
    """Why an extra key is refused, with the closest setting of its section."""
    model: Any = Settings
    for part in loc[:-1]:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        model = field.annotation if field is not None else None
    if not hasattr(model, "model_fields"):
        return "unknown setting"
    section = f" in [{'.'.join(map(str, loc[:-1]))}]" if len(loc) > 1 else ""
    like = closest(str(loc[-1]), model.model_fields)
    hint = f" (did you mean {like!r}?)" if like else ""
    return f"unknown setting{section}{hint}"


def resolve_config_path(explicit: str | Path | None) -> Path | None:
    """``--config`` > ``QCLUSTER_CONFIG`` > ``./qcluster.toml`` if it exists."""
    if explicit:
        path = Path(explicit)
    elif os.environ.get("QCLUSTER_CONFIG"):
        path = Path(os.environ["QCLUSTER_CONFIG"])
    else:
        default = Path(DEFAULT_CONFIG_FILE)
        return default if default.is_file() else None
    if path.is_dir():
        raise ConfigError(f"configuration file {str(path)!r} is a folder: give the "
                          "qcluster.toml file in it")
    if not path.is_file():
        raise ConfigError(f"configuration file {str(path)!r} does not exist")
    return path


def load_settings(config: str | Path | None = None, **overrides: Any) -> Settings:
    """Load and validate settings; raise :class:`ConfigError` naming file and field.

    ``overrides`` are explicit values (CLI flags); ``None`` values are ignored.
    """
    path = resolve_config_path(config)
    if path is not None:
        _check_toml_syntax(path)
    explicit = {key: value for key, value in overrides.items() if value is not None}
    Settings._toml_file = path
    try:
        return Settings(**explicit)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    except SettingsError as exc:  # an environment variable that is not JSON where JSON is due
        raise ConfigError(_describe_unparsable(exc)) from None
    finally:
        Settings._toml_file = None


def _check_toml_syntax(path: Path) -> None:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:  # TOML is UTF-8: say where it is not, no traceback
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 (byte {exc.start} is "
                          f"0x{exc.object[exc.start]:02x})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: {exc.strerror}") from None
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


#: Settings whose values an error message never repeats (it may reach a log).
SECRET_FIELDS = frozenset({"token", "tokens"})


def _describe(exc: ValidationError, path: Path | None) -> str:
    """One line: where, then each bad field with its reason (``; ``-separated)."""
    problems = []
    for error in exc.errors():
        loc = error.get("loc", ())
        field = ".".join(str(p) for p in loc) or "(root)"
        got = "a secret, not shown" if loc and loc[0] in SECRET_FIELDS else repr(error.get("input"))
        reason = (_unknown_setting(loc) if error.get("type") == "extra_forbidden"
                  else _reason(error.get("msg", "")))
        problems.append(f"{field}{_field_source(loc)}: {reason} (got {got})")
    where = str(path) if path else "settings (environment / flags)"
    return f"invalid configuration in {where}: " + "; ".join(problems)


def _field_source(loc: tuple[Any, ...]) -> str:
    """`` (QCLUSTER_X)`` when the environment sets the field's top-level variable: the user
    reads which variable to fix, not only the field's name."""
    if not loc:
        return ""
    variable = f"QCLUSTER_{str(loc[0]).upper()}"
    return f" (from {variable})" if variable in os.environ else ""


def _describe_unparsable(exc: SettingsError) -> str:
    """pydantic-settings' 'error parsing value for field "tokens" from source ...' as the
    variable to fix and what it must hold (its value is never repeated: it may be secret)."""
    field = str(exc).partition('field "')[2].partition('"')[0] or "?"
    variable = f"QCLUSTER_{field.upper()}"
    return (f"invalid configuration: {variable} is not valid JSON (it must be a JSON "
            f"{'object' if field in DICT_FIELDS else 'value'}, e.g. "
            f"{DICT_FIELDS.get(field, '...')})")


#: The settings an environment variable gives as a JSON object, with an example each.
DICT_FIELDS = {
    "tokens": """'{"ops": "SECRET"}'""",
    "queues": """'{"emails": {"batch_size": 10}}'""",
    "periodic": """'{"nightly": {"queue": "reports", "cron": "0 3 * * *"}}'""",
    "master": """'{"max_slots": 16}'""",
    "manager": """'{"interval_s": 2}'""",
}
